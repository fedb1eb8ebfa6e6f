"""PyTorch's whole OpInfo database on a remote CPU worker against the same samples run locally.

Up to 3 samples per OpInfo, three passes (fp32 forward, bf16 forward, fp32 backward), only the
dtypes CUDA supports for each op (tests/torch/op_sweep.py says how samples are judged). Writes
bench/results/opinfo_sweep.json: per pass the pass %, silent mismatches and errors apart, and
the failures grouped by cause, under `--label` (default `after`).

    python bench/opinfo_sweep.py [--per-op 3] [--every 1] [--passes fp32_forward,...]
                                 [--label after] [--ops add,mul] [--shard K/N] [--deadline-s S]

`--shard K/N` takes every N-th op from the K-th (1-based), so N runs cover the database once
(bench/gpu/run_issue21_gpu.sh splits the H200 sweep this way); `--deadline-s` stops starting
ops after that long, shared out over the passes, and counts the ops left out.

On the GPU machine, `GPUPOOL_TEST_WORKER_DEVICE=cuda:0` runs the worker on the GPU while this
process stays a client without a GPU (CUDA_VISIBLE_DEVICES=); the local side is then the CPU.
To judge a CUDA worker against the local GPU instead, the sweep runs twice:

    python bench/opinfo_sweep.py --record R.pt ...      # the client: samples and remote results
    python bench/opinfo_sweep.py --replay R.pt --out ... # a process with the GPU: judges them

(tests/torch/op_sweep.py, `record_op` / `replay_op`): the same samples, the same seeds, no
CPU-reference exemptions. bench/gpu/run_issue21_gpu.sh does both, a part per shard.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "torch"))
sys.path.insert(0, str(ROOT))  # tests.timing, which the worker fixtures use
RESULTS = ROOT / "bench" / "results" / "opinfo_sweep.json"
LEASE = "lease-sweep"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-op", type=int, default=3)
    parser.add_argument("--every", type=int, default=1, help="only ops whose name hash %% N == 0")
    parser.add_argument("--passes", default="fp32_forward,bf16_forward,fp32_backward")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--verbose", action="store_true", help="name each op on stderr first")
    parser.add_argument("--shard", default="1/1", help="K/N: every N-th op from the K-th")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="0: no deadline")
    parser.add_argument("--record", default="", help="keep samples and remote results here")
    parser.add_argument("--replay", default="", help="judge a --record file on --device")
    parser.add_argument("--device", default="cuda", help="the replay's local device")
    options = parser.parse_args()
    if options.record and options.replay:
        parser.error("--record and --replay are two runs")
    if options.replay:
        replay(options)
        return
    shard, shards = (int(part) for part in options.shard.split("/"))
    if not 1 <= shard <= shards:
        parser.error("--shard K/N needs 1 <= K <= N")

    import torch
    from op_sweep import PASSES, Tally, applies, full_name, op_db, record_op, run_op, sampled
    from torch_workers import TOKEN, WORKER_DEVICE, start_worker

    import gpupool.torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    worker = start_worker(LEASE)
    state = {"worker": worker}

    def attach() -> None:
        gpupool.torch.attach(workers=[state["worker"].address], token=TOKEN, lease=LEASE)

    def reattach() -> None:
        """A sample killed the session: count it, start a fresh worker, go on."""
        gpupool.torch.detach()
        state["worker"].stop()
        state["worker"] = start_worker(LEASE)
        attach()

    attach()
    ops = sampled(op_db(), options.every)
    if options.ops:
        wanted = set(options.ops.split(","))
        ops = [op for op in ops if full_name(op) in wanted or op.name in wanted]
    ops = ops[shard - 1 :: shards]
    passes = options.passes.split(",")
    report: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    not_run_by_pass: dict[str, int] = {}
    lost = 0
    begun = time.perf_counter()
    try:
        for number, which in enumerate(passes):
            assert which in PASSES, which
            tally = Tally()
            started = time.perf_counter()
            # Each pass may use its share of what is left of the deadline.
            left_s = options.deadline_s - (started - begun)
            stop_at = started + left_s / (len(passes) - number) if options.deadline_s else None
            not_run = 0
            for op in ops:
                if not applies(op, which):
                    continue
                if stop_at is not None and time.perf_counter() > stop_at:
                    not_run += 1
                    continue
                before = len(tally.outcomes)
                if options.verbose:
                    print(which, full_name(op), file=sys.stderr, flush=True)
                if options.record:
                    entry = record_op(op, which, options.per_op)
                    entries.append(entry)
                    if any("WorkerLost" in str(r["error"]) for r in entry["samples"]):
                        lost += 1
                        reattach()
                    continue
                run_op(op, which, options.per_op, tally, on_lost=reattach)
                lost += sum("WorkerLost" in o.cause for o in tally.outcomes[before:])
            if options.record:
                ran = sum(e["which"] == which for e in entries)
                print(f"{which}: {ran} ops recorded ({not_run} left out by the deadline)")
                not_run_by_pass[which] = not_run
                continue
            report[which] = show(which, tally, time.perf_counter() - started, not_run)
    finally:
        gpupool.torch.detach()
        state["worker"].stop()
    settings = {
        "per_op": options.per_op, "every": options.every, "ops": len(ops),
        "shard": options.shard, "deadline_s": options.deadline_s,
    }  # fmt: skip
    machine = (
        f"{platform.machine()} x{os.cpu_count()}; worker device {WORKER_DEVICE}; "
        f"torch {torch.__version__}; python {platform.python_version()}"
    )
    if options.record:
        kept = {"entries": entries, "settings": settings, "machine": machine,
                "sessions_lost": lost, "not_run": not_run_by_pass}  # fmt: skip
        # pickle, not torch.save: its pickler refuses some samples' objects that pickle takes
        Path(options.record).write_bytes(pickle.dumps(kept))
        print(f"recorded to {options.record}")
        return
    report["sessions_lost"] = lost
    report["machine"] = machine
    report["settings"] = settings
    write(options.out, options.label, report)


def show(which: str, tally: Any, seconds: float, not_run: int) -> dict[str, Any]:
    """A pass's summary, printed: the pass %, each silent mismatch named, the commonest causes."""
    summary: dict[str, Any] = tally.summary()
    summary["seconds"] = round(seconds, 1)
    summary["ops_not_run"] = not_run
    print(
        f"{which}: {summary['pass_pct']:.2f} % of {summary['tried']} samples pass, "
        f"{summary['mismatches']} mismatches, {summary['errors']} errors "
        f"({summary['seconds']} s; {not_run} ops left out by the deadline)",
        flush=True,
    )
    for failure in summary["failures"]:
        if failure["result"] == "mismatch":  # silent wrong values, each named
            print(f"  MISMATCH {failure['op']}[{failure['sample']}]: "
                  f"{failure['cause'][:200]}", flush=True)  # fmt: skip
    for cause in summary["causes"][:8]:
        print(f"  {cause['samples']:3d} x {cause['cause'][:150]}", flush=True)
    return summary


def replay(options: argparse.Namespace) -> None:
    """Judge a --record file's remote results against the same samples on a local device."""
    import torch
    from op_sweep import PASSES, Tally, full_name, op_db, replay_op

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    kept = pickle.loads(Path(options.replay).read_bytes())  # our own file, made by --record
    by_name = {full_name(op): op for op in op_db()}
    report: dict[str, Any] = {}
    for which in PASSES:
        entries = [e for e in kept["entries"] if e["which"] == which]
        if not entries:
            continue
        tally = Tally()
        started = time.perf_counter()
        for entry in entries:
            replay_op(by_name[entry["op"]], entry, tally, options.device)
        report[which] = show(which, tally, time.perf_counter() - started,
                             kept["not_run"].get(which, 0))  # fmt: skip
    report["sessions_lost"] = kept["sessions_lost"]
    report["machine"] = f"{kept['machine']}; judged against local {options.device}" + (
        f" ({torch.cuda.get_device_name(0)})" if options.device.startswith("cuda") else ""
    )
    report["settings"] = kept["settings"]
    write(options.out, options.label, report)


def write(out: str, label: str, report: dict[str, Any]) -> None:
    path = Path(out)
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored[label] = report
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"written to {path} under {label!r}")


if __name__ == "__main__":
    main()
