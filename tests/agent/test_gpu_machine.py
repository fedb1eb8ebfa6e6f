"""On a machine with an NVIDIA GPU: the NVML backend and a real MPS control daemon."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpupool.agent.backends import detect
from gpupool.agent.mps import MpsDaemon

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():  # type: ignore[no-untyped-def]
    found = detect("gpu-test")
    if found is None:
        pytest.skip("no NVIDIA GPU visible through NVML")
    yield found
    found.close()


def test_nvml_inventory_reports_real_gpus(backend) -> None:  # type: ignore[no-untyped-def]
    gpus = backend.inventory()
    assert gpus and all(g.uuid.startswith("GPU-") and g.memory_mib > 1024 for g in gpus)
    assert not any(g.simulated for g in gpus)
    assert backend.driver_version()
    telemetry = backend.telemetry()
    assert {t.uuid for t in telemetry} == {g.uuid for g in gpus}
    assert all(t.temperature_c is not None and t.memory_used_mib is not None for t in telemetry)


def test_real_mps_daemon_starts_and_stops_in_private_directories(backend, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    uuid = backend.inventory()[0].uuid
    daemon = MpsDaemon(uuid, tmp_path / "mps")
    daemon.start()
    try:
        assert daemon.running()
        assert (daemon.pipe_dir / "control").exists()
    finally:
        daemon.stop()
    assert not daemon.running()
