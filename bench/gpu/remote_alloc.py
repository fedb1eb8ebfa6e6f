"""A remote-lease program that tries to escape its limits through its own environment.

It sets (before torch starts) the variables that direct-access limiters trust, then asks
for 3 GiB (within a 4 GiB lease) and 6 GiB (beyond it), and runs bf16 matrix products for
a fixed time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.update(
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=140G",
    CUDA_VISIBLE_DEVICES="1",
    LD_LIBRARY_PATH="/tmp/not-the-driver",
    LD_PRELOAD="/tmp/not-a-limiter.so",
)

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--alloc", action="store_true")
    args = parser.parse_args()
    out: dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    if args.alloc:
        small = torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
        small.fill_(1)
        out["alloc_3gib_ok"] = bool(small[-1].item() == 1)
        del small
        try:
            big = torch.empty(6 * 2**30, dtype=torch.uint8, device="cuda")
            big.fill_(1)
            big[-1].item()
            out["alloc_6gib_refused"] = False
        except torch.cuda.OutOfMemoryError as exc:
            out["alloc_6gib_refused"] = True
            out["error"] = str(exc)[:300]
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    (a @ b).sum().item()
    while time.time() < args.start_at:
        time.sleep(0.005)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for _ in range(8):
            c = a @ b
        c[0, 0].item()
        done += 8
    elapsed = time.perf_counter() - start
    out["tflops"] = done * 2 * n**3 / elapsed / 1e12
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
