"""Preemption planning and the dual pool: only downward, only when it makes room, cheapest."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.core import FAIR, Gpu, GpuMode, LeaseRequest, Pool, Quota, Slice
from gpupool.core.dualpool import DualPoolPolicy, rebalance
from gpupool.core.preempt import held_units, plan_preemption, withdrawn

GIB = 1024


def make_pool(gpus: int = 1, tenants: dict[str, Quota] | None = None) -> Pool:
    pool = Pool(queue_policy=FAIR)
    pool.quotas.update(tenants or {"a": Quota(), "b": Quota()})
    pool.set_node_up("n", True)
    for i in range(gpus):
        pool.upsert_gpu(Gpu(f"g{i}", "n", "NVIDIA H100", 80 * GIB, i))
    return pool


def hold(pool: Pool, lease_id: str, gpu: str, pct: int, priority: int, tenant: str = "a") -> None:
    pool.grant(lease_id, tenant, (Slice(gpu, pct, 8 * GIB * pct // 10),), priority)


def test_a_higher_priority_request_preempts_the_cheapest_lower_priority_set() -> None:
    pool = make_pool()
    hold(pool, "small-1", "g0", 25, 0)
    hold(pool, "small-2", "g0", 25, 0)
    hold(pool, "mid", "g0", 50, 1)
    plan = plan_preemption(pool, "urgent", LeaseRequest(tenant="b", compute_pct=50, priority=5))
    assert plan is not None
    assert plan.victims == ("small-1", "small-2")


def test_one_lease_is_preempted_when_it_alone_makes_room() -> None:
    pool = make_pool()
    for i in range(4):
        hold(pool, f"tiny-{i}", "g0", 10, 0)
    hold(pool, "half", "g0", 60, 0)
    plan = plan_preemption(pool, "urgent", LeaseRequest(tenant="b", compute_pct=50, priority=5))
    assert plan is not None and plan.victims == ("half",)


def test_equal_or_higher_priority_leases_are_never_preempted() -> None:
    pool = make_pool()
    hold(pool, "same", "g0", 50, 5)
    hold(pool, "higher", "g0", 50, 9)
    assert plan_preemption(pool, "r", LeaseRequest(tenant="b", compute_pct=50, priority=5)) is None


def test_no_preemption_when_it_would_not_make_the_request_fit() -> None:
    pool = make_pool()
    hold(pool, "low", "g0", 30, 0)
    hold(pool, "high", "g0", 70, 9)
    assert plan_preemption(pool, "r", LeaseRequest(tenant="b", compute_pct=50, priority=5)) is None


def test_a_tenants_guaranteed_share_is_never_preempted() -> None:
    pool = make_pool(tenants={"a": Quota(guaranteed_gpus=0.5), "b": Quota()})
    hold(pool, "kept", "g0", 50, 0, tenant="a")
    hold(pool, "other", "g0", 50, 0, tenant="b")
    plan = plan_preemption(pool, "r", LeaseRequest(tenant="b", compute_pct=50, priority=5))
    assert plan is not None and plan.victims == ("other",)


def test_the_pool_marks_victims_and_the_request_waits_for_them() -> None:
    pool = make_pool()
    hold(pool, "low", "g0", 100, 0)
    pool.enqueue("urgent", LeaseRequest(tenant="b", compute_pct=60, priority=5))
    assert pool.serve_queue() == []
    [plan] = pool.plan_preemptions()
    assert plan.victims == ("low",)
    assert pool.preempting == {"low": "urgent"}
    assert "waiting for 1 lower-priority lease(s)" in pool.why_waiting("urgent")
    assert pool.plan_preemptions() == []  # already being made room for
    pool.enqueue("latecomer", LeaseRequest(tenant="a", compute_pct=30))
    pool.release("low")
    assert [g.lease_id for g in pool.serve_queue()] == ["urgent", "latecomer"]


leases = st.lists(
    st.tuples(st.sampled_from([10, 20, 25, 50, 100]), st.integers(0, 6), st.sampled_from("ab")),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    leases,
    st.integers(1, 6),
    st.sampled_from([10, 50, 100]),
    st.integers(1, 2),
    st.sampled_from([0.0, 0.5, 1.0]),
)
def test_preemption_only_goes_downward_and_makes_the_request_fit(
    held: list[tuple[int, int, str]], priority: int, compute: int, gpus: int, guaranteed: float
) -> None:
    pool = make_pool(2, {"a": Quota(guaranteed_gpus=guaranteed), "b": Quota()})
    for i, (pct, prio, tenant) in enumerate(held):
        request = LeaseRequest(tenant=tenant, compute_pct=pct, priority=prio)
        pool.try_grant(f"l{i}", request)
    request = LeaseRequest(tenant="b", gpus=gpus, compute_pct=compute, priority=priority)
    if pool.plan(request) is not None:
        return
    a_before = held_units(pool, "a")
    plan = plan_preemption(pool, "r", request)
    if plan is None:
        return
    for victim in plan.victims:
        assert pool.priorities[victim] < priority
    for victim in plan.victims:
        pool.release(victim)
    assert held_units(pool, "a") >= min(guaranteed, a_before) - 1e-9
    assert pool.plan(request) is not None, "preempting did not make the request fit"


def test_dual_pool_turns_an_idle_virtual_gpu_physical_for_a_waiting_request() -> None:
    pool = make_pool(3)
    pool.enqueue("whole", LeaseRequest(tenant="a", physical=True))
    changes = rebalance(pool, DualPoolPolicy(ready=1))
    assert [c.new for c in changes] == [GpuMode.PHYSICAL, GpuMode.PHYSICAL]
    assert [g.lease_id for g in pool.serve_queue()] == ["whole"]
    assert sum(1 for g in pool.gpus.values() if g.mode is GpuMode.PHYSICAL) == 2


def test_dual_pool_gives_idle_physical_gpus_back_when_slices_wait() -> None:
    pool = make_pool(2)
    for uuid in ("g0", "g1"):
        pool.set_mode(uuid, GpuMode.PHYSICAL)
    pool.enqueue("slice", LeaseRequest(tenant="a", compute_pct=50))
    changes = rebalance(pool, DualPoolPolicy(ready=1))
    assert [(c.gpu_uuid, c.new) for c in changes] == [("g1", GpuMode.VIRTUAL)]
    assert [g.lease_id for g in pool.serve_queue()] == ["slice"]


def test_dual_pool_leaves_busy_gpus_alone() -> None:
    pool = make_pool(1)
    pool.try_grant("busy", LeaseRequest(tenant="a", compute_pct=10))
    pool.enqueue("whole", LeaseRequest(tenant="a", physical=True))
    assert rebalance(pool, DualPoolPolicy(ready=0)) == []


def test_a_gang_that_may_span_servers_preempts_across_them() -> None:
    pool = Pool(queue_policy=FAIR)
    pool.quotas.update({"a": Quota(), "b": Quota()})
    for node in ("n1", "n2"):
        pool.set_node_up(node, True)
        pool.upsert_gpu(Gpu(f"{node}-g0", node, "NVIDIA H100", 80 * GIB, 0))
    pool.grant("low-1", "a", (Slice("n1-g0", 100, 8 * GIB),), 0)
    pool.grant("low-2", "a", (Slice("n2-g0", 100, 8 * GIB),), 0)
    gang = LeaseRequest(tenant="b", gpus=2, compute_pct=100, memory_mib=8 * GIB, priority=5)
    plan = plan_preemption(pool, "gang", gang)
    assert plan is not None and set(plan.victims) == {"low-1", "low-2"}
    pinned = LeaseRequest(
        tenant="b", gpus=2, compute_pct=100, memory_mib=8 * GIB, priority=5, span_nodes=False
    )
    assert plan_preemption(pool, "pinned", pinned) is None, "no one server has two GPUs"


# ---- withdrawal: a preemption lasts only while its cause waits --------------------------


def test_a_preemption_is_withdrawn_when_its_request_is_released_and_the_victim_keeps_its_gpu(
) -> None:
    pool = make_pool()
    hold(pool, "low", "g0", 100, 0)
    pool.enqueue("urgent", LeaseRequest(tenant="b", compute_pct=60, priority=5))
    [plan] = pool.plan_preemptions()
    assert plan.victims == ("low",)
    pool.release("urgent")
    assert pool.withdraw_preemptions() == {"low": "urgent"}
    assert pool.preempting == {}
    assert "low" in pool.holdings and pool.usage["g0"].compute_pct == 100
    assert pool.withdraw_preemptions() == {}  # once only


def test_a_preemption_is_withdrawn_when_its_request_is_granted_on_room_found_elsewhere() -> None:
    pool = make_pool(2)
    hold(pool, "low", "g0", 100, 0)
    hold(pool, "other", "g1", 100, 9)
    pool.enqueue("urgent", LeaseRequest(tenant="b", compute_pct=60, priority=5))
    [plan] = pool.plan_preemptions()
    assert plan.victims == ("low",)
    pool.release("other")  # room elsewhere, before the victim is gone
    assert [g.lease_id for g in pool.serve_queue()] == ["urgent"]
    assert pool.withdraw_preemptions() == {"low": "urgent"}
    assert "low" in pool.holdings


def test_a_preemption_whose_cause_was_not_recorded_is_never_withdrawn() -> None:
    assert withdrawn({"old": "", "new": "gone"}, set()) == {"new": "gone"}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    leases,
    st.lists(
        st.tuples(st.integers(1, 7), st.sampled_from([10, 50, 100]), st.sampled_from("ab")),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_withdrawal_keeps_exactly_the_preemptions_whose_request_still_waits(
    held: list[tuple[int, int, str]],
    asks: list[tuple[int, int, str]],
    keep: list[bool],
) -> None:
    """For any pool: after some of the causing requests leave the queue, withdrawal leaves
    only preemptions whose cause still waits, returns every other one, and no victim loses
    anything it holds (withdrawal changes no capacity)."""
    pool = make_pool(2)
    for i, (pct, prio, tenant) in enumerate(held):
        pool.try_grant(f"l{i}", LeaseRequest(tenant=tenant, compute_pct=pct, priority=prio))
    for j, (prio, pct, tenant) in enumerate(asks):
        pool.enqueue(f"q{j}", LeaseRequest(tenant=tenant, compute_pct=pct, priority=prio))
    pool.serve_queue()
    pool.plan_preemptions()
    before = dict(pool.preempting)
    for j in range(len(asks)):
        if not keep[j] and f"q{j}" in pool.queue:
            pool.release(f"q{j}")
    holdings = dict(pool.holdings)
    usage = {u: (g.compute_pct, g.memory_mib) for u, g in pool.usage.items()}
    gone = pool.withdraw_preemptions()
    assert set(gone) | set(pool.preempting) == {v for v in before if v in holdings}
    assert all(cause not in pool.queue for cause in gone.values())
    assert all(cause in pool.queue for cause in pool.preempting.values())
    assert pool.holdings == holdings
    assert {u: (g.compute_pct, g.memory_mib) for u, g in pool.usage.items()} == usage
