"""Tell a node's agent at once that a remote lease was granted on it, instead of at its next
heartbeat: the grant then reaches the agent in milliseconds, and a ready worker serves the
lease a moment later (`gpupool agent --ready-workers`).

Best effort: the agent's API must be reachable from the controller (the same host, or
`gpupool agent --api-host`); otherwise the agent learns of the lease at its next heartbeat,
as before. The URL is the agent's own word (it registered it), so only its scheme, host and
port are used, with the fixed path of the agent's wake call and no body: a node cannot point
the controller at any other path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

import httpx

from gpupool.controller.store import Store

log = logging.getLogger("gpupool.controller.wake")

WAKE_PATH = "/agent/v1/wake"
WAKE_TIMEOUT_S = 1.0
_pending: set[asyncio.Task[None]] = set()
"""Wake calls in flight (kept referenced until done: asyncio holds tasks weakly)."""


def wake_url(agent_url: str | None) -> str | None:
    """`http://host:port/agent/v1/wake` from an agent's registered URL, or None if that URL is
    not a plain http(s)://host[:port] (a path, query, fragment or credentials in it)."""
    if not agent_url:
        return None
    try:
        parts = urlsplit(agent_url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}{WAKE_PATH}"


def wake_agents(store: Store, nodes: Iterable[str]) -> None:
    """Start, without waiting for them, the wake calls to these nodes' agents."""
    for node in sorted(set(nodes)):
        row = store.node_rows.get(node)
        url = wake_url(row.agent_url if row is not None else None)
        if url is None:
            continue
        task = asyncio.get_running_loop().create_task(_wake(node, url))
        _pending.add(task)
        task.add_done_callback(_pending.discard)


async def _wake(node: str, url: str) -> None:
    try:
        async with httpx.AsyncClient(timeout=WAKE_TIMEOUT_S) as client:
            await client.post(url)
    except httpx.HTTPError as exc:  # its heartbeat brings the lease instead
        log.debug("could not wake the agent of %s at %s: %s", node, url, exc)
