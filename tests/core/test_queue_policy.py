"""The queue: priority, weighted dominant share, FIFO among equals, backfill, aging, max wait."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.core import FAIR, Gpu, LeaseRequest, Pool, QueuePolicy, Quota, QuotaExceeded, Slice
from gpupool.core.queue import priority_cap, priority_refusal

GIB = 1024


def make_pool(
    gpus: int = 1, policy: QueuePolicy = FAIR, tenants: dict[str, Quota] | None = None
) -> Pool:
    pool = Pool(queue_policy=policy)
    pool.quotas.update(tenants or {"a": Quota(), "b": Quota(), "c": Quota()})
    pool.set_node_up("n", True)
    for i in range(gpus):
        pool.upsert_gpu(Gpu(f"g{i}", "n", "NVIDIA H100", 80 * GIB, i))
    return pool


def order(pool: Pool, now: float | None = None) -> list[str]:
    return [q.lease_id for q in pool.ordered_queue(now)]


def test_the_tenant_holding_less_goes_first_among_equal_priorities() -> None:
    pool = make_pool(2)
    assert not isinstance(pool.try_grant("held", LeaseRequest(tenant="a", compute_pct=100)), str)
    pool.enqueue("a1", LeaseRequest(tenant="a", compute_pct=50))
    pool.enqueue("b1", LeaseRequest(tenant="b", compute_pct=50))
    assert order(pool) == ["b1", "a1"]


def test_fair_share_interleaves_tenants_with_many_requests() -> None:
    pool = make_pool()
    for i in range(3):
        pool.enqueue(f"a{i}", LeaseRequest(tenant="a", compute_pct=10))
    for i in range(3):
        pool.enqueue(f"b{i}", LeaseRequest(tenant="b", compute_pct=10))
    assert order(pool) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_heavier_weight_earns_a_larger_share() -> None:
    pool = make_pool(tenants={"a": Quota(weight=2.0), "b": Quota()})
    for i in range(4):
        pool.enqueue(f"a{i}", LeaseRequest(tenant="a", compute_pct=10))
        pool.enqueue(f"b{i}", LeaseRequest(tenant="b", compute_pct=10))
    first_six = order(pool)[:6]
    assert sum(1 for lid in first_six if lid.startswith("a")) == 4


def test_dominant_share_counts_memory_when_memory_is_the_larger_share() -> None:
    pool = make_pool()
    pool.enqueue("compute", LeaseRequest(tenant="a", compute_pct=30, memory_mib=GIB))
    pool.enqueue("memory", LeaseRequest(tenant="b", compute_pct=10, memory_mib=40 * GIB))
    assert order(pool) == ["compute", "memory"]


def test_priority_comes_before_fair_share() -> None:
    pool = make_pool()
    pool.enqueue("low", LeaseRequest(tenant="b", compute_pct=10))
    pool.enqueue("high", LeaseRequest(tenant="a", compute_pct=90, priority=5))
    assert order(pool) == ["high", "low"]


def test_first_come_first_served_among_equals() -> None:
    pool = make_pool(policy=QueuePolicy())
    for name in ("x", "y", "z"):
        pool.enqueue(name, LeaseRequest(tenant="a" if name != "y" else "b", compute_pct=10))
    assert order(pool) == ["x", "y", "z"]


def test_a_request_that_waited_long_goes_ahead_of_smaller_shares() -> None:
    pool = make_pool(policy=QueuePolicy(fair_share=True, age_boost_s=60))
    assert not isinstance(pool.try_grant("held", LeaseRequest(tenant="a", compute_pct=60)), str)
    pool.enqueue("old", LeaseRequest(tenant="a", compute_pct=50), now=0)
    pool.enqueue("young", LeaseRequest(tenant="b", compute_pct=50), now=30)
    assert order(pool, now=59) == ["young", "old"]
    assert order(pool, now=61) == ["old", "young"]


def test_a_small_request_is_backfilled_where_it_leaves_the_heads_room_alone() -> None:
    pool = make_pool(2, policy=QueuePolicy())
    pool.grant("h0", "a", (Slice("g0", 60, 8 * GIB),))
    pool.grant("h1", "a", (Slice("g1", 30, 8 * GIB),))
    pool.enqueue("big", LeaseRequest(tenant="a", compute_pct=80))
    pool.enqueue("small", LeaseRequest(tenant="b", compute_pct=10))
    # big waits for the GPU closest to fitting it (g1: 30 % used); small goes to g0.
    [grant] = pool.serve_queue()
    assert grant.lease_id == "small"
    assert grant.slices[0].gpu_uuid == "g0"
    pool.release("h1")
    assert [g.lease_id for g in pool.serve_queue()] == ["big"]


def test_a_request_that_would_take_the_heads_room_waits() -> None:
    pool = make_pool(1, policy=QueuePolicy())
    pool.try_grant("held", LeaseRequest(tenant="a", compute_pct=30))
    pool.enqueue("big", LeaseRequest(tenant="a", compute_pct=80))
    pool.enqueue("small", LeaseRequest(tenant="b", compute_pct=20))
    assert pool.serve_queue() == []
    assert pool.why_waiting("small") == "behind earlier requests of the same kind"


def test_a_short_request_may_use_the_heads_room_within_the_delay_bound() -> None:
    pool = make_pool(1, policy=QueuePolicy(max_head_delay_s=300))
    pool.try_grant("held", LeaseRequest(tenant="a", compute_pct=30))
    pool.enqueue("big", LeaseRequest(tenant="a", compute_pct=80))
    pool.enqueue("long", LeaseRequest(tenant="b", compute_pct=20, expected_duration_s=3600))
    pool.enqueue("short", LeaseRequest(tenant="b", compute_pct=20, expected_duration_s=120))
    assert [g.lease_id for g in pool.serve_queue()] == ["short"]


def test_a_request_past_the_maximum_wait_is_reported_with_why_it_waited() -> None:
    pool = make_pool(policy=QueuePolicy(max_wait_s=600))
    pool.try_grant("held", LeaseRequest(tenant="a", compute_pct=100))
    pool.enqueue("q", LeaseRequest(tenant="b", compute_pct=50), now=1000)
    pool.enqueue("patient", LeaseRequest(tenant="b", compute_pct=50), now=1500)
    assert pool.overdue(1599) == []
    [(lease_id, reason)] = pool.overdue(1601)
    assert lease_id == "q"
    assert "waited 601 s (limit 600 s)" in reason and "0 available" in reason


def test_a_request_may_ask_for_a_shorter_maximum_wait() -> None:
    pool = make_pool()
    pool.try_grant("held", LeaseRequest(tenant="a", compute_pct=100))
    pool.enqueue("q", LeaseRequest(tenant="b", compute_pct=50, max_wait_s=5), now=0)
    assert [lid for lid, _ in pool.overdue(6)] == ["q"]


def test_the_cached_order_follows_grants_releases_and_direct_removals() -> None:
    pool = make_pool(2)
    pool.enqueue("a1", LeaseRequest(tenant="a", compute_pct=100))
    pool.enqueue("b1", LeaseRequest(tenant="b", compute_pct=100))
    pool.enqueue("a2", LeaseRequest(tenant="a", compute_pct=50))
    assert order(pool) == ["a1", "b1", "a2"]
    pool.try_grant("more-b", LeaseRequest(tenant="b", compute_pct=100))
    assert order(pool) == ["a1", "a2", "b1"]
    pool.queue.pop("a2")
    assert order(pool) == ["a1", "b1"]
    assert pool.position("b1") == 2


jobs = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([10, 25, 50, 100]),
        st.integers(1, 2),  # GPUs
        st.integers(1, 20),  # duration
        st.integers(0, 4),  # gap to the next arrival
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs, st.sampled_from([1.0, 2.0, 4.0]))
def test_no_request_starves_under_fair_share(
    arrivals: list[tuple[str, int, int, int, int]], weight_a: float
) -> None:
    """With finite leases, a request waits at most the boost age plus one longest lease for
    each request queued ahead of it when it arrived (and one for itself)."""
    boost = 30.0
    pool = make_pool(
        3,
        QueuePolicy(fair_share=True, age_boost_s=boost),
        {"a": Quota(weight=weight_a), "b": Quota(), "c": Quota()},
    )
    longest = max(d for _t, _c, _g, d, _gap in arrivals)
    events: list[tuple[float, int, str]] = []
    t = 0.0
    spec: dict[str, tuple[LeaseRequest, int]] = {}
    for i, (tenant, compute, gpus, duration, gap) in enumerate(arrivals):
        lid = f"r{i}"
        spec[lid] = (LeaseRequest(tenant=tenant, gpus=gpus, compute_pct=compute), duration)
        heapq.heappush(events, (t, 1, lid))
        t += gap
    arrived: dict[str, tuple[float, int]] = {}
    started: dict[str, float] = {}
    while events:
        now, kind, lid = heapq.heappop(events)
        if kind == 0:
            pool.release(lid)
        else:
            arrived[lid] = (now, len(pool.queue))
            pool.enqueue(lid, spec[lid][0], now=now)
        for g in pool.serve_queue(now=now):
            started[g.lease_id] = now
            heapq.heappush(events, (now + spec[g.lease_id][1], 0, g.lease_id))
    assert set(started) == set(spec), "a request never started"
    for lid, (at, ahead) in arrived.items():
        assert started[lid] - at <= boost + (ahead + 1) * longest, lid


# ---- priority caps ----------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 1000),
    st.one_of(st.none(), st.integers(0, 1000)),
    st.one_of(st.none(), st.integers(0, 1000)),
)
def test_a_priority_is_refused_exactly_when_it_is_above_the_cap_and_the_refusal_says_it(
    priority: int, tenant_max: int | None, default_max: int | None
) -> None:
    """The tenant's own cap replaces the pool's default; None everywhere is unlimited."""
    cap = tenant_max if tenant_max is not None else default_max
    problem = priority_refusal("t", priority, tenant_max, default_max)
    assert (problem is not None) == (cap is not None and priority > cap)
    assert priority_cap(tenant_max, default_max) == cap
    if problem is not None:
        assert f"priority {priority}" in problem and f": {cap} (" in problem


def test_the_pool_refuses_a_priority_over_the_default_cap_unless_privileged() -> None:
    pool = Pool(default_max_priority=3)
    pool.quotas["t"] = Quota()
    pool.check_quota_ever(LeaseRequest(tenant="t", compute_pct=10, priority=3))
    with pytest.raises(QuotaExceeded, match="above the highest priority tenant t may ask"):
        pool.check_quota_ever(LeaseRequest(tenant="t", compute_pct=10, priority=4))
    pool.check_quota_ever(LeaseRequest(tenant="t", compute_pct=10, priority=4), privileged=True)
    pool.quotas["t"] = Quota(max_priority=10)
    pool.check_quota_ever(LeaseRequest(tenant="t", compute_pct=10, priority=10))
