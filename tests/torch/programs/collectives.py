"""One rank calling every collective torch.distributed offers on its device (a remote GPU
when gpupool is attached, else the CPU with gloo); prints the results as one JSON line, which
the tests compare between the two. `collectives.py [MiB]`: with a size, one all-reduce of a
tensor that large and the error it raised, if any."""

import json
import os
import sys

import torch
import torch.distributed as dist

remote = torch.cuda.is_available()
local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
device = f"cuda:{local_rank}" if remote else "cpu"
if remote:
    torch.cuda.set_device(local_rank)
dist.init_process_group("nccl" if remote else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()

if len(sys.argv) > 1:
    big = torch.ones(int(sys.argv[1]) << 18, device=device)  # MiB of float32
    try:
        dist.all_reduce(big)
        print(json.dumps({"rank": rank, "sum": big[0].item()}), flush=True)
    except Exception as exc:
        print(json.dumps({"rank": rank, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    os._exit(0)

out: dict[str, object] = {"rank": rank}
t = torch.arange(4.0, device=device) * (rank + 1)
dist.all_reduce(t)
out["all_reduce"] = t.tolist()
for op in ("MAX", "MIN", "PRODUCT", "AVG"):
    x = torch.arange(1.0, 4.0, device=device) + rank
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    out[op] = x.tolist()
b = torch.arange(3.0, device=device) * (rank + 1)
dist.broadcast(b, src=world - 1)
out["broadcast"] = b.tolist()
gathered = torch.empty(world * 2, device=device)
dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device=device))
out["all_gather_into_tensor"] = gathered.tolist()
pieces = [torch.empty(2, device=device) for _ in range(world)]
dist.all_gather(pieces, torch.full((2,), rank + 10.0, device=device))
out["all_gather"] = [p.tolist() for p in pieces]
scattered = torch.empty(2, device=device)
dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * world, device=device) * (rank + 1))
out["reduce_scatter_tensor"] = scattered.tolist()
reduced = torch.arange(3.0, device=device) * (rank + 1)
dist.reduce(reduced, dst=world - 1)
averaged = torch.arange(1.0, 4.0, device=device) + rank
dist.reduce(averaged, dst=0, op=dist.ReduceOp.AVG)
if rank == world - 1:  # the other ranks' tensors are undefined after a reduce
    out["reduce"] = reduced.tolist()
if rank == 0:
    out["reduce_avg"] = averaged.tolist()
into = [torch.empty(2, device=device) for _ in range(world)] if rank == world - 1 else None
dist.gather(torch.full((2,), rank + 20.0, device=device), into, dst=world - 1)
if into is not None:
    out["gather"] = [t.tolist() for t in into]
piece = torch.empty(2, device=device)
parts = [torch.full((2,), 30.0 + r, device=device) for r in range(world)] if rank == 0 else None
dist.scatter(piece, parts, src=0)
out["scatter"] = piece.tolist()
sent = [torch.full((2,), 100.0 * rank + r, device=device) for r in range(world)]
got = [torch.empty(2, device=device) for _ in range(world)]  # gloo: every piece one size
dist.all_to_all(got, sent)
out["all_to_all"] = [g.tolist() for g in got]
if remote:  # gloo on the CPU reduces a strided view as if it were dense: no local twin
    strided = torch.zeros(4, 2, device=device)[:, 0]
    strided += rank + 1
    dist.all_reduce(strided)
    out["strided"] = strided.tolist()
if remote:  # refused at the call, naming the collective (no record: the peers never wait)
    refused = []
    for call in (
        lambda: dist.all_to_all([torch.empty(2, device=device)], sent),
        lambda: dist.gather(got[0], [torch.empty(3, device=device)] * world, dst=rank),
        lambda: dist.scatter(got[0], [torch.empty(2, device=device)], src=rank),
    ):
        try:
            call()
        except ValueError as exc:
            refused.append(str(exc))
    out["refused"] = refused
if world > 1:
    if rank == 0:
        dist.send(torch.tensor([42.0, 43.0], device=device), dst=1)
    elif rank == 1:
        got = torch.zeros(2, device=device)
        dist.recv(got, src=0)
        out["recv"] = got.tolist()
    # from any source: locally the sender's rank; on remote GPUs refused at the call
    if rank == 0 and not remote:
        dist.send(torch.tensor([44.0], device=device), dst=1)
    elif rank == 1:
        try:
            out["recv_any"] = dist.recv(torch.zeros(1, device=device))
        except NotImplementedError as exc:
            out["recv_any"] = str(exc)
host = torch.ones(3) * (rank + 1)  # host tensors keep gloo among the clients
dist.all_reduce(host)
out["host"] = host.tolist()
host_into = [torch.empty(3) for _ in range(world)] if rank == 0 else None
dist.gather(torch.ones(3) * (rank + 1), host_into, dst=0)
if host_into is not None:
    out["host_gather"] = [t.tolist() for t in host_into]
work = dist.all_reduce(torch.ones(2, device=device), async_op=True)
work.wait()
dist.barrier()
out["device"] = str(t.device)
print(json.dumps(out), flush=True)
dist.destroy_process_group()
