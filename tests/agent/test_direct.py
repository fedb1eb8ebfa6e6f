"""The rules of the watch of direct slices, as pure functions: who breaks which lease, and how."""

from __future__ import annotations

from gpupool.agent.backends.base import GpuProcess
from gpupool.agent.direct import (
    Reason,
    judge,
    pinned_limits_mib,
    raised_limits,
    to_stop_for_memory,
)
from gpupool.protocol.v1.api import DirectLease, DirectSlice

G0, G1 = "GPU-0", "GPU-1"


def lease(*slices: DirectSlice) -> DirectLease:
    return DirectLease(token_sha256="0" * 64, slices=list(slices))


def piece(
    uuid: str = G0, compute: int = 30, memory: int = 8192, whole: bool = False
) -> DirectSlice:
    return DirectSlice(gpu_uuid=uuid, compute_pct=compute, memory_mib=memory, whole=whole)


def proc(pid: int, uuid: str = G0, mib: int | None = 100, sm: float | None = None) -> GpuProcess:
    return GpuProcess(gpu_uuid=uuid, pid=pid, used_memory_mib=mib, sm_util_pct=sm)


def reasons(findings: list) -> list[tuple[str, int]]:  # type: ignore[type-arg]
    return sorted((f.reason.value, f.process.pid) for f in findings)


def test_a_compliant_process_is_not_found_against() -> None:
    leases = {"l-a": lease(piece(memory=8192))}
    assert judge([proc(10, mib=8000, sm=25.0)], {10: "l-a"}, leases) == []


def test_a_process_over_its_lease_memory_is_to_be_stopped() -> None:
    leases = {"l-a": lease(piece(memory=1024))}
    findings = judge([proc(10, mib=2048)], {10: "l-a"}, leases)
    assert reasons(findings) == [("over_memory", 10)]
    (finding,) = findings
    assert finding.reason.stops
    assert (finding.used_memory_mib, finding.limit_memory_mib) == (2048, 1024)
    assert "l-a" in finding.detail and "1024 MiB" in finding.detail


def test_processes_of_one_lease_share_its_slice_and_the_largest_is_stopped_first() -> None:
    leases = {"l-a": lease(piece(memory=8192))}
    procs = [proc(10, mib=5000), proc(11, mib=5000), proc(12, mib=1000)]
    findings = judge(procs, {10: "l-a", 11: "l-a", 12: "l-a"}, leases)
    assert reasons(findings) == [("over_memory", 10)], "stopping one of the two fits the rest"
    assert findings[0].used_memory_mib == 11000


def test_to_stop_for_memory_stops_nothing_that_fits_and_ignores_unknown_readings() -> None:
    assert to_stop_for_memory([proc(1, mib=4096), proc(2, mib=4096)], 8192) == []
    assert to_stop_for_memory([proc(1, mib=None), proc(2, mib=100)], 50) == [proc(2, mib=100)]
    assert [p.pid for p in to_stop_for_memory([proc(1, mib=9), proc(2, mib=9)], 0)] == [1, 2]


def test_leases_on_one_gpu_are_judged_apart() -> None:
    leases = {"l-a": lease(piece(memory=1024)), "l-b": lease(piece(memory=4096))}
    findings = judge([proc(10, mib=3000), proc(20, mib=3000)], {10: "l-a", 20: "l-b"}, leases)
    assert reasons(findings) == [("over_memory", 10)]


def test_a_process_on_a_gpu_its_lease_does_not_hold_is_to_be_stopped() -> None:
    leases = {"l-a": lease(piece(G0))}
    findings = judge([proc(10, G0), proc(10, G1)], {10: "l-a"}, leases)
    assert reasons(findings) == [("foreign_gpu", 10)]
    assert findings[0].process.gpu_uuid == G1
    assert findings[0].reason.stops


def test_a_process_of_no_lease_and_one_of_an_ended_lease_are_to_be_stopped() -> None:
    leases = {"l-a": lease(piece())}
    findings = judge([proc(10), proc(11)], {10: None, 11: "l-gone"}, leases)
    assert reasons(findings) == [("no_lease", 10), ("no_lease", 11)]
    assert "ended" in next(f.detail for f in findings if f.process.pid == 11)


def test_a_whole_gpu_has_no_memory_limit_below_the_gpus_own() -> None:
    leases = {"l-p": lease(piece(compute=100, memory=81920, whole=True))}
    assert judge([proc(10, mib=90000, sm=100.0)], {10: "l-p"}, leases) == []


def test_compute_over_the_share_is_reported_not_stopped() -> None:
    leases = {"l-a": lease(piece(compute=30))}
    findings = judge([proc(10, sm=35.0), proc(11, sm=30.0)], {10: "l-a", 11: "l-a"}, leases)
    assert reasons(findings) == [("compute_over_share", 10)]
    (finding,) = findings
    assert not finding.reason.stops
    assert (finding.compute_pct, finding.share_pct) == (65.0, 30)


def test_compute_within_the_tolerance_or_unmeasured_is_not_reported() -> None:
    leases = {"l-a": lease(piece(compute=30))}
    assert judge([proc(10, sm=39.0)], {10: "l-a"}, leases) == []
    assert judge([proc(10, sm=None)], {10: "l-a"}, leases) == []


def test_raised_mps_variables_are_named() -> None:
    the_lease = lease(piece(G0, compute=30, memory=8192))
    said = raised_limits(
        {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=80G",
            "CUDA_VISIBLE_DEVICES": f"{G0},{G1}",
        },
        the_lease,
        G0,
    )
    assert said == [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 (share 30)",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT up to 81920 MiB (lease 8192 MiB)",
        f"CUDA_VISIBLE_DEVICES names {G1}",
    ]


def test_the_lease_own_variables_raise_nothing() -> None:
    the_lease = lease(piece(G0, compute=30, memory=8192))
    environ = {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M",
        "CUDA_VISIBLE_DEVICES": G0,
    }
    assert raised_limits(environ, the_lease, G0) == []
    unset = {k: v for k, v in environ.items() if k != "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"}
    assert raised_limits(unset, the_lease, G0) == ["no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]


def test_hostile_mps_variables_are_unreadable_not_errors() -> None:
    the_lease = lease(piece(G0))
    said = raised_limits(
        {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "9" * 400,
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=-1G",
        },
        the_lease,
        G0,
    )
    assert said == [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE unreadable",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT unreadable",
    ]


def test_pinned_limits_are_read_in_mps_syntax() -> None:
    assert pinned_limits_mib("0=8192M") == [8192]
    assert pinned_limits_mib("0=2G, 1=512M") == [2048, 512]
    assert pinned_limits_mib("0=1048576K") == [1024]
    assert pinned_limits_mib("0=x") is None
    assert pinned_limits_mib("0=" + "9" * 30 + "G") is None


def test_every_reason_that_stops_is_a_limit_and_compute_only_reports() -> None:
    assert {r for r in Reason if r.stops} == {
        Reason.OVER_MEMORY,
        Reason.FOREIGN_GPU,
        Reason.NO_LEASE,
    }
