"""What the dashboard's pages show: the overview, the servers, one GPU with its slice holders,
the history and the alerts, all read from memory (no database query)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import UTC, datetime

from gpupool import __version__
from gpupool.controller.services import snapshot as snapshots
from gpupool.controller.services.alerts import Alert
from gpupool.controller.services.snapshot import GpuReading, PoolSnapshot
from gpupool.controller.services.watch import PoolWatch
from gpupool.controller.store import Store
from gpupool.core import GpuMode, InvalidRequest, NotFound
from gpupool.protocol.v1.dashboard import (
    AlertOut,
    AlertRuleOut,
    AlertsOut,
    GpuDetailOut,
    GpuTile,
    HistoryOut,
    OverviewOut,
    ServerOut,
    SliceHolder,
    TenantUsage,
    WebhookOut,
)

MAX_HISTORY_RANGE_S = 7 * 24 * 3600
MAX_HISTORY_KEYS = 64


def _time(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, UTC)


def tile(g: GpuReading) -> GpuTile:
    return GpuTile(
        uuid=g.uuid,
        node=g.node,
        index=g.index,
        model=g.model,
        memory_mib=g.memory_mib,
        mode=g.mode,
        target_mode=g.target_mode,
        healthy=g.healthy,
        simulated=g.simulated,
        compute_granted_pct=g.compute_granted_pct,
        memory_granted_mib=g.memory_granted_mib,
        leases=g.leases,
        utilization_pct=g.utilization_pct,
        memory_used_mib=g.memory_used_mib,
        temperature_c=g.temperature_c,
        power_w=g.power_w,
    )


def alert_out(a: Alert) -> AlertOut:
    return AlertOut(
        name=a.rule.name,
        severity=a.rule.severity,
        state=a.state,
        labels=dict(a.labels),
        summary=a.summary,
        value=a.value,
        active_since=datetime.fromtimestamp(a.active_since, UTC),
        fired_at=_time(a.fired_at),
        resolved_at=_time(a.resolved_at),
    )


def overview(store: Store, watch: PoolWatch, snap: PoolSnapshot | None = None) -> OverviewOut:
    snap = snap or snapshots.take(store)
    return OverviewOut(
        at=datetime.fromtimestamp(snap.at, UTC),
        version=__version__,
        simulated=any(g.simulated for g in snap.gpus),
        nodes_up=sum(1 for n in snap.nodes if n.up),
        nodes_down=sum(1 for n in snap.nodes if not n.up),
        gpus_total=len(snap.gpus),
        gpus_by_mode=snap.gpus_by_mode,
        gpus_unhealthy=sum(1 for g in snap.gpus if not g.healthy),
        leases_by_state=snap.leases_by_state,
        leases_holding=snap.holding,
        queue_length=snap.queue_length,
        queue_oldest_wait_s=round(snap.queue_oldest_wait_s, 1),
        compute_capacity_pct=snap.compute_capacity_pct,
        compute_granted_pct=snap.compute_granted_pct,
        compute_used_pct=snap.compute_used_pct,
        memory_capacity_mib=snap.memory_capacity_mib,
        memory_granted_mib=snap.memory_granted_mib,
        memory_used_mib=snap.memory_used_mib,
        utilization_pct=snap.utilization_pct,
        fragmentation=snap.fragmentation,
        ratios=snap.ratios,
        alerts=[alert_out(a) for a in watch.alerts.firing()],
        alerts_pending=len(watch.alerts.pending()),
        tenants=[
            TenantUsage(
                name=t.name,
                compute_granted_pct=t.compute_granted_pct,
                memory_granted_mib=t.memory_granted_mib,
                gpus=t.gpus,
                leases=t.leases,
                queued=t.queued,
            )
            for t in snap.tenants
        ],
        gpus=[tile(g) for g in snap.gpus],
    )


def _num(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _whole(value: object) -> int | None:
    number = _num(value)
    return None if number is None else int(number)


def servers(store: Store, watch: PoolWatch) -> list[ServerOut]:
    snap = snapshots.take(store)
    by_node: dict[str, list[GpuTile]] = {}
    for g in snap.gpus:
        by_node.setdefault(g.node, []).append(tile(g))
    out = []
    for n in snap.nodes:
        sent, recv = watch.net.of(n.name)
        host = n.host
        out.append(
            ServerOut(
                name=n.name,
                up=n.up,
                backend=n.backend,
                cpu_count=n.cpu_count,
                last_seen_s=None if n.last_seen_s is None else round(n.last_seen_s, 1),
                cpu_pct=_num(host.get("cpu_pct")),
                load1=_num(host.get("load1")),
                memory_used_mib=_whole(host.get("memory_used_mib")),
                memory_total_mib=_whole(host.get("memory_total_mib")),
                disk_used_mib=_whole(host.get("disk_used_mib")),
                disk_total_mib=_whole(host.get("disk_total_mib")),
                net_recv_bytes_per_s=None if not n.up else recv,
                net_sent_bytes_per_s=None if not n.up else sent,
                gpus=by_node.get(n.name, []),
            )
        )
    return out


def gpu_detail(store: Store, uuid: str) -> GpuDetailOut:
    snap = snapshots.take(store)
    reading = next((g for g in snap.gpus if g.uuid == uuid), None)
    if reading is None:
        raise NotFound(f"no GPU {uuid!r}")
    with store.lock:
        pool = store.pool
        gpu = pool.gpus[uuid]
        row = store.gpu_rows.get(uuid)
        usage = pool.usage.get(uuid)
        holders = []
        for lease_id in sorted(usage.leases if usage else ()):
            lease = store.lease_rows.get(lease_id)
            mine = pool.holdings.get(lease_id, ())
            for s in mine:
                if s.gpu_uuid != uuid:
                    continue
                holders.append(
                    SliceHolder(
                        lease_id=lease_id,
                        tenant=lease.tenant if lease else pool.owners.get(lease_id, "?"),
                        holder=lease.holder if lease else "",
                        state=lease.state if lease else "granted",
                        priority=lease.priority if lease else 0,
                        access=lease.access if lease else "direct",
                        compute_pct=s.compute_pct,
                        memory_mib=s.memory_mib,
                        whole=s.whole,
                        granted_at=lease.granted_at if lease else None,
                    )
                )
        physical = gpu.mode is GpuMode.PHYSICAL or (usage is not None and usage.whole)
        compute_cap = 100 if physical else int(100 * pool.ratios.compute)
        memory_cap = gpu.memory_mib if physical else int(gpu.memory_mib * pool.ratios.memory)
        telemetry = dict(store.live.telemetry.get(uuid) or (row.telemetry if row else {}) or {})
    holders.sort(key=lambda h: (-h.compute_pct, h.lease_id))
    return GpuDetailOut(
        gpu=tile(reading),
        pci_bus_id=row.pci_bus_id if row else None,
        isolation_reason=reading.isolation_reason,
        telemetry=telemetry,
        compute_capacity_pct=compute_cap,
        memory_capacity_mib=memory_cap,
        holders=holders,
    )


def history(
    watch: PoolWatch, keys: Iterable[str], range_s: float, points: int, now: float | None = None
) -> HistoryOut:
    wanted = [k.strip() for k in keys if k.strip()]
    if not wanted:
        raise InvalidRequest("give at least one series in keys (e.g. pool.utilization_pct)")
    if len(wanted) > MAX_HISTORY_KEYS:
        raise InvalidRequest(f"at most {MAX_HISTORY_KEYS} series at once, got {len(wanted)}")
    if not 0 < range_s <= MAX_HISTORY_RANGE_S:
        raise InvalidRequest(f"range_s must be 1..{MAX_HISTORY_RANGE_S}, got {range_s:g}")
    data = watch.history.query(wanted, range_s, time.time() if now is None else now, points)
    return HistoryOut(step_s=int(data["step_s"]), t=data["t"], series=data["series"])


def alerts(watch: PoolWatch) -> AlertsOut:
    book = watch.alerts
    firing, pending = book.firing(), book.pending()
    status = watch.webhook.status
    return AlertsOut(
        evaluated_at=_time(book.evaluated_at),
        firing=[alert_out(a) for a in firing],
        pending=[alert_out(a) for a in pending],
        resolved=[alert_out(a) for a in book.resolved],
        rules=[
            AlertRuleOut(
                name=r.name,
                severity=r.severity,
                for_s=r.for_s,
                expr=r.expr,
                summary=r.summary,
                description=r.description,
                firing=sum(1 for a in firing if a.rule.name == r.name),
                pending=sum(1 for a in pending if a.rule.name == r.name),
            )
            for r in book.rules
        ],
        webhook=WebhookOut(
            configured=status.url is not None,
            sent=status.sent,
            failed=status.failed,
            last_error=status.last_error,
            last_sent_at=_time(status.last_sent_at),
        ),
    )
