"""The pool at a glance: capacity, grants, leases by state, the queue."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpupool.controller.models import LeaseRow, NodeRow
from gpupool.controller.store import Store
from gpupool.core import GpuMode, LeaseState
from gpupool.protocol.v1.api import PoolSummary


def summary(store: Store, session: Session) -> PoolSummary:
    states = {
        state: count
        for state, count in session.execute(
            select(LeaseRow.state, func.count())
            .where(LeaseRow.state != LeaseState.RELEASED.value)
            .group_by(LeaseRow.state)
        )
    }
    nodes = {
        state: count
        for state, count in session.execute(
            select(NodeRow.state, func.count()).group_by(NodeRow.state)
        )
    }
    with store.lock:
        pool = store.pool
        by_mode = {m.value: 0 for m in GpuMode}
        compute_cap = memory_cap = compute_granted = memory_granted = 0
        for gpu in pool.gpus.values():
            by_mode[gpu.mode.value] += 1
            used = pool.usage[gpu.uuid]
            compute_granted += used.compute_pct
            memory_granted += used.memory_mib
            if gpu.takes_new_leases() or used.leases:
                if gpu.mode is GpuMode.PHYSICAL:
                    compute_cap += 100
                    memory_cap += gpu.memory_mib
                else:
                    compute_cap += int(100 * pool.ratios.compute)
                    memory_cap += int(gpu.memory_mib * pool.ratios.memory)
        return PoolSummary(
            nodes_up=nodes.get("up", 0),
            nodes_down=nodes.get("down", 0),
            gpus=by_mode,
            compute_capacity_pct=compute_cap,
            compute_granted_pct=compute_granted,
            memory_capacity_mib=memory_cap,
            memory_granted_mib=memory_granted,
            leases=states,
            queued=len(pool.queue),
            ratios={"compute": pool.ratios.compute, "memory": pool.ratios.memory},
            simulated=any(g.simulated for g in pool.gpus.values()),
        )
