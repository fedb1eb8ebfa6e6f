"""Device lists, preferences and container env, from the agent's view of its GPUs."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpupool.k8s.devices import (
    AllocationRefused,
    GpuView,
    NodeView,
    allocation,
    devices,
    gpu_of,
    preferred,
)
from gpupool.protocol.v1.api import LeaseOut, SliceOut
from gpupool.protocol.v1.k8s import ClaimOut


def view(*gpus: GpuView, simulated: bool = False) -> NodeView:
    return NodeView(gpus=gpus, simulated=simulated)


def test_each_gpu_is_listed_in_the_pool_of_its_mode() -> None:
    node = view(
        GpuView("GPU-a", 0, "virtual"),
        GpuView("GPU-b", 1, "physical"),
        GpuView("GPU-c", 2, "draining", target_mode="physical"),
        GpuView("GPU-d", 3, "draining", target_mode="virtual"),
        GpuView("GPU-e", 4, "isolated"),
    )
    vgpu = {d.id: d.health for d in devices("vgpu", node, 2)}
    assert vgpu == {
        "GPU-a-slot0": "Healthy",
        "GPU-a-slot1": "Healthy",
        "GPU-c-slot0": "Unhealthy",  # leaving the virtual pool: nothing new on it
        "GPU-c-slot1": "Unhealthy",
        "GPU-e-slot0": "Unhealthy",
        "GPU-e-slot1": "Unhealthy",
    }
    gpu = {d.id: d.health for d in devices("gpu", node, 2)}
    assert gpu == {"GPU-b": "Healthy", "GPU-d": "Unhealthy", "GPU-e": "Unhealthy"}


def test_device_ids_map_back_to_their_gpu_and_respect_the_kubelet_limit() -> None:
    assert gpu_of("GPU-fef8089b-4820-abfc-e83e-94318197576e-slot7") == (
        "GPU-fef8089b-4820-abfc-e83e-94318197576e"
    )
    assert gpu_of("GPU-fef8089b-4820-abfc-e83e-94318197576e") == (
        "GPU-fef8089b-4820-abfc-e83e-94318197576e"
    )
    with pytest.raises(ValueError, match="longer than 63"):
        devices("gpu", view(GpuView("GPU-" + "x" * 70, 0, "physical")), 1)


def test_preferred_devices_are_on_the_claims_gpus() -> None:
    available = ["GPU-a-slot0", "GPU-a-slot1", "GPU-b-slot0", "GPU-b-slot1"]
    assert preferred(available, [], 1, ["GPU-b"]) == ["GPU-b-slot0"]
    assert preferred(available, ["GPU-a-slot1"], 2, ["GPU-b"]) == ["GPU-a-slot1", "GPU-b-slot0"]
    assert preferred(available, [], 2, []) == ["GPU-a-slot0", "GPU-a-slot1"]


def lease(*slices: SliceOut, physical: bool = False) -> LeaseOut:
    now = datetime.now(UTC)
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
        holder="k8s-claim:c-1234567890",
        ttl_s=120,
        created_at=now,
        granted_at=now,
        released_at=None,
        last_heartbeat_at=now,
        release_reason=None,
        slices=list(slices),
    )


def claim(lease_: LeaseOut) -> ClaimOut:
    kind = "gpu" if lease_.physical else "vgpu"
    return ClaimOut(claim="c-1234567890", node="n", resource=kind, state="allocated", lease=lease_)


def piece(uuid: str, pct: int = 30, mib: int = 4096, whole: bool = False) -> SliceOut:
    return SliceOut(
        gpu_uuid=uuid, node="n", gpu_index=0, compute_pct=pct, memory_mib=mib, whole=whole
    )


def test_a_slice_gets_its_mps_daemon_and_limits() -> None:
    node = NodeView(
        gpus=(GpuView("GPU-a", 0, "virtual", mps_pipe_dir="/var/lib/gpupool/mps/GPU-a/pipe"),),
        mps_shm_dir="/var/lib/gpupool/shm",
    )
    given = allocation(claim(lease(piece("GPU-a"))), node, ["GPU-a-slot3"])
    assert given.envs["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert given.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpupool/mps/pipe"
    assert given.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert given.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert given.mounts == [
        ("/run/gpupool/mps/pipe", "/var/lib/gpupool/mps/GPU-a/pipe", False),
        ("/run/gpupool/mps/log", "/var/lib/gpupool/mps/GPU-a/log", False),
        ("/dev/shm", "/var/lib/gpupool/shm", False),
    ]


def test_a_slice_on_a_real_gpu_without_mps_is_refused() -> None:
    node = view(GpuView("GPU-a", 0, "virtual"))
    with pytest.raises(AllocationRefused, match="runs no MPS daemon"):
        allocation(claim(lease(piece("GPU-a"))), node, ["GPU-a-slot0"])


def test_whole_gpus_get_no_mps_and_foreign_gpus_are_refused() -> None:
    node = view(GpuView("GPU-a", 0, "physical"), GpuView("GPU-b", 1, "physical"))
    whole = lease(piece("GPU-a", 100, 81920, True), piece("GPU-b", 100, 81920, True), physical=True)
    given = allocation(claim(whole), node, ["GPU-b", "GPU-a"])
    assert given.envs["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert given.mounts == [] and not any(k.startswith("CUDA_MPS") for k in given.envs)
    elsewhere = lease(piece("GPU-z", 100, 81920, True), physical=True)
    with pytest.raises(AllocationRefused, match="this node does not have: GPU-z"):
        allocation(claim(elsewhere), node, ["GPU-a"])
