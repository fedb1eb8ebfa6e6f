"""The one ASGI answer the pool's own middlewares write themselves: a JSON error body.

Middlewares that answer before the application (the body limit, an HA follower that cannot
forward) speak raw ASGI; they share this so that their answers look like every other error
of the API (`{"error": code, "detail": words}`) and always carry their length."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
"""ASGI's send callable (written out: the protocol package needs no web framework)."""


async def send_json(
    send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]
) -> None:
    """Answer with `body` as JSON and `headers` besides its type and length."""
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
