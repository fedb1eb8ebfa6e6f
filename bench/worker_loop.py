"""The worker's own cost per record: the compiled record loop against the Python one.

A training step reaches the worker as thousands of records (GPT-2-small: 3,799 a step, half
of them FREE; ResNet-50: 1,430), and on the H200 box the worker spent 33-45 ms of CPU a step
(docs/remote.md). This feeds an Executor the same BATCH frames through `run_frame` with the
compiled loop (gpupool/worker/_runloop.c) and without it, in one process, on tiny CPU tensors
(so the arithmetic is small and the same for both) and a memory limit that, like a CUDA
worker's, needs no word of stores and frees. The stream mixes what a step sends: elementwise
ops on two handles, ops with a scalar, views with a shape, ops with keyword arguments and a
dtype, reductions with a list argument, and a FREE for every tensor made.

    python bench/worker_loop.py [--steps 200] [--repeat 5] [--device cuda:0]

With --device cuda:0 the ops launch real kernels (the worker's CPU per record is what is
measured; the GPU is synchronized before the clock stops).

Writes bench/results/worker_loop.json: microseconds per record for each loop, the median of
--repeat alternating runs, and what the compiled loop saves.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import Kind, Rec, pack_records
from gpupool.protocol.v1.tensors import DTYPE_EXT, REMOTE_DEVICE_EXT, handle_ext
from gpupool.worker import executor as executor_module
from gpupool.worker.executor import Executor
from gpupool.worker.memory import NO_RESERVATION, Reservation

OPS = ["aten::add.Tensor", "aten::mul.Scalar", "aten::view", "aten::sum.dim_IntList",
       "aten::_to_copy", "aten::full", "aten::mul.Tensor"]  # fmt: skip
RECORDS_PER_BATCH = 400


class UncountedMemory:
    """A memory limit that, like CudaMemory, leaves the accounting to an allocator."""

    limit_bytes = None
    host_limit_bytes = None
    counts_storages = False

    def bounded(self) -> bool:
        return False

    def held_bytes(self) -> int:
        return 0

    def host_held_bytes(self) -> int:
        return 0

    def recount(self, tensors: list[torch.Tensor]) -> None:
        return None

    def reserve(self, nbytes: int) -> Reservation:
        return NO_RESERVATION

    def reserve_host(self, nbytes: int, what: str) -> Reservation:
        return NO_RESERVATION

    def peak_bytes(self) -> int:
        return 0

    def charge(self, tensors: list[torch.Tensor]) -> None:
        return None

    def release(self, tensor: torch.Tensor) -> None:
        return None

    def reset(self) -> None:
        return None

    def set_limit(self, limit_bytes: int | None) -> None:
        return None

    def make_room(self, exc: BaseException) -> bool:
        return False


class Quiet:
    client_arena = None
    worker_arena = None
    pinned = False

    def reply(self, head: list[Any], tail: memoryview | None = None) -> None:
        return None


def step_records(first_handle: int) -> list[list[Any]]:
    h = first_handle
    bf16 = DTYPE_EXT[torch.bfloat16]
    records: list[list[Any]] = []
    for _ in range(40):
        a, b, c, d, e, f = h, h + 1, h + 2, h + 3, h + 4, h + 5
        h += 6
        records += [
            [Rec.OP, 1, [handle_ext(1), handle_ext(2)], None, [a]],
            [Rec.OP, 2, [handle_ext(a), 0.5], None, [b]],
            [Rec.OP, 3, [handle_ext(b), [2, 2]], None, [c]],
            [Rec.OP, 4, [handle_ext(c), [1], False], None, [d]],
            [Rec.OP, 5, [handle_ext(d)], {"dtype": bf16}, [e]],
            [Rec.OP, 7, [handle_ext(a), handle_ext(b)], None, [f]],
            [Rec.FREE, a], [Rec.FREE, b], [Rec.FREE, c], [Rec.FREE, d], [Rec.FREE, e],
            [Rec.FREE, f],
        ]  # fmt: skip
    return records


def executor(compiled: bool, device: torch.device) -> Executor:
    ex = Executor("bench", device, UncountedMemory())
    if not compiled:
        ex._loop = None  # run_frame's Python path
    setup = [[Rec.DEF, i + 1, name] for i, name in enumerate(OPS)]
    f32 = {"dtype": DTYPE_EXT[torch.float32], "device": REMOTE_DEVICE_EXT}
    setup += [[Rec.OP, 6, [[4], 1.5], f32, [1]], [Rec.OP, 6, [[4], 2.5], f32, [2]]]
    ex.run_frame(pack_records([Kind.BATCH], setup), Quiet())
    return ex


def measure(compiled: bool, steps: int, device: torch.device) -> float:
    ex = executor(compiled, device)
    frames = []
    records = 0
    for step in range(steps):
        recs = step_records(100 + step * 1000)
        records += len(recs)
        for start in range(0, len(recs), RECORDS_PER_BATCH):
            frames.append(pack_records([Kind.BATCH], recs[start : start + RECORDS_PER_BATCH]))
    link = Quiet()
    started = time.thread_time()
    for body in frames:
        ex.run_frame(body, link)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    spent = time.thread_time() - started
    assert ex.error is None, ex.error
    assert set(ex.tensors) == {1, 2}, "every tensor made was freed"
    return spent / records * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results/worker_loop.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if not executor_module.compiled_loop():
        raise SystemExit("gpupool.worker._runloop is not built (or GPUPOOL_FASTPATH=0)")
    torch.set_num_threads(1)
    measure(True, 5, device), measure(False, 5, device)  # warm both
    compiled, python = [], []
    for _ in range(args.repeat):
        compiled.append(measure(True, args.steps, device))
        python.append(measure(False, args.steps, device))
    result = {
        "us_per_record_compiled": round(statistics.median(compiled), 2),
        "us_per_record_python": round(statistics.median(python), 2),
        "saved_us_per_record": round(statistics.median(python) - statistics.median(compiled), 2),
        "records_per_step": len(step_records(0)),
        "device": str(device),
        "torch": torch.__version__,
        "machine": f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})",
    }
    print(json.dumps(result))
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    rows = [r for r in (rows if isinstance(rows, list) else [rows]) if r["device"] != str(device)]
    args.out.write_text(json.dumps([*rows, result], indent=2) + "\n")


if __name__ == "__main__":
    main()
