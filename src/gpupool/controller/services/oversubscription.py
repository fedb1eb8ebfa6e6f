"""Memory oversubscription at run time: who gives way when a worker's GPU runs short.

A worker whose allocation fits its lease's limit but not its GPU's free memory reports the
shortfall with its agent's heartbeat (`WorkerReport.room_wanted_mib`, numbered by `room_seq`).
All the workers of that GPU report in the same heartbeat (a GPU has one node), so their
memory and last op are what the policy (`gpupool.core.oversubscription.choose_victims`)
weighs. The chosen leases are ordered to swap out (`RemoteLease.swap_reason`, through the
swap path idle release uses); their slices go back to the pool when they have, and each
resumes at its next op, placed again. When nobody can give way, the request is refused
(`RemoteSlice.room_denied_seq`) and the allocation fails with its lease's OutOfMemoryError.

Both answers live in the lease's `elastic` record (`swap`, `room`), so they survive a
controller restart like the rest of the lease; a restore or migration starts that record
afresh.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.orm import Session

from gpupool.controller.elastic_record import generation, swap_order
from gpupool.controller.models import LeaseRow
from gpupool.controller.services.events import record
from gpupool.controller.store import Store
from gpupool.core import Access, LeaseState
from gpupool.core.oversubscription import Session as GpuSession
from gpupool.core.oversubscription import choose_victims, is_idle
from gpupool.protocol.v1.api import WorkerReport

REASON = "oversubscription"
ASKING = frozenset({LeaseState.GRANTED, LeaseState.ACTIVE, LeaseState.IDLE})
"""A lease in these states has a client on its worker that may allocate."""


def note_room_requests(store: Store, session: Session, reports: list[WorkerReport]) -> None:
    """Answer each new request for room in one node's heartbeat."""
    for report in reports:
        if report.alive and report.room_wanted_mib > 0 and report.room_seq > 0:
            row = store.lease_rows.get(report.lease_id)
            if row is not None and LeaseState(row.state) in ASKING:
                _answer(store, session, row, report, reports)


def _answer(
    store: Store,
    session: Session,
    row: LeaseRow,
    request: WorkerReport,
    reports: list[WorkerReport],
) -> None:
    rooms: dict[str, Any] = dict((row.elastic or {}).get("room", {}))
    seen = rooms.get(request.gpu_uuid)
    if isinstance(seen, dict) and int(seen.get("seq", 0)) >= request.room_seq:
        return  # answered already (heartbeats repeat the request while it waits)
    now = time.time()
    sessions, freeing_mib = _sessions_on(store, request, reports)
    needed_mib = request.room_wanted_mib - freeing_mib
    requester = GpuSession(
        row.id, Access(row.access), row.priority, request.memory_mib or 0,
        request.last_op_at or now,
    )  # fmt: skip
    where = _where(store, request.gpu_uuid)
    if needed_mib <= 0:
        verdict = "waiting"  # sessions ordered out earlier will free enough
    else:
        victims = choose_victims(sessions, requester, needed_mib, now)
        verdict = "swapping" if victims else "denied"
        for victim in victims:
            _order_swap(store, session, victim, row.id, request.room_wanted_mib, where, now)
        if not victims:
            record(
                session, "controller", "lease.oversubscription.denied", row.id,
                f"{REASON}: needs {request.room_wanted_mib} MiB more on {where}; no idle or "
                "lower-priority session there can give way: the allocation fails",
            )  # fmt: skip
    rooms[request.gpu_uuid] = {"seq": request.room_seq, "verdict": verdict}
    row.elastic = {**(row.elastic or {}), "room": rooms}


def _sessions_on(
    store: Store, request: WorkerReport, reports: list[WorkerReport]
) -> tuple[list[GpuSession], int]:
    """The other sessions of the requester's GPU, and the memory that swaps ordered before
    (not done yet) will free."""
    sessions: list[GpuSession] = []
    freeing_mib = 0
    for other in reports:
        if other.gpu_uuid != request.gpu_uuid or other.lease_id == request.lease_id:
            continue
        row = store.lease_rows.get(other.lease_id)
        if row is None or not other.alive or not _current(row, other):
            continue
        held_mib = 0 if other.swapped else other.memory_mib or 0
        if swap_order(row) is not None and LeaseState(row.state) in ASKING:
            freeing_mib += held_mib
            continue
        last_active_s = other.last_op_at or 0.0
        sessions.append(
            GpuSession(
                row.id, Access(row.access), row.priority, held_mib, last_active_s, other.swapped
            )
        )
    return sessions, freeing_mib


def _current(row: LeaseRow, report: WorkerReport) -> bool:
    return report.generation == generation(row)


def _order_swap(
    store: Store,
    session: Session,
    victim: GpuSession,
    requester_id: str,
    wanted_mib: int,
    where: str,
    now: float,
) -> None:
    row = store.lease_rows[victim.lease_id]
    row.elastic = {
        **(row.elastic or {}),
        "swap": {"reason": REASON, "for": requester_id, "at": now},
    }
    how = "idle" if is_idle(victim, now) else f"priority {victim.priority}"
    record(
        session, "controller", "lease.swap_ordered", row.id,
        f"{REASON}: lease {requester_id} needs {wanted_mib} MiB more on {where}; this lease "
        f"({how}, {victim.held_mib} MiB held) is swapped out to host memory",
    )  # fmt: skip


def _where(store: Store, gpu_uuid: str) -> str:
    gpu = store.pool.gpus.get(gpu_uuid)
    return gpu_uuid if gpu is None else f"{gpu.node}/{gpu.index}"
