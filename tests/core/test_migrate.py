"""A moving lease holds two places on the GPUs but is charged once against its tenant's quota:
a tenant at its quota can still be migrated and drained, and a resize cannot grow past it."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpupool.core.errors import NoCapacity, QuotaExceeded
from gpupool.core.migrate import (
    SHADOW,
    begin_move,
    end_move,
    migration_targets,
    move_charge,
    move_quota_blocks,
    resize_in_place,
)
from gpupool.core.model import (
    Gpu,
    GpuMode,
    LeaseRequest,
    Quota,
    Slice,
    Usage,
    quota_violation,
    usage_of,
)
from gpupool.core.pool import Pool

GIB = 1024
FULL = Quota(max_memory_mib=20 * GIB, max_compute_pct=50, max_leases=1)
"""Exactly what one lease of 50 % and 20 GiB takes."""


def two_node_pool(quota: Quota = FULL) -> Pool:
    pool = Pool()
    for node in ("n0", "n1"):
        pool.set_node_up(node, True)
        pool.upsert_gpu(Gpu(f"{node}-g0", node, "NVIDIA H200", 80 * GIB, 0, GpuMode.VIRTUAL))
    pool.quotas.update({"team": quota, "other": Quota()})
    return pool


def grant_at_quota(pool: Pool) -> tuple[Slice, ...]:
    request = LeaseRequest(tenant="team", compute_pct=50, memory_mib=20 * GIB, node="n0")
    slices = pool.try_grant("L1", request)
    assert not isinstance(slices, str), slices
    assert pool.held_by("team") == Usage(memory_mib=20 * GIB, compute_pct=50, leases=1)
    return slices


def test_a_tenant_at_its_quota_is_drained_off_a_node_and_charged_once_meanwhile() -> None:
    pool = two_node_pool()
    old = grant_at_quota(pool)
    charged = copy.copy(pool.held_by("team"))
    asked = LeaseRequest(tenant="team", compute_pct=1, memory_mib=1)
    unmoved = copy.deepcopy(pool).try_grant("L2", asked)
    assert isinstance(unmoved, str) and unmoved.startswith("tenant quota")
    targets = migration_targets(pool, old, avoid_nodes=("n0",))
    assert [s.gpu_uuid for s in targets] == ["n1-g0"]

    begin_move(pool, "L1", targets)
    # The GPUs hold both places, so no one else is placed on the old one meanwhile ...
    assert pool.usage["n0-g0"].leases == {"L1" + SHADOW}
    assert pool.usage["n1-g0"].leases == {"L1"}
    assert pool.free_on(pool.gpus["n0-g0"]) == (50, 60 * GIB)
    # ... but the tenant is charged for one lease, exactly as before, within its quota.
    assert pool.held_by("team") == charged
    assert quota_violation(FULL, Usage(), pool.held_by("team")) is None
    # Its next request is refused for the quota it holds, not for the move.
    assert pool.try_grant("L2", asked) == unmoved

    assert end_move(pool, "L1") == []
    assert pool.held_by("team") == charged
    assert pool.usage["n0-g0"].leases == set()
    assert pool.free_on(pool.gpus["n0-g0"]) == (100, 80 * GIB)


def test_a_tenant_whose_quota_was_lowered_below_its_use_can_still_be_migrated() -> None:
    pool = two_node_pool()
    old = grant_at_quota(pool)
    pool.quotas["team"] = Quota(max_memory_mib=GIB, max_compute_pct=10, max_leases=0)
    begin_move(pool, "L1", migration_targets(pool, old, to="n1"))
    assert pool.holdings["L1"] == (Slice("n1-g0", 50, 20 * GIB),)


def test_draining_the_old_gpu_switches_it_when_the_move_ends() -> None:
    pool = two_node_pool()
    old = grant_at_quota(pool)
    begin_move(pool, "L1", migration_targets(pool, old, avoid_nodes=("n0",)))
    assert pool.set_mode("n0-g0", GpuMode.PHYSICAL).new is GpuMode.DRAINING
    [change] = end_move(pool, "L1")
    assert (change.gpu_uuid, change.new) == ("n0-g0", GpuMode.PHYSICAL)
    assert pool.gpus["n0-g0"].mode is GpuMode.PHYSICAL


def test_a_resize_past_the_quota_is_refused_and_changes_nothing() -> None:
    pool = two_node_pool()
    old = grant_at_quota(pool)
    before = copy.deepcopy(pool)
    bigger = migration_targets(pool, old, compute_pct=60, stay=True)
    with pytest.raises(QuotaExceeded, match="tenant team: compute % would be 60, quota is 50"):
        begin_move(pool, "L1", bigger)
    with pytest.raises(QuotaExceeded, match="memory would be 21 GiB, quota is 20 GiB"):
        resize_in_place(pool, "L1", (Slice("n0-g0", 50, 21 * GIB),))
    assert (pool.holdings, pool.tenant_usage, pool.usage) == (
        before.holdings,
        before.tenant_usage,
        before.usage,
    )


def test_a_shrinking_resize_is_charged_the_old_size_until_it_ends() -> None:
    pool = two_node_pool()
    old = grant_at_quota(pool)
    smaller = migration_targets(pool, old, compute_pct=20, memory_mib=4 * GIB, stay=True)
    assert [s.gpu_uuid for s in smaller] == ["n0-g0"]
    begin_move(pool, "L1", smaller)
    assert pool.held_by("team") == Usage(memory_mib=20 * GIB, compute_pct=50, leases=1)
    assert pool.usage["n0-g0"].compute_pct == 70
    end_move(pool, "L1")
    assert pool.held_by("team") == Usage(memory_mib=4 * GIB, compute_pct=20, leases=1)


slices = st.lists(
    st.builds(
        Slice, st.sampled_from(["a", "b", "c"]), st.integers(1, 100), st.integers(1, 1 << 17)
    ),
    min_size=1,
    max_size=3,
)
usages = st.builds(
    Usage,
    gpus=st.integers(0, 4),
    memory_mib=st.integers(0, 1 << 18),
    compute_pct=st.integers(0, 400),
    leases=st.integers(0, 8),
)
limits = st.builds(
    Quota,
    max_gpus=st.none() | st.integers(0, 4),
    max_memory_mib=st.none() | st.integers(0, 1 << 18),
    max_compute_pct=st.none() | st.integers(0, 400),
    max_leases=st.none() | st.integers(0, 8),
)


@given(old=slices, new=slices)
def test_a_move_is_charged_the_larger_place_per_resource_and_one_lease(
    old: list[Slice], new: list[Slice]
) -> None:
    charge, was, now = (
        move_charge(tuple(old), tuple(new)),
        usage_of(tuple(old)),
        usage_of(tuple(new)),
    )
    assert charge.leases == 1
    assert charge.memory_mib == max(was.memory_mib, now.memory_mib)
    assert charge.compute_pct == max(was.compute_pct, now.compute_pct)
    assert move_charge(tuple(old), tuple(old)) == was


@given(quota=limits, held=usages, old=slices, data=st.data())
def test_a_move_that_does_not_grow_is_never_refused_for_the_quota(
    quota: Quota, held: Usage, old: list[Slice], data: st.DataObject
) -> None:
    """Same size elsewhere, or smaller in every way: allowed whatever the tenant holds."""
    smaller = [
        Slice(
            data.draw(st.sampled_from(["a", "b", "c"])),
            data.draw(st.integers(1, s.compute_pct)),
            data.draw(st.integers(1, s.memory_mib)),
        )
        for s in old
    ]
    assert move_quota_blocks(quota, held, tuple(old), tuple(smaller)) is None


class MovingPoolMachine(RuleBasedStateMachine):
    """Grants, moves (migrations, drains, resizes), finished moves and releases in any order:
    the GPUs count every place held, each tenant is charged each lease once (the larger place
    while it moves), and no tenant ever goes past its quota."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool()
        self.next_id = 0

    @initialize(
        gpus=st.lists(st.integers(1, 4), min_size=2, max_size=4),
        quota=limits,
    )
    def make_pool(self, gpus: list[int], quota: Quota) -> None:
        for n, count in enumerate(gpus):
            self.pool.set_node_up(f"n{n}", True)
            for i in range(count):
                gpu = Gpu(f"n{n}-g{i}", f"n{n}", "NVIDIA H200", 40 * GIB, i, GpuMode.VIRTUAL)
                self.pool.upsert_gpu(gpu)
        self.pool.quotas.update({"team": quota, "free": Quota()})

    def leases(self, moving: bool | None = None) -> list[str]:
        pool = self.pool
        return sorted(
            lease
            for lease in pool.holdings
            if not lease.endswith(SHADOW)
            and (moving is None or ((lease + SHADOW) in pool.holdings) is moving)
        )

    @rule(
        tenant=st.sampled_from(["team", "team", "free"]),
        gpus=st.integers(1, 2),
        compute_pct=st.integers(1, 100),
        memory_mib=st.integers(1, 40 * GIB),
    )
    def grant(self, tenant: str, gpus: int, compute_pct: int, memory_mib: int) -> None:
        self.next_id += 1
        request = LeaseRequest(tenant, gpus=gpus, compute_pct=compute_pct, memory_mib=memory_mib)
        self.pool.try_grant(f"L{self.next_id}", request)

    @precondition(lambda self: self.leases(moving=False))
    @rule(
        data=st.data(),
        compute_pct=st.none() | st.integers(1, 100),
        memory_mib=st.none() | st.integers(1, 40 * GIB),
        drain=st.booleans(),
    )
    def move(
        self, data: st.DataObject, compute_pct: int | None, memory_mib: int | None, drain: bool
    ) -> None:
        pool = self.pool
        lease = data.draw(st.sampled_from(self.leases(moving=False)))
        old = pool.holdings[lease]
        avoid = {pool.gpus[s.gpu_uuid].node for s in old} if drain else set()
        resize = compute_pct is not None or memory_mib is not None
        before = copy.deepcopy(pool)
        try:
            targets = migration_targets(
                pool,
                old,
                compute_pct=compute_pct,
                memory_mib=memory_mib,
                avoid_nodes=avoid,
                stay=resize and not drain,
            )
            begin_move(pool, lease, targets)
        except NoCapacity:
            return
        except QuotaExceeded:
            # Only a resize that grows the lease can be refused for the quota.
            assert usage_of(targets) != usage_of(old)
            assert (pool.holdings, pool.usage, pool.tenant_usage) == (
                before.holdings,
                before.usage,
                before.tenant_usage,
            )
            return
        assert pool.holdings[lease + SHADOW] == old
        if not resize:
            assert pool.tenant_usage == before.tenant_usage, "a plain move changed the charge"

    @precondition(lambda self: self.leases(moving=True))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        end_move(self.pool, data.draw(st.sampled_from(self.leases(moving=True))))

    @precondition(lambda self: self.leases())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.leases()))
        self.pool.release(lease)
        end_move(self.pool, lease)

    @invariant()
    def gpus_count_every_place_held(self) -> None:
        pool = self.pool
        for uuid, used in pool.usage.items():
            held = [s for slices in pool.holdings.values() for s in slices if s.gpu_uuid == uuid]
            assert used.compute_pct == sum(s.compute_pct for s in held) <= 100
            assert used.memory_mib == sum(s.memory_mib for s in held) <= 40 * GIB

    @invariant()
    def tenants_are_charged_each_lease_once_and_within_quota(self) -> None:
        pool = self.pool
        expected: dict[str, Usage] = {}
        for lease in self.leases():
            old = pool.holdings.get(lease + SHADOW)
            new = pool.holdings[lease]
            charge = usage_of(new) if old is None else move_charge(old, new)
            expected.setdefault(pool.owners[lease], Usage()).add(charge)
        actual = {t: u for t, u in pool.tenant_usage.items() if u != Usage()}
        assert actual == {t: u for t, u in expected.items() if u != Usage()}
        assert quota_violation(pool.quotas["team"], Usage(), pool.held_by("team")) is None


MovingPoolMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_moving_leases_keep_capacity_and_quota = MovingPoolMachine.TestCase
