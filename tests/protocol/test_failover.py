"""Clients given several controller URLs: they reach the one that answers, and say clearly
when none does."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from gpupool.client.sdk import ControllerUnreachable, PoolClient
from gpupool.protocol.failover import (
    PAUSE_S,
    AsyncFailoverTransport,
    Attempt,
    FailoverTransport,
    Outcome,
    Rotation,
    split_urls,
)
from tests.conftest import free_port


def test_urls_are_split_and_normalised() -> None:
    assert split_urls(" ctl-a:8900, http://ctl-b:8900/ ,") == [
        "http://ctl-a:8900",
        "http://ctl-b:8900",
    ]
    with pytest.raises(ValueError, match="no controller URL"):
        split_urls(" , ")


URLS = ["http://a:1", "http://b:1", "http://c:1"]


def test_an_attempt_moves_on_rests_after_each_round_and_gives_up_at_its_deadline() -> None:
    attempt = Attempt(Rotation(URLS, budget_s=10.0), now=100.0)
    assert attempt.index == 0
    assert attempt.next_pause(Outcome.UNREACHABLE, now=100.1) == 0.0
    assert attempt.index == 1
    assert attempt.next_pause(Outcome.NOT_LEADING, now=100.2) == 0.0
    # Three controllers tried, none leads: rest before the next round.
    assert attempt.next_pause(Outcome.UNREACHABLE, now=100.3) == PAUSE_S
    assert attempt.index == 0
    # At the deadline the last outcome stands: no more sends, the index stays.
    assert attempt.next_pause(Outcome.NOT_LEADING, now=110.0) is None
    assert attempt.next_pause(Outcome.UNREACHABLE, now=110.0) is None
    assert attempt.index == 0


def test_an_answer_ends_the_attempt_and_later_requests_follow_the_leader_named() -> None:
    rotation = Rotation(URLS, budget_s=10.0)
    first = Attempt(rotation, now=0.0)
    assert first.next_pause(Outcome.UNREACHABLE, now=0.0) == 0.0
    # A concurrent request starts where the rotation stands now: past the dead controller.
    assert Attempt(rotation, now=0.0).index == 1
    # Controller b answers (a forwarded answer) and names c as the leader.
    assert first.next_pause(Outcome.ANSWERED, now=0.1, leader="http://c:1/") is None
    assert Attempt(rotation, now=0.2).index == 2
    # A leader the client was not given is no hint to follow.
    assert Attempt(rotation, now=0.3).next_pause(Outcome.ANSWERED, 0.3, "http://x:1") is None
    assert Attempt(rotation, now=0.4).index == 2


def _scripted_controllers(seen: list[str]) -> httpx.MockTransport:
    """a is down, b is a standby that knows no leader, c leads."""
    not_leader = {"error": "not_leader", "detail": "no controller leads"}

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host}{request.url.path}")
        if request.url.host == "a":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.host == "b":
            return httpx.Response(503, json=not_leader)
        return httpx.Response(200, json={"by": request.url.host})

    return httpx.MockTransport(handle)


def test_the_sync_and_async_transports_walk_the_controllers_the_same_way() -> None:
    sync_seen: list[str] = []
    with httpx.Client(transport=FailoverTransport(URLS, _scripted_controllers(sync_seen))) as c:
        sync_answers = [c.get("http://a:1/x").json()["by"] for _ in range(2)]

    async def run_async() -> list[str]:
        transport = AsyncFailoverTransport(URLS, _scripted_controllers(async_seen))
        async with httpx.AsyncClient(transport=transport) as client:
            return [(await client.get("http://a:1/x")).json()["by"] for _ in range(2)]

    async_seen: list[str] = []
    async_answers = asyncio.run(run_async())
    # a refused, b had no leader, c answered; the second request went straight to c.
    assert sync_seen == async_seen == ["a/x", "b/x", "c/x", "c/x"]
    assert sync_answers == async_answers == ["c", "c"]


class _CutOff(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that breaks off after the headers: a controller killed mid-answer."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")
        yield b""

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")
        yield b""


def test_an_answer_cut_off_mid_body_goes_on_to_the_next_controller() -> None:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url.host))
        if request.url.host == "a":
            return httpx.Response(200, headers={"Content-Length": "539"}, stream=_CutOff())
        return httpx.Response(200, json={"by": request.url.host})

    with httpx.Client(transport=FailoverTransport(URLS, httpx.MockTransport(handle))) as client:
        assert client.post("http://a:1/x").json() == {"by": "b"}
    assert seen == ["a", "b"]

    async def run_async() -> dict[str, str]:
        transport = AsyncFailoverTransport(URLS, httpx.MockTransport(handle))
        async with httpx.AsyncClient(transport=transport) as client:
            return (await client.post("http://a:1/x")).json()  # type: ignore[no-any-return]

    seen.clear()
    assert asyncio.run(run_async()) == {"by": "b"}
    assert seen == ["a", "b"]


def test_a_non_retryable_answer_is_handed_back_at_once() -> None:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url.host))
        return httpx.Response(503, json={"error": "draining", "detail": "shutting down"})

    with httpx.Client(transport=FailoverTransport(URLS, httpx.MockTransport(handle))) as client:
        assert client.get("http://a:1/x").status_code == 503
    assert seen == ["a"]


def test_the_sdk_moves_past_a_dead_controller_to_a_live_one(start_controller) -> None:
    live = start_controller(None)
    dead = f"http://127.0.0.1:{free_port()}"
    with PoolClient(f"{dead},{live.url}") as sdk:
        assert sdk.health()["status"] == "ok"
        tenant = sdk.tenant("default")
        assert tenant.name == "default"


def test_no_live_controller_is_one_clear_error_after_the_failover_time() -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    started = time.monotonic()
    with PoolClient(",".join(dead), failover_s=1.0) as sdk, pytest.raises(ControllerUnreachable):
        sdk.health()
    assert time.monotonic() - started >= 1.0


def test_the_cli_refuses_a_url_list_that_names_no_controller() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.cli", "--url", " , ", "pool"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no controller URL" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_leader_that_lost_its_database_passes_the_request_on() -> None:
    """A leader cut off from its database answers 503 storage_unavailable until it notices it
    leads no more; the standby that took over serves the request (a lease request's
    request_id makes the resend safe)."""
    seen: list[str] = []
    lost = {"error": "storage_unavailable", "detail": "the controller's database cannot answer"}

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url.host))
        if request.url.host == "a":
            return httpx.Response(503, json=lost)
        return httpx.Response(201, json={"by": request.url.host})

    with httpx.Client(transport=FailoverTransport(URLS, httpx.MockTransport(handle))) as client:
        assert client.post("http://a:1/leases").json() == {"by": "b"}
    assert seen == ["a", "b"]
    # With every controller cut off, the last 503 is the caller's once the budget is spent.
    always = httpx.MockTransport(lambda request: httpx.Response(503, json=lost))
    with httpx.Client(transport=FailoverTransport(URLS, always, budget_s=0.0)) as client:
        response = client.post("http://a:1/leases")
    assert response.status_code == 503 and response.json()["error"] == "storage_unavailable"
