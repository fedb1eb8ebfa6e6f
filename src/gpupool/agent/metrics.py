"""The agent's Prometheus metrics: each GPU under dcgm-exporter's names (so existing
dashboards and rules work), its health events, and the leases that hold it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpupool import __version__
from gpupool.agent.backends.base import GpuEvent
from gpupool.protocol.v1.api import GpuDesired, GpuInventory, GpuTelemetry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MIB = 1024 * 1024
MODES = ("virtual", "physical", "draining", "isolated")

# dcgm-exporter's labels, so that its Grafana dashboards and recording rules apply unchanged.
GPU_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"]

# (telemetry field, metric, help, scale): the DCGM field names dcgm-exporter exports.
DCGM_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("utilization_pct", "DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
    ("memory_used_mib", "DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
    ("temperature_c", "DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
    ("power_w", "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
    ("sm_clock_mhz", "DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
    ("mem_clock_mhz", "DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz)."),
    (
        "ecc_uncorrected",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
    ),
    (
        "ecc_corrected",
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "Total number of single-bit volatile ECC errors.",
    ),
)


@dataclass(slots=True)
class HealthCounts:
    """Health events of each GPU since the agent started, and the last Xid of each GPU."""

    xids: dict[tuple[str, int], int] = field(default_factory=dict)
    events: dict[tuple[str, str], int] = field(default_factory=dict)
    last_xid: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, event: GpuEvent) -> None:
        with self._lock:
            key = (event.gpu_uuid, event.kind)
            self.events[key] = self.events.get(key, 0) + 1
            # Xid 79 arrives as a "lost" event; it is an Xid all the same.
            if event.kind in ("xid", "lost") and isinstance(event.value, int):
                xid = (event.gpu_uuid, event.value)
                self.xids[xid] = self.xids.get(xid, 0) + 1
                self.last_xid[event.gpu_uuid] = event.value

    def copy(self) -> HealthCounts:
        with self._lock:
            return HealthCounts(dict(self.xids), dict(self.events), dict(self.last_xid))

    def xid_total(self, uuid: str) -> int:
        with self._lock:
            return sum(n for (gpu, _), n in self.xids.items() if gpu == uuid)

    def telemetry_fields(self, uuid: str) -> dict[str, Any]:
        """What the heartbeat tells the controller, which judges the Xid alert from it."""
        fields: dict[str, Any] = {"xid_errors": self.xid_total(uuid)}
        with self._lock:
            if uuid in self.last_xid:
                fields["xid_last"] = self.last_xid[uuid]
        return fields


@dataclass(frozen=True, slots=True)
class AgentView:
    """What one scrape reports, read from the agent and its backend off the event loop."""

    node: str
    backend: str
    simulated: bool
    registered: bool
    controller_reachable: bool | None
    heartbeats_sent: int
    mps_daemons: int
    inventory: list[GpuInventory]
    telemetry: list[GpuTelemetry]
    desired: dict[str, GpuDesired]
    health: HealthCounts
    direct_stopped: dict[str, int] = field(default_factory=dict)
    direct_reported: dict[str, int] = field(default_factory=dict)
    direct_usage: dict[tuple[str, str], tuple[int, float | None]] = field(default_factory=dict)
    direct_attached: int = 0
    ready_workers: dict[str, int] = field(default_factory=dict)
    """Ready workers alive now, per GPU that takes remote leases (gpupool.agent.ready)."""
    ready_wanted: int = 0
    ready_handed_over: int = 0


def _gpu_label_values(gpu: GpuInventory, node: str) -> list[str]:
    return [str(gpu.index), gpu.uuid, gpu.pci_bus_id or "", f"nvidia{gpu.index}", gpu.model, node]


class AgentCollector(Collector):
    def __init__(self, view: AgentView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        view = self.view
        yield from _agent_families(view)
        readings = {t.uuid: t for t in view.telemetry}
        gpus = [(g, readings.get(g.uuid), _gpu_label_values(g, view.node)) for g in view.inventory]
        for attr, name, doc in DCGM_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=GPU_LABELS)
            for _gpu, t, labels in gpus:
                value = getattr(t, attr) if t is not None else None
                if value is not None:
                    family.add_metric(labels, float(value))
            yield family
        free = GaugeMetricFamily(
            "DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=GPU_LABELS
        )
        total = GaugeMetricFamily(
            "DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", labels=GPU_LABELS
        )
        xid_last = GaugeMetricFamily(
            "DCGM_FI_DEV_XID_ERRORS",
            "Value of the last XID error encountered.",
            labels=GPU_LABELS,
        )
        for gpu, t, labels in gpus:
            total.add_metric(labels, gpu.memory_mib)
            if t is not None and t.memory_used_mib is not None:
                free.add_metric(labels, max(0, gpu.memory_mib - t.memory_used_mib))
            xid_last.add_metric(labels, view.health.last_xid.get(gpu.uuid, 0))
        yield from (free, total, xid_last)
        yield from _health_families(view, gpus)
        yield from _lease_families(view, gpus)
        yield from _direct_families(view)
        yield from _ready_families(view, gpus)


def _agent_families(view: AgentView) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "gpupool_agent_info",
        "The agent: its node, GPU backend and version.",
        labels=["Hostname", "backend", "simulated", "version"],
    )
    info.add_metric([view.node, view.backend, str(view.simulated).lower(), __version__], 1)
    yield info
    yield GaugeMetricFamily(
        "gpupool_agent_registered",
        "1 once the controller knows this node.",
        value=int(view.registered),
    )
    yield GaugeMetricFamily(
        "gpupool_agent_controller_reachable",
        "1 while the controller answers.",
        value=1 if view.controller_reachable else 0,
    )
    yield CounterMetricFamily(
        "gpupool_agent_heartbeats",
        "Heartbeats the controller accepted.",
        value=view.heartbeats_sent,
    )
    yield GaugeMetricFamily(
        "gpupool_agent_mps_daemons", "MPS control daemons running.", value=view.mps_daemons
    )


Row = tuple[GpuInventory, GpuTelemetry | None, list[str]]


def _health_families(view: AgentView, gpus: list[Row]) -> Iterator[Metric]:
    xids = CounterMetricFamily(
        "gpupool_gpu_xid_errors",
        "Xid errors of the GPU since the agent started, by Xid code.",
        labels=[*GPU_LABELS, "xid"],
    )
    events = CounterMetricFamily(
        "gpupool_gpu_health_events",
        "Health events of the GPU since the agent started, by kind.",
        labels=[*GPU_LABELS, "kind"],
    )
    mode = GaugeMetricFamily(
        "gpupool_gpu_mode",
        "1 for the mode the controller wants of the GPU, 0 for the others.",
        labels=[*GPU_LABELS, "mode"],
    )
    processes = GaugeMetricFamily(
        "gpupool_gpu_processes", "Compute processes on the GPU.", labels=GPU_LABELS
    )
    counts = view.health
    for gpu, t, labels in gpus:
        codes = sorted(code for (uuid, code) in counts.xids if uuid == gpu.uuid)
        # A zero series from the start, so that increase() sees the first error.
        if not codes:
            xids.add_metric([*labels, "none"], 0)
        for code in codes:
            xids.add_metric([*labels, str(code)], counts.xids[(gpu.uuid, code)])
        for kind in ("xid", "ecc_uncorrected", "temperature", "lost"):
            events.add_metric([*labels, kind], counts.events.get((gpu.uuid, kind), 0))
        desired = view.desired.get(gpu.uuid)
        if desired is not None:
            for m in MODES:
                mode.add_metric([*labels, m], 1 if desired.mode == m else 0)
        if t is not None:
            processes.add_metric(labels, len(t.processes))
    yield from (xids, events, mode, processes)


def _lease_families(view: AgentView, gpus: list[Row]) -> Iterator[Metric]:
    lease_labels = ["lease", *GPU_LABELS]
    held = GaugeMetricFamily(
        "gpupool_lease_gpu",
        "1 for each GPU of this node that a lease holds (a slice or the whole GPU).",
        labels=lease_labels,
    )
    util = GaugeMetricFamily(
        "gpupool_lease_gpu_utilization_percent",
        "Utilisation of a GPU held by a single lease: that lease's use.",
        labels=lease_labels,
    )
    memory = GaugeMetricFamily(
        "gpupool_lease_gpu_memory_used_bytes",
        "Memory in use on a GPU held by a single lease: that lease's use.",
        labels=lease_labels,
    )
    for gpu, t, labels in gpus:
        desired = view.desired.get(gpu.uuid)
        leases = desired.leases if desired is not None else []
        for lease in leases:
            held.add_metric([lease, *labels], 1)
        # With several leases on one GPU the device's readings cannot be split among them;
        # that needs the per-process accounting of the workers.
        if len(leases) == 1 and t is not None:
            if t.utilization_pct is not None:
                util.add_metric([leases[0], *labels], t.utilization_pct)
            if t.memory_used_mib is not None:
                memory.add_metric([leases[0], *labels], t.memory_used_mib * MIB)
    yield from (held, util, memory)


DIRECT_REASONS = ("over_memory", "foreign_gpu", "no_lease")
DIRECT_REPORTS = ("compute_over_share", "raised_limits", "unattributable")


def _direct_families(view: AgentView) -> Iterator[Metric]:
    """The watch of direct slices: what it stopped and saw, and each lease's measured use."""
    stopped = CounterMetricFamily(
        "gpupool_direct_processes_stopped",
        "Processes of direct slices stopped (or, with --direct-watch report, found) by reason.",
        labels=["reason"],
    )
    for reason in DIRECT_REASONS:
        stopped.add_metric([reason], view.direct_stopped.get(reason, 0))
    reported = CounterMetricFamily(
        "gpupool_direct_reports",
        "What the watch of direct slices reported without stopping anything, by reason.",
        labels=["reason"],
    )
    for reason in DIRECT_REPORTS:
        reported.add_metric([reason], view.direct_reported.get(reason, 0))
    memory = GaugeMetricFamily(
        "gpupool_direct_lease_memory_used_bytes",
        "GPU memory the processes of a direct lease hold on a GPU, as the driver reports it.",
        labels=["lease", "UUID"],
    )
    sm = GaugeMetricFamily(
        "gpupool_direct_lease_sm_percent",
        "SM use of a direct lease's processes on a GPU (NVML per-process samples), where "
        "the driver samples processes.",
        labels=["lease", "UUID"],
    )
    for (lease, uuid), (mib, pct) in sorted(view.direct_usage.items()):
        memory.add_metric([lease, uuid], mib * MIB)
        if pct is not None:
            sm.add_metric([lease, uuid], pct)
    attached = GaugeMetricFamily(
        "gpupool_direct_attached_processes",
        "Processes attached to direct leases by `gpupool run` (each with its descendants).",
        value=view.direct_attached,
    )
    yield from (stopped, reported, memory, sm, attached)


def _ready_families(view: AgentView, gpus: list[Row]) -> Iterator[Metric]:
    """The ready pool: workers started ahead of their leases (`--ready-workers`)."""
    ready = GaugeMetricFamily(
        "gpupool_agent_ready_workers",
        "Workers started ahead of their leases and ready to take one, per GPU.",
        labels=GPU_LABELS,
    )
    for gpu, _t, labels in gpus:
        if gpu.uuid in view.ready_workers:
            ready.add_metric(labels, view.ready_workers[gpu.uuid])
    yield ready
    yield GaugeMetricFamily(
        "gpupool_agent_ready_workers_wanted",
        "Ready workers the agent keeps: --ready-workers times the GPUs that take remote leases.",
        value=view.ready_wanted,
    )
    yield CounterMetricFamily(
        "gpupool_agent_ready_workers_handed_over",
        "Remote leases whose worker was a ready worker, since the agent started.",
        value=view.ready_handed_over,
    )


def exposition(view: AgentView) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(view))
    return generate_latest(registry)
