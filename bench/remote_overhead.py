"""What a remote GPU costs: training steps run locally and through a gpupool worker.

Runs on a GPU server. Starts one worker (`python -m gpupool.worker --device cuda:0`) on the
local GPU, then measures, in one run, each workload twice in fresh processes:
  - local:  the program with the GPU (plain PyTorch);
  - remote: the same program in a process that sees no GPU (CUDA_VISIBLE_DEVICES=""), attached
            to the worker with gpupool.torch.attach() (a Unix socket: same host, shared memory).
Workloads: torchvision ResNet-50 (bf16 autocast, SGD) at batch 32 and 128; a GPT-2-small-shaped
transformers model built from its config (no weight download; bf16 autocast, AdamW) at
sequence 512; op throughput, round-trip latency, and host↔GPU copy bandwidth.
Writes bench/results/remote_overhead.json: a list of
{workload, batch, mode, local_ms, remote_ms, ratio, machine} (mode "eager"), plus the extra
fields each micro-benchmark has.

`--mode captured`: the remote side runs its training step through `gpupool.torch.capture`
(one message per step, replayed by the worker as a CUDA graph), still against the local
EAGER step of the same run; rows have mode "captured" and say how the worker replayed
(`remote_worker_modes`: graph or ops) and any capture warnings. `--mode compiled`: captured
as above with `compile=True`, so the worker compiles each step's program with Inductor
(Triton on a GPU worker, then a CUDA graph; C++ on a CPU worker); rows have mode "compiled".
`--mode torch-compile`: both sides train the model under `torch.compile` in float32 (bf16
autocast with `--amp`), the loss
differentiated outside the compiled call (locally Inductor on the GPU; remotely the forward
and backward graphs compiled on the worker, gpupool.torch.joint); rows also give the local
float32 eager step (`local_eager_ms`) and how the worker ran each graph (`remote_graphs`).
`--worker-device cpu` runs
the whole comparison on the CPU (a CPU worker against plain CPU PyTorch), for the small
workloads (mlp, cnn, gpt_tiny) on a machine without a GPU.

    python bench/remote_overhead.py [--steps 20] [--repeat 3]
                                    [--only resnet50,gpt2,ops,roundtrip,copy]
    python bench/remote_overhead.py --mode captured --only resnet50,gpt2
    python bench/remote_overhead.py --mode captured --worker-device cpu --only mlp,cnn,gpt_tiny
    python bench/remote_overhead.py --mode compiled --worker-device cpu \\
        --out bench/results/remote_compiled_cpu.json
    python bench/remote_overhead.py --mode torch-compile --worker-device cpu \\
        --out bench/results/remote_torch_compile_cpu.json
    python bench/remote_overhead.py --mode torch-compile --compile-target function \\
        --worker-device cpu --out bench/results/remote_torch_compile_function_cpu.json

torchvision and transformers are imported only inside the workloads that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "remote_overhead.json"
TOKEN = "bench-remote-overhead"
LEASE = "bench-lease"


# ---- workloads: each builds its state once and returns a step function ------------------


def resnet50_step(
    batch: int, device: str = "cuda", compiled: bool = False, amp: bool = False
) -> Any:
    """compiled: the model under torch.compile, in float32 unless `amp` (bf16 autocast)."""
    import torch
    import torch.nn.functional as F
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(batch, 3, 224, 224, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    call = torch.compile(model) if compiled else model

    def step() -> None:
        with torch.autocast(
            torch.device(device).type, dtype=torch.bfloat16, enabled=amp or not compiled
        ):
            loss = F.cross_entropy(call(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step.compiled = call  # type: ignore[attr-defined]
    return step


def gpt2_step(
    batch: int, sequence: int = 512, device: str = "cuda", compiled: bool = False, amp: bool = False
) -> Any:
    """compiled: as resnet50_step's, and without the KV cache a training step never reads."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    config._attn_implementation = "sdpa"
    if compiled:
        config.use_cache = False
    model = transformers.GPT2LMHeadModel(config).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (batch, sequence), device=device)
    call = torch.compile(model) if compiled else model

    def step() -> None:
        with torch.autocast(
            torch.device(device).type, dtype=torch.bfloat16, enabled=amp or not compiled
        ):
            loss = call(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step.compiled = call  # type: ignore[attr-defined]
    return step


def small_step(
    workload: str, batch: int, device: str, compiled: bool = False, target: str = "module"
) -> Any:
    """Small models for a machine without a GPU (CPU worker against CPU PyTorch): an MLP with
    SGD, a conv net with batch norm and Adam, a 2-layer causal transformer with AdamW.
    compiled with target "function": torch.compile of the loss function, which names the
    model, instead of the model."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    if workload == "mlp":
        model: nn.Module = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, 64)
    elif workload == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )  # fmt: skip
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(batch, 3, 16, 16)
    else:
        layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
        model = nn.Sequential(nn.Embedding(128, 64), nn.TransformerEncoder(layer, 2),
                              nn.Linear(64, 10))  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 128, (batch, 32))
    model.to(device)
    x, y = x.to(device), torch.randint(0, 10, (batch,), device=device)
    call = torch.compile(model) if compiled and target == "module" else model

    def loss_of(inputs: Any, labels: Any) -> Any:
        out = call(inputs)
        return F.cross_entropy(out if out.dim() == 2 else out.mean(1), labels)

    compiled_loss = torch.compile(loss_of) if compiled and target == "function" else loss_of

    def step() -> None:
        loss = compiled_loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step.compiled = call if target == "module" else compiled_loss  # type: ignore[attr-defined]
    return step


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(step: Any, steps: int, warmup: int, device: str = "cuda") -> dict[str, float]:
    """Mean milliseconds per step, GPU work included (ms), and of it the time the program
    spent in its step calls (issue_ms: what the client's Python costs while the device
    works; on a busy host the least noisy measure of what capture saves). Through a worker,
    also the worker's own time per step (worker_busy_ms: decoding records, calling ops,
    launching kernels) and its records per step: a step cannot be faster than the larger of
    issue_ms, worker_busy_ms and the GPU's time."""
    for _ in range(warmup):
        step()
    synchronize(device)
    before = _worker_stats()
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        step()
    issued, issued_cpu = time.perf_counter(), time.thread_time()
    synchronize(device)
    done = time.perf_counter()
    timed = {
        "ms": (done - start) / steps * 1e3,
        "issue_ms": (issued - start) / steps * 1e3,
        "issue_cpu_ms": (issued_cpu - start_cpu) / steps * 1e3,
    }
    after = _worker_stats()
    if before and after:
        records = (after["ops_total"] - before["ops_total"]) / steps
        busy_ms = (after["busy_s"] - before["busy_s"]) / steps * 1e3
        if "busy_cpu_s" in after:
            cpu_s = after["busy_cpu_s"] - before["busy_cpu_s"]
            timed["worker_busy_cpu_ms"] = cpu_s / steps * 1e3
        timed |= {
            "worker_busy_ms": busy_ms,
            "records_per_step": records,
            "worker_us_per_record": busy_ms / records * 1e3 if records else 0.0,
            "client_us_per_record": timed["issue_ms"] / records * 1e3 if records else 0.0,
        }
    return timed


def _worker_stats() -> dict[str, Any] | None:
    """The worker's counters when this process is attached to one (waits for its queue)."""
    if "gpupool.torch" not in sys.modules:  # a local run never imports it
        return None
    from gpupool.torch import runtime

    if not runtime.attached():
        return None
    stats = runtime.stream(0).sync()
    return stats if "busy_s" in stats else None


CAPTURE_WARMUP = 7
"""Calls before a captured step is timed: recordings until two agree (three), the worker's
side-stream warm-up run, the CUDA graph capture, and one replay to spare (compiled: the
Inductor compile comes at the second RUN and pushes the capture one RUN later)."""


def time_step(spec: dict[str, Any], step: Any, warmup: int, device: str) -> dict[str, Any]:
    """Time a workload's step, captured when the spec says so."""
    if spec.get("torch_compile"):
        # The trace comes at the second call, each graph's program after two recordings, and
        # the worker's compile at its second RUN (and a CUDA graph after that).
        timed: dict[str, Any] = time_steps(step, spec["steps"], max(warmup, 10), device)
        graphs = getattr(getattr(step.compiled, "forward", step.compiled), "training", None)
        if hasattr(graphs, "steps"):  # remote: how the worker ran the forward and backward graphs
            timed["graphs"] = [s.worker_programs() for s in graphs.steps()]
            timed["not_compiled"] = [s.not_compiled() for s in graphs.steps()]
            timed["declined"] = graphs.declined()
        return timed
    if not spec.get("capture"):
        return time_steps(step, spec["steps"], warmup, device)
    import warnings

    import gpupool.torch

    captured = gpupool.torch.capture(
        step, graph=spec.get("graph", True), compile=bool(spec.get("compile"))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gpupool.torch.CaptureWarning)
        timed = time_steps(captured, spec["steps"], max(warmup, CAPTURE_WARMUP), device)
    return {
        **timed,
        "replaying": captured.replaying,
        "worker_modes": captured.worker_modes(),
        "not_compiled": captured.not_compiled(),
        "capture_warnings": sorted({str(w.message)[:300] for w in caught}),
    }


def op_throughput(ops: int = 20000) -> dict[str, float]:
    """Small dependent ops: how fast a program can issue work (ms per op, ops per second)."""
    import torch

    x = torch.zeros(1024, device="cuda")
    for _ in range(200):
        x = x + 1
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ops):
        x = x + 1
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return {
        "ms": (done - start) / ops * 1e3,
        "ops_per_s": ops / (done - start),
        "issue_ops_per_s": ops / (issued - start),
    }


def round_trip(reads: int = 2000) -> dict[str, float]:
    """A value read back (`.item()` of a scalar that was just computed): ms per read."""
    import torch

    x = torch.zeros((), device="cuda")
    for _ in range(100):
        x.add_(1).item()
    start = time.perf_counter()
    for _ in range(reads):
        x.add_(1).item()
    return {"ms": (time.perf_counter() - start) / reads * 1e3}


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """Host→GPU and GPU→host copies of a pageable host tensor, GB/s."""
    import torch

    host = torch.randn(mib * (1 << 20) // 4)
    device_copy = host.to("cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        device_copy = host.to("cuda")
    torch.cuda.synchronize()
    h2d = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        back = device_copy.cpu()
    d2h = (time.perf_counter() - start) / repeats
    assert back.shape == host.shape
    gb = mib * (1 << 20) / 1e9
    return {"ms": (h2d + d2h) / 2 * 1e3, "h2d_gb_per_s": gb / h2d, "d2h_gb_per_s": gb / d2h}


def memory_isolation(limit_mib: int) -> dict[str, Any]:
    """A client that tries to raise its own limits still gets exactly its lease's memory."""
    import torch

    held = torch.empty(limit_mib * 3 // 4 * (1 << 20) // 4, device="cuda")
    torch.cuda.synchronize()
    try:
        too_much = torch.empty(limit_mib // 2 * (1 << 20) // 4, device="cuda")
        torch.cuda.synchronize()
        refused, message = False, f"allocated {too_much.numel() * 4 >> 20} MiB over the limit"
    except torch.OutOfMemoryError as exc:
        refused, message = True, str(exc).splitlines()[0][:300]
    still_works = float((held[:10] * 0 + 1).sum()) == 10.0
    return {
        "ms": 0.0,
        "refused_over_limit": refused,
        "still_works": still_works,
        "message": message,
    }


HOSTILE_ENV = {
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=200G",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "LD_PRELOAD": "",
    "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", ""),
}
"""What a tenant might set to escape its limits; the worker was started by the agent, so none
of it reaches the CUDA context."""


# ---- one measurement in its own process -------------------------------------------------


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs inside a child process: local (GPU visible) or remote (attached to the worker)."""
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])  # before torch starts any thread
    result = _measure(spec)
    if spec["mode"] == "remote":
        from gpupool.torch import dispatch

        result["fastpath"] = dispatch.fastpath_active()  # the compiled client hot path ran
    return result


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["mode"] == "remote":
        import gpupool.torch

        gpupool.torch.attach(workers=[spec["address"]], token=TOKEN, lease=LEASE)
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    workload, batch = spec["workload"], spec["batch"]
    # Remote runs see the worker as cuda whatever it runs on; a CPU comparison's local side
    # runs plain CPU PyTorch.
    device = "cpu" if spec["mode"] == "local" and spec.get("worker_device") == "cpu" else "cuda"
    if spec.get("worker_device") == "cpu":
        torch.set_num_threads(1)  # as the worker: one core each, on a host that has few
    compiled, amp = bool(spec.get("torch_compile")), bool(spec.get("amp"))
    if workload == "resnet50":
        step = resnet50_step(batch, device=device, compiled=compiled, amp=amp)
        return time_step(spec, step, 5, device)
    if workload == "gpt2":
        return time_step(
            spec, gpt2_step(batch, device=device, compiled=compiled, amp=amp), 3, device
        )
    if workload in SMALL:
        step = small_step(workload, batch, device, compiled, spec.get("compile_target", "module"))
        return time_step(spec, step, 5, device)
    if workload == "op_throughput":
        return op_throughput()
    if workload == "round_trip":
        return round_trip()
    if workload == "copy_256MiB":
        return copy_bandwidth()
    if workload == "isolation_memory":
        return memory_isolation(spec["limit_mib"])
    raise ValueError(f"unknown workload {workload}")


def run_child(
    spec: dict[str, Any],
    gpu_visible: bool,
    timeout_s: float,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    env = {**os.environ, **(extra_env or {})}
    if not gpu_visible:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def two_cores() -> tuple[list[int], list[int]]:
    """The hardware threads of two distinct physical cores of one socket (not core 0, which
    takes most interrupts where it can): one for the worker, one for the program, so that
    neither shares a core's execution units with the other (SMT siblings would)."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = int((topology / "physical_package_id").read_text())
            core = int((topology / "core_id").read_text())
        except (OSError, ValueError):
            package, core = 0, cpu
        cores.setdefault((package, core), []).append(cpu)
    by_package: dict[int, list[list[int]]] = {}
    for (package, _), threads in sorted(cores.items()):
        by_package.setdefault(package, []).append(threads)
    usable = max(by_package.values(), key=len)
    if len(usable) < 2:
        raise SystemExit("--pin needs two physical cores")
    return (usable[1], usable[2]) if len(usable) > 2 else (usable[0], usable[1])


def machine(on_cpu: bool = False) -> str:
    import torch

    if on_cpu:
        cpu = platform.processor() or platform.machine()
        return f"no GPU (CPU worker); {cpu} x{os.cpu_count()}; torch {torch.__version__}"
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip().splitlines()[0]  # fmt: skip
    except (OSError, IndexError, subprocess.SubprocessError):
        gpu = "unknown GPU"
    cpu = platform.processor() or platform.machine()
    return f"{gpu}; {cpu} x{os.cpu_count()}; torch {torch.__version__}"


def isolation_row(tmp: str, host: str, timeout_s: float) -> dict[str, Any]:
    from gpupool.protocol.v1.dataplane import start_worker_process

    limit_mib = 4096
    worker, ready = start_worker_process(
        LEASE, TOKEN, device="cuda:0", listen=f"unix:{tmp}/limited.sock", memory_limit_mib=limit_mib
    )
    try:
        spec = {"workload": "isolation_memory", "batch": 1, "steps": 1, "mode": "remote",
                "address": str(ready.address), "limit_mib": limit_mib}  # fmt: skip
        outcome = run_child(spec, gpu_visible=False, timeout_s=timeout_s, extra_env=HOSTILE_ENV)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    row: dict[str, Any] = {
        "workload": "isolation_memory", "batch": 1, "mode": "eager", "local_ms": None,
        "remote_ms": None, "ratio": None, "machine": host, "limit_mib": limit_mib,
        "client_env": sorted(HOSTILE_ENV),
    }  # fmt: skip
    return row | {k: v for k, v in outcome.items() if k != "ms"}


PLAN = [
    ("resnet50", 32),
    ("resnet50", 128),
    ("gpt2", 8),
    ("op_throughput", 1),
    ("round_trip", 1),
    ("copy_256MiB", 1),
]
SMALL = ("mlp", "cnn", "gpt_tiny")
CAPTURED_PLAN = [("resnet50", 32), ("resnet50", 128), ("gpt2", 8)]
"""What `--mode captured` measures on a GPU: training steps (the micro-benchmarks have none)."""
CPU_PLAN = [("mlp", 32), ("cnn", 32), ("gpt_tiny", 16)]
"""What `--worker-device cpu` measures: small models a CPU runs in milliseconds."""


def _row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row.get("workload"), row.get("batch"), row.get("mode"), row.get("spin_us", 0),
            bool(row.get("pinned")), row.get("compile_target") or "module")  # fmt: skip


def merged(path: Path, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows already in `path` that this run did not measure again (other modes, other
    workloads, other polling settings), then this run's rows."""
    try:
        kept = json.loads(path.read_text()) if path.exists() else []
    except (OSError, ValueError):
        kept = []
    if not isinstance(kept, list):
        kept = []
    fresh = {_row_key(row) for row in results}
    return [row for row in kept if isinstance(row, dict) and _row_key(row) not in fresh] + results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--only", default="", help="comma-separated workload names, or name:batch (resnet50:32)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="local/remote pairs per workload; the median is kept"
    )
    parser.add_argument("--transport", choices=["unix", "tcp"], default="unix")
    parser.add_argument("--timeout", type=float, default=900.0, help="per measurement, seconds")
    parser.add_argument(
        "--spin-us",
        type=int,
        default=None,
        help="worker and client poll the socket this long before sleeping (default: off)",
    )
    parser.add_argument(
        "--mode", choices=["eager", "captured", "compiled", "torch-compile"], default="eager"
    )
    parser.add_argument(
        "--no-graph",
        action="store_true",
        help="captured steps replay op by op on the worker instead of as a CUDA graph",
    )
    parser.add_argument(
        "--worker-device",
        default="cuda:0",
        help="cuda:0, or cpu: a CPU worker against CPU PyTorch (small workloads)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="worker on one physical core, the program (local and remote alike) on another",
    )
    parser.add_argument(
        "--amp",
        action="store_true",
        help="--mode torch-compile under bf16 autocast (both sides) instead of float32",
    )
    parser.add_argument(
        "--compile-target",
        choices=["module", "function"],
        default="module",
        help="--mode torch-compile on a CPU worker: compile the model, or the loss function "
        "that names it",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        try:
            print(json.dumps(measure(json.loads(args.child))), flush=True)
        except Exception:  # reported to the parent as this workload's error
            traceback.print_exc()
            return 1
        return 0

    from gpupool.protocol.v1.dataplane import start_worker_process

    wanted = {w for w in args.only.split(",") if w}
    on_cpu = args.worker_device == "cpu"
    base = CPU_PLAN if on_cpu else CAPTURED_PLAN if args.mode != "eager" else PLAN
    plan = [
        (w, b)
        for w, b in base
        if not wanted or w in wanted or w.split("_")[0] in wanted or f"{w}:{b}" in wanted
    ]
    torch_compile = args.mode == "torch-compile"
    extra: dict[str, Any] = {"capture": args.mode in ("captured", "compiled"),
                             "torch_compile": torch_compile, "graph": not args.no_graph,
                             "compile": args.mode == "compiled", "amp": args.amp,
                             "compile_target": args.compile_target,
                             "worker_device": "cpu" if on_cpu else "cuda"}  # fmt: skip
    worker_cpus: str | None = None
    if args.pin:
        worker_core, program_core = two_cores()
        worker_cpus = ",".join(map(str, worker_core))
        extra["cpus"] = program_core
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        listen = f"unix:{tmp}/worker.sock" if args.transport == "unix" else "tcp://127.0.0.1:0"
        worker, ready = start_worker_process(
            LEASE, TOKEN, device=args.worker_device, listen=listen, spin_us=args.spin_us,
            threads=1 if on_cpu else None, cpus=worker_cpus,
        )  # fmt: skip
        spin_env = {"GPUPOOL_SPIN_US": str(args.spin_us)} if args.spin_us else None
        try:
            host = machine(on_cpu)
            results: list[dict[str, Any]] = []
            for workload, batch in plan:
                spec = {"workload": workload, "batch": batch, "steps": args.steps, **extra}
                # The local side is always the eager step: what a captured step must beat.
                # With --repeat, local and remote alternate and the row is the run with the
                # median ratio (the box's other tenants make single runs swing); every
                # run's ratio is kept in `ratios`.
                runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
                for _ in range(args.repeat):
                    local = run_child(
                        {**spec, "mode": "local", "capture": False},
                        gpu_visible=not on_cpu,
                        timeout_s=args.timeout,
                    )
                    remote = run_child(
                        {**spec, "mode": "remote", "address": str(ready.address)},
                        gpu_visible=False,
                        timeout_s=args.timeout,
                        extra_env=spin_env,
                    )
                    if torch_compile:  # the same float32 step without torch.compile
                        local["eager_ms"] = run_child(
                            {**spec, "mode": "local", "torch_compile": False},
                            gpu_visible=not on_cpu,
                            timeout_s=args.timeout,
                        ).get("ms")
                    runs.append((local, remote))
                ratios = sorted(
                    (r["ms"] / lo["ms"], i)
                    for i, (lo, r) in enumerate(runs)
                    if "ms" in lo and "ms" in r
                )
                local, remote = runs[ratios[len(ratios) // 2][1]] if ratios else runs[0]
                row: dict[str, Any] = {
                    "workload": workload,
                    "batch": batch,
                    "mode": args.mode,
                    "amp": args.amp,
                    "compile_target": args.compile_target if torch_compile else None,
                    "local_ms": local.get("ms"),
                    "remote_ms": remote.get("ms"),
                    "ratio": (remote["ms"] / local["ms"])
                    if "ms" in local and "ms" in remote
                    else None,
                    "machine": host,
                    "transport": args.transport,
                    "spin_us": args.spin_us or 0,
                }
                if args.pin:
                    row["pinned"] = {"worker": worker_cpus, "program": extra["cpus"]}
                if args.repeat > 1:
                    row["ratios"] = [r for r, _ in ratios]
                for side, values in (("local", local), ("remote", remote)):
                    for key, value in values.items():
                        if key != "ms":
                            row[f"{side}_{key}"] = value
                results.append(row)
                print(json.dumps(row), flush=True)
            if (not wanted or "isolation" in wanted) and args.mode == "eager" and not on_cpu:
                results.append(isolation_row(tmp, host, args.timeout))
                print(json.dumps(results[-1]), flush=True)
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged(args.out, results), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
