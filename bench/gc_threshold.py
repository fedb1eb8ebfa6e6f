"""The cyclic collector's share of a remote training step, at Python's threshold and at gpupool's.

gpupool.torch.attach() and the worker raise the collector's first threshold from 700 to
10,000 (gpupool/startup.py says why). This runs bench/remote_client_cost.py's GPT-2-shaped
step (tiny sizes, a CPU worker on a Unix socket) in fresh processes with
GPUPOOL_GC_THRESHOLD=700 (Python's own) and unset (gpupool's), alternating, and reports per
step the client's mean and median CPU, the collector's time in the client (gc.callbacks) and
how many collections of each generation ran, and the worker's busy CPU:

    python bench/gc_threshold.py [--steps 150] [--repeat 3]

Results: bench/results/gc_threshold.json (median over --repeat of each number).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def child(steps: int) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import torch
    from remote_client_cost import LEASE, TOKEN, build_gpt2

    import gpupool.torch
    from gpupool.protocol.v1.dataplane import start_worker_process
    from gpupool.torch import runtime

    tmp = tempfile.mkdtemp(prefix="gp-gc-")
    worker, ready = start_worker_process(
        LEASE, TOKEN, device="cpu", listen=f"unix:{tmp}/w.sock", threads=1
    )
    try:
        gpupool.torch.attach(workers=[str(ready.address)], token=TOKEN, lease=LEASE)
        torch.manual_seed(0)
        step = build_gpt2(batch=2)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        spent: collections.Counter[int] = collections.Counter()
        runs: collections.Counter[int] = collections.Counter()
        began = [0.0]

        def watch(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                began[0] = time.thread_time()
            else:
                spent[info["generation"]] += time.thread_time() - began[0]
                runs[info["generation"]] += 1

        gc.callbacks.append(watch)
        stream = runtime.stream(0)
        before = stream.sync()
        cpus = []
        for _ in range(steps):
            started = time.thread_time()
            step()
            cpus.append(time.thread_time() - started)
        after = stream.sync()
        gc.callbacks.remove(watch)
        return {
            "threshold": gc.get_threshold()[0],
            "client_cpu_ms_mean": statistics.mean(cpus) * 1e3,
            "client_cpu_ms_median": statistics.median(cpus) * 1e3,
            "client_cpu_ms_max": max(cpus) * 1e3,
            "gc_ms_per_step": sum(spent.values()) / steps * 1e3,
            "collections": {str(g): runs[g] for g in (0, 1, 2)},
            "worker_busy_cpu_ms": (after["busy_cpu_s"] - before["busy_cpu_s"]) / steps * 1e3,
        }
    finally:
        gpupool.torch.detach()
        worker.kill()


def run_variant(threshold: str | None, steps: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_GC_THRESHOLD"}
    if threshold is not None:
        env["GPUPOOL_GC_THRESHOLD"] = threshold
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(steps)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"threshold": runs[0]["threshold"]}
    for key in runs[0]:
        if key.endswith("_ms") or "_ms_" in key:
            out[key] = round(statistics.median(r[key] for r in runs), 2)
    out["collections"] = {
        g: statistics.median(r["collections"][g] for r in runs) for g in ("0", "1", "2")
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gc_threshold.json")
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    python_default: list[dict[str, Any]] = []
    gpupool_default: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        python_default.append(run_variant("700", args.steps))
        gpupool_default.append(run_variant(None, args.steps))
    result = {
        "workload": "GPT-2-shaped step, tiny sizes, CPU worker (bench/remote_client_cost.py)",
        "steps": args.steps,
        "python_threshold": summary(python_default),
        "gpupool_threshold": summary(gpupool_default),
        "machine": f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})",
    }
    print(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
