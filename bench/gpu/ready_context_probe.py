"""Where a ready CUDA worker's context should be made: measured on one GPU (issue 26).

An MPS client's thread percentage is fixed when its context connects, so a context made
before the hand-over is right for one share only. This compares, on the first GPU, with one
MPS daemon (started here, as the agent starts it):
  - cold: a worker started for its lease (process, torch import, context at its first op);
  - handover: a ready worker without a context; the lease's share goes into its environment at
    the hand-over and the context is made then (what `gpupool agent --ready-workers` does
    where a GPU has an MPS daemon);
  - ahead: a ready worker that made its context before the hand-over (`--context-ahead`, what
    the agent does on a GPU without an MPS daemon: no share to set);
and, for the first two at 30 % and at 100 %, a bf16 matmul's TFLOP/s through the worker, which
says whether the share set at hand-over holds (30 % should run at about 0.3 of 100 %).
Last, CUDA green contexts (torch.cuda.green_contexts): whether this torch has them, how long
one takes to make, and a matmul's TFLOP/s on 30 % of the SMs against all of them, in a
process of its own without MPS. Prints one JSON summary line at the end.

    python bench/gpu/ready_context_probe.py [--repeat 3]
    python bench/gpu/ready_context_probe.py --cpu   # the same paths on CPU workers (a dry run:
                                                    # no MPS, no context, no green contexts)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from gpupool.agent.isolation import worker_environment  # noqa: E402
from gpupool.agent.mps import MpsSupervisor, client_env  # noqa: E402
from gpupool.protocol.v1.dataplane import (  # noqa: E402
    HANDOVER_ENV,
    Handover,
    WorkerCredentials,
    start_standby_worker,
    start_worker_process,
)

TOKEN = "probe-token"
MATMUL = 8192
DEVICE = "cuda:0"


def gpu_uuid() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.split()[0]


def first_op(address: str, lease: str, matmul: bool) -> dict[str, float]:
    """Attach this process to the worker: the first op's time, and a matmul's TFLOP/s."""
    import torch

    import gpupool.torch as gt

    began = time.monotonic()
    gt.attach({"id": lease, "workers": [address], "token": TOKEN})
    try:
        assert torch.ones(4, device="cuda").add(1).sum().item() == 8.0
        out = {"first_op_s": round(time.monotonic() - began, 4)}
        if matmul:
            size = MATMUL if DEVICE != "cpu" else 256
            a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
            (a @ a).sum().item()
            began, steps = time.monotonic(), 20
            for _ in range(steps):
                b = a @ a
            b.sum().item()
            seconds = time.monotonic() - began
            out["tflops"] = round(2 * size**3 * steps / seconds / 1e12, 3)
    finally:
        gt.detach()
    return out


def run_cold(env: dict[str, str], work: Path, n: int, pct: int, matmul: bool) -> dict[str, Any]:
    lease = f"cold-{n}"
    began = time.monotonic()
    proc, ready = start_worker_process(
        lease, TOKEN, env=env | mps_limits(pct), device=DEVICE, memory_limit_mib=8192,
        log_file=work / f"{lease}.log", cwd=work,
    )  # fmt: skip
    try:
        started = time.monotonic() - began
        return {"start_s": round(started, 3), **first_op(str(ready.address), lease, matmul)}
    finally:
        proc.kill()
        proc.wait()


def run_ready(
    env: dict[str, str], work: Path, n: int, pct: int, ahead: bool, matmul: bool
) -> dict[str, Any]:
    lease = f"{'ahead' if ahead else 'handover'}-{n}"
    began = time.monotonic()
    standby = start_standby_worker(
        env=env, device=DEVICE, log_file=work / f"{lease}.log", cwd=work, managed=True,
        context_ahead=ahead,
    )  # fmt: skip
    standby_s = time.monotonic() - began
    try:
        began = time.monotonic()
        handover = Handover(
            lease, WorkerCredentials.generate(TOKEN), memory_limit_mib=8192,
            mps_env={} if ahead else mps_limits(pct),
        )  # fmt: skip
        ready = standby.hand_over(handover, log_file=work / f"{lease}.log")
        handed = time.monotonic() - began
        op = first_op(str(ready.address), lease, matmul)
        return {"standby_s": round(standby_s, 3), "handover_s": round(handed, 4),
                "handover_to_first_op_s": round(handed + op["first_op_s"], 4), **op}  # fmt: skip
    finally:
        standby.proc.kill()
        standby.proc.wait()


def mps_limits(pct: int) -> dict[str, str]:
    limits = client_env(Path("/unused"), Path("/unused"), pct, 8192)
    return {k: v for k, v in limits.items() if k in HANDOVER_ENV}


def green_contexts() -> dict[str, Any]:
    """In a child that sees the GPU and no MPS daemon."""
    code = r"""
import json, time, torch
from torch.cuda import green_contexts as g
out = {"torch": torch.__version__, "supported": bool(g.SUPPORTED)}
if g.SUPPORTED:
    torch.cuda.init(); sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    def tflops():
        (a @ a).sum().item(); t = time.monotonic()
        for _ in range(20): b = a @ a
        b.sum().item(); return round(2 * 8192**3 * 20 / (time.monotonic() - t) / 1e12, 1)
    out["all_sms"], out["tflops_all"] = sms, tflops()
    t = time.monotonic(); ctx = g.GreenContext.create(num_sms=int(sms * 0.3), device_id=0)
    out["create_s"] = round(time.monotonic() - t, 4)
    ctx.set_context()
    try:
        with torch.cuda.stream(ctx.Stream()):
            out["tflops_30pct_sms"] = tflops()
    finally:
        ctx.pop_context()
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS")}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": done.stderr.strip()[-500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="a dry run on CPU workers")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.cpu else DEVICE
    uuid = "GPU-cpu-dry-run" if args.cpu else gpu_uuid()
    work = Path(tempfile.mkdtemp(prefix="gpupool-ready-probe-"))
    result: dict[str, Any] = {"gpu": uuid, "device": DEVICE}
    if not args.cpu:
        result["green_contexts"] = green_contexts()
    mps = MpsSupervisor(work / "mps")
    mps.enabled = mps.enabled and not args.cpu
    mps.reconcile({uuid: ("virtual", None)})
    pipe = mps.pipe_dir(uuid)
    result["mps_pipe"] = pipe
    base = worker_environment(os.environ, work, {"CUDA_VISIBLE_DEVICES": uuid})
    under_mps = dict(base)
    if pipe is not None:
        under_mps |= {"CUDA_MPS_PIPE_DIRECTORY": pipe,
                      "CUDA_MPS_LOG_DIRECTORY": str(Path(pipe).parent / "log")}  # fmt: skip
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # this process is the client: its cuda is the worker
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        for n in range(args.repeat):
            last = n == args.repeat - 1
            rows.setdefault("cold_30", []).append(run_cold(under_mps, work, n, 30, last))
            rows.setdefault("handover_30", []).append(
                run_ready(under_mps, work, n, 30, False, last)
            )
            if not args.cpu:  # a CPU worker has no context to make
                rows.setdefault("ahead_no_mps", []).append(
                    run_ready(base, work, n, 100, True, False)
                )
            print(json.dumps({k: v[-1] for k, v in rows.items()}), flush=True)
        rows["cold_100"] = [run_cold(under_mps, work, 99, 100, True)]
        rows["handover_100"] = [run_ready(under_mps, work, 99, 100, False, True)]
    finally:
        mps.stop_all()
    for name, measured in rows.items():
        keys = sorted({k for row in measured for k in row})
        result[name] = {
            k: round(statistics.median([r[k] for r in measured if k in r]), 4) for k in keys
        }
    hi, lo = result["handover_100"].get("tflops"), result["handover_30"].get("tflops")
    if hi and lo:
        result["handover_share_30_of_100"] = round(lo / hi, 2)
    hi, lo = result["cold_100"].get("tflops"), result["cold_30"].get("tflops")
    if hi and lo:
        result["cold_share_30_of_100"] = round(lo / hi, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
