"""The SDK turns answers into models and failures into ApiError / ControllerUnreachable."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient, resolve_url
from gpupool.protocol.v1.api import LeaseCreate

NOW = datetime(2026, 1, 1, tzinfo=UTC).isoformat()


def lease_json(state: str, position: int | None = None) -> dict[str, Any]:
    return {
        "id": "l-1",
        "tenant": "default",
        "state": state,
        "gpus": 1,
        "compute_pct": 25,
        "memory_mib": 1024,
        "physical": False,
        "priority": 0,
        "access": "direct",
        "holder": "",
        "ttl_s": 30.0,
        "created_at": NOW,
        "granted_at": None,
        "released_at": None,
        "last_heartbeat_at": NOW,
        "release_reason": None,
        "slices": [],
        "queue_position": position,
    }


def client_for(handler: Any, actor: str | None = None) -> PoolClient:
    return PoolClient("http://pool.test", actor=actor, transport=httpx.MockTransport(handler))


def test_error_answer_becomes_api_error_with_code_and_detail() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, json={"error": "quota_exceeded", "detail": "GPUs would be 3"})

    with pytest.raises(ApiError) as caught, client_for(handler) as client:
        client.create_lease(LeaseCreate(gpus=3))
    assert (caught.value.status, caught.value.code) == (403, "quota_exceeded")
    assert caught.value.detail == "GPUs would be 3"
    assert caught.value.is_client_error


def test_framework_validation_errors_are_read_too() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        detail = [{"loc": ["body", "gpus"], "msg": "Input should be greater than 0"}]
        return httpx.Response(422, json={"detail": detail})

    with pytest.raises(ApiError) as caught, client_for(handler) as client:
        client.leases()
    assert caught.value.detail == "gpus: Input should be greater than 0"


def test_server_error_without_json_is_still_an_api_error() -> None:
    with (
        pytest.raises(ApiError) as caught,
        client_for(lambda r: httpx.Response(500, text="boom")) as c,
    ):
        c.pool()
    assert caught.value.status == 500
    assert not caught.value.is_client_error


def test_requests_carry_actor_body_and_query() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, json=lease_json("granted"))

    with client_for(handler, actor="alice") as client:
        client.create_lease(LeaseCreate(compute_pct="25%", memory="1GiB"))
    request = seen[0]
    assert request.url.path == "/api/v1/leases"
    assert request.headers["X-Gpupool-Actor"] == "alice"
    body = json.loads(request.content)
    assert body["compute_pct"] == 25
    assert body["memory"] == "1GiB"


def test_path_segments_are_quoted() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path.decode())
        return httpx.Response(404, json={"error": "not_found", "detail": "no"})

    with pytest.raises(ApiError), client_for(handler) as client:
        client.gpu("a/b")
    assert seen == ["/api/v1/gpus/a%2Fb"]


def test_wait_for_grant_heartbeats_until_the_lease_leaves_the_queue() -> None:
    answers = [lease_json("queued", 2), lease_json("queued", 1), lease_json("granted")]
    beats: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        beats.append(request.url.path)
        return httpx.Response(200, json=answers[len(beats) - 1])

    updates: list[int | None] = []
    with client_for(handler) as client:
        lease = client.wait_for_grant(
            "l-1", on_update=lambda now: updates.append(now.queue_position), poll_interval_s=0.01
        )
    assert lease.state == "granted"
    assert beats == ["/api/v1/leases/l-1/heartbeat"] * 3
    assert updates == [2, 1, None]


def test_wait_for_grant_gives_up_after_its_timeout() -> None:
    handler = lambda request: httpx.Response(200, json=lease_json("queued", 1))  # noqa: E731
    with pytest.raises(TimeoutError), client_for(handler) as client:
        client.wait_for_grant("l-1", timeout=0.05, poll_interval_s=0.01)


def test_no_listener_is_controller_unreachable_with_the_url() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ControllerUnreachable) as caught, PoolClient(url, timeout=2) as client:
        client.health()
    assert url in str(caught.value)
    assert "connection refused" in str(caught.value)


def test_url_resolution_prefers_argument_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_URL", "http://env:1/")
    assert resolve_url("http://arg:2") == "http://arg:2"
    assert resolve_url(None) == "http://env:1"
    monkeypatch.delenv("GPUPOOL_URL")
    assert resolve_url(None) == "http://127.0.0.1:8900"
    assert resolve_url("pool:8900") == "http://pool:8900"


def test_wait_for_grant_rides_out_a_short_controller_outage() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 2:
            raise httpx.ConnectError("connection refused", request=request)
        state = "granted" if len(calls) >= 3 else "queued"
        return httpx.Response(200, json=lease_json(state, None if state == "granted" else 1))

    with client_for(handler) as client:
        lease = client.wait_for_grant("l-1", poll_interval_s=0.01)
    assert lease.state == "granted"
    assert len(calls) == 3


def test_wait_for_grant_gives_up_when_the_controller_stays_away() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(ControllerUnreachable), client_for(handler) as client:
        client.wait_for_grant("l-1", poll_interval_s=0.01, unreachable_grace_s=0.05)
