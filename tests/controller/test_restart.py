"""A controller killed with -9 and started again loses no lease and no queue entry."""

from __future__ import annotations

from tests.conftest import register_fake_node


def test_kill_9_and_restart_loses_no_lease_and_no_queue_entry(start_controller, db_url) -> None:
    ctl = start_controller(db_url, lease_ttl_s=600.0)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        ids = [
            client.post("/leases", json={"compute_pct": 25, "memory": "1GiB"}).json()["id"]
            for _ in range(7)
        ]
        before = {lease["id"]: lease for lease in client.get("/leases").json()}
        queue_before = [e["lease"]["id"] for e in client.get("/queue").json()]
    assert len(queue_before) == 3

    ctl.kill9()
    ctl.restart()

    with ctl.client() as client:
        after = {lease["id"]: lease for lease in client.get("/leases").json()}
        assert set(after) == set(before) == set(ids)
        for lease_id, lease in before.items():
            assert after[lease_id]["state"] == lease["state"]
            assert after[lease_id]["slices"] == lease["slices"]
        assert [e["lease"]["id"] for e in client.get("/queue").json()] == queue_before
        assert client.get("/gpus").json()[0]["compute_granted_pct"] == 100

        granted = [i for i in ids if after[i]["state"] == "granted"]
        client.delete(f"/leases/{granted[0]}")
        assert client.get(f"/leases/{queue_before[0]}").json()["state"] == "granted"
        assert [e["lease"]["id"] for e in client.get("/queue").json()] == queue_before[1:]
