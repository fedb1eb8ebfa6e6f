"""Tokens and roles: every API call is authorised, tenants see their own leases only, admin
actions are in the event log under the token's name, secrets are stored hashed."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from gpupool.controller.app import create_app
from gpupool.controller.settings import ControllerSettings
from tests.conftest import ADMIN_TOKEN
from tests.controller.inprocess import API, TestClient, controller, register


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_token(
    admin: TestClient,
    name: str,
    role: str,
    tenant: str | None = None,
    node: str | None = None,
    **more: object,
) -> str:
    """A new token's secret; an agent token acts for `node` (default: node-a)."""
    body: dict[str, object] = {"name": name, "role": role, **more}
    if tenant is not None:
        body["tenant"] = tenant
    if role == "agent":
        body["node"] = node or "node-a"
    answer = admin.post(f"{API}/tokens", json=body)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["token"])


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[TestClient]:
    with controller(tmp_path) as client:
        register(client, "node-a", gpus=2)
        for name in ("team-a", "team-b"):
            assert client.post(f"{API}/tenants", json={"name": name}).status_code == 201
        yield client


PROTECTED = [
    ("GET", "/leases"),
    ("POST", "/leases"),
    ("GET", "/leases/l-000000000000"),
    ("DELETE", "/leases/l-000000000000"),
    ("GET", "/queue"),
    ("GET", "/gpus"),
    ("POST", "/gpus/GPU-node-a-0/mode"),
    ("GET", "/nodes"),
    ("POST", "/nodes"),
    ("GET", "/tenants"),
    ("POST", "/tenants"),
    ("GET", "/pool"),
    ("GET", "/events"),
    ("GET", "/dashboard/overview"),
    ("GET", "/history?keys=pool.queue_length"),
    ("GET", "/alerts"),
    ("GET", "/tokens"),
    ("GET", "/whoami"),
]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_every_call_without_a_token_is_refused(
    admin: TestClient, method: str, path: str
) -> None:
    answer = admin.request(method, API + path, headers={"Authorization": ""}, json={})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"] == "unauthenticated"
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")


def test_health_and_the_api_document_are_open(admin: TestClient) -> None:
    for path in ("/health", "/openapi.json"):
        assert admin.get(API + path, headers={"Authorization": ""}).status_code == 200


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ("not-a-token", "malformed"),
        ("gpp_zzzzzzzzzzzz_secret", "malformed"),
        ("gpp_0123456789ab_unknown-secret", "not valid"),
    ],
)
def test_bad_tokens_are_refused_with_a_reason(admin: TestClient, token: str, reason: str) -> None:
    answer = admin.get(f"{API}/pool", headers=bearer(token))
    assert answer.status_code == 401
    assert reason in answer.json()["detail"]


def test_a_wrong_secret_for_a_real_id_is_refused(admin: TestClient) -> None:
    real = make_token(admin, "alice", "viewer")
    forged = real[: real.rindex("_") + 1] + "x" * 43
    assert admin.get(f"{API}/pool", headers=bearer(forged)).status_code == 401


def test_secrets_are_stored_as_hashes_only(admin: TestClient, tmp_path: Path) -> None:
    token = make_token(admin, "alice", "viewer")
    token_id, secret = token.removeprefix("gpp_").split("_", 1)
    engine = create_engine(f"sqlite:///{tmp_path / 'gpupool.db'}")
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM tokens")).mappings().all()
    engine.dispose()
    [row] = [r for r in rows if r["id"] == token_id]
    assert row["secret_sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    assert all(secret not in str(value) for r in rows for value in r.values())


def test_revoked_and_expired_tokens_stop_working(admin: TestClient) -> None:
    token = make_token(admin, "alice", "viewer")
    assert admin.get(f"{API}/pool", headers=bearer(token)).status_code == 200
    token_id = token.removeprefix("gpp_").split("_", 1)[0]
    assert admin.delete(f"{API}/tokens/{token_id}").json()["revoked_at"] is not None
    answer = admin.get(f"{API}/pool", headers=bearer(token))
    assert answer.status_code == 401  # at once on this controller, not after the cache ages
    again = admin.delete(f"{API}/tokens/{token_id}")
    assert again.status_code == 409 and "revoked already" in again.json()["detail"]

    brief = admin.post(
        f"{API}/tokens", json={"name": "brief", "role": "viewer", "expires_in_s": 0.5}
    ).json()["token"]
    time.sleep(0.7)
    answer = admin.get(f"{API}/pool", headers=bearer(brief))
    assert answer.status_code == 401 and "expired" in answer.json()["detail"]


def test_the_last_admin_token_cannot_be_revoked(admin: TestClient) -> None:
    me = admin.get(f"{API}/whoami").json()
    answer = admin.delete(f"{API}/tokens/{me['token_id']}")
    assert answer.status_code == 409 and "last admin" in answer.json()["detail"]


def test_token_requests_are_checked(admin: TestClient) -> None:
    cases = [
        ({"name": "x", "role": "tenant"}, 422, "needs --tenant"),
        ({"name": "x", "role": "viewer", "tenant": "team-a"}, 422, "leave out the tenant"),
        ({"name": "x", "role": "tenant", "tenant": "nobody"}, 404, "no tenant"),
        ({"name": "x", "role": "root"}, 422, "role"),
        ({"name": "bad name!", "role": "viewer"}, 422, "name"),
    ]
    before = admin.get(f"{API}/tokens").json()
    for body, status, reason in cases:
        answer = admin.post(f"{API}/tokens", json=body)
        assert answer.status_code == status, (body, answer.text)
        assert reason in answer.text
    assert admin.get(f"{API}/tokens").json() == before


def test_tenants_see_and_act_on_their_own_leases_only(admin: TestClient) -> None:
    a = bearer(make_token(admin, "alice", "tenant", "team-a"))
    b = bearer(make_token(admin, "bob", "tenant", "team-b"))
    mine = admin.post(f"{API}/leases", json={"compute_pct": 10, "memory": "1GiB"}, headers=a)
    assert mine.status_code == 201 and mine.json()["tenant"] == "team-a"  # the token's tenant
    theirs = admin.post(f"{API}/leases", json={"compute_pct": 10, "memory": "1GiB"}, headers=b)
    lease_a, lease_b = mine.json()["id"], theirs.json()["id"]

    other = admin.post(
        f"{API}/leases", json={"tenant": "team-b", "compute_pct": 10, "memory": "1GiB"}, headers=a
    )
    assert other.status_code == 403 and "team-a" in other.json()["detail"]
    assert [x["id"] for x in admin.get(f"{API}/leases", headers=a).json()] == [lease_a]
    assert admin.get(f"{API}/leases", params={"tenant": "team-b"}, headers=a).status_code == 403
    for method, path in (
        ("GET", f"/leases/{lease_b}"),
        ("POST", f"/leases/{lease_b}/heartbeat"),
        ("DELETE", f"/leases/{lease_b}"),
    ):
        answer = admin.request(method, API + path, headers=a)
        assert answer.status_code == 404, (method, path, answer.text)
    assert admin.get(f"{API}/leases/{lease_b}").json()["state"] == "granted"  # untouched
    assert admin.delete(f"{API}/leases/{lease_a}", headers=a).json()["state"] == "released"
    assert [t["name"] for t in admin.get(f"{API}/tenants", headers=a).json()] == ["team-a"]
    assert admin.get(f"{API}/tenants/team-b", headers=a).status_code == 404


def test_tenants_see_their_own_queue_entries_with_real_positions(admin: TestClient) -> None:
    a = bearer(make_token(admin, "alice", "tenant", "team-a"))
    b = bearer(make_token(admin, "bob", "tenant", "team-b"))
    for headers in (b, a):
        body = {"physical": True, "gpus": 2, "ttl_s": 600}
        admin.post(f"{API}/leases", json={"compute_pct": 100, "memory": "1GiB"}, headers=headers)
        assert admin.post(f"{API}/leases", json=body, headers=headers).json()["state"] == "queued"
    queue = admin.get(f"{API}/queue", headers=a).json()
    assert [(e["position"], e["lease"]["tenant"]) for e in queue] == [(2, "team-a")]
    assert len(admin.get(f"{API}/queue").json()) == 2


@pytest.mark.parametrize(
    ("role", "method", "path", "body"),
    [
        ("tenant", "POST", "/gpus/GPU-node-a-0/mode", {"mode": "physical"}),
        ("tenant", "POST", "/gpus/GPU-node-a-0/drain", None),
        ("tenant", "POST", "/tenants", {"name": "mine"}),
        ("tenant", "PATCH", "/tenants/team-a", {"weight": 5}),
        ("tenant", "GET", "/events", None),
        ("tenant", "GET", "/dashboard/overview", None),
        ("tenant", "POST", "/tokens", {"name": "x", "role": "admin"}),
        ("tenant", "POST", "/nodes/node-a/heartbeat", {}),
        ("viewer", "POST", "/leases", {"compute_pct": 10, "memory": "1GiB"}),
        ("viewer", "POST", "/gpus/GPU-node-a-0/clear", None),
        ("viewer", "DELETE", "/nodes/node-a", None),
        ("viewer", "GET", "/tokens", None),
        ("agent", "POST", "/leases", {"compute_pct": 10, "memory": "1GiB"}),
        ("agent", "POST", "/gpus/GPU-node-a-0/mode", {"mode": "physical"}),
        ("agent", "GET", "/leases", None),
        ("agent", "POST", "/k8s/claims", {"claim": "c", "node": "node-a", "request": {}}),
        ("agent", "POST", "/k8s/placement", {"nodes": ["node-a"], "request": {}}),
        ("join", "GET", "/nodes", None),
        ("join", "POST", "/nodes", {"name": "node-a"}),
        ("join", "POST", "/nodes/node-a/heartbeat", {}),
        ("join", "POST", "/gpus/GPU-node-a-0/isolate", {"reason": "x", "fault": True}),
        ("join", "POST", "/leases", {"compute_pct": 10, "memory": "1GiB"}),
        ("scheduler", "POST", "/nodes", {"name": "node-a"}),
        ("scheduler", "POST", "/nodes/node-a/heartbeat", {}),
        ("scheduler", "POST", "/gpus/GPU-node-a-0/isolate", {"reason": "x", "fault": True}),
        ("scheduler", "GET", "/k8s/nodes/node-a/pending", None),
        ("scheduler", "POST", "/leases", {"compute_pct": 10, "memory": "1GiB"}),
    ],
)
def test_roles_are_refused_what_they_may_not_do(
    admin: TestClient, role: str, method: str, path: str, body: object
) -> None:
    token = make_token(admin, f"{role}-x", role, "team-a" if role == "tenant" else None)
    before = admin.get(f"{API}/gpus").json(), admin.get(f"{API}/tenants").json()
    answer = admin.request(method, API + path, headers=bearer(token), json=body)
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"] == "forbidden" and role in answer.json()["detail"]
    assert (admin.get(f"{API}/gpus").json(), admin.get(f"{API}/tenants").json()) == before


def test_viewers_read_everything_and_agents_register_nodes(admin: TestClient) -> None:
    viewer = bearer(make_token(admin, "watcher", "viewer"))
    for path in ("/leases", "/queue", "/gpus", "/nodes", "/tenants", "/pool", "/events"):
        assert admin.get(API + path, headers=viewer).status_code == 200, path
    agent = bearer(make_token(admin, "node-b", "agent", node="node-b"))
    node = {
        "name": "node-b",
        "gpus": [{"uuid": "GPU-b-0", "index": 0, "model": "H100", "memory_mib": 81920}],
    }
    assert admin.post(f"{API}/nodes", json=node, headers=agent).status_code == 201
    beat = admin.post(f"{API}/nodes/node-b/heartbeat", json={}, headers=agent)
    assert beat.status_code == 200, beat.text
    isolate = admin.post(
        f"{API}/gpus/GPU-b-0/isolate", json={"reason": "xid 79", "fault": True}, headers=agent
    )
    assert isolate.status_code == 200


def test_admin_actions_are_in_the_event_log_under_the_token_name(admin: TestClient) -> None:
    ops = make_token(admin, "ops-carol", "admin")
    headers = bearer(ops)
    admin.post(f"{API}/gpus/GPU-node-a-1/mode", json={"mode": "physical"}, headers=headers)
    admin.patch(f"{API}/tenants/team-a", json={"weight": 3}, headers=headers)
    viewer = make_token(admin, "watcher", "viewer")
    viewer_id = viewer.removeprefix("gpp_").split("_", 1)[0]
    admin.delete(f"{API}/tokens/{viewer_id}", headers=headers)
    events = admin.get(f"{API}/events", params={"limit": 1000}).json()
    by_carol = {(e["kind"], e["subject"]) for e in events if e["actor"] == "admin:ops-carol"}
    assert {
        ("gpu.mode", "GPU-node-a-1"),
        ("tenant.updated", "team-a"),
        ("token.revoked", viewer_id),
    } <= by_carol
    created = [e for e in events if e["kind"] == "token.created" and e["subject"] == viewer_id]
    assert created and created[0]["actor"] == "admin:bootstrap"


def test_the_dashboard_session_cookie_needs_the_csrf_header_for_writes(
    admin: TestClient,
) -> None:
    viewer = make_token(admin, "watcher", "viewer")
    bad = admin.post(f"{API}/session", json={"token": "gpp_0123456789ab_nope"})
    assert bad.status_code == 401
    signed = admin.post(f"{API}/session", json={"token": ADMIN_TOKEN})
    assert signed.status_code == 200 and signed.json()["role"] == "admin"
    cookie = signed.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    session = admin.cookies.get("gpupool_session")
    assert session == ADMIN_TOKEN
    no_bearer = {"Authorization": ""}
    assert admin.get(f"{API}/gpus", headers=no_bearer).status_code == 200
    forged = admin.post(f"{API}/tenants", json={"name": "csrf"}, headers=no_bearer)
    assert forged.status_code == 403 and "X-Gpupool-Csrf" in forged.json()["detail"]
    allowed = admin.post(
        f"{API}/tenants", json={"name": "csrf"}, headers={**no_bearer, "X-Gpupool-Csrf": "1"}
    )
    assert allowed.status_code == 201
    admin.post(f"{API}/session", json={"token": viewer})
    who = admin.get(f"{API}/whoami", headers=no_bearer).json()
    assert who["role"] == "viewer"
    assert admin.delete(f"{API}/session").status_code == 204
    assert admin.get(f"{API}/gpus", headers=no_bearer).status_code == 401


def test_deleting_a_tenant_deletes_its_tokens(admin: TestClient) -> None:
    token = make_token(admin, "temp", "tenant", "team-b")
    assert admin.delete(f"{API}/tenants/team-b").status_code == 204
    assert admin.get(f"{API}/pool", headers=bearer(token)).status_code == 401
    assert all(t["tenant"] != "team-b" for t in admin.get(f"{API}/tokens?all=true").json())


def test_the_first_start_writes_an_admin_token_for_its_owner_only(tmp_path: Path) -> None:
    settings = ControllerSettings(data_dir=tmp_path, admin_token=None)
    with TestClient(create_app(settings)) as client:
        path = tmp_path / "admin.token"
        token = path.read_text().strip()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        me = client.get(f"{API}/whoami", headers=bearer(token)).json()
        assert (me["role"], me["name"]) == ("admin", "first-admin")
    path.unlink()
    with TestClient(create_app(settings)) as client:
        # An admin exists already: no second token is made, no file is written.
        assert not path.exists()
        assert client.get(f"{API}/whoami", headers=bearer(token)).status_code == 200


def test_a_malformed_admin_token_stops_the_start(tmp_path: Path) -> None:
    settings = ControllerSettings(data_dir=tmp_path, admin_token="hunter2")
    with pytest.raises(Exception, match="malformed"), TestClient(create_app(settings)):
        pass
