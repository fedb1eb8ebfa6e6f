"""Per-step times of recurrent training loops, locally or through a worker: where a remote
stack's time goes (a first call's one-off cost, or every call's).

    python bench/gpu/rnn_timing.py --device cuda            # the local GPU
    CUDA_VISIBLE_DEVICES= python bench/gpu/rnn_timing.py --remote cuda:0
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "torch"), str(ROOT)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--remote", default="")
    parser.add_argument("--steps", type=int, default=6)
    options = parser.parse_args()
    import torch
    from torch import nn

    worker = None
    if options.remote:
        os.environ["GPUPOOL_TEST_WORKER_DEVICE"] = options.remote
        from torch_workers import TOKEN, start_worker

        import gpupool.torch

        worker = start_worker("lease-rnn")
        gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease="lease-rnn")
    device = "cuda" if options.remote else options.device
    try:
        for name, dropout in (("lstm 2x650, dropout 0.5", 0.5), ("lstm 2x650, no dropout", 0.0),
                              ("gru 2x650, dropout 0.5", 0.5)):  # fmt: skip
            torch.manual_seed(0)
            cls = nn.GRU if name.startswith("gru") else nn.LSTM
            model = cls(650, 650, 2, dropout=dropout).to(device)
            x = torch.randn(35, 20, 650)
            times = []
            for _ in range(options.steps):
                started = time.perf_counter()
                out = model(x.to(device))[0]
                loss = out.square().mean()
                loss.backward()
                loss.item()
                times.append((time.perf_counter() - started) * 1e3)
            print(f"{name:28s}", " ".join(f"{t:8.1f}" for t in times), "ms", flush=True)
    finally:
        if worker is not None:
            import gpupool.torch

            gpupool.torch.detach()
            worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
