"""Probe on the GPU machine: nn.LSTM through a CUDA worker (the word-language-model failure:
hx 4-D at the second step). Prints the shapes the client sees at each step, with and without
cuDNN's weight flattening."""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, "tests/torch")
sys.path.insert(0, ".")
os.environ.setdefault("GPUPOOL_TEST_WORKER_DEVICE", "cuda:0")
from torch_workers import TOKEN, start_worker  # noqa: E402

import gpupool.torch  # noqa: E402

worker = start_worker("lease-p")
try:
    gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease="lease-p")
    for flatten in (True, False):
        print(f"--- flatten={flatten}")
        try:
            if not flatten:
                torch.backends.cudnn.is_acceptable = lambda t: False  # type: ignore[assignment]
            m = torch.nn.LSTM(16, 16, 2, dropout=0.2).to("cuda")
            w = m.weight_ih_l0
            print("is_cuda", w.is_cuda, "device", w.device)
            print("flat weights", [tuple(t.shape) for t in m._flat_weights])
            x = torch.randn(6, 4, 16).to("cuda")
            h = (w.new_zeros(2, 4, 16), w.new_zeros(2, 4, 16))
            print("h0", tuple(h[0].shape))
            for step in range(2):
                out, h = m(x, h)
                print("step", step, "out", tuple(out.shape), "hy", tuple(h[0].shape), "cy", tuple(h[1].shape))
                h = (h[0].detach(), h[1].detach())
            out.sum().backward()
            print("grad", tuple(m.weight_hh_l1.grad.shape), float(m.weight_hh_l1.grad.abs().sum()))
        except Exception:
            traceback.print_exc(limit=6)
    hx = torch.zeros(2, 4, 16).to("cuda")
    parts = hx.unbind(0)
    print("unbind", [tuple(p.shape) for p in parts])
    ig = torch.randn(4, 64).to("cuda")
    hg = torch.randn(4, 64).to("cuda")
    cx = torch.randn(4, 16).to("cuda")
    r = torch.ops.aten._thnn_fused_lstm_cell(ig, hg, cx)
    print("fused cell", [tuple(t.shape) for t in r])
    print("stack", tuple(torch.stack([r[0], r[0]], 0).shape))
finally:
    worker.stop()
