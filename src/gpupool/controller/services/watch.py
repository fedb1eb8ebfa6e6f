"""Watching the pool: one tick measures it, keeps the sample in the history and judges the
alert rules; what the controller learns this way lives in one `PoolWatch`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpupool.controller.services import history as histories
from gpupool.controller.services import metrics
from gpupool.controller.services import snapshot as snapshots
from gpupool.controller.services.alerts import Alerts, Notice, Webhook
from gpupool.controller.services.history import History
from gpupool.controller.services.snapshot import PoolSnapshot
from gpupool.controller.settings import ControllerSettings
from gpupool.controller.store import Store
from gpupool.core import LeaseState

HISTORY_FILE = "history.json"


@dataclass(slots=True)
class NetRate:
    seen_at: float
    sent: float
    recv: float
    sent_per_s: float | None = None
    recv_per_s: float | None = None


@dataclass(slots=True)
class NetRates:
    """Bytes per second of each server, from the counters of successive heartbeats."""

    nodes: dict[str, NetRate] = field(default_factory=dict)

    def update(self, node: str, seen_at: float, sent: float, recv: float) -> None:
        last = self.nodes.get(node)
        if last is None or sent < last.sent or recv < last.recv:
            self.nodes[node] = NetRate(seen_at, sent, recv)
            return
        dt = seen_at - last.seen_at
        if dt < 0.2:  # the same heartbeat seen twice
            return
        self.nodes[node] = NetRate(
            seen_at, sent, recv, (sent - last.sent) / dt, (recv - last.recv) / dt
        )

    def of(self, node: str) -> tuple[float | None, float | None]:
        rate = self.nodes.get(node)
        return (None, None) if rate is None else (rate.sent_per_s, rate.recv_per_s)


@dataclass(slots=True)
class PoolWatch:
    """What the controller keeps by watching the pool: history, alerts, network rates."""

    history: History
    alerts: Alerts
    webhook: Webhook
    net: NetRates
    registry: CollectorRegistry
    history_file: Path | None


def open_watch(store: Store, settings: ControllerSettings) -> PoolWatch:
    alerts = Alerts()
    history = History()
    path = settings.data_dir / HISTORY_FILE
    histories.load(history, path)
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return PoolWatch(
        history=history,
        alerts=alerts,
        webhook=Webhook(settings.webhook_url, f"http://{host}:{settings.port}"),
        net=NetRates(),
        registry=metrics.registry_for(store, alerts.firing_counts),
        history_file=path,
    )


def sample(snap: PoolSnapshot, net: NetRates) -> dict[str, float]:
    """One point of every series the dashboard charts."""
    nan = float("nan")
    util = snap.utilization_pct
    values: dict[str, float] = {
        "pool.utilization_pct": nan if util is None else util,
        "pool.compute_capacity_pct": snap.compute_capacity_pct,
        "pool.compute_granted_pct": snap.compute_granted_pct,
        "pool.compute_used_pct": snap.compute_used_pct,
        "pool.memory_capacity_mib": snap.memory_capacity_mib,
        "pool.memory_granted_mib": snap.memory_granted_mib,
        "pool.memory_used_mib": snap.memory_used_mib,
        "pool.queue_length": snap.queue_length,
        "pool.queue_wait_s": snap.queue_oldest_wait_s,
        "pool.leases_holding": snap.holding,
        "pool.nodes_up": sum(1 for n in snap.nodes if n.up),
        "pool.fragmentation": snap.fragmentation,
    }
    for g in snap.gpus:
        if g.utilization_pct is not None:
            values[f"gpu.{g.uuid}.utilization_pct"] = g.utilization_pct
        if g.memory_used_mib is not None:
            values[f"gpu.{g.uuid}.memory_used_mib"] = g.memory_used_mib
        values[f"gpu.{g.uuid}.compute_granted_pct"] = g.compute_granted_pct
        values[f"gpu.{g.uuid}.memory_granted_mib"] = g.memory_granted_mib
    for n in snap.nodes:
        host = n.host
        sent, recv = host.get("net_sent_bytes"), host.get("net_recv_bytes")
        if (
            n.last_seen_s is not None
            and isinstance(sent, int | float)
            and isinstance(recv, int | float)
        ):
            net.update(n.name, snap.at - n.last_seen_s, float(sent), float(recv))
        for key in ("cpu_pct", "memory_used_mib", "load1"):
            value = host.get(key)
            if isinstance(value, int | float) and n.up:
                values[f"node.{n.name}.{key}"] = float(value)
        sent_rate, recv_rate = net.of(n.name)
        if n.up and sent_rate is not None and recv_rate is not None:
            values[f"node.{n.name}.net_sent_bytes_per_s"] = sent_rate
            values[f"node.{n.name}.net_recv_bytes_per_s"] = recv_rate
    return values


def tick(store: Store, watch: PoolWatch, now: float) -> list[Notice]:
    """Measure, keep and judge the pool once; runs off the event loop (it takes the lock)."""
    snap = snapshots.take(store, now)
    watch.history.add(now, sample(snap, watch.net))
    preempted = metrics.TRANSITIONS.count(LeaseState.PREEMPTED.value)
    return watch.alerts.evaluate(snap, preempted, now)
