"""The lease state table: every allowed move, every refused one, and `released` is the end."""

from __future__ import annotations

import itertools

import pytest

from gpupool.core.errors import InvalidTransition
from gpupool.core.lease import HOLDING, LIVE, TRANSITIONS, transition
from gpupool.core.model import LeaseState as S

ALLOWED = {
    (S.QUEUED, S.GRANTED),
    (S.QUEUED, S.RELEASED),
    (S.GRANTED, S.ACTIVE),
    (S.GRANTED, S.IDLE),
    (S.GRANTED, S.SWAPPED),
    (S.GRANTED, S.MIGRATING),
    (S.GRANTED, S.PREEMPTED),
    (S.GRANTED, S.RELEASED),
    (S.ACTIVE, S.IDLE),
    (S.ACTIVE, S.SWAPPED),
    (S.ACTIVE, S.MIGRATING),
    (S.ACTIVE, S.PREEMPTED),
    (S.ACTIVE, S.RELEASED),
    (S.IDLE, S.ACTIVE),
    (S.IDLE, S.SWAPPED),
    (S.IDLE, S.MIGRATING),
    (S.IDLE, S.PREEMPTED),
    (S.IDLE, S.RELEASED),
    (S.SWAPPED, S.GRANTED),
    (S.SWAPPED, S.ACTIVE),
    (S.SWAPPED, S.QUEUED),
    (S.SWAPPED, S.RELEASED),
    (S.MIGRATING, S.GRANTED),
    (S.MIGRATING, S.ACTIVE),
    (S.MIGRATING, S.RELEASED),
    (S.PREEMPTED, S.QUEUED),
    (S.PREEMPTED, S.ACTIVE),  # the preemption was withdrawn: its cause went away
    (S.PREEMPTED, S.RELEASED),
}

MOVES = [(a, b) for a, b in itertools.product(S, S) if a != b]


def test_every_state_has_a_row_in_the_table() -> None:
    assert set(TRANSITIONS) == set(S)


@pytest.mark.parametrize(("current", "target"), sorted(ALLOWED))
def test_allowed_transition_returns_the_target(current: S, target: S) -> None:
    assert transition(current, target) is target


@pytest.mark.parametrize(
    ("current", "target"), [m for m in MOVES if m not in ALLOWED], ids=lambda s: s.value
)
def test_transition_not_in_the_table_is_refused(current: S, target: S) -> None:
    with pytest.raises(InvalidTransition, match=f"from {current.value} to {target.value}"):
        transition(current, target)


@pytest.mark.parametrize("state", list(S))
def test_repeating_the_current_state_is_allowed_and_changes_nothing(state: S) -> None:
    assert transition(state, state) is state


@pytest.mark.parametrize("target", [s for s in S if s is not S.RELEASED])
def test_released_is_terminal(target: S) -> None:
    with pytest.raises(InvalidTransition):
        transition(S.RELEASED, target)


def test_every_live_state_can_be_released() -> None:
    for state in LIVE:
        assert transition(state, S.RELEASED) is S.RELEASED


def test_queued_lease_cannot_skip_to_active() -> None:
    with pytest.raises(InvalidTransition):
        transition(S.QUEUED, S.ACTIVE)


def test_holding_states_are_the_ones_that_occupy_a_gpu() -> None:
    assert frozenset({S.GRANTED, S.ACTIVE, S.IDLE, S.MIGRATING}) == HOLDING
    assert not HOLDING & {S.QUEUED, S.SWAPPED, S.PREEMPTED, S.RELEASED}


def test_live_states_are_all_but_released() -> None:
    assert frozenset(set(S) - {S.RELEASED}) == LIVE
