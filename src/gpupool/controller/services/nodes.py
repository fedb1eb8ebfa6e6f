"""Nodes: registration with their GPU inventory, heartbeats, marking silent nodes down, drain."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpupool.controller.elastic_record import generation, handoff
from gpupool.controller.models import GpuRow, LeaseRow, NodeRow, utcnow
from gpupool.controller.services import elastic, oversubscription
from gpupool.controller.services import gpus as gpu_service
from gpupool.controller.services.events import record
from gpupool.controller.services.leases import persist_grants, release
from gpupool.controller.store import Store, gpu_of, host_of
from gpupool.controller.views import node_out
from gpupool.core import (
    HOLDING,
    Access,
    Conflict,
    GpuMode,
    LeaseState,
    NotFound,
    ReleaseReason,
    transition,
)
from gpupool.core.migrate import SHADOW
from gpupool.protocol.v1.api import (
    DirectEvents,
    DirectLease,
    DirectSlice,
    GpuDesired,
    NodeHeartbeat,
    NodeHeartbeatReply,
    NodeOut,
    NodeRegister,
    RemoteLease,
    WorkerReport,
)
from gpupool.protocol.v1.attach import token_sha256


def register(store: Store, session: Session, body: NodeRegister, actor: str) -> NodeOut:
    """Add or refresh a node; GPUs it no longer reports are removed or, if leased, isolated."""
    pool = store.pool
    now = utcnow()
    for gpu in body.gpus:
        other = pool.gpus.get(gpu.uuid)
        if other is not None and other.node != body.name:
            raise Conflict(f"GPU {gpu.uuid} is already registered by node {other.node}")
    row = store.node_row(session, body.name)
    fresh = row is None
    # An agent started again on a node that was down may have adopted workers of leases
    # that ended meanwhile: the node comes up with its first heartbeat, which reports them
    # (see heartbeat), not here.
    returning = row is not None and row.state != "up"
    if row is None:
        row = NodeRow(name=body.name, registered_at=now)
        session.add(row)
        store.node_rows[body.name] = row
    row.address = body.address
    row.agent_url = body.agent_url
    row.cpu_count = body.cpu_count
    row.memory_mib = body.memory_mib
    row.driver_version = body.driver_version
    row.cuda_version = body.cuda_version
    row.backend = body.backend
    row.state = "down" if returning else "up"
    row.last_seen_at = now
    reported = {g.uuid for g in body.gpus}
    for gpu in body.gpus:
        grow = store.gpu_row(session, gpu.uuid)
        if grow is None:
            grow = GpuRow(uuid=gpu.uuid, node=body.name, mode=GpuMode.VIRTUAL.value, healthy=True)
            session.add(grow)
            store.gpu_rows[gpu.uuid] = grow
        grow.index = gpu.index
        grow.model = gpu.model
        grow.memory_mib = gpu.memory_mib
        grow.simulated = gpu.simulated
        grow.pci_bus_id = gpu.pci_bus_id
        pool.upsert_gpu(gpu_of(grow))
    for grow in list(session.scalars(select(GpuRow).where(GpuRow.node == body.name))):
        if grow.uuid in reported:
            continue
        if pool.usage.get(grow.uuid) is not None and pool.usage[grow.uuid].leases:
            pool.isolate(grow.uuid)
            grow.mode = GpuMode.ISOLATED.value
            grow.target_mode = GpuMode.VIRTUAL.value
            grow.isolation_reason = "no longer reported by its agent"
            record(
                session,
                "controller",
                "gpu.isolated",
                grow.uuid,
                "isolated: no longer reported by its agent",
            )
        else:
            pool.remove_gpu(grow.uuid)
            store.gpu_rows.pop(grow.uuid, None)
            session.delete(grow)
            record(
                session, "controller", "gpu.removed", grow.uuid, "no longer reported by its agent"
            )
    pool.set_node_up(body.name, not returning)
    pool.set_host(body.name, host_of(row))
    store.live.node_seen[body.name] = time.time()
    simulated = " (simulated)" if any(g.simulated for g in body.gpus) else ""
    record(
        session,
        actor,
        "node.registered" if fresh else "node.reregistered",
        body.name,
        f"{len(body.gpus)} GPU(s){simulated}, backend {body.backend}",
    )
    persist_grants(store, session, pool.serve_queue(), now)
    return node_out(row, len(body.gpus))


def heartbeat(store: Store, session: Session, name: str, body: NodeHeartbeat) -> NodeHeartbeatReply:
    """Note a node's heartbeat and answer with what the controller wants of its GPUs."""
    row = store.node_row(session, name)
    if row is None:
        raise NotFound(f"no node {name!r}: register it first")
    store.live.node_seen[name] = time.time()
    own = own_gpus(store, name)
    for t in body.telemetry:
        if t.uuid in own:
            store.live.telemetry[t.uuid] = t.model_dump(exclude_none=True, exclude={"uuid"})
    store.live.host[name] = body.host
    store.live.dirty_nodes.add(name)
    workers = own_workers(store, own, body.workers)
    note_workers(store, workers, session)
    oversubscription.note_room_requests(store, session, workers)
    end_leases_of_dead_workers(store, session, workers)
    # A node back from an outage may still run workers of leases that ended meanwhile (the
    # node-lost policy released them): it stays out of placement until its agent, told by
    # this reply, has stopped them, so no new lease shares a GPU with a stale worker.
    resumed = row.state != "up" and not stale_workers(store, workers)
    if resumed:
        row.state = "up"
        row.last_seen_at = utcnow()
        store.pool.set_node_up(name, True)
        record(session, "controller", "node.up", name, "heartbeats resumed")
        persist_grants(store, session, store.pool.serve_queue(), utcnow())
    return NodeHeartbeatReply(
        resumed=resumed,
        gpus=desired(store, name),
        leases=remote_leases(store, name),
        direct=direct_leases(store, name),
    )


def own_gpus(store: Store, node: str) -> set[str]:
    """The GPUs registered by `node` (a GPU uuid belongs to one node: see register)."""
    return set(store.pool.node_gpus.get(node, {}))


def own_workers(store: Store, gpus: set[str], reports: list[WorkerReport]) -> list[WorkerReport]:
    """The worker reports a node may make: for its own GPUs, and for leases with a slice
    (current, or the old place of a move) on that GPU, or for leases no longer held.

    Everything else is dropped unread: one node's agent must not set where another node's
    worker listens (a client would send its lease token there), end another node's lease
    by calling its worker dead, or ask room for it.
    """
    out = []
    for report in reports:
        if report.gpu_uuid not in gpus:
            continue
        row = store.lease_rows.get(report.lease_id)
        if row is not None and report.gpu_uuid not in lease_gpus(row):
            continue
        out.append(report)
    return out


def lease_gpus(row: LeaseRow) -> set[str]:
    """Every GPU a lease's workers may run on now: its slices and, while it moves, the old."""
    held = {s.gpu_uuid for s in row.slices}
    moving = handoff(row)
    if moving is not None:
        held |= {str(p.get("gpu_uuid")) for p in moving.get("from", [])}
    return held


IDLE_AFTER_S = 30.0
"""A remote lease whose workers ran no op for this long shows as idle."""


def note_workers(store: Store, reports: list[WorkerReport], session: Session | None = None) -> None:
    """Record where each remote slice's worker listens and what it is doing."""
    now = time.time()
    by_lease: dict[str, list[WorkerReport]] = {}
    for report in reports:
        by_lease.setdefault(report.lease_id, []).append(report)
    for lease_id, workers in by_lease.items():
        row = store.lease_rows.get(lease_id)
        if row is None:
            continue
        moving = handoff(row)
        gen = int(moving["to_gen"]) if moving is not None else generation(row)
        endpoints = {w.gpu_uuid: w.endpoint for w in workers if w.alive and w.generation == gen}
        for piece in row.slices:
            if piece.gpu_uuid in endpoints and piece.endpoint != endpoints[piece.gpu_uuid]:
                piece.endpoint = endpoints[piece.gpu_uuid]
        last_ops = [w.last_op_at for w in workers if w.last_op_at is not None]
        activity: dict[str, Any] = {
            "workers": len(workers),
            "memory_mib": sum(w.memory_mib or 0 for w in workers),
            "last_op_at": max(last_ops) if last_ops else None,
            "errors": [w.error for w in workers if w.error],
        }
        store.live.lease_activity[lease_id] = activity
        if session is not None:
            elastic.note_reports(store, session, row, workers)
        state = LeaseState(row.state)
        if state in (LeaseState.GRANTED, LeaseState.ACTIVE, LeaseState.IDLE) and last_ops:
            busy = now - max(last_ops) < IDLE_AFTER_S
            row.state = transition(state, LeaseState.ACTIVE if busy else LeaseState.IDLE).value


def stale_workers(store: Store, reports: list[WorkerReport]) -> list[WorkerReport]:
    """Workers still running for leases that are no longer held."""
    return [
        r
        for r in reports
        if r.alive
        and (
            (row := store.lease_rows.get(r.lease_id)) is None
            or LeaseState(row.state) not in HOLDING
        )
    ]


def end_leases_of_dead_workers(
    store: Store, session: Session, reports: list[WorkerReport]
) -> list[str]:
    """Release the remote leases whose worker died, saying how, so the slice goes back to the
    pool and the holder learns why at its next heartbeat.

    A worker holds its client's tensors: one started afresh would serve an empty handle
    table, so the agent never restarts it and the lease cannot go on.
    """
    ended = []
    for report in reports:
        row = store.lease_rows.get(report.lease_id)
        if report.alive or row is None or row.state == LeaseState.RELEASED.value:
            continue
        moving = handoff(row)
        serving = int(moving["to_gen"]) if moving is not None else generation(row)
        if report.generation < serving:
            continue  # a worker that handed its client over (migration, restore) and left
        detail = f"worker on {report.gpu_uuid}: {report.error or 'exited'}"
        release(store, session, report.lease_id, "controller", ReleaseReason.WORKER_LOST, detail)
        ended.append(report.lease_id)
    return ended


def remote_leases(store: Store, node: str) -> dict[str, RemoteLease]:
    """The remote leases with slices on `node`, for its agent to run their workers."""
    out: dict[str, RemoteLease] = {}
    for lease_id, row in store.lease_rows.items():
        wanted = elastic.remote_lease_for(store, row, node)
        if wanted is not None:
            out[lease_id] = wanted
    return out


DIRECT_WATCHED = HOLDING | {LeaseState.PREEMPTED}
"""A preempted lease's program may still run on its slice until the lease is released."""


def direct_leases(store: Store, node: str) -> dict[str, DirectLease]:
    """The direct leases with slices on `node`, for its agent's watch of their processes:
    the limits of each slice and the hash of the lease's token (never the token)."""
    out: dict[str, DirectLease] = {}
    for lease_id, row in store.lease_rows.items():
        if row.access != Access.DIRECT.value or LeaseState(row.state) not in DIRECT_WATCHED:
            continue
        pieces = [
            DirectSlice(
                gpu_uuid=s.gpu_uuid,
                compute_pct=s.compute_pct,
                memory_mib=s.memory_mib,
                whole=bool(s.whole or row.physical),
            )
            for s in row.slices
            if s.node == node
        ]
        if pieces:
            digest = token_sha256(row.worker_token) if row.worker_token else None
            out[lease_id] = DirectLease(token_sha256=digest, slices=pieces)
    return out


def record_direct_events(
    store: Store, session: Session, name: str, body: DirectEvents, actor: str
) -> int:
    """Put what a node's watch of direct slices did into the event log. Only events about
    that node's GPUs, and leases that exist, are taken: an agent speaks for its node only."""
    if store.node_row(session, name) is None:
        raise NotFound(f"no node {name!r}: register it first")
    tenants: dict[str, str] = {}
    for event in body.events:
        gpu = store.pool.gpus.get(event.gpu_uuid)
        if gpu is None or gpu.node != name:
            raise NotFound(f"no GPU {event.gpu_uuid} on node {name}")
        if event.lease_id is not None:
            # Released leases leave the store's memory but not the database: a process
            # stopped as its lease ended is still told about that lease.
            lease = store.lease_rows.get(event.lease_id) or session.get(LeaseRow, event.lease_id)
            if lease is None:
                raise NotFound(f"no lease {event.lease_id}")
            tenants[event.lease_id] = lease.tenant
    for event in body.events:
        data = event.model_dump(exclude_none=True, exclude={"kind", "message"})
        tenant = tenants.get(event.lease_id) if event.lease_id is not None else None
        record(
            session,
            actor,
            f"direct.{event.kind}",
            event.lease_id or event.gpu_uuid,
            f"{name}: {event.message}",
            node=name,
            **data,
            **({"tenant": tenant} if tenant else {}),
        )
    return len(body.events)


def desired(store: Store, node: str) -> dict[str, GpuDesired]:
    out = {}
    for gpu in store.pool.gpus.values():
        if gpu.node == node:
            out[gpu.uuid] = GpuDesired(
                mode=gpu.mode.value,
                target_mode=gpu.target_mode.value if gpu.target_mode else None,
                leases=sorted(store.pool.usage[gpu.uuid].leases),
            )
    return out


def mark_silent_down(store: Store, session: Session) -> list[str]:
    now = time.time()
    down = []
    for row in [r for r in store.node_rows.values() if r.state == "up"]:
        seen = store.live.node_seen.get(row.name, store.started_at)
        if now - seen > store.settings.node_timeout_s:
            row.state = "down"
            store.pool.set_node_up(row.name, False)
            record(
                session,
                "controller",
                "node.down",
                row.name,
                f"no heartbeat for {now - seen:.0f}s "
                f"(timeout {store.settings.node_timeout_s:.0f}s)",
            )
            down.append(row.name)
    return down


def release_lost(store: Store, session: Session) -> list[str]:
    """With `--node-lost-policy release`: end every lease on a node that has been down for
    longer than the grace time, so its GPUs' share of the pool is not held by a dead host.

    The node itself gets nothing new while down, and when it comes back its agent is told
    only the leases still held, so it stops the workers of those released here.
    """
    settings = store.settings
    if settings.node_lost_policy != "release":
        return []
    now = time.time()
    limit_s = settings.node_timeout_s + settings.node_lost_grace_s
    ended: list[str] = []
    for row in [r for r in store.node_rows.values() if r.state == "down"]:
        silent_s = now - store.live.node_seen.get(row.name, store.started_at)
        if silent_s <= limit_s:
            continue
        uuids = [g.uuid for g in store.pool.gpus.values() if g.node == row.name]
        for lease_id in sorted(store.pool.leases_on(uuids)):
            detail = (
                f"node {row.name} silent for {silent_s:.0f}s "
                f"(node-lost-policy release, grace {settings.node_lost_grace_s:g}s)"
            )
            release(store, session, lease_id, "controller", ReleaseReason.NODE_LOST, detail)
            ended.append(lease_id)
    return ended


def flush_liveness(store: Store, session: Session) -> None:
    """Write the latest node heartbeats and telemetry in one batch."""
    for name in list(store.live.dirty_nodes):
        row = store.node_row(session, name)
        if row is None:
            continue
        seen = store.live.node_seen.get(name)
        if seen is not None:
            row.last_seen_at = utcnow().fromtimestamp(seen, tz=utcnow().tzinfo)
        row.host = store.live.host.get(name, {})
        for grow in [g for g in store.gpu_rows.values() if g.node == name]:
            if grow.uuid in store.live.telemetry:
                grow.telemetry = store.live.telemetry[grow.uuid]
    store.live.dirty_nodes.clear()


def remove(store: Store, session: Session, name: str, actor: str) -> None:
    row = store.node_row(session, name)
    if row is None:
        raise NotFound(f"no node {name!r}")
    uuids = [g.uuid for g in session.scalars(select(GpuRow).where(GpuRow.node == name))]
    held = store.pool.leases_on(uuids)
    if held:
        raise Conflict(f"node {name} still holds {len(held)} lease(s): release or drain them first")
    for uuid in uuids:
        store.pool.remove_gpu(uuid)
        store.gpu_rows.pop(uuid, None)
    store.pool.set_node_up(name, False)
    store.node_rows.pop(name, None)
    session.delete(row)
    record(session, actor, "node.removed", name, f"removed with {len(uuids)} GPU(s)")


def list_nodes(store: Store, session: Session) -> list[NodeOut]:
    counts = {
        node: count
        for node, count in session.execute(select(GpuRow.node, func.count()).group_by(GpuRow.node))
    }
    rows = list(session.scalars(select(NodeRow).order_by(NodeRow.name)))
    return [node_out(r, counts.get(r.name, 0), store.live.host.get(r.name)) for r in rows]


def get(store: Store, session: Session, name: str) -> NodeOut:
    row = session.get(NodeRow, name)
    if row is None:
        raise NotFound(f"no node {name!r}")
    count = session.scalar(select(func.count()).select_from(GpuRow).where(GpuRow.node == name)) or 0
    return node_out(row, count, store.live.host.get(name))


def drain(store: Store, session: Session, name: str, actor: str) -> list[str]:
    """No new leases on the node's GPUs; its remote leases move away now; direct leases end
    on their own (the GPUs switch when empty). Returns the leases that started moving."""
    uuids = [u for u, g in store.pool.gpus.items() if g.node == name]
    if name not in store.node_rows and not uuids:
        raise NotFound(f"no node {name!r}")
    moved: list[str] = []
    for lease_id in sorted(store.pool.leases_on(uuids)):
        row = store.lease_rows.get(lease_id)
        if row is None or row.access != Access.REMOTE.value or SHADOW in lease_id:
            continue
        if LeaseState(row.state) not in elastic.MOVABLE or handoff(row) is not None:
            continue
        elastic.migrate(store, session, lease_id, actor, avoid_nodes=(name,), reason="drain")
        moved.append(lease_id)
    for uuid in uuids:
        if store.pool.gpus[uuid].mode.value != "draining":
            gpu_service.drain(store, session, uuid, actor)
    record(session, actor, "node.drain", name, f"draining: {len(moved)} remote lease(s) moving")
    return moved


def undrain(store: Store, session: Session, name: str, actor: str) -> None:
    """The node's GPUs take leases again (the mode they were draining to, or virtual)."""
    uuids = [u for u, g in store.pool.gpus.items() if g.node == name]
    if name not in store.node_rows and not uuids:
        raise NotFound(f"no node {name!r}")
    for uuid in uuids:
        gpu = store.pool.gpus[uuid]
        if gpu.mode.value == "draining":
            gpu_service.set_mode(
                store,
                session,
                uuid,
                (gpu.target_mode or gpu.mode).value if gpu.target_mode else "virtual",
                actor,
            )
    record(session, actor, "node.undrain", name, "takes leases again")
