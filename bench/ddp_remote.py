"""DDP step time, local against remote: the same two-rank (or N-rank) DDP program on the
machine's GPUs with NCCL, then through gpupool workers (one per GPU, the ranks as clients
without a GPU), for ResNet-50 and GPT-2-small.

    python bench/ddp_remote.py                     # a machine with 2 GPUs: both models
    python bench/ddp_remote.py --tiny --device cpu # CPU workers, tiny models (what CI runs)

Writes bench/results/ddp_remote.json (or --out) and prints one line per model. The step time
is the median over the timed steps of rank 0, each step ending with `loss.item()`, so that
queued remote work is inside the step it belongs to. ResNet-50 is torchvision's where it is
installed, else the same architecture built here from torch.nn (the JSON says which);
GPT-2-small is written here in plain torch (12 layers, 768 wide, 12 heads, 50,257 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEASE = "bench-ddp"
TOKEN = "bench-ddp-token"
PEER_SECRET = "bench-ddp-peer"


# ---- the models ---------------------------------------------------------------------------


def resnet(layers: tuple[int, ...], width: int, classes: int) -> Any:
    """ResNet with bottleneck blocks ([3, 4, 6, 3], 64: ResNet-50), in plain torch.nn."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, mid: int, stride: int) -> None:
            super().__init__()
            cout = mid * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid),
                nn.ReLU(inplace=True), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
            )  # fmt: skip
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.skip(x))

    blocks: list[nn.Module] = [
        nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]  # fmt: skip
    cin = width
    for stage, count in enumerate(layers):
        mid = width * 2**stage
        for i in range(count):
            blocks.append(Bottleneck(cin, mid, 2 if i == 0 and stage > 0 else 1))
            cin = mid * 4
    blocks += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*blocks)


def gpt2(layers: int, dim: int, heads: int, vocab: int, seq: int) -> Any:
    """GPT-2 (pre-norm blocks, learned positions, tied embedding), in plain torch.nn."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(dim, dim=2)
            q, k, v = (z.view(b, t, heads, dim // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, dim))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln = nn.LayerNorm(dim)
            for table in (self.tok, self.pos):
                nn.init.normal_(table.weight, std=0.02)  # GPT-2's initialisation

        def forward(self, idx: Any) -> Any:
            positions = torch.arange(idx.shape[1], device=idx.device)
            x = self.blocks(self.tok(idx) + self.pos(positions))
            return self.ln(x) @ self.tok.weight.t()

    return GPT()


def workload(name: str, tiny: bool) -> tuple[Any, Any, Any, str]:
    """(model, inputs, targets, where the model came from) on the host."""
    import torch

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "resnet50":
        source = "torch.nn (bench/ddp_remote.py)"
        if tiny:
            model = resnet((1, 1, 1, 1), 8, 10)
            x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        else:
            try:
                import torchvision

                model, source = torchvision.models.resnet50(), "torchvision"
            except ImportError:
                model = resnet((3, 4, 6, 3), 64, 1000)
            x = torch.randn(32, 3, 224, 224, generator=g)
            y = torch.randint(0, 1000, (32,), generator=g)
        return model, x, y, source
    if name == "gpt2":
        layers, dim, heads, vocab, seq, batch = (
            (2, 64, 4, 256, 32, 2) if tiny else (12, 768, 12, 50257, 512, 8)
        )
        model = gpt2(layers, dim, heads, vocab, seq)
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        return model, x, torch.roll(x, -1, 1), "plain torch (bench/ddp_remote.py)"
    raise SystemExit(f"unknown model {name}")


# ---- one rank -----------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    """One rank: attach to its worker (remote), or take its GPU (local); time DDP steps."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.phase == "remote":
        import gpupool.torch

        gpupool.torch.attach(
            workers=os.environ["BENCH_WORKERS"].split(","), token=TOKEN, lease=LEASE, rank=rank
        )
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if gpu else "gloo")
    model, x, y, source = workload(args.model, args.tiny)
    model = DDP(model.to(device), device_ids=[local_rank] if gpu else None)
    if args.model == "gpt2":
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = x.to(device), y.to(device)
    amp = gpu and not args.tiny
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())  # the step's end: everything queued for it has run
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    dist.barrier()
    if rank == 0:
        record = {
            "median_step_ms": round(statistics.median(times) * 1e3, 2),
            "steps_ms": [round(t * 1e3, 2) for t in times],
            "losses": losses,
            "model_source": source,
            "device": str(device),
        }
        print("RESULT " + json.dumps(record), flush=True)
    dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_phase(
    args: argparse.Namespace, phase: str, model: str, workers: list[str]
) -> dict[str, Any]:
    env = {
        **os.environ,
        "WORLD_SIZE": str(args.ranks),
        "LOCAL_WORLD_SIZE": str(args.ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    if phase == "remote":
        env |= {"BENCH_WORKERS": ",".join(workers), "CUDA_VISIBLE_DEVICES": ""}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = [
        sys.executable, __file__, "--rank-child", "--phase", phase, "--model", model,
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        *(["--tiny"] if args.tiny else []),
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            argv,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(args.ranks)
    ]
    result: dict[str, Any] | None = None
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=args.timeout_s)
            if proc.returncode != 0:
                raise SystemExit(f"{phase} {model}: a rank failed:\n{err[-3000:]}")
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT ") :])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if result is None:
        raise SystemExit(f"{phase} {model}: rank 0 printed no result")
    return result


def start_workers(args: argparse.Namespace) -> list[Any]:
    sys.path.insert(0, str(ROOT / "src"))
    from gpupool.protocol.v1.dataplane import (
        WorkerCredentials,
        parse_address,
        send_control,
        start_worker_process,
    )

    started = []
    for i in range(args.ranks):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        device = "cpu"
        if args.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(i)
            device = "cuda:0"
        credentials = WorkerCredentials.generate(TOKEN, PEER_SECRET)
        proc, ready = start_worker_process(
            LEASE, credentials, env=env, device=device, threads=1 if args.tiny else None
        )
        started.append((proc, str(ready.address), credentials.control))
    addresses = [address for _, address, _ in started]
    for _, address, control in started:
        send_control(
            parse_address(address), LEASE, control, {"op": "peers", "endpoints": addresses}
        )
    return started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--models", default="resnet50,gpt2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="small models (CPU runs, tests)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ddp_remote.json")
    parser.add_argument("--label", default=None)
    parser.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=["local", "remote"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        rank_main(args)
        return
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.device_count() >= args.ranks else "cpu"
    report: dict[str, Any] = {
        "label": args.label or ("tiny" if args.tiny else socket.gethostname()),
        "ranks": args.ranks,
        "device": args.device,
        "steps": args.steps,
        "models": {},
    }
    workers = start_workers(args)
    try:
        for model in args.models.split(","):
            local = run_phase(args, "local", model, [])
            remote = run_phase(args, "remote", model, [address for _, address, _ in workers])
            ratio = remote["median_step_ms"] / local["median_step_ms"]
            report["models"][model] = {
                "local": local,
                "remote": remote,
                "remote_over_local": round(ratio, 3),
            }
            print(
                f"{model}: local {local['median_step_ms']:.1f} ms, remote "
                f"{remote['median_step_ms']:.1f} ms a step ({ratio:.2f}x), {args.ranks} ranks on "
                f"{args.device} ({local['model_source']})",
                flush=True,
            )
    finally:
        for proc, _, _ in workers:
            proc.terminate()
        for proc, _, _ in workers:
            proc.wait(timeout=30)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
