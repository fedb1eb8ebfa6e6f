"""Where a running remote lease goes when it moves (migration, resize, drain, evacuation).

The lease keeps its old slices until its state arrived on the new ones, so a destination must
have room for the new slice on top of everything granted now, the old slice included. That is
also what makes a resize on the same GPU possible only when the GPU can hold both a moment.

Its tenant's quota counts the lease once meanwhile (`move_charge`): the GPUs hold two places,
the tenant uses one.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpupool.core.errors import InvalidRequest, NoCapacity, QuotaExceeded
from gpupool.core.model import Gpu, GpuMode, Quota, Slice, Usage, quota_violation, usage_of
from gpupool.core.pool import ModeChange, Pool

SHADOW = "~from"
"""Pool id suffix of the old slices a moving lease holds until its state has moved."""


def move_charge(old: tuple[Slice, ...], new: tuple[Slice, ...]) -> Usage:
    """What a lease moving from `old` to `new` slices charges its tenant while it holds both:
    per resource the larger of the two places, and one lease.

    The double hold is the pool's doing (a drain, an evacuation, an operator's migration) and
    lasts until the state has moved: charging both places would push a tenant at its quota
    over it, and queue or refuse its next request, for a move it did not ask for. Charging only
    the new place would let a shrinking resize free quota while the old, larger slices still
    run. The larger of the two is exact for a plain move (the charge does not change) and, for
    a resize, is what the tenant holds at the start or at the end, whichever is more.
    """
    was, now = usage_of(old), usage_of(new)
    return Usage(
        gpus=max(was.gpus, now.gpus),
        memory_mib=max(was.memory_mib, now.memory_mib),
        compute_pct=max(was.compute_pct, now.compute_pct),
        leases=1,
    )


def old_place_charge(old: tuple[Slice, ...], new: tuple[Slice, ...]) -> Usage:
    """What the old place (`<lease>~from`) adds to the new one's charge: `move_charge` in all."""
    total, now = move_charge(old, new), usage_of(new)
    total.add(now, sign=-1)
    return total


def move_quota_blocks(
    quota: Quota, held: Usage, old: tuple[Slice, ...], new: tuple[Slice, ...]
) -> str | None:
    """Which limit a move from `old` to `new` would break for a tenant holding `held` (the old
    place included), or None. Only what the move adds to the charge is checked: a move that
    does not grow (a migration, a drain, a shrinking resize) is never refused, even for a tenant
    at its quota, or above it because the quota was lowered since its leases were granted."""
    extra = move_charge(old, new)
    extra.add(usage_of(old), sign=-1)
    if extra == Usage():
        return None
    return quota_violation(quota, held, extra)


def _check_quota(pool: Pool, lease_id: str, new: tuple[Slice, ...]) -> None:
    tenant = pool.owners[lease_id]
    problem = move_quota_blocks(
        pool.quotas.get(tenant, Quota()), pool.held_by(tenant), pool.holdings[lease_id], new
    )
    if problem is not None:
        raise QuotaExceeded(f"tenant {tenant}: {problem}")


def begin_move(pool: Pool, lease_id: str, targets: tuple[Slice, ...]) -> None:
    """The lease holds `targets` from now on, and its old slices under `<lease>~from` until
    `end_move`: placement sees both places taken, the quota one (`move_charge`).

    Raises QuotaExceeded, changing nothing, when a resize would grow the lease past its
    tenant's quota."""
    _check_quota(pool, lease_id, targets)
    old = pool.holdings[lease_id]
    tenant = pool.owners[lease_id]
    priority = pool.priorities.get(lease_id, 0)
    host = pool.host_held.get(lease_id, ())
    # The old place is held before the lease lets it go, so no drain ends in between.
    hold_old_place(pool, lease_id, old, targets)
    pool.release(lease_id)
    pool.grant(lease_id, tenant, targets, priority, host)


def hold_old_place(
    pool: Pool, lease_id: str, old: tuple[Slice, ...], new: tuple[Slice, ...]
) -> None:
    """Hold the old slices of a lease that holds `new` now under `<lease>~from` (also when a
    controller rebuilds its pool from the database), charged only beyond the new place."""
    pool.grant(
        lease_id + SHADOW,
        pool.owners[lease_id],
        old,
        pool.priorities.get(lease_id, 0),
        charge=old_place_charge(old, new),
    )


def end_move(pool: Pool, lease_id: str) -> list[ModeChange]:
    """The state has moved (or the lease ended): the old place goes back to the pool;
    draining GPUs it alone held switch mode."""
    return pool.release(lease_id + SHADOW)


def resize_in_place(pool: Pool, lease_id: str, new: tuple[Slice, ...]) -> None:
    """The lease's slices become `new` on the same GPUs, without a second place (a worker's
    memory limit changes at once). Raises QuotaExceeded, changing nothing, when the tenant's
    quota does not allow the growth."""
    _check_quota(pool, lease_id, new)
    tenant = pool.owners[lease_id]
    priority = pool.priorities.get(lease_id, 0)
    host = pool.host_held.get(lease_id, ())
    pool.release(lease_id)
    pool.grant(lease_id, tenant, new, priority, host)


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
