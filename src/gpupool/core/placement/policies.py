"""Placement policies: a named scorer (or a seeded coin) applied after the filters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random

from gpupool.core.errors import InvalidRequest
from gpupool.core.placement import scorers
from gpupool.core.placement.scorers import Candidate
from gpupool.core.placement.workload import Workload

Scorer = Callable[[Candidate, Workload], float]

DEFAULT_POLICY = "frag-aware"


@dataclass(slots=True)
class PlacementPolicy:
    """How a request's server and GPUs are chosen among those that pass the filters."""

    name: str
    scorer: Scorer
    summary: str
    rng: Random | None = field(default=None, compare=False)
    """Set for the random policy: it picks uniformly among the servers that fit."""

    @property
    def memo_key(self) -> str:
        return self.name


_SCORERS: dict[str, tuple[Scorer, str]] = {
    "frag-aware": (
        scorers.frag_aware,
        "least room for the usual request sizes used up, scarce room first (the default)",
    ),
    "fgd": (scorers.fragmentation_growth, "fragmentation gradient descent (Weng et al. 2023)"),
    "best-fit": (scorers.best_fit, "the server, then the GPU, left with the least free room"),
    "packing": (scorers.packing, "GPUs in use first, then idle GPUs of busy servers"),
    "spread": (scorers.spread, "the emptiest server and GPU"),
    "dot-product": (scorers.dot_product, "free resources best aligned with the request (Tetris)"),
    "clustering": (scorers.clustering, "requests of one size together (Gandiva-like)"),
    "random": (scorers.best_fit, "a random server among those that fit"),
}

POLICY_NAMES: tuple[str, ...] = tuple(_SCORERS)


def policy_named(name: str, seed: int = 0) -> PlacementPolicy:
    """A fresh policy by name; `default` is the one the pool itself uses."""
    key = DEFAULT_POLICY if name == "default" else name
    if key not in _SCORERS:
        known = ", ".join(("default", *POLICY_NAMES))
        raise InvalidRequest(f"unknown placement policy {name!r} (one of {known})")
    scorer, summary = _SCORERS[key]
    return PlacementPolicy(key, scorer, summary, Random(seed) if key == "random" else None)
