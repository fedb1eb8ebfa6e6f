"""What the scheduler extender costs the controller: placement per node, and claims.

A real controller process (SQLite) with NODES simulated nodes of 8 GPUs, half their compute
already leased in 25 % and 50 % slices. Measures, through the REST API:
- `POST /api/v1/k8s/placement` for a 25 % slice against every node (the extender's filter and
  prioritize, with nodeCacheCapable: one call per pod per scheduling cycle);
- a claim made on a node and released (the extender's bind, then the pod's end).
Writes bench/results/k8s_placement.json.

    python bench/k8s_placement.py                  # 1,000 nodes, 8,000 GPUs
    python bench/k8s_placement.py --nodes 100 --calls 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _http import HttpConnection
from controller_throughput import free_port, wait_ready

RESULTS = Path(__file__).resolve().parent / "results" / "k8s_placement.json"
GPUS_PER_NODE = 8


def start_controller(port: int, data_dir: str) -> subprocess.Popen[bytes]:
    code = (
        "from pathlib import Path;"
        "from gpupool.controller.settings import ControllerSettings;"
        "from gpupool.controller.server import serve;"
        f"serve(ControllerSettings(port={port}, data_dir=Path({data_dir!r}),"
        " node_timeout_s=3600.0, lease_ttl_s=3600.0))"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def summary(ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


async def fill(conn: HttpConnection, nodes: int, rng: random.Random) -> int:
    names = [f"node-{n:04d}" for n in range(nodes)]
    for name in names:
        body = {
            "name": name,
            "backend": "fake",
            "gpus": [
                {
                    "uuid": f"GPU-{name}-{i}",
                    "index": i,
                    "model": "H100-80GB (simulated)",
                    "memory_mib": 81920,
                    "simulated": True,
                }
                for i in range(GPUS_PER_NODE)
            ],
        }
        status, data = await conn.request("POST", "/api/v1/nodes", body)
        if status != 201:
            raise RuntimeError(f"register {name}: {status} {data}")
    leases = 0
    target_pct = nodes * GPUS_PER_NODE * 100 // 2
    granted_pct = 0
    while granted_pct < target_pct:
        pct = rng.choice([25, 50])
        body = {"compute_pct": pct, "memory": f"{pct * 800}MiB", "wait": False}
        status, _ = await conn.request("POST", "/api/v1/leases", body)
        if status != 201:
            break
        granted_pct += pct
        leases += 1
    return leases


async def measure(port: int, nodes: int, calls: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    conn = HttpConnection("127.0.0.1", port)
    await conn.connect()
    started = time.perf_counter()
    leases = await fill(conn, nodes, rng)
    setup_s = time.perf_counter() - started
    names = [f"node-{n:04d}" for n in range(nodes)]
    query = {"request": {"compute_pct": 25, "memory": "20GiB"}, "nodes": names}
    placement_ms = []
    fitting = 0
    for _ in range(calls):
        t0 = time.perf_counter()
        status, answer = await conn.request("POST", "/api/v1/k8s/placement", query)
        placement_ms.append((time.perf_counter() - t0) * 1000)
        assert status == 200, answer
        fitting = sum(1 for f in answer["nodes"] if f["fits"])
    claim_ms, release_ms = [], []
    for i in range(calls):
        node = rng.choice(names)
        body = {
            "claim": f"c-bench-{i:08d}",
            "node": node,
            "pod": "bench/pod",
            "request": {"compute_pct": 25, "memory": "20GiB"},
        }
        t0 = time.perf_counter()
        status, answer = await conn.request("POST", "/api/v1/k8s/claims", body)
        claim_ms.append((time.perf_counter() - t0) * 1000)
        if status != 201:
            continue  # that node was full: the scheduler would not have picked it
        t0 = time.perf_counter()
        status, _ = await conn.request("DELETE", f"/api/v1/k8s/claims/c-bench-{i:08d}")
        release_ms.append((time.perf_counter() - t0) * 1000)
    await conn.close()
    return {
        "nodes": nodes,
        "gpus": nodes * GPUS_PER_NODE,
        "leases_before": leases,
        "setup_s": round(setup_s, 1),
        "placement_all_nodes": {**summary(placement_ms), "calls": calls, "fitting_nodes": fitting},
        "claim_create": {**summary(claim_ms), "calls": calls},
        "claim_release": {**summary(release_ms), "calls": len(release_ms)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as data_dir:
        proc = start_controller(port, data_dir)
        try:
            asyncio.run(wait_ready(port))
            result = asyncio.run(measure(port, args.nodes, args.calls, args.seed))
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    result["machine"] = f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})"
    result["python"] = platform.python_version()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
