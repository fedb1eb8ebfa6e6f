"""Probe: every op the client dispatches during one nn.LSTM forward on a CUDA worker, with the
shapes of its tensor arguments and results (which op gives the layer's hidden a 4th dim)."""

from __future__ import annotations

import os
import sys

os.environ["GPUPOOL_FASTPATH"] = "0"
os.environ.setdefault("GPUPOOL_TEST_WORKER_DEVICE", "cuda:0")
import torch  # noqa: E402

sys.path.insert(0, "tests/torch")
sys.path.insert(0, ".")
from torch_workers import TOKEN, start_worker  # noqa: E402

import gpupool.torch  # noqa: E402
from gpupool.torch import dispatch  # noqa: E402


def shapes(v):
    if isinstance(v, torch.Tensor):
        return tuple(v.shape)
    if isinstance(v, (list, tuple)):
        return [shapes(x) for x in v if isinstance(x, (torch.Tensor, list, tuple))]
    return None


LOG = []
orig_dispatch, orig_run = dispatch.dispatch, dispatch.run


def logged_dispatch(func, args, kwargs):
    out = orig_dispatch(func, args, kwargs)
    LOG.append(("D", str(func), shapes(list(args)), shapes(out)))
    return out


def logged_run(info, args, kwargs, *rest, **kw):
    out = orig_run(info, args, kwargs, *rest, **kw)
    LOG.append(("R", str(getattr(info, "name", info)), shapes(list(args)), shapes(out)))
    return out


worker = start_worker("lease-p")
try:
    gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease="lease-p")
    m = torch.nn.LSTM(8, 8, 1).to("cuda")
    x = torch.randn(2, 3, 8).to("cuda")
    h = (torch.zeros(1, 3, 8).to("cuda"), torch.zeros(1, 3, 8).to("cuda"))
    dispatch.dispatch, dispatch.run = logged_dispatch, logged_run
    out, (hy, cy) = m(x, h)
    dispatch.dispatch, dispatch.run = orig_dispatch, orig_run
    for line in LOG:
        print(*line)
    print("out", tuple(out.shape), "hy", tuple(hy.shape), "cy", tuple(cy.shape))
    print("values", hy.cpu().shape, float(out.cpu().abs().sum()))
finally:
    worker.stop()
