"""What a client in Python can cost per op at best, against what gpupool's client costs.

Every op on a remote tensor enters Python through `__torch_dispatch__` and returns new
wrapper tensors; those two steps are the floor of any pure-Python client, whatever it does in
between. This measures, per op, in one process:

- `entry_us`: an op on a `__torch_dispatch__` subclass whose handler returns a tensor made
  beforehand (C++ -> Python -> C++ and nothing else);
- `entry_wrap_us`: the handler makes one new wrapper (`_make_wrapper_subclass`), as any
  client that returns fresh tensors must;
- `gpupool_us`: the same op on a gpupool remote tensor (encoding, plan cache, handles,
  record), streamed to a worker on this host (the worker's time is not included: nothing
  waits for it);
- `gpupool_extra_us` = gpupool_us - entry_wrap_us: what gpupool's own code adds;
- `gpupool_python_us` / `gpupool_python_extra_us`: the same with the compiled hot path off
  (`fastpath` says whether it was on for `gpupool_us`: it is where the C module was built).

    python bench/dispatch_floor.py [--device cuda:0|cpu] [--out bench/results/dispatch_floor.json]

With a training step's dispatch count (bench/remote_client_cost.py counts them), the floor
of its issue time is (the step's issue time) - dispatches * gpupool_extra_us: if that is
still above the target, no amount of Python tuning reaches it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def per_op_us(fn: Any, number: int = 20000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def measure(device: str) -> dict[str, Any]:
    import torch

    import gpupool.torch
    from gpupool.protocol.v1.dataplane import start_worker_process
    from gpupool.torch import dispatch

    meta = torch.device("meta")
    make = torch.Tensor._make_wrapper_subclass
    made: list[Any] = []

    class Entry(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
            return made[0]

    class Wrap(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
            out = make(Wrap, (64, 64), strides=(64, 1), storage_offset=0, dtype=args[0].dtype,
                       device=meta)  # fmt: skip
            out._gp = None  # a client keeps at least its handle on each wrapper
            return out

    def pair(cls: type) -> tuple[Any, Any]:
        return (make(cls, (64, 64), dtype=torch.float32, device=meta),
                make(cls, (64, 64), dtype=torch.float32, device=meta))  # fmt: skip

    ea, eb = pair(Entry)
    made.append(ea)
    wa, wb = pair(Wrap)
    tmp = tempfile.mkdtemp(prefix="gp-floor-")
    worker, ready = start_worker_process(
        "floor", "floor-token", device=device, listen=f"unix:{tmp}/w.sock", threads=1
    )
    rows: list[dict[str, Any]] = []
    try:
        gpupool.torch.attach(workers=[str(ready.address)], token="floor-token", lease="floor")
        ga = torch.randn(64, 64, device="cuda")
        gb = torch.randn(64, 64, device="cuda")
        ops = {
            "add": lambda a, b: a + b,
            "mul": lambda a, b: a * b,
            "mm": lambda a, b: torch.mm(a, b),
            "view": lambda a, b: a.view(4096),
            "t": lambda a, b: a.t(),
        }
        for name, op in ops.items():
            entry = per_op_us(lambda op=op: op(wa, wb)) if name in ("view", "t") else None
            # A view may not return its input itself: the entry-only handler serves only ops
            # with new outputs; views are measured with one new wrapper (their real floor).
            if entry is None:
                entry = per_op_us(lambda op=op: op(ea, eb))
            wrap = per_op_us(lambda op=op: op(wa, wb))
            fast = dispatch.use_fastpath(True)
            remote = per_op_us(lambda op=op: op(ga, gb))
            dispatch.use_fastpath(False)
            python = per_op_us(lambda op=op: op(ga, gb))
            dispatch.use_fastpath(True)
            torch.cuda.synchronize()
            rows.append({"op": name, "entry_us": entry, "entry_wrap_us": wrap,
                         "gpupool_us": remote, "gpupool_extra_us": remote - wrap,
                         "fastpath": fast, "gpupool_python_us": python,
                         "gpupool_python_extra_us": python - wrap})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        gpupool.torch.detach()
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    return {
        "machine": f"{platform.machine()} x{__import__('os').cpu_count()}; "
        f"torch {torch.__version__}; python {platform.python_version()}; worker {device}",
        "ops": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", help="the worker's device")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/dispatch_floor.json")
    args = parser.parse_args()
    result = measure(args.device)
    existing: dict[str, Any] = {}
    if args.out.exists():
        existing = json.loads(args.out.read_text())
    existing[result["machine"]] = result["ops"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
