"""Behaviour of the pool: placement, grants, releases, the queue, quotas and GPU modes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpupool.core.errors import Conflict, InvalidRequest, NoCapacity, NotFound, QuotaExceeded
from gpupool.core.model import Access, Gpu, GpuMode, LeaseRequest, Quota, Ratios, Slice, Usage
from gpupool.core.pool import Grant, ModeChange, Pool

GIB = 1024


def make_pool(
    layout: dict[str, int] | None = None,
    *,
    memory_mib: int = 80 * GIB,
    mode: GpuMode = GpuMode.VIRTUAL,
    ratios: Ratios | None = None,
    model: str = "NVIDIA H200",
    tenants: dict[str, Quota] | None = None,
) -> Pool:
    """A pool with `layout[node]` GPUs on each node, all nodes up; GPU uuids are `node-gI`."""
    pool = Pool(ratios=ratios or Ratios())
    for node, count in (layout or {"n1": 1}).items():
        pool.set_node_up(node, True)
        for i in range(count):
            pool.upsert_gpu(
                Gpu(
                    uuid=f"{node}-g{i}",
                    node=node,
                    model=model,
                    memory_mib=memory_mib,
                    index=i,
                    mode=mode,
                )
            )
    pool.quotas.update(tenants or {"default": Quota()})
    return pool


def granted(result: tuple[Slice, ...] | str) -> tuple[Slice, ...]:
    assert not isinstance(result, str), f"expected a grant, got: {result}"
    return result


def waits(result: tuple[Slice, ...] | str) -> str:
    assert isinstance(result, str), f"expected to wait, got a grant: {result}"
    return result


# ---- slices and whole GPUs -------------------------------------------------------------


def test_ten_slices_of_ten_pct_fill_one_gpu_and_the_eleventh_queues() -> None:
    pool = make_pool()
    tenth = LeaseRequest(compute_pct=10)
    for i in range(10):
        (s,) = granted(pool.try_grant(f"l{i}", tenth))
        assert s == Slice("n1-g0", compute_pct=10, memory_mib=8 * GIB)
    assert pool.usage["n1-g0"].compute_pct == 100
    assert pool.usage["n1-g0"].memory_mib == 80 * GIB

    assert "0 available" in waits(pool.try_grant("l10", tenth))
    pool.enqueue("l10", tenth)
    assert pool.serve_queue() == []
    assert pool.position("l10") == 1

    pool.release("l3")
    assert pool.serve_queue() == [Grant("l10", (Slice("n1-g0", 10, 8 * GIB),))]
    assert pool.queue == {}


def test_physical_request_takes_a_whole_physical_gpu_only() -> None:
    pool = make_pool({"n1": 2})
    pool.set_mode("n1-g1", GpuMode.PHYSICAL)

    (s,) = granted(pool.try_grant("p1", LeaseRequest(physical=True)))
    assert s == Slice("n1-g1", compute_pct=100, memory_mib=80 * GIB, whole=True)
    assert pool.usage["n1-g1"].whole

    # The virtual GPU is never handed out whole, and the physical one is taken.
    assert "free physical GPUs" in waits(pool.try_grant("p2", LeaseRequest(physical=True)))
    # Nor does a slice land on the physical GPU, even when it is free and the other is full.
    pool.release("p1")
    granted(pool.try_grant("full", LeaseRequest(compute_pct=100)))
    waits(pool.try_grant("v0", LeaseRequest(compute_pct=10)))
    pool.release("full")
    (v,) = granted(pool.try_grant("v1", LeaseRequest(compute_pct=10)))
    assert v.gpu_uuid == "n1-g0"


def test_physical_gpu_is_not_given_whole_while_it_holds_any_lease() -> None:
    pool = make_pool()
    granted(pool.try_grant("v1", LeaseRequest(compute_pct=10)))
    # An agent re-registers the GPU as physical while a slice still runs on it.
    pool.upsert_gpu(replace(pool.gpus["n1-g0"], mode=GpuMode.PHYSICAL, target_mode=None))
    waits(pool.try_grant("p1", LeaseRequest(physical=True)))
    pool.release("v1")
    granted(pool.try_grant("p1", LeaseRequest(physical=True)))


def test_grant_refuses_a_slice_on_a_gpu_held_whole() -> None:
    pool = make_pool(mode=GpuMode.PHYSICAL)
    granted(pool.try_grant("p1", LeaseRequest(physical=True)))
    with pytest.raises(NoCapacity, match="held whole"):
        pool.grant("v1", "default", (Slice("n1-g0", 10, GIB),))
    with pytest.raises(NoCapacity, match="not free"):
        pool.grant("p2", "default", (Slice("n1-g0", 100, 80 * GIB, whole=True),))


def test_a_lease_id_cannot_be_granted_twice() -> None:
    pool = make_pool()
    granted(pool.try_grant("l1", LeaseRequest(compute_pct=10)))
    with pytest.raises(Conflict):
        pool.grant("l1", "default", (Slice("n1-g0", 10, GIB),))


def test_proportional_memory_when_memory_is_not_given() -> None:
    pool = make_pool(memory_mib=81_920)
    (s,) = granted(pool.try_grant("l1", LeaseRequest(compute_pct=25)))
    assert s.memory_mib == 20 * GIB


def test_proportional_memory_rounds_up_to_whole_mib() -> None:
    pool = make_pool(memory_mib=1001)
    (s,) = granted(pool.try_grant("l1", LeaseRequest(compute_pct=33)))
    assert s.memory_mib == 331  # 330.33 rounded up


def test_explicit_memory_is_used_as_given() -> None:
    pool = make_pool()
    (s,) = granted(pool.try_grant("l1", LeaseRequest(compute_pct=25, memory_mib=5 * GIB)))
    assert (s.compute_pct, s.memory_mib) == (25, 5 * GIB)


def test_memory_fills_a_gpu_before_compute_does() -> None:
    pool = make_pool(memory_mib=10 * GIB)
    granted(pool.try_grant("big", LeaseRequest(compute_pct=10, memory_mib=9 * GIB)))
    waits(pool.try_grant("more", LeaseRequest(compute_pct=10, memory_mib=2 * GIB)))
    granted(pool.try_grant("fits", LeaseRequest(compute_pct=10, memory_mib=GIB)))


def test_best_fit_packs_slices_onto_the_fuller_gpu() -> None:
    pool = make_pool({"n1": 2})
    granted(pool.try_grant("a", LeaseRequest(compute_pct=50, memory_mib=GIB)))
    (s,) = granted(pool.try_grant("b", LeaseRequest(compute_pct=25, memory_mib=GIB)))
    assert s.gpu_uuid == pool.holdings["a"][0].gpu_uuid


def test_request_for_a_node_lands_only_on_that_node() -> None:
    pool = make_pool({"n1": 1, "n2": 1})
    (s,) = granted(pool.try_grant("l1", LeaseRequest(compute_pct=10, node="n2")))
    assert pool.gpus[s.gpu_uuid].node == "n2"


def test_gpu_model_constraint_matches_case_insensitively() -> None:
    pool = make_pool({"n1": 1})
    pool.upsert_gpu(Gpu("a100", "n1", "NVIDIA A100-SXM4-80GB", 80 * GIB, index=1))
    (s,) = granted(pool.try_grant("l1", LeaseRequest(compute_pct=10, gpu_models=("a100",))))
    assert s.gpu_uuid == "a100"
    waits(pool.try_grant("l2", LeaseRequest(compute_pct=10, gpu_models=("B200",))))


# ---- oversubscription ------------------------------------------------------------------


def test_compute_ratio_two_allows_two_hundred_pct_granted_on_one_gpu() -> None:
    pool = make_pool(ratios=Ratios(compute=2.0))
    for i in range(4):
        granted(pool.try_grant(f"l{i}", LeaseRequest(compute_pct=50, memory_mib=GIB)))
    assert pool.usage["n1-g0"].compute_pct == 200
    waits(pool.try_grant("l4", LeaseRequest(compute_pct=1, memory_mib=GIB)))


def test_without_oversubscription_compute_stops_at_one_hundred_pct() -> None:
    pool = make_pool()
    for i in range(2):
        granted(pool.try_grant(f"l{i}", LeaseRequest(compute_pct=50, memory_mib=GIB)))
    waits(pool.try_grant("l2", LeaseRequest(compute_pct=1, memory_mib=GIB)))


def test_memory_ratio_allows_more_memory_than_the_gpu_has_to_remote_leases() -> None:
    pool = make_pool(memory_mib=10 * GIB, ratios=Ratios(compute=2.0, memory=1.5))
    remote = Access.REMOTE
    granted(pool.try_grant("a", LeaseRequest(compute_pct=50, memory_mib=10 * GIB, access=remote)))
    granted(pool.try_grant("b", LeaseRequest(compute_pct=50, memory_mib=5 * GIB, access=remote)))
    assert pool.usage["n1-g0"].memory_mib == 15 * GIB
    waits(pool.try_grant("c", LeaseRequest(compute_pct=1, memory_mib=1, access=remote)))


@pytest.mark.parametrize(("compute", "memory"), [(0.5, 1.0), (101.0, 1.0), (1.0, 0.9), (1.0, 11.0)])
def test_oversubscription_ratios_outside_their_range_are_refused(
    compute: float, memory: float
) -> None:
    with pytest.raises(InvalidRequest):
        Ratios(compute=compute, memory=memory)


# ---- nodes -----------------------------------------------------------------------------


def test_node_down_gets_no_placement() -> None:
    pool = make_pool({"n1": 2})
    pool.set_node_up("n1", False)
    assert "0 available" in waits(pool.try_grant("l1", LeaseRequest(compute_pct=10)))
    pool.set_node_up("n1", True)
    granted(pool.try_grant("l1", LeaseRequest(compute_pct=10)))


def test_node_down_keeps_its_leases_and_placement_moves_to_other_nodes() -> None:
    pool = make_pool({"n1": 1, "n2": 1})
    (s,) = granted(pool.try_grant("l1", LeaseRequest(compute_pct=10, node="n1")))
    pool.set_node_up("n1", False)
    assert pool.holdings["l1"] == (s,)
    (t,) = granted(pool.try_grant("l2", LeaseRequest(compute_pct=10)))
    assert pool.gpus[t.gpu_uuid].node == "n2"


def test_gpu_of_a_node_never_seen_up_gets_no_placement() -> None:
    pool = Pool()
    pool.upsert_gpu(Gpu("g", "n1", "H200", 80 * GIB))
    waits(pool.try_grant("l1", LeaseRequest(compute_pct=10)))


def test_unhealthy_gpu_gets_no_placement() -> None:
    pool = make_pool()
    pool.upsert_gpu(Gpu("n1-g0", "n1", "H200", 80 * GIB, healthy=False))
    waits(pool.try_grant("l1", LeaseRequest(compute_pct=10)))


def test_gpu_holding_leases_cannot_be_removed() -> None:
    pool = make_pool()
    granted(pool.try_grant("l1", LeaseRequest(compute_pct=10)))
    with pytest.raises(Conflict):
        pool.remove_gpu("n1-g0")
    pool.release("l1")
    pool.remove_gpu("n1-g0")
    assert pool.gpus == {}
    with pytest.raises(NotFound):
        pool.gpu("n1-g0")


# ---- never fits ------------------------------------------------------------------------


def test_request_that_can_never_fit_is_refused() -> None:
    pool = make_pool({"n1": 2}, memory_mib=16 * GIB)
    with pytest.raises(NoCapacity, match="can never be granted"):
        pool.check_can_ever_fit(LeaseRequest(gpus=3, compute_pct=10))
    with pytest.raises(NoCapacity, match="can never be granted"):
        pool.check_can_ever_fit(LeaseRequest(compute_pct=10, memory_mib=17 * GIB))
    with pytest.raises(NoCapacity, match="can never be granted"):
        pool.check_can_ever_fit(LeaseRequest(compute_pct=10, gpu_models=("B200",)))
    with pytest.raises(NoCapacity, match="can never be granted"):
        pool.check_can_ever_fit(LeaseRequest(compute_pct=10, node="elsewhere"))


def test_request_that_fits_later_is_not_refused() -> None:
    pool = make_pool({"n1": 2}, memory_mib=16 * GIB)
    granted(pool.try_grant("a", LeaseRequest(gpus=2)))
    # Busy, in the wrong mode or on a down node: all of that can change.
    pool.set_mode("n1-g0", GpuMode.PHYSICAL)
    pool.set_node_up("n1", False)
    pool.check_can_ever_fit(LeaseRequest(gpus=2, compute_pct=100))
    pool.check_can_ever_fit(LeaseRequest(gpus=2, physical=True))


def test_memory_oversubscription_widens_what_can_ever_fit_for_remote_leases() -> None:
    pool = make_pool(memory_mib=16 * GIB, ratios=Ratios(memory=2.0))
    remote = Access.REMOTE
    pool.check_can_ever_fit(LeaseRequest(compute_pct=10, memory_mib=32 * GIB, access=remote))
    with pytest.raises(NoCapacity):
        pool.check_can_ever_fit(
            LeaseRequest(compute_pct=10, memory_mib=32 * GIB + 1, access=remote)
        )


def test_gang_that_may_not_span_servers_is_refused_when_no_server_has_enough_gpus() -> None:
    pool = make_pool({"n1": 2, "n2": 2})
    pool.check_can_ever_fit(LeaseRequest(gpus=4))
    with pytest.raises(NoCapacity, match="may not span"):
        pool.check_can_ever_fit(LeaseRequest(gpus=3, span_nodes=False))


# ---- gangs -----------------------------------------------------------------------------


def test_gang_prefers_one_node() -> None:
    pool = make_pool({"a": 2, "b": 3})
    granted(pool.try_grant("x", LeaseRequest(compute_pct=100, node="a")))
    # `a` has one GPU left and `b` three: a 2-GPU gang goes to `b` alone.
    slices = granted(pool.try_grant("gang", LeaseRequest(gpus=2, compute_pct=50)))
    assert {pool.gpus[s.gpu_uuid].node for s in slices} == {"b"}
    assert len({s.gpu_uuid for s in slices}) == 2


def test_gang_spans_nodes_when_no_single_node_has_room() -> None:
    pool = make_pool({"a": 2, "b": 2})
    granted(pool.try_grant("x", LeaseRequest(node="a")))
    granted(pool.try_grant("y", LeaseRequest(node="b")))
    slices = granted(pool.try_grant("gang", LeaseRequest(gpus=2, compute_pct=50)))
    assert {pool.gpus[s.gpu_uuid].node for s in slices} == {"a", "b"}


def test_gang_that_may_not_span_waits_when_no_single_node_has_room() -> None:
    pool = make_pool({"a": 2, "b": 2})
    granted(pool.try_grant("x", LeaseRequest(node="a")))
    granted(pool.try_grant("y", LeaseRequest(node="b")))
    reason = waits(pool.try_grant("gang", LeaseRequest(gpus=2, span_nodes=False)))
    assert "single server" in reason
    assert "gang" not in pool.holdings


def test_gang_is_all_or_nothing() -> None:
    pool = make_pool({"n1": 3})
    granted(pool.try_grant("x", LeaseRequest(node="n1")))
    before = {uuid: (u.compute_pct, u.memory_mib) for uuid, u in pool.usage.items()}
    waits(pool.try_grant("gang", LeaseRequest(gpus=3, compute_pct=10)))
    assert "gang" not in pool.holdings
    assert {uuid: (u.compute_pct, u.memory_mib) for uuid, u in pool.usage.items()} == before


def test_gang_slices_are_on_distinct_gpus_even_when_one_gpu_has_room_for_all() -> None:
    pool = make_pool({"n1": 2})
    slices = granted(pool.try_grant("gang", LeaseRequest(gpus=2, compute_pct=10)))
    assert sorted(s.gpu_uuid for s in slices) == ["n1-g0", "n1-g1"]
    waits(pool.try_grant("gang3", LeaseRequest(gpus=3, compute_pct=10)))


# ---- releases --------------------------------------------------------------------------


def test_release_returns_capacity_exactly() -> None:
    pool = make_pool({"n1": 2}, tenants={"t": Quota()})
    granted(pool.try_grant("a", LeaseRequest(tenant="t", gpus=2, compute_pct=30)))
    pool.release("a")
    assert all(
        (u.compute_pct, u.memory_mib, u.leases, u.whole) == (0, 0, set(), False)
        for u in pool.usage.values()
    )
    assert pool.held_by("t") == Usage()
    assert pool.holdings == {} and pool.owners == {}


def test_releasing_an_unknown_lease_changes_nothing() -> None:
    pool = make_pool()
    assert pool.release("nope") == []


def test_releasing_a_queued_lease_removes_it_from_the_queue() -> None:
    pool = make_pool()
    pool.enqueue("q", LeaseRequest())
    pool.release("q")
    assert pool.queue == {}


def test_tenant_usage_counts_whole_gpus_and_slices() -> None:
    pool = make_pool({"n1": 2}, tenants={"t": Quota()})
    pool.set_mode("n1-g1", GpuMode.PHYSICAL)
    granted(pool.try_grant("v", LeaseRequest(tenant="t", compute_pct=25)))
    granted(pool.try_grant("p", LeaseRequest(tenant="t", physical=True)))
    assert pool.held_by("t") == Usage(gpus=1, memory_mib=100 * GIB, compute_pct=125, leases=2)


# ---- quotas ----------------------------------------------------------------------------


def test_quota_blocks_grant_but_not_other_tenants() -> None:
    pool = make_pool(tenants={"small": Quota(max_compute_pct=30), "big": Quota()})
    granted(pool.try_grant("s1", LeaseRequest(tenant="small", compute_pct=20)))
    assert "tenant quota" in waits(
        pool.try_grant("s2", LeaseRequest(tenant="small", compute_pct=20))
    )

    pool.enqueue("s2", LeaseRequest(tenant="small", compute_pct=20, priority=5))
    pool.enqueue("b1", LeaseRequest(tenant="big", compute_pct=20))
    assert [g.lease_id for g in pool.serve_queue()] == ["b1"]
    assert "s2" in pool.queue
    assert pool.why_waiting("s2").startswith("tenant quota")

    pool.release("s1")
    assert [g.lease_id for g in pool.serve_queue()] == ["s2"]


@pytest.mark.parametrize(
    ("quota", "request_"),
    [
        (Quota(max_gpus=1), LeaseRequest(tenant="t", gpus=2, physical=True)),
        (Quota(max_memory_mib=GIB), LeaseRequest(tenant="t", compute_pct=10, memory_mib=2 * GIB)),
        (Quota(max_compute_pct=50), LeaseRequest(tenant="t", gpus=2, compute_pct=30)),
        (Quota(max_leases=0), LeaseRequest(tenant="t", compute_pct=1)),
        (Quota(max_priority=3), LeaseRequest(tenant="t", compute_pct=1, priority=4)),
    ],
)
def test_request_that_breaks_its_quota_even_alone_is_refused(
    quota: Quota, request_: LeaseRequest
) -> None:
    pool = make_pool({"n1": 2}, mode=GpuMode.PHYSICAL, tenants={"t": quota})
    with pytest.raises(QuotaExceeded):
        pool.check_quota_ever(request_)


def test_quota_check_alone_uses_the_smallest_proportional_memory() -> None:
    pool = make_pool({"n1": 1}, memory_mib=80 * GIB, tenants={"t": Quota(max_memory_mib=4 * GIB)})
    pool.upsert_gpu(Gpu("small", "n1", "L4", 16 * GIB, index=1))
    pool.check_quota_ever(LeaseRequest(tenant="t", compute_pct=25))  # 4 GiB on the small GPU
    with pytest.raises(QuotaExceeded):
        pool.check_quota_ever(LeaseRequest(tenant="t", compute_pct=26))


def test_request_of_an_unknown_tenant_is_refused() -> None:
    pool = make_pool()
    with pytest.raises(NotFound, match="no tenant"):
        pool.check_quota_ever(LeaseRequest(tenant="ghost"))


def test_lease_count_quota_holds() -> None:
    pool = make_pool(tenants={"t": Quota(max_leases=2)})
    granted(pool.try_grant("a", LeaseRequest(tenant="t", compute_pct=1)))
    granted(pool.try_grant("b", LeaseRequest(tenant="t", compute_pct=1)))
    assert "leases would be 3" in waits(
        pool.try_grant("c", LeaseRequest(tenant="t", compute_pct=1))
    )


# ---- the queue -------------------------------------------------------------------------


def test_queue_order_priority_then_age() -> None:
    pool = make_pool()
    pool.enqueue("old-low", LeaseRequest(priority=0))
    pool.enqueue("old-high", LeaseRequest(priority=5))
    pool.enqueue("new-low", LeaseRequest(priority=0))
    pool.enqueue("new-high", LeaseRequest(priority=5))
    order = [q.lease_id for q in pool.ordered_queue()]
    assert order == ["old-high", "new-high", "old-low", "new-low"]
    assert [pool.position(lid) for lid in order] == [1, 2, 3, 4]
    assert pool.position("absent") is None

    # The GPU fits one whole-GPU slice at a time: they are served in that order.
    served = []
    for _ in order:
        (g,) = pool.serve_queue()
        served.append(g.lease_id)
        pool.release(g.lease_id)
    assert served == order


def test_restored_queue_keeps_its_order_and_new_entries_go_last() -> None:
    pool = make_pool()
    first = pool.enqueue("a", LeaseRequest())
    second = pool.enqueue("b", LeaseRequest())
    fresh = make_pool()
    fresh.restore_queued(second)
    fresh.restore_queued(first)
    fresh.enqueue("c", LeaseRequest())
    assert [q.lease_id for q in fresh.ordered_queue()] == ["a", "b", "c"]


def test_large_request_at_the_head_is_not_starved_by_small_ones() -> None:
    pool = make_pool()
    granted(pool.try_grant("held", LeaseRequest(compute_pct=50)))
    pool.enqueue("large", LeaseRequest(compute_pct=80))
    pool.enqueue("small", LeaseRequest(compute_pct=10))
    assert pool.serve_queue() == []
    assert pool.why_waiting("small") == "behind earlier requests of the same kind"
    pool.release("held")
    assert [g.lease_id for g in pool.serve_queue()] == ["large", "small"]


def test_blocked_physical_request_does_not_hold_back_virtual_ones() -> None:
    pool = make_pool({"n1": 2})
    pool.set_mode("n1-g1", GpuMode.PHYSICAL)
    granted(pool.try_grant("p", LeaseRequest(physical=True)))
    pool.enqueue("p2", LeaseRequest(physical=True, priority=9))
    pool.enqueue("v", LeaseRequest(compute_pct=10))
    assert [g.lease_id for g in pool.serve_queue()] == ["v"]
    assert list(pool.queue) == ["p2"]


def test_why_waiting_says_what_the_head_of_the_queue_lacks() -> None:
    pool = make_pool()
    granted(pool.try_grant("held", LeaseRequest(compute_pct=50)))
    pool.enqueue("q", LeaseRequest(compute_pct=80))
    assert "0 available" in pool.why_waiting("q")
    assert pool.why_waiting("absent") == ""
    pool.release("held")
    assert pool.why_waiting("q") == "about to be granted"


def test_why_waiting_names_the_quota_of_a_request_behind_others() -> None:
    pool = make_pool(tenants={"a": Quota(), "t": Quota(max_memory_mib=GIB)})
    granted(pool.try_grant("held", LeaseRequest(tenant="a", compute_pct=50)))
    pool.enqueue("large", LeaseRequest(tenant="a", compute_pct=80))
    pool.enqueue("q", LeaseRequest(tenant="t", compute_pct=10, memory_mib=2 * GIB))
    assert pool.why_waiting("q") == "tenant quota"


# ---- modes -----------------------------------------------------------------------------


def test_mode_switch_of_idle_gpu_is_immediate() -> None:
    pool = make_pool()
    change = pool.set_mode("n1-g0", GpuMode.PHYSICAL)
    assert change == ModeChange("n1-g0", GpuMode.VIRTUAL, GpuMode.PHYSICAL, None)
    assert pool.gpus["n1-g0"].mode is GpuMode.PHYSICAL


def test_mode_switch_of_busy_gpu_goes_through_draining_until_empty() -> None:
    pool = make_pool()
    granted(pool.try_grant("a", LeaseRequest(compute_pct=10)))
    granted(pool.try_grant("b", LeaseRequest(compute_pct=10)))

    change = pool.set_mode("n1-g0", GpuMode.PHYSICAL)
    assert change == ModeChange("n1-g0", GpuMode.VIRTUAL, GpuMode.DRAINING, GpuMode.PHYSICAL)
    # Draining: no new slices, no whole GPU yet.
    waits(pool.try_grant("c", LeaseRequest(compute_pct=10)))
    waits(pool.try_grant("p", LeaseRequest(physical=True)))

    assert pool.release("a") == []
    assert pool.gpus["n1-g0"].mode is GpuMode.DRAINING
    assert pool.release("b") == [ModeChange("n1-g0", GpuMode.DRAINING, GpuMode.PHYSICAL, None)]
    assert pool.gpus["n1-g0"].mode is GpuMode.PHYSICAL
    granted(pool.try_grant("p", LeaseRequest(physical=True)))


def test_physical_gpu_in_use_drains_back_to_virtual() -> None:
    pool = make_pool(mode=GpuMode.PHYSICAL)
    granted(pool.try_grant("p", LeaseRequest(physical=True)))
    pool.set_mode("n1-g0", GpuMode.VIRTUAL)
    assert pool.gpus["n1-g0"].mode is GpuMode.DRAINING
    assert pool.release("p") == [ModeChange("n1-g0", GpuMode.DRAINING, GpuMode.VIRTUAL, None)]


def test_switching_a_draining_gpu_back_cancels_the_drain() -> None:
    pool = make_pool()
    granted(pool.try_grant("a", LeaseRequest(compute_pct=10)))
    pool.set_mode("n1-g0", GpuMode.PHYSICAL)
    change = pool.set_mode("n1-g0", GpuMode.VIRTUAL)
    assert change == ModeChange("n1-g0", GpuMode.DRAINING, GpuMode.VIRTUAL, None)
    granted(pool.try_grant("b", LeaseRequest(compute_pct=10)))


def test_setting_the_current_mode_changes_nothing() -> None:
    pool = make_pool()
    granted(pool.try_grant("a", LeaseRequest(compute_pct=10)))
    assert pool.set_mode("n1-g0", GpuMode.VIRTUAL) == ModeChange(
        "n1-g0", GpuMode.VIRTUAL, GpuMode.VIRTUAL, None
    )


@pytest.mark.parametrize("mode", [GpuMode.DRAINING, GpuMode.ISOLATED])
def test_mode_can_only_be_set_to_virtual_or_physical(mode: GpuMode) -> None:
    pool = make_pool()
    with pytest.raises(InvalidRequest):
        pool.set_mode("n1-g0", mode)


def test_mode_of_an_unknown_gpu_cannot_be_set() -> None:
    pool = make_pool()
    with pytest.raises(NotFound):
        pool.set_mode("nope", GpuMode.PHYSICAL)


def test_drained_gpu_stays_drained_until_an_operator_switches_it() -> None:
    pool = make_pool()
    granted(pool.try_grant("a", LeaseRequest(compute_pct=10)))
    pool.drain("n1-g0")
    waits(pool.try_grant("b", LeaseRequest(compute_pct=10)))
    assert pool.release("a") == []
    assert pool.gpus["n1-g0"].mode is GpuMode.DRAINING
    pool.set_mode("n1-g0", GpuMode.VIRTUAL)
    granted(pool.try_grant("b", LeaseRequest(compute_pct=10)))


@pytest.mark.parametrize("mode", [GpuMode.VIRTUAL, GpuMode.PHYSICAL])
def test_isolated_gpu_gets_no_new_leases_and_clear_restores_mode(mode: GpuMode) -> None:
    pool = make_pool(mode=mode)
    request = LeaseRequest(physical=mode is GpuMode.PHYSICAL)
    change = pool.isolate("n1-g0")
    assert change == ModeChange("n1-g0", mode, GpuMode.ISOLATED, mode)
    waits(pool.try_grant("a", request))
    # Isolating twice changes nothing; an isolated GPU can be neither switched nor drained.
    assert pool.isolate("n1-g0").new is GpuMode.ISOLATED
    with pytest.raises(Conflict):
        pool.set_mode("n1-g0", GpuMode.VIRTUAL)
    with pytest.raises(Conflict):
        pool.drain("n1-g0")

    assert pool.clear("n1-g0") == ModeChange("n1-g0", GpuMode.ISOLATED, mode, None)
    assert pool.gpus["n1-g0"].mode is mode
    granted(pool.try_grant("a", request))


def test_clear_marks_the_gpu_healthy() -> None:
    pool = make_pool()
    pool.upsert_gpu(Gpu("n1-g0", "n1", "H200", 80 * GIB, healthy=False))
    pool.isolate("n1-g0")
    pool.clear("n1-g0")
    assert pool.gpus["n1-g0"].healthy


def test_only_an_isolated_gpu_can_be_cleared() -> None:
    pool = make_pool()
    with pytest.raises(Conflict, match="not isolated"):
        pool.clear("n1-g0")


def test_isolated_gpu_keeps_its_leases_until_released() -> None:
    pool = make_pool()
    granted(pool.try_grant("a", LeaseRequest(compute_pct=10)))
    pool.isolate("n1-g0")
    assert pool.leases_on(["n1-g0"]) == {"a"}
    pool.release("a")
    assert pool.leases_on(["n1-g0"]) == set()


def test_isolating_a_draining_gpu_returns_it_to_the_drain_target() -> None:
    pool = make_pool()
    granted(pool.try_grant("a", LeaseRequest(compute_pct=10)))
    pool.set_mode("n1-g0", GpuMode.PHYSICAL)
    assert pool.isolate("n1-g0").target is GpuMode.PHYSICAL
    pool.release("a")
    assert pool.clear("n1-g0").new is GpuMode.PHYSICAL


def test_clearing_a_gpu_isolated_mid_drain_finishes_the_drain_first() -> None:
    # A physical GPU held whole was switching to virtual when it was isolated. Cleared while
    # the whole-GPU lease still runs, it must not take slices next to that lease.
    pool = make_pool(mode=GpuMode.PHYSICAL, ratios=Ratios(compute=2.0, memory=2.0))
    granted(pool.try_grant("p", LeaseRequest(physical=True)))
    pool.set_mode("n1-g0", GpuMode.VIRTUAL)
    pool.isolate("n1-g0")
    change = pool.clear("n1-g0")
    assert change == ModeChange("n1-g0", GpuMode.ISOLATED, GpuMode.DRAINING, GpuMode.VIRTUAL)
    assert pool.gpus["n1-g0"].target_mode is GpuMode.VIRTUAL
    waits(pool.try_grant("v", LeaseRequest(compute_pct=10)))
    pool.enqueue("v", LeaseRequest(compute_pct=10))
    assert pool.serve_queue() == []
    assert pool.release("p") == [ModeChange("n1-g0", GpuMode.DRAINING, GpuMode.VIRTUAL, None)]
    assert [g.lease_id for g in pool.serve_queue()] == ["v"]


def test_clearing_a_gpu_isolated_while_draining_to_physical_waits_for_its_slices() -> None:
    pool = make_pool()
    granted(pool.try_grant("v", LeaseRequest(compute_pct=10)))
    pool.set_mode("n1-g0", GpuMode.PHYSICAL)
    pool.isolate("n1-g0")
    assert pool.clear("n1-g0").new is GpuMode.DRAINING
    waits(pool.try_grant("p", LeaseRequest(physical=True)))
    waits(pool.try_grant("v2", LeaseRequest(compute_pct=10)))
    pool.release("v")
    assert pool.gpus["n1-g0"].mode is GpuMode.PHYSICAL
    granted(pool.try_grant("p", LeaseRequest(physical=True)))


def test_leases_on_collects_leases_of_several_gpus() -> None:
    pool = make_pool({"n1": 2})
    granted(pool.try_grant("gang", LeaseRequest(gpus=2, compute_pct=10)))
    granted(pool.try_grant("one", LeaseRequest(compute_pct=10)))
    assert pool.leases_on(["n1-g0", "n1-g1", "unknown"]) == {"gang", "one"}


def test_request_within_quota_on_some_free_gpu_is_granted() -> None:
    pool = make_pool(
        {"n1": 1},
        memory_mib=80 * GIB,
        tenants={"other": Quota(), "t": Quota(max_memory_mib=5 * GIB)},
    )
    pool.upsert_gpu(Gpu("small", "n1", "NVIDIA H200", 16 * GIB, index=1))
    # The big GPU is the fuller one (placed there explicitly: policies may differ).
    pool.grant("busy", "other", (Slice("n1-g0", 70, 56 * GIB),))
    request = LeaseRequest(tenant="t", compute_pct=25)
    pool.check_quota_ever(request)  # 4 GiB on the small GPU: admitted
    (s,) = granted(pool.try_grant("l1", request))
    assert s == Slice("small", 25, 4 * GIB)
