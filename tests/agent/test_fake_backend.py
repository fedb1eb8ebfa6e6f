"""The simulated backend: reading specs, telemetry that follows its settings, injected faults."""

from __future__ import annotations

import threading
import time

import pytest

from gpupool.agent.backends import Backend, FakeBackend, parse_spec
from tests.timing import scaled


def test_spec_of_one_model_gives_that_many_gpus_with_binary_memory() -> None:
    backend = FakeBackend.from_spec("4xH100-80GB", node_name="n1")
    gpus = backend.inventory()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert [g.uuid for g in gpus] == [f"GPU-sim-n1-{i}" for i in range(4)]
    assert {g.memory_mib for g in gpus} == {81920}
    assert all(g.simulated and g.model.endswith(" (simulated)") for g in gpus)
    assert "H100" in gpus[0].model


def test_spec_of_mixed_models_numbers_gpus_across_items() -> None:
    gpus = FakeBackend.from_spec("2xA100-40GB, 1xH100-80GB", node_name="n").inventory()
    assert [(g.index, g.memory_mib) for g in gpus] == [(0, 40960), (1, 40960), (2, 81920)]
    assert "A100" in gpus[0].model and "H100" in gpus[2].model
    assert len({g.uuid for g in gpus}) == 3
    assert len({g.pci_bus_id for g in gpus}) == 3


def test_spec_of_one_small_gpu() -> None:
    (gpu,) = FakeBackend.from_spec("1xL4-24GB", node_name="edge").inventory()
    assert gpu.memory_mib == 24 * 1024
    assert gpu.uuid == "GPU-sim-edge-0"


def test_spec_is_case_insensitive_in_its_letters() -> None:
    assert parse_spec("2XH100-80gb") == parse_spec("2xH100-80GB")


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("", "empty item"),
        ("4xH100-80GB,", "empty item"),
        ("H100-80GB", "cannot read"),
        ("4xH100", "cannot read"),
        ("4xH100-80", "cannot read"),
        ("4xH100-80TB", "cannot read"),
        ("-1xH100-80GB", "cannot read"),
        ("0xH100-80GB", "count must be"),
        ("65xH100-80GB", "count must be"),
        ("1xH100-0GB", "memory must be"),
        ("40xH100-80GB,40xA100-40GB", "at most 64"),
    ],
)
def test_bad_spec_is_refused_with_a_one_line_reason(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as caught:
        FakeBackend.from_spec(spec, node_name="n")
    assert "\n" not in str(caught.value)


def test_fake_backend_is_a_backend() -> None:
    backend: Backend = FakeBackend.from_spec("1xL4-24GB", node_name="n")
    assert backend.simulated and backend.name == "fake"
    assert backend.driver_version() == "simulated"


def test_telemetry_follows_the_set_utilisation_and_memory() -> None:
    backend = FakeBackend.from_spec("2xH100-80GB", node_name="n")
    backend.set_utilization(1, 75.0)
    backend.set_memory_used(1, 20480)
    backend.set_processes(1, [{"pid": 4242, "used_memory_mib": 20000}])
    idle, busy = backend.telemetry()
    assert idle.utilization_pct == 0.0 and idle.memory_used_mib == 0
    assert busy.utilization_pct == 75.0 and busy.memory_used_mib == 20480
    assert busy.processes == [{"pid": 4242, "used_memory_mib": 20000}]
    assert busy.power_w is not None and idle.power_w is not None and busy.power_w > idle.power_w
    assert busy.temperature_c is not None and idle.temperature_c is not None
    assert busy.temperature_c > idle.temperature_c
    assert backend.telemetry() == [idle, busy]  # the same settings read the same


def test_settings_out_of_range_are_refused() -> None:
    backend = FakeBackend.from_spec("1xL4-24GB", node_name="n")
    with pytest.raises(ValueError):
        backend.set_utilization(0, 101)
    with pytest.raises(ValueError):
        backend.set_memory_used(0, 24 * 1024 + 1)
    with pytest.raises(IndexError, match="no simulated GPU 3"):
        backend.inject_ecc(3)


def test_injected_xid_becomes_an_event_once() -> None:
    backend = FakeBackend.from_spec("2xH100-80GB", node_name="n")
    backend.inject_xid(1, 43)
    (event,) = backend.poll_events(0)
    assert (event.gpu_uuid, event.kind, event.value) == ("GPU-sim-n-1", "xid", 43)
    assert "Xid 43" in event.message and "stopped processing" in event.message
    assert backend.poll_events(0) == []


def test_xid_79_means_the_gpu_is_lost() -> None:
    backend = FakeBackend.from_spec("1xH100-80GB", node_name="n")
    backend.inject_xid(0, 79)
    (event,) = backend.poll_events(0)
    assert event.kind == "lost" and "fallen off the bus" in event.message
    assert backend.telemetry()[0].utilization_pct is None


def test_injected_ecc_errors_count_up_in_telemetry() -> None:
    backend = FakeBackend.from_spec("1xA100-40GB", node_name="n")
    backend.inject_ecc(0)
    backend.inject_ecc(0)
    events = backend.poll_events(0)
    assert [(e.kind, e.value) for e in events] == [("ecc_uncorrected", 1), ("ecc_uncorrected", 2)]
    assert backend.telemetry()[0].ecc_uncorrected == 2


def test_overheat_shows_in_telemetry_until_cleared() -> None:
    backend = FakeBackend.from_spec("1xL4-24GB", node_name="n")
    backend.inject_overheat(0, 95.0)
    (event,) = backend.poll_events(0)
    assert (event.kind, event.value) == ("temperature", 95.0)
    assert backend.telemetry()[0].temperature_c == 95.0
    backend.clear_faults(0)
    assert backend.telemetry()[0].temperature_c != 95.0


def test_lost_gpu_reports_no_readings_but_stays_in_inventory() -> None:
    backend = FakeBackend.from_spec("2xL4-24GB", node_name="n")
    backend.set_utilization(0, 50)
    backend.inject_lost(0)
    (event,) = backend.poll_events(0)
    assert (event.gpu_uuid, event.kind) == ("GPU-sim-n-0", "lost")
    lost, fine = backend.telemetry()
    assert lost.model_dump(exclude_none=True) == {"uuid": "GPU-sim-n-0", "processes": []}
    assert fine.utilization_pct == 0.0
    assert len(backend.inventory()) == 2
    backend.clear_faults(0)
    assert backend.telemetry()[0].utilization_pct == 50


def test_poll_events_wakes_up_when_a_fault_is_injected() -> None:
    backend = FakeBackend.from_spec("1xL4-24GB", node_name="n")
    timer = threading.Timer(0.05, backend.inject_ecc, args=(0,))
    started = time.monotonic()
    timer.start()
    try:
        events = backend.poll_events(10_000)
    finally:
        timer.cancel()
    assert [e.kind for e in events] == ["ecc_uncorrected"]
    assert time.monotonic() - started < scaled(5.0)
