"""Silent holders lose their leases, silent nodes go down, and the queue is served again."""

from __future__ import annotations

import time

import httpx

from tests.conftest import AUTH, register_fake_node
from tests.timing import scaled


def _wait(predicate, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_lease_of_a_silent_holder_is_released_and_the_queue_served(start_controller) -> None:
    ctl = start_controller(None, lease_ttl_s=600.0, reconcile_interval_s=0.2)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        silent = client.post(
            "/leases", json={"compute_pct": 100, "memory": "1GiB", "ttl_s": 1.0}
        ).json()
        waiting = client.post("/leases", json={"compute_pct": 100, "memory": "1GiB"}).json()
        assert (silent["state"], waiting["state"]) == ("granted", "queued")
        _wait(lambda: client.get(f"/leases/{silent['id']}").json()["state"] == "released")
        lease = client.get(f"/leases/{silent['id']}").json()
        assert lease["release_reason"] == "holder stopped heartbeating"
        assert client.get(f"/leases/{waiting['id']}").json()["state"] == "granted"


def test_heartbeats_keep_a_lease_alive(start_controller) -> None:
    """A holder that beats well inside its ttl keeps the lease through many reconcile passes,
    for more than twice the ttl. The ttl is scaled by the suite's slowdown and the beats come
    ten times per ttl, so a loaded machine that stalls one request does not release a lease
    whose holder is alive: only silence longer than the ttl may do that."""
    ttl_s = scaled(2.0)
    ctl = start_controller(None, reconcile_interval_s=0.2)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        lease = client.post(
            "/leases", json={"compute_pct": 50, "memory": "1GiB", "ttl_s": ttl_s}
        ).json()
        start = time.monotonic()
        while time.monotonic() - start < 2.5 * ttl_s:
            beat = client.post(f"/leases/{lease['id']}/heartbeat", json={"active": True}).json()
            assert beat["state"] == "active"
            time.sleep(ttl_s / 10)
        assert client.get(f"/leases/{lease['id']}").json()["state"] == "active"


def test_silent_node_goes_down_gets_no_leases_and_comes_back(start_controller) -> None:
    ctl = start_controller(None, node_timeout_s=1.0, reconcile_interval_s=0.2)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        _wait(lambda: client.get("/nodes").json()[0]["state"] == "down")
        lease = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"}).json()
        assert lease["state"] == "queued"
        assert client.post("/nodes/node-a/heartbeat", json={}).json()["resumed"] is True
        assert client.get(f"/leases/{lease['id']}").json()["state"] == "granted"
        kinds = [e["kind"] for e in client.get("/events").json()]
        assert "node.down" in kinds and "node.up" in kinds


def test_queued_request_with_wait_false_is_refused_and_not_kept(start_controller) -> None:
    ctl = start_controller(None)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        client.post("/leases", json={"compute_pct": 100, "memory": "1GiB"})
        response = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB", "wait": False})
        assert response.status_code == 409
        assert "wait=false" in response.json()["detail"]
        assert len(client.get("/leases", params={"state": "all"}).json()) == 1


def test_events_record_who_did_what(start_controller) -> None:
    ctl = start_controller(None)
    with httpx.Client(base_url=ctl.url + "/api/v1", headers=AUTH) as admin:
        register_fake_node(admin, gpus=1)
        alice = admin.post("/tokens", json={"name": "alice", "role": "tenant", "tenant": "default"})
        alice_auth = {"Authorization": f"Bearer {alice.json()['token']}"}
        with httpx.Client(base_url=ctl.url + "/api/v1", headers=alice_auth) as client:
            lease = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"}).json()
            client.delete(f"/leases/{lease['id']}")
        events = admin.get("/events", params={"subject": lease["id"]}).json()
        # The actor is who the token says, not what a header claims.
        assert [(e["kind"], e["actor"]) for e in events] == [
            ("lease.created", "tenant:default/alice"),
            ("lease.granted", "controller"),
            ("lease.released", "tenant:default/alice"),
        ]
