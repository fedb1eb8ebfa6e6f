"""Priorities with limits: a tenant token asks at most its tenant's cap (else the pool's
default, 0 unless the operator says otherwise), an admin any; and a preemption lasts only
while the request that caused it waits: released, expired or granted elsewhere before the
victims are gone, it is withdrawn and the victims keep their leases."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupool.controller.services import leases
from gpupool.controller.store import Store
from tests.controller.inprocess import API, TestClient, controller, register
from tests.timing import scaled

SLICE = {"compute_pct": 100, "memory": "8GiB"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def tenant_token(admin: TestClient, tenant: str, **quota: object) -> dict[str, str]:
    made = admin.post(f"{API}/tenants", json={"name": tenant, "quota": quota})
    assert made.status_code == 201, made.text
    token = admin.post(f"{API}/tokens", json={"name": tenant, "role": "tenant", "tenant": tenant})
    assert token.status_code == 201, token.text
    return bearer(token.json()["token"])


def wait_for(check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll until `check()` is truthy (the reconcile loop acts on its own schedule)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[TestClient]:
    with controller(tmp_path, preempt_grace_s=30.0) as client:
        register(client, "node-a", gpus=1)
        yield client


def nothing_queued(admin: TestClient) -> bool:
    return admin.get(f"{API}/queue").json() == [] and admin.get(f"{API}/leases").json() == []


# ---- the cap ----------------------------------------------------------------------------


def test_a_tenant_above_the_default_cap_is_refused_with_the_cap_and_nothing_is_queued(
    admin: TestClient,
) -> None:
    team = tenant_token(admin, "team-a")
    answer = admin.post(f"{API}/leases", json={**SLICE, "priority": 1000}, headers=team)
    assert answer.status_code == 403, answer.text
    detail = answer.json()["detail"]
    assert answer.json()["error"] == "quota_exceeded"
    assert "priority 1000" in detail and ": 0 (the pool's default max priority" in detail
    assert nothing_queued(admin)
    events = admin.get(f"{API}/events", params={"kind": "lease.created"}).json()
    assert events == []
    ok = admin.post(f"{API}/leases", json={**SLICE, "priority": 0}, headers=team)
    assert ok.status_code == 201, ok.text


def test_a_tenants_own_cap_replaces_the_default_and_an_admin_may_ask_any_priority(
    admin: TestClient,
) -> None:
    team = tenant_token(admin, "team-a", max_priority=50)
    over = admin.post(f"{API}/leases", json={**SLICE, "priority": 51}, headers=team)
    assert over.status_code == 403
    assert ": 50 (tenant team-a's max_priority)" in over.json()["detail"]
    assert nothing_queued(admin)
    at = admin.post(f"{API}/leases", json={**SLICE, "priority": 50, "wait": False}, headers=team)
    assert at.status_code == 201, at.text
    assert admin.delete(f"{API}/leases/{at.json()['id']}", headers=team).status_code == 200
    by_admin = admin.post(f"{API}/leases", json={**SLICE, "tenant": "team-a", "priority": 1000})
    assert by_admin.status_code == 201 and by_admin.json()["priority"] == 1000


def test_the_default_cap_is_the_operators_setting(tmp_path: Path) -> None:
    with controller(tmp_path, default_max_priority=10) as admin:
        register(admin, "node-a", gpus=1)
        team = tenant_token(admin, "team-a")
        assert admin.post(f"{API}/leases", json={**SLICE, "priority": 10}, headers=team).is_success
        over = admin.post(f"{API}/leases", json={**SLICE, "priority": 11}, headers=team)
        assert over.status_code == 403 and ": 10 (the pool's default" in over.json()["detail"]


def test_a_pods_claim_is_capped_even_when_the_extender_holds_an_admin_token(
    admin: TestClient,
) -> None:
    """The priority of a claim comes from the pod, which its tenant wrote."""
    tenant_token(admin, "team-a")
    claim = {
        "claim": "c-prio00000001",
        "node": "node-a",
        "pod": "ns/pod",
        "request": {**SLICE, "tenant": "team-a", "priority": 1000},
    }
    answer = admin.post(f"{API}/k8s/claims", json=claim)
    assert answer.status_code == 403 and "priority 1000" in answer.json()["detail"]
    assert nothing_queued(admin)


# ---- withdrawal -----------------------------------------------------------------------------


def store_of(admin: TestClient) -> Store:
    store: Store = admin.app.state.store  # type: ignore[attr-defined]
    return store


def end_preempted_later(admin: TestClient, seconds: float) -> int:
    """Run the grace-period check as if `seconds` had passed, on the store's writer."""
    store = store_of(admin)
    later = time.time() + seconds

    async def run() -> int:
        return await store.write(lambda s: leases.end_preempted(store, s, now=later))

    assert admin.portal is not None
    return admin.portal.call(run)


def lease(admin: TestClient, lease_id: str) -> dict[str, Any]:
    answer: dict[str, Any] = admin.get(f"{API}/leases/{lease_id}").json()
    return answer


def preempted(admin: TestClient, victim: str) -> bool:
    return lease(admin, victim)["state"] == "preempted"


def test_a_request_withdrawn_quickly_does_not_end_the_victims_lease(admin: TestClient) -> None:
    victim_team = tenant_token(admin, "team-v")
    urgent_team = tenant_token(admin, "team-u", max_priority=1000)
    victim = admin.post(f"{API}/leases", json=SLICE, headers=victim_team).json()["id"]
    urgent = admin.post(f"{API}/leases", json={**SLICE, "priority": 1000}, headers=urgent_team)
    assert urgent.status_code == 201 and urgent.json()["state"] == "queued"
    wait_for(lambda: preempted(admin, victim))
    assert "lease " + urgent.json()["id"] in lease(admin, victim)["release_reason"]
    # The request goes away before the victim did.
    gone = admin.delete(f"{API}/leases/{urgent.json()['id']}", headers=urgent_team)
    assert gone.status_code == 200
    kept = lease(admin, victim)
    assert kept["state"] == "active" and kept["release_reason"] is None
    events = admin.get(f"{API}/events", params={"kind": "lease.preemption_withdrawn"}).json()
    assert [e["subject"] for e in events] == [victim]
    assert "was released or expired" in events[0]["message"]
    assert "this lease is kept" in events[0]["message"]
    # Long after the grace period, the victim still holds its GPU.
    assert end_preempted_later(admin, 3600) == 0
    assert lease(admin, victim)["state"] == "active"
    assert victim in admin.get(f"{API}/gpus/GPU-node-a-0").json()["leases"]
    # The same check does end a preemption whose request still waits (the control case).
    again = admin.post(f"{API}/leases", json={**SLICE, "priority": 1000}, headers=urgent_team)
    wait_for(lambda: preempted(admin, victim))
    assert end_preempted_later(admin, 3600) == 1
    ended = lease(admin, victim)
    assert ended["state"] == "released" and ended["release_reason"].startswith("preempted")
    wait_for(lambda: lease(admin, again.json()["id"])["state"] == "granted")


def test_a_request_granted_elsewhere_before_its_victims_are_gone_withdraws_the_preemption(
    tmp_path: Path,
) -> None:
    with controller(tmp_path, preempt_grace_s=30.0) as admin:
        register(admin, "node-a", gpus=2)
        victim_team = tenant_token(admin, "team-v")
        urgent_team = tenant_token(admin, "team-u", max_priority=500)
        victim = admin.post(f"{API}/leases", json=SLICE, headers=victim_team).json()["id"]
        # The other GPU is held by an admin's lease above the request's priority.
        other = admin.post(f"{API}/leases", json={**SLICE, "tenant": "team-v", "priority": 900})
        assert other.json()["state"] == "granted"
        urgent = admin.post(f"{API}/leases", json={**SLICE, "priority": 500}, headers=urgent_team)
        wait_for(lambda: preempted(admin, victim))
        # Room appears elsewhere first: the request is granted there.
        assert admin.delete(f"{API}/leases/{other.json()['id']}").status_code == 200
        granted = lease(admin, urgent.json()["id"])
        assert granted["state"] == "granted"
        assert {s["gpu_uuid"] for s in granted["slices"]} != {
            s["gpu_uuid"] for s in lease(admin, victim)["slices"]
        }
        assert lease(admin, victim)["state"] == "active"
        events = admin.get(f"{API}/events", params={"kind": "lease.preemption_withdrawn"}).json()
        assert [e["subject"] for e in events] == [victim]
        assert "was granted before this lease was gone" in events[0]["message"]
        assert end_preempted_later(admin, 3600) == 0
        assert lease(admin, victim)["state"] == "active"


def test_a_withdrawal_survives_a_controller_restart(tmp_path: Path, db_url: str | None) -> None:
    """The cause of a preemption is stored: released after a restart, it still withdraws."""
    with controller(tmp_path, db_url=db_url, preempt_grace_s=300.0) as admin:
        register(admin, "node-a", gpus=1)
        victim_team = tenant_token(admin, "team-v")
        victim = admin.post(f"{API}/leases", json={**SLICE, "ttl_s": 3600}, headers=victim_team)
        urgent = admin.post(
            f"{API}/leases", json={**SLICE, "tenant": "team-v", "priority": 9, "ttl_s": 3600}
        )
        wait_for(lambda: preempted(admin, victim.json()["id"]))
    with controller(tmp_path, db_url=db_url, preempt_grace_s=300.0) as admin:
        assert lease(admin, victim.json()["id"])["state"] == "preempted"
        assert admin.delete(f"{API}/leases/{urgent.json()['id']}").status_code == 200
        assert lease(admin, victim.json()["id"])["state"] == "active"
        assert end_preempted_later(admin, 3600) == 0


def test_a_request_that_expires_before_its_victim_is_gone_withdraws_the_preemption(
    admin: TestClient,
) -> None:
    victim_team = tenant_token(admin, "team-v")
    urgent_team = tenant_token(admin, "team-u", max_priority=1000)
    victim = admin.post(f"{API}/leases", json=SLICE, headers=victim_team).json()["id"]
    # Its holder sends no heartbeat: the queued request expires after its ttl.
    urgent = admin.post(
        f"{API}/leases", json={**SLICE, "priority": 1000, "ttl_s": 1.5}, headers=urgent_team
    ).json()["id"]
    wait_for(lambda: preempted(admin, victim))
    ended = wait_for(lambda: (lease(admin, urgent)["state"] == "released") and lease(admin, urgent))
    assert ended["release_reason"] == "holder stopped heartbeating"  # it expired
    wait_for(lambda: lease(admin, victim)["state"] == "active")
    events = admin.get(f"{API}/events", params={"kind": "lease.preemption_withdrawn"}).json()
    assert [e["subject"] for e in events] == [victim]
    assert end_preempted_later(admin, 3600) == 0
