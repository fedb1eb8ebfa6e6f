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
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import parse_address
from gpupool.torch import (
    autocast,
    conversions,
    cuda_api,
    dispatch,  # noqa: F401 - binds RemoteTensor's dispatcher
    kernels,
    optim,
    runtime,
    serialization,
)
from gpupool.torch.capture import CapturedStep, CaptureWarning, capture
from gpupool.torch.stream import AttachError, DeviceStream, WorkerLost, open_stream
from gpupool.torch.tensor import RemoteTensor

__all__ = [
    "AttachError",
    "CaptureWarning",
    "CapturedStep",
    "RemoteTensor",
    "WorkerLost",
    "attach",
    "attached",
    "capture",
    "detach",
]


def attach(
    lease: Any = None,
    *,
    workers: Sequence[str] | None = None,
    token: str | None = None,
    shm_mib: int = 256,
) -> list[torch.device]:
    """Show the lease's GPUs to this process as cuda:0 … cuda:N-1 and return those devices.

    `lease` is a lease id, or an object (or dict) with `id`, `workers` and `token`.
    Unix-socket workers on this host also share memory for tensor bytes (`shm_mib` each way).
    """
    if runtime.attached():
        raise AttachError("already attached; call gpupool.torch.detach() first")
    lease_id, addresses, secret = _resolve(lease, workers, token)
    streams: list[DeviceStream] = []
    try:
        for index, address in enumerate(addresses):
            streams.append(open_stream(index, parse_address(address), lease_id, secret, shm_mib))
    except BaseException:
        for opened in streams:
            opened.close()
        raise
    runtime.install(streams)
    kernels.install()
    cuda_api.install()
    conversions.install()
    serialization.install()
    autocast.install()
    optim.install()
    atexit.register(detach)  # close the connections in order; the workers free everything
    return [s.device for s in streams]


def detach() -> None:
    """Close the connections (the workers free this client's tensors) and restore torch."""
    if not runtime.attached():
        return
    atexit.unregister(detach)
    optim.uninstall()
    autocast.uninstall()
    serialization.uninstall()
    conversions.uninstall()
    cuda_api.uninstall()
    kernels.uninstall()
    runtime.uninstall()


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
