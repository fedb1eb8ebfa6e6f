"""What `gpupool run` hands its command: GPUs in lease order, MPS limits, and its exit status."""

from __future__ import annotations

import socket
from datetime import UTC, datetime
from pathlib import Path

from gpupool.cli.run import child_env, exit_status, lease_env, unenforced_warning
from gpupool.protocol.v1.api import GpuOut, LeaseOut, SliceOut

NOW = datetime(2026, 1, 1, tzinfo=UTC)
URL = "http://127.0.0.1:8900"


def lease(slices: list[SliceOut], physical: bool = False) -> LeaseOut:
    return LeaseOut(
        id="l-1",
        tenant="default",
        state="granted",
        gpus=len(slices),
        compute_pct=None if physical else slices[0].compute_pct,
        memory_mib=None if physical else slices[0].memory_mib,
        physical=physical,
        priority=0,
        access="direct",
        holder="me",
        ttl_s=30,
        created_at=NOW,
        granted_at=NOW,
        released_at=None,
        last_heartbeat_at=NOW,
        release_reason=None,
        slices=slices,
    )


def piece(
    uuid: str, index: int, compute: int = 30, memory: int = 8192, whole: bool = False
) -> SliceOut:
    return SliceOut(
        gpu_uuid=uuid,
        node="n",
        gpu_index=index,
        compute_pct=compute,
        memory_mib=memory,
        whole=whole,
    )


def gpu(uuid: str, simulated: bool) -> GpuOut:
    return GpuOut(
        uuid=uuid,
        node="n",
        index=0,
        model="H100",
        memory_mib=81920,
        mode="virtual",
        target_mode=None,
        healthy=True,
        simulated=simulated,
        pci_bus_id=None,
        compute_granted_pct=0,
        memory_granted_mib=0,
        leases=[],
    )


def test_slices_get_visible_devices_in_lease_order_and_mps_limits_per_index() -> None:
    held = lease([piece("GPU-b", 1), piece("GPU-a", 0)])
    env = lease_env(held, [gpu("GPU-b", False), gpu("GPU-a", False)], URL)
    assert env == {
        "CUDA_VISIBLE_DEVICES": "GPU-b,GPU-a",
        "GPUPOOL_LEASE_ID": "l-1",
        "GPUPOOL_URL": URL,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M,1=8192M",
    }


def test_whole_gpus_get_no_mps_limits() -> None:
    held = lease([piece("GPU-a", 0, 100, 81920, whole=True)], physical=True)
    env = lease_env(held, [gpu("GPU-a", False)], URL)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env


def test_simulated_gpu_is_announced() -> None:
    env = lease_env(lease([piece("GPU-a", 0)]), [gpu("GPU-a", True)], URL)
    assert env["GPUPOOL_SIMULATED"] == "1"


def test_outer_lease_variables_do_not_leak_into_the_command() -> None:
    outer = {
        "PATH": "/bin",
        "GPUPOOL_SIMULATED": "1",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10",
        "CUDA_VISIBLE_DEVICES": "GPU-old",
    }
    inner = lease_env(
        lease([piece("GPU-a", 0, 100, 81920, whole=True)], physical=True),
        [gpu("GPU-a", False)],
        URL,
    )
    env = child_env(outer, inner)
    assert env["PATH"] == "/bin"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert "GPUPOOL_SIMULATED" not in env
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_exit_status_follows_the_shell_convention() -> None:
    assert exit_status(0) == 0
    assert exit_status(3) == 3
    assert exit_status(-15) == 143
    assert exit_status(-9) == 137


def test_slice_reaches_its_gpus_mps_daemon_through_its_pipe_directory(tmp_path: Path) -> None:
    pipe = tmp_path / "mps" / "GPU-a" / "pipe"
    pipe.mkdir(parents=True)
    with_mps = gpu("GPU-a", False).model_copy(update={"telemetry": {"mps_pipe_dir": str(pipe)}})
    held = lease([piece("GPU-a", 0)])
    env = lease_env(held, [with_mps], URL)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(pipe.parent / "log")
    warning = unenforced_warning(held, [with_mps], env)
    assert warning is not None and "cannot be reached" in warning, "no daemon's socket there"
    with socket.socket(socket.AF_UNIX) as daemon:
        daemon.bind(str(pipe / "control"))
        assert unenforced_warning(held, [with_mps], env) is None


def test_slice_on_a_real_gpu_without_mps_is_warned_about() -> None:
    held = lease([piece("GPU-a", 0)])
    env = lease_env(held, [gpu("GPU-a", False)], URL)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env
    warning = unenforced_warning(held, [gpu("GPU-a", False)], env)
    assert warning is not None and "not enforced" in warning


def test_outer_mps_pipe_directory_does_not_leak_into_a_physical_lease() -> None:
    outer = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/other-mps", "CUDA_MPS_LOG_DIRECTORY": "/tmp/x"}
    inner = lease_env(
        lease([piece("GPU-a", 0, 100, 81920, whole=True)], physical=True),
        [gpu("GPU-a", False)],
        URL,
    )
    env = child_env(outer, inner)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env and "CUDA_MPS_LOG_DIRECTORY" not in env


def test_a_long_command_names_its_lease_by_its_start() -> None:
    """`gpupool run` names the lease after its command; the controller keeps 256 characters,
    so a long `python -c` program is cut there, never refused (a --holder given by hand is)."""
    from gpupool.cli.leases import HOLDER_MAX
    from gpupool.cli.run import _holder

    long = "me@host pid 1: python -c " + "x" * 1000
    assert len(_holder(long)) == HOLDER_MAX and _holder(long).startswith("me@host pid 1: python")
    assert _holder("me@host pid 1: true") == "me@host pid 1: true"
