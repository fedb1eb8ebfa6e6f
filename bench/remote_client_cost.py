"""What the gpupool client runtime itself costs per op, measured without a GPU.

A CPU worker (`python -m gpupool.worker --device cpu`, one thread, Unix socket) runs the ops;
the client process drives a small ResNet-shaped network (bottleneck blocks, batch norm, bf16
autocast, SGD with momentum and weight decay) with tiny tensors, so the worker's arithmetic
is negligible and what is measured is the client: dispatch, plan-cache lookups, autocast,
record encoding, handle bookkeeping and autograd. `--workload gpt2` drives a transformers
GPT2LMHeadModel built from a GPT-2-small-shaped config (12 layers, 12 heads, bf16 autocast,
AdamW) with a tiny hidden size, vocabulary and sequence: the op structure of
bench/remote_overhead.py's gpt2 step (the one issue 4 measures on the GPU) at no arithmetic.
Attention dropout is off: with it a CPU worker's SDPA choice is the math kernel, where the
GPU's is flash (one fused op, as here without it).

- `issue_ms`: wall time for the client to issue one training step (every record queued or
  sent; the worker is not waited for), mean over the timed steps;
- `issue_cpu_ms`: the client thread's CPU time for the same;
- `us_per_op`: issue_ms / records per step (OP, DEF, FREE and PUT records alike);
- `round_trip_ms`: `x.add_(1).item()` on a 0-d tensor: one op and one read, a full wait;
- `worker_busy_ms`: the worker's own time per step (decoding records, looking up handles,
  calling ops), from its `busy_s` counter, measured over steps the client issued back to back
  (`worker_us_per_record` = that / records): on a GPU the step is only as fast as the largest
  of the client's issue time, the worker's time and the GPU's time, when they overlap.

Numbers in bench/results/remote_client_cost.json come from a 2-core CPU box (client and
worker share the two cores), not the GPU server; compare "before" and "after" with each other,
not with bench/results/remote_overhead.json.

    python bench/remote_client_cost.py [--workload resnet|gpt2] [--steps 30] [--repeat 3]
                                       [--label after] [--profile F] [--ab]

Each number is the median over --repeat runs (each with a fresh worker): the box is shared and
noisy. `before` was measured with the previous sources first on PYTHONPATH. gpt2 numbers are
stored under `gpt2_<label>`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "remote_client_cost.json"
TOKEN = "bench-client-cost"
LEASE = "bench-client-cost"


def build(batch: int, blocks: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            inner = width // 2
            self.conv1 = nn.Conv2d(width, inner, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(inner)
            self.conv2 = nn.Conv2d(inner, inner, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(inner)
            self.conv3 = nn.Conv2d(inner, width, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = F.relu(self.bn1(self.conv1(x)))
            out = F.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return F.relu(out + x)

    width = 8
    model = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        *[Bottleneck(width) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(batch, 3, 8, 8, device="cuda")
    labels = torch.randint(0, 10, (batch,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def build_gpt2(batch: int) -> Any:
    import torch
    import transformers

    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=96, n_layer=12, n_head=12, attn_pdrop=0.0
    )
    config._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(config).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (batch, 16), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def measure(
    workload: str, steps: int, blocks: int, profile: str | None, spin_us: int, ab: bool = False
) -> dict[str, Any]:
    import torch

    import gpupool.torch
    from gpupool.protocol.v1.dataplane import start_worker_process
    from gpupool.torch import dispatch, runtime

    tmp = tempfile.mkdtemp(prefix="gp-bench-")
    options: dict[str, Any] = {"spin_us": spin_us} if spin_us else {}
    worker, ready = start_worker_process(
        LEASE, TOKEN, device="cpu", listen=f"unix:{tmp}/w.sock", threads=1, **options
    )
    try:
        gpupool.torch.attach(workers=[str(ready.address)], token=TOKEN, lease=LEASE)
        stream = runtime.stream(0)
        torch.manual_seed(0)
        step = build_gpt2(batch=2) if workload == "gpt2" else build(batch=2, blocks=blocks)

        counted = [0]
        original_emit = stream.emit

        def counting_emit(record: list[Any]) -> None:
            counted[0] += 1
            original_emit(record)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        # Records per step: ops plus frees (appended directly), counted over one step.
        before = _records_sent(stream)
        dispatch.use_fastpath(False)  # the compiled path appends records without emit()
        stream.emit = counting_emit  # type: ignore[method-assign]
        step()
        stream.emit = original_emit  # type: ignore[method-assign]
        torch.cuda.synchronize()
        records = _records_sent(stream) - before
        ops = counted[0]

        fast = dispatch.use_fastpath(True)
        walls, cpus = [], []
        py_walls: list[float] = []
        py_cpus: list[float] = []
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
        for i in range(steps * 2 if ab else steps):
            # --ab: steps alternate between the compiled hot path and the Python one, so
            # both see the same process, worker and machine load.
            python = ab and i % 2 == 1
            if ab:
                dispatch.use_fastpath(not python)
            torch.cuda.synchronize()  # start each step with an idle worker and an empty queue
            if profiler:
                profiler.enable()
            c0, w0 = time.thread_time(), time.perf_counter()
            step()
            w1, c1 = time.perf_counter(), time.thread_time()
            if profiler:
                profiler.disable()
            (py_walls if python else walls).append(w1 - w0)
            (py_cpus if python else cpus).append(c1 - c0)
        dispatch.use_fastpath(True)
        torch.cuda.synchronize()
        if profiler and profile:
            profiler.dump_stats(profile)

        # The worker's own time: steps issued back to back, so it always has records queued.
        busy_steps = max(5, steps // 2)
        start_stats = stream.sync()
        for _ in range(busy_steps):
            step()
        end_stats = stream.sync()
        busy_ms = (end_stats["busy_s"] - start_stats["busy_s"]) / busy_steps * 1e3

        x = torch.zeros((), device="cuda")
        for _ in range(200):
            x.add_(1).item()
        reads = 2000
        start = time.perf_counter()
        for _ in range(reads):
            x.add_(1).item()
        round_trip = (time.perf_counter() - start) / reads
        issue, issue_cpu = _lower_half(walls), _lower_half(cpus)
        extra: dict[str, Any] = {}
        if ab:
            extra = {
                "python_issue_ms": _lower_half(py_walls) * 1e3,
                "python_issue_cpu_ms": _lower_half(py_cpus) * 1e3,
            }
        return {
            "fastpath": fast,
            **extra,
            "ops_per_step": ops,
            "records_per_step": records,
            "issue_ms": issue * 1e3,
            "issue_cpu_ms": issue_cpu * 1e3,
            "us_per_op": issue / ops * 1e6,
            "ops_per_s": ops / issue,
            "round_trip_ms": round_trip * 1e3,
            "worker_busy_ms": busy_ms,
            "worker_us_per_record": busy_ms / records * 1e3,
        }
    finally:
        gpupool.torch.detach()
        worker.terminate()
        worker.wait(10)


def _lower_half(samples: list[float]) -> float:
    """Mean of the lower half: a shared box's noise only ever adds time."""
    ordered = sorted(samples)
    half = ordered[: len(ordered) // 2 + 1]
    return sum(half) / len(half)


def _records_sent(stream: Any) -> int:
    stats = stream.sync()
    return int(stats.get("ops_total", 0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=["resnet", "gpt2"], default="resnet")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="fresh workers; medians kept")
    parser.add_argument(
        "--spin-us", type=int, default=0, help="busy-poll: worker --spin-us, client a third"
    )
    parser.add_argument("--label", default=None, help="store the numbers under this key")
    parser.add_argument("--profile", default=None, help="write cProfile stats of the steps")
    parser.add_argument(
        "--ab",
        action="store_true",
        help="alternate steps between the compiled hot path and the Python one (python_* keys)",
    )
    args = parser.parse_args()
    if args.spin_us:
        os.environ["GPUPOOL_SPIN_US"] = str(max(1, args.spin_us // 3))
    import torch

    runs = [
        measure(args.workload, args.steps, args.blocks, args.profile, args.spin_us, args.ab)
        for _ in range(max(1, args.repeat))
    ]
    result: dict[str, Any] = {
        key: sorted(run[key] for run in runs)[len(runs) // 2] for key in runs[0]
    }  # each key's median
    result["runs"] = runs
    result["spin_us"] = args.spin_us
    result["workload"] = args.workload
    result["machine"] = (
        f"{platform.machine()} x{os.cpu_count()} CPU only (client and CPU worker share it); "
        f"torch {torch.__version__}; python {sys.version.split()[0]}"
    )
    print(json.dumps(result, indent=2))
    if args.label:
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        data["note"] = (
            "Measured on a 2-core CPU box with a CPU worker (bench/remote_client_cost.py), not "
            "on the GPU server: client cost per op and Unix-socket round trip, before and after "
            "the client hot-path work."
        )
        data[args.label if args.workload == "resnet" else f"gpt2_{args.label}"] = result
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
