"""Load on one controller: 1,000 clients heartbeating their leases and 200 lease requests a second.

Starts a real controller process (SQLite by default, `--db postgresql://...` or `--db pg` for a
fresh PostgreSQL database), registers a simulated node big enough that no request queues, and
plays its agent. Then:

- `--clients` holders each take a lease and renew it every `--heartbeat-s` seconds (spread
  evenly, so 1,000 holders at 5 s are 200 heartbeats a second), as `gpupool run` does;
- `--rate` lease requests a second arrive on a fixed schedule (open loop: a slow answer does not
  slow the arrivals, so latency is not hidden), each created and then released by its holder.

It runs for `--seconds` (default 600) and writes bench/results/load.json: errors per kind (any
answer that is not a success, any failure to connect, any held lease the controller ended; there
must be none), latency percentiles p50/p90/p99/max per request kind (`latency_ms` as the client
sees it, a wait for a free pooled connection included; `on_the_wire_ms` from a free connection
to the answer), the rates achieved against the rates asked for, how late the generator started
requests against its schedule, and the CPU each process used. A generator that falls behind its
schedule measures itself, not the controller: the report says so (`generator_kept_up`).

Requests go over `--connections` keep-alive connections of the small HTTP/1.1 client in
bench/_http.py; see `Connections` for why not httpx.

    python bench/load.py                          # 600 s on SQLite
    python bench/load.py --seconds 60             # a quick proof
    python bench/load.py --db pg --seconds 600    # on a fresh PostgreSQL database
    python bench/load.py --url http://ctl:8900    # against a controller already running

Credentials, where the controller asks for them: `--token` or GPUPOOL_TOKEN, else the admin
token a controller this script starts writes to its data directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _http import HttpConnection
from _pool import free_port
from controller_throughput import drop_pg_database, make_pg_database

RESULTS = Path(__file__).resolve().parent / "results" / "load.json"
API = "/api/v1"
NODE = "load-node"
HELD = {"compute_pct": 1, "memory": "64MiB"}
"""What each heartbeating holder keeps: 1,000 of them fit on 10 GPUs."""
CHURN = {"compute_pct": 5, "memory": "1GiB", "wait": False}
"""What each lease request asks for; `wait: false` makes a request that cannot be granted at once
an error rather than a silent wait in the queue."""
TIMEOUT_S = 30.0
"""A request not answered in this long is an error (and its connection is replaced)."""
BROKEN = (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError)
"""How a request fails on the wire: refused, reset, timed out, cut short, unreadable."""

# ---- measurements ------------------------------------------------------------------------------


@dataclass
class Kind:
    """Latencies and errors of one request kind."""

    latencies_s: list[float] = field(default_factory=list)
    """From the moment the client wants to send to the answer."""
    wire_s: list[float] = field(default_factory=list)
    """From the moment a pooled connection was free to the answer: the controller's part."""
    errors: Counter[str] = field(default_factory=Counter)

    def report(self, seconds: float) -> dict[str, Any]:
        ordered = sorted(self.latencies_s)

        def pct(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

        return {
            "requests": len(ordered) + sum(self.errors.values()),
            "ok": len(ordered),
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors.most_common(10)),
            "rate_per_s": round(len(ordered) / seconds, 1),
            "latency_ms": {
                "p50": pct(0.50),
                "p90": pct(0.90),
                "p99": pct(0.99),
                "max": round(ordered[-1] * 1000, 2) if ordered else None,
            },
            "on_the_wire_ms": {
                "p50": percentile_ms(self.wire_s, 0.50),
                "p90": percentile_ms(self.wire_s, 0.90),
                "p99": percentile_ms(self.wire_s, 0.99),
                "max": percentile_ms(self.wire_s, 1.0),
            },
        }


class Connections:
    """A pool of keep-alive HTTP/1.1 connections: a request takes one, sends, gives it back.

    Not httpx: on this 2-core machine its AsyncClient spent 1.7-3.6 ms of CPU a request and
    topped out near 170 requests/s, where the same controller answered 1,589 heartbeats/s to
    the small client of bench/_http.py. The generator would have measured itself."""

    def __init__(self, url: str, size: int, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.headers = headers
        self.idle: asyncio.Queue[HttpConnection] = asyncio.Queue()
        for _ in range(size):
            self.idle.put_nowait(HttpConnection(self.host, self.port, headers))

    async def request(
        self, method: str, path: str, body: Any = None
    ) -> tuple[int, Any, float, float]:
        """(status, answer, seconds waited for a free connection, seconds the request took)."""
        queued = time.perf_counter()
        conn = await self.idle.get()
        started = time.perf_counter()
        try:
            if conn.writer is None:
                await conn.connect()
            status, answer = await asyncio.wait_for(conn.request(method, path, body), TIMEOUT_S)
            return status, answer, started - queued, time.perf_counter() - started
        except BROKEN:
            # A broken connection is replaced; the request counts as failed.
            await conn.close()
            conn = HttpConnection(self.host, self.port, self.headers)
            raise
        finally:
            self.idle.put_nowait(conn)

    async def close(self) -> None:
        while not self.idle.empty():
            await self.idle.get_nowait().close()


@dataclass
class Load:
    api: Connections
    kinds: dict[str, Kind] = field(
        default_factory=lambda: {k: Kind() for k in ("heartbeat", "create", "release", "hold")}
    )
    lag_s: list[float] = field(default_factory=list)
    """How late each scheduled request started: the generator's own health."""
    slot_wait_s: list[float] = field(default_factory=list)
    """How long requests waited for a free connection in the generator."""
    measuring: bool = False
    arrived: int = 0
    """Lease requests started while measuring: what was asked of the controller."""

    async def call(self, kind: str, method: str, path: str, body: Any = None) -> Any:
        try:
            status, answer, waited, took = await self.api.request(method, path, body)
        except BROKEN as exc:
            self.kinds[kind].errors[type(exc).__name__] += 1
            return None
        if self.measuring:
            self.slot_wait_s.append(waited)
        if status >= 300:
            self.kinds[kind].errors[f"{status} {str(answer)[:120]}"] += 1
            return None
        if self.measuring or kind == "hold":
            # As its client sees it: a wait for a free pooled connection counts too (1,000 real
            # clients would each have their own), so a slow server cannot hide in the pool.
            self.kinds[kind].latencies_s.append(waited + took)
            self.kinds[kind].wire_s.append(took)
        return answer


# ---- the clients --------------------------------------------------------------------------------


async def holder(
    load: Load, index: int, clients: int, period_s: float, stop: asyncio.Event
) -> None:
    """One client holding a lease and renewing it every `period_s`, like `gpupool run` does."""
    await asyncio.sleep(period_s * index / clients)  # take leases in a ramp, not a burst
    lease = await load.call("hold", "POST", f"{API}/leases", {**HELD, "holder": f"h{index}"})
    if lease is None:
        return
    lease_id = lease["id"]
    loop = asyncio.get_running_loop()
    due = loop.time() + period_s
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, due - loop.time()))
        if stop.is_set():
            break
        if load.measuring:
            load.lag_s.append(max(0.0, loop.time() - due))
        due += period_s
        answer = await load.call("heartbeat", "POST", f"{API}/leases/{lease_id}/heartbeat")
        if answer is not None and answer["state"] == "released":
            load.kinds["heartbeat"].errors[f"lease ended: {answer['release_reason']}"] += 1
            return
    await load.call("hold", "DELETE", f"{API}/leases/{lease_id}")


async def request_and_release(load: Load) -> None:
    lease = await load.call("create", "POST", f"{API}/leases", CHURN)
    if lease is not None:
        await load.call("release", "DELETE", f"{API}/leases/{lease['id']}")


async def arrivals(load: Load, rate: float, stop: asyncio.Event) -> None:
    """Lease requests on a fixed schedule, each in its own task (open loop)."""
    loop = asyncio.get_running_loop()
    interval = 1.0 / rate
    due = loop.time()
    running: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if load.measuring:
            load.lag_s.append(max(0.0, loop.time() - due))
            load.arrived += 1
        task = asyncio.create_task(request_and_release(load))
        running.add(task)
        task.add_done_callback(running.discard)
        due += interval
    await asyncio.gather(*running)


async def agent(api: Connections, stop: asyncio.Event) -> None:
    """Be the node's agent: a node that stops heartbeating goes down and takes no leases.

    `api` is the agent's own connection, as a real agent has: heartbeats of the node must not
    wait behind the load in the clients' pool."""
    while not stop.is_set():
        with contextlib.suppress(*BROKEN):
            await api.request("POST", f"{API}/nodes/{NODE}/heartbeat", {})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=2.0)


# ---- the run ------------------------------------------------------------------------------------


async def register(api: Connections, gpus: int) -> None:
    body = {
        "name": NODE,
        "backend": "fake",
        "gpus": [
            {
                "uuid": f"GPU-sim-load-{i}",
                "index": i,
                "model": "H100-80GB (simulated)",
                "memory_mib": 81920,
                "simulated": True,
            }
            for i in range(gpus)
        ],
    }
    status, answer, _, _ = await api.request("POST", f"{API}/nodes", body)
    if status != 201:
        raise RuntimeError(f"registering the load node failed: {status} {answer}")


async def run(args: argparse.Namespace, url: str, token: str | None) -> dict[str, Any]:
    headers = {"X-Gpupool-Actor": "load"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    api = Connections(url, args.connections, headers)
    node_api = Connections(url, 1, headers)
    try:
        await register(node_api, args.gpus)
        load = Load(api)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(agent(node_api, stop))]
        tasks += [
            asyncio.create_task(holder(load, i, args.clients, args.heartbeat_s, stop))
            for i in range(args.clients)
        ]
        # Warm-up: every holder has its lease and has heartbeated once before measuring starts.
        await asyncio.sleep(args.heartbeat_s * 2)
        holding = len(load.kinds["hold"].latencies_s)
        tasks.append(asyncio.create_task(arrivals(load, args.rate, stop)))
        me = psutil.Process()
        cpu_before = me.cpu_times()
        load.measuring = True
        started = time.monotonic()
        await asyncio.sleep(args.seconds)
        load.measuring = False
        elapsed = time.monotonic() - started
        cpu_after = me.cpu_times()
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        await api.close()
        await node_api.close()
    gen_cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    lag = sorted(load.lag_s)
    lag_p99_ms = percentile_ms(lag, 0.99)
    report = {kind: k.report(elapsed) for kind, k in load.kinds.items() if kind != "hold"}
    errors = sum(k["errors"] for k in report.values()) + sum(load.kinds["hold"].errors.values())
    asked_heartbeats = args.clients / args.heartbeat_s
    return {
        "seconds": round(elapsed, 1),
        "clients": args.clients,
        "leases_held": holding,
        "heartbeat_s": args.heartbeat_s,
        "connections": args.connections,
        "asked": {"heartbeat_per_s": asked_heartbeats, "lease_requests_per_s": args.rate},
        "started_lease_requests_per_s": round(load.arrived / elapsed, 1),
        "achieved": {
            "heartbeat_per_s": report["heartbeat"]["rate_per_s"],
            "lease_requests_per_s": report["create"]["rate_per_s"],
        },
        "errors": errors,
        "hold_errors": dict(load.kinds["hold"].errors.most_common(10)),
        "kinds": report,
        "generator": {
            "cpu_pct_of_one_core": round(100 * gen_cpu / elapsed, 1),
            "schedule_lag_p99_ms": lag_p99_ms,
            "schedule_lag_max_ms": round(lag[-1] * 1000, 2) if lag else None,
            "connection_wait_p99_ms": percentile_ms(load.slot_wait_s, 0.99),
        },
        "generator_kept_up": bool(lag_p99_ms is not None and lag_p99_ms < 100),
    }


def percentile_ms(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[int(q * (len(ordered) - 1))] * 1000, 2) if ordered else None


def read_token(args: argparse.Namespace, data_dir: Path | None) -> str | None:
    token = args.token or os.environ.get("GPUPOOL_TOKEN")
    if token:
        return str(token)
    if data_dir is not None and (data_dir / "admin.token").exists():
        return (data_dir / "admin.token").read_text().strip()
    return None


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the controller exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}{API}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("the controller did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--heartbeat-s", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=200.0, help="lease requests per second")
    parser.add_argument("--db", default="sqlite", help="sqlite, pg (a fresh database) or a URL")
    parser.add_argument("--url", help="a controller already running (no controller is started)")
    parser.add_argument("--token", help="API token (default: GPUPOOL_TOKEN)")
    parser.add_argument("--gpus", type=int, default=32, help="GPUs of the simulated node")
    parser.add_argument("--connections", type=int, default=256, help="keep-alive connections")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    proc: subprocess.Popen[bytes] | None = None
    pg_name: str | None = None
    data_dir: Path | None = None
    url = args.url
    db = args.db
    with tempfile.TemporaryDirectory(prefix="gpupool-load-") as tmp:
        if url is None:
            data_dir = Path(tmp)
            db_url: str | None = None
            if db == "pg":
                pg_name, db_url = make_pg_database()
            elif db != "sqlite":
                db_url = db
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            code = (
                "from pathlib import Path\n"
                "from gpupool.controller.settings import ControllerSettings\n"
                "from gpupool.controller.server import serve\n"
                f"serve(ControllerSettings(port={port}, data_dir=Path({tmp!r}),"
                f" db_url={db_url!r}))\n"
            )
            log = open(data_dir / "controller.log", "wb")  # noqa: SIM115 - lives with the process
            proc = subprocess.Popen(
                [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_ready(url, proc)
            ctl_cpu_before = psutil.Process(proc.pid).cpu_times() if proc else None
            t0 = time.monotonic()
            result = asyncio.run(run(args, url, read_token(args, data_dir)))
            if proc is not None and ctl_cpu_before is not None:
                after = psutil.Process(proc.pid).cpu_times()
                used = (after.user - ctl_cpu_before.user) + (after.system - ctl_cpu_before.system)
                result["controller_cpu_pct_of_one_core"] = round(
                    100 * used / (time.monotonic() - t0), 1
                )
                tail = (data_dir / "controller.log").read_text(errors="replace")  # type: ignore[operator]
                result["controller_log_errors"] = tail.count("Traceback")
        finally:
            if proc is not None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=15)
                if proc.poll() is None:
                    proc.kill()
            if pg_name is not None:
                drop_pg_database(pg_name)
    result["db"] = "postgresql" if (db == "pg" or db.startswith("postgres")) else db
    if args.url:
        result["db"] = "as the controller at --url runs"
    result["machine"] = (
        f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    result["command"] = " ".join(["python", "bench/load.py", *sys.argv[1:]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if result["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
