"""The oversubscription policy: who gives way when a GPU runs short, and where direct leases
may not go (memory above the GPU's physical size is for remote slices only)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.core.model import Access, Gpu, GpuMode, LeaseRequest, Ratios
from gpupool.core.oversubscription import (
    IDLE_AFTER_S,
    Session,
    candidates,
    choose_victims,
    is_idle,
)
from gpupool.core.pool import Pool

NOW = 1000.0
GIB = 1024

sessions_st = st.lists(
    st.builds(
        Session,
        lease_id=st.sampled_from([f"l{i}" for i in range(12)]),
        access=st.sampled_from([Access.REMOTE, Access.REMOTE, Access.DIRECT]),
        priority=st.integers(0, 3),
        held_mib=st.integers(0, 4000),
        last_active_s=st.floats(NOW - 30, NOW),
        swapped=st.booleans(),
    ),
    max_size=12,
    unique_by=lambda s: s.lease_id,
)
requester_st = st.builds(
    Session,
    lease_id=st.sampled_from(["l0", "l1", "me"]),
    access=st.just(Access.REMOTE),
    priority=st.integers(0, 3),
    held_mib=st.integers(0, 4000),
    last_active_s=st.just(NOW),
)


@settings(max_examples=300, deadline=None)
@given(sessions_st, requester_st, st.integers(-10, 20000))
def test_victims_never_include_the_requester_a_direct_lease_or_a_swapped_session(
    sessions: list[Session], requester: Session, needed: int
) -> None:
    victims = choose_victims(sessions, requester, needed, NOW)
    for victim in victims:
        assert victim.lease_id != requester.lease_id
        assert victim.access is Access.REMOTE
        assert not victim.swapped and victim.held_mib > 0
        # a busy session gives way only to a higher priority
        assert is_idle(victim, NOW) or victim.priority < requester.priority


@settings(max_examples=300, deadline=None)
@given(sessions_st, requester_st, st.integers(1, 20000))
def test_victims_free_what_is_needed_when_possible_and_nobody_is_swapped_for_nothing(
    sessions: list[Session], requester: Session, needed: int
) -> None:
    victims = choose_victims(sessions, requester, needed, NOW)
    available = sum(s.held_mib for s in candidates(sessions, requester, NOW))
    if available >= needed:
        assert sum(v.held_mib for v in victims) >= needed
        # minimal prefix: without the last victim the room would not suffice
        assert sum(v.held_mib for v in victims[:-1]) < needed
    else:
        assert victims == []


@settings(max_examples=200, deadline=None)
@given(sessions_st, requester_st, st.integers(1, 20000), st.randoms())
def test_the_choice_does_not_depend_on_the_order_sessions_are_listed_in(
    sessions: list[Session], requester: Session, needed: int, rng: random.Random
) -> None:
    shuffled = list(sessions)
    rng.shuffle(shuffled)
    assert choose_victims(sessions, requester, needed, NOW) == choose_victims(
        shuffled, requester, needed, NOW
    )


@settings(max_examples=200, deadline=None)
@given(sessions_st, requester_st)
def test_idle_sessions_go_before_busy_ones_and_lower_priorities_before_higher(
    sessions: list[Session], requester: Session
) -> None:
    order = candidates(sessions, requester, NOW)
    keys = [(not is_idle(s, NOW), s.priority) for s in order]
    assert keys == sorted(keys)


def session(lease: str, priority: int, held: int, idle_s: float, **kw: object) -> Session:
    return Session(lease, Access.REMOTE, priority, held, NOW - idle_s, **kw)  # type: ignore[arg-type]


def test_the_documented_order_idle_then_priority_then_least_recently_active() -> None:
    me = session("me", 5, 1000, 0)
    others = [
        session("busy-low", 1, 3000, 0),
        session("idle-high-recent", 9, 3000, IDLE_AFTER_S + 1),
        session("idle-high-old", 9, 3000, IDLE_AFTER_S + 60),
        session("idle-low", 0, 1000, IDLE_AFTER_S + 1),
        session("busy-same", 5, 9000, 0),
    ]
    names = [s.lease_id for s in candidates(others, me, NOW)]
    assert names == ["idle-low", "idle-high-old", "idle-high-recent", "busy-low"]
    assert [v.lease_id for v in choose_victims(others, me, 3500, NOW)] == [
        "idle-low",
        "idle-high-old",
    ]
    assert choose_victims(others, me, 20000, NOW) == [], "busy-same never gives way"


def fake_gpu_pool(ratio: float) -> Pool:
    pool = Pool(ratios=Ratios(memory=ratio))
    pool.set_node_up("n1", True)
    pool.upsert_gpu(
        Gpu(uuid="g0", node="n1", model="Fake", memory_mib=80 * GIB, index=0, mode=GpuMode.VIRTUAL)
    )
    return pool


def remote(memory_gib: int) -> LeaseRequest:
    return LeaseRequest(compute_pct=10, memory_mib=memory_gib * GIB, access=Access.REMOTE)


def direct(memory_gib: int) -> LeaseRequest:
    return LeaseRequest(compute_pct=10, memory_mib=memory_gib * GIB)


def test_two_remote_leases_of_sixty_percent_fit_one_gpu_under_ratio_one_and_a_half() -> None:
    pool = fake_gpu_pool(1.5)
    assert isinstance(pool.try_grant("a", remote(48)), tuple)
    assert isinstance(pool.try_grant("b", remote(48)), tuple)
    assert pool.usage["g0"].memory_mib == 96 * GIB
    assert isinstance(pool.try_grant("c", remote(30)), str), "120 GiB is the cap: c waits"


def test_a_direct_lease_gets_only_physically_free_memory() -> None:
    pool = fake_gpu_pool(1.5)
    assert isinstance(pool.try_grant("a", remote(48)), tuple)
    assert isinstance(pool.try_grant("d", direct(40)), str), "only 32 GiB are physically free"
    assert isinstance(pool.try_grant("d", direct(32)), tuple)
    assert isinstance(pool.try_grant("r", remote(40)), tuple), "remote may still oversubscribe"


def test_a_direct_request_bigger_than_the_gpu_can_never_be_granted_whatever_the_ratio() -> None:
    from gpupool.core.errors import NoCapacity

    pool = fake_gpu_pool(1.5)
    with pytest.raises(NoCapacity):
        pool.check_can_ever_fit(direct(100))
    pool.check_can_ever_fit(remote(100))
