"""Grant+release pairs per second and their latency through the REST API, SQLite and PostgreSQL.

Starts a real controller process, registers a simulated node with enough room that no
request queues, then runs N concurrent clients that each create a lease and release it,
as fast as they can, for a fixed time. Writes bench/results/controller_throughput.json.

    python bench/controller_throughput.py                      # both databases, 1/16/64 clients
    python bench/controller_throughput.py --db sqlite --clients 16 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

from _http import HttpConnection

from gpupool.protocol.v1.tokens import new_token

RESULTS = Path(__file__).resolve().parent / "results" / "controller_throughput.json"
PG_ADMIN = os.environ.get("GPUPOOL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")



# The controllers a benchmark starts install this admin token ($GPUPOOL_ADMIN_TOKEN), and every
# client it starts or makes sends it ($GPUPOOL_TOKEN).
os.environ.setdefault("GPUPOOL_ADMIN_TOKEN", new_token()[2])
os.environ.setdefault("GPUPOOL_TOKEN", os.environ["GPUPOOL_ADMIN_TOKEN"])
AUTH = {"Authorization": f"Bearer {os.environ['GPUPOOL_TOKEN']}"}

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_pg_database() -> tuple[str, str]:
    import psycopg

    name = f"gpupool_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0]
    return name, f"{base}/{name}"


def drop_pg_database(name: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_controller(port: int, data_dir: str, db_url: str | None) -> subprocess.Popen[bytes]:
    code = (
        "from pathlib import Path;"
        "from gpupool.controller.settings import ControllerSettings;"
        "from gpupool.controller.server import serve;"
        f"serve(ControllerSettings(port={port}, data_dir=Path({data_dir!r}), db_url={db_url!r}))"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)


async def wait_ready(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = HttpConnection("127.0.0.1", port, headers=AUTH)
            await conn.connect()
            status, _ = await conn.request("GET", "/api/v1/health")
            await conn.close()
            if status == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("controller did not start")


async def register_node(port: int, gpus: int) -> None:
    conn = HttpConnection("127.0.0.1", port, headers=AUTH)
    await conn.connect()
    body = {
        "name": "bench-node",
        "backend": "fake",
        "gpus": [
            {
                "uuid": f"GPU-sim-bench-{i}",
                "index": i,
                "model": "H100-80GB (simulated)",
                "memory_mib": 81920,
                "simulated": True,
            }
            for i in range(gpus)
        ],
    }
    status, data = await conn.request("POST", "/api/v1/nodes", body)
    await conn.close()
    if status != 201:
        raise RuntimeError(f"register failed: {status} {data}")


async def heartbeat_node(port: int, stop: asyncio.Event) -> None:
    """Be the bench node's agent: a node that stops heartbeating goes down and takes no leases."""
    conn = HttpConnection("127.0.0.1", port, headers=AUTH)
    await conn.connect()
    try:
        while not stop.is_set():
            await conn.request("POST", "/api/v1/nodes/bench-node/heartbeat", {})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=2.0)
    finally:
        await conn.close()


async def client_loop(port: int, stop_at: float, pair_ms: list[float], errors: list[str]) -> None:
    conn = HttpConnection("127.0.0.1", port, headers=AUTH)
    await conn.connect()
    body = {"compute_pct": 10, "memory": "1GiB", "holder": "bench"}
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status, lease = await conn.request("POST", "/api/v1/leases", body)
            if status != 201 or lease["state"] != "granted":
                errors.append(f"create {status} {lease}")
                continue
            status, out = await conn.request("DELETE", f"/api/v1/leases/{lease['id']}")
            if status != 200 or out["state"] != "released":
                errors.append(f"release {status} {out}")
                continue
            pair_ms.append((time.perf_counter() - t0) * 1000)
    finally:
        await conn.close()


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1))))
    return ordered[k]


async def measure(port: int, clients: int, seconds: float) -> dict[str, float | int]:
    stop = asyncio.Event()
    beats = asyncio.create_task(heartbeat_node(port, stop))
    try:
        return await _measure(port, clients, seconds)
    finally:
        stop.set()
        await beats


async def _measure(port: int, clients: int, seconds: float) -> dict[str, float | int]:
    # Warm-up: connections, caches, and the controller's first queries.
    warm: list[float] = []
    await asyncio.gather(
        *(client_loop(port, time.perf_counter() + 1.0, warm, []) for _ in range(min(clients, 4)))
    )
    pair_ms: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    stop_at = start + seconds
    await asyncio.gather(*(client_loop(port, stop_at, pair_ms, errors) for _ in range(clients)))
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    return {
        "clients": clients,
        "pairs": len(pair_ms),
        "pairs_per_s": round(len(pair_ms) / elapsed, 1),
        "p50_ms": round(statistics.median(pair_ms), 2),
        "p99_ms": round(percentile(pair_ms, 99), 2),
        "seconds": round(elapsed, 2),
    }


def run_db(db: str, client_counts: list[int], seconds: float) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    pg_name = None
    with tempfile.TemporaryDirectory() as data_dir:
        db_url = None
        if db == "postgresql":
            pg_name, db_url = make_pg_database()
        port = free_port()
        proc = start_controller(port, data_dir, db_url)
        try:
            asyncio.run(wait_ready(port))
            asyncio.run(register_node(port, gpus=max(client_counts)))
            for clients in client_counts:
                result = asyncio.run(measure(port, clients, seconds))
                row = {"db": db, **result}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            proc.terminate()
            proc.wait(timeout=15)
            if pg_name:
                drop_pg_database(pg_name)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    dbs = ["sqlite", "postgresql"] if args.db == "both" else [args.db]
    rows: list[dict[str, object]] = []
    for db in dbs:
        rows.extend(run_db(db, counts, args.seconds))
    machine = (
        f"{platform.node()}: {os.cpu_count()} cores, "
        f"{platform.python_implementation()} {platform.python_version()}"
    )
    for row in rows:
        row["machine"] = machine
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
