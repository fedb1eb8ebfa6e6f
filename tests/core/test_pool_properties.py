"""Properties of the allocator under random operations: never over-allocates, quotas hold,
modes stay consistent, releases restore capacity exactly."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from gpupool.core.errors import Conflict
from gpupool.core.model import (
    Gpu,
    GpuMode,
    LeaseRequest,
    Quota,
    Ratios,
    Slice,
    Usage,
    quota_violation,
    usage_of,
)
from gpupool.core.pool import Pool

TENANTS = ("alice", "bob", "carol")
"""alice has no quota; bob and carol get random ones."""
MODELS = ("NVIDIA H200", "NVIDIA L4")

memory_sizes = st.one_of(
    st.sampled_from([1024, 16 * 1024, 24 * 1024, 80 * 1024, 141 * 1024]),
    st.integers(min_value=100, max_value=150_000),
)

quotas = st.builds(
    Quota,
    max_gpus=st.none() | st.integers(0, 4),
    max_memory_mib=st.none() | st.integers(0, 300_000),
    max_compute_pct=st.none() | st.integers(0, 500),
    max_leases=st.none() | st.integers(0, 6),
)

ratios = st.builds(
    Ratios,
    compute=st.sampled_from([1.0, 1.5, 2.0, 4.0]),
    memory=st.sampled_from([1.0, 1.25, 2.0]),
)


@st.composite
def requests(draw: st.DrawFn, nodes: list[str]) -> LeaseRequest:
    """Mostly plain requests (one GPU, anywhere, any model), so that many of them are granted."""
    physical = draw(st.booleans())
    return LeaseRequest(
        tenant=draw(st.sampled_from(TENANTS)),
        gpus=draw(st.just(1) | st.integers(1, 4)),
        compute_pct=100
        if physical
        else draw(st.sampled_from([1, 10, 25, 50]) | st.integers(1, 100)),
        memory_mib=None
        if physical
        else draw(st.none() | st.integers(1, 8192) | st.integers(1, 160_000)),
        physical=physical,
        priority=draw(st.integers(0, 3)),
        node=draw(st.none() | st.none() | st.sampled_from(nodes)),
        gpu_models=draw(st.just(()) | st.just(()) | st.sampled_from([("h200",), ("L4",)])),
        span_nodes=draw(st.just(True) | st.booleans()),
    )


def state_of(pool: Pool) -> tuple[object, ...]:
    """Everything that matters about a pool, with a tenant that holds nothing counted as absent."""
    return (
        pool.ratios,
        dict(pool.gpus),
        set(pool.nodes_up),
        dict(pool.quotas),
        dict(pool.holdings),
        dict(pool.owners),
        dict(pool.queue),
        {
            uuid: (u.compute_pct, u.memory_mib, frozenset(u.leases), u.whole)
            for uuid, u in pool.usage.items()
        },
        {t: u for t, u in pool.tenant_usage.items() if u != Usage()},
        pool.next_seq,
    )


class PoolMachine(RuleBasedStateMachine):
    """Drives one Pool through random requests, releases, mode switches and node changes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool()
        self.nodes: list[str] = []
        self.requested: dict[str, LeaseRequest] = {}
        self.next_id = 0
        self.modes_touched = False
        self.initial_gpus: dict[str, Gpu] = {}

    # ---- setup -------------------------------------------------------------------------

    @initialize(
        layout=st.lists(
            st.lists(
                st.tuples(memory_sizes, st.sampled_from(MODELS), st.booleans()),
                min_size=1,
                max_size=4,
            ),
            min_size=1,
            max_size=4,
        ),
        ratios=ratios,
        tenant_quotas=st.tuples(st.just(Quota()), quotas, quotas),
    )
    def make_pool(
        self,
        layout: list[list[tuple[int, str, bool]]],
        ratios: Ratios,
        tenant_quotas: tuple[Quota, Quota, Quota],
    ) -> None:
        self.pool = Pool(ratios=ratios)
        for n, gpus in enumerate(layout):
            node = f"n{n}"
            self.nodes.append(node)
            self.pool.set_node_up(node, True)
            for i, (memory_mib, model, physical) in enumerate(gpus):
                mode = GpuMode.PHYSICAL if physical else GpuMode.VIRTUAL
                self.pool.upsert_gpu(Gpu(f"{node}-g{i}", node, model, memory_mib, i, mode))
        self.pool.quotas.update(zip(TENANTS, tenant_quotas, strict=True))
        self.initial_gpus = dict(self.pool.gpus)

    # ---- helpers -----------------------------------------------------------------------

    def new_id(self) -> str:
        self.next_id += 1
        return f"L{self.next_id}"

    def pick_gpu(self, data: st.DataObject) -> str:
        """Any GPU, but most often one that holds leases or is between modes: where bugs hide."""
        pool = self.pool
        busy = sorted(uuid for uuid, used in pool.usage.items() if used.leases)
        unsettled = sorted(
            uuid
            for uuid, gpu in pool.gpus.items()
            if gpu.mode in (GpuMode.DRAINING, GpuMode.ISOLATED)
        )
        choices = [c for c in (busy, unsettled) if c] + [sorted(pool.gpus)]
        return data.draw(st.sampled_from(data.draw(st.sampled_from(choices))))

    def check_grant(self, request: LeaseRequest, slices: tuple[Slice, ...]) -> None:
        """A grant just made obeys its request, and went only where new leases may go."""
        pool = self.pool
        assert len(slices) == request.gpus
        assert len({s.gpu_uuid for s in slices}) == request.gpus
        nodes = {pool.gpus[s.gpu_uuid].node for s in slices}
        if not request.span_nodes:
            assert len(nodes) == 1
        if request.node is not None:
            assert nodes == {request.node}
        for s in slices:
            gpu = pool.gpus[s.gpu_uuid]
            assert gpu.healthy and gpu.node in pool.nodes_up
            assert request.model_allowed(gpu.model)
            assert s.whole is request.physical
            if request.physical:
                assert gpu.mode is GpuMode.PHYSICAL
                assert (s.compute_pct, s.memory_mib) == (100, gpu.memory_mib)
            else:
                assert gpu.mode is GpuMode.VIRTUAL
                assert s.compute_pct == request.compute_pct
                assert s.memory_mib == request.slice_memory_mib(gpu)

    def release_everything(self) -> None:
        pool = self.pool
        finishing = {
            uuid: gpu.target_mode
            for uuid, gpu in pool.gpus.items()
            if gpu.mode is GpuMode.DRAINING and gpu.target_mode is not None
        }
        for lease_id in sorted(set(pool.holdings) | set(pool.queue)):
            for change in pool.release(lease_id):
                assert finishing.pop(change.gpu_uuid) is change.new
        assert not finishing, "a drain with a target outlived its last lease"
        self.requested.clear()

        assert pool.holdings == {} and pool.owners == {} and pool.queue == {}
        for u in pool.usage.values():
            assert (u.compute_pct, u.memory_mib, u.leases, u.whole) == (0, 0, set(), False)
        assert all(u == Usage() for u in pool.tenant_usage.values())
        # Exactly where a pool with these GPUs, nodes and quotas starts.
        fresh = Pool(ratios=pool.ratios, nodes_up=set(pool.nodes_up), quotas=dict(pool.quotas))
        for gpu in pool.gpus.values():
            fresh.upsert_gpu(gpu)
        fresh.next_seq = pool.next_seq
        assert state_of(pool) == state_of(fresh)
        if not self.modes_touched:
            assert pool.gpus == self.initial_gpus

    def serve(self) -> None:
        """Serve the queue, as the controller does after every change, and check the grants."""
        pool = self.pool
        order = [q.lease_id for q in pool.ordered_queue()]
        waiting = {q.lease_id: q.request for q in pool.queue.values()}
        grants = pool.serve_queue()
        served = [g.lease_id for g in grants]
        assert served == [lid for lid in order if lid in served], "served out of queue order"
        for g in grants:
            assert g.lease_id not in pool.queue
            assert pool.holdings[g.lease_id] == g.slices
            self.check_grant(waiting[g.lease_id], g.slices)
            self.requested[g.lease_id] = waiting[g.lease_id]

    # ---- rules: leases -----------------------------------------------------------------

    @rule(data=st.data())
    def try_grant(self, data: st.DataObject) -> None:
        self.grant_or_refuse(data, data.draw(requests(self.nodes)))

    @rule(data=st.data(), compute_off=st.integers(-1, 1), memory_off=st.integers(-1, 1))
    def request_what_is_left(self, data: st.DataObject, compute_off: int, memory_off: int) -> None:
        """Ask for a GPU's room, give or take one step: the edge where over-allocation hides."""
        pool = self.pool
        uuid = self.pick_gpu(data)
        gpu = pool.gpus[uuid]
        held = [s for slices in pool.holdings.values() for s in slices if s.gpu_uuid == uuid]
        compute = int(100 * pool.ratios.compute) - sum(s.compute_pct for s in held)
        memory = int(gpu.memory_mib * pool.ratios.memory) - sum(s.memory_mib for s in held)
        request = LeaseRequest(
            tenant="alice",
            compute_pct=min(100, max(1, compute + compute_off)),
            memory_mib=max(1, memory + memory_off),
            node=gpu.node,
        )
        self.grant_or_refuse(data, request)

    def grant_or_refuse(self, data: st.DataObject, request: LeaseRequest) -> None:
        """Grant now or say why not; sometimes release at once, which must undo it exactly."""
        lease_id = self.new_id()
        before = copy.deepcopy(self.pool)
        result = self.pool.try_grant(lease_id, request)
        if isinstance(result, str):
            assert result
            assert state_of(self.pool) == state_of(before), "a refused grant changed the pool"
            return
        assert self.pool.holdings[lease_id] == result
        self.check_grant(request, result)
        if data.draw(st.booleans(), label="release at once"):
            assert self.pool.release(lease_id) == []
            assert state_of(self.pool) == state_of(before), "grant+release is not a no-op"
        else:
            self.requested[lease_id] = request

    @rule(data=st.data())
    def enqueue_and_serve(self, data: st.DataObject) -> None:
        request = data.draw(requests(self.nodes))
        self.pool.enqueue(self.new_id(), request)
        self.serve()

    @precondition(lambda self: self.pool.holdings or self.pool.queue)
    @rule(data=st.data())
    def release_and_serve(self, data: st.DataObject) -> None:
        pool = self.pool
        lease_id = data.draw(st.sampled_from(sorted(set(pool.holdings) | set(pool.queue))))
        gpus = {s.gpu_uuid for s in pool.holdings.get(lease_id, ())}
        for change in pool.release(lease_id):
            assert change.gpu_uuid in gpus
            assert change.old is GpuMode.DRAINING
            assert pool.gpus[change.gpu_uuid].mode is change.new
            assert not pool.usage[change.gpu_uuid].leases
        assert lease_id not in pool.holdings and lease_id not in pool.queue
        self.requested.pop(lease_id, None)
        self.serve()

    # ---- rules: GPUs and nodes ---------------------------------------------------------

    @rule(data=st.data(), mode=st.sampled_from([GpuMode.VIRTUAL, GpuMode.PHYSICAL, None]))
    def switch_mode(self, data: st.DataObject, mode: GpuMode | None) -> None:
        """An operator switches a GPU to the other pool, or (mode None) drains it."""
        pool = self.pool
        uuid = self.pick_gpu(data)
        self.modes_touched = True
        if pool.gpus[uuid].mode is GpuMode.ISOLATED:
            try:
                pool.set_mode(uuid, mode) if mode else pool.drain(uuid)
            except Conflict:
                return
            raise AssertionError("an isolated GPU switched mode")
        if mode is None:
            assert pool.drain(uuid).new is GpuMode.DRAINING
            assert pool.gpus[uuid].mode is GpuMode.DRAINING
            return
        change = pool.set_mode(uuid, mode)
        gpu = pool.gpus[uuid]
        assert gpu.mode is change.new
        if pool.usage[uuid].leases:
            assert gpu.mode in (mode, GpuMode.DRAINING)
        else:
            assert gpu.mode is mode and gpu.target_mode is None

    @rule(data=st.data(), failed=st.booleans())
    def isolate(self, data: st.DataObject, failed: bool) -> None:
        """An operator isolates a GPU, or its health check fails and it is isolated."""
        uuid = self.pick_gpu(data)
        self.modes_touched = True
        if failed:
            self.pool.upsert_gpu(replace(self.pool.gpus[uuid], healthy=False))
        self.pool.isolate(uuid)
        gpu = self.pool.gpus[uuid]
        assert gpu.mode is GpuMode.ISOLATED
        assert gpu.target_mode in (GpuMode.VIRTUAL, GpuMode.PHYSICAL)

    @precondition(lambda self: any(g.mode is GpuMode.ISOLATED for g in self.pool.gpus.values()))
    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        pool = self.pool
        isolated = sorted(u for u, g in pool.gpus.items() if g.mode is GpuMode.ISOLATED)
        uuid = data.draw(st.sampled_from(isolated))
        was = pool.gpus[uuid]
        change = pool.clear(uuid)
        gpu = pool.gpus[uuid]
        assert gpu.healthy
        assert (gpu.mode, gpu.target_mode) == (change.new, change.target)
        # Back where it was going; still draining there while it holds the other pool's leases.
        assert gpu.mode is was.target_mode or (
            gpu.mode is GpuMode.DRAINING and gpu.target_mode is was.target_mode
        )

    @rule(n=st.integers(0, 15), up=st.booleans())
    def set_node_up(self, n: int, up: bool) -> None:
        self.pool.set_node_up(self.nodes[n % len(self.nodes)], up)

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def never_over_allocates(self) -> None:
        pool = self.pool
        for uuid, gpu in pool.gpus.items():
            used = pool.usage[uuid]
            assert used.compute_pct <= int(100 * pool.ratios.compute)
            assert used.memory_mib <= int(gpu.memory_mib * pool.ratios.memory)
            assert used.compute_pct >= 0 and used.memory_mib >= 0

    @invariant()
    def usage_is_the_sum_of_holdings(self) -> None:
        pool = self.pool
        expected = {uuid: (0, 0, set(), False) for uuid in pool.gpus}
        for lease_id, slices in pool.holdings.items():
            for s in slices:
                compute, memory, leases, whole = expected[s.gpu_uuid]
                expected[s.gpu_uuid] = (
                    compute + s.compute_pct,
                    memory + s.memory_mib,
                    leases | {lease_id},
                    whole or s.whole,
                )
        actual = {
            uuid: (u.compute_pct, u.memory_mib, u.leases, u.whole) for uuid, u in pool.usage.items()
        }
        assert actual == expected

    @invariant()
    def tenant_usage_is_the_sum_of_holdings_and_within_quota(self) -> None:
        pool = self.pool
        assert set(pool.owners) == set(pool.holdings)
        expected: dict[str, Usage] = {}
        for lease_id, slices in pool.holdings.items():
            expected.setdefault(pool.owners[lease_id], Usage()).add(usage_of(slices))
        actual = {t: u for t, u in pool.tenant_usage.items() if u != Usage()}
        assert actual == {t: u for t, u in expected.items() if u != Usage()}
        for tenant, held in expected.items():
            assert quota_violation(pool.quotas[tenant], Usage(), held) is None

    @invariant()
    def whole_gpu_slice_is_alone_on_its_gpu(self) -> None:
        for uuid, used in self.pool.usage.items():
            if used.whole:
                assert len(used.leases) == 1, f"{uuid} is held whole and shared"

    @invariant()
    def gang_leases_are_all_or_nothing(self) -> None:
        pool = self.pool
        assert set(pool.holdings) == set(self.requested)
        assert not set(pool.holdings) & set(pool.queue)
        for lease_id, slices in pool.holdings.items():
            request = self.requested[lease_id]
            assert len(slices) == request.gpus
            assert len({s.gpu_uuid for s in slices}) == request.gpus
            assert all(s.whole is request.physical for s in slices)

    @invariant()
    def mode_matches_the_leases_a_gpu_holds(self) -> None:
        pool = self.pool
        for uuid, gpu in pool.gpus.items():
            kinds = {
                s.whole
                for lid in pool.usage[uuid].leases
                for s in pool.holdings[lid]
                if s.gpu_uuid == uuid
            }
            assert len(kinds) <= 1, f"{uuid} holds whole and partial slices at once"
            if gpu.mode is GpuMode.VIRTUAL:
                assert True not in kinds, f"virtual {uuid} holds a whole-GPU lease"
            if gpu.mode is GpuMode.PHYSICAL:
                assert False not in kinds, f"physical {uuid} holds a slice"
            if gpu.mode is GpuMode.DRAINING and gpu.target_mode is not None:
                assert kinds, f"{uuid} is draining to {gpu.target_mode} but already empty"

    def teardown(self) -> None:
        if self.pool.gpus:
            self.release_everything()


PoolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# 200 runs of 50 steps: ~25 s alone, 2-4x that beside three other xdist workers on two cores
# (300 took 107 s there, the suite's longest test); the 120 s hang detector would cut a
# healthy run.
TestPoolProperties = pytest.mark.timeout(300)(PoolMachine.TestCase)
