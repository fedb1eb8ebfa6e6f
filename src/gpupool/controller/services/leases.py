"""Leases: create (grant or queue), heartbeat, release, expire, and serving the queue."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpupool.controller.models import LeaseRow, LeaseSliceRow, utcnow
from gpupool.controller.services.events import record
from gpupool.controller.store import Store
from gpupool.controller.views import lease_out
from gpupool.core import (
    HOLDING,
    LIVE,
    Access,
    Conflict,
    Grant,
    InvalidRequest,
    LeaseRequest,
    LeaseState,
    ModeChange,
    NoCapacity,
    NotFound,
    QuotaExceeded,
    ReleaseReason,
    transition,
)
from gpupool.core.migrate import end_move
from gpupool.core.units import parse_cpu_milli, parse_memory_mib
from gpupool.protocol.v1.api import LeaseCreate, LeaseOut


def new_lease_id() -> str:
    return "l-" + uuid.uuid4().hex[:12]


def request_from(body: LeaseCreate) -> LeaseRequest:
    if body.physical and (body.compute_pct is not None or body.memory is not None):
        raise InvalidRequest("a physical lease takes whole GPUs: give no compute or memory")
    if body.access != "remote" and body.idle_timeout_s is not None:
        raise InvalidRequest(
            "only a remote lease can be swapped out when idle: idle_timeout_s needs access remote"
        )
    if body.access == "remote" and (body.cpu is not None or body.host_memory is not None):
        raise InvalidRequest(
            "a remote lease's program runs on its own server: cpu and host_memory are for "
            "direct leases"
        )
    return LeaseRequest(
        tenant=body.tenant,
        gpus=body.gpus,
        compute_pct=100 if body.compute_pct is None else body.compute_pct,
        memory_mib=body.memory_mib(),
        physical=body.physical,
        priority=body.priority,
        access=Access(body.access),
        node=body.node,
        gpu_models=tuple(m.strip() for m in body.gpu_models if m.strip()),
        span_nodes=body.span_nodes,
        prefer_node=body.prefer_node,
        max_wait_s=body.max_wait_s,
        cpu_milli=0 if body.cpu is None else parse_cpu_milli(body.cpu),
        host_memory_mib=0 if body.host_memory is None else parse_memory_mib(body.host_memory),
    )


def create(
    store: Store, session: Session, body: LeaseCreate, actor: str, privileged: bool = False
) -> LeaseOut:
    """Grant the request now if it fits behind everything already waiting, else queue it.

    Only a `privileged` caller (an admin token) may ask a priority above the tenant's cap.
    """
    pool = store.pool
    request = request_from(body)
    if body.request_id is not None:
        made = made_by(session, body.request_id, request.tenant)
        if made is not None:
            return lease_out(made, pool).model_copy(update={"token": made.worker_token})
    if request.tenant not in pool.quotas:
        raise InvalidRequest(f"no tenant {request.tenant!r}")
    if request.node is not None and request.node not in {g.node for g in pool.gpus.values()}:
        raise InvalidRequest(f"no node {request.node!r} with GPUs in this pool")
    pool.check_quota_ever(request, privileged=privileged)
    pool.check_can_ever_fit(request)
    limit = pool.quotas[request.tenant].max_leases
    if limit is not None:
        waiting = sum(1 for q in pool.queue.values() if q.request.tenant == request.tenant)
        if pool.held_by(request.tenant).leases + waiting + 1 > limit:
            raise QuotaExceeded(
                f"tenant {request.tenant}: leases would be "
                f"{pool.held_by(request.tenant).leases + waiting + 1}, quota is {limit}"
            )
    lease_id = new_lease_id()
    clock = time.time()
    entry = pool.enqueue(lease_id, request, now=clock)
    grants = pool.serve_queue(now=clock)
    mine = next((g for g in grants if g.lease_id == lease_id), None)
    now = utcnow()
    others = [g for g in grants if g.lease_id != lease_id]
    if mine is None and not body.wait:
        reason = pool.why_waiting(lease_id)
        pool.release(lease_id)
        persist_grants(store, session, others, now)
        raise NoCapacity(f"does not fit now ({reason}) and wait=false")
    ttl = body.ttl_s if body.ttl_s is not None else store.settings.lease_ttl_s
    row = LeaseRow(
        id=lease_id,
        tenant=request.tenant,
        state=LeaseState.QUEUED.value,
        gpus=request.gpus,
        compute_pct=None if request.physical else request.compute_pct,
        memory_mib=request.memory_mib,
        physical=request.physical,
        priority=request.priority,
        access=request.access.value,
        node=request.node,
        gpu_models=list(request.gpu_models),
        span_nodes=request.span_nodes,
        prefer_node=request.prefer_node,
        max_wait_s=request.max_wait_s,
        holder=body.holder or actor,
        ttl_s=ttl,
        queue_seq=entry.seq,
        created_at=now,
        last_heartbeat_at=now,
        # Remote: the data-plane token its client presents to its workers. Direct: what `gpupool
        # run` shows the agent to attach its processes to the lease's watch (agent/watch.py).
        worker_token=secrets.token_urlsafe(32),
        # Remote: what the lease's workers (peers, successors) show each other; never the client.
        peer_secret=secrets.token_urlsafe(32) if request.access is Access.REMOTE else None,
        cpu_milli=request.cpu_milli,
        host_memory_mib=request.host_memory_mib,
        request_id=body.request_id,
        idle_timeout_s=body.idle_timeout_s,
    )
    session.add(row)
    store.lease_rows[lease_id] = row
    store.live.lease_seen[lease_id] = time.time()
    record(
        session,
        actor,
        "lease.created",
        lease_id,
        f"{describe(request)} requested",
        tenant=request.tenant,
    )
    if mine is not None:
        _apply_grant(store, row, mine, now)
        record(
            session, "controller", "lease.granted", lease_id, f"granted on {_where(store, mine)}"
        )
    else:
        record(session, "controller", "lease.queued", lease_id, pool.why_waiting(lease_id))
    persist_grants(store, session, others, now)
    # The token goes to whoever asked for the lease, once; no later answer shows it.
    return lease_out(row, pool).model_copy(update={"token": row.worker_token})


def made_by(session: Session, request_id: str, tenant: str) -> LeaseRow | None:
    """The lease an earlier send of the same request made, if any.

    Clients resend a request when its answer was lost (a controller died after the commit,
    before the reply); the key makes the resend find that lease instead of making another.
    """
    row = session.scalar(select(LeaseRow).where(LeaseRow.request_id == request_id))
    if row is not None and row.tenant != tenant:
        raise Conflict(f"request_id {request_id!r} was already used by another request")
    return row


def describe(request: LeaseRequest) -> str:
    if request.physical:
        return f"{request.gpus} whole physical GPU(s)"
    memory = "proportional memory" if request.memory_mib is None else f"{request.memory_mib}MiB"
    return f"{request.gpus} slice(s) of {request.compute_pct}% and {memory}"


def _where(store: Store, grant: Grant) -> str:
    names = []
    for s in grant.slices:
        gpu = store.pool.gpus.get(s.gpu_uuid)
        names.append(f"{gpu.node}/{gpu.index}" if gpu else s.gpu_uuid)
    return ", ".join(names)


def _apply_grant(store: Store, row: LeaseRow, grant: Grant, now: datetime) -> None:
    row.state = transition(LeaseState(row.state), LeaseState.GRANTED).value
    row.granted_at = now
    row.queue_seq = None
    charge = store.pool.host_held.get(grant.lease_id, ())
    row.host_charge = [list(c) for c in charge] or None
    row.slices = [
        LeaseSliceRow(
            position=i,
            gpu_uuid=s.gpu_uuid,
            node=store.pool.gpus[s.gpu_uuid].node,
            gpu_index=store.pool.gpus[s.gpu_uuid].index,
            compute_pct=s.compute_pct,
            memory_mib=s.memory_mib,
            whole=s.whole,
        )
        for i, s in enumerate(grant.slices)
    ]


def persist_grants(store: Store, session: Session, grants: Iterable[Grant], now: datetime) -> None:
    """Write grants the pool made while serving the queue."""
    for grant in grants:
        row = store.lease_row(session, grant.lease_id)
        if row is None:  # pragma: no cover - the pool and the database always agree
            raise RuntimeError(f"pool granted unknown lease {grant.lease_id}")
        _apply_grant(store, row, grant, now)
        # The wait is over: the holder's clock starts again so a long queue is not an expiry.
        store.live.lease_seen[grant.lease_id] = time.time()
        record(
            session,
            "controller",
            "lease.granted",
            grant.lease_id,
            f"granted on {_where(store, grant)}",
        )
    withdraw_preemptions(store, session)


def withdraw_preemptions(store: Store, session: Session) -> list[str]:
    """Withdraw the preemptions whose cause no longer waits: it was released, expired, or
    granted (on room that freed up elsewhere) before its victims were gone.

    The victims keep their leases: back to active, no deadline, and the event log says so,
    so that a request made and withdrawn at once cannot end another tenant's lease. Called
    wherever the queue may have lost a request (every grant and every release pass here).
    """
    kept: list[str] = []
    for victim, cause in sorted(store.pool.withdraw_preemptions().items()):
        row = store.lease_row(session, victim)
        store.live.preempt_deadline.pop(victim, None)
        if row is None or LeaseState(row.state) is not LeaseState.PREEMPTED:
            continue
        row.state = transition(LeaseState.PREEMPTED, LeaseState.ACTIVE).value
        row.release_reason = None
        row.preempt_deadline_at = None
        row.preempted_by = None
        store.live.lease_seen[victim] = time.time()
        cause_row = store.lease_rows.get(cause)
        why = (
            "was granted before this lease was gone"
            if cause_row is not None and LeaseState(cause_row.state) in HOLDING
            else "was released or expired"
        )
        record(
            session,
            "controller",
            "lease.preemption_withdrawn",
            victim,
            f"preemption withdrawn: lease {cause}, which it was preempted for, {why}; "
            "this lease is kept",
            by=cause,
        )
        kept.append(victim)
    return kept


def persist_mode_changes(store: Store, session: Session, changes: Iterable[ModeChange]) -> None:
    for change in changes:
        row = store.gpu_row(session, change.gpu_uuid)
        if row is None:
            continue
        row.mode = change.new.value
        row.target_mode = change.target.value if change.target else None
        record(
            session,
            "controller",
            "gpu.mode",
            change.gpu_uuid,
            f"mode {change.old.value} -> {change.new.value}",
        )


def release(
    store: Store,
    session: Session,
    lease_id: str,
    actor: str,
    reason: ReleaseReason = ReleaseReason.HOLDER,
    detail: str | None = None,
    only_tenant: str | None = None,
) -> LeaseOut:
    """End a lease; `only_tenant` limits the caller to that tenant's leases."""
    row = store.lease_row(session, lease_id)
    if row is None or (only_tenant is not None and row.tenant != only_tenant):
        raise NotFound(f"no lease {lease_id!r}")
    if row.state == LeaseState.RELEASED.value:
        return lease_out(row)
    was = LeaseState(row.state)
    if was is LeaseState.QUEUED and reason is ReleaseReason.HOLDER:
        reason = ReleaseReason.CANCELLED
    row.state = transition(was, LeaseState.RELEASED).value
    now = utcnow()
    row.released_at = now
    if was is not LeaseState.PREEMPTED or not row.release_reason:
        # A preempted lease keeps saying why it ended, whoever releases it at last.
        why = reason.value if detail is None else f"{reason.value}: {detail}"
        row.release_reason = why[:256]
    row.queue_seq = None
    store.live.preempt_deadline.pop(lease_id, None)
    changes = store.pool.release(lease_id)
    changes += end_move(store.pool, lease_id)  # old slices of a lease that was moving
    store.live.lease_seen.pop(lease_id, None)
    store.live.dirty_leases.discard(lease_id)
    store.lease_rows.pop(lease_id, None)
    store.live.lease_activity.pop(lease_id, None)
    record(session, actor, "lease.released", lease_id, reason.value, was=was.value)
    persist_mode_changes(store, session, changes)
    persist_grants(store, session, store.pool.serve_queue(now=time.time()), now)
    return lease_out(row)


def heartbeat(
    store: Store,
    session: Session,
    lease_id: str,
    active: bool | None,
    only_tenant: str | None = None,
) -> LeaseOut:
    row = store.lease_row(session, lease_id)
    if row is None or (only_tenant is not None and row.tenant != only_tenant):
        raise NotFound(f"no lease {lease_id!r}")
    state = LeaseState(row.state)
    if state in LIVE:
        store.live.lease_seen[lease_id] = time.time()
        row.last_heartbeat_at = utcnow()
        if active is not None and state in HOLDING and state is not LeaseState.MIGRATING:
            target = LeaseState.ACTIVE if active else LeaseState.IDLE
            if target is not state:
                row.state = transition(state, target).value
    return lease_out(row, store.pool)


def expire(store: Store, session: Session) -> int:
    """Release every lease whose holder has been silent for longer than its ttl."""
    now = time.time()
    candidates = [lid for lid, seen in store.live.lease_seen.items() if now - seen > 1.0]
    if not candidates:
        return 0
    rows = [r for r in (store.lease_row(session, lid) for lid in candidates) if r is not None]
    count = 0
    for row in rows:
        seen = store.live.lease_seen.get(row.id)
        if seen is None or row.state == LeaseState.RELEASED.value:
            store.live.lease_seen.pop(row.id, None)
            continue
        if now - seen > row.ttl_s:
            release(store, session, row.id, "controller", ReleaseReason.EXPIRED)
            count += 1
    return count


def serve(store: Store, session: Session) -> int:
    grants = store.pool.serve_queue(now=time.time())
    persist_grants(store, session, grants, utcnow())
    return len(grants)


PREEMPTIBLE = frozenset({LeaseState.GRANTED, LeaseState.ACTIVE, LeaseState.IDLE})


def preempt(store: Store, session: Session) -> int:
    """Preempt lower-priority leases where that makes a blocked request fit.

    The holder sees state `preempted` (and why) in its next heartbeat reply and should
    stop; the lease is released when it does, or when the grace period ends.
    """
    pool = store.pool
    if not store.settings.preemption or not any(
        q.request.priority > 0 for q in pool.queue.values()
    ):
        return 0
    clock = time.time()
    count = 0
    for plan in pool.plan_preemptions(now=clock):
        rows = [store.lease_row(session, victim) for victim in plan.victims]
        if any(r is None or LeaseState(r.state) not in PREEMPTIBLE for r in rows):
            for victim in plan.victims:  # a victim moved on meanwhile: try again later
                pool.preempting.pop(victim, None)
            continue
        winner = pool.queue[plan.lease_id].request
        deadline = clock + store.settings.preempt_grace_s
        for row in rows:
            assert row is not None
            row.state = transition(LeaseState(row.state), LeaseState.PREEMPTED).value
            row.release_reason = (
                f"{ReleaseReason.PREEMPTED.value}: lease {plan.lease_id} "
                f"(priority {winner.priority} > {row.priority}) needs its GPUs; "
                f"stop within {store.settings.preempt_grace_s:g} s"
            )[:256]
            row.preempt_deadline_at = datetime.fromtimestamp(deadline, UTC)
            row.preempted_by = plan.lease_id
            store.live.preempt_deadline[row.id] = deadline
            record(
                session,
                "controller",
                "lease.preempted",
                row.id,
                f"preempted for {plan.lease_id} (priority {winner.priority}); "
                f"released in {store.settings.preempt_grace_s:g} s unless its holder stops first",
                by=plan.lease_id,
            )
            count += 1
    return count


def end_preempted(store: Store, session: Session, now: float | None = None) -> int:
    """Release preempted leases whose holders did not stop within the grace period (unless
    the request they were preempted for went away first: then they stay). `now` (default:
    the clock) lets a test look past the grace period without waiting for it."""
    withdraw_preemptions(store, session)
    clock = time.time() if now is None else now
    due = [lid for lid, at in store.live.preempt_deadline.items() if at <= clock]
    for lease_id in due:
        release(store, session, lease_id, "controller", ReleaseReason.PREEMPTED)
    return len(due)


def fail_overdue(store: Store, session: Session) -> int:
    """Fail queued requests that waited past the maximum wait, saying why they waited."""
    overdue = store.pool.overdue(time.time())
    for lease_id, why in overdue:
        release(store, session, lease_id, "controller", ReleaseReason.WAITED_TOO_LONG, why)
    return len(overdue)


def list_leases(
    store: Store,
    session: Session,
    state: str | None = None,
    tenant: str | None = None,
    gpu: str | None = None,
    node: str | None = None,
    limit: int = 1000,
) -> list[LeaseOut]:
    query = select(LeaseRow)
    if state is None:
        query = query.where(LeaseRow.state != LeaseState.RELEASED.value)
    elif state != "all":
        states = [s.strip() for s in state.split(",")]
        valid = {s.value for s in LeaseState}
        bad = [s for s in states if s not in valid]
        if bad:
            raise InvalidRequest(
                f"unknown lease state {bad[0]!r} (one of {', '.join(sorted(valid))}, all)"
            )
        query = query.where(LeaseRow.state.in_(states))
    if tenant:
        query = query.where(LeaseRow.tenant == tenant)
    if gpu or node:
        sub = select(LeaseSliceRow.lease_id)
        if gpu:
            sub = sub.where(LeaseSliceRow.gpu_uuid == gpu)
        if node:
            sub = sub.where(LeaseSliceRow.node == node)
        query = query.where(LeaseRow.id.in_(sub))
    query = query.order_by(LeaseRow.created_at.desc()).limit(limit)
    rows = list(session.scalars(query))
    with store.lock:
        return [lease_out(r, store.pool, store.live.lease_activity.get(r.id)) for r in rows]


def get(
    store: Store, session: Session, lease_id: str, only_tenant: str | None = None
) -> LeaseOut:
    row = session.get(LeaseRow, lease_id)
    if row is None or (only_tenant is not None and row.tenant != only_tenant):
        raise NotFound(f"no lease {lease_id!r}")
    with store.lock:
        return lease_out(row, store.pool, store.live.lease_activity.get(row.id))


def queue(store: Store, session: Session) -> list[tuple[int, LeaseOut]]:
    with store.lock:
        ordered = [q.lease_id for q in store.pool.ordered_queue()]
    if not ordered:
        return []
    rows = {r.id: r for r in session.scalars(select(LeaseRow).where(LeaseRow.id.in_(ordered)))}
    out = []
    with store.lock:
        for position, lease_id in enumerate(ordered, start=1):
            row = rows.get(lease_id)
            if row is not None and row.state == LeaseState.QUEUED.value:
                out.append((position, lease_out(row, store.pool)))
    return out
