"""Hot migration and swap of a running training program: pause, swap-out and restore times.

ResNet-50 trains on a remote GPU (worker on GPU 0) with extra device tensors that bring its
state to about --state-gib. Mid-run a successor worker starts on GPU 1 and takes the state over
while the program keeps training; the program follows it at its next op. Then the worker swaps
the idle program out to host memory, and its next step restores it. The same run without the
move is the reference: `loss_continuous` says the migrated run's losses equal it within
--loss-rtol (and show no jump at the move). Written as a list of {state_gib, pause_s, path,
swap_out_s, restore_s, restore_gbps, loss_continuous, machine, ...}; `path` is how the state
moved (cuda_ipc or shm on one host, stream between hosts or with --paths stream).

    python bench/migration.py --out bench/results/migration.json              # 2 GPUs
    python bench/migration.py --paths stream                                  # the cross-host path
    python bench/migration.py --device cpu --model tiny --state-gib 0.2 --out /tmp/m.json  # CPU
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gpupool.protocol.v1.dataplane import (  # noqa: E402
    WorkerCredentials,
    start_worker_process,
)

TOKEN = "bench-migration"
LEASE = "bench-migration"


def machine(device: str) -> str:
    if device == "cuda":
        import subprocess

        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        gpus = "; ".join(line.strip() for line in smi.splitlines())
        return f"{gpus}; torch {torch.__version__}; {platform.node()}, {os.cpu_count()} CPUs"
    return f"CPU workers; torch {torch.__version__}; {platform.node()}, {os.cpu_count()} CPUs"


def worker_device(device: str, index: int) -> str:
    return f"cuda:{index}" if device == "cuda" else "cpu"


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    """The largest relative gap between the migrated run's losses and the unmigrated run's,
    step by step (0.0 on CPU workers: the same ops in the same order give the same bits)."""
    pairs = list(zip(losses, reference, strict=False))
    return max((abs(a - b) / max(abs(b), 1e-3) for a, b in pairs), default=float("inf"))


def build(name: str) -> torch.nn.Module:
    """A torchvision model by name, or `tiny` (a small CNN) where torchvision is missing."""
    if name == "tiny":
        nn = torch.nn
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 100),
        )  # fmt: skip
    import torchvision

    model: torch.nn.Module = getattr(torchvision.models, name)(num_classes=100)
    return model


def train(args: argparse.Namespace, migrate: bool) -> dict[str, Any]:
    """One training run on a worker on GPU 0; with `migrate`, a successor worker on GPU 1 (or a
    new worker on GPU 0 where there is one GPU) takes the state over mid-run, then the idle
    program is swapped out and restored. Without, the reference the losses are compared to."""
    import gpupool.torch
    from gpupool.torch import runtime

    env = {**os.environ}
    target = 1 if args.device == "cuda" and torch.cuda.device_count() > 1 else 0
    # One lease: its workers share the lease's peer secret, which a successor needs.
    credentials = WorkerCredentials.generate(TOKEN)
    first, ready1 = start_worker_process(
        LEASE, credentials, env=env, device=worker_device(args.device, 0), idle_timeout_s=None
    )
    procs = [first]
    try:
        gpupool.torch.attach(workers=[str(ready1.address)], token=TOKEN, lease=LEASE)
        stream = runtime.stream(0)
        torch.manual_seed(0)
        model = build(args.model).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        # Weights and momentum are what the worker holds between steps (gradients are set to
        # None, activations are freed); a held buffer pads the state up to --state-gib.
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 2
        ballast_bytes = max(0, int(args.state_gib * (1 << 30)) - model_bytes)
        ballast = torch.ones(ballast_bytes // 4, device="cuda")
        g = torch.Generator().manual_seed(1)
        batches = [
            (torch.randn(args.batch, 3, args.image, args.image, generator=g),
             torch.randint(0, 100, (args.batch,), generator=g))
            for _ in range(4)
        ]  # fmt: skip
        on_device = [(x.cuda(), y.cuda()) for x, y in batches]
        losses: list[float] = []
        step_s: list[float] = []
        moved_at: int | None = None
        step = 0
        give_up_at = time.monotonic() + args.give_up_s
        while step < args.steps or (
            migrate and step > args.migrate_at and stream.elastic.moves == 0
        ):
            if time.monotonic() > give_up_at:
                raise RuntimeError("the program never followed its state to the new worker")
            if migrate and step == args.migrate_at:
                # Started beside the training loop: the program keeps running meanwhile.
                import threading

                def start_successor() -> None:
                    successor, _ = start_worker_process(
                        LEASE, credentials, env=env, device=worker_device(args.device, target),
                        restore_from=str(stream.address), idle_timeout_s=args.idle_s,
                        handoff_paths=args.paths,
                    )  # fmt: skip
                    procs.append(successor)

                threading.Thread(target=start_successor, daemon=True).start()
            moves = stream.elastic.moves
            started = time.perf_counter()
            xd, yd = on_device[step % len(on_device)]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(xd), yd)
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
            step_s.append(time.perf_counter() - started)
            if stream.elastic.moves != moves and moved_at is None:
                moved_at = step
            step += 1
        if not migrate:
            return {"losses": losses}
        pause_s = stream.elastic.last_pause_s
        moved_bytes = stream.elastic.last_bytes
        path = stream.elastic.last_path
        # Swap: the program goes idle; the new worker asks it to swap out after idle_s.
        deadline = time.monotonic() + args.idle_s + 120
        while not stream.elastic.swapped:
            if time.monotonic() > deadline:
                raise RuntimeError("the idle program was not swapped out")
            time.sleep(0.05)
        swap_out_s, swap_bytes = stream.elastic.last_swap_s, stream.elastic.last_bytes
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(on_device[0][0]), on_device[0][1])
        loss.backward()
        opt.step()
        float(loss.item())
        restore_s = stream.elastic.last_pause_s
        resumed_step_s = time.perf_counter() - started
        assert float(ballast[0].item()) == 1.0, "the state survived the moves"
        return {
            "state_gib": round(moved_bytes / (1 << 30), 3),
            "padding_gib": round(ballast_bytes / (1 << 30), 3),
            "pause_s": round(pause_s, 3),
            "path": path,
            "moved_gbps": round(moved_bytes / pause_s / 1e9, 2) if pause_s else None,
            "step_s_median": round(statistics.median(step_s), 4),
            "step_s_with_move": round(step_s[moved_at], 3) if moved_at is not None else None,
            "swap_out_s": round(swap_out_s, 3),
            "swapped_gib": round(swap_bytes / (1 << 30), 3),
            "restore_s": round(restore_s, 3),
            "restore_gbps": round(swap_bytes / restore_s / 1e9, 2) if restore_s else None,
            "resumed_step_s": round(resumed_step_s, 3),
            "moved_at_step": moved_at,
            "losses": losses,
            "moved": f"{worker_device(args.device, 0)} -> {worker_device(args.device, target)}",
            "model": args.model,
            "batch": args.batch,
            "machine": machine(args.device),
            **({"note": "one GPU visible: the move went to a new worker on the same GPU"}
               if args.device == "cuda" and target == 0 else {}),
        }  # fmt: skip
    finally:
        gpupool.torch.detach()
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    reference = train(args, migrate=False)["losses"]
    row = train(args, migrate=True)
    losses = row["losses"]
    gap = max_rel_diff(losses[: len(reference)], reference)
    row["loss_max_rel_diff"] = round(gap, 6)
    row["loss_continuous"] = row["moved_at_step"] is not None and gap <= args.loss_rtol
    row["losses"] = [round(v, 5) for v in losses]
    row["reference_losses"] = [round(v, 5) for v in reference]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--state-gib", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--migrate-at", type=int, default=10)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--paths", type=lambda v: v.split(","), default=None,
        help="handoff paths the successor accepts (default all: cuda_ipc,shm,stream)",
    )  # fmt: skip
    parser.add_argument(
        "--loss-rtol",
        type=float,
        default=0.05,
        help="largest relative loss gap to the unmigrated run called continuous",
    )
    parser.add_argument("--give-up-s", type=float, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/migration.json")
    args = parser.parse_args()
    row = run(args)
    rows: list[dict[str, Any]] = []
    if args.out.exists():
        key = ("machine", "state_gib", "path")
        rows = [r for r in json.loads(args.out.read_text())
                if any(r.get(k) != row[k] for k in key)]  # fmt: skip
    rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("losses")}))


if __name__ == "__main__":
    main()
