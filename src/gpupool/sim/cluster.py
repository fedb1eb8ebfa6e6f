"""A trace's cluster as a gpupool `Pool`, and its pods as lease requests.

The simulator drives the very `Pool` the controller uses. A pod's `gpu_milli` becomes a
slice whose memory is exactly that share of the GPU (GPUs are given 1,000 x 80 MiB so
thousandths map to whole MiB) and whose compute share is rounded down to whole percent,
so the share that binds is exact to the thousandth, as in the trace.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpupool.core import FAIR, Gpu, Host, LeaseRequest, Pool, QueuePolicy, Quota
from gpupool.core.placement import Demand, demand_of, mix_of, policy_named
from gpupool.sim.trace import NodeSpec, PodSpec

MIB_PER_MILLI = 80
GPU_MEMORY_MIB = 1000 * MIB_PER_MILLI


def request_of(pod: PodSpec, tenant: str = "default") -> LeaseRequest:
    if pod.num_gpu == 0:
        return LeaseRequest(
            tenant=tenant,
            gpus=0,
            cpu_milli=max(pod.cpu_milli, 1),
            host_memory_mib=pod.memory_mib,
            span_nodes=False,
        )
    whole = pod.gpu_milli >= 1000
    return LeaseRequest(
        tenant=tenant,
        gpus=pod.num_gpu,
        compute_pct=100 if whole else max(1, pod.gpu_milli // 10),
        memory_mib=None if whole else max(1, pod.gpu_milli * MIB_PER_MILLI),
        gpu_models=pod.gpu_spec,
        span_nodes=False,
        cpu_milli=pod.cpu_milli,
        host_memory_mib=pod.memory_mib,
    )


def build_pool(
    nodes: Iterable[NodeSpec],
    policy: str = "default",
    seed: int = 0,
    workload: Iterable[Demand] = (),
    queue_policy: QueuePolicy = FAIR,
    tenants: Iterable[str] = ("default",),
) -> Pool:
    """A pool with the trace's servers, all up; `workload` is the mix placement expects."""
    pool = Pool(policy=policy_named(policy, seed), queue_policy=queue_policy)
    pool.learn_workload = False
    for name in tenants:
        pool.quotas[name] = Quota()
    for node in nodes:
        pool.set_node_up(node.name, True)
        pool.set_host(node.name, Host(cpu_milli=node.cpu_milli, memory_mib=node.memory_mib))
        for i in range(node.gpus):
            pool.upsert_gpu(Gpu(f"{node.name}-g{i}", node.name, node.model, GPU_MEMORY_MIB, i))
    mix = mix_of(workload)
    if mix:
        pool.workload.set_mix(mix)
    return pool


def demands_of(pods: Iterable[PodSpec]) -> list[Demand]:
    return [demand_of(request_of(p)) for p in pods]


def capacity_gpus(nodes: Iterable[NodeSpec]) -> int:
    return sum(n.gpus for n in nodes)


def allocated_milli(pool: Pool) -> int:
    """GPU thousandths held: whole GPUs 1000, slices their binding share."""
    total = 0
    for slices in pool.holdings.values():
        for s in slices:
            if s.whole or s.compute_pct >= 100:
                total += 1000
            else:
                total += s.memory_mib // MIB_PER_MILLI
    return total


def fragmentation_pct(pool: Pool) -> float:
    """Share of idle GPU that the typical pods cannot use (FGD's fragmentation rate)."""
    frag = idle = 0.0
    for group in pool.index:
        up = sum(1 for n in group.nodes if n in pool.nodes_up)
        if not up:
            continue
        idle_here = sum(s.share_free() for s in group.shape.slots)
        if idle_here <= 0:
            continue
        idle += up * idle_here
        frag += up * pool.workload.fragmentation(group.shape)
    return 100.0 * frag / idle if idle > 0 else 0.0
