"""One rank that all-reduces until something fails, then prints what it was told as one JSON
line and exits 3: what a worker's death looks like to every rank of a remote program."""

import json
import os
import sys

import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
rank = dist.get_rank()
t = torch.ones(1024, device=f"cuda:{local_rank}")
step = 0
try:
    while True:
        dist.all_reduce(t)
        t.div_(dist.get_world_size())
        value = t[0].item()
        if step == 0:
            print(json.dumps({"rank": rank, "ready": True}), flush=True)
        step += 1
except Exception as exc:
    print(
        json.dumps({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "steps": step}),
        flush=True,
    )
    sys.stdout.flush()
    os._exit(3)
