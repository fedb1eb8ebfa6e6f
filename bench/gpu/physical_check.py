"""Reports what a program sees of its GPU: whole memory, and whether MPS stands in between."""

from __future__ import annotations

import json
import os

import pynvml
import torch


def mps_servers() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == "nvidia-cuda-mps-server":
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def main() -> None:
    free, total = torch.cuda.mem_get_info()
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    pynvml.nvmlInit()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    handle = pynvml.nvmlDeviceGetHandleByUUID(visible.split(",")[0])
    mps_procs = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
    me = os.getpid()
    print(
        json.dumps(
            {
                "total_gib": round(total / 2**30, 2),
                "free_gib": round(free / 2**30, 2),
                "nvml_total_gib": round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 2),
                "mps_env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS")},
                "mps_server_pids": mps_servers(),
                "this_process_is_mps_client": any(p.pid == me for p in mps_procs),
                "visible": visible,
                "ok": bool(x.sum().item() == 1024),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
