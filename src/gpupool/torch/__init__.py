"""Remote GPUs for PyTorch: `attach()` and unchanged code that uses `cuda` runs on a worker.

    import gpupool.torch
    gpupool.torch.attach(workers=["tcp://10.0.0.7:41000"], token=..., lease="L-42")
    model = Net().cuda()          # the parameters live on the lease's GPU
    loss = model(x.to("cuda")).sum(); loss.backward(); opt.step()
    print(loss.item())            # only reads wait for the worker
    step = gpupool.torch.capture(train_step)   # later calls: one message each, replayed

Without arguments, attach() reads GPUPOOL_LEASE, GPUPOOL_WORKERS (comma-separated addresses,
one per GPU of the lease: cuda:0, cuda:1, …) and GPUPOOL_LEASE_TOKEN, as `gpupool run
--remote` sets.

    gpupool.torch.attach(lazy=True, request={"compute": "30%", "memory": "8GiB"})

takes no GPU until the program's first GPU op, which asks the controller (GPUPOOL_URL) for
that remote lease, waits in the queue if it must, and goes on (`gpupool run --remote --lazy`).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpupool.protocol.v1.api import LeaseCreate
from gpupool.protocol.v1.dataplane import parse_address
from gpupool.startup import restore_gc, tune_gc
from gpupool.torch import (
    autocast,
    compiler,
    conversions,
    cuda_api,
    dispatch,  # noqa: F401 - binds RemoteTensor's dispatcher
    flags,
    kernels,
    optim,
    runtime,
    serialization,
    session,  # noqa: F401 - answers the streams' swap and move notices
)
from gpupool.torch.capture import CapturedStep, CaptureWarning, capture
from gpupool.torch.dispatch import fastpath_active
from gpupool.torch.lazy import (
    LAZY_LEASE_FILE_ENV,
    LAZY_TOKEN_ENV,
    LazyLease,
    LeaseRefused,
    lease_request,
)
from gpupool.torch.stream import AttachError, DeviceStream, WorkerLost, open_stream
from gpupool.torch.tensor import RemoteTensor

__all__ = [
    "AttachError",
    "CaptureWarning",
    "CapturedStep",
    "LazyLease",
    "LeaseRefused",
    "RemoteTensor",
    "WorkerLost",
    "attach",
    "attached",
    "capture",
    "detach",
    "fastpath_active",
    "rank_from_environment",
]


def attach(
    lease: Any = None,
    *,
    workers: Sequence[str] | None = None,
    token: str | None = None,
    shm_mib: int = 256,
    lazy: bool = False,
    request: LeaseCreate | Mapping[str, Any] | None = None,
    url: str | None = None,
    api_token: str | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
) -> list[torch.device]:
    """Show the lease's GPUs to this process as cuda:0 … cuda:N-1 and return those devices.

    `rank=r` (one process per GPU, as `torchrun` starts them): attach to GPU r of the lease
    only; this process sees it as cuda:`local_rank` (default r), as on a node with a GPU per
    rank, and cuda:0 names it too, so `torch.cuda.set_device(local_rank)`,
    `.to(f"cuda:{local_rank}")` and DDP's `device_ids=[local_rank]` work unchanged.
    `torch.distributed` groups of such processes run their collectives among the lease's
    workers (`gpupool.torch.distributed`).

    `lease` is a lease id, or an object (or dict) with `id`, `workers` and `token`.
    Unix-socket workers on this host also share memory for tensor bytes (`shm_mib` each way).

    `lazy=True` takes no lease now: the first GPU op asks the controller at `url` (default
    GPUPOOL_URL) with `api_token` (default: as the CLI finds it) for `request` (LeaseCreate
    fields, e.g. `{"compute": "30%", "memory": "8GiB"}`; default GPUPOOL_LAZY, else one GPU)
    and waits for it; a refusal raises LeaseRefused there. The lease goes back at detach().
    """
    if runtime.attached():
        raise AttachError("already attached; call gpupool.torch.detach() first")
    if lazy:
        if lease is not None or workers or token:
            raise AttachError("lazy=True asks for a new lease: give no lease, workers or token")
        pending = LazyLease(
            lease_request(request),
            lambda lease_id, addresses, secret: _open_streams(lease_id, addresses, secret, shm_mib),
            url=url,
            api_token=api_token or os.environ.get(LAZY_TOKEN_ENV) or None,
            lease_file=os.environ.get(LAZY_LEASE_FILE_ENV),
        )
        runtime.install_pending(pending)
        _install_hooks()
        return [torch.device("cuda", i) for i in range(pending.device_count)]
    lease_id, addresses, secret = _resolve(lease, workers, token)
    gpus = len(addresses)
    if rank is not None:
        if not 0 <= rank < gpus:
            raise AttachError(f"rank {rank} has no GPU: the lease {lease_id} has {gpus} GPU(s)")
        addresses = [addresses[rank]]
    alias = None if rank is None else (rank if local_rank is None else local_rank)
    streams = _open_streams(lease_id, addresses, secret, shm_mib, first_index=alias or 0)
    if rank is not None:
        streams[0].lease_gpu = rank
    runtime.install(streams, alias, visible=gpus)
    _install_hooks()
    return [s.device for s in streams]


def rank_from_environment(gpus: int) -> tuple[int, int] | None:
    """(rank, local rank) of a process a launcher started as one rank of a distributed program
    (torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE), when the lease has one GPU
    per rank; None for a process of no launcher. A lease whose GPUs do not match the ranks is
    refused: several ranks cannot share one worker."""
    env = os.environ
    if "RANK" not in env and "LOCAL_RANK" not in env:
        return None
    try:
        rank = int(env.get("RANK", env.get("LOCAL_RANK", "0")))
        local_rank = int(env.get("LOCAL_RANK", rank))
        world = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError as exc:
        raise AttachError(f"a launcher's RANK / WORLD_SIZE are not numbers: {exc}") from None
    if gpus == world:
        return rank, local_rank
    if gpus == local_world:  # one lease per host of a multi-host launch
        return local_rank, local_rank
    raise AttachError(
        f"{world} ranks ({local_world} on this host) and a lease of {gpus} GPU(s): run one "
        "rank per GPU of the lease (torchrun --nproc-per-node equal to gpupool run --gpus)"
    )


def _open_streams(
    lease_id: str, addresses: Sequence[str], secret: str, shm_mib: int, first_index: int = 0
) -> list[DeviceStream]:
    streams: list[DeviceStream] = []
    try:
        for index, address in enumerate(addresses, start=first_index):
            streams.append(open_stream(index, parse_address(address), lease_id, secret, shm_mib))
    except BaseException:
        for opened in streams:
            opened.close()
        raise
    return streams


_gc_replaced: tuple[int, int, int] | None = None
"""The collector thresholds attach() replaced (gpupool.startup.tune_gc), put back by detach()."""


def _install_hooks() -> None:
    global _gc_replaced
    _gc_replaced = tune_gc()
    kernels.install()
    cuda_api.install()
    conversions.install()
    serialization.install()
    autocast.install()
    optim.install()
    flags.install()
    compiler.install()
    if torch.distributed.is_available():
        from gpupool.torch import distributed

        distributed.install()
    atexit.register(detach)  # close the connections in order; the workers free everything


def detach() -> None:
    """Close the connections (the workers free this client's tensors) and restore torch."""
    if not runtime.attached():
        return
    atexit.unregister(detach)
    if torch.distributed.is_available():
        from gpupool.torch import distributed

        distributed.uninstall()
    compiler.uninstall()
    flags.uninstall()
    optim.uninstall()
    autocast.uninstall()
    serialization.uninstall()
    conversions.uninstall()
    cuda_api.uninstall()
    kernels.uninstall()
    runtime.uninstall()
    global _gc_replaced
    restore_gc(_gc_replaced)
    _gc_replaced = None


def attached() -> bool:
    return runtime.attached()


def _resolve(
    lease: Any, workers: Sequence[str] | None, token: str | None
) -> tuple[str, list[str], str]:
    if isinstance(lease, dict):
        lease_id, workers, token = (
            lease.get("id"),
            workers or lease.get("workers"),
            token or lease.get("token"),
        )
    elif lease is not None and not isinstance(lease, str):
        lease_id = getattr(lease, "id", None)
        workers = workers or getattr(lease, "workers", None)
        token = token or getattr(lease, "token", None)
    else:
        lease_id = lease
    lease_id = lease_id or os.environ.get("GPUPOOL_LEASE", "")
    if not workers:
        env = os.environ.get("GPUPOOL_WORKERS", "")
        workers = [w.strip() for w in env.split(",") if w.strip()]
    token = token or os.environ.get("GPUPOOL_LEASE_TOKEN")
    if not workers:
        raise AttachError("no workers to attach to: pass workers=[…] or set GPUPOOL_WORKERS")
    if not token:
        raise AttachError("no lease token: pass token=… or set GPUPOOL_LEASE_TOKEN")
    return str(lease_id), list(workers), token
