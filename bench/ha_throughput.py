"""What high availability costs a write: grant+release pairs per second on PostgreSQL with one
controller alone, with the leader of two `--ha` controllers, and through the standby (which
forwards every write to the leader). Same load as bench/controller_throughput.py.

    python bench/ha_throughput.py [--clients 16] [--seconds 10]  → bench/results/ha_throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gpupool.protocol.v1.tokens import new_token

sys.path.insert(0, str(Path(__file__).resolve().parent))
from controller_throughput import (
    drop_pg_database,
    free_port,
    make_pg_database,
    measure,
    register_node,
    wait_ready,
)

# The controllers this benchmark starts install this admin token, and every client sends it.
os.environ.setdefault("GPUPOOL_ADMIN_TOKEN", new_token()[2])
os.environ.setdefault("GPUPOOL_TOKEN", os.environ["GPUPOOL_ADMIN_TOKEN"])
AUTH = {"Authorization": f"Bearer {os.environ['GPUPOOL_TOKEN']}"}

RESULTS = Path(__file__).resolve().parent / "results" / "ha_throughput.json"


def start(port: int, data_dir: Path, db_url: str, ha: bool) -> subprocess.Popen[bytes]:
    code = (
        "from pathlib import Path;"
        "from gpupool.controller.settings import ControllerSettings;"
        "from gpupool.controller.server import serve;"
        f"serve(ControllerSettings(port={port}, data_dir=Path({str(data_dir)!r}), "
        f"db_url={db_url!r}, ha={ha!r}))"
    )
    data_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)


def wait_role(port: int, role: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/ha", timeout=2, headers=AUTH)
            if answer.json()["role"] == role:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"controller on {port} never became {role}")


def run_case(case: str, clients: int, seconds: float) -> dict[str, object]:
    name, db_url = make_pg_database()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            first = free_port()
            procs.append(start(first, work / "a", db_url, ha=case != "alone"))
            asyncio.run(wait_ready(first))
            target = first
            if case != "alone":
                wait_role(first, "leader")
                second = free_port()
                procs.append(start(second, work / "b", db_url, ha=True))
                asyncio.run(wait_ready(second))
                wait_role(second, "standby")
                if case == "through the standby":
                    target = second
            asyncio.run(register_node(target, gpus=clients))
            result = asyncio.run(measure(target, clients, seconds))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=15)
        drop_pg_database(name)
    row = {"case": case, **result}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    rows = [
        run_case(case, args.clients, args.seconds)
        for case in ("alone", "HA leader", "through the standby")
    ]
    out = {
        "db": "postgresql",
        "rows": rows,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "machine": f"{platform.machine()}, CPython {platform.python_version()}",
        "note": "all processes (controllers, PostgreSQL, load) share the same cores",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
