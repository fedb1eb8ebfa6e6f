"""Placement pipeline: filters, the policies' preferences, locality, host resources, the index."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.core import Gpu, GpuMode, Host, LeaseRequest, Pool, Quota
from gpupool.core.errors import InvalidRequest
from gpupool.core.placement import POLICY_NAMES, demand_of, policy_named
from gpupool.core.placement.index import shape_of

GIB = 1024


def make_pool(
    layout: dict[str, int], policy: str = "default", model: str = "NVIDIA H100", seed: int = 0
) -> Pool:
    pool = Pool(policy=policy_named(policy, seed))
    pool.quotas["default"] = Quota()
    for node, count in layout.items():
        pool.set_node_up(node, True)
        for i in range(count):
            pool.upsert_gpu(Gpu(f"{node}-g{i}", node, model, 80 * GIB, i))
    return pool


def grant(pool: Pool, lease_id: str, request: LeaseRequest) -> tuple[str, ...]:
    result = pool.try_grant(lease_id, request)
    assert not isinstance(result, str), result
    return tuple(s.gpu_uuid for s in result)


def nodes_of(pool: Pool, uuids: tuple[str, ...]) -> set[str]:
    return {pool.gpus[u].node for u in uuids}


def test_every_policy_places_a_simple_request() -> None:
    for name in ("default", *POLICY_NAMES):
        pool = make_pool({"a": 2, "b": 2}, name)
        assert len(grant(pool, "x", LeaseRequest(compute_pct=30))) == 1


def test_unknown_policy_is_refused_with_the_known_names() -> None:
    with pytest.raises(InvalidRequest, match="best-fit"):
        policy_named("nope")


def test_best_fit_puts_a_slice_on_the_fuller_server() -> None:
    pool = make_pool({"a": 2, "b": 2}, "best-fit")
    grant(pool, "held", LeaseRequest(compute_pct=60, node="b"))
    assert nodes_of(pool, grant(pool, "x", LeaseRequest(compute_pct=30))) == {"b"}


def test_spread_puts_a_slice_on_the_emptier_server() -> None:
    pool = make_pool({"a": 2, "b": 2}, "spread")
    grant(pool, "held", LeaseRequest(compute_pct=60, node="b"))
    assert nodes_of(pool, grant(pool, "x", LeaseRequest(compute_pct=30))) == {"a"}


def test_packing_prefers_a_gpu_already_in_use() -> None:
    pool = make_pool({"a": 2}, "packing")
    (first,) = grant(pool, "held", LeaseRequest(compute_pct=20))
    assert grant(pool, "x", LeaseRequest(compute_pct=20)) == (first,)


def test_default_policy_keeps_an_empty_server_for_whole_server_gangs() -> None:
    pool = make_pool({"a": 4, "b": 4})
    grant(pool, "held", LeaseRequest(compute_pct=100, node="a"))
    # Slices go where they do not break the last fully free 4-GPU server.
    for i in range(3):
        assert nodes_of(pool, grant(pool, f"s{i}", LeaseRequest(compute_pct=50))) == {"a"}
    assert nodes_of(pool, grant(pool, "gang", LeaseRequest(gpus=4, span_nodes=False))) == {"b"}


def test_default_policy_keeps_a_scarce_model_for_requests_that_need_it() -> None:
    pool = make_pool({"common": 4})
    pool.set_node_up("rare", True)
    for i in range(2):
        pool.upsert_gpu(Gpu(f"rare-g{i}", "rare", "NVIDIA A100", 80 * GIB, i))
    needs_a100 = LeaseRequest(gpu_models=("A100",), compute_pct=100)
    pool.workload.set_mix([(demand_of(LeaseRequest()), 0.5), (demand_of(needs_a100), 0.5)])
    for i in range(4):
        assert nodes_of(pool, grant(pool, f"any{i}", LeaseRequest())) == {"common"}
    assert nodes_of(pool, grant(pool, "a100", needs_a100)) == {"rare"}


def test_locality_prefers_the_clients_own_server_then_any() -> None:
    pool = make_pool({"a": 1, "b": 1}, "best-fit")
    grant(pool, "held", LeaseRequest(compute_pct=50, node="a"))
    assert nodes_of(pool, grant(pool, "x", LeaseRequest(compute_pct=10, prefer_node="b"))) == {"b"}
    grant(pool, "fill", LeaseRequest(compute_pct=90, node="b"))
    assert nodes_of(pool, grant(pool, "y", LeaseRequest(compute_pct=10, prefer_node="b"))) == {"a"}


def test_pinned_server_is_the_only_candidate() -> None:
    pool = make_pool({"a": 1, "b": 1})
    grant(pool, "held", LeaseRequest(node="a"))
    assert "0 available" in str(pool.try_grant("x", LeaseRequest(compute_pct=10, node="a")))


def test_gpu_model_constraint_filters_servers() -> None:
    pool = make_pool({"a": 1}, model="NVIDIA L4")
    pool.set_node_up("b", True)
    pool.upsert_gpu(Gpu("b-g0", "b", "NVIDIA H100", 80 * GIB, 0))
    uuids = grant(pool, "x", LeaseRequest(compute_pct=10, gpu_models=("h100", "a100")))
    assert nodes_of(pool, uuids) == {"b"}


def test_a_direct_lease_needs_cpu_and_memory_on_its_server() -> None:
    pool = make_pool({"a": 2, "b": 2})
    pool.set_host("a", Host(cpu_milli=8000, memory_mib=64 * GIB))
    pool.set_host("b", Host(cpu_milli=32000, memory_mib=256 * GIB))
    big = LeaseRequest(compute_pct=10, cpu_milli=16000, host_memory_mib=32 * GIB)
    assert nodes_of(pool, grant(pool, "x", big)) == {"b"}
    grant(pool, "y", big)
    reason = pool.try_grant("z", big)
    assert isinstance(reason, str) and "CPU" in reason
    pool.release("x")
    assert pool.host_used["b"] == (16000, 32 * GIB)


def test_a_host_only_request_takes_cpu_and_no_gpu() -> None:
    pool = make_pool({"a": 1})
    pool.set_host("a", Host(cpu_milli=4000, memory_mib=GIB))
    grant(pool, "cpu", LeaseRequest(gpus=0, cpu_milli=3000))
    assert pool.holdings["cpu"] == ()
    assert isinstance(pool.try_grant("more", LeaseRequest(gpus=0, cpu_milli=2000)), str)


def test_random_policy_is_reproducible_with_its_seed() -> None:
    def run(seed: int) -> list[tuple[str, ...]]:
        pool = make_pool({f"n{i}": 2 for i in range(6)}, "random", seed=seed)
        return [grant(pool, f"l{i}", LeaseRequest(compute_pct=40)) for i in range(8)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_gang_spans_the_fewest_servers() -> None:
    pool = make_pool({"a": 2, "b": 3, "c": 1})
    for node, n in (("a", 1), ("b", 1)):
        grant(pool, f"held-{node}", LeaseRequest(node=node, gpus=n))
    uuids = grant(pool, "gang", LeaseRequest(gpus=3))
    assert nodes_of(pool, uuids) == {"a", "b"} or nodes_of(pool, uuids) == {"b", "c"}
    assert len(set(uuids)) == 3


requests = st.builds(
    LeaseRequest,
    gpus=st.integers(1, 4),
    compute_pct=st.sampled_from([10, 25, 50, 100]),
    span_nodes=st.booleans(),
    node=st.none() | st.sampled_from(["a", "b"]),
    cpu_milli=st.sampled_from([0, 0, 4000, 16000]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(requests, st.booleans()), min_size=1, max_size=25),
    st.sampled_from(["default", "best-fit", "spread", "fgd", "random"]),
)
def test_gang_is_all_or_nothing_and_the_index_matches_the_pool(
    steps: list[tuple[LeaseRequest, bool]], policy: str
) -> None:
    pool = make_pool({"a": 3, "b": 2, "c": 4}, policy)
    for node, cpu in (("a", 32000), ("b", 16000), ("c", 64000)):
        pool.set_host(node, Host(cpu_milli=cpu))
    for i, (request, release_first) in enumerate(steps):
        if release_first and pool.holdings:
            pool.release(sorted(pool.holdings)[0])
        before = {u: (g.compute_pct, g.memory_mib) for u, g in pool.usage.items()}
        result = pool.try_grant(f"l{i}", request)
        if isinstance(result, str):
            assert {u: (g.compute_pct, g.memory_mib) for u, g in pool.usage.items()} == before
            assert f"l{i}" not in pool.holdings
        else:
            assert len(result) == request.gpus == len({s.gpu_uuid for s in result})
            servers = {pool.gpus[s.gpu_uuid].node for s in result}
            if not request.span_nodes:
                assert len(servers) == 1
            if request.node is not None:
                assert servers == {request.node}
        for node, uuids in pool.node_gpus.items():
            fresh, _order = shape_of(
                (pool.gpus[u] for u in uuids),
                pool.usage,
                pool.ratios,
                pool.hosts.get(node),
                pool.host_used.get(node, (0, 0)),
            )
            assert pool.index.shapes[node] == fresh
            assert node in pool.index.groups[fresh].nodes
        for node, host in pool.hosts.items():
            assert host.cpu_milli is None or pool.host_used.get(node, (0, 0))[0] <= host.cpu_milli


def test_physical_gpus_are_left_to_physical_requests() -> None:
    pool = make_pool({"a": 2})
    pool.set_mode("a-g1", GpuMode.PHYSICAL)
    assert grant(pool, "whole", LeaseRequest(physical=True)) == ("a-g1",)
    assert grant(pool, "slice", LeaseRequest(compute_pct=10)) == ("a-g0",)


def test_request_for_more_server_cpu_than_any_server_has_can_never_fit() -> None:
    import pytest

    from gpupool.core import Gpu, LeaseRequest, NoCapacity, Pool
    from gpupool.core.model import Host

    pool = Pool()
    for node in ("a", "b"):
        pool.set_node_up(node, True)
        pool.set_host(node, Host(cpu_milli=8000, memory_mib=65536))
        for i in range(2):
            pool.upsert_gpu(Gpu(uuid=f"{node}{i}", node=node, model="H100", memory_mib=81920, index=i))
    pool.check_can_ever_fit(LeaseRequest(gpus=1, compute_pct=10, memory_mib=1024, cpu_milli=8000))
    pool.check_can_ever_fit(LeaseRequest(gpus=4, compute_pct=10, memory_mib=1024, cpu_milli=12000))
    with pytest.raises(NoCapacity, match="never"):
        pool.check_can_ever_fit(LeaseRequest(gpus=1, compute_pct=10, memory_mib=1024, cpu_milli=9000))
    with pytest.raises(NoCapacity, match="never"):
        pool.check_can_ever_fit(
            LeaseRequest(gpus=2, compute_pct=10, memory_mib=1024, cpu_milli=12000, span_nodes=False)
        )
