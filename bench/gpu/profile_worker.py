"""Where a worker's time goes while it serves one of bench/remote_real.py's loops.

The client runs the loop attached to a worker on this host (Unix socket and shared memory);
py-spy samples the worker process meanwhile, native frames included (`--native`: the C++ of
ATen, the CUDA driver, the compiled record loop), and the samples are folded into the frames
with the most time of their own and the most time beneath them. Beside it, per step: the
loop's time, the client's CPU and the worker's busy time (wall and CPU), so it is plain
which side bounds the loop before looking at what the worker does.

    python bench/gpu/profile_worker.py --loop gpt2_generate [--device cuda:0] [--seconds 10]
                                       [--tiny] [--native] [--out F]

Needs py-spy (`pip install py-spy`) and the right to trace a child process (root, or
ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))


def fold(raw: Path, top: int) -> dict[str, Any]:
    """py-spy's raw output (one `frame;frame;... count` line per stack) into the frames with
    the most samples of their own and the most samples anywhere in their stacks."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            anywhere[frame] += n
    share = lambda c: [(round(100 * n / max(total, 1), 1), f[:160]) for f, n in c.most_common(top)]  # noqa: E731
    return {"samples": total, "own_pct": share(own), "inclusive_pct": share(anywhere)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loop", default="gpt2_generate")
    parser.add_argument("--device", default="cuda:0", help="the worker's device")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tiny", action="store_true", help="tiny models (CPU workers)")
    parser.add_argument("--native", action="store_true", help="sample native frames too")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")

    import remote_real as rr

    tmp = Path(tempfile.mkdtemp(prefix="gpupool-profile-worker-"))
    proc, address = rr.start_worker(
        f"unix:{tmp}/w.sock", args.device, sys.executable, args.tiny, tmp / "worker.log"
    )
    try:
        import torch

        import gpupool.torch

        gpupool.torch.attach(workers=[address], token=rr.TOKEN, lease=rr.LEASE)
        if args.tiny:
            torch.set_num_threads(1)
        torch.manual_seed(0)
        step = rr.BUILDERS[args.loop]("cuda", args.tiny)
        for _ in range(rr.WARMUP[args.loop]):
            step()
        raw = tmp / "samples.txt"
        argv = [spy, "record", "-p", str(proc.pid), "-r", "1000", "-f", "raw", "-o", str(raw),
                "-d", str(int(args.seconds + 30))]  # fmt: skip
        # Native frames need the process stopped at each sample (slower, but it says which C++
        # the time is in); Python frames alone are read while it runs.
        argv.append("--native" if args.native else "--nonblocking")
        sampler = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # py-spy attaches
        before = rr.client_counters()
        started, cpu, steps = time.perf_counter(), time.thread_time(), 0
        while time.perf_counter() - started < args.seconds:
            step()
            steps += 1
        wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
        after = rr.client_counters()
        sampler.send_signal(2)
        said = sampler.communicate(timeout=60)[0].decode(errors="replace")
        result: dict[str, Any] = {
            "loop": args.loop,
            "device": args.device,
            "steps": steps,
            "ms_per_step": wall / steps * 1e3,
            "client_cpu_ms_per_step": cpu / steps * 1e3,
            **{f"{k}_per_step": (after[k] - before[k]) / steps for k in after},
        }
        if raw.exists():
            result["profile"] = fold(raw, args.top)
        else:
            result["py_spy"] = said[-2000:]
    finally:
        proc.kill()
        proc.wait()
    profile = result.pop("profile", None)
    print(json.dumps(result))
    if profile is not None:
        print(f"{profile['samples']} samples")
        for title, key in (("own", "own_pct"), ("inclusive", "inclusive_pct")):
            print(f"--- {title}")
            for pct, frame in profile[key]:
                print(f"{pct:5.1f}% {frame}")
        result["profile"] = profile
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
