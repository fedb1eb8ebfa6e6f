"""The committed device-plugin modules are what scripts/gen_k8s_proto.sh makes from api.proto,
and api.proto has the kubelet's wire names (service paths, field numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool.k8s.deviceplugin.v1beta1 import api_pb2 as pb

SRC = Path(__file__).resolve().parents[2] / "src"


def test_generated_modules_match_api_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the modules")
    from gpupool.k8s.deviceplugin.generate import PROTO, generate

    for made in generate(SRC, tmp_path):
        committed = SRC / Path(PROTO).parent / made.name
        assert made.read_text() == committed.read_text(), (
            f"{committed} is stale: run scripts/gen_k8s_proto.sh"
        )


def test_wire_names_are_the_kubelets() -> None:
    services = pb.DESCRIPTOR.services_by_name
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert [m.name for m in services["Registration"].methods] == ["Register"]
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    numbers = {
        (message, f.name): f.number
        for message, descriptor in pb.DESCRIPTOR.message_types_by_name.items()
        for f in descriptor.fields
    }
    assert numbers[("RegisterRequest", "resource_name")] == 3
    assert numbers[("DevicePluginOptions", "get_preferred_allocation_available")] == 2
    assert numbers[("Device", "ID")] == 1 and numbers[("Device", "health")] == 2
    assert numbers[("ContainerPreferredAllocationRequest", "allocation_size")] == 3
    assert numbers[("ContainerAllocateResponse", "cdi_devices")] == 5
    assert numbers[("Mount", "read_only")] == 3
