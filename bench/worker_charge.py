"""What charging ops before they run costs a CPU worker, per record.

A CPU worker (the fake backend, what CI runs the whole torch suite on) has no allocator to
hold its lease's limit, so `gpupool.worker.admission` charges every op's outputs and in-place
growth before it runs, from meta kernels over the worker's own tensors, remembered per
signature. This feeds the same BATCH frames as bench/worker_loop.py (a step's mix of
elementwise ops, scalars, views, reductions, casts and a FREE for every tensor made; tiny
tensors, so the arithmetic is small) through one Executor per way of counting:

- uncounted: a limit that needs no word of stores (a CUDA worker's; the compiled fast store);
- charged after: the storages counted once stored, as a CPU worker did before this;
- charged before: counted, and each op charged first (its signature looked up, its meta
  kernel run once per new signature);
- unlimited: counted, with no limit to charge against (a worker without one, as CI's torch
  suite runs): the charge ahead is skipped.

It also times one meta prediction (a signature never seen: what a stream of ever new shapes
costs per op).

    python bench/worker_charge.py [--steps 200] [--repeat 5]

Writes bench/results/worker_charge.json: microseconds per record for each way, the median of
--repeat alternating runs, what charging before adds per OP record, and microseconds per meta
prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_loop import OPS, RECORDS_PER_BATCH, Quiet, UncountedMemory, step_records

from gpupool.protocol.v1.dataplane import Kind, Rec, pack_records
from gpupool.protocol.v1.tensors import DTYPE_EXT, REMOTE_DEVICE_EXT
from gpupool.worker.admission import Admission
from gpupool.worker.executor import Executor
from gpupool.worker.memory import HostMemory

WAYS = ("uncounted", "charged_after", "charged_before", "unlimited")


def executor(way: str) -> Executor:
    if way == "uncounted":
        ex = Executor("bench", torch.device("cpu"), UncountedMemory())
    elif way == "unlimited":  # a worker without a limit (CI's torch suite): nothing to refuse
        ex = Executor("bench", torch.device("cpu"), HostMemory(None))
    else:
        ex = Executor("bench", torch.device("cpu"), HostMemory(1 << 30))
        if way == "charged_after":
            ex._admission = None  # ops are wrapped at DEF: none are
    setup = [[Rec.DEF, i + 1, name] for i, name in enumerate(OPS)]
    f32 = {"dtype": DTYPE_EXT[torch.float32], "device": REMOTE_DEVICE_EXT}
    setup += [[Rec.OP, 6, [[4], 1.5], f32, [1]], [Rec.OP, 6, [[4], 2.5], f32, [2]]]
    ex.run_frame(pack_records([Kind.BATCH], setup), Quiet())
    return ex


def frames(steps: int) -> tuple[list[bytes], int, int]:
    bodies: list[bytes] = []
    records = ops = 0
    for step in range(steps):
        recs = step_records(100 + step * 1000)
        records += len(recs)
        ops += sum(1 for r in recs if r[0] == Rec.OP)
        for start in range(0, len(recs), RECORDS_PER_BATCH):
            bodies.append(pack_records([Kind.BATCH], recs[start : start + RECORDS_PER_BATCH]))
    return bodies, records, ops


def measure(way: str, steps: int) -> tuple[float, int]:
    """CPU microseconds per record over `steps` steps, and the OP records among them."""
    ex = executor(way)
    bodies, records, ops = frames(steps)
    link = Quiet()
    started = time.thread_time()
    for body in bodies:
        ex.run_frame(body, link)
    spent = time.thread_time() - started
    assert ex.error is None, ex.error
    assert set(ex.tensors) == {1, 2}, "every tensor made was freed"
    return spent / records * 1e6, ops


def meta_prediction_us(repeat: int) -> float:
    """One prediction of a signature never seen (the cache bypassed), per op of a step."""
    admission = Admission(HostMemory(None))
    a, b = torch.ones(4), torch.ones(4)
    aten = torch.ops.aten
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
        (aten.add.Tensor, (a, b), {}),
        (aten.mul.Scalar, (a, 0.5), {}),
        (aten.view.default, (a, [2, 2]), {}),
        (aten.sum.dim_IntList, (a.view(2, 2), [1], False), {}),
        (aten._to_copy.default, (a,), {"dtype": torch.bfloat16}),
        (aten.mul.Tensor, (a, b), {}),
    ]
    for fn, args, kwargs in calls:  # the first meta call of each op loads its kernel
        admission._predict(fn._op, args, kwargs)
    started = time.thread_time()
    for _ in range(repeat):
        for fn, args, kwargs in calls:
            admission._predict(fn._op, args, kwargs)
    return (time.thread_time() - started) / (repeat * len(calls)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/worker_charge.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    for way in WAYS:
        measure(way, 5)  # warm: meta kernels loaded, signatures seen
    runs: dict[str, list[float]] = {way: [] for way in WAYS}
    ops = records = 0
    for _ in range(args.repeat):
        for way in WAYS:
            us, ops = measure(way, args.steps)
            runs[way].append(us)
    _, records, ops = frames(1)
    median = {way: statistics.median(values) for way, values in runs.items()}
    before_vs_after = median["charged_before"] - median["charged_after"]
    result = {
        "us_per_record": {way: round(value, 2) for way, value in median.items()},
        "charge_before_us_per_op": round(before_vs_after * records / ops, 2),
        "meta_prediction_us": round(meta_prediction_us(200), 1),
        "records_per_step": records,
        "ops_per_step": ops,
        "load_average_1m": round(os.getloadavg()[0], 1),
        "torch": torch.__version__,
        "machine": f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})",
    }
    print(json.dumps(result))
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
