"""Probe: squeeze of a remote (1, 3, 8) tensor on torch 2.11 (the LSTM decomposition's
hx.squeeze(0) kept its dim on a CUDA worker)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, "tests/torch")
sys.path.insert(0, ".")
os.environ.setdefault("GPUPOOL_TEST_WORKER_DEVICE", "cuda:0")
from torch_workers import TOKEN, start_worker  # noqa: E402

import gpupool.torch  # noqa: E402
from gpupool.torch import dispatch  # noqa: E402

worker = start_worker("lease-p")
try:
    gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease="lease-p")
    print("fastpath", dispatch.fastpath_active())
    x = torch.randn(1, 3, 8).to("cuda")
    y = x * x
    for name, f in [
        ("x.squeeze(0)", lambda: x.squeeze(0)),
        ("y.squeeze(0)", lambda: y.squeeze(0)),
        ("torch.squeeze(y, 0)", lambda: torch.squeeze(y, 0)),
        ("aten.squeeze.dim(y, 0)", lambda: torch.ops.aten.squeeze.dim(y, 0)),
        ("aten.squeeze.dims(y, [0])", lambda: torch.ops.aten.squeeze.dims(y, [0])),
        ("y.squeeze()", lambda: y.squeeze()),
        ("y.unsqueeze(0).squeeze(0)", lambda: y.unsqueeze(0).squeeze(0)),
    ]:
        try:
            r = f()
            print(f"{name:28s} client {tuple(r.shape)} worker {tuple(r.cpu().shape)}")
        except Exception as e:  # noqa: BLE001
            print(f"{name:28s} {type(e).__name__}: {str(e)[:200]}")
    with torch.no_grad():
        print("no_grad y.squeeze(0)", tuple(y.squeeze(0).shape))
    z = torch.randn(1, 3, 8, requires_grad=True).to("cuda")
    print("requires_grad z.squeeze(0)", tuple(z.squeeze(0).shape), z.squeeze(0).grad_fn)
    print("meta", tuple(torch.empty(1, 3, 8, device="meta").squeeze(0).shape))
finally:
    worker.stop()
