"""bf16 matrix products on the GPU for a fixed time; prints JSON with TFLOP/s (also per second).

Run under a lease (`gpupool run ... -- python bench/gpu/matmul.py`): two of these at once show
how MPS shares one GPU between two leases.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--start-at", type=float, default=0.0, help="wall-clock start (epoch s)")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    n = args.size
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    while time.time() < args.start_at:
        time.sleep(0.005)
    flop = 2 * n**3
    per_second: list[float] = []
    done = 0
    start = time.perf_counter()
    window_start, window_done = start, 0
    while time.perf_counter() - start < args.seconds:
        for _ in range(4):
            a @ b
        torch.cuda.synchronize()
        done += 4
        window_done += 4
        now = time.perf_counter()
        if now - window_start >= 1.0:
            per_second.append(window_done * flop / (now - window_start) / 1e12)
            window_start, window_done = now, 0
    elapsed = time.perf_counter() - start
    print(
        json.dumps(
            {
                "label": args.label,
                "tflops": done * flop / elapsed / 1e12,
                "per_second": [round(x, 1) for x in per_second],
                "seconds": elapsed,
                "device": torch.cuda.get_device_name(0),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "mps_thread_pct": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
