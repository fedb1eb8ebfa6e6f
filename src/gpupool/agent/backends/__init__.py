"""GPU backends of the agent (real NVML, simulated) and the choice between them."""

from __future__ import annotations

import logging

from gpupool.agent.backends.base import Backend, EventKind, GpuEvent, GpuProcess, xid_event
from gpupool.agent.backends.fake import FakeBackend, parse_spec
from gpupool.agent.backends.nvml import NvmlBackend, NvmlError, ReplayNvml, record_fixture

log = logging.getLogger(__name__)

__all__ = [
    "Backend",
    "EventKind",
    "FakeBackend",
    "GpuEvent",
    "GpuProcess",
    "NvmlBackend",
    "NvmlError",
    "ReplayNvml",
    "detect",
    "parse_spec",
    "record_fixture",
    "xid_event",
]


def detect(node_name: str) -> Backend | None:
    """The NVML backend when NVML starts and sees at least one GPU, else None.

    `node_name` is unused by NVML (real GPUs carry their own UUIDs); it is taken so that
    every way of getting a backend has the same shape.
    """
    del node_name
    try:
        backend = NvmlBackend()
    except ImportError:
        log.info("nvidia-ml-py is not installed: no NVIDIA GPUs can be seen")
        return None
    except NvmlError as exc:
        log.info("NVML did not start (%s): no NVIDIA GPUs seen", exc)
        return None
    if backend.device_count == 0:
        backend.close()
        log.info("NVML started but sees no GPU")
        return None
    return backend
