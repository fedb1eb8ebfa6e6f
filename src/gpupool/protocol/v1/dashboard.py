"""Bodies of the dashboard's read API (`/api/v1/dashboard/*`, `/api/v1/history`,
`/api/v1/alerts`): the pool summarised for people, in one request per page."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field


class GpuTile(BaseModel):
    """One GPU as the dashboard draws it: mode, grants and the latest readings."""

    uuid: str
    node: str
    index: int
    model: str
    memory_mib: int
    mode: str
    target_mode: str | None
    healthy: bool
    simulated: bool
    compute_granted_pct: int
    memory_granted_mib: int
    leases: int
    utilization_pct: float | None
    memory_used_mib: int | None
    temperature_c: float | None
    power_w: float | None


class AlertOut(BaseModel):
    name: str
    severity: Literal["critical", "warning", "info"]
    state: Literal["pending", "firing", "resolved"]
    labels: dict[str, str]
    summary: str
    value: float
    active_since: datetime
    fired_at: datetime | None
    resolved_at: datetime | None


class TenantUsage(BaseModel):
    name: str
    compute_granted_pct: int
    memory_granted_mib: int
    gpus: int
    leases: int
    queued: int


class OverviewOut(BaseModel):
    at: datetime
    version: str
    simulated: bool
    nodes_up: int
    nodes_down: int
    gpus_total: int
    gpus_by_mode: dict[str, int]
    gpus_unhealthy: int
    leases_by_state: dict[str, int]
    leases_holding: int
    queue_length: int
    queue_oldest_wait_s: float
    compute_capacity_pct: int
    compute_granted_pct: int
    compute_used_pct: float
    memory_capacity_mib: int
    memory_granted_mib: int
    memory_used_mib: int
    utilization_pct: float | None
    fragmentation: float
    ratios: dict[str, float]
    alerts: list[AlertOut]
    alerts_pending: int
    tenants: list[TenantUsage]
    gpus: list[GpuTile]


class ServerOut(BaseModel):
    """A server as operators manage it: its host readings beside its GPUs."""

    name: str
    up: bool
    backend: str
    cpu_count: int | None
    last_seen_s: float | None
    cpu_pct: float | None
    load1: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    disk_used_mib: int | None
    disk_total_mib: int | None
    net_recv_bytes_per_s: float | None
    net_sent_bytes_per_s: float | None
    gpus: list[GpuTile]


class SliceHolder(BaseModel):
    """One lease's part of one GPU, and who holds it."""

    lease_id: str
    tenant: str
    holder: str
    state: str
    priority: int
    access: str
    compute_pct: int
    memory_mib: int
    whole: bool
    granted_at: datetime | None


class GpuDetailOut(BaseModel):
    gpu: GpuTile
    pci_bus_id: str | None
    isolation_reason: str | None
    telemetry: dict[str, Any]
    compute_capacity_pct: int
    memory_capacity_mib: int
    holders: list[SliceHolder]


class HistoryOut(BaseModel):
    step_s: int
    t: list[float]
    series: dict[str, list[float | None]]


class AlertRuleOut(BaseModel):
    name: str
    severity: str
    for_s: int
    expr: str
    summary: str
    description: str
    firing: int
    pending: int


class WebhookOut(BaseModel):
    configured: bool
    sent: int
    failed: int
    last_error: str | None
    last_sent_at: datetime | None


class AlertsOut(BaseModel):
    evaluated_at: datetime | None
    firing: list[AlertOut]
    pending: list[AlertOut]
    resolved: list[AlertOut]
    rules: list[AlertRuleOut]
    webhook: WebhookOut = Field(
        default_factory=lambda: WebhookOut(
            configured=False, sent=0, failed=0, last_error=None, last_sent_at=None
        )
    )
