"""Reaching one of several controllers (high availability) through one httpx transport: each
request goes to the controller that answered last, and moves on to the next one while a
controller is down or does not lead.

Resending is safe for every request of the API: reads and heartbeats change nothing twice,
releases of a released lease answer the same, and the SDK gives each lease request a
`request_id` that makes a resent request find the lease its first send made.
"""

from __future__ import annotations

import asyncio
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


def not_leading(response: httpx.Response) -> bool:
    """A standby answers 503 `not_leader` while no controller leads: another will soon."""
    if response.status_code != 503:
        return False
    try:
        body = json.loads(response.content)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("error") == "not_leader"


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

    def answered(self, index: int, response: httpx.Response) -> None:
        """Follow a standby's hint: ask the leader it named first from now on."""
        leader = response.headers.get(LEADER_HEADER)
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
        rotation = self.rotation
        deadline = time.monotonic() + rotation.budget_s
        index = rotation.start()
        tried = 0
        while True:
            try:
                response = self.inner.handle_request(rotation.retarget(request, index))
            except httpx.TransportError:
                if time.monotonic() >= deadline:
                    raise
            else:
                if response.status_code != 503:
                    rotation.answered(index, response)
                    return response
                response.read()
                if not not_leading(response) or time.monotonic() >= deadline:
                    return response
                response.close()
            index = rotation.moved_on(index)
            tried += 1
            if tried % len(rotation.urls) == 0:
                time.sleep(PAUSE_S)

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
        rotation = self.rotation
        deadline = time.monotonic() + rotation.budget_s
        index = rotation.start()
        tried = 0
        while True:
            try:
                response = await self.inner.handle_async_request(rotation.retarget(request, index))
            except httpx.TransportError:
                if time.monotonic() >= deadline:
                    raise
            else:
                if response.status_code != 503:
                    rotation.answered(index, response)
                    return response
                await response.aread()
                if not not_leading(response) or time.monotonic() >= deadline:
                    return response
                await response.aclose()
            index = rotation.moved_on(index)
            tried += 1
            if tried % len(rotation.urls) == 0:
                await asyncio.sleep(PAUSE_S)

    async def aclose(self) -> None:
        await self.inner.aclose()
