"""The pool measured at one instant, from memory only: what metrics, history, alerts and the
dashboard's overview are all computed from, so that they never disagree."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpupool.controller.store import Store
from gpupool.core import GpuMode, LeaseState
from gpupool.core.model import GpuUsage

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuReading:
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
    whole: bool
    utilization_pct: float | None
    memory_used_mib: int | None
    temperature_c: float | None
    power_w: float | None
    xid_errors: int | None
    xid_last: int | None
    isolation_reason: str | None


@dataclass(frozen=True, slots=True)
class NodeReading:
    name: str
    up: bool
    backend: str
    gpus: int
    cpu_count: int | None
    host: dict[str, Any]
    last_seen_s: float | None
    """Seconds since the node's last heartbeat; None when it has sent none since the start."""


@dataclass(frozen=True, slots=True)
class TenantReading:
    name: str
    compute_granted_pct: int
    memory_granted_mib: int
    gpus: int
    leases: int
    queued: int


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    at: float
    gpus: list[GpuReading]
    nodes: list[NodeReading]
    tenants: list[TenantReading]
    leases_by_state: dict[str, int]
    queue_length: int
    queue_oldest_wait_s: float
    compute_capacity_pct: int
    compute_granted_pct: int
    compute_used_pct: float
    memory_capacity_mib: int
    memory_granted_mib: int
    memory_used_mib: int
    fragmentation: float
    ratios: dict[str, float] = field(default_factory=dict)

    @property
    def gpus_by_mode(self) -> dict[str, int]:
        out = {m.value: 0 for m in GpuMode}
        for gpu in self.gpus:
            out[gpu.mode] = out.get(gpu.mode, 0) + 1
        return out

    @property
    def utilization_pct(self) -> float | None:
        """Mean utilisation of the GPUs that report one."""
        readings = [g.utilization_pct for g in self.gpus if g.utilization_pct is not None]
        return sum(readings) / len(readings) if readings else None

    @property
    def holding(self) -> int:
        return sum(n for s, n in self.leases_by_state.items() if s != LeaseState.QUEUED.value)


def take(store: Store, now: float | None = None) -> PoolSnapshot:
    """Measure the pool; holds the store's lock for a few milliseconds on a large pool."""
    now = time.time() if now is None else now
    with store.lock:
        return _measure(store, now)


def _measure(store: Store, now: float) -> PoolSnapshot:
    pool = store.pool
    telemetry = store.live.telemetry
    gpus: list[GpuReading] = []
    compute_cap = memory_cap = compute_granted = memory_granted = 0
    compute_used = 0.0
    memory_used = 0
    free_total = free_scattered = 0
    for uuid, gpu in pool.gpus.items():
        used = pool.usage.get(uuid) or GpuUsage()
        t = telemetry.get(uuid) or {}
        row = store.gpu_rows.get(uuid)
        util = _float(t.get("utilization_pct"))
        mem_used = _int(t.get("memory_used_mib"))
        gpus.append(
            GpuReading(
                uuid=uuid,
                node=gpu.node,
                index=gpu.index,
                model=gpu.model,
                memory_mib=gpu.memory_mib,
                mode=gpu.mode.value,
                target_mode=gpu.target_mode.value if gpu.target_mode else None,
                healthy=gpu.healthy,
                simulated=gpu.simulated,
                compute_granted_pct=used.compute_pct,
                memory_granted_mib=used.memory_mib,
                leases=len(used.leases),
                whole=used.whole,
                utilization_pct=util,
                memory_used_mib=mem_used,
                temperature_c=_float(t.get("temperature_c")),
                power_w=_float(t.get("power_w")),
                xid_errors=_int(t.get("xid_errors")),
                xid_last=_int(t.get("xid_last")),
                isolation_reason=row.isolation_reason if row is not None else None,
            )
        )
        compute_granted += used.compute_pct
        memory_granted += used.memory_mib
        compute_used += util or 0.0
        memory_used += mem_used or 0
        if gpu.takes_new_leases() or used.leases:
            if gpu.mode is GpuMode.PHYSICAL:
                compute_cap += 100
                memory_cap += gpu.memory_mib
            else:
                compute_cap += int(100 * pool.ratios.compute)
                memory_cap += int(gpu.memory_mib * pool.ratios.memory)
        if gpu.mode is GpuMode.VIRTUAL and gpu.takes_new_leases() and gpu.node in pool.nodes_up:
            free, _memory = pool.free_on(gpu)
            free = max(free, 0)
            free_total += free
            if used.leases:
                free_scattered += free
    gpus.sort(key=lambda g: (g.node, g.index))

    states: dict[str, int] = {}
    oldest_created: float | None = None
    for lease in store.lease_rows.values():
        states[lease.state] = states.get(lease.state, 0) + 1
        if lease.id in pool.queue:
            created = lease.created_at.timestamp()
            if oldest_created is None or created < oldest_created:
                oldest_created = created

    gpu_count: dict[str, int] = {}
    for g in gpus:
        gpu_count[g.node] = gpu_count.get(g.node, 0) + 1
    nodes = []
    for name, nrow in sorted(store.node_rows.items()):
        seen = store.live.node_seen.get(name)
        nodes.append(
            NodeReading(
                name=name,
                up=nrow.state == "up",
                backend=nrow.backend,
                gpus=gpu_count.get(name, 0),
                cpu_count=nrow.cpu_count,
                host=dict(store.live.host.get(name) or nrow.host or {}),
                last_seen_s=None if seen is None else max(0.0, now - seen),
            )
        )

    queued: dict[str, int] = {}
    for entry in pool.queue.values():
        queued[entry.request.tenant] = queued.get(entry.request.tenant, 0) + 1
    tenants = [
        TenantReading(
            name=name,
            compute_granted_pct=pool.held_by(name).compute_pct,
            memory_granted_mib=pool.held_by(name).memory_mib,
            gpus=pool.held_by(name).gpus,
            leases=pool.held_by(name).leases,
            queued=queued.get(name, 0),
        )
        for name in sorted(pool.quotas)
    ]
    return PoolSnapshot(
        at=now,
        gpus=gpus,
        nodes=nodes,
        tenants=tenants,
        leases_by_state=states,
        queue_length=len(pool.queue),
        queue_oldest_wait_s=0.0 if oldest_created is None else max(0.0, now - oldest_created),
        compute_capacity_pct=compute_cap,
        compute_granted_pct=compute_granted,
        compute_used_pct=round(compute_used, 3),
        memory_capacity_mib=memory_cap,
        memory_granted_mib=memory_granted,
        memory_used_mib=memory_used,
        fragmentation=fragmentation(free_total, free_scattered),
        ratios={"compute": pool.ratios.compute, "memory": pool.ratios.memory},
    )


def fragmentation(free_total_pct: int, free_on_shared_pct: int) -> float:
    """Share of the free virtual compute that sits on GPUs already holding slices.

    0 means all free room is on empty GPUs (any request shape fits); 1 means every free
    percent is a leftover beside someone else's slice, so a whole-GPU-sized slice cannot be
    placed even though the pool has room in total.
    """
    if free_total_pct <= 0:
        return 0.0
    return round(free_on_shared_pct / free_total_pct, 4)


def _float(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _int(value: object) -> int | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    return None
