"""A tenant at its quota: its remote lease can still be drained off a node and moved while the
pool holds both places, its charge stays what it was (also after a restart), and a resize
that would take it past the quota is refused with the reason."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import register_fake_node

TEAM_QUOTA = {"max_compute_pct": 50, "max_memory": "20GiB", "max_leases": 1}


def charge(client: httpx.Client) -> tuple[int, int, int]:
    team = client.get("/tenants/team").json()
    return team["used_compute_pct"], team["used_memory_mib"], team["used_leases"]


def gpu(client: httpx.Client, uuid: str) -> dict[str, Any]:
    return next(g for g in client.get("/gpus").json() if g["uuid"] == uuid)


def test_a_tenant_at_its_quota_is_drained_and_migrated_and_charged_once(
    start_controller, db_url
) -> None:
    ctl = start_controller(db_url)
    with ctl.client() as client:
        (old_gpu,) = register_fake_node(client, "node-a")
        others = {register_fake_node(client, n)[0]: n for n in ("node-b", "node-c")}
        made = client.post("/tenants", json={"name": "team", "quota": TEAM_QUOTA})
        assert made.status_code == 201, made.text
        lease = client.post(
            "/leases",
            json={
                "tenant": "team",
                "compute_pct": 50,
                "memory": "20GiB",
                "access": "remote",
                "node": "node-a",
            },
        ).json()
        assert lease["state"] == "granted", lease
        assert charge(client) == (50, 20480, 1)

        # Growing past the quota is refused, with the limit it would break.
        grown = client.post(f"/leases/{lease['id']}/resize", json={"compute_pct": 60})
        assert grown.status_code == 403, grown.text
        assert grown.json()["detail"] == "tenant team: compute % would be 60, quota is 50"
        assert charge(client) == (50, 20480, 1)

        # Switching its GPU to physical moves the lease away; the GPU drains meanwhile.
        switched = client.post(f"/gpus/{old_gpu}/mode", json={"mode": "physical"})
        assert switched.status_code == 200, switched.text
        assert switched.json()["mode"] == "draining"
        moving = client.get(f"/leases/{lease['id']}").json()
        assert moving["state"] == "migrating"
        [new_gpu] = [s["gpu_uuid"] for s in moving["slices"]]
        [spare_gpu] = set(others) - {new_gpu}
        # Both places are held on the GPUs, the tenant is charged for one.
        assert gpu(client, old_gpu)["compute_granted_pct"] == 50
        assert gpu(client, new_gpu)["compute_granted_pct"] == 50
        assert charge(client) == (50, 20480, 1)
        ctl.restart()
        assert charge(client) == (50, 20480, 1), "a restarted controller charges both places"

        # The new worker took the state over: the old place and its GPU are free.
        adopted = {
            "lease_id": lease["id"],
            "gpu_uuid": new_gpu,
            "endpoint": f"tcp://{others[new_gpu]}:1",
            "generation": 1,
            "adopted": True,
        }
        beat = client.post(f"/nodes/{others[new_gpu]}/heartbeat", json={"workers": [adopted]})
        assert beat.status_code == 200, beat.text
        assert client.get(f"/leases/{lease['id']}").json()["state"] == "active"
        assert charge(client) == (50, 20480, 1)
        assert gpu(client, old_gpu)["compute_granted_pct"] == 0
        assert gpu(client, old_gpu)["mode"] == "physical"
        ctl.restart()
        assert gpu(client, old_gpu)["mode"] == "physical", "the switch was not stored"

        # A drain of the node it is on now moves it again, still at its quota.
        drained = client.post(f"/nodes/{others[new_gpu]}/drain")
        assert drained.status_code == 200, drained.text
        assert drained.json() == [lease["id"]]
        assert gpu(client, spare_gpu)["compute_granted_pct"] == 50
        assert charge(client) == (50, 20480, 1)
