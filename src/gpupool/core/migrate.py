"""Where a running remote lease goes when it moves (migration, resize, drain, evacuation).

The lease keeps its old slices until its state arrived on the new ones, so a destination must
have room for the new slice on top of everything granted now, the old slice included. That is
also what makes a resize on the same GPU possible only when the GPU can hold both a moment.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpupool.core.errors import InvalidRequest, NoCapacity
from gpupool.core.model import Gpu, GpuMode, Slice
from gpupool.core.pool import Pool

SHADOW = "~from"
"""Pool id suffix of the old slices a moving lease holds until its state has moved."""


def migration_targets(
    pool: Pool,
    slices: tuple[Slice, ...],
    *,
    to: str | None = None,
    compute_pct: int | None = None,
    memory_mib: int | None = None,
    avoid_nodes: Iterable[str] = (),
    stay: bool = False,
) -> tuple[Slice, ...]:
    """One destination slice per current slice, or NoCapacity saying what is missing.

    `to` is a GPU uuid or a node name (None: anywhere but where the lease is now, unless `stay`:
    a resize, which prefers the lease's own GPUs); `avoid_nodes` are never chosen (a drain)."""
    avoid = set(avoid_nodes)
    if to is not None and to not in pool.gpus and to not in pool.node_gpus:
        raise InvalidRequest(f"no GPU or node {to!r} in this pool")
    chosen: list[Slice] = []
    taken: set[str] = set()
    for current in slices:
        want_compute = compute_pct if compute_pct is not None else current.compute_pct
        want_memory = memory_mib if memory_mib is not None else current.memory_mib
        candidates = [
            gpu
            for gpu in _candidates(pool, to, avoid)
            if gpu.uuid not in taken and (stay or to is not None or gpu.uuid != current.gpu_uuid)
        ]
        fitting = [g for g in candidates if _fits(pool, g, want_compute, want_memory)]
        if not fitting:
            where = f"on {to}" if to is not None else "on any other GPU"
            raise NoCapacity(
                f"no room for a slice of {want_compute}% and {want_memory}MiB {where} "
                f"(the old slice is held until the state has moved)"
            )
        best = min(fitting, key=lambda g: _preference(pool, g, current, stay))
        chosen.append(Slice(best.uuid, want_compute, want_memory))
        taken.add(best.uuid)
    return tuple(chosen)


def _candidates(pool: Pool, to: str | None, avoid: set[str]) -> list[Gpu]:
    if to is not None and to in pool.gpus:
        gpu = pool.gpus[to]
        if gpu.mode is not GpuMode.VIRTUAL or not gpu.healthy or gpu.node not in pool.nodes_up:
            raise InvalidRequest(f"GPU {to} takes no remote slices now ({gpu.mode.value})")
        return [gpu]
    return [
        gpu
        for gpu in pool.gpus.values()
        if gpu.mode is GpuMode.VIRTUAL
        and gpu.healthy
        and gpu.node in pool.nodes_up
        and gpu.node not in avoid
        and (to is None or gpu.node == to)
    ]


def _fits(pool: Pool, gpu: Gpu, compute_pct: int, memory_mib: int) -> bool:
    if pool.usage[gpu.uuid].whole:
        return False
    compute, memory = pool.free_on(gpu)
    return compute >= compute_pct and memory >= memory_mib


def _preference(pool: Pool, gpu: Gpu, current: Slice, stay: bool) -> tuple[int, int, int]:
    """Stay on the same GPU for a resize, else the same server (no network copy), then the
    GPU with the most free memory."""
    here = pool.gpus.get(current.gpu_uuid)
    same_gpu = 0 if stay and gpu.uuid == current.gpu_uuid else 1
    same_node = 0 if here is not None and gpu.node == here.node else 1
    return same_gpu, same_node, -pool.free_on(gpu)[1]
