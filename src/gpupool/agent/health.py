"""Which GPU health events take a GPU out of service, and which are a program's own doing."""

from __future__ import annotations

from gpupool.agent.backends.base import GpuEvent

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
"""Xids that a faulty program causes (illegal address, page fault, stopped, killed,
video decoder misuse): the GPU itself is fine and stays in service."""


def is_fault(event: GpuEvent) -> bool:
    """True for hardware trouble that must isolate the GPU."""
    if event.kind == "xid":
        return not (isinstance(event.value, int) and event.value in APPLICATION_XIDS)
    return event.kind in ("ecc_uncorrected", "temperature", "lost")


def isolation_reason(event: GpuEvent) -> str:
    return f"{event.kind}: {event.message}"
