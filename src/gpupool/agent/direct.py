"""What the watch of direct slices decides: which GPU processes break their lease, and how.

Pure functions over plain data (the processes a GPU reports, who owns each, the leases on
this node), so every rule is tested without a GPU, a process or a clock; gpupool.agent.watch
gathers the data and carries the decisions out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gpupool.agent.backends.base import GpuProcess
from gpupool.protocol.v1.api import DirectLease, DirectSlice

COMPUTE_TOLERANCE_PCT = 10.0
"""Measured SM use may exceed a share by this much before it is reported: NVML's
per-process samples are averages over the driver's sampling window, not exact shares."""


class Reason(StrEnum):
    """Why the watch acts on a process; the value is what events and metrics carry."""

    OVER_MEMORY = "over_memory"
    FOREIGN_GPU = "foreign_gpu"
    NO_LEASE = "no_lease"
    COMPUTE_OVER_SHARE = "compute_over_share"
    RAISED_LIMITS = "raised_limits"

    @property
    def stops(self) -> bool:
        """Memory and GPUs are limits the watch enforces; compute is only reported."""
        return self in (Reason.OVER_MEMORY, Reason.FOREIGN_GPU, Reason.NO_LEASE)


@dataclass(frozen=True, slots=True)
class Finding:
    """One process that breaks (or, for compute, exceeds) what its lease allows on one GPU."""

    reason: Reason
    process: GpuProcess
    lease_id: str | None
    detail: str
    used_memory_mib: int | None = None
    """For OVER_MEMORY: what the lease's processes held on the GPU together."""
    limit_memory_mib: int | None = None
    compute_pct: float | None = None
    share_pct: int | None = None


def slice_on(lease: DirectLease, gpu_uuid: str) -> DirectSlice | None:
    return next((s for s in lease.slices if s.gpu_uuid == gpu_uuid), None)


def judge(
    processes: Sequence[GpuProcess],
    owners: Mapping[int, str | None],
    leases: Mapping[str, DirectLease],
    compute_tolerance_pct: float = COMPUTE_TOLERANCE_PCT,
) -> list[Finding]:
    """Every finding for `processes` (exempt ones, such as workers and MPS servers, already
    left out); `owners` maps each pid to its direct lease, None for a process of no lease."""
    findings: list[Finding] = []
    held: dict[tuple[str, str], list[GpuProcess]] = {}
    for proc in processes:
        lease_id = owners.get(proc.pid)
        lease = leases.get(lease_id) if lease_id is not None else None
        if lease_id is None or lease is None:
            why = "no lease" if lease_id is None else f"lease {lease_id}, which has ended"
            findings.append(
                Finding(
                    Reason.NO_LEASE, proc, lease_id, f"uses {proc.gpu_uuid} and belongs to {why}"
                )
            )
            continue
        if slice_on(lease, proc.gpu_uuid) is None:
            findings.append(
                Finding(
                    Reason.FOREIGN_GPU,
                    proc,
                    lease_id,
                    f"uses {proc.gpu_uuid}, which its lease {lease_id} does not hold",
                )
            )
            continue
        held.setdefault((lease_id, proc.gpu_uuid), []).append(proc)
    for (lease_id, gpu_uuid), procs in held.items():
        piece = slice_on(leases[lease_id], gpu_uuid)
        assert piece is not None
        if piece.whole:
            continue  # a whole GPU: the driver's own limit is the lease's
        findings += _over_memory(lease_id, piece, procs)
        over = _over_share(lease_id, piece, procs, compute_tolerance_pct)
        if over is not None:
            findings.append(over)
    return findings


def to_stop_for_memory(processes: Iterable[GpuProcess], limit_mib: int) -> list[GpuProcess]:
    """The fewest processes to stop, largest first, so that the rest fit in `limit_mib`.

    A lease's processes share its slice: two of 5 GiB on a 8 GiB slice break it together, and
    stopping the larger one is enough. Processes whose use the driver does not report count
    as zero (they cannot be judged)."""
    known = sorted(
        (p for p in processes if p.used_memory_mib is not None),
        key=lambda p: (-(p.used_memory_mib or 0), p.pid),
    )
    total = sum(p.used_memory_mib or 0 for p in known)
    out: list[GpuProcess] = []
    for proc in known:
        if total <= limit_mib:
            break
        out.append(proc)
        total -= proc.used_memory_mib or 0
    return out


def _over_memory(lease_id: str, piece: DirectSlice, procs: list[GpuProcess]) -> list[Finding]:
    total = sum(p.used_memory_mib or 0 for p in procs)
    return [
        Finding(
            Reason.OVER_MEMORY,
            proc,
            lease_id,
            f"its lease {lease_id} holds {piece.memory_mib} MiB on {piece.gpu_uuid}; "
            f"its processes there use {total} MiB (this one {proc.used_memory_mib} MiB)",
            used_memory_mib=total,
            limit_memory_mib=piece.memory_mib,
        )
        for proc in to_stop_for_memory(procs, piece.memory_mib)
    ]


def _over_share(
    lease_id: str, piece: DirectSlice, procs: list[GpuProcess], tolerance_pct: float
) -> Finding | None:
    measured = [p for p in procs if p.sm_util_pct is not None]
    if not measured:
        return None
    total = sum(p.sm_util_pct or 0.0 for p in measured)
    if total <= piece.compute_pct + tolerance_pct:
        return None
    top = max(measured, key=lambda p: (p.sm_util_pct or 0.0, -p.pid))
    return Finding(
        Reason.COMPUTE_OVER_SHARE,
        top,
        lease_id,
        f"its lease {lease_id} has {piece.compute_pct} % of {piece.gpu_uuid}; its processes "
        f"there use {total:g} % of the SMs (per-process samples)",
        compute_pct=total,
        share_pct=piece.compute_pct,
    )


# ---- what a process's environment says it was started with ---------------------------------


def raised_limits(environ: Mapping[str, str], lease: DirectLease, gpu_uuid: str) -> list[str]:
    """The MPS and device variables a process was started with that ask for more than its
    lease gives on `gpu_uuid`, in words; empty when it asks for no more.

    /proc/<pid>/environ holds the environment a process was exec'd with: a child whose parent
    re-exported larger limits shows them here; a program that changes its own variables
    in memory before CUDA starts does not, which is why memory is judged by what the driver
    reports and not by these variables."""
    piece = slice_on(lease, gpu_uuid)
    if piece is None or piece.whole:
        return []
    said: list[str] = []
    pct = _int(environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
    if pct is not None and pct > piece.compute_pct:
        said.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct} (share {piece.compute_pct})")
    if "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in environ and pct is None:
        said.append("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE unreadable")
    limit = environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    if limit is not None:
        asked = pinned_limits_mib(limit)
        if asked is None:
            said.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT unreadable")
        elif not asked or max(asked) > piece.memory_mib:
            most = max(asked) if asked else None
            said.append(
                f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT up to {most} MiB (lease {piece.memory_mib} MiB)"
            )
    else:
        said.append("no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    held = {s.gpu_uuid for s in lease.slices}
    if visible is not None:
        others = [d.strip() for d in visible.split(",") if d.strip() and d.strip() not in held]
        if others:
            said.append(f"CUDA_VISIBLE_DEVICES names {', '.join(others[:4])}")
    return said


_UNITS_MIB = {"": 1.0 / (1024 * 1024), "K": 1.0 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 * 1024}


def pinned_limits_mib(value: str) -> list[int] | None:
    """`0=8192M,1=2G` (MPS's syntax) as MiB per entry; None when it cannot be read."""
    out: list[int] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        _, _, amount = item.rpartition("=")
        amount = amount.strip().upper()
        unit = amount[-1] if amount and amount[-1] in "KMGT" else ""
        number = amount[:-1] if unit else amount
        if not number.isdigit() or len(number) > 18:
            return None
        out.append(int(int(number) * _UNITS_MIB[unit]))
    return out


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if value.isdigit() and len(value) <= 9 else None
