"""GPUs: list and show, and the operator's switches (mode, drain, isolate, clear)."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpupool.controller.models import GpuRow, utcnow
from gpupool.controller.services import elastic
from gpupool.controller.services.auth import Principal
from gpupool.controller.services.events import record
from gpupool.controller.services.leases import persist_grants, release
from gpupool.controller.store import Store
from gpupool.controller.views import gpu_out
from gpupool.core import GpuMode, InvalidRequest, ModeChange, NotFound, ReleaseReason, dualpool
from gpupool.protocol.v1.api import GpuOut


def _row(store: Store, session: Session, uuid: str) -> GpuRow:
    row = store.gpu_row(session, uuid)
    if row is None:
        raise NotFound(f"no GPU {uuid!r}")
    return row


def _after_change(
    store: Store,
    session: Session,
    row: GpuRow,
    change: ModeChange,
    actor: str,
    kind: str,
    message: str,
) -> GpuOut:
    gpu = store.pool.gpus[row.uuid]
    row.mode = gpu.mode.value
    row.target_mode = gpu.target_mode.value if gpu.target_mode else None
    row.healthy = gpu.healthy
    record(session, actor, kind, row.uuid, message, old=change.old.value, new=change.new.value)
    persist_grants(store, session, store.pool.serve_queue(), utcnow())
    return gpu_out(row, store.pool, store.live.telemetry.get(row.uuid))


def set_mode(store: Store, session: Session, uuid: str, mode: str, actor: str) -> GpuOut:
    row = _row(store, session, uuid)
    try:
        target = GpuMode(mode)
    except ValueError:
        raise InvalidRequest(f"unknown mode {mode!r} (virtual or physical)") from None
    change = store.pool.set_mode(uuid, target)
    if change.new is GpuMode.DRAINING:
        # Remote leases need not be waited for: they move to other GPUs while they run.
        elastic.evacuate(store, session, uuid, actor, f"GPU {uuid} switches to {target.value}")
        message = (
            f"draining to {target.value}: waits for {len(store.pool.usage[uuid].leases)} lease(s)"
        )
    else:
        message = f"mode {change.old.value} -> {change.new.value}"
    return _after_change(store, session, row, change, actor, "gpu.mode", message)


def drain(store: Store, session: Session, uuid: str, actor: str) -> GpuOut:
    row = _row(store, session, uuid)
    change = store.pool.drain(uuid)
    elastic.evacuate(store, session, uuid, actor, f"GPU {uuid} drains")
    return _after_change(store, session, row, change, actor, "gpu.drain", "draining: no new leases")


def isolate(
    store: Store,
    session: Session,
    uuid: str,
    reason: str,
    actor: str,
    fault: bool = False,
    caller: Principal | None = None,
) -> GpuOut:
    """Take a GPU out of service. After a hardware fault its leases end: their holders are
    told by the lease's state and reason and by an event, and the queue moves on.

    `caller`, when given, must be allowed to act for the GPU's node (an admin, or that
    node's agent): one node's agent cannot isolate another node's GPUs.
    """
    row = _row(store, session, uuid)
    if caller is not None:
        caller.check_node(row.node, f"isolate GPU {uuid}")
    if fault and row.mode == GpuMode.ISOLATED.value and row.isolation_reason == reason:
        return gpu_out(row, store.pool, store.live.telemetry.get(uuid))  # the agent repeats itself
    change = store.pool.isolate(uuid)
    row.isolation_reason = reason
    if not fault:  # degraded, still working: its remote leases move away while they run
        elastic.evacuate(store, session, uuid, actor, f"GPU {uuid} isolated: {reason}")
    if fault:
        store.pool.gpus[uuid] = replace(store.pool.gpus[uuid], healthy=False)
        for lease_id in sorted(store.pool.usage[uuid].leases):
            release(store, session, lease_id, "controller", ReleaseReason.GPU_FAILED)
            record(
                session, "controller", "lease.gpu_failed", lease_id, f"GPU {uuid} failed: {reason}"
            )
    return _after_change(store, session, row, change, actor, "gpu.isolated", f"isolated: {reason}")


def clear(store: Store, session: Session, uuid: str, actor: str) -> GpuOut:
    row = _row(store, session, uuid)
    change = store.pool.clear(uuid)
    row.isolation_reason = None
    row.healthy = True
    return _after_change(
        store,
        session,
        row,
        change,
        actor,
        "gpu.cleared",
        f"isolation cleared, back to {change.new.value}",
    )


def list_gpus(
    store: Store, session: Session, node: str | None = None, mode: str | None = None
) -> list[GpuOut]:
    query = select(GpuRow).order_by(GpuRow.node, GpuRow.index)
    if node:
        query = query.where(GpuRow.node == node)
    rows = list(session.scalars(query))
    with store.lock:
        out = [gpu_out(r, store.pool, store.live.telemetry.get(r.uuid)) for r in rows]
    if mode:
        if mode not in {m.value for m in GpuMode}:
            raise InvalidRequest(f"unknown mode {mode!r}")
        out = [g for g in out if g.mode == mode]
    return out


def get(store: Store, session: Session, uuid: str) -> GpuOut:
    row = _row(store, session, uuid)
    with store.lock:
        return gpu_out(row, store.pool, store.live.telemetry.get(uuid))


def rebalance(store: Store, session: Session) -> int:
    """Dual pool: move idle GPUs between the pools to follow demand, when configured."""
    ready = store.settings.physical_ready
    if ready is None:
        return 0
    changes = dualpool.rebalance(store.pool, dualpool.DualPoolPolicy(ready=ready))
    for change in changes:
        row = store.gpu_row(session, change.gpu_uuid)
        if row is None:
            continue
        row.mode = change.new.value
        row.target_mode = change.target.value if change.target else None
        record(
            session,
            "dual-pool policy",
            "gpu.mode",
            change.gpu_uuid,
            f"mode {change.old.value} -> {change.new.value}: following demand",
            old=change.old.value,
            new=change.new.value,
        )
    return len(changes)
