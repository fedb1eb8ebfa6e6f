"""Reaching one of several controllers (high availability) through one httpx transport: each
request goes to the controller that answered last, and moves on to the next one while a
controller is down or does not lead.

Resending is safe for every request of the API: reads and heartbeats change nothing twice,
releases of a released lease answer the same, and the SDK gives each lease request a
`request_id` that makes a resent request find the lease its first send made.
"""

from __future__ import annotations

import asyncio
import enum
import json
import threading
import time

import httpx

DEFAULT_BUDGET_S = 20.0
"""How long one request keeps trying the controllers: a takeover takes about a second,
a controller that is cut off costs a connect timeout."""
LEADER_HEADER = "x-gpupool-leader"
"""A standby names the leader on the answers it forwarded from it."""
PAUSE_S = 0.25
"""Rest after each full round of the controllers, so a pool with no leader is not hammered."""


def split_urls(value: str) -> list[str]:
    """`http://a:8900, b:8900` → normalised base URLs; raises ValueError when none is given."""
    urls = []
    for part in value.split(","):
        url = part.strip()
        if not url:
            continue
        if "://" not in url:
            url = f"http://{url}"
        urls.append(url.rstrip("/"))
    if not urls:
        raise ValueError(f"no controller URL in {value!r}")
    return urls


PASS_ON_ERRORS = frozenset({"not_leader", "storage_unavailable"})
"""The 503s another controller may not give: a standby's while no controller leads (another
will soon), and a leader's that has lost its database (cut off, it is no leader for long:
the standby that can reach the database takes over)."""


def not_leading(response: httpx.Response) -> bool:
    """Whether this controller cannot serve the request where another may (PASS_ON_ERRORS)."""
    if response.status_code != 503:
        return False
    try:
        body = json.loads(response.content)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("error") in PASS_ON_ERRORS


class Rotation:
    """Which controller to ask, shared by every request of one client."""

    def __init__(self, urls: list[str], budget_s: float) -> None:
        if not urls:
            raise ValueError("a failover needs at least one controller URL")
        self.urls = urls
        self.budget_s = budget_s
        self.current = 0
        self._lock = threading.Lock()

    def retarget(self, request: httpx.Request, index: int) -> httpx.Request:
        """The same request, sent to controller `index` instead of the first one."""
        url = str(request.url)
        first = self.urls[0]
        if url.startswith(first):
            url = self.urls[index] + url[len(first) :]
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"host"]
        return httpx.Request(
            request.method,
            url,
            headers=headers,
            content=request.content,
            extensions=request.extensions,
        )

    def start(self) -> int:
        with self._lock:
            return self.current

    def answered(self, index: int, leader: str | None) -> None:
        """Follow a standby's hint: ask the leader it named first from now on."""
        if leader is None:
            return
        leader = leader.rstrip("/")
        if leader in self.urls:
            with self._lock:
                if self.current == index:
                    self.current = self.urls.index(leader)

    def moved_on(self, failed: int) -> int:
        """The next controller after `failed`; other requests follow the move."""
        with self._lock:
            if self.current == failed:
                self.current = (failed + 1) % len(self.urls)
            return self.current


class Outcome(enum.Enum):
    """What one send to one controller came to, as far as failing over cares."""

    ANSWERED = "answered"
    """Any answer but a standby's `not_leader`, errors included: it is the caller's."""
    NOT_LEADING = "not_leading"
    """No controller leads yet, or this one lost its database: another one (or this one,
    soon) will serve."""
    UNREACHABLE = "unreachable"
    """No answer at all (refused, timed out, cut off)."""


def outcome_of(response: httpx.Response) -> Outcome:
    """Classify an answer; a 503's body must have been read."""
    return Outcome.NOT_LEADING if not_leading(response) else Outcome.ANSWERED


class Attempt:
    """One request's way through the controllers: which one to send to, and after each
    send whether to send again. It does no I/O and reads no clock, so the synchronous and
    the asynchronous transport walk the same way and a test can walk it with made-up times.
    """

    def __init__(self, rotation: Rotation, now: float) -> None:
        self.rotation = rotation
        self.deadline = now + rotation.budget_s
        self.index = rotation.start()
        self.tried = 0

    def request(self, request: httpx.Request) -> httpx.Request:
        """`request` addressed to the controller this attempt asks now."""
        return self.rotation.retarget(request, self.index)

    def next_pause(self, outcome: Outcome, now: float, leader: str | None = None) -> float | None:
        """After a send that came to `outcome` at time `now`: None when the request is done
        (hand the answer back, or raise the transport error), else how long to rest before
        sending to `self.index`, which has moved on to the next controller.

        `leader` is the controller an answering standby named; later requests go there first.
        """
        if outcome is Outcome.ANSWERED:
            self.rotation.answered(self.index, leader)
            return None
        if now >= self.deadline:
            return None
        self.index = self.rotation.moved_on(self.index)
        self.tried += 1
        # A full round found no leader: rest, so a pool without one is not hammered.
        return PAUSE_S if self.tried % len(self.rotation.urls) == 0 else 0.0

    def after_answer(self, response: httpx.Response, now: float) -> float | None:
        """`next_pause` for an answer (a 503's body read)."""
        return self.next_pause(outcome_of(response), now, response.headers.get(LEADER_HEADER))


class FailoverTransport(httpx.BaseTransport):
    """A synchronous transport over several controllers (the SDK's `PoolClient`)."""

    def __init__(
        self,
        urls: list[str],
        inner: httpx.BaseTransport | None = None,
        budget_s: float = DEFAULT_BUDGET_S,
    ) -> None:
        self.rotation = Rotation(urls, budget_s)
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        attempt = Attempt(self.rotation, time.monotonic())
        while True:
            try:
                response = self.inner.handle_request(attempt.request(request))
                # The body is read here, inside the walk: a controller killed mid-answer
                # (headers sent, body cut off) gave no answer, and the request goes on to the
                # next one (resends are safe: see the module's docstring).
                response.read()
            except httpx.TransportError:
                pause = attempt.next_pause(Outcome.UNREACHABLE, time.monotonic())
                if pause is None:
                    raise
            else:
                pause = attempt.after_answer(response, time.monotonic())
                if pause is None:
                    return response
                response.close()
            if pause:
                time.sleep(pause)

    def close(self) -> None:
        self.inner.close()


class AsyncFailoverTransport(httpx.AsyncBaseTransport):
    """The same over asyncio (the agent's client)."""

    def __init__(
        self,
        urls: list[str],
        inner: httpx.AsyncBaseTransport | None = None,
        budget_s: float = DEFAULT_BUDGET_S,
    ) -> None:
        self.rotation = Rotation(urls, budget_s)
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        attempt = Attempt(self.rotation, time.monotonic())
        while True:
            try:
                response = await self.inner.handle_async_request(attempt.request(request))
                await response.aread()  # a cut-off body is no answer (as above)
            except httpx.TransportError:
                pause = attempt.next_pause(Outcome.UNREACHABLE, time.monotonic())
                if pause is None:
                    raise
            else:
                pause = attempt.after_answer(response, time.monotonic())
                if pause is None:
                    return response
                await response.aclose()
            if pause:
                await asyncio.sleep(pause)

    async def aclose(self) -> None:
        await self.inner.aclose()
