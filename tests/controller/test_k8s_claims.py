"""The controller's /k8s endpoints: placement per node, claims as leases, the one-claim gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import register_fake_node
from tests.controller.inprocess import API, controller, register

SLICE = {"compute_pct": 25, "memory": "8GiB"}


def claim_body(claim: str, node: str = "node-a", **request: Any) -> dict[str, Any]:
    return {"claim": claim, "node": node, "pod": "ns/pod", "request": request or SLICE}


def test_placement_says_where_a_request_fits_and_which_node_the_pool_prefers(
    tmp_path: Path,
) -> None:
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=1)
        register(client, "node-b", gpus=2)
        # node-a is nearly full: a 25 % slice fits only on node-b.
        assert (
            client.post(f"{API}/leases", json={"compute_pct": 80, "node": "node-a"}).status_code
            == 201
        )
        answer = client.post(
            f"{API}/k8s/placement",
            json={"request": SLICE, "nodes": ["node-a", "node-b", "cpu-1"]},
        ).json()
        fits = {f["node"]: f for f in answer["nodes"]}
        assert fits["node-a"]["fits"] is False and "available now" in fits["node-a"]["reason"]
        assert fits["node-b"] == {
            "node": "node-b",
            "fits": True,
            "reason": None,
            "never": False,
            "score": 10,
        }
        assert fits["cpu-1"]["reason"] == "no gpupool GPUs on this node" and fits["cpu-1"]["never"]
        assert fits["node-a"]["never"] is False  # the 80 % lease may end
        assert answer["best"] == "node-b"


def test_claim_is_a_lease_on_the_chosen_node_and_binding_twice_is_harmless(tmp_path: Path) -> None:
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=2)
        first = client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01"))
        assert first.status_code == 201, first.text
        again = client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01"))
        assert (
            again.status_code == 201 and again.json()["lease"]["id"] == first.json()["lease"]["id"]
        )
        elsewhere = client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01", node="node-b"))
        assert (
            elsewhere.status_code == 409
            and "already bound to node node-a" in elsewhere.json()["detail"]
        )
        lease = first.json()["lease"]
        assert lease["holder"] == "k8s-claim:c-aaaaaaaa01"
        assert lease["node"] == "node-a" and lease["state"] == "granted"


def test_one_claim_waits_per_node_until_a_container_gets_it(tmp_path: Path) -> None:
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=2)
        assert client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01")).status_code == 201
        busy = client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa02"))
        assert (
            busy.status_code == 409
            and "still admitting claim c-aaaaaaaa01" in busy.json()["detail"]
        )
        pending = client.get(f"{API}/k8s/nodes/node-a/pending").json()
        assert pending["claim"] == "c-aaaaaaaa01"

        wrong = client.post(
            f"{API}/k8s/nodes/node-a/allocate", json={"resource": "gpu", "devices": 1}
        )
        assert wrong.status_code == 404 and "no claim is waiting" in wrong.json()["detail"]
        got = client.post(
            f"{API}/k8s/nodes/node-a/allocate", json={"resource": "vgpu", "devices": 1}
        )
        assert got.status_code == 200
        assert got.json()["state"] == "allocated" and got.json()["lease"]["state"] == "active"
        assert client.get(f"{API}/k8s/nodes/node-a/pending").status_code == 404

        assert client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa02")).status_code == 201
        released = client.delete(f"{API}/k8s/claims/c-aaaaaaaa01")
        assert released.json()["lease"]["state"] == "released"
        assert [c["claim"] for c in client.get(f"{API}/k8s/claims").json()] == ["c-aaaaaaaa02"]
        assert client.get(f"{API}/k8s/claims/c-aaaaaaaa01").status_code == 404


def test_bad_claims_are_refused_with_a_reason_and_change_nothing(tmp_path: Path) -> None:
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=1)
        bad_id = client.post(f"{API}/k8s/claims", json=claim_body("Not_A_Label"))
        assert bad_id.status_code == 422 and "claim" in bad_id.json()["detail"]
        remote = client.post(
            f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01", compute_pct=25, access="remote")
        )
        assert remote.status_code == 422 and "direct leases" in remote.json()["detail"]
        too_big = client.post(
            f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01", gpus=4, physical=True)
        )
        assert too_big.status_code == 409 and "never be granted" in too_big.json()["detail"]
        full = client.post(f"{API}/leases", json={"compute_pct": 90, "memory": "70GiB"})
        assert full.status_code == 201
        no_room = client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01"))
        assert no_room.status_code == 409 and "wait=false" in no_room.json()["detail"]
        assert client.get(f"{API}/k8s/claims").json() == []
        assert len(client.get(f"{API}/leases").json()) == 1


def test_claims_survive_a_controller_restart(start_controller: Any, db_url: str | None) -> None:
    ctl = start_controller(db_url, lease_ttl_s=600.0)
    with ctl.client() as client:
        register_fake_node(client, name="node-a", gpus=1)
        made = client.post("/k8s/claims", json=claim_body("c-restart0001"))
        assert made.status_code == 201, made.text
    ctl.kill9()
    ctl.restart()
    with ctl.client() as client:
        after = client.get("/k8s/claims/c-restart0001")
        assert after.status_code == 200
        assert after.json()["lease"]["id"] == made.json()["lease"]["id"]
        assert after.json()["state"] == "bound"
        busy = client.post("/k8s/claims", json=claim_body("c-restart0002"))
        assert busy.status_code == 409  # the gate holds across restarts too


def test_only_scheduler_and_admin_tokens_make_claims_and_agents_ask_for_their_node_only(
    tmp_path: Path,
) -> None:
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=1)
        register(client, "node-b", gpus=1)
        scopes: dict[str, dict[str, str]] = {
            "scheduler": {},
            "viewer": {},
            "tenant": {"tenant": "default"},
            "agent": {"node": "node-a"},
        }
        tokens = {
            role: client.post(
                f"{API}/tokens", json={"name": f"k8s-{role}", "role": role, **scope}
            ).json()["token"]
            for role, scope in scopes.items()
        }
        body = claim_body("c-auth00000001")
        none = client.post(f"{API}/k8s/claims", json=body, headers={"Authorization": ""})
        assert none.status_code == 401
        for role in ("viewer", "tenant", "agent"):
            refused = client.post(
                f"{API}/k8s/claims", json=body, headers={"Authorization": f"Bearer {tokens[role]}"}
            )
            assert refused.status_code == 403 and "cannot do this" in refused.json()["detail"]
        assert client.get(f"{API}/k8s/claims").json() == []  # nothing was made
        scheduler = {"Authorization": f"Bearer {tokens['scheduler']}"}
        assert client.post(f"{API}/k8s/claims", json=body, headers=scheduler).status_code == 201
        beat = client.post(f"{API}/k8s/claims/c-auth00000001/heartbeat", headers=scheduler)
        assert beat.status_code == 200 and beat.json()["state"] == "bound"
        events = client.get(f"{API}/events", params={"kind": "lease.created"}).json()
        assert events[-1]["actor"] == "scheduler:k8s-scheduler"
        # The device plugin of node-a (its agent's token) sees node-a's claim...
        agent = {"Authorization": f"Bearer {tokens['agent']}"}
        mine = client.get(f"{API}/k8s/nodes/node-a/pending", headers=agent)
        assert mine.status_code == 200 and mine.json()["claim"] == "c-auth00000001"
        # ...and cannot read or allocate another node's.
        assert (
            client.post(
                f"{API}/k8s/claims",
                json=claim_body("c-auth00000002", node="node-b"),
                headers=scheduler,
            ).status_code
            == 201
        )
        other = client.get(f"{API}/k8s/nodes/node-b/pending", headers=agent)
        assert other.status_code == 403 and "node-a" in other.json()["detail"]
        take = client.post(
            f"{API}/k8s/nodes/node-b/allocate",
            json={"resource": "vgpu", "devices": 1},
            headers=agent,
        )
        assert take.status_code == 403 and "node 'node-b'" in take.json()["detail"]
        assert client.get(f"{API}/k8s/claims/c-auth00000002").json()["state"] == "bound"


def test_preemption_names_the_cheapest_offered_claims_and_only_live_ones(tmp_path: Path) -> None:
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=1)
        register(client, "node-b", gpus=1)
        tenant = {"name": "research", "quota": {"max_priority": 1000}}
        assert client.post(f"{API}/tenants", json=tenant).status_code == 201
        half = {"compute_pct": 50, "memory": "8GiB", "tenant": "research"}
        for n, (claim, priority) in enumerate((("c-low00000001", 0), ("c-high0000001", 500))):
            made = client.post(
                f"{API}/k8s/claims", json=claim_body(claim, **half, priority=priority)
            )
            assert made.status_code == 201, made.text
            allocated = client.post(
                f"{API}/k8s/nodes/node-a/allocate", json={"resource": "vgpu", "devices": 1}
            )
            assert allocated.status_code == 200 and allocated.json()["claim"] == claim, n
        # node-b is full of a lease made outside Kubernetes.
        assert (
            client.post(f"{API}/leases", json={"compute_pct": 100, "node": "node-b"}).status_code
            == 201
        )
        query = {
            "request": {"compute_pct": 40, "memory": "8GiB", "tenant": "research", "priority": 100},
            "nodes": {
                "node-a": ["c-high0000001", "c-low00000001", "c-gone00000001"],
                "node-b": ["c-low00000001"],  # live, but not on node-b: not counted there
            },
        }
        answer = client.post(f"{API}/k8s/preemption", json=query)
        assert answer.status_code == 200, answer.text
        nodes = {n["node"]: n for n in answer.json()["nodes"]}
        assert nodes["node-a"]["helps"] is True
        assert nodes["node-a"]["claims"] == ["c-low00000001"]  # never the higher priority one
        assert (
            nodes["node-b"]["helps"] is False and "would not make room" in nodes["node-b"]["reason"]
        )
        # Nothing was ended: the scheduler evicts, and claims end with their pods.
        assert len(client.get(f"{API}/k8s/claims").json()) == 2
        capped = {**query, "request": {**query["request"], "tenant": "default"}}
        refused = client.post(f"{API}/k8s/preemption", json=capped).json()["nodes"]
        assert all(not n["helps"] and "priority 100" in n["reason"] for n in refused)
        agent = client.post(
            f"{API}/tokens", json={"name": "a", "role": "agent", "node": "node-a"}
        ).json()["token"]
        denied = client.post(
            f"{API}/k8s/preemption", json=query, headers={"Authorization": f"Bearer {agent}"}
        )
        assert denied.status_code == 403


def test_placement_leaves_out_a_node_that_is_admitting_a_claim(tmp_path: Path) -> None:
    """The one-claim rule in filter: else the scheduler keeps choosing the node its bind refuses."""
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=2)
        register(client, "node-b", gpus=2)
        assert client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01")).status_code == 201
        query = {"request": SLICE, "nodes": ["node-a", "node-b"]}
        answer = client.post(f"{API}/k8s/placement", json=query).json()
        fits = {f["node"]: f for f in answer["nodes"]}
        assert fits["node-a"]["fits"] is False and fits["node-a"]["never"] is False
        assert "admitting claim c-aaaaaaaa01" in fits["node-a"]["reason"]
        assert fits["node-b"]["fits"] is True and answer["best"] == "node-b"

        allocated = client.post(
            f"{API}/k8s/nodes/node-a/allocate", json={"resource": "vgpu", "devices": 1}
        )
        assert allocated.status_code == 200
        answer = client.post(f"{API}/k8s/placement", json=query).json()
        assert all(f["fits"] for f in answer["nodes"])


def test_allocate_refuses_while_a_pod_without_a_claim_waits_on_the_node(tmp_path: Path) -> None:
    """Claim theft: a pod the webhook skipped (kube-system, nodeName set) is admitted by the
    kubelet, whose Allocate names no pod; it must not get the claim waiting on the node."""
    allocate = f"{API}/k8s/nodes/node-a/allocate"
    mine = {"pod": "default/train", "claim": "c-aaaaaaaa01"}
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=2)
        assert client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa01")).status_code == 201
        for waiting, why in [
            ([mine, {"pod": "kube-system/thief"}], "kube-system/thief on node node-a"),
            ([mine, {"pod": "kube-system/thief", "claim": "c-aaaaaaaa01"}], "2 pods"),
            ([mine, {"pod": "kube-system/thief", "claim": "c-forged0001"}], "without a claim"),
            ([{"pod": "kube-system/thief"}], "without a claim"),
            ([], "not among the pods waiting"),
        ]:
            body = {"resource": "vgpu", "devices": 1, "waiting": waiting}
            refused = client.post(allocate, json=body)
            assert refused.status_code == 409 and why in refused.json()["detail"], refused.text
        assert client.get(f"{API}/k8s/nodes/node-a/pending").json()["claim"] == "c-aaaaaaaa01"

        got = client.post(allocate, json={"resource": "vgpu", "devices": 1, "waiting": [mine]})
        assert got.status_code == 200 and got.json()["state"] == "allocated"
        # Its pod, still starting, does not block the next one.
        assert client.post(f"{API}/k8s/claims", json=claim_body("c-aaaaaaaa02")).status_code == 201
        both = [mine, {"pod": "default/second", "claim": "c-aaaaaaaa02"}]
        got = client.post(allocate, json={"resource": "vgpu", "devices": 1, "waiting": both})
        assert got.status_code == 200 and got.json()["claim"] == "c-aaaaaaaa02"
