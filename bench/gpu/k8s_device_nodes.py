"""Checks, on a real GPU server, what the device plugin's Allocate would name: each GPU's
device node as read from the driver's /proc files against NVML's minor number, and the
control nodes. Writes bench/results/k8s_device_nodes.json; exits 1 on any disagreement.

    PYTHONPATH=src python bench/gpu/k8s_device_nodes.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pynvml

from gpupool.k8s.devicenodes import discover
from gpupool.k8s.devices import CdiNaming, GpuView, NodeView, allocation
from gpupool.protocol.v1.api import LeaseOut, SliceOut
from gpupool.protocol.v1.k8s import ClaimOut

RESULT = Path(__file__).resolve().parents[1] / "results" / "k8s_device_nodes.json"


def nvml_minors() -> dict[str, tuple[int, int]]:
    """UUID -> (index, minor number), as NVML says."""
    pynvml.nvmlInit()
    try:
        out = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            out[uuid] = (index, pynvml.nvmlDeviceGetMinorNumber(handle))
        return out
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    nodes = discover()
    expected = nvml_minors()
    problems = []
    for uuid, (_index, minor) in expected.items():
        if nodes.minors.get(uuid) != minor:
            problems.append(f"{uuid}: NVML minor {minor}, /proc says {nodes.minors.get(uuid)}")
    if "/dev/nvidiactl" not in nodes.control:
        problems.append("no /dev/nvidiactl")
    if "/dev/nvidia-uvm" not in nodes.control:
        problems.append("no /dev/nvidia-uvm (is nvidia-uvm loaded?)")
    first = next(iter(expected), None)
    given = None
    if first is not None:
        index, _ = expected[first]
        piece = SliceOut(
            gpu_uuid=first, node="n", gpu_index=index, compute_pct=100, memory_mib=1, whole=True
        )
        lease = LeaseOut.model_construct(
            id="l-check", physical=True, slices=[piece], gpus=1, compute_pct=None, memory_mib=None
        )
        claim = ClaimOut.model_construct(
            claim="c-check0000", node="n", resource="gpu", state="allocated", lease=lease
        )
        view = NodeView(
            gpus=(GpuView(first, index, "physical"),), device_nodes=nodes, cdi=CdiNaming()
        )
        done = allocation(claim, view, [first])
        given = {"devices": done.devices, "cdi_devices": done.cdi_devices}
    report = {
        "nvml": {u: {"index": i, "minor": m} for u, (i, m) in expected.items()},
        "proc": nodes.minors,
        "control": list(nodes.control),
        "allocate_first_gpu": given,
        "problems": problems,
    }
    RESULT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
