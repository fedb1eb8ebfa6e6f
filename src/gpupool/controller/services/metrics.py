"""The controller's Prometheus metrics: the pool as `gpupool_*` series, lease transitions,
queue waits and scheduling latency."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import event

from gpupool import __version__
from gpupool.controller.models import LeaseRow
from gpupool.controller.services import snapshot as snapshots
from gpupool.controller.services.snapshot import MIB, PoolSnapshot
from gpupool.controller.store import Store
from gpupool.core import GpuMode, LeaseState
from gpupool.protocol.v1 import API_PREFIX

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

WAIT_BUCKETS_S = (0.01, 0.1, 0.5, 1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600)
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

LEASE_WAIT = Histogram(
    "gpupool_lease_wait_seconds",
    "Time from a lease request to its grant: the queue wait, 0 for a request granted at once.",
    buckets=WAIT_BUCKETS_S,
    registry=None,
)
SCHEDULING_LATENCY = Histogram(
    "gpupool_scheduling_latency_seconds",
    "Time the controller takes to answer a lease request with a grant or a place in the queue.",
    buckets=LATENCY_BUCKETS_S,
    registry=None,
)


class LeaseTransitions:
    """How many times leases entered each state, counted as the lease rows change.

    The rows are watched (a SQLAlchemy attribute event) rather than the lease service
    being asked to report, so every path that changes a lease is counted, present and future.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {s.value: 0 for s in LeaseState}
        self.changed_at: dict[str, float] = {}

    def entered(self, state: str) -> None:
        with self._lock:
            self.counts[state] = self.counts.get(state, 0) + 1
            self.changed_at[state] = time.time()

    def count(self, state: str) -> int:
        with self._lock:
            return self.counts.get(state, 0)


TRANSITIONS = LeaseTransitions()


@event.listens_for(LeaseRow.state, "set")
def _lease_state_set(target: LeaseRow, value: object, old: object, _initiator: object) -> None:
    if isinstance(value, str) and value != old:
        TRANSITIONS.entered(value)


@event.listens_for(LeaseRow.granted_at, "set")
def _lease_granted(target: LeaseRow, value: object, old: object, _initiator: object) -> None:
    created = target.created_at
    if isinstance(value, datetime) and isinstance(created, datetime) and value != old:
        LEASE_WAIT.observe(max(0.0, (value - created).total_seconds()))


# ---- scheduling latency, at the HTTP boundary ----------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

LEASE_REQUESTS_PATH = f"{API_PREFIX}/leases"


class SchedulingTimer:
    """ASGI middleware timing lease requests from arrival to answer; passes all else through."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"].rstrip("/") != LEASE_REQUESTS_PATH
        ):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def send_timed(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if status < 300:
                    SCHEDULING_LATENCY.observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, send_timed)


# ---- exposition ----------------------------------------------------------------------------


class PoolCollector(Collector):
    """Turns a fresh snapshot of the pool into metric families at each scrape."""

    def __init__(self, store: Store, firing: Callable[[], dict[tuple[str, str], int]]) -> None:
        self.store = store
        self.firing = firing

    def collect(self) -> Iterator[Metric]:
        snap = snapshots.take(self.store)
        yield from pool_families(snap)
        yield from node_families(snap)
        yield from gpu_families(snap)
        yield from tenant_families(snap)
        transitions = CounterMetricFamily(
            "gpupool_lease_transitions",
            "Times leases entered each state (preempted, released, ...).",
            labels=["to"],
        )
        for state in LeaseState:
            transitions.add_metric([state.value], TRANSITIONS.count(state.value))
        yield transitions
        alerts = GaugeMetricFamily(
            "gpupool_alerts_firing",
            "Alerts firing in the controller's own evaluation of the shipped rules.",
            labels=["alertname", "severity"],
        )
        for (name, severity), count in sorted(self.firing().items()):
            alerts.add_metric([name, severity], count)
        yield alerts
        yield _gauge(
            "gpupool_leader",
            "1 on the controller that runs the scheduler (always, without high availability); "
            "0 on a standby, which serves reads and forwards writes.",
            1.0 if self.store.leading else 0.0,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def pool_families(snap: PoolSnapshot) -> Iterator[Metric]:
    info = GaugeMetricFamily("gpupool_build_info", "gpupool version.", labels=["version"])
    info.add_metric([__version__], 1)
    yield info
    nodes = GaugeMetricFamily("gpupool_nodes", "Nodes by state.", labels=["state"])
    up = sum(1 for n in snap.nodes if n.up)
    nodes.add_metric(["up"], up)
    nodes.add_metric(["down"], len(snap.nodes) - up)
    yield nodes
    gpus = GaugeMetricFamily("gpupool_gpus", "GPUs by mode.", labels=["mode"])
    for mode, count in snap.gpus_by_mode.items():
        gpus.add_metric([mode], count)
    yield gpus
    yield _gauge(
        "gpupool_gpus_unhealthy",
        "GPUs marked unhealthy after a hardware fault.",
        sum(1 for g in snap.gpus if not g.healthy),
    )
    leases = GaugeMetricFamily("gpupool_leases", "Live leases by state.", labels=["state"])
    for state in LeaseState:
        if state is not LeaseState.RELEASED:
            leases.add_metric([state.value], snap.leases_by_state.get(state.value, 0))
    yield leases
    yield _gauge("gpupool_queue_length", "Lease requests waiting.", snap.queue_length)
    yield _gauge(
        "gpupool_queue_oldest_wait_seconds",
        "How long the longest-waiting queued request has waited.",
        snap.queue_oldest_wait_s,
    )
    yield _gauge(
        "gpupool_compute_capacity_percent",
        "Grantable compute of GPUs in service, in percent of one GPU (oversubscription included).",
        snap.compute_capacity_pct,
    )
    yield _gauge(
        "gpupool_compute_granted_percent",
        "Compute granted to leases, in percent of one GPU.",
        snap.compute_granted_pct,
    )
    yield _gauge(
        "gpupool_compute_used_percent",
        "Compute in use (sum of GPU utilisation), in percent of one GPU.",
        snap.compute_used_pct,
    )
    yield _gauge(
        "gpupool_memory_capacity_bytes",
        "Grantable GPU memory in service (oversubscription included).",
        snap.memory_capacity_mib * MIB,
    )
    yield _gauge(
        "gpupool_memory_granted_bytes",
        "GPU memory granted to leases.",
        snap.memory_granted_mib * MIB,
    )
    yield _gauge(
        "gpupool_memory_used_bytes",
        "GPU memory in use, as the agents read it.",
        snap.memory_used_mib * MIB,
    )
    yield _gauge(
        "gpupool_fragmentation_ratio",
        "Share of free virtual compute stranded beside other leases' slices (0 = none).",
        snap.fragmentation,
    )


_HOST_GAUGES = (
    ("cpu_pct", "gpupool_node_cpu_percent", "CPU use of the server, percent.", 1),
    ("load1", "gpupool_node_load1", "One-minute load average of the server.", 1),
    ("memory_used_mib", "gpupool_node_memory_used_bytes", "Host memory in use.", MIB),
    ("memory_total_mib", "gpupool_node_memory_total_bytes", "Host memory.", MIB),
    (
        "disk_used_mib",
        "gpupool_node_disk_used_bytes",
        "Disk used where the agent keeps state.",
        MIB,
    ),
    ("disk_total_mib", "gpupool_node_disk_total_bytes", "Size of the agent's disk.", MIB),
)
_HOST_COUNTERS = (
    ("net_recv_bytes", "gpupool_node_network_received_bytes", "Bytes received by the server."),
    ("net_sent_bytes", "gpupool_node_network_sent_bytes", "Bytes sent by the server."),
)


def node_families(snap: PoolSnapshot) -> Iterator[Metric]:
    up = GaugeMetricFamily("gpupool_node_up", "1 while the node heartbeats.", labels=["node"])
    for node in snap.nodes:
        up.add_metric([node.name], 1 if node.up else 0)
    yield up
    for key, name, doc, scale in _HOST_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["node"])
        for node in snap.nodes:
            value = node.host.get(key)
            if isinstance(value, int | float):
                family.add_metric([node.name], float(value) * scale)
        yield family
    for key, name, doc in _HOST_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["node"])
        for node in snap.nodes:
            value = node.host.get(key)
            if isinstance(value, int | float):
                counter.add_metric([node.name], float(value))
        yield counter


def gpu_families(snap: PoolSnapshot) -> Iterator[Metric]:
    labels = ["node", "gpu", "UUID"]
    mode = GaugeMetricFamily(
        "gpupool_gpu_mode",
        "1 for the GPU's current mode, 0 for the others.",
        labels=[*labels, "mode"],
    )
    healthy = GaugeMetricFamily("gpupool_gpu_healthy", "0 after a hardware fault.", labels=labels)
    compute = GaugeMetricFamily(
        "gpupool_gpu_compute_granted_percent", "Compute granted on the GPU.", labels=labels
    )
    memory = GaugeMetricFamily(
        "gpupool_gpu_memory_granted_bytes", "Memory granted on the GPU.", labels=labels
    )
    leases = GaugeMetricFamily("gpupool_gpu_leases", "Leases holding the GPU.", labels=labels)
    modes = [m.value for m in GpuMode]
    for g in snap.gpus:
        values = [g.node, str(g.index), g.uuid]
        for m in modes:
            mode.add_metric([*values, m], 1 if g.mode == m else 0)
        healthy.add_metric(values, 1 if g.healthy else 0)
        compute.add_metric(values, g.compute_granted_pct)
        memory.add_metric(values, g.memory_granted_mib * MIB)
        leases.add_metric(values, g.leases)
    yield from (mode, healthy, compute, memory, leases)


def tenant_families(snap: PoolSnapshot) -> Iterator[Metric]:
    specs = (
        (
            "gpupool_tenant_compute_granted_percent",
            "Compute the tenant holds.",
            "compute_granted_pct",
            1,
        ),
        (
            "gpupool_tenant_memory_granted_bytes",
            "GPU memory the tenant holds.",
            "memory_granted_mib",
            MIB,
        ),
        ("gpupool_tenant_gpus", "Whole GPUs the tenant holds.", "gpus", 1),
        ("gpupool_tenant_leases", "Leases the tenant holds.", "leases", 1),
        ("gpupool_tenant_queued_leases", "Requests of the tenant waiting.", "queued", 1),
    )
    for name, doc, attr, scale in specs:
        family = GaugeMetricFamily(name, doc, labels=["tenant"])
        for t in snap.tenants:
            family.add_metric([t.name], getattr(t, attr) * scale)
        yield family


def registry_for(
    store: Store, firing: Callable[[], dict[tuple[str, str], int]]
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(store, firing))
    registry.register(LEASE_WAIT)
    registry.register(SCHEDULING_LATENCY)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def agent_targets(store: Store) -> list[dict[str, Any]]:
    """Prometheus HTTP service discovery: one target group per agent that told its API URL."""
    with store.lock:
        nodes = [(row.name, row.agent_url) for row in store.node_rows.values() if row.agent_url]
    groups = []
    for name, url in sorted(nodes):
        scheme, _, rest = url.partition("://")
        host = rest.split("/", 1)[0]
        groups.append({"targets": [host], "labels": {"node": name, "__scheme__": scheme or "http"}})
    return groups
