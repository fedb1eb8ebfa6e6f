"""The controller's side of the watch of direct slices: each heartbeat names the node's direct
leases (limits and token hash, never the token), and a node's watch events reach the event
log about that node's GPUs only."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.inprocess import API, TestClient, controller, register


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with controller(tmp_path) as c:
        register(c, "node-a", gpus=2)
        register(c, "node-b", gpus=1)
        yield c


def token_of(
    client: TestClient, role: str, tenant: str | None = None, node: str | None = None
) -> str:
    """A new token of a role; agent tokens name the one node they act for."""
    body: dict[str, object] = {"name": f"{role}-x", "role": role}
    if tenant:
        body["tenant"] = tenant
    if node:
        body["node"] = node
    answer = client.post(f"{API}/tokens", json=body)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["token"])


def event(**fields: object) -> dict[str, object]:
    body: dict[str, object] = {
        "kind": "process_stopped",
        "reason": "over_memory",
        "message": "stopped pid 4242 (python train.py): over",
        "gpu_uuid": "GPU-node-a-0",
        "pid": 4242,
        "command": "python train.py",
    }
    body.update(fields)
    return body


def test_a_heartbeat_names_the_nodes_direct_leases_with_a_token_hash(client: TestClient) -> None:
    made = client.post(
        f"{API}/leases", json={"compute_pct": 30, "memory": "8GiB", "node": "node-a"}
    ).json()
    assert made["token"], "a direct lease's holder gets a token to attach its processes with"
    remote = client.post(
        f"{API}/leases",
        json={"compute_pct": 20, "memory": "1GiB", "node": "node-a", "access": "remote"},
    ).json()
    reply = client.post(f"{API}/nodes/node-a/heartbeat", json={}).json()
    direct = reply["direct"]
    assert set(direct) == {made["id"]}, "remote leases run workers, not direct programs"
    assert direct[made["id"]] == {
        "token_sha256": hashlib.sha256(made["token"].encode()).hexdigest(),
        "slices": [
            {
                "gpu_uuid": made["slices"][0]["gpu_uuid"],
                "compute_pct": 30,
                "memory_mib": 8192,
                "whole": False,
            }
        ],
    }
    assert made["token"] not in str(reply)
    assert remote["id"] in reply["leases"]
    other = client.post(f"{API}/nodes/node-b/heartbeat", json={}).json()
    assert other["direct"] == {}, "another node hears nothing of node-a's leases"
    client.delete(f"{API}/leases/{made['id']}")
    assert client.post(f"{API}/nodes/node-a/heartbeat", json={}).json()["direct"] == {}


def test_a_physical_lease_is_a_whole_gpu_to_the_watch(client: TestClient) -> None:
    client.post(f"{API}/gpus/GPU-node-a-1/mode", json={"mode": "physical"})
    made = client.post(f"{API}/leases", json={"physical": True, "node": "node-a"}).json()
    reply = client.post(f"{API}/nodes/node-a/heartbeat", json={}).json()
    (piece,) = reply["direct"][made["id"]]["slices"]
    assert piece["whole"] is True and piece["gpu_uuid"] == "GPU-node-a-1"


def test_watch_events_are_recorded_with_lease_process_and_reason(client: TestClient) -> None:
    made = client.post(
        f"{API}/leases", json={"compute_pct": 30, "memory": "1GiB", "node": "node-a"}
    ).json()
    gpu = made["slices"][0]["gpu_uuid"]
    agent = bearer(token_of(client, "agent", node="node-a"))
    body = {
        "events": [
            event(lease_id=made["id"], gpu_uuid=gpu, used_memory_mib=2048, limit_memory_mib=1024)
        ]
    }
    before = client.get(f"{API}/events", params={"subject": made["id"]}).json()
    stranger = bearer(token_of(client, "agent", node="node-b"))
    refused = client.post(f"{API}/nodes/node-a/direct-events", json=body, headers=stranger)
    assert refused.status_code == 403, refused.text
    assert client.get(f"{API}/events", params={"subject": made["id"]}).json() == before
    answer = client.post(f"{API}/nodes/node-a/direct-events", json=body, headers=agent)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"recorded": 1}
    (recorded,) = client.get(f"{API}/events", params={"subject": made["id"]}).json()[-1:]
    assert recorded["kind"] == "direct.process_stopped"
    assert recorded["message"] == "node-a: stopped pid 4242 (python train.py): over"
    assert recorded["data"]["pid"] == 4242
    assert recorded["data"]["reason"] == "over_memory"
    assert recorded["data"]["node"] == "node-a"
    assert recorded["data"]["tenant"] == "default"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/nodes/node-a/direct-events", {"events": [event(gpu_uuid="GPU-node-b-0")]}, 404),
        ("/nodes/node-a/direct-events", {"events": [event(lease_id="l-nosuchlease")]}, 404),
        ("/nodes/ghost/direct-events", {"events": [event()]}, 404),
        ("/nodes/node-a/direct-events", {"events": []}, 422),
        ("/nodes/node-a/direct-events", {"events": [event(pid=-1)]}, 422),
        ("/nodes/node-a/direct-events", {"events": [event(kind="reboot")]}, 422),
        ("/nodes/node-a/direct-events", {"events": [event(message="x" * 501)]}, 422),
        ("/nodes/node-a/direct-events", {"events": [event(command="a\u0000b")]}, 422),
        ("/nodes/node-a/direct-events", {"events": [event(extra=1)]}, 422),
        ("/nodes/node-a/direct-events", {"events": [event()] * 257}, 422),
    ],
)
def test_bad_watch_events_are_refused_and_nothing_is_recorded(
    client: TestClient, path: str, body: object, status: int
) -> None:
    before = _recorded(client)
    answer = client.post(API + path, json=body)
    assert answer.status_code == status, answer.text
    assert _recorded(client) == before


def _recorded(client: TestClient) -> list[dict[str, object]]:
    """The event log but the controller's own stall notes, which a loaded machine adds at any
    time (its loop did not run for seconds): they are not the refused request's doing."""
    events = client.get(f"{API}/events", params={"limit": 500}).json()
    return [e for e in events if e["kind"] != "controller.stalled"]


@pytest.mark.parametrize("role", ["tenant", "viewer"])
def test_only_agents_report_watch_events(client: TestClient, role: str) -> None:
    client.post(f"{API}/tenants", json={"name": "team-a"})
    token = token_of(client, role, "team-a" if role == "tenant" else None)
    answer = client.post(
        f"{API}/nodes/node-a/direct-events", json={"events": [event()]}, headers=bearer(token)
    )
    assert answer.status_code == 403, answer.text


def test_an_event_about_a_lease_that_just_ended_is_still_recorded(client: TestClient) -> None:
    made = client.post(
        f"{API}/leases", json={"compute_pct": 30, "memory": "1GiB", "node": "node-a"}
    ).json()
    gpu = made["slices"][0]["gpu_uuid"]
    assert client.delete(f"{API}/leases/{made['id']}").status_code in (200, 204)
    body = {"events": [event(lease_id=made["id"], gpu_uuid=gpu, reason="no_lease")]}
    answer = client.post(f"{API}/nodes/node-a/direct-events", json=body)
    assert answer.status_code == 200, answer.text
    kinds = [e["kind"] for e in client.get(f"{API}/events", params={"subject": made["id"]}).json()]
    assert kinds[-1] == "direct.process_stopped"
