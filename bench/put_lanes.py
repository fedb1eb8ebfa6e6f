"""Host-to-device bandwidth of one large pinned put over TCP, with 0, 2 and 4 lanes.

A worker on this host listens on TCP (loopback; a client on another server sees the same
protocol), and a fresh client process per setting moves a pinned 256 MiB tensor with
`non_blocking=True` and synchronises: into a tensor it already has (`copy_`) and into a new
one (`.to`), best of four. The same run measures plain loopback sockets with 1, 2 and 4
connections at once (`bench/gpu/socket_lanes_probe.py`), so the pool's numbers can be read
against what the machine's TCP can do. Lanes pay off where cores are free on both ends: on a
2-core machine one stream already keeps both cores busy.

    python bench/put_lanes.py [--out bench/results/put_lanes_cpu.json] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, sys, time, torch
sys.path[:0] = [{tests!r}, {root!r}]
from torch_workers import TOKEN, start_worker
import gpupool.torch
from gpupool.torch import runtime
worker = start_worker("lease-lanes-bench")
gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease="lease-lanes-bench")
host = torch.randn(64 << 20).pin_memory()
dev = host.to("cuda", non_blocking=True)
torch.cuda.synchronize()
out = {{}}
for name in ("copy_", "to"):
    best = 1e9
    for _ in range(4):
        start = time.perf_counter()
        if name == "copy_":
            dev.copy_(host, non_blocking=True)
        else:
            dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    out[name + "_gb_s"] = host.numel() * 4 / best / 1e9
assert torch.equal(dev[-1000:].cpu(), host[-1000:])
out["lanes"] = runtime.stream(0).lanes
print(json.dumps(out))
gpupool.torch.detach()
worker.stop()
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/put_lanes_cpu.json")
    parser.add_argument("--device", default=None, help="the worker's device (default: CPU)")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.device:
        env["GPUPOOL_TEST_WORKER_DEVICE"] = args.device
    probe = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/socket_lanes_probe.py"), "--mib", "256"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict[str, object] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "device": args.device or "cpu worker",
        "sockets": json.loads(probe.stdout.strip().splitlines()[-1])["gb_s_by_lanes"],
        "pool": {},
    }
    code = CHILD.format(tests=str(ROOT / "tests/torch"), root=str(ROOT))
    for lanes in (0, 2, 4):
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**env, "GPUPOOL_PUT_LANES": str(lanes)}, cwd=ROOT,
        )  # fmt: skip
        row = json.loads(child.stdout.strip().splitlines()[-1])
        result["pool"][str(lanes)] = row  # type: ignore[index]
        print(f"lanes {lanes}: {row}", flush=True)
    result["at"] = time.strftime("%Y-%m-%d")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
