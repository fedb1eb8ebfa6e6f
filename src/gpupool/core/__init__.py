"""The pure domain of the pool: resources, placement, the queue and quotas. No I/O."""

from gpupool.core.errors import (
    Conflict,
    InvalidRequest,
    InvalidTransition,
    NoCapacity,
    NotFound,
    PoolError,
    QuotaExceeded,
)
from gpupool.core.lease import HOLDING, LIVE, transition
from gpupool.core.model import (
    Access,
    Gpu,
    GpuMode,
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

__all__ = [
    "HOLDING",
    "LIVE",
    "Access",
    "Conflict",
    "Gpu",
    "GpuMode",
    "Grant",
    "InvalidRequest",
    "InvalidTransition",
    "LeaseRequest",
    "LeaseState",
    "ModeChange",
    "NoCapacity",
    "NotFound",
    "Pool",
    "PoolError",
    "QueuedLease",
    "Quota",
    "QuotaExceeded",
    "Ratios",
    "ReleaseReason",
    "Slice",
    "Usage",
    "transition",
]
