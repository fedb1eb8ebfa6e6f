"""Tries to hold N GiB on the GPU; prints JSON saying whether CUDA refused it (out of memory)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, required=True)
    args = parser.parse_args()
    free, total = torch.cuda.mem_get_info()
    result: dict[str, object] = {
        "asked_gib": args.gib,
        "free_gib": round(free / 2**30, 2),
        "total_gib": round(total / 2**30, 2),
        "mem_limit_env": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
    }
    try:
        block = torch.empty(int(args.gib * 2**30), dtype=torch.uint8, device="cuda")
        block.fill_(1)
        torch.cuda.synchronize()
        result["oom"] = False
    except torch.cuda.OutOfMemoryError as exc:
        result["oom"] = True
        result["error"] = str(exc).splitlines()[0][:300]
    print(json.dumps(result), flush=True)
    sys.exit(3 if result["oom"] else 0)


if __name__ == "__main__":
    main()
