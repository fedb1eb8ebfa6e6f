"""Where a remote step's client time goes, loop by loop (bench/remote_real.py's loops).

For each loop: the local step (median ms, client CPU ms, aten ops per step counted by a
dispatch mode), then the same loop attached to a worker on this host over its Unix socket:
median ms, client CPU ms, records and frames sent per step, and a cProfile of a few steps
(the top functions by own time; a C function's own time includes the compiled hot path it
enters, since the dispatcher calls that from C). One process per loop and mode, so nothing
one leaves behind (plans, caches) helps the next.

    python bench/gpu/profile_client.py --loops bert_infer,gpt2_generate [--tiny]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))


def child(loop: str, mode: str, address: str, tiny: bool, steps: int, top: int) -> None:
    import remote_real as rr
    import torch

    if mode == "remote":
        import gpupool.torch

        gpupool.torch.attach(workers=[address], token=rr.TOKEN, lease=rr.LEASE)
    device = "cpu" if tiny and mode == "local" else "cuda"
    if tiny:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    step = rr.BUILDERS[loop](device, tiny)
    for _ in range(rr.WARMUP[loop]):
        step()
    out: dict[str, Any] = {"loop": loop, "mode": mode}
    if mode == "local":
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = {}

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                counts[str(func)] = counts.get(str(func), 0) + 1
                return func(*args, **(kwargs or {}))

        with Count():
            step()
        out["ops_per_step"] = sum(counts.values())
        out["top_ops"] = sorted(counts.items(), key=lambda kv: -kv[1])[:25]
    else:
        from gpupool.torch import dispatch, runtime

        stream = runtime.stream(0)
        sent = {"records": 0, "frames": 0}
        original = stream._flush_locked

        def counting(*a: Any, **k: Any) -> Any:
            sent["records"] += len(stream.records)
            sent["frames"] += 1
            return original(*a, **k)

        stream._flush_locked = counting  # type: ignore[method-assign]
        out["fastpath"] = dispatch.fastpath_active()
    times, cpu = [], time.thread_time()
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    out["ms"] = statistics.median(times) * 1e3
    out["client_cpu_ms"] = (time.thread_time() - cpu) / steps * 1e3
    if mode == "remote":
        out["records_per_step"] = sent["records"] / steps
        out["frames_per_step"] = sent["frames"] / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(max(2, steps // 3)):
        step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    out["profile"] = text.getvalue()[-12000:]
    print(json.dumps(out), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loops", default="bert_infer,gpt2_generate")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--child", nargs=4, metavar=("LOOP", "MODE", "ADDRESS", "STEPS"))
    args = parser.parse_args()
    if args.child:
        loop, mode, address, steps = args.child
        child(loop, mode, address, args.tiny, int(steps), args.top)
        return 0
    import remote_real as rr

    device = "cpu" if args.tiny else "cuda:0"
    with tempfile.TemporaryDirectory(prefix="gpupool-prof-") as tmp:
        proc, address = rr.start_worker(f"unix:{tmp}/w.sock", device, sys.executable, args.tiny,
                                        Path(tmp) / "w.log")  # fmt: skip
        try:
            for loop in [x for x in args.loops.split(",") if x]:
                for mode in ("local", "remote"):
                    cmd = [sys.executable, __file__, "--child", loop, mode, address,
                           str(args.steps), "--top", str(args.top)]  # fmt: skip
                    cmd += ["--tiny"] if args.tiny else []
                    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
                    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
                    lines = [x for x in run.stdout.splitlines() if x.startswith("{")]
                    if not lines:
                        print(f"{loop} {mode}: rc={run.returncode}", run.stderr[-3000:], flush=True)
                        continue
                    res = json.loads(lines[-1])
                    prof = res.pop("profile")
                    print(json.dumps(res), flush=True)
                    print(prof, flush=True)
        finally:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
