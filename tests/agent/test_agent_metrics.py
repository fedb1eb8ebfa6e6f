"""The agent's /metrics: dcgm-exporter's names and labels per GPU, health counters, leases."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.exceptions import StarletteDeprecationWarning

from gpupool.agent import metrics
from gpupool.agent.api import create_agent_app
from gpupool.agent.backends import FakeBackend
from gpupool.agent.service import Agent, AgentSettings
from gpupool.protocol.v1.api import GpuDesired

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

Samples = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    backend = FakeBackend.from_spec("2xH100-80GB", node_name="sim-a")
    settings = AgentSettings(
        controller_url="http://127.0.0.1:9",
        data_dir=tmp_path,
        node_name="sim-a",
        fake_spec="2xH100-80GB",
    )
    return Agent(settings, backend=backend)


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    hits = [v for lab, v in samples[name] if all(lab.get(k) == want for k, want in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def test_gpus_are_exported_under_dcgm_exporter_names_and_labels(agent: Agent) -> None:
    backend = agent.backend
    assert isinstance(backend, FakeBackend)
    backend.set_utilization(0, 87.5)
    backend.set_memory_used(0, 30000)
    samples = parse(metrics.exposition(agent.metrics_view()).decode())
    uuid0 = "GPU-sim-sim-a-0"
    assert value(samples, "DCGM_FI_DEV_GPU_UTIL", UUID=uuid0) == 87.5
    assert value(samples, "DCGM_FI_DEV_FB_USED", UUID=uuid0) == 30000
    assert value(samples, "DCGM_FI_DEV_FB_FREE", UUID=uuid0) == 81920 - 30000
    assert value(samples, "DCGM_FI_DEV_FB_TOTAL", UUID=uuid0) == 81920
    assert value(samples, "DCGM_FI_DEV_GPU_TEMP", UUID=uuid0) > 32
    assert value(samples, "DCGM_FI_DEV_POWER_USAGE", UUID=uuid0) > 60
    assert value(samples, "DCGM_FI_DEV_XID_ERRORS", UUID=uuid0) == 0
    assert value(samples, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", UUID=uuid0) == 0
    labels = next(lab for lab, _ in samples["DCGM_FI_DEV_GPU_UTIL"] if lab["UUID"] == uuid0)
    assert labels == {
        "gpu": "0",
        "UUID": uuid0,
        "pci_bus_id": "00000000:10:00.0",
        "device": "nvidia0",
        "modelName": "NVIDIA H100-80GB (simulated)",
        "Hostname": "sim-a",
    }
    assert len(samples["DCGM_FI_DEV_GPU_UTIL"]) == 2
    assert value(samples, "gpupool_agent_info", Hostname="sim-a") == 1


def test_xid_errors_are_counted_per_code_and_the_last_one_kept(agent: Agent) -> None:
    backend = agent.backend
    assert isinstance(backend, FakeBackend)
    for code in (48, 48, 79):
        agent.health_counts.observe(backend.inject_xid(1, code))
    agent.health_counts.observe(backend.inject_ecc(1))
    samples = parse(metrics.exposition(agent.metrics_view()).decode())
    uuid1 = "GPU-sim-sim-a-1"
    assert value(samples, "gpupool_gpu_xid_errors_total", UUID=uuid1, xid="48") == 2
    assert value(samples, "gpupool_gpu_xid_errors_total", UUID=uuid1, xid="79") == 1
    assert value(samples, "gpupool_gpu_xid_errors_total", UUID="GPU-sim-sim-a-0", xid="none") == 0
    assert value(samples, "DCGM_FI_DEV_XID_ERRORS", UUID=uuid1) == 79
    assert (
        value(samples, "gpupool_gpu_health_events_total", UUID=uuid1, kind="ecc_uncorrected") == 1
    )
    assert value(samples, "gpupool_gpu_health_events_total", UUID=uuid1, kind="lost") == 1
    # The heartbeat carries the same counts to the controller, which judges the Xid alert.
    body, _ = agent._heartbeat_body(backend)
    sent = {t.uuid: t for t in body.telemetry}
    assert (sent[uuid1].xid_errors, sent[uuid1].xid_last) == (3, 79)
    assert (sent["GPU-sim-sim-a-0"].xid_errors, sent["GPU-sim-sim-a-0"].xid_last) == (0, None)


def test_leases_and_modes_come_from_the_controllers_reply(agent: Agent) -> None:
    backend = agent.backend
    assert isinstance(backend, FakeBackend)
    backend.set_utilization(0, 40.0)
    backend.set_memory_used(0, 2048)
    agent.desired = {
        "GPU-sim-sim-a-0": GpuDesired(mode="virtual", target_mode=None, leases=["l-solo"]),
        "GPU-sim-sim-a-1": GpuDesired(
            mode="draining", target_mode="physical", leases=["l-a", "l-b"]
        ),
    }
    samples = parse(metrics.exposition(agent.metrics_view()).decode())
    assert value(samples, "gpupool_gpu_mode", UUID="GPU-sim-sim-a-1", mode="draining") == 1
    assert value(samples, "gpupool_gpu_mode", UUID="GPU-sim-sim-a-1", mode="virtual") == 0
    held = {(lab["lease"], lab["UUID"]) for lab, _ in samples["gpupool_lease_gpu"]}
    assert held == {
        ("l-solo", "GPU-sim-sim-a-0"),
        ("l-a", "GPU-sim-sim-a-1"),
        ("l-b", "GPU-sim-sim-a-1"),
    }
    # A GPU with one lease: its readings are that lease's; shared GPUs are not split by guess.
    assert value(samples, "gpupool_lease_gpu_utilization_percent", lease="l-solo") == 40.0
    assert value(samples, "gpupool_lease_gpu_memory_used_bytes", lease="l-solo") == 2048 * 1024**2
    assert [lab["lease"] for lab, _ in samples["gpupool_lease_gpu_utilization_percent"]] == [
        "l-solo"
    ]


def test_agent_api_serves_metrics(agent: Agent) -> None:
    with TestClient(create_agent_app(agent)) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert {
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_XID_ERRORS",
    } <= names


def test_the_direct_watch_is_exported() -> None:
    from gpupool.agent.metrics import AgentView, HealthCounts, exposition

    view = AgentView(
        node="n",
        backend="fake",
        simulated=True,
        registered=True,
        controller_reachable=True,
        heartbeats_sent=1,
        mps_daemons=0,
        inventory=[],
        telemetry=[],
        desired={},
        health=HealthCounts(),
        direct_stopped={"over_memory": 2},
        direct_reported={"compute_over_share": 1},
        direct_usage={("l-a", "GPU-0"): (512, 42.0), ("l-b", "GPU-0"): (10, None)},
        direct_attached=3,
    )
    text = exposition(view).decode()
    assert 'gpupool_direct_processes_stopped_total{reason="over_memory"} 2.0' in text
    assert 'gpupool_direct_processes_stopped_total{reason="no_lease"} 0.0' in text
    assert 'gpupool_direct_reports_total{reason="compute_over_share"} 1.0' in text
    assert 'gpupool_direct_lease_memory_used_bytes{UUID="GPU-0",lease="l-a"}' in text
    assert 'gpupool_direct_lease_sm_percent{UUID="GPU-0",lease="l-a"} 42.0' in text
    assert 'lease="l-b"} ' not in text.split("gpupool_direct_lease_sm_percent")[-1]
    assert "gpupool_direct_attached_processes 3.0" in text
