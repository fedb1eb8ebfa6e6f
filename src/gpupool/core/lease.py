"""Lease state transitions in one table, so no code path can invent its own."""

from __future__ import annotations

from gpupool.core.errors import InvalidTransition
from gpupool.core.model import LeaseState as S

TRANSITIONS: dict[S, frozenset[S]] = {
    S.QUEUED: frozenset({S.GRANTED, S.RELEASED}),
    S.GRANTED: frozenset({S.ACTIVE, S.IDLE, S.SWAPPED, S.MIGRATING, S.PREEMPTED, S.RELEASED}),
    S.ACTIVE: frozenset({S.IDLE, S.SWAPPED, S.MIGRATING, S.PREEMPTED, S.RELEASED}),
    S.IDLE: frozenset({S.ACTIVE, S.SWAPPED, S.MIGRATING, S.PREEMPTED, S.RELEASED}),
    S.SWAPPED: frozenset({S.GRANTED, S.ACTIVE, S.QUEUED, S.RELEASED}),
    S.MIGRATING: frozenset({S.GRANTED, S.ACTIVE, S.RELEASED}),
    # Back to active when the preemption is withdrawn: the request it was for went away.
    S.PREEMPTED: frozenset({S.QUEUED, S.ACTIVE, S.RELEASED}),
    S.RELEASED: frozenset(),
}

HOLDING = frozenset({S.GRANTED, S.ACTIVE, S.IDLE, S.MIGRATING})
"""States in which a lease holds GPU capacity."""

LIVE = frozenset(set(TRANSITIONS) - {S.RELEASED})
"""States that still need their holder's heartbeat."""


def transition(current: S, target: S) -> S:
    """Return `target` if the table allows it; a repeated state is allowed and changes nothing."""
    if current == target or target in TRANSITIONS[current]:
        return target
    raise InvalidTransition(f"a lease cannot go from {current.value} to {target.value}")
