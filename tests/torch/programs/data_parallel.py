"""One rank of a data-parallel training program, run locally (gloo on the CPU) or on remote
GPUs (gpupool): `python data_parallel.py ddp|fsdp STEPS`, under torchrun or with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Prints one JSON line: the rank's losses and the
trained parameters, which the tests compare between the two runs."""

import fcntl
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def model_for(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    ).to(device)


def batches(rank: int, steps: int, accumulate: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own data, made on the host so that both runs see the same values."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        for _ in range(steps * accumulate)
    ]


def main() -> None:
    mode, steps = sys.argv[1], int(sys.argv[2])
    accumulate = 2
    remote = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = f"cuda:{local_rank}" if remote else "cpu"
    if remote:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if remote else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_for(device)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Small buckets: several all-reduces a step, as a large model has.
        trained = DDP(model, device_ids=[local_rank] if remote else None, bucket_cap_mb=0.002)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda" if remote else "cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        trained = fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(trained.parameters(), lr=0.05, momentum=0.9)
    losses = []
    data = batches(rank, steps, accumulate)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            last = micro == accumulate - 1
            if mode == "ddp" and not last:
                with trained.no_sync():  # gradient accumulation: no all-reduce yet
                    F.mse_loss(trained(x.to(device)), y.to(device)).backward()
                continue
            if mode == "fsdp":
                trained.set_requires_gradient_sync(last)
            loss = F.mse_loss(trained(x.to(device)), y.to(device))
            loss.backward()
        opt.step()
        losses.append(loss.item())
    params = []
    for p in trained.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params.append(full.detach().cpu().flatten().tolist())
    line = json.dumps(
        {
            "rank": rank,
            "world": world,
            "losses": losses,
            "params": params,
            "device": str(next(model.parameters()).device),
        }
    )
    # The ranks share torchrun's stdout, and a line longer than a pipe's atomic write (4 KiB)
    # from two ranks at once interleaves: one rank writes at a time.
    with open(os.path.join(tempfile.gettempdir(), "gpupool-data-parallel.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
