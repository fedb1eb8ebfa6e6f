"""The controller's /metrics: valid exposition format, and numbers that match the pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpupool import __version__
from tests.controller.inprocess import API, TestClient, controller, register


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with controller(tmp_path) as client:
        yield client


def scrape(client: TestClient) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Parse /metrics with Prometheus' own parser: sample name -> labels -> value."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def one(
    metrics: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    return metrics[name][tuple(sorted(labels.items()))]


def test_metrics_parse_and_count_leases_queue_and_grants(client: TestClient) -> None:
    uuids = register(client, gpus=2)
    for _ in range(3):
        assert (
            client.post(f"{API}/leases", json={"compute_pct": 40, "memory": "10GiB"}).status_code
            == 201
        )
    queued = client.post(f"{API}/leases", json={"physical": True}).json()
    assert queued["state"] == "queued"
    client.post(f"{API}/gpus/{uuids[1]}/drain")

    m = scrape(client)
    assert one(m, "gpupool_leases", state="granted") == 3
    assert one(m, "gpupool_leases", state="queued") == 1
    assert one(m, "gpupool_queue_length") == 1
    assert one(m, "gpupool_queue_oldest_wait_seconds") >= 0
    assert one(m, "gpupool_compute_granted_percent") == 120
    assert one(m, "gpupool_memory_granted_bytes") == 3 * 10 * 1024**3
    assert one(m, "gpupool_gpus", mode="virtual") == 1
    assert one(m, "gpupool_gpus", mode="draining") == 1
    assert one(m, "gpupool_gpu_mode", node="node-a", gpu="1", UUID=uuids[1], mode="draining") == 1
    assert one(m, "gpupool_gpu_mode", node="node-a", gpu="1", UUID=uuids[1], mode="virtual") == 0
    assert one(m, "gpupool_node_up", node="node-a") == 1
    assert one(m, "gpupool_nodes", state="up") == 1
    assert one(m, "gpupool_tenant_leases", tenant="default") == 3
    assert one(m, "gpupool_tenant_queued_leases", tenant="default") == 1
    assert one(m, "gpupool_scheduling_latency_seconds_count") >= 4
    assert one(m, "gpupool_lease_wait_seconds_count") >= 3
    assert one(m, "gpupool_lease_transitions_total", to="granted") >= 3
    assert 0.0 <= one(m, "gpupool_fragmentation_ratio") <= 1.0
    assert one(m, "gpupool_build_info", version=__version__) == 1


def test_releases_and_grants_from_the_queue_are_counted(client: TestClient) -> None:
    register(client, gpus=1)
    first = client.post(f"{API}/leases", json={"compute_pct": 100, "memory": "1GiB"}).json()
    waiting = client.post(f"{API}/leases", json={"compute_pct": 100, "memory": "1GiB"}).json()
    assert waiting["state"] == "queued"
    before = scrape(client)
    client.post(f"{API}/leases/{first['id']}/release")
    after = scrape(client)
    released = "gpupool_lease_transitions_total"
    assert one(after, released, to="released") == one(before, released, to="released") + 1
    assert (
        one(after, "gpupool_lease_wait_seconds_count")
        == one(before, "gpupool_lease_wait_seconds_count") + 1
    )
    assert one(after, "gpupool_queue_length") == 0


def test_node_host_readings_are_exported(client: TestClient) -> None:
    register(client, gpus=1)
    host = {
        "cpu_pct": 12.5,
        "memory_used_mib": 1024,
        "memory_total_mib": 4096,
        "net_recv_bytes": 1000,
        "net_sent_bytes": 2000,
        "disk_used_mib": 10,
        "disk_total_mib": 100,
    }
    client.post(f"{API}/nodes/node-a/heartbeat", json={"host": host, "telemetry": []})
    m = scrape(client)
    assert one(m, "gpupool_node_cpu_percent", node="node-a") == 12.5
    assert one(m, "gpupool_node_memory_used_bytes", node="node-a") == 1024 * 1024**2
    assert one(m, "gpupool_node_network_received_bytes_total", node="node-a") == 1000


def test_fragmentation_counts_free_compute_beside_other_slices(client: TestClient) -> None:
    register(client, gpus=2)
    client.post(f"{API}/leases", json={"compute_pct": 50, "memory": "1GiB"})
    # 150 % free: 50 beside the slice on one GPU, 100 on the empty other.
    assert one(scrape(client), "gpupool_fragmentation_ratio") == pytest.approx(50 / 150, abs=1e-4)


def test_agents_are_listed_for_prometheus_service_discovery(client: TestClient) -> None:
    body = {"name": "gpu-7", "agent_url": "http://10.0.0.7:9400", "gpus": []}
    assert client.post(f"{API}/nodes", json=body).status_code == 201
    register(client, name="no-api", gpus=1)  # an agent without its API is not a target
    targets = client.get(f"{API}/prometheus/targets").json()
    assert targets == [
        {"targets": ["10.0.0.7:9400"], "labels": {"node": "gpu-7", "__scheme__": "http"}}
    ]
