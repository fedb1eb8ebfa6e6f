"""Many clients asking at once: exact grants, an ordered queue, and the queue served on release."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import AUTH, register_fake_node


def _create(url: str) -> dict[str, object]:
    with httpx.Client(base_url=url + "/api/v1", timeout=60, headers=AUTH) as client:
        response = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"})
        assert response.status_code == 201, response.text
        return dict(response.json())


def test_fifty_concurrent_requests_grant_exactly_ten_and_queue_the_rest_in_order(
    start_controller, db_url
) -> None:
    ctl = start_controller(db_url, lease_ttl_s=600.0)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        with ThreadPoolExecutor(max_workers=50) as pool:
            results = list(pool.map(lambda _: _create(ctl.url), range(50)))

        granted = [r for r in results if r["state"] == "granted"]
        queued = [r for r in results if r["state"] == "queued"]
        assert len(granted) == 10
        assert len(queued) == 40
        assert sorted(r["queue_position"] for r in queued) != []  # positions were reported

        gpu = client.get("/gpus").json()[0]
        assert gpu["compute_granted_pct"] == 100
        assert len(gpu["leases"]) == 10

        queue = client.get("/queue").json()
        assert [e["position"] for e in queue] == list(range(1, 41))
        assert {e["lease"]["id"] for e in queue} == {r["id"] for r in queued}
        created = [e["lease"]["created_at"] for e in queue]
        assert created == sorted(created), "the queue is first come, first served"

        head = queue[0]["lease"]["id"]
        released = client.delete(f"/leases/{granted[0]['id']}").json()
        assert released["state"] == "released"
        assert client.get(f"/leases/{head}").json()["state"] == "granted"
        queue_after = client.get("/queue").json()
        assert [e["lease"]["id"] for e in queue_after] == [e["lease"]["id"] for e in queue[1:]]
        assert [e["position"] for e in queue_after] == list(range(1, 40))
        assert client.get("/gpus").json()[0]["compute_granted_pct"] == 100
