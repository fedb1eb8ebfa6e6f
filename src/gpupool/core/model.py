"""The pool's domain words as data: GPUs and their modes, slices, lease requests, quotas."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from gpupool.core.errors import InvalidRequest
from gpupool.core.units import format_size

MAX_GPUS_PER_LEASE = 256
MAX_PRIORITY = 1000


class GpuMode(StrEnum):
    """How a GPU is used: sliced and shared, handed out whole, emptying, or out of service."""

    VIRTUAL = "virtual"
    PHYSICAL = "physical"
    DRAINING = "draining"
    ISOLATED = "isolated"


class Access(StrEnum):
    """How a lease's program reaches its GPU (DESIGN.md: Access)."""

    DIRECT = "direct"
    REMOTE = "remote"


class LeaseState(StrEnum):
    QUEUED = "queued"
    GRANTED = "granted"
    ACTIVE = "active"
    IDLE = "idle"
    SWAPPED = "swapped"
    MIGRATING = "migrating"
    PREEMPTED = "preempted"
    RELEASED = "released"


class ReleaseReason(StrEnum):
    """Why a lease ended: shown to its holder, so each reason is distinct."""

    HOLDER = "released by holder"
    EXPIRED = "holder stopped heartbeating"
    ADMIN = "released by an operator"
    CANCELLED = "cancelled while queued"
    GPU_FAILED = "its GPU failed"
    NODE_REMOVED = "its node was removed"
    PREEMPTED = "preempted by a higher-priority request"
    WAITED_TOO_LONG = "waited longer than the queue's maximum wait"
    WORKER_LOST = "its worker died"
    NODE_LOST = "its node was lost"


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU as the pool sees it.

    `target_mode` is where a draining GPU goes once it is empty (None: it stays drained),
    and for an isolated GPU the mode it returns to when an operator clears it.
    """

    uuid: str
    node: str
    model: str
    memory_mib: int
    index: int = 0
    mode: GpuMode = GpuMode.VIRTUAL
    target_mode: GpuMode | None = None
    healthy: bool = True
    simulated: bool = False

    def takes_new_leases(self) -> bool:
        return self.healthy and self.mode in (GpuMode.VIRTUAL, GpuMode.PHYSICAL)


@dataclass(frozen=True, slots=True)
class Ratios:
    """Oversubscription of the virtual pool: shares are caps, so compute may exceed 100 %."""

    compute: float = 1.0
    memory: float = 1.0

    def __post_init__(self) -> None:
        if not 1.0 <= self.compute <= 100.0:
            raise InvalidRequest(
                f"compute oversubscription ratio must be 1..100, got {self.compute}"
            )
        if not 1.0 <= self.memory <= 10.0:
            raise InvalidRequest(f"memory oversubscription ratio must be 1..10, got {self.memory}")


@dataclass(frozen=True, slots=True)
class Slice:
    """What one lease holds on one GPU. `whole` marks an exclusive physical GPU."""

    gpu_uuid: str
    compute_pct: int
    memory_mib: int
    whole: bool = False


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """What a client asks for: N slices of the same size, or N whole physical GPUs.

    `memory_mib=None` on a slice means "memory in proportion to the compute share" of
    whichever GPU it lands on, which is what most notebook users mean by "25 % of a GPU".
    """

    tenant: str = "default"
    gpus: int = 1
    compute_pct: int = 100
    memory_mib: int | None = None
    physical: bool = False
    priority: int = 0
    access: Access = Access.DIRECT
    node: str | None = None
    gpu_models: tuple[str, ...] = ()
    span_nodes: bool = True
    prefer_node: str | None = None
    """The client's own server: placement tries it first (locality `any`)."""
    cpu_milli: int = 0
    host_memory_mib: int = 0
    """CPU and memory the program takes on the GPU's server (a direct lease runs there)."""
    max_wait_s: float | None = None
    expected_duration_s: float | None = None
    """How long the requester says the lease lasts: lets it use room kept for the queue's head."""

    def __post_init__(self) -> None:
        host_only = self.gpus == 0 and (self.cpu_milli > 0 or self.host_memory_mib > 0)
        if not (1 <= self.gpus <= MAX_GPUS_PER_LEASE or (host_only and not self.physical)):
            raise InvalidRequest(f"gpus must be 1..{MAX_GPUS_PER_LEASE}, got {self.gpus}")
        if self.cpu_milli < 0 or self.host_memory_mib < 0:
            raise InvalidRequest("server CPU and memory must not be negative")
        if self.max_wait_s is not None and self.max_wait_s <= 0:
            raise InvalidRequest(f"maximum wait must be positive, got {self.max_wait_s}")
        if not 1 <= self.compute_pct <= 100:
            raise InvalidRequest(f"compute share must be 1..100 %, got {self.compute_pct}")
        if self.memory_mib is not None and self.memory_mib < 1:
            raise InvalidRequest(f"memory must be at least 1MiB, got {self.memory_mib}MiB")
        if not 0 <= self.priority <= MAX_PRIORITY:
            raise InvalidRequest(f"priority must be 0..{MAX_PRIORITY}, got {self.priority}")
        if self.physical and (self.compute_pct != 100 or self.memory_mib is not None):
            raise InvalidRequest("a physical lease takes whole GPUs: give no compute or memory")
        if self.physical and self.access is Access.REMOTE:
            raise InvalidRequest("physical GPUs are always direct access")
        if not self.tenant:
            raise InvalidRequest("tenant must not be empty")

    def slice_memory_mib(self, gpu: Gpu) -> int:
        if self.physical:
            return gpu.memory_mib
        if self.memory_mib is not None:
            return self.memory_mib
        return max(1, -(-gpu.memory_mib * self.compute_pct // 100))

    def model_allowed(self, model: str) -> bool:
        if not self.gpu_models:
            return True
        low = model.lower()
        return any(want.lower() in low for want in self.gpu_models)


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits; None means unlimited. Whole GPUs count 100 % compute and all memory."""

    max_gpus: int | None = None
    max_memory_mib: int | None = None
    max_compute_pct: int | None = None
    max_leases: int | None = None
    max_priority: int | None = None
    weight: float = 1.0
    """Fair-share weight: a tenant of weight 2 is owed twice the share of a tenant of weight 1."""
    guaranteed_gpus: float = 0.0
    """GPU-equivalents that preemption never takes from this tenant."""

    def __post_init__(self) -> None:
        for name in ("max_gpus", "max_memory_mib", "max_compute_pct", "max_leases", "max_priority"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidRequest(f"{name} must not be negative, got {value}")
        if not self.weight > 0:
            raise InvalidRequest(f"weight must be positive, got {self.weight}")
        if self.guaranteed_gpus < 0:
            raise InvalidRequest(
                f"guaranteed share must not be negative, got {self.guaranteed_gpus}"
            )


@dataclass(slots=True)
class Usage:
    """What a tenant holds (granted leases) or what one lease would add."""

    gpus: int = 0
    memory_mib: int = 0
    compute_pct: int = 0
    leases: int = 0

    def add(self, other: Usage, sign: int = 1) -> None:
        self.gpus += sign * other.gpus
        self.memory_mib += sign * other.memory_mib
        self.compute_pct += sign * other.compute_pct
        self.leases += sign * other.leases


def usage_of(slices: tuple[Slice, ...]) -> Usage:
    """Quota usage of one granted lease: whole GPUs count as GPUs, every slice as compute+memory."""
    return Usage(
        gpus=sum(1 for s in slices if s.whole),
        memory_mib=sum(s.memory_mib for s in slices),
        compute_pct=sum(s.compute_pct for s in slices),
        leases=1,
    )


def quota_violation(quota: Quota, held: Usage, extra: Usage) -> str | None:
    """Say which limit `held + extra` breaks, or None when the quota holds."""
    checks = (
        ("GPUs", quota.max_gpus, held.gpus + extra.gpus, str),
        ("memory", quota.max_memory_mib, held.memory_mib + extra.memory_mib, format_size),
        ("compute %", quota.max_compute_pct, held.compute_pct + extra.compute_pct, str),
        ("leases", quota.max_leases, held.leases + extra.leases, str),
    )
    for what, limit, total, shown in checks:
        if limit is not None and total > limit:
            return f"{what} would be {shown(total)}, quota is {shown(limit)}"
    return None


def quota_text(quota: Quota) -> str:
    """A quota in words ('at most 2 GPUs, 40 GiB of memory'), never a Python repr."""
    limits = []
    if quota.max_gpus is not None:
        limits.append(f"{quota.max_gpus} GPU{'' if quota.max_gpus == 1 else 's'}")
    if quota.max_memory_mib is not None:
        limits.append(f"{format_size(quota.max_memory_mib)} of memory")
    if quota.max_compute_pct is not None:
        limits.append(f"{quota.max_compute_pct} % compute")
    if quota.max_leases is not None:
        limits.append(f"{quota.max_leases} lease{'' if quota.max_leases == 1 else 's'}")
    if quota.max_priority is not None:
        limits.append(f"priority {quota.max_priority}")
    text = f"at most {', '.join(limits)}" if limits else "no limits"
    if quota.guaranteed_gpus:
        text += f", {quota.guaranteed_gpus:g} GPUs guaranteed"
    return text


@dataclass(frozen=True, slots=True)
class QueuedLease:
    """A waiting request; `seq` orders equals first-come first-served."""

    lease_id: str
    request: LeaseRequest
    seq: int
    enqueued_at: float = 0.0
    """Seconds (the caller's clock) when it started waiting: for aging and the maximum wait."""


@dataclass(frozen=True, slots=True)
class Host:
    """What a GPU server offers besides its GPUs; None: not accounted."""

    cpu_milli: int | None = None
    memory_mib: int | None = None


@dataclass(slots=True)
class GpuUsage:
    compute_pct: int = 0
    memory_mib: int = 0
    leases: set[str] = field(default_factory=set)
    whole: bool = False
