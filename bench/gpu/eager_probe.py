"""Why an eager remote step is slower than it should be: the same step under a few variants.

A diagnostic for the GPU machine (issue 4), not a result: each variant starts a fresh CUDA
worker and times the remote step of bench/remote_overhead.py's workloads in a child process
that sees no GPU, and reports besides the step time where the client's wall time went:

- `issue_cpu_ms`: the client's main thread CPU time while issuing a step (wall minus this is
  time the thread was not running: waiting for the GIL, a lock, a socket, or the scheduler);
- `sends`, `send_ms`: socket sends per step and the wall time spent in them;
- `client_vcsw`, `client_ivcsw`: voluntary / involuntary context switches of the main thread;
- `worker_busy_ms`, `worker_vcsw`: the worker's own time and its context switches per step.

Variants (comma-separated `--variants`):
  local    plain PyTorch with the GPU in the process (the reference);
  base     as shipped;
  pin      client and worker on one CPU each, of different physical cores (all threads);
  pinsib   client and worker on the two SMT siblings of one physical core;
  spin     worker and client poll their sockets 200 us before sleeping;
  nopoll   the client's background flusher does not poll for worker notices;
  flush10  the background flusher wakes every 10 ms instead of 2 ms;
  noflusher  no background flusher thread at all (the step's final sync sends the tail);
  spy      as base, sampled by py-spy (raw stacks in $OUT/spy_<workload>_<batch>.raw).

    python bench/gpu/eager_probe.py --variants base,pin --workloads resnet50:32,gpt2:8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
TOKEN = "probe-token"
LEASE = "probe-lease"


def _ctx(pid: int) -> tuple[int, int]:
    """Voluntary and involuntary context switches of all of a process's threads."""
    vol = invol = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                invol += int(line.split()[1])
    return vol, invol


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import remote_overhead as ro

    variant = spec["variant"]
    if variant == "local":
        return _local(spec)
    if variant in ("pin", "pinsib"):
        os.sched_setaffinity(0, set(spec["client_cpus"]))
    from gpupool.torch import runtime

    if variant == "flush10":
        runtime.FLUSH_INTERVAL_S = 0.010
    if variant == "nopoll":
        from gpupool.torch import stream as stream_module

        stream_module.poll_notices = lambda stream: None
    if variant == "noflusher":
        runtime._Flusher.start = lambda self: None  # type: ignore[method-assign]
    import gpupool.torch

    gpupool.torch.attach(workers=[spec["address"]], token=TOKEN, lease=LEASE)
    stream = runtime.stream(0)
    conn = stream.conn
    sent = {"n": 0, "s": 0.0}
    original = conn.send_body

    def timed_send(body: Any) -> None:
        t0 = time.perf_counter()
        try:
            original(body)
        finally:
            sent["n"] += 1
            sent["s"] += time.perf_counter() - t0

    conn.send_body = timed_send  # type: ignore[method-assign]
    workload, batch = spec["workload"], spec["batch"]
    step = ro.resnet50_step(batch) if workload == "resnet50" else ro.gpt2_step(batch)
    for _ in range(spec.get("warmup", 5)):
        step()
    stats0 = stream.sync()
    sent["n"], sent["s"] = 0, 0.0
    steps = spec["steps"]
    ru0 = resource.getrusage(resource.RUSAGE_THREAD)
    c0, w0 = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        step()
    w1, c1 = time.perf_counter(), time.thread_time()
    ru1 = resource.getrusage(resource.RUSAGE_THREAD)
    sends, send_s = sent["n"], sent["s"]
    stats1 = stream.sync()
    w2 = time.perf_counter()
    out = {
        "ms": (w2 - w0) / steps * 1e3,
        "issue_ms": (w1 - w0) / steps * 1e3,
        "issue_cpu_ms": (c1 - c0) / steps * 1e3,
        "sends": sends / steps,
        "send_ms": send_s / steps * 1e3,
        "client_vcsw": (ru1.ru_nvcsw - ru0.ru_nvcsw) / steps,
        "client_ivcsw": (ru1.ru_nivcsw - ru0.ru_nivcsw) / steps,
    }
    if "busy_s" in stats1:
        out["worker_busy_ms"] = (stats1["busy_s"] - stats0["busy_s"]) / steps * 1e3
        if "busy_cpu_s" in stats1:
            cpu = stats1["busy_cpu_s"] - stats0["busy_cpu_s"]
            out["worker_busy_cpu_ms"] = cpu / steps * 1e3
        out["records"] = (stats1["ops_total"] - stats0["ops_total"]) / steps
    return out


def _local(spec: dict[str, Any]) -> dict[str, Any]:
    """The same step with the GPU in this process (plain PyTorch), timed as remote_overhead
    times it."""
    import remote_overhead as ro

    workload, batch = spec["workload"], spec["batch"]
    step = ro.resnet50_step(batch) if workload == "resnet50" else ro.gpt2_step(batch)
    return ro.time_steps(step, spec["steps"], spec.get("warmup", 5))


def _cores() -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (SMT siblings together)."""
    allowed = os.sched_getaffinity(0)
    groups: dict[str, list[int]] = {}
    for cpu in sorted(allowed):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        key = path.read_text().strip() if path.exists() else str(cpu)
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def _placement(variant: str) -> tuple[list[int], list[int]]:
    """pin: client and worker on different physical cores (their siblings idle);
    pinsib: the two SMT siblings of one core, to see what sharing a core costs."""
    cores = _cores()
    if variant == "pinsib" and len(cores[0]) > 1:
        return [cores[0][0]], [cores[0][1]]
    if len(cores) >= 2:
        return [cores[0][0]], [cores[1][0]]
    return [cores[0][0]], [cores[0][0]]


def run_variant(
    variant: str, workloads: list[tuple[str, int]], steps: int, device: str, warmup: int = 5
) -> None:
    from gpupool.protocol.v1.dataplane import start_worker_process

    client_cpus, worker_cpus = _placement(variant)
    options: dict[str, Any] = {"spin_us": 200} if variant == "spin" else {}
    with tempfile.TemporaryDirectory(prefix="gp-probe-") as tmp:
        worker, ready = start_worker_process(
            LEASE, TOKEN, device=device, listen=f"unix:{tmp}/w.sock", **options
        )
        try:
            if variant in ("pin", "pinsib"):
                subprocess.run(
                    ["taskset", "-a", "-cp", ",".join(map(str, worker_cpus)), str(worker.pid)],
                    check=True, capture_output=True,
                )  # fmt: skip
            for workload, batch in workloads:
                spec = {
                    "variant": variant, "workload": workload, "batch": batch, "steps": steps,
                    "address": str(ready.address), "client_cpus": client_cpus, "warmup": warmup,
                }  # fmt: skip
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
                if variant == "local":
                    env.pop("CUDA_VISIBLE_DEVICES")
                if variant == "spin":
                    env["GPUPOOL_SPIN_US"] = "200"
                v0 = _ctx(worker.pid)
                argv = [sys.executable, __file__, "--child", json.dumps(spec)]
                if variant == "spy":
                    out = (
                        Path(os.environ.get("OUT", "."))
                        / f"spy_{os.environ.get('PROBE_TAG', '')}{workload}_{batch}.raw"
                    )
                    argv = [
                        "py-spy",
                        "record",
                        "-r",
                        "250",
                        "-f",
                        "raw",
                        "-o",
                        str(out),
                        "--",
                        *argv,
                    ]
                proc = subprocess.run(
                    argv,
                    capture_output=True, text=True, env=env, timeout=300,
                )  # fmt: skip
                v1 = _ctx(worker.pid)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
                row: dict[str, Any] = {"variant": variant, "workload": workload, "batch": batch}
                if proc.returncode or not lines:
                    row["error"] = " | ".join((proc.stderr or proc.stdout).splitlines()[-8:])
                else:
                    row |= json.loads(lines[-1])
                    # the worker's switches over the child's whole run (warm-up included)
                    row["worker_vcsw_run"] = v1[0] - v0[0]
                    row["worker_ivcsw_run"] = v1[1] - v0[1]
                print(json.dumps(row), flush=True)
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                print(json.dumps({"variant": variant, "note": "worker ignored SIGTERM"}))
                worker.kill()
                worker.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", default="base")
    parser.add_argument("--workloads", default="resnet50:32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda:0", help="worker device (cpu: smoke test)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    workloads = [(w.split(":")[0], int(w.split(":")[1])) for w in args.workloads.split(",")]
    for variant in args.variants.split(","):
        run_variant(variant, workloads, args.steps, args.device, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
