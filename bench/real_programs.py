"""The real-program set (tests/torch/real_programs.py) on a local device and on a remote one,
and the comparison of the two runs: on the GPU machine, local CUDA against a CUDA worker.

    python bench/real_programs.py run --device cuda --out local.json          # local GPU
    python bench/real_programs.py run --remote cuda:0 --out remote.json       # via a worker
    python bench/real_programs.py compare local.json remote.json

`run` turns deterministic algorithms on, warn-only (both sides alike: a worker gets the
switch through its FLAGS record; a local GPU needs CUBLAS_WORKSPACE_CONFIG, which run sets)
and cuDNN's benchmark off, runs each program in turn (a program that fails is recorded with
its error, and the rest go on) and writes {name: {"result": ..., "seconds": ...} | {"error": ...}}.
`--remote DEVICE` starts one worker on DEVICE (its CUDA_VISIBLE_DEVICES from
GPUPOOL_TEST_WORKER_GPUS, default 0) and attaches this process to it, which should see no GPU
itself (CUDA_VISIBLE_DEVICES=). `compare` prints one line per program: EQUAL (bit-identical
numbers), or the largest relative difference and where, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "torch"))
sys.path.insert(0, str(ROOT))
LEASE = "lease-programs"


def run(options: argparse.Namespace) -> int:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import real_programs
    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # as the worker runs: a CPU's reductions round by thread count
    names = options.only.split(",") if options.only else list(real_programs.PROGRAMS)
    worker = None
    device = options.device
    if options.remote:
        os.environ["GPUPOOL_TEST_WORKER_DEVICE"] = options.remote
        from torch_workers import TOKEN, start_worker

        import gpupool.torch

        worker = start_worker(LEASE)
        gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease=LEASE)
        device = "cuda"
    # warn_only: a CUDA GPU has no deterministic backward for some ops these programs use
    # (torchvision's adaptive average pooling); they run, and are where differences may come.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    report: dict[str, Any] = {
        "_setup": {
            "torch": torch.__version__,
            "device": device,
            "remote": options.remote or None,
            "local_gpu": torch.cuda.get_device_name(0)
            if not options.remote and torch.cuda.is_available()
            else None,
        }
    }
    try:
        for name in names:
            package, program = real_programs.PROGRAMS[name]
            if package and not real_programs.available(package):
                report[name] = {"error": f"{package} is not installed"}
                continue
            started = time.perf_counter()
            try:
                result = program(device)
                report[name] = {"result": result, "seconds": time.perf_counter() - started}
            except Exception as exc:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                report[name] = {
                    "error": f"{type(exc).__name__}: {str(exc)[:400]} "
                    f"[{Path(where.filename).name}:{where.lineno}]"
                }
            print(name, "ok" if "result" in report[name] else report[name]["error"], flush=True)
    finally:
        if worker is not None:
            import gpupool.torch

            gpupool.torch.detach()
            worker.stop()
    Path(options.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _differences(a: Any, b: Any, path: str) -> list[tuple[float, str]]:
    """(relative difference, where) for every number that differs; inf for a shape change."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [(math.inf, f"{path}: keys {sorted(a)} != {sorted(b)}")]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [(math.inf, f"{path}: length {len(a)} != {len(b)}")]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{path}[{i}]")
        ]
    if a == b:
        return []
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        scale = max(abs(a), abs(b), 1e-30)
        return [(abs(a - b) / scale, f"{path}: {a!r} != {b!r}")]
    return [(math.inf, f"{path}: {a!r} != {b!r}")]


def compare(options: argparse.Namespace) -> int:
    local = json.loads(Path(options.local).read_text())
    remote = json.loads(Path(options.remote_file).read_text())
    print("local:", local.pop("_setup", None), "| remote:", remote.pop("_setup", None))
    equal = 0
    for name in local:
        a, b = local[name], remote.get(name, {"error": "not run"})
        if "error" in a or "error" in b:
            print(
                f"{name:22s} ERROR local: {a.get('error', 'ok')} | remote: {b.get('error', 'ok')}"
            )
            continue
        diffs = _differences(a["result"], b["result"], name)
        seconds = f"{a['seconds']:.1f} s local, {b['seconds']:.1f} s remote"
        if not diffs:
            equal += 1
            print(f"{name:22s} EQUAL ({seconds})")
        else:
            worst = max(diffs)
            print(
                f"{name:22s} DIFF {len(diffs)} values, worst rel {worst[0]:.2e} "
                f"at {worst[1][:160]} ({seconds})"
            )
    print(f"bit-identical: {equal} of {len(local)} programs")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run")
    one.add_argument("--device", default="cpu", help="the local device (ignored with --remote)")
    one.add_argument("--remote", default="", help="run on a worker on this device (cpu, cuda:0)")
    one.add_argument("--only", default="", help="comma-separated program names")
    one.add_argument("--out", required=True)
    two = sub.add_parser("compare")
    two.add_argument("local")
    two.add_argument("remote_file")
    options = parser.parse_args()
    return run(options) if options.command == "run" else compare(options)


if __name__ == "__main__":
    sys.exit(main())
