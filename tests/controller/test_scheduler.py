"""The controller acts for the scheduler: preemption with a grace period, the maximum queue
wait, fair share between tenants, and the dual-pool policy."""

from __future__ import annotations

import time

from tests.conftest import register_fake_node
from tests.timing import scaled


def _wait(predicate, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_higher_priority_request_preempts_and_holder_sees_it(start_controller, db_url) -> None:
    ctl = start_controller(db_url, preempt_grace_s=2.0, reconcile_interval_s=0.2)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        low = client.post("/leases", json={"compute_pct": 80, "memory": "1GiB"}).json()
        high = client.post(
            "/leases", json={"compute_pct": 50, "memory": "1GiB", "priority": 5}
        ).json()
        assert (low["state"], high["state"]) == ("granted", "queued")

        def preempted() -> bool:
            beat = client.post(f"/leases/{low['id']}/heartbeat", json={"active": True}).json()
            return bool(beat["state"] == "preempted")

        _wait(preempted)
        beat = client.post(f"/leases/{low['id']}/heartbeat").json()
        assert high["id"] in beat["release_reason"] and "stop within 2" in beat["release_reason"]
        # The holder does not stop: the grace period ends the lease.
        _wait(lambda: client.get(f"/leases/{high['id']}").json()["state"] == "granted")
        ended = client.get(f"/leases/{low['id']}").json()
        assert ended["state"] == "released"
        assert ended["release_reason"].startswith("preempted by a higher-priority request")
        kinds = [e["kind"] for e in client.get("/events", params={"subject": low["id"]}).json()]
        assert "lease.preempted" in kinds


def test_holder_that_stops_ends_the_preemption_at_once(start_controller) -> None:
    ctl = start_controller(None, preempt_grace_s=60.0, reconcile_interval_s=0.2)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        low = client.post("/leases", json={"compute_pct": 100, "memory": "1GiB"}).json()
        high = client.post(
            "/leases", json={"compute_pct": 100, "memory": "1GiB", "priority": 9}
        ).json()
        _wait(lambda: client.get(f"/leases/{low['id']}").json()["state"] == "preempted")
        client.delete(f"/leases/{low['id']}")
        assert client.get(f"/leases/{high['id']}").json()["state"] == "granted"
        reason = client.get(f"/leases/{low['id']}").json()["release_reason"]
        assert reason.startswith("preempted")


def test_equal_priority_never_preempts(start_controller) -> None:
    ctl = start_controller(None, preempt_grace_s=0.5, reconcile_interval_s=0.1)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        first = client.post("/leases", json={"compute_pct": 100, "priority": 3}).json()
        client.post("/leases", json={"compute_pct": 100, "priority": 3})
        time.sleep(scaled(1.0))  # reconcile passes, each of which could wrongly preempt
        assert client.get(f"/leases/{first['id']}").json()["state"] == "granted"


def test_request_past_the_maximum_wait_fails_with_its_reason(start_controller, db_url) -> None:
    ctl = start_controller(db_url, max_queue_wait_s=1.0, reconcile_interval_s=0.2)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        client.post("/leases", json={"compute_pct": 100, "memory": "1GiB"})
        waiting = client.post("/leases", json={"compute_pct": 100, "memory": "1GiB"}).json()
        _wait(lambda: client.get(f"/leases/{waiting['id']}").json()["state"] == "released")
        reason = client.get(f"/leases/{waiting['id']}").json()["release_reason"]
        assert reason.startswith("waited longer than the queue's maximum wait")
        assert "0 available" in reason


def test_a_request_can_set_its_own_maximum_wait(start_controller) -> None:
    ctl = start_controller(None, reconcile_interval_s=0.2)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        client.post("/leases", json={"compute_pct": 100})
        impatient = client.post("/leases", json={"compute_pct": 100, "max_wait_s": 0.5}).json()
        _wait(lambda: client.get(f"/leases/{impatient['id']}").json()["state"] == "released")


def test_fair_share_serves_the_tenant_holding_less_first(start_controller) -> None:
    ctl = start_controller(None)
    with ctl.client() as client:
        register_fake_node(client, gpus=2)
        for name in ("team-a", "team-b"):
            assert client.post("/tenants", json={"name": name}).status_code == 201
        client.post("/leases", json={"tenant": "team-a", "compute_pct": 100})
        client.post("/leases", json={"tenant": "team-a", "compute_pct": 100})
        a_waits = client.post("/leases", json={"tenant": "team-a", "compute_pct": 100}).json()
        b_waits = client.post("/leases", json={"tenant": "team-b", "compute_pct": 100}).json()
        positions = {e["lease"]["id"]: e["position"] for e in client.get("/queue").json()}
        assert positions == {b_waits["id"]: 1, a_waits["id"]: 2}


def test_guaranteed_share_is_stored_and_shown(start_controller, db_url) -> None:
    ctl = start_controller(db_url)
    with ctl.client() as client:
        body = {"name": "research", "quota": {"guaranteed_gpus": 2.5}}
        assert client.post("/tenants", json=body).json()["guaranteed_gpus"] == 2.5
        ctl.restart()
        with ctl.client() as again:
            assert again.get("/tenants/research").json()["guaranteed_gpus"] == 2.5


def test_dual_pool_switches_an_idle_gpu_for_a_waiting_physical_request(start_controller) -> None:
    ctl = start_controller(None, physical_ready=0, reconcile_interval_s=0.2)
    with ctl.client() as client:
        uuids = register_fake_node(client, gpus=2)
        client.post("/leases", json={"compute_pct": 50, "memory": "1GiB"})
        whole = client.post("/leases", json={"physical": True}).json()
        _wait(lambda: client.get(f"/leases/{whole['id']}").json()["state"] == "granted")
        modes = sorted(client.get(f"/gpus/{u}").json()["mode"] for u in uuids)
        assert modes == ["physical", "virtual"]
        actors = {e["actor"] for e in client.get("/events", params={"kind": "gpu.mode"}).json()}
        assert "dual-pool policy" in actors


def test_preempted_lease_survives_a_restart_and_is_released_after_grace(start_controller) -> None:
    # The grace outlasts a restart on a busy machine, so the restarted controller must find
    # the preemption still running, and end it on time; the node (registered once, with no
    # heartbeats) must outlast the grace.
    grace_s = scaled(12.0)
    ctl = start_controller(
        None, preempt_grace_s=grace_s, node_timeout_s=grace_s + 60, reconcile_interval_s=0.2
    )
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        low = client.post("/leases", json={"compute_pct": 100, "ttl_s": 600}).json()
        high = client.post("/leases", json={"compute_pct": 100, "priority": 5, "ttl_s": 600}).json()
        _wait(lambda: client.get(f"/leases/{low['id']}").json()["state"] == "preempted")
    ctl.restart()
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        assert client.get(f"/leases/{high['id']}").json()["state"] == "queued"
        _wait(lambda: client.get(f"/leases/{high['id']}").json()["state"] == "granted", 30.0)
        assert client.get(f"/leases/{low['id']}").json()["state"] == "released"
