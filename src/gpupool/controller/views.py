"""Rows and pool state turned into the API's response bodies."""

from __future__ import annotations

from typing import Any

from gpupool.controller.elastic_record import swap_reason
from gpupool.controller.models import EventRow, GpuRow, LeaseRow, NodeRow, TenantRow
from gpupool.core import Pool
from gpupool.core.model import GpuUsage, Usage
from gpupool.protocol.v1.api import EventOut, GpuOut, LeaseOut, NodeOut, SliceOut, TenantOut


def lease_out(
    row: LeaseRow, pool: Pool | None = None, activity: dict[str, Any] | None = None
) -> LeaseOut:
    position = reason = None
    if pool is not None and row.state == "queued":
        position = pool.position(row.id)
        reason = pool.why_waiting(row.id) or None
    return LeaseOut(
        id=row.id,
        tenant=row.tenant,
        state=row.state,
        gpus=row.gpus,
        compute_pct=row.compute_pct,
        memory_mib=row.memory_mib,
        physical=row.physical,
        priority=row.priority,
        access=row.access,
        holder=row.holder,
        ttl_s=row.ttl_s,
        created_at=row.created_at,
        granted_at=row.granted_at,
        released_at=row.released_at,
        last_heartbeat_at=row.last_heartbeat_at,
        release_reason=row.release_reason,
        slices=[
            SliceOut(
                gpu_uuid=s.gpu_uuid,
                node=s.node,
                gpu_index=s.gpu_index,
                compute_pct=s.compute_pct,
                memory_mib=s.memory_mib,
                whole=s.whole,
                endpoint=s.endpoint,
            )
            for s in row.slices
        ],
        queue_position=position,
        waiting_reason=reason,
        activity=dict(activity or {}),
        node=row.node,
        gpu_models=list(row.gpu_models or []),
        idle_timeout_s=row.idle_timeout_s,
        swap_reason=_swap_reason(row),
    )


def _swap_reason(row: LeaseRow) -> str | None:
    """Why a swapped lease is out, or why a running one is asked to go (oversubscription)."""
    return swap_reason(row) if row.state in ("swapped", "granted", "active", "idle") else None


def gpu_out(row: GpuRow, pool: Pool, telemetry: dict[str, object] | None = None) -> GpuOut:
    gpu = pool.gpus.get(row.uuid)
    used = pool.usage.get(row.uuid, GpuUsage())
    return GpuOut(
        uuid=row.uuid,
        node=row.node,
        index=row.index,
        model=row.model,
        memory_mib=row.memory_mib,
        mode=(gpu.mode.value if gpu else row.mode),
        target_mode=(
            (gpu.target_mode.value if gpu.target_mode else None) if gpu else row.target_mode
        ),
        healthy=gpu.healthy if gpu else row.healthy,
        simulated=row.simulated,
        pci_bus_id=row.pci_bus_id,
        compute_granted_pct=used.compute_pct,
        memory_granted_mib=used.memory_mib,
        leases=sorted(used.leases),
        telemetry=dict(telemetry if telemetry is not None else row.telemetry or {}),
        isolation_reason=row.isolation_reason,
    )


def node_out(row: NodeRow, gpu_count: int, host: dict[str, object] | None = None) -> NodeOut:
    return NodeOut(
        name=row.name,
        address=row.address,
        agent_url=row.agent_url,
        state=row.state,
        backend=row.backend,
        cpu_count=row.cpu_count,
        memory_mib=row.memory_mib,
        driver_version=row.driver_version,
        cuda_version=row.cuda_version,
        gpu_count=gpu_count,
        registered_at=row.registered_at,
        last_seen_at=row.last_seen_at,
        host=dict(host if host is not None else row.host or {}),
    )


def tenant_out(row: TenantRow, used: Usage, queued: int) -> TenantOut:
    return TenantOut(
        name=row.name,
        weight=row.weight,
        max_gpus=row.max_gpus,
        max_memory_mib=row.max_memory_mib,
        max_compute_pct=row.max_compute_pct,
        max_leases=row.max_leases,
        max_priority=row.max_priority,
        guaranteed_gpus=row.guaranteed_gpus or 0.0,
        idle_timeout_s=row.idle_timeout_s,
        used_gpus=used.gpus,
        used_memory_mib=used.memory_mib,
        used_compute_pct=used.compute_pct,
        used_leases=used.leases,
        queued_leases=queued,
    )


def event_out(row: EventRow) -> EventOut:
    return EventOut(
        id=row.id,
        at=row.at,
        actor=row.actor,
        kind=row.kind,
        subject=row.subject,
        message=row.message,
        data=dict(row.data or {}),
    )
