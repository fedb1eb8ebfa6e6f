"""What the agent needs from a GPU backend: inventory, telemetry and health events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from gpupool.protocol.v1.api import GpuInventory, GpuTelemetry

EventKind = Literal["xid", "ecc_uncorrected", "temperature", "lost"]

# Xid codes an operator meets most, with the words of NVIDIA's Xid catalogue; the rest are
# shown as a bare number, which is still searchable.
XID_MEANINGS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# After these the GPU is gone until a reset: the pool must treat it as lost, not just faulty.
XID_LOST = frozenset({79})


@dataclass(frozen=True, slots=True)
class GpuEvent:
    """One health event of one GPU: what happened (`kind`), its number, and words for people."""

    gpu_uuid: str
    kind: EventKind
    value: int | float | None
    message: str


def xid_event(gpu_uuid: str, code: int) -> GpuEvent:
    """The event for an Xid error, classified the same way for real and simulated GPUs."""
    meaning = XID_MEANINGS.get(code)
    message = f"Xid {code}" + (f": {meaning}" if meaning else "")
    kind: EventKind = "lost" if code in XID_LOST else "xid"
    return GpuEvent(gpu_uuid=gpu_uuid, kind=kind, value=code, message=message)


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process with a compute context on one GPU, as the driver (or the simulation) reports
    it: the agent's watch of direct slices compares these with the leases."""

    gpu_uuid: str
    pid: int
    used_memory_mib: int | None
    """None: the driver does not report this process's memory."""
    sm_util_pct: float | None = None
    """The share of the GPU's SMs it used lately (NVML's per-process samples); None: not
    measured (no samples, or a driver that does not sample processes)."""


class Backend(Protocol):
    """A source of GPUs. Every method may block (NVML does): call it off the event loop."""

    name: str
    simulated: bool

    def inventory(self) -> list[GpuInventory]: ...

    def telemetry(self) -> list[GpuTelemetry]: ...

    def driver_version(self) -> str | None: ...

    def cuda_version(self) -> str | None: ...

    def poll_events(self, timeout_ms: int) -> list[GpuEvent]:
        """Events since the last call; waits up to `timeout_ms` when there are none yet."""
        ...

    def gpu_processes(self) -> list[GpuProcess]:
        """Every process with a compute context on any GPU now, MPS clients included."""
        ...

    def close(self) -> None: ...
