"""Placement as a pipeline: filters → scorers → selection, over an index of server shapes."""

from gpupool.core.placement.filters import Demand, demand_of
from gpupool.core.placement.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    PlacementPolicy,
    policy_named,
)
from gpupool.core.placement.select import Placement
from gpupool.core.placement.workload import Workload, mix_of

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Demand",
    "Placement",
    "PlacementPolicy",
    "Workload",
    "demand_of",
    "mix_of",
    "policy_named",
]
