"""Dual pool: move idle GPUs between the virtual and physical pools to follow demand.

While whole-GPU (physical) requests wait, idle virtual GPUs that suit them become
physical, plus `ready` more so the next ones start at once. While slices wait and no
physical request does, idle physical GPUs beyond `ready` go back to the virtual pool.
Only idle GPUs move, so no lease is disturbed; busy GPUs are the operator's to drain.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupool.core.model import Gpu, GpuMode, LeaseRequest
from gpupool.core.pool import ModeChange, Pool


@dataclass(frozen=True, slots=True)
class DualPoolPolicy:
    ready: int = 1
    """Idle physical GPUs to keep while physical requests queue."""


def _idle(pool: Pool, gpu: Gpu, mode: GpuMode) -> bool:
    return (
        gpu.mode is mode
        and gpu.target_mode is None
        and gpu.healthy
        and gpu.node in pool.nodes_up
        and not pool.usage[gpu.uuid].leases
    )


def _suits(gpu: Gpu, request: LeaseRequest) -> bool:
    return (request.node is None or gpu.node == request.node) and request.model_allowed(gpu.model)


def rebalance(pool: Pool, policy: DualPoolPolicy) -> list[ModeChange]:
    """Switch idle GPUs between the pools; returns the switches made."""
    waiting = pool.ordered_queue()
    physical = [e.request for e in waiting if e.request.physical]
    virtual_blocked = any(not e.request.physical and pool.plan(e.request) is None for e in waiting)
    idle_virtual = sorted(
        (g for g in pool.gpus.values() if _idle(pool, g, GpuMode.VIRTUAL)),
        key=lambda g: (g.node, g.index, g.uuid),
    )
    idle_physical = [g for g in pool.gpus.values() if _idle(pool, g, GpuMode.PHYSICAL)]
    changes: list[ModeChange] = []
    if physical:
        spare = list(idle_physical)
        for request in physical:
            have = [g for g in spare if _suits(g, request)]
            short = request.gpus - len(have)
            for g in have[: request.gpus]:
                spare.remove(g)
            if short <= 0:
                continue
            chosen = _pick(idle_virtual, request, short, have)
            for g in chosen:
                idle_virtual.remove(g)
                changes.append(pool.set_mode(g.uuid, GpuMode.PHYSICAL))
        for g in idle_virtual[: max(0, policy.ready - len(spare))]:
            changes.append(pool.set_mode(g.uuid, GpuMode.PHYSICAL))
    elif virtual_blocked and len(idle_physical) > policy.ready:
        surplus = sorted(idle_physical, key=lambda g: (g.node, g.index, g.uuid))
        for g in surplus[policy.ready :]:
            changes.append(pool.set_mode(g.uuid, GpuMode.VIRTUAL))
    return changes


def _pick(idle: list[Gpu], request: LeaseRequest, short: int, have: list[Gpu]) -> list[Gpu]:
    suitable = [g for g in idle if _suits(g, request)]
    if request.span_nodes:
        return suitable[:short]
    # One server: the one that, with the physical GPUs it already has free, needs fewest.
    by_node: dict[str, list[Gpu]] = {}
    for g in suitable:
        by_node.setdefault(g.node, []).append(g)
    best: list[Gpu] = []
    for node, gpus in sorted(by_node.items()):
        ready_here = sum(1 for g in have if g.node == node)
        need = request.gpus - ready_here
        if len(gpus) >= need and (not best or need < len(best)):
            best = gpus[:need]
    return best
