"""Direct leases also take CPU and memory of the server they run on, and give them back."""

from __future__ import annotations

import httpx

from tests.conftest import ControllerProcess


def _register(client: httpx.Client) -> None:
    body = {
        "name": "node-a",
        "cpu_count": 8,
        "memory_mib": 65536,
        "gpus": [
            {"uuid": f"GPU-sim-node-a-{i}", "index": i, "model": "H100 (simulated)",
             "memory_mib": 81920, "simulated": True}
            for i in range(2)
        ],
    }  # fmt: skip
    assert client.post("/nodes", json=body).status_code == 201


def test_server_cpu_and_memory_are_granted_queued_and_restored(start_controller, db_url) -> None:
    ctl: ControllerProcess = start_controller(db_url, lease_ttl_s=600.0)
    with ctl.client() as client:
        _register(client)
        first = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB", "cpu": "6", "host_memory": "32GiB"}).json()
        assert first["state"] == "granted"
        second = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB", "cpu": "4000m"}).json()
        assert second["state"] == "queued", "8 cores: 6 are taken, 4 more do not fit"
        never = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB", "cpu": "16"})
        assert never.status_code == 409 and "never" in never.json()["detail"]
        bad = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB", "cpu": "lots"})
        assert bad.status_code == 422 and "CPU" in bad.json()["detail"]

    ctl.kill9()
    ctl.restart()
    with ctl.client() as client:
        assert client.get(f"/leases/{second['id']}").json()["state"] == "queued", (
            "after a restart the first lease still holds its 6 cores"
        )
        client.delete(f"/leases/{first['id']}")
        assert client.get(f"/leases/{second['id']}").json()["state"] == "granted"
