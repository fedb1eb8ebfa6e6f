"""Creating a tenant is idempotent: a create resent (after a controller failover, say) with the
same settings answers with the tenant it made; other settings are refused with the differences.
"""

from __future__ import annotations

import pytest

from gpupool.client.sdk import ApiError, PoolClient
from gpupool.protocol.v1.api import QuotaIn, TenantCreate
from tests.conftest import ADMIN_TOKEN, register_fake_node

BODY = {
    "name": "team-a",
    "weight": 2.5,
    "quota": {"max_compute_pct": 400, "max_memory": "160GiB", "max_leases": 8},
    "idle_timeout_s": 300,
}


def test_a_resent_create_answers_with_the_tenant_and_a_different_one_says_why(
    start_controller, db_url
) -> None:
    ctl = start_controller(db_url)
    with ctl.client() as client:
        first = client.post("/tenants", json=BODY)
        assert first.status_code == 201, first.text
        again = client.post("/tenants", json=BODY)
        assert again.status_code == 200, again.text
        assert again.json() == first.json()
        events = client.get("/events", params={"kind": "tenant.created", "subject": "team-a"})
        assert len(events.json()) == 1, "a resent create is not a second creation"

        other = {**BODY, "quota": {**BODY["quota"], "max_compute_pct": 300}, "weight": 1}
        refused = client.post("/tenants", json=other)
        assert refused.status_code == 409, refused.text
        assert refused.json()["detail"] == (
            "tenant 'team-a' exists already with other settings: "
            "weight is 2.5 (asked 1); max_compute_pct is 400 (asked 300)"
        )
        # Leaving a limit out asks for none: that differs from the tenant's limit too.
        unlimited = client.post("/tenants", json={**BODY, "quota": {"max_leases": 8}})
        assert unlimited.status_code == 409
        assert "max_memory is 160 GiB (asked no limit)" in unlimited.json()["detail"]
        assert client.get("/tenants/team-a").json() == first.json()


def test_the_sdk_creating_a_tenant_twice_gets_the_same_tenant(start_controller, db_url) -> None:
    ctl = start_controller(db_url)
    body = TenantCreate(name="team-b", quota=QuotaIn(max_gpus=2))
    with PoolClient(ctl.url, token=ADMIN_TOKEN) as sdk:
        assert sdk.create_tenant(body) == sdk.create_tenant(body)
        with pytest.raises(ApiError) as refused:
            sdk.create_tenant(TenantCreate(name="team-b"))
        assert (refused.value.status, refused.value.code) == (409, "conflict")
        assert refused.value.detail.endswith("max_gpus is 2 (asked no limit)")


def test_a_tenant_with_history_is_deleted_and_stays_deleted_after_a_restart(
    start_controller, db_url
) -> None:
    ctl = start_controller(db_url)
    with ctl.client() as client:
        register_fake_node(client)
        assert client.post("/tenants", json={"name": "team-c"}).status_code == 201
        lease = client.post("/leases", json={"tenant": "team-c", "compute_pct": 10}).json()
        refused = client.delete("/tenants/team-c")
        assert refused.status_code == 409 and "release them first" in refused.json()["detail"]
        assert client.post(f"/leases/{lease['id']}/release").status_code == 200
        assert client.delete("/tenants/team-c").status_code == 204
    ctl.restart()
    with ctl.client() as client:
        assert client.get("/tenants/team-c").status_code == 404
        assert "team-c" not in [t["name"] for t in client.get("/tenants").json()]
        history = client.get("/leases", params={"state": "all", "tenant": "team-c"}).json()
        assert [item["id"] for item in history] == [lease["id"]]
        gone = client.post("/leases", json={"tenant": "team-c", "compute_pct": 10})
        assert gone.status_code == 422 and gone.json()["detail"] == "no tenant 'team-c'"
        again = client.post("/tenants", json={"name": "team-c", "quota": {"max_gpus": 1}})
        assert again.status_code == 201 and again.json()["max_gpus"] == 1
        events = client.get("/events", params={"subject": "team-c"}).json()
        assert [e["kind"] for e in events][-2:] == ["tenant.deleted", "tenant.created"]
        assert "lease(s) kept" in events[-2]["message"]
