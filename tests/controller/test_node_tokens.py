"""Node-bound agent credentials: an agent token acts for the node it was made for and no
other, a heartbeat answers with that node's leases only, new nodes join only with a token an
operator made for them, and agent tokens of older databases are refused with a way out.

Every attack is seen refused and leaves the pool as it was. Run on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import create_engine, text

from gpupool.controller.db import alembic_config
from gpupool.controller.settings import ControllerSettings
from gpupool.protocol.v1.tokens import digest, new_token
from tests.controller.inprocess import API, TestClient, controller, register


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def node_body(name: str, gpus: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "gpus": [
            {"uuid": f"GPU-{name}-{i}", "index": i, "model": "H100", "memory_mib": 81920}
            for i in range(gpus)
        ],
    }


def make(admin: TestClient, **body: object) -> dict[str, Any]:
    answer = admin.post(f"{API}/tokens", json=body)
    assert answer.status_code == 201, answer.text
    made: dict[str, Any] = answer.json()
    return made


def agent_token(admin: TestClient, node: str) -> dict[str, str]:
    return bearer(make(admin, name=node, role="agent", node=node)["token"])


def pool_state(admin: TestClient) -> tuple[Any, ...]:
    """What an attack must not change: nodes, GPUs (modes, health), leases and their slices."""
    nodes = [
        {k: n[k] for k in ("name", "state", "address", "agent_url", "gpu_count", "registered_at")}
        for n in admin.get(f"{API}/nodes").json()
    ]
    gpus = [
        {k: g[k] for k in ("uuid", "node", "mode", "healthy", "isolation_reason", "telemetry")}
        for g in admin.get(f"{API}/gpus").json()
    ]
    leases = [
        {k: lease[k] for k in ("id", "state", "slices")}
        for lease in admin.get(f"{API}/leases").json()
    ]
    return nodes, gpus, leases


@pytest.fixture
def admin(tmp_path: Path, db_url: str | None) -> Iterator[TestClient]:
    with controller(tmp_path, db_url=db_url) as client:
        register(client, "node-a", gpus=1)
        register(client, "node-b", gpus=1)
        assert client.post(f"{API}/tenants", json={"name": "team-a"}).status_code == 201
        yield client


def remote_lease(admin: TestClient, node: str) -> dict[str, Any]:
    body = {"tenant": "team-a", "compute_pct": 10, "memory": "1GiB", "access": "remote"}
    answer = admin.post(f"{API}/leases", json={**body, "node": node})
    assert answer.status_code == 201, answer.text
    lease: dict[str, Any] = answer.json()
    assert lease["state"] == "granted" and lease["token"]
    return lease


# ---- one node's token, another node ---------------------------------------------------------


def test_an_agent_token_cannot_register_heartbeat_or_isolate_as_another_node(
    admin: TestClient,
) -> None:
    a = agent_token(admin, "node-a")
    before = pool_state(admin)
    attacks = [
        admin.post(f"{API}/nodes", json=node_body("node-b", gpus=2), headers=a),
        admin.post(f"{API}/nodes/node-b/heartbeat", json={}, headers=a),
        admin.post(
            f"{API}/gpus/GPU-node-b-0/isolate", json={"reason": "xid 79", "fault": True}, headers=a
        ),
        admin.post(f"{API}/gpus/GPU-node-b-0/isolate", json={"reason": "drain it"}, headers=a),
        admin.get(f"{API}/k8s/nodes/node-b/pending", headers=a),
    ]
    for answer in attacks:
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"] == "forbidden"
        assert "acts for node 'node-a' only" in answer.json()["detail"]
    assert pool_state(admin) == before
    # Its own node, it may do all of it.
    assert admin.post(f"{API}/nodes", json=node_body("node-a"), headers=a).status_code == 201
    assert admin.post(f"{API}/nodes/node-a/heartbeat", json={}, headers=a).status_code == 200
    own = admin.post(f"{API}/gpus/GPU-node-a-0/isolate", json={"reason": "x"}, headers=a)
    assert own.status_code == 200 and own.json()["mode"] == "isolated"


def test_a_heartbeat_answers_with_the_nodes_own_leases_only(admin: TestClient) -> None:
    on_a = remote_lease(admin, "node-a")
    on_b = remote_lease(admin, "node-b")
    beat = admin.post(f"{API}/nodes/node-a/heartbeat", json={}, headers=agent_token(admin, "node-a"))
    assert beat.status_code == 200, beat.text
    assert set(beat.json()["leases"]) == {on_a["id"]}
    assert beat.json()["leases"][on_a["id"]]["token"] == on_a["token"]
    assert on_b["token"] not in beat.text  # no other lease's data-plane token, anywhere
    assert set(beat.json()["gpus"]) == {"GPU-node-a-0"}


def test_a_rogue_registration_with_a_token_made_for_another_node_is_refused(
    admin: TestClient,
) -> None:
    stolen = agent_token(admin, "gpu-7")
    before = pool_state(admin)
    rogue = admin.post(f"{API}/nodes", json=node_body("gpu-8", gpus=4), headers=stolen)
    assert rogue.status_code == 403, rogue.text
    assert "acts for node 'gpu-7' only" in rogue.json()["detail"]
    assert pool_state(admin) == before
    assert admin.get(f"{API}/nodes/gpu-8").status_code == 404
    # A tenant's new remote lease goes to the real nodes, never to the refused one.
    lease = admin.post(
        f"{API}/leases",
        json={"tenant": "team-a", "compute_pct": 10, "memory": "1GiB", "access": "remote"},
    ).json()
    assert {s["node"] for s in lease["slices"]} <= {"node-a", "node-b"}


def test_worker_reports_about_another_nodes_leases_are_ignored(admin: TestClient) -> None:
    """A node may not end another node's lease by calling its worker dead, nor point its
    client at an endpoint of its choosing (where the client would send the lease token)."""
    on_b = remote_lease(admin, "node-b")
    a = agent_token(admin, "node-a")
    before = pool_state(admin)
    for gpu in ("GPU-node-b-0", "GPU-node-a-0"):
        reports = [
            {"lease_id": on_b["id"], "gpu_uuid": gpu, "endpoint": "tcp://6.6.6.6:1"},
            {"lease_id": on_b["id"], "gpu_uuid": gpu, "alive": False, "error": "gone"},
        ]
        beat = admin.post(
            f"{API}/nodes/node-a/heartbeat",
            json={"workers": reports, "telemetry": [{"uuid": "GPU-node-b-0", "power_w": 1.0}]},
            headers=a,
        )
        assert beat.status_code == 200, beat.text
    assert pool_state(admin) == before
    lease = admin.get(f"{API}/leases/{on_b['id']}").json()
    assert lease["state"] == "granted" and all(s["endpoint"] is None for s in lease["slices"])
    gpu_b = admin.get(f"{API}/gpus/GPU-node-b-0").json()
    assert (gpu_b.get("telemetry") or {}).get("power_w") != 1.0


# ---- joining ----------------------------------------------------------------------------------


def test_an_agent_token_must_name_its_node(admin: TestClient) -> None:
    answer = admin.post(f"{API}/tokens", json={"name": "any", "role": "agent"})
    assert answer.status_code == 422 and "--node" in answer.json()["detail"]
    wrong = admin.post(f"{API}/tokens", json={"name": "v", "role": "viewer", "node": "node-a"})
    assert wrong.status_code == 422 and "only an agent token names a node" in wrong.text
    bad = admin.post(f"{API}/tokens", json={"name": "x", "role": "agent", "node": "a/b"})
    assert bad.status_code == 422
    assert not [t for t in admin.get(f"{API}/tokens").json() if t["role"] == "agent"]


def test_a_join_token_makes_one_node_token_per_new_node_within_its_limit(
    admin: TestClient,
) -> None:
    join = make(admin, name="rack-1", role="join", max_nodes=3)
    assert join["joins_left"] == 3 and join["node"] is None
    joiner = bearer(join["token"])
    # It acts for no node itself.
    assert admin.post(f"{API}/nodes", json=node_body("gpu-1"), headers=joiner).status_code == 403
    assert admin.get(f"{API}/nodes", headers=joiner).status_code == 403
    made = admin.post(f"{API}/nodes/gpu-1/join", headers=joiner)
    assert made.status_code == 201, made.text
    assert made.json()["role"] == "agent" and made.json()["node"] == "gpu-1"
    gpu1 = bearer(made.json()["token"])
    assert admin.get(f"{API}/whoami", headers=gpu1).json()["node"] == "gpu-1"
    assert admin.post(f"{API}/nodes", json=node_body("gpu-1"), headers=gpu1).status_code == 201
    assert admin.post(f"{API}/nodes", json=node_body("gpu-9"), headers=gpu1).status_code == 403
    # A node that has a token cannot be joined again (that would be a takeover)...
    again = admin.post(f"{API}/nodes/gpu-1/join", headers=joiner)
    assert again.status_code == 409 and "revoke" in again.json()["detail"]
    taken = admin.post(f"{API}/nodes/node-a/join", headers=joiner)
    assert taken.status_code == 201  # node-a's agent runs with the admin token in this test
    assert admin.post(f"{API}/nodes/node-a/join", headers=joiner).status_code == 409
    # ...and the limit holds.
    assert admin.post(f"{API}/nodes/gpu-2/join", headers=joiner).status_code == 201
    spent = admin.post(f"{API}/nodes/gpu-3/join", headers=joiner)
    assert spent.status_code == 403 and "joined all the nodes it may" in spent.json()["detail"]
    tokens = admin.get(f"{API}/tokens").json()
    assert sorted(t["node"] for t in tokens if t["role"] == "agent") == ["gpu-1", "gpu-2", "node-a"]
    assert next(t for t in tokens if t["id"] == join["id"])["joins_left"] == 0
    events = admin.get(f"{API}/events", params={"kind": "node.joined"}).json()
    assert {e["subject"] for e in events} == {"gpu-1", "gpu-2", "node-a"}
    # Revoking a lost node's token lets it join afresh.
    first = made.json()["id"]
    assert admin.delete(f"{API}/tokens/{first}").status_code == 200
    more = make(admin, name="rack-2", role="join")
    assert admin.post(f"{API}/nodes/gpu-1/join", headers=bearer(more["token"])).status_code == 201


def test_only_a_join_token_joins(admin: TestClient) -> None:
    for role, scope in (("viewer", {}), ("agent", {"node": "node-a"}), ("scheduler", {})):
        token = bearer(make(admin, name=f"{role}-j", role=role, **scope)["token"])
        answer = admin.post(f"{API}/nodes/gpu-5/join", headers=token)
        assert answer.status_code == 403, answer.text
    assert not [t for t in admin.get(f"{API}/tokens").json() if t["node"] == "gpu-5"]


# ---- agent tokens of older databases --------------------------------------------------------


UNBOUND = "names no node"


def test_agent_tokens_of_an_older_database_are_refused_with_how_to_make_a_node_token(
    tmp_path: Path, db_url: str | None
) -> None:
    """A database at revision 0007 holds an agent token that acted for every node; after the
    upgrade it is kept (and listed) but refused everywhere, with the command to run."""
    settings = ControllerSettings(data_dir=tmp_path, db_url=db_url)
    url = settings.database_url()
    engine = create_engine(url)
    with engine.begin() as connection:
        config = alembic_config(url)
        config.attributes["connection"] = connection
        command.upgrade(config, "0007")
    token_id, secret, token = new_token()
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO tokens (id, name, role, tenant, secret_sha256, created_at, created_by)"
                " VALUES (:id, 'k8s', 'agent', NULL, :sha, :at, 'admin:old')"
            ),
            {"id": token_id, "sha": digest(secret), "at": "2026-11-30 10:00:00+00:00"},
        )
    engine.dispose()
    with controller(tmp_path, db_url=db_url) as admin:
        old = bearer(token)
        before = pool_state(admin)
        for method, path, body in (
            ("POST", "/nodes", node_body("node-x")),
            ("POST", "/nodes/node-x/heartbeat", {}),
            ("GET", "/nodes", None),
            ("GET", "/k8s/nodes/node-x/pending", None),
        ):
            answer = admin.request(method, API + path, json=body, headers=old)
            assert answer.status_code == 403, answer.text
            detail = answer.json()["detail"]
            assert UNBOUND in detail and "gpupool token create NODE --role agent --node" in detail
        assert pool_state(admin) == before
        listed = next(t for t in admin.get(f"{API}/tokens").json() if t["id"] == token_id)
        assert listed["role"] == "agent" and listed["node"] is None
