"""Invariants of a pool that a fault must not break, checked through the SDK, and the record
each fault-injection test leaves for bench/results/reliability.md."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpupool.client.sdk import PoolClient
from gpupool.protocol.v1.api import LeaseOut

NOT_HOLDING = ("queued", "released")
REPORT_DIR_ENV = "GPUPOOL_RELIABILITY_DIR"


def double_grants(api: PoolClient) -> list[str]:
    """What is wrong with the grants: a GPU given past its capacity, or the controller's
    accounting of a GPU differing from the leases that hold it. Empty when all is well."""
    holding = [lease for lease in api.leases() if lease.state not in NOT_HOLDING]
    compute: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    holders: dict[str, set[str]] = defaultdict(set)
    for lease in holding:
        for piece in lease.slices:
            compute[piece.gpu_uuid] += piece.compute_pct
            memory[piece.gpu_uuid] += piece.memory_mib
            holders[piece.gpu_uuid].add(lease.id)
    problems = []
    for gpu in api.gpus():
        if compute[gpu.uuid] > 100 or memory[gpu.uuid] > gpu.memory_mib:
            problems.append(
                f"{gpu.uuid} granted {compute[gpu.uuid]}% and {memory[gpu.uuid]} MiB "
                f"of 100% and {gpu.memory_mib} MiB"
            )
        if (gpu.compute_granted_pct, gpu.memory_granted_mib) != (
            compute[gpu.uuid],
            memory[gpu.uuid],
        ):
            problems.append(
                f"{gpu.uuid}: the controller counts {gpu.compute_granted_pct}% and "
                f"{gpu.memory_granted_mib} MiB, its leases hold {compute[gpu.uuid]}% and "
                f"{memory[gpu.uuid]} MiB"
            )
        if set(gpu.leases) != holders[gpu.uuid]:
            problems.append(
                f"{gpu.uuid}: leases {sorted(gpu.leases)} vs {sorted(holders[gpu.uuid])}"
            )
    return problems


def all_leases(api: PoolClient) -> dict[str, LeaseOut]:
    return {lease.id: lease for lease in api.leases(state="all", limit=10000)}


@dataclass
class FaultRecord:
    """One row of the reliability report: what was done, what survived, what was lost."""

    fault: str
    setup: str = ""
    survived: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """What a fault must not take: a granted or queued lease gone, a grant made twice, a
    released lease back, a client that did not get its answer. Must stay empty."""
    seconds: float = 0.0

    def save(self, test_name: str) -> None:
        """Written only when bench/reliability.py runs the suite (it sets the directory)."""
        directory = os.environ.get(REPORT_DIR_ENV)
        if not directory:
            return
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", test_name)
        Path(directory, f"{name}.json").write_text(json.dumps(asdict(self), indent=1))
