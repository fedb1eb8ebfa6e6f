"""Batch norm on a CUDA worker against the local GPU, bit for bit, forward and backward.

Cases: training on batch statistics alone (what a local GPU runs with cuDNN), training with
running statistics, evaluation, cuDNN on and off, float32 and bfloat16, 2-d and 4-d inputs.
Inputs are made on the host from a fixed seed; one process per side (a client attached to a
worker has no local GPU of its own):

    python bench/gpu/batch_norm_check.py local OUT.pt
    python bench/gpu/batch_norm_check.py remote OUT.pt --worker ADDRESS   (a started worker)
    python bench/gpu/batch_norm_check.py compare LOCAL.pt REMOTE.pt
    python bench/gpu/batch_norm_check.py both DIR [--device cuda:0]   (all three, a worker of
        its own on that device; the remote side runs without a GPU of its own)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

SHAPES = ((8, 3, 5, 5), (16, 4), (4, 6, 7))


def cases() -> list[dict[str, Any]]:
    out = []
    for shape, mode, affine, cudnn, dtype in itertools.product(
        SHAPES, ("batch_stats", "running_stats", "eval"), (True, False), (True, False),
        (torch.float32, torch.bfloat16),
    ):  # fmt: skip
        out.append({"shape": shape, "mode": mode, "affine": affine, "cudnn": cudnn,
                    "dtype": dtype})  # fmt: skip
    return out


def run(case: dict[str, Any], device: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(zlib.crc32(repr((case["shape"], case["mode"])).encode()))
    channels = case["shape"][1]
    x = torch.randn(case["shape"]).to(case["dtype"])
    w, b = torch.rand(channels) + 0.5, torch.randn(channels)
    mean, var = torch.randn(channels) * 0.1, torch.rand(channels) + 0.5
    grad = torch.randn(case["shape"]).to(case["dtype"])
    x = x.to(device).requires_grad_()
    w, b = (t.to(device).requires_grad_() for t in (w, b))
    rm, rv = mean.to(device), var.to(device)
    stats = case["mode"] != "batch_stats"
    with torch.backends.cudnn.flags(enabled=case["cudnn"]):
        y = F.batch_norm(
            x, rm if stats else None, rv if stats else None,
            w if case["affine"] else None, b if case["affine"] else None,
            training=case["mode"] != "eval", momentum=0.1, eps=1e-5,
        )  # fmt: skip
        y.backward(grad.to(device))
    result = {"y": y.detach(), "dx": x.grad}
    if case["affine"]:
        result.update(dw=w.grad, db=b.grad)
    if stats:
        result.update(running_mean=rm, running_var=rv)
    return {k: v.cpu() for k, v in result.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("side", choices=("local", "remote", "compare", "both"))
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--worker", default="")
    parser.add_argument("--device", default="cuda:0", help="both: the worker's device")
    args = parser.parse_args()
    if args.side == "both":
        return both(Path(args.paths[0]), args.device)
    if args.side == "compare":
        local, remote = (torch.load(p) for p in args.paths[:2])
        bad = 0
        for i, (case, want) in enumerate(local):
            got = remote[i][1]
            if "error" in got or "error" in want:
                bad += 1
                print(
                    "ERROR",
                    {k: str(v) for k, v in case.items()},
                    got.get("error"),
                    want.get("error"),
                )
                continue
            diffs = {k: float((got[k].float() - want[k].float()).abs().max()) for k in want
                     if not torch.equal(got[k], want[k])}  # fmt: skip
            if diffs:
                bad += 1
                named = {k: (str(v) if k == "dtype" else v) for k, v in case.items()}
                print("DIFFERS", named, diffs)
        print(f"{len(local) - bad} of {len(local)} cases bit-identical")
        return 0
    if args.side == "remote":
        import gpupool.torch

        gpupool.torch.attach(workers=[args.worker], token="bn-check", lease="bn-check")
    results = []
    for case in cases():
        try:
            results.append((case, run(case, "cuda")))
        except Exception as exc:  # a case that fails is a result: the comparison names it
            results.append((case, {"error": f"{type(exc).__name__}: {exc}"[:300]}))
    torch.save(results, args.paths[0])
    return 0


def both(folder: Path, device: str) -> int:
    import os
    import subprocess

    from gpupool.protocol.v1.dataplane import start_worker_process

    folder.mkdir(parents=True, exist_ok=True)
    proc, ready = start_worker_process(
        "bn-check", "bn-check", device=device, listen=f"unix:{folder}/w.sock",
        log_file=folder / "worker.log",
    )  # fmt: skip
    try:
        me = [sys.executable, __file__]
        no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        remote = [*me, "remote", str(folder / "remote.pt"), "--worker", str(ready.address)]
        subprocess.run(remote, check=True, env=no_gpu, timeout=300)
        subprocess.run([*me, "local", str(folder / "local.pt")], check=True, timeout=300)
    finally:
        proc.kill()
    return main_compare(folder / "local.pt", folder / "remote.pt")


def main_compare(local: Path, remote: Path) -> int:
    sys.argv = [sys.argv[0], "compare", str(local), str(remote)]
    return main()


if __name__ == "__main__":
    sys.exit(main())
