"""Allocate names the lease's GPUs as device nodes (found through the driver's /proc) and as
CDI devices (nvidia.com/gpu=<uuid|index>), over the kubelet's real gRPC protocol."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import grpc
import pytest
from test_devices import claim, lease, piece

from gpupool.k8s.devicenodes import DeviceNodeFinder, DeviceNodes, discover, parse_information
from gpupool.k8s.deviceplugin.server import DeviceList, DevicePluginService
from gpupool.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from gpupool.k8s.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpupool.k8s.devices import AllocationRefused, CdiNaming, GpuView, NodeView, allocation
from gpupool.k8s.resources import ResourceKind
from gpupool.protocol.v1.k8s import ClaimOut

UUID_A = "GPU-fef8089b-4820-abfc-e83e-94318197576e"
UUID_B = "GPU-0c3e6f2a-7d4b-4e1a-9b2c-1f5d8e7a6b90"


def information(uuid: str, minor: int, bus: str) -> str:
    """As the NVIDIA driver writes /proc/driver/nvidia/gpus/<bus>/information."""
    return (
        "Model: \t\t NVIDIA H200\nIRQ:   \t\t 0\n"
        f"GPU UUID: \t {uuid}\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\n"
        f"DMA Size: \t 52 bits\nBus Location: \t {bus}\nDevice Minor: \t {minor}\n"
        "GPU Excluded:\t No\n"
    )


def host(tmp_path: Path, gpus: dict[str, int]) -> tuple[Path, Path]:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    dev.mkdir()
    for n, (uuid, minor) in enumerate(gpus.items()):
        bus = f"0000:{0x18 + n:02x}:00.0"
        (proc / bus).mkdir(parents=True)
        (proc / bus / "information").write_text(information(uuid, minor, bus))
        (dev / f"nvidia{minor}").touch()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        (dev / name).touch()
    return proc, dev


def test_the_drivers_proc_files_give_each_gpu_its_minor(tmp_path: Path) -> None:
    assert parse_information(information(UUID_A, 3, "0000:18:00.0")) == (UUID_A, 3)
    assert parse_information("Model: x\nDevice Minor: 1\n") is None
    proc, dev = host(tmp_path, {UUID_A: 3, UUID_B: 0})
    nodes = discover(proc, dev)
    assert nodes.minors == {UUID_A: 3, UUID_B: 0}
    assert nodes.control == (f"{dev}/nvidiactl", f"{dev}/nvidia-uvm", f"{dev}/nvidia-uvm-tools")
    (dev / "nvidia0").unlink()  # listed by the driver, but no node: not offered
    assert discover(proc, dev).minors == {UUID_A: 3}
    assert discover(tmp_path / "absent", dev) == DeviceNodes(control=nodes.control, dev=str(dev))


def test_the_finder_reads_the_host_again_only_for_a_gpu_it_has_not_seen(tmp_path: Path) -> None:
    proc, dev = host(tmp_path, {UUID_A: 3})
    finder = DeviceNodeFinder(proc, dev)
    assert finder.nodes_for([UUID_A]).minors == {UUID_A: 3}
    (proc / "0000:18:00.0" / "information").unlink()
    assert finder.nodes_for([UUID_A]).minors == {UUID_A: 3}  # cached
    bus = proc / "0000:3b:00.0"
    bus.mkdir()
    (bus / "information").write_text(information(UUID_B, 1, "0000:3b:00.0"))
    (dev / "nvidia1").touch()
    assert finder.nodes_for([UUID_A, UUID_B]).minors == {UUID_B: 1}


def _whole(*uuids: str) -> ClaimOut:
    return claim(lease(*(piece(u, 100, 81920, True) for u in uuids), physical=True))


def test_a_container_gets_its_gpus_nodes_and_no_others() -> None:
    nodes = DeviceNodes(
        minors={UUID_A: 3, UUID_B: 0}, control=("/dev/nvidiactl", "/dev/nvidia-uvm")
    )
    node = NodeView(
        gpus=(GpuView(UUID_A, 0, "physical"), GpuView(UUID_B, 1, "physical")), device_nodes=nodes
    )
    given = allocation(_whole(UUID_A), node, [UUID_A])
    assert given.devices == [
        ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),
        ("/dev/nvidia3", "/dev/nvidia3", "rw"),  # its minor, not its index
    ]
    assert given.cdi_devices == []
    unknown = NodeView(gpus=node.gpus, device_nodes=DeviceNodes(minors={UUID_B: 0}))
    with pytest.raises(AllocationRefused, match=f"no device node of GPU {UUID_A}"):
        allocation(_whole(UUID_A), unknown, [UUID_A])
    assert allocation(_whole(UUID_A), NodeView(gpus=node.gpus), [UUID_A]).devices == []


def test_cdi_names_follow_the_nodes_spec_naming() -> None:
    gpus = (GpuView(UUID_A, 0, "physical"), GpuView(UUID_B, 1, "physical"))
    by_uuid = allocation(_whole(UUID_B, UUID_A), NodeView(gpus=gpus, cdi=CdiNaming()), [])
    assert by_uuid.cdi_devices == [f"nvidia.com/gpu={UUID_B}", f"nvidia.com/gpu={UUID_A}"]
    by_index = NodeView(gpus=gpus, cdi=CdiNaming("index"))
    assert allocation(_whole(UUID_B), by_index, []).cdi_devices == ["nvidia.com/gpu=1"]
    with pytest.raises(ValueError, match="uuid or index"):
        CdiNaming("type-index")
    with pytest.raises(ValueError, match=r"vendor\.tld/class"):
        CdiNaming(kind="gpu")


class OneClaim:
    def __init__(self, given: ClaimOut) -> None:
        self.given = given

    async def allocate(self, kind: ResourceKind, devices: int, *_: object) -> ClaimOut:
        return self.given

    async def pending(self) -> ClaimOut | None:
        return self.given


def test_allocate_sends_device_specs_and_cdi_devices_over_grpc() -> None:
    node = NodeView(
        gpus=(GpuView(UUID_A, 0, "physical"),),
        device_nodes=DeviceNodes(minors={UUID_A: 2}, control=("/dev/nvidiactl",)),
        cdi=CdiNaming(),
    )
    socket = Path(tempfile.mkdtemp(prefix="dp-")) / "gpupool-gpu.sock"

    async def run() -> pb.AllocateResponse:
        server = grpc.aio.server()
        service = DevicePluginService("gpu", DeviceList(), lambda: node, OneClaim(_whole(UUID_A)), None)
        pb_grpc.add_DevicePluginServicer_to_server(service, server)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
                request = pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=[UUID_A])]
                )
                answer: pb.AllocateResponse = await pb_grpc.DevicePluginStub(channel).Allocate(
                    request
                )
                return answer
        finally:
            await server.stop(None)

    try:
        (response,) = asyncio.run(run()).container_responses
    finally:
        socket.unlink(missing_ok=True)
        socket.parent.rmdir()
    assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
        ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
        ("/dev/nvidia2", "/dev/nvidia2", "rw"),
    ]
    assert [d.name for d in response.cdi_devices] == [f"nvidia.com/gpu={UUID_A}"]
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == UUID_A
