"""The device plugin against a fake kubelet speaking the real gRPC protocol, with a real
controller and agent behind it."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from k8s_node import K8sNode

from gpupool.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from gpupool.protocol.v1.api import LeaseCreate
from gpupool.protocol.v1.k8s import ClaimCreate
from tests.timing import scaled

VGPU = "gpupool.io/vgpu"
GPU = "gpupool.io/gpu"
GPU0 = "GPU-sim-k8s-node-1-0"
GPU1 = "GPU-sim-k8s-node-1-1"

pytestmark = pytest.mark.slow


def healthy(devices: dict[str, str]) -> set[str]:
    return {d for d, h in devices.items() if h == "Healthy"}


def test_plugin_registers_both_resources_and_lists_virtual_gpus_as_slots(k8s_node: K8sNode) -> None:
    kubelet = k8s_node.kubelet
    vgpu = kubelet.plugin(VGPU)
    gpu = kubelet.plugin(GPU)
    assert vgpu.request.version == "v1beta1"
    assert vgpu.request.endpoint == "gpupool-vgpu.sock"
    assert gpu.request.endpoint == "gpupool-gpu.sock"
    assert vgpu.request.options.get_preferred_allocation_available
    devices = kubelet.devices(VGPU, lambda d: len(d) == 8)
    assert healthy(devices) == {f"{g}-slot{k}" for g in (GPU0, GPU1) for k in range(4)}
    assert kubelet.devices(GPU, lambda d: True) == {}
    options = vgpu.stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
    assert options.get_preferred_allocation_available and not options.pre_start_required


def test_list_and_watch_follows_mode_switch_and_isolation(k8s_node: K8sNode) -> None:
    kubelet = k8s_node.kubelet
    kubelet.devices(VGPU, lambda d: len(healthy(d)) == 8)
    k8s_node.cli("gpu", "mode", GPU0, "physical", "--wait")
    devices = kubelet.devices(VGPU, lambda d: len(d) == 4)
    assert all(d.startswith(GPU1) for d in devices)
    assert kubelet.devices(GPU, lambda d: bool(d)) == {GPU0: "Healthy"}

    k8s_node.cli("gpu", "isolate", GPU1, "--reason", "test fault")
    devices = kubelet.devices(VGPU, lambda d: bool(d) and not healthy(d))
    assert set(devices) == {f"{GPU1}-slot{k}" for k in range(4)}
    k8s_node.cli("gpu", "clear", GPU1)
    kubelet.devices(VGPU, lambda d: len(healthy(d)) == 4)


def test_allocate_gives_the_container_the_claimed_lease(k8s_node: K8sNode) -> None:
    kubelet = k8s_node.kubelet
    vgpu = kubelet.plugin(VGPU)
    devices = kubelet.devices(VGPU, lambda d: len(healthy(d)) == 8)

    # No claim waits on the node: a pod that bypassed the gpupool scheduler gets nothing.
    with pytest.raises(grpc.RpcError) as refused:
        vgpu.stub.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{GPU0}-slot0"])]
            ),
            timeout=10,
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no claim is waiting on node k8s-node-1" in (refused.value.details() or "")

    # Fill GPU0 a little so the pool's placement picks a definite GPU for the claim.
    claim = k8s_node.client.create_claim(
        ClaimCreate(
            claim="c-0123456789abcdef",
            node=k8s_node.node,
            pod="default/notebook",
            request=LeaseCreate(compute_pct=25, memory="8GiB"),
        )
    )
    assert claim.state == "bound"
    claimed_gpu = claim.lease.slices[0].gpu_uuid

    preferred = vgpu.stub.GetPreferredAllocation(
        pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=sorted(devices), allocation_size=1
                )
            ]
        ),
        timeout=10,
    )
    chosen = list(preferred.container_responses[0].deviceIDs)
    assert len(chosen) == 1 and chosen[0].startswith(claimed_gpu + "-slot")

    answer = vgpu.stub.Allocate(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)]),
        timeout=10,
    )
    envs = dict(answer.container_responses[0].envs)
    assert envs["GPUPOOL_ALLOCATED_CLAIM"] == "c-0123456789abcdef"
    assert envs["GPUPOOL_LEASE"] == claim.lease.id
    assert envs["CUDA_VISIBLE_DEVICES"] == claimed_gpu
    assert envs["NVIDIA_VISIBLE_DEVICES"] == claimed_gpu
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert envs["GPUPOOL_SIMULATED"] == "1"
    after = k8s_node.client.claim("c-0123456789abcdef")
    assert after.state == "allocated"
    assert after.lease.state == "active"

    # The claim is taken: a second container asking the same gets nothing.
    with pytest.raises(grpc.RpcError):
        vgpu.stub.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[chosen[0]])]
            ),
            timeout=10,
        )


def test_physical_claim_gets_whole_gpu_without_mps(k8s_node: K8sNode) -> None:
    kubelet = k8s_node.kubelet
    k8s_node.cli("gpu", "mode", GPU1, "physical", "--wait")
    gpu = kubelet.plugin(GPU)
    kubelet.devices(GPU, lambda d: d == {GPU1: "Healthy"})
    k8s_node.client.create_claim(
        ClaimCreate(
            claim="c-profiler-000001",
            node=k8s_node.node,
            pod="default/profiler",
            request=LeaseCreate(gpus=1, physical=True),
        )
    )
    answer = gpu.stub.Allocate(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[GPU1])]),
        timeout=10,
    )
    envs = dict(answer.container_responses[0].envs)
    assert envs["CUDA_VISIBLE_DEVICES"] == GPU1
    assert not any(k.startswith("CUDA_MPS") for k in envs)


def test_plugin_registers_again_after_kubelet_restart(k8s_node: K8sNode) -> None:
    kubelet = k8s_node.kubelet
    kubelet.devices(VGPU, lambda d: len(d) == 8)
    before = len(kubelet.registrations)
    kubelet.restart()
    kubelet.wait(
        "both resources to register again", lambda: len(kubelet.registrations) >= before + 2
    )
    assert {r.resource_name for r in kubelet.registrations[before:]} == {VGPU, GPU}
    # The new kubelet dialled the fresh sockets and got the full list again.
    devices = kubelet.devices(VGPU, lambda d: len(d) == 8)
    assert len(healthy(devices)) == 8
    # And the plugin still follows changes on the new stream.
    k8s_node.cli("gpu", "mode", GPU0, "physical", "--wait")
    kubelet.devices(GPU, lambda d: d == {GPU0: "Healthy"})


def test_a_gpu_fault_turns_its_devices_unhealthy_within_seconds(k8s_node: K8sNode) -> None:
    kubelet = k8s_node.kubelet
    kubelet.devices(VGPU, lambda d: len(healthy(d)) == 8)
    agent_url = k8s_node.client.node(k8s_node.node).agent_url
    assert agent_url is not None
    injected = httpx.post(
        f"{agent_url}/agent/v1/faults", json={"index": 1, "kind": "xid", "value": 79}
    )
    assert injected.json()["gpu_uuid"] == GPU1
    started = time.monotonic()
    devices = kubelet.devices(VGPU, lambda d: len(healthy(d)) == 4, timeout_s=10)
    assert time.monotonic() - started < scaled(5)
    assert {d for d, h in devices.items() if h == "Unhealthy"} == {
        f"{GPU1}-slot{k}" for k in range(4)
    }
