"""Elastic remote leases: swap-out when idle, restore, live resize, migration, evacuation.

A remote lease's workers are numbered by generation. While its state moves, `row.elastic`
holds the handoff: the slices of the generation that still holds the state (`from`), kept
running until the new generation (the lease's slices now) reports that it took the state
over. Capacity follows the same rule: a migrating lease also holds its old slices, under the
pool id `<lease>~from`, until the handoff ends. A swapped lease holds no capacity at all; its
worker keeps the tensors in host memory until the client needs them, and then the lease is
placed again like a new request (it may wait in the queue: the client sees the wait).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.orm import Session

from gpupool.controller.elastic_record import (
    generation,
    handoff,
    room_denied_seq,
    swap_order,
    swap_reason,
)
from gpupool.controller.models import LeaseRow, LeaseSliceRow, utcnow
from gpupool.controller.services.events import record
from gpupool.controller.services.leases import persist_grants, persist_mode_changes
from gpupool.controller.store import Store, request_of, slices_of
from gpupool.controller.views import lease_out
from gpupool.core import (
    Access,
    Conflict,
    InvalidRequest,
    LeaseState,
    NoCapacity,
    NotFound,
    Slice,
    transition,
)
from gpupool.core.migrate import (
    SHADOW,
    begin_move,
    end_move,
    migration_targets,
    resize_in_place,
)
from gpupool.core.model import GpuUsage
from gpupool.protocol.v1.api import LeaseOut, RemoteLease, RemoteSlice, WorkerReport

MOVABLE = frozenset({LeaseState.GRANTED, LeaseState.ACTIVE, LeaseState.IDLE})


# ---- the handoff record -----------------------------------------------------------------


def _piece(s: LeaseSliceRow) -> dict[str, Any]:
    return {
        "gpu_uuid": s.gpu_uuid,
        "node": s.node,
        "gpu_index": s.gpu_index,
        "compute_pct": s.compute_pct,
        "memory_mib": s.memory_mib,
        "endpoint": s.endpoint,
    }


def _begin(row: LeaseRow, reason: str) -> None:
    gen = generation(row)
    # A new dict, not an update in place: the JSON column sees only assignments.
    row.elastic = {
        "gen": gen,
        "handoff": {
            "from": [_piece(s) for s in row.slices],
            "from_gen": gen,
            "to_gen": gen + 1,
            "reason": reason,
            "shadow": reason != "restore",
            "started_at": time.time(),
        },
    }


def _slice_rows(store: Store, slices: tuple[Slice, ...]) -> list[LeaseSliceRow]:
    return [
        LeaseSliceRow(
            position=i,
            gpu_uuid=s.gpu_uuid,
            node=store.pool.gpus[s.gpu_uuid].node,
            gpu_index=store.pool.gpus[s.gpu_uuid].index,
            compute_pct=s.compute_pct,
            memory_mib=s.memory_mib,
            whole=False,
        )
        for i, s in enumerate(slices)
    ]


def _where(rows: list[LeaseSliceRow] | list[dict[str, Any]]) -> str:
    parts = []
    for s in rows:
        node, index = (s["node"], s["gpu_index"]) if isinstance(s, dict) else (s.node, s.gpu_index)
        parts.append(f"{node}/{index}")
    return ", ".join(parts)


# ---- migration and resize ------------------------------------------------------------------


def _movable(store: Store, session: Session, lease_id: str) -> LeaseRow:
    row = store.lease_row(session, lease_id)
    if row is None:
        raise NotFound(f"no lease {lease_id!r}")
    if row.access != Access.REMOTE.value:
        raise InvalidRequest(
            f"lease {lease_id} is direct: only remote leases move while their program runs"
        )
    state = LeaseState(row.state)
    if state is LeaseState.MIGRATING or handoff(row) is not None:
        raise Conflict(f"lease {lease_id} is already moving; try again when it is active")
    if state not in MOVABLE:
        raise Conflict(f"lease {lease_id} is {state.value}: only a granted lease can move")
    return row


def migrate(
    store: Store,
    session: Session,
    lease_id: str,
    actor: str,
    *,
    to: str | None = None,
    compute_pct: int | None = None,
    memory_mib: int | None = None,
    avoid_nodes: tuple[str, ...] = (),
    reason: str = "migration",
) -> LeaseOut:
    """Start moving a running remote lease: new workers adopt the state, the client follows."""
    row = _movable(store, session, lease_id)
    pool = store.pool
    old = slices_of(row)
    stay = reason == "resize"
    targets = migration_targets(
        pool,
        old,
        to=to,
        compute_pct=compute_pct,
        memory_mib=memory_mib,
        avoid_nodes=avoid_nodes,
        stay=stay,
    )
    # The old slices stay held (under the shadow id) until the state has moved.
    begin_move(pool, lease_id, targets)
    _begin(row, reason)
    row.slices = _slice_rows(store, targets)
    if compute_pct is not None:
        row.compute_pct = compute_pct
    if memory_mib is not None:
        row.memory_mib = memory_mib
    row.state = transition(LeaseState(row.state), LeaseState.MIGRATING).value
    before = _where(handoff(row)["from"])  # type: ignore[index]
    record(
        session, actor, f"lease.{reason}", lease_id, f"{reason}: {before} -> {_where(row.slices)}"
    )
    return lease_out(row, pool)


def resize(
    store: Store,
    session: Session,
    lease_id: str,
    actor: str,
    compute_pct: int | None,
    memory_mib: int | None,
) -> LeaseOut:
    """A live resize. Memory alone, where the GPU has room: the worker's limit changes at once.
    A new compute share needs a new worker (an MPS client's thread percentage is fixed when it
    connects): the lease migrates to a fresh worker with the new limits, on the same GPU where
    it fits, transparently to the client."""
    if compute_pct is None and memory_mib is None:
        raise InvalidRequest("give a new compute share, memory, or both")
    if memory_mib is not None and memory_mib < 1:
        raise InvalidRequest("memory must be at least 1MiB")
    row = _movable(store, session, lease_id)
    pool = store.pool
    old = slices_of(row)
    same_compute = compute_pct is None or all(s.compute_pct == compute_pct for s in old)
    if same_compute and memory_mib is not None:
        grown = [
            s for s in old if pool.free_on(pool.gpus[s.gpu_uuid])[1] < memory_mib - s.memory_mib
        ]
        if not grown:
            new = tuple(Slice(s.gpu_uuid, s.compute_pct, memory_mib) for s in old)
            resize_in_place(pool, lease_id, new)
            for piece in row.slices:
                piece.memory_mib = memory_mib
            row.memory_mib = memory_mib
            record(session, actor, "lease.resize", lease_id, f"memory -> {memory_mib}MiB in place")
            return lease_out(row, pool)
    return migrate(
        store,
        session,
        lease_id,
        actor,
        compute_pct=compute_pct,
        memory_mib=memory_mib,
        reason="resize",
    )


def evacuate(store: Store, session: Session, uuid: str, actor: str, why: str) -> list[str]:
    """Move the running remote leases off one GPU (switched to physical, drained, or degraded);
    one that finds no room elsewhere stays until it ends, and an event says so."""
    moved: list[str] = []
    for lease_id in sorted(store.pool.usage.get(uuid, GpuUsage()).leases):
        row = store.lease_rows.get(lease_id)
        if row is None or row.access != Access.REMOTE.value or SHADOW in lease_id:
            continue
        if LeaseState(row.state) not in MOVABLE or handoff(row) is not None:
            continue
        try:
            migrate(store, session, lease_id, actor, reason="evacuation")
        except NoCapacity as exc:
            record(session, actor, "lease.evacuation_failed", lease_id, f"{why}: {exc}")
            continue
        moved.append(lease_id)
    return moved


# ---- what the workers report ---------------------------------------------------------------


def note_reports(
    store: Store, session: Session, row: LeaseRow, reports: list[WorkerReport]
) -> None:
    """Swap-outs, requests for a GPU again, and finished handoffs, from one lease's workers."""
    state = LeaseState(row.state)
    current = handoff(row)
    if current is not None:
        _maybe_finish(store, session, row, current, reports)
        return
    gen = generation(row)
    mine = [r for r in reports if r.generation == gen and r.alive]
    if not mine:
        return
    if state in MOVABLE and any(r.swapped for r in mine):
        _swapped(store, session, row)
    elif state is LeaseState.SWAPPED and any(r.wants_gpu for r in mine):
        _wants_gpu(store, session, row)


def _swapped(store: Store, session: Session, row: LeaseRow) -> None:
    """The worker swapped its client out: because the controller ordered it (another session
    of the GPU needed the memory) or because the client idled; the reason stays shown."""
    reason = swap_reason(row) or "idle"
    row.elastic = {**(row.elastic or {}), "swap": {**(swap_order(row) or {}), "reason": reason}}
    row.state = transition(LeaseState(row.state), LeaseState.SWAPPED).value
    changes = store.pool.release(row.id)
    record(
        session,
        "controller",
        "lease.swapped",
        row.id,
        f"{reason}: tensors in host memory on {_where(row.slices)}; slice back in the pool",
    )
    persist_mode_changes(store, session, changes)
    persist_grants(store, session, store.pool.serve_queue(now=time.time()), utcnow())


def _wants_gpu(store: Store, session: Session, row: LeaseRow) -> None:
    """The client needs its tensors: place the lease again, as a request in the queue."""
    _begin(row, "restore")
    row.state = transition(LeaseState(row.state), LeaseState.QUEUED).value
    entry = store.pool.enqueue(row.id, request_of(row), now=time.time())
    row.queue_seq = entry.seq
    record(
        session,
        "controller",
        "lease.restoring",
        row.id,
        "the program needs its GPU again: placing the lease",
    )
    persist_grants(store, session, store.pool.serve_queue(now=time.time()), utcnow())


def _maybe_finish(
    store: Store,
    session: Session,
    row: LeaseRow,
    current: dict[str, Any],
    reports: list[WorkerReport],
) -> None:
    if LeaseState(row.state) not in (LeaseState.MIGRATING, *MOVABLE):
        return  # still queued for a GPU to restore on
    to_gen = int(current["to_gen"])
    adopted = {r.gpu_uuid for r in reports if r.generation == to_gen and r.alive and r.adopted}
    if not row.slices or not all(s.gpu_uuid in adopted for s in row.slices):
        return
    # Draining GPUs that only the old slices held switch now.
    changes = end_move(store.pool, row.id)
    row.elastic = {"gen": to_gen}
    was = LeaseState(row.state)
    if was is LeaseState.MIGRATING:
        row.state = transition(was, LeaseState.ACTIVE).value
    took = time.time() - float(current.get("started_at", time.time()))
    record(
        session,
        "controller",
        f"lease.{current.get('reason', 'migration')}.done",
        row.id,
        f"state on {_where(row.slices)} after {took:.1f} s; old workers stop",
    )
    persist_mode_changes(store, session, changes)
    persist_grants(store, session, store.pool.serve_queue(now=time.time()), utcnow())


# ---- what the agents run ---------------------------------------------------------------------


KEEP_STATES = frozenset(
    {
        LeaseState.GRANTED,
        LeaseState.ACTIVE,
        LeaseState.IDLE,
        LeaseState.MIGRATING,
        LeaseState.SWAPPED,
        LeaseState.QUEUED,
        LeaseState.PREEMPTED,
    }
)


def remote_lease_for(store: Store, row: LeaseRow, node: str) -> RemoteLease | None:
    """The workers `node` runs for a remote lease: the current generation's slices, and while
    a handoff lasts the old generation's too (the new ones adopt from them)."""
    state = LeaseState(row.state)
    if row.access != Access.REMOTE.value or row.worker_token is None or state not in KEEP_STATES:
        return None
    current = handoff(row)
    gen = generation(row)
    pieces: list[RemoteSlice] = []
    placed = state is not LeaseState.QUEUED and state is not LeaseState.SWAPPED
    olds: list[dict[str, Any]] = list(current["from"]) if current is not None else []
    if current is None:
        if state is LeaseState.QUEUED:
            return None
        pieces += [
            _remote(s.gpu_uuid, s.gpu_index, s.compute_pct, s.memory_mib, gen)
            for s in row.slices
            if s.node == node
        ]
    else:
        from_gen, to_gen = int(current["from_gen"]), int(current["to_gen"])
        pieces += [
            _remote(p["gpu_uuid"], p["gpu_index"], p["compute_pct"], p["memory_mib"], from_gen)
            for p in olds
            if p["node"] == node
        ]
        if placed:
            for position, s in enumerate(row.slices):
                if s.node != node:
                    continue
                source = olds[position]["endpoint"] if position < len(olds) else None
                pieces.append(
                    _remote(s.gpu_uuid, s.gpu_index, s.compute_pct, s.memory_mib, to_gen, source)
                )
    if not pieces:
        return None
    for piece in pieces:
        piece.room_denied_seq = room_denied_seq(row, piece.gpu_uuid)
    idle = (
        row.idle_timeout_s
        if row.idle_timeout_s is not None
        else store.idle_timeouts.get(row.tenant)
    )
    ordered = swap_reason(row) if state in MOVABLE and current is None else None
    return RemoteLease(
        token=row.worker_token,
        peer_secret=row.peer_secret,
        peers=[s.endpoint for s in row.slices],
        host_memory_mib=row.host_memory_mib or 0,
        slices=pieces,
        idle_timeout_s=idle,
        swap_reason=ordered,
    )


def _remote(
    uuid: str, index: int, compute: int, memory: int, gen: int, source: str | None = None
) -> RemoteSlice:
    return RemoteSlice(
        gpu_uuid=uuid,
        gpu_index=index,
        compute_pct=compute,
        memory_mib=memory,
        generation=gen,
        restore_from=source,
    )
