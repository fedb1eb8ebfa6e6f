"""Leases of a node that stays down, by policy; remote leases whose worker died end at once."""

from __future__ import annotations

import time

import pytest

from gpupool.controller.settings import ControllerSettings
from tests.conftest import register_fake_node
from tests.timing import scaled


def _wait(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_release_policy_ends_the_leases_of_a_node_down_past_its_grace(
    start_controller, db_url
) -> None:
    ctl = start_controller(
        db_url,
        node_timeout_s=0.5,
        reconcile_interval_s=0.1,
        node_lost_policy="release",
        node_lost_grace_s=1.0,
    )
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        lease = client.post(
            "/leases", json={"compute_pct": 50, "memory": "1GiB", "ttl_s": 600}
        ).json()

        def released() -> bool:
            beat = client.post(f"/leases/{lease['id']}/heartbeat", json={}).json()
            return bool(beat["state"] == "released")

        _wait(released)
        ended = client.get(f"/leases/{lease['id']}").json()
        assert ended["release_reason"].startswith("its node was lost: node node-a silent for")
        assert "grace 1s" in ended["release_reason"]
        assert client.get("/gpus").json()[0]["compute_granted_pct"] == 0
        # Back again, the node gets new leases; the released one stays released.
        client.post("/nodes/node-a/heartbeat", json={})
        again = client.post("/leases", json={"compute_pct": 100, "memory": "1GiB"}).json()
        assert again["state"] == "granted"
        assert client.get(f"/leases/{lease['id']}").json()["state"] == "released"


def test_keep_policy_keeps_heartbeated_leases_of_a_down_node(start_controller) -> None:
    ctl = start_controller(None, node_timeout_s=0.5, reconcile_interval_s=0.1)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        lease = client.post(
            "/leases", json={"compute_pct": 50, "memory": "1GiB", "ttl_s": 5}
        ).json()
        _wait(lambda: client.get("/nodes").json()[0]["state"] == "down")
        for _ in range(20):
            beat = client.post(f"/leases/{lease['id']}/heartbeat", json={}).json()
            assert beat["state"] == "granted"
            time.sleep(0.1)


def test_dead_worker_reported_by_the_agent_ends_its_remote_lease(start_controller) -> None:
    ctl = start_controller(None)
    with ctl.client() as client:
        (uuid,) = register_fake_node(client, gpus=1)
        lease = client.post(
            "/leases", json={"compute_pct": 40, "memory": "1GiB", "access": "remote"}
        ).json()
        alive = {"lease_id": lease["id"], "gpu_uuid": uuid, "alive": True, "endpoint": "tcp://h:1"}
        reply = client.post("/nodes/node-a/heartbeat", json={"workers": [alive]}).json()
        assert lease["id"] in reply["leases"]
        dead = {
            "lease_id": lease["id"],
            "gpu_uuid": uuid,
            "alive": False,
            "error": "worker killed by signal 9",
        }
        reply = client.post("/nodes/node-a/heartbeat", json={"workers": [dead]}).json()
        assert reply["leases"] == {}, "the agent is told at once: it drops the dead worker"
        ended = client.get(f"/leases/{lease['id']}").json()
        assert ended["state"] == "released"
        assert (
            ended["release_reason"]
            == f"its worker died: worker on {uuid}: worker killed by signal 9"
        )
        assert client.get("/gpus").json()[0]["compute_granted_pct"] == 0
        # A late report of the same dead worker changes nothing.
        client.post("/nodes/node-a/heartbeat", json={"workers": [dead]})
        assert len(client.get("/events", params={"subject": lease["id"]}).json()) == 3


def test_returning_node_takes_no_lease_while_a_worker_of_an_ended_lease_runs(
    start_controller,
) -> None:
    ctl = start_controller(None, node_timeout_s=0.5, reconcile_interval_s=0.1)
    with ctl.client() as client:
        (uuid,) = register_fake_node(client, gpus=1)
        old = client.post(
            "/leases", json={"compute_pct": 100, "memory": "1GiB", "access": "remote"}
        ).json()
        _wait(lambda: client.get("/nodes").json()[0]["state"] == "down")
        client.delete(f"/leases/{old['id']}")
        waiting = client.post("/leases", json={"compute_pct": 100, "memory": "1GiB"}).json()
        stale = {"lease_id": old["id"], "gpu_uuid": uuid, "alive": True, "endpoint": "tcp://h:1"}
        reply = client.post("/nodes/node-a/heartbeat", json={"workers": [stale]}).json()
        assert reply["resumed"] is False and reply["leases"] == {}
        assert client.get("/nodes").json()[0]["state"] == "down"
        assert client.get(f"/leases/{waiting['id']}").json()["state"] == "queued"
        # The agent stopped the worker: the next heartbeat brings the node back.
        reply = client.post("/nodes/node-a/heartbeat", json={"workers": []}).json()
        assert reply["resumed"] is True
        assert client.get(f"/leases/{waiting['id']}").json()["state"] == "granted"


def test_agent_registering_again_after_an_outage_comes_up_with_its_first_heartbeat(
    start_controller,
) -> None:
    ctl = start_controller(None, node_timeout_s=0.5, reconcile_interval_s=0.1)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        _wait(lambda: client.get("/nodes").json()[0]["state"] == "down")
        waiting = client.post("/leases", json={"compute_pct": 100, "memory": "1GiB"}).json()
        register_fake_node(client, gpus=1)
        assert client.get("/nodes").json()[0]["state"] == "down", "its workers are not known yet"
        assert client.get(f"/leases/{waiting['id']}").json()["state"] == "queued"
        assert client.post("/nodes/node-a/heartbeat", json={"workers": []}).json()["resumed"]
        assert client.get(f"/leases/{waiting['id']}").json()["state"] == "granted"


@pytest.mark.parametrize(
    ("field", "value"), [("node_lost_policy", "forget"), ("node_lost_grace_s", -1.0)]
)
def test_bad_node_lost_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ControllerSettings(**{field: value})  # type: ignore[arg-type]
