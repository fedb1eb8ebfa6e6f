"""The NVML backend, driven by recorded (or handmade) NVML answers instead of a GPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import gpupool.agent.backends as backends
from gpupool.agent.backends.nvml import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NvmlApi,
    NvmlBackend,
    NvmlError,
    ReplayNvml,
    format_cuda_version,
    record_fixture,
)

FIXTURES = Path(__file__).parent / "fixtures"
HANDMADE = FIXTURES / "nvml_h200_handmade.json"
RECORDED = FIXTURES / "nvml_h200.json"
MIB = 1024 * 1024
NVML_READINGS = (
    "utilization_pct",
    "memory_used_mib",
    "temperature_c",
    "power_w",
    "ecc_uncorrected",
    "ecc_corrected",
    "sm_clock_mhz",
    "mem_clock_mhz",
)


def handmade() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(HANDMADE.read_text())
    return data


def backend_of(data: dict[str, Any]) -> NvmlBackend:
    return NvmlBackend(api=ReplayNvml(data))


def with_answer(data: dict[str, Any], key: str, answer: dict[str, Any]) -> dict[str, Any]:
    changed = copy.deepcopy(data)
    changed["calls"][key] = answer
    return changed


def not_supported() -> dict[str, Any]:
    return {"error": NVML_ERROR_NOT_SUPPORTED, "message": "Not Supported"}


# ---- every fixture there is (the recorded one joins once it exists) -------------------------


@pytest.mark.parametrize(
    "path", [p for p in (HANDMADE, RECORDED) if p.exists()], ids=lambda p: p.name
)
def test_fixture_replays_into_a_full_inventory_and_telemetry(path: Path) -> None:
    backend = NvmlBackend(api=ReplayNvml.load(path))
    gpus = backend.inventory()
    assert gpus and [g.index for g in gpus] == list(range(len(gpus)))
    for gpu in gpus:
        assert gpu.uuid.startswith("GPU-") and "H200" in gpu.model
        assert gpu.memory_mib > 140_000 and not gpu.simulated
        assert gpu.pci_bus_id and gpu.mig_mode is not None
    assert backend.driver_version() and (backend.cuda_version() or "").count(".") == 1
    telemetry = backend.telemetry()
    assert [t.uuid for t in telemetry] == [g.uuid for g in gpus]
    for reading in telemetry:
        # Every reading an H200 offers must come through: a None here is a call missing.
        missing = [k for k in NVML_READINGS if getattr(reading, k) is None]
        assert missing == [], f"{path.name}: no {missing}"


# ---- the handmade H200 in detail ---------------------------------------------------------


def test_handmade_fixture_says_it_is_handmade() -> None:
    assert ReplayNvml.load(HANDMADE).source == "handmade"
    assert "HANDMADE" in handmade()["note"]


def test_inventory_of_the_h200() -> None:
    backend = backend_of(handmade())
    first, second = backend.inventory()
    assert first.model == "NVIDIA H200" and first.memory_mib == 143771
    assert first.uuid == "GPU-7c1e3a52-9b0d-4f86-a2d1-5e3f90c4b817"
    assert first.pci_bus_id == "00000000:18:00.0" and second.pci_bus_id == "00000000:2A:00.0"
    assert first.mig_mode is False and second.index == 1
    assert backend.driver_version() == "580.159.04"
    assert backend.cuda_version() == "13.0"
    assert backend.name == "nvml" and not backend.simulated


def test_telemetry_of_the_busy_h200() -> None:
    busy, idle = backend_of(handmade()).telemetry()
    assert busy.utilization_pct == 87.0 and busy.memory_used_mib == 24210
    assert busy.temperature_c == 58.0 and busy.power_w == pytest.approx(512.347)
    assert (busy.ecc_uncorrected, busy.ecc_corrected) == (0, 0)
    assert (busy.sm_clock_mhz, busy.mem_clock_mhz) == (1980, 3201)
    assert busy.processes == [{"pid": 48213, "used_memory_mib": 23664}]
    assert idle.utilization_pct == 0.0 and idle.processes == []


def test_cuda_version_reads_as_major_dot_minor() -> None:
    assert format_cuda_version(13000) == "13.0"
    assert format_cuda_version(12040) == "12.4"
    assert format_cuda_version(11080) == "11.8"


# ---- what a GPU does not offer, and GPUs that fail ----------------------------------------


def test_readings_a_gpu_does_not_offer_are_unknown_not_errors() -> None:
    data = with_answer(handmade(), "ecc_errors:0,uncorrected", not_supported())
    data = with_answer(data, "ecc_errors:0,corrected", not_supported())
    data = with_answer(data, "mig_mode:0", not_supported())
    data = with_answer(data, "power_mw:0", {"error": 999, "message": "Unknown Error"})
    backend = backend_of(data)
    assert backend.inventory()[0].mig_mode is None
    reading = backend.telemetry()[0]
    assert (reading.ecc_uncorrected, reading.ecc_corrected, reading.power_w) == (None, None, None)
    assert reading.utilization_pct == 87.0


def test_mig_enabled_gpu_says_so() -> None:
    data = with_answer(handmade(), "mig_mode:1", {"value": 1})
    assert [g.mig_mode for g in backend_of(data).inventory()] == [False, True]


def test_lost_gpu_gives_one_lost_event_and_no_readings() -> None:
    lost = {"error": NVML_ERROR_GPU_IS_LOST, "message": "GPU is lost"}
    data = with_answer(handmade(), "utilization:1", lost)
    backend = backend_of(data)
    assert backend.telemetry()[1].model_dump(exclude_none=True) == {
        "uuid": "GPU-e04b9f27-31c6-4d7a-8b55-0a2c6e1df369",
        "processes": [],
    }
    backend.telemetry()
    (event,) = backend.poll_events(0)
    assert event.kind == "lost" and event.gpu_uuid.startswith("GPU-e04b9f27")
    assert backend.poll_events(0) == []


def test_reaching_the_slowdown_temperature_raises_one_event() -> None:
    data = with_answer(handmade(), "temperature_c:0", {"value": 88})
    backend = backend_of(data)
    backend.telemetry()
    backend.telemetry()
    (event,) = backend.poll_events(0)
    assert (event.kind, event.value) == ("temperature", 88.0)
    assert "87 C" in event.message


def test_gpu_that_stops_answering_keeps_its_last_known_identity() -> None:
    data = handmade()
    backend = backend_of(data)
    before = backend.inventory()
    assert isinstance(backend.api, ReplayNvml)
    failing = with_answer(data, "name:1", {"error": NVML_ERROR_GPU_IS_LOST, "message": "lost"})
    backend.api = ReplayNvml(failing)
    assert backend.inventory() == before


def test_gpu_that_never_answered_is_left_out_of_the_inventory() -> None:
    data = with_answer(handmade(), "name:1", {"error": 999, "message": "Unknown Error"})
    assert [g.index for g in backend_of(data).inventory()] == [0]


# ---- events ------------------------------------------------------------------------------


def test_xid_and_ecc_events_are_told_apart_and_named_by_gpu() -> None:
    data = handmade()
    data["events"] = [
        {"index": 1, "type": EVENT_XID_CRITICAL, "data": 79},
        {"index": 0, "type": EVENT_DOUBLE_BIT_ECC, "data": 0},
        {"index": 0, "type": EVENT_XID_CRITICAL, "data": 13},
        {"index": 0, "type": 0x4, "data": 0},  # a P-state change: not a health event
    ]
    events = backend_of(data).poll_events(0)
    assert [(e.gpu_uuid[:12], e.kind, e.value) for e in events] == [
        ("GPU-e04b9f27", "lost", 79),
        ("GPU-7c1e3a52", "ecc_uncorrected", 0),
        ("GPU-7c1e3a52", "xid", 13),
    ]


def test_no_events_within_the_wait_is_an_empty_list() -> None:
    assert backend_of(handmade()).poll_events(1) == []


def test_gpus_without_events_are_watched_through_telemetry_only() -> None:
    class NoEvents(ReplayNvml):
        def call(self, method: str, *args: int | str) -> Any:
            if method == "wait_event":
                raise NvmlError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
            return super().call(method, *args)

    backend = NvmlBackend(api=NoEvents(handmade()))
    assert backend.poll_events(0) == []
    assert backend.poll_events(0) == []


# ---- recording ---------------------------------------------------------------------------


def test_recorded_fixture_replays_the_same_answers(tmp_path: Path) -> None:
    original = handmade()
    original["events"] = [{"index": 0, "type": EVENT_XID_CRITICAL, "data": 31}]
    out = tmp_path / "nvml.json"
    fixture = record_fixture(out, api=ReplayNvml(original), event_wait_ms=0)
    assert json.loads(out.read_text()) == fixture
    assert fixture["calls"] == original["calls"]
    assert fixture["events"] == original["events"]
    again = NvmlBackend(api=ReplayNvml.load(out))
    first = backend_of(handmade())
    assert again.inventory() == first.inventory()
    assert again.telemetry() == first.telemetry()


def test_errors_are_recorded_too(tmp_path: Path) -> None:
    data = with_answer(handmade(), "mig_mode:0", not_supported())
    fixture = record_fixture(tmp_path / "f.json", api=ReplayNvml(data), event_wait_ms=0)
    assert isinstance(fixture["calls"], dict)
    assert fixture["calls"]["mig_mode:0"] == not_supported()


def test_a_file_that_is_not_a_fixture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"calls": {}}))
    with pytest.raises(ValueError, match="not a gpupool-nvml-fixture"):
        ReplayNvml.load(path)


# ---- choosing a backend ------------------------------------------------------------------


def test_detect_gives_nothing_when_nvml_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(api: NvmlApi | None = None) -> NvmlBackend:
        raise NvmlError(12, "NVML Shared Library Not Found")

    monkeypatch.setattr(backends, "NvmlBackend", no_library)
    assert backends.detect("n") is None


def test_detect_gives_nothing_when_nvml_sees_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    data = with_answer(handmade(), "device_count:", {"value": 0})
    monkeypatch.setattr(backends, "NvmlBackend", lambda: NvmlBackend(api=ReplayNvml(data)))
    assert backends.detect("n") is None


def test_detect_gives_nvml_when_it_sees_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "NvmlBackend", lambda: NvmlBackend(api=ReplayNvml(handmade())))
    found = backends.detect("n")
    assert found is not None and found.name == "nvml"
