"""The pure domain of the pool: resources, placement, the queue and quotas. No I/O."""

from gpupool.core.errors import (
    Conflict,
    Forbidden,
    InvalidRequest,
    InvalidTransition,
    NoCapacity,
    NotFound,
    PoolError,
    QuotaExceeded,
    Unauthenticated,
)
from gpupool.core.lease import HOLDING, LIVE, transition
from gpupool.core.model import (
    Access,
    Gpu,
    GpuMode,
    Host,
    LeaseRequest,
    LeaseState,
    QueuedLease,
    Quota,
    Ratios,
    ReleaseReason,
    Slice,
    Usage,
)
from gpupool.core.pool import Grant, ModeChange, Pool
from gpupool.core.preempt import Preemption
from gpupool.core.queue import FAIR, QueuePolicy

__all__ = [
    "FAIR",
    "HOLDING",
    "LIVE",
    "Access",
    "Conflict",
    "Forbidden",
    "Gpu",
    "GpuMode",
    "Grant",
    "Host",
    "InvalidRequest",
    "InvalidTransition",
    "LeaseRequest",
    "LeaseState",
    "ModeChange",
    "NoCapacity",
    "NotFound",
    "Pool",
    "PoolError",
    "Preemption",
    "QueuePolicy",
    "QueuedLease",
    "Quota",
    "QuotaExceeded",
    "Ratios",
    "ReleaseReason",
    "Slice",
    "Unauthenticated",
    "Usage",
    "transition",
]
