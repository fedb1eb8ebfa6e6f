"""The most bytes one HTTP request body may hold, refused with a fast 413 before it is read.

Every server of gpupool that takes JSON (the controller's API, `gpupool k8s serve`) parses
the whole body on its event loop. Without a limit, a few bodies of tens of megabytes from
one caller stall every other request, `/health` included. The limit is checked on the
declared Content-Length before a byte of the body is read, and counted while a chunked body
streams in, so a refused body costs the server no more than the limit.

The answer closes the connection (`Connection: close`): the rest of the body the client may
still be sending is not read, let alone parsed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gpupool.protocol.asgi import send_json

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MIB = 1024 * 1024


class BodyTooLarge(Exception):
    """A request body went past the limit while it was streaming in."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"request body is larger than the limit of {limit_bytes} bytes")
        self.limit_bytes = limit_bytes


def describe_size(n_bytes: int) -> str:
    """`4 MiB`, `64 KiB` or `1500 bytes`: what the 413's reason names."""
    if n_bytes >= MIB and n_bytes % MIB == 0:
        return f"{n_bytes // MIB} MiB"
    if n_bytes >= 1024 and n_bytes % 1024 == 0:
        return f"{n_bytes // 1024} KiB"
    return f"{n_bytes} bytes"


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length, None where it has none; ValueError where it is not one
    number (HTTP servers refuse two different lengths, but not every parser does)."""
    values = {v.strip() for k, v in headers if k.lower() == b"content-length"}
    if not values:
        return None
    if len(values) != 1:
        raise ValueError("several different Content-Length headers")
    (value,) = values
    if not value.isdigit():
        raise ValueError(f"Content-Length {value[:32]!r} is not a number")
    return int(value)


class BodyLimit:
    """ASGI middleware: refuse HTTP requests whose body is over `limit_bytes` with a 413.

    `error_body` makes the JSON of a refusal in the format of the app it wraps (the
    controller's `{"error", "detail"}`, the extender's `{"Error"}`).
    """

    def __init__(
        self,
        app: App,
        limit_bytes: int,
        error_body: Callable[[str, str], dict[str, Any]] | None = None,
    ) -> None:
        if limit_bytes < 1:
            raise ValueError(f"a body limit must be at least 1 byte, got {limit_bytes}")
        self.app = app
        self.limit_bytes = limit_bytes
        self.error_body = error_body or (lambda code, detail: {"error": code, "detail": detail})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            declared = declared_length(scope.get("headers") or [])
        except ValueError as exc:
            await self._refuse(send, 400, "bad_request", str(exc))
            return
        if declared is not None and declared > self.limit_bytes:
            await self._refuse_too_large(scope, send, f"Content-Length {declared}")
            return
        await self._stream(scope, receive, send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app with a `receive` that counts the body and cuts it off at the limit.

        Past the limit the 413 goes out at once, and the app's `receive` raises BodyTooLarge
        so that it stops; whatever the app still sends or raises after that is dropped (it
        may turn the cut into an error answer of its own, which must not follow the 413).
        """
        received = 0
        started = refused = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                raise BodyTooLarge(self.limit_bytes)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit_bytes:
                    if not started:
                        await self._refuse_too_large(scope, send, f"{received} bytes streamed")
                    refused = True
                    raise BodyTooLarge(self.limit_bytes)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception as exc:
            if not refused:
                raise
            # The app stopped because its body was cut off: expected, and answered already.
            log.debug("an app cut off at the body limit ended with %r", exc)

    async def _refuse_too_large(self, scope: Scope, send: Send, seen: str) -> None:
        client = scope.get("client") or ("?", 0)
        log.warning(
            "refused %s %s from %s: body over the %s limit (%s)",
            scope.get("method"),
            scope.get("path"),
            client[0],
            describe_size(self.limit_bytes),
            seen,
        )
        await self._refuse(
            send,
            413,
            "body_too_large",
            f"request body is larger than the limit of {describe_size(self.limit_bytes)}",
        )

    async def _refuse(self, send: Send, status: int, code: str, detail: str) -> None:
        # The rest of the body is never read: the connection cannot carry another request.
        await send_json(send, status, self.error_body(code, detail), [(b"connection", b"close")])
