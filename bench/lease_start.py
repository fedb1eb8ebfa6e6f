"""Grant-to-first-op of remote leases, with ready workers and cold.

Starts a controller and an agent (`--fake` simulated GPUs with CPU workers by default; the
machine's GPUs with `--gpu`), then, for each `--ready-workers` setting, takes `--leases`
remote leases one after another, as `gpupool run --remote` does: create the lease, wait for its
worker's endpoint (the SDK's wait_for_workers), attach gpupool.torch and run one op whose
result comes back (`torch.ones(4, device="cuda").add(1).sum().item()`). Grant-to-first-op is
from the lease's `granted_at` (the controller's clock, this host) to that result. Each lease is
released before the next; with ready workers, the next lease waits until the agent has a ready
worker again ("when ready workers are available"), and says whether it got one. A first lease
of each run is not counted: it pays this process's own first remote op (gpupool.torch's and
the client's meta kernels' first calls), which belongs to a program's start.

Each lease comes at a random moment of the agent's heartbeat interval. Parts of each lease's
time: `pickup_s` (grant until the agent set out to start its worker: the controller's wake
call, else at most the agent's heartbeat interval), then `worker_s` (until the endpoint reached
the client), then `attach_s` (connection and first op). Writes p50/p95 of each to --out:

    python bench/lease_start.py [--leases 20] [--ready-workers 1,0] [--interval 2]
    python bench/lease_start.py --gpu --out bench/results/lease_start_gpu.json   # on a GPU host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pool import AUTH, GP, ROOT, free_port, wait

SERVERS_ENV = dict(os.environ)
"""The controller's and agent's environment: this process's, before it hides its GPUs."""
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the client sees no GPU: its cuda is the pool's

RESULTS = ROOT / "bench" / "results" / "lease_start_cpu.json"
PARTS = ("grant_to_first_op_s", "pickup_s", "worker_s", "attach_s")


@contextlib.contextmanager
def pool(work: Path, ready: int, interval_s: float, fake: str | None) -> Iterator[httpx.Client]:
    """A controller and an agent keeping `ready` ready workers per GPU."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = open(work / f"pool-ready{ready}.log", "w")  # noqa: SIM115 - closed below
    ctl = subprocess.Popen(
        [*GP, "controller", "--port", str(port), "--data-dir", str(work / f"ctl{ready}")],
        stdout=logs,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=SERVERS_ENV,
    )
    agent = None
    try:
        api = httpx.Client(base_url=url + "/api/v1", timeout=30, headers=AUTH)
        wait(lambda: api.get("/health").status_code == 200, 60, "controller")
        args = [
            *GP,
            "agent",
            "--url",
            url,
            "--interval",
            f"{interval_s:g}",
            "--data-dir",
            str(work / f"agent{ready}"),
            "--ready-workers",
            str(ready),
        ]
        if fake:
            args += ["--fake", fake]
        agent = subprocess.Popen(
            args, stdout=logs, stderr=subprocess.STDOUT, cwd=ROOT, env=SERVERS_ENV
        )
        wait(lambda: len(api.get("/gpus").json()) > 0, 120, "GPUs to register")
        api.headers["X-Bench-Url"] = url
        yield api
    finally:
        for proc in (agent, ctl):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        logs.close()


def ready_now(api: httpx.Client) -> tuple[int, int]:
    (node,) = api.get("/nodes").json()
    host = node["host"]
    return int(host.get("ready_workers") or 0), int(host.get("ready_workers_wanted") or 0)


def agent_status(api: httpx.Client) -> dict[str, Any]:
    (node,) = api.get("/nodes").json()
    return dict(httpx.get(node["agent_url"] + "/agent/v1/status", timeout=10).json())


def one_lease(api: httpx.Client, memory: str) -> dict[str, Any]:
    """One remote lease from request to first op's result; released at the end."""
    import torch

    import gpupool.torch as gt
    from gpupool.client.sdk import PoolClient
    from gpupool.protocol.v1.api import LeaseCreate

    url = api.headers["X-Bench-Url"]
    handed_before = agent_status(api)["ready_workers"]["handed_over"]
    with PoolClient(url, token=AUTH["Authorization"].split()[1]) as client:
        lease = client.create_lease(
            LeaseCreate(compute_pct=25, memory=memory, access="remote", ttl_s=600)
        )
        token = lease.token or ""
        learned: float | None = None
        try:
            granted = lease.granted_at
            assert granted is not None, lease
            granted_s = granted.replace(tzinfo=granted.tzinfo or UTC).timestamp()
            lease = client.wait_for_workers(lease.id)
            endpoint_s = time.time()
            gt.attach(
                {"id": lease.id, "workers": [s.endpoint for s in lease.slices], "token": token}
            )
            try:
                value = torch.ones(4, device="cuda").add(1).sum().item()
            finally:
                first_op_s = time.time()
                gt.detach()
            assert value == 8.0, value
            learned = learned_at(api, lease.id)
        finally:
            client.release_lease(lease.id)
    handed = agent_status(api)["ready_workers"]["handed_over"] > handed_before
    return {
        "grant_to_first_op_s": round(first_op_s - granted_s, 4),
        "pickup_s": round(learned - granted_s, 4) if learned else None,
        "worker_s": round(endpoint_s - (learned or granted_s), 4),
        "attach_s": round(first_op_s - endpoint_s, 4),
        "ready_worker": handed,
    }


def learned_at(api: httpx.Client, lease_id: str) -> float | None:
    """When the agent set out to start the lease's worker (its status API, while it runs)."""
    for worker in agent_status(api)["ready_workers"]["workers"]:
        if worker["lease_id"] == lease_id and worker["asked_at"] is not None:
            return float(worker["asked_at"])
    return None


def wait_idle(api: httpx.Client, ready: int) -> None:
    """Before the next lease: the last one's worker gone; with ready workers, all ready."""

    def settled() -> bool:
        gpus = api.get("/gpus").json()
        if any(g["leases"] for g in gpus):
            return False
        if ready:
            have, wanted = ready_now(api)
            return wanted > 0 and have >= wanted
        return True

    wait(settled, 300, "the pool to settle")


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    values = sorted(r[key] for r in rows if r.get(key) is not None)
    if not values:
        return {}
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return {
        "p50": round(statistics.median(values), 3),
        "p95": round(p95, 3),
        "max": round(values[-1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--leases", type=int, default=20)
    parser.add_argument(
        "--cold-leases", type=int, default=0, help="leases of the cold setting (0: --leases)"
    )
    parser.add_argument("--ready-workers", default="1,0", help="settings to compare, in order")
    parser.add_argument("--interval", type=float, default=2.0, help="the agent's heartbeat (s)")
    parser.add_argument("--fake", default="1xH100-80GB", help="simulated GPUs (CPU workers)")
    parser.add_argument("--gpu", action="store_true", help="the machine's GPUs, not --fake")
    parser.add_argument("--memory", default="256MiB")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, help="keep the pool's files and logs here")
    args = parser.parse_args()
    if not 1 <= args.leases <= 200 or not 0 <= args.cold_leases <= 200:
        parser.error("--leases must be 1..200 (--cold-leases 0..200)")
    settings = [int(x) for x in args.ready_workers.split(",") if x.strip()]
    rng = random.Random(26)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the pool on the way out
    work = args.work or Path(tempfile.mkdtemp(prefix="gpupool-lease-start-"))
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o711)  # workers as the worker user reach MPS pipes under it (see _pool.py)
    results: dict[str, Any] = {
        "leases": args.leases,
        "heartbeat_interval_s": args.interval,
        "backend": "gpu" if args.gpu else f"fake {args.fake}",
        "runs": [],
    }
    for ready in settings:
        rows: list[dict[str, Any]] = []
        leases = args.cold_leases if ready == 0 and args.cold_leases else args.leases
        results["runs"].append(run_summary(ready, rows, leases))
        with pool(work, ready, args.interval, None if args.gpu else args.fake) as api:
            # One lease first, not counted: this process's own first remote op (gpupool.torch's
            # and the meta kernels' first calls) is the program's start, not the pool's.
            wait_idle(api, ready)
            one_lease(api, args.memory)
            for _ in range(leases):
                wait_idle(api, ready)
                # Leases come at any time, not in step with the agent's heartbeats.
                time.sleep(rng.uniform(0, args.interval))
                try:
                    rows.append(one_lease(api, args.memory))
                except Exception as exc:  # counted and shown: a failed start is a result too
                    rows.append({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(json.dumps({"ready_workers": ready, **rows[-1]}), flush=True)
                # Written after every lease: a run cut short (a time limit) keeps what it
                # measured, and says how far it got.
                results["runs"][-1] = run_summary(ready, rows, leases)
                results["machine"] = machine()
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    results["machine"] = machine()
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(
        json.dumps(
            {"summary": [{k: v for k, v in r.items() if k != "rows"} for r in results["runs"]]},
            indent=1,
        )
    )


def run_summary(ready: int, rows: list[dict[str, Any]], wanted: int) -> dict[str, Any]:
    """One setting's summary over the leases measured so far (`measured` < `leases`: cut short)."""
    return {
        "ready_workers": ready,
        "leases": wanted,
        "measured": len(rows),
        "got_a_ready_worker": sum(bool(r.get("ready_worker")) for r in rows),
        "failed": sum("error" in r for r in rows),
        **{
            key: summary(rows, key) if rows else {}
            for key in ("grant_to_first_op_s", "pickup_s", "worker_s", "attach_s")
        },
        "rows": rows,
    }


def machine() -> str:
    cores = os.cpu_count()
    load = os.getloadavg()[0]
    return f"{platform.node()} ({platform.machine()}, {cores} cores, load {load:.1f} at the end)"


if __name__ == "__main__":
    main()
