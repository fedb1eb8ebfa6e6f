"""Operators switch GPUs between the virtual and physical pools, drain and isolate them."""

from __future__ import annotations

from tests.conftest import register_fake_node


def test_busy_gpu_drains_before_switching_to_physical(start_controller, db_url) -> None:
    ctl = start_controller(db_url)
    with ctl.client() as client:
        [uuid] = register_fake_node(client, gpus=1)
        lease = client.post("/leases", json={"compute_pct": 30, "memory": "1GiB"}).json()
        gpu = client.post(f"/gpus/{uuid}/mode", json={"mode": "physical"}).json()
        assert (gpu["mode"], gpu["target_mode"]) == ("draining", "physical")
        blocked = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"}).json()
        assert blocked["state"] == "queued"
        whole = client.post("/leases", json={"physical": True}).json()
        assert whole["state"] == "queued"
        client.delete(f"/leases/{lease['id']}")
        assert client.get(f"/gpus/{uuid}").json()["mode"] == "physical"
        whole = client.get(f"/leases/{whole['id']}").json()
        assert whole["state"] == "granted"
        assert whole["slices"][0]["whole"] is True
        assert whole["slices"][0]["memory_mib"] == 81920
        assert client.get(f"/leases/{blocked['id']}").json()["state"] == "queued"


def test_idle_gpu_switches_at_once_and_back(start_controller) -> None:
    ctl = start_controller(None)
    with ctl.client() as client:
        [uuid] = register_fake_node(client, gpus=1)
        assert (
            client.post(f"/gpus/{uuid}/mode", json={"mode": "physical"}).json()["mode"]
            == "physical"
        )
        assert (
            client.post(f"/gpus/{uuid}/mode", json={"mode": "virtual"}).json()["mode"] == "virtual"
        )


def test_isolated_gpu_gets_no_leases_until_cleared(start_controller) -> None:
    ctl = start_controller(None)
    with ctl.client() as client:
        [uuid] = register_fake_node(client, gpus=1)
        gpu = client.post(f"/gpus/{uuid}/isolate", json={"reason": "XID 79"}).json()
        assert gpu["mode"] == "isolated"
        assert gpu["isolation_reason"] == "XID 79"
        lease = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"}).json()
        assert lease["state"] == "queued"
        assert client.post(f"/gpus/{uuid}/clear").json()["mode"] == "virtual"
        assert client.get(f"/leases/{lease['id']}").json()["state"] == "granted"


def test_tenant_quota_holds_and_raising_it_serves_the_queue(start_controller, db_url) -> None:
    ctl = start_controller(db_url)
    with ctl.client() as client:
        register_fake_node(client, gpus=2)
        created = client.post(
            "/tenants",
            json={"name": "team-a", "quota": {"max_compute_pct": 50, "max_memory": "8GiB"}},
        )
        assert created.status_code == 201, created.text
        too_big = client.post(
            "/leases", json={"tenant": "team-a", "compute_pct": 60, "memory": "1GiB"}
        )
        assert too_big.status_code == 403
        first = client.post(
            "/leases", json={"tenant": "team-a", "compute_pct": 40, "memory": "1GiB"}
        ).json()
        second = client.post(
            "/leases", json={"tenant": "team-a", "compute_pct": 40, "memory": "1GiB"}
        ).json()
        assert (first["state"], second["state"]) == ("granted", "queued")
        assert "quota" in second["waiting_reason"]
        other = client.post("/leases", json={"compute_pct": 40, "memory": "1GiB"}).json()
        assert other["state"] == "granted", "another tenant is not held back by team-a's quota"
        client.patch("/tenants/team-a", json={"quota": {"max_compute_pct": 100}})
        assert client.get(f"/leases/{second['id']}").json()["state"] == "granted"
        tenant = client.get("/tenants/team-a").json()
        assert tenant["used_compute_pct"] == 80


def test_gpu_fault_ends_its_leases_and_tells_their_holders(start_controller) -> None:
    ctl = start_controller(None)
    with ctl.client() as client:
        uuids = register_fake_node(client, gpus=2)
        lease = client.post(
            "/leases", json={"compute_pct": 50, "memory": "1GiB", "node": "node-a"}
        ).json()
        bad = lease["slices"][0]["gpu_uuid"]
        gpu = client.post(
            f"/gpus/{bad}/isolate",
            json={"reason": "XID 79: GPU has fallen off the bus", "fault": True},
        ).json()
        assert (gpu["mode"], gpu["healthy"]) == ("isolated", False)
        ended = client.get(f"/leases/{lease['id']}").json()
        assert (ended["state"], ended["release_reason"]) == ("released", "its GPU failed")
        events = client.get("/events", params={"subject": lease["id"]}).json()
        assert any(e["kind"] == "lease.gpu_failed" and "XID 79" in e["message"] for e in events)
        for _ in range(3):
            new = client.post("/leases", json={"compute_pct": 50, "memory": "1GiB"}).json()
            assert all(s["gpu_uuid"] != bad for s in new["slices"])
        reply = client.post("/nodes/node-a/heartbeat", json={}).json()
        assert reply["gpus"][bad]["mode"] == "isolated"
        assert set(reply["gpus"]) == set(uuids)
        cleared = client.post(f"/gpus/{bad}/clear").json()
        assert (cleared["mode"], cleared["healthy"]) == ("virtual", True)
