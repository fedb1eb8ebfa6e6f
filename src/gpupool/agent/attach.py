"""The agent's Unix socket where `gpupool run` attaches a direct lease's process to the watch.

Every byte that arrives is a tenant's: one line of at most MAX_LINE_BYTES, read within
READ_TIMEOUT_S, a bounded number of connections at once; the process attached is the one the
kernel says connected (SO_PEERCRED), whatever the message says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpupool.agent.watch import DirectWatch
from gpupool.protocol.v1.attach import (
    MAX_LINE_BYTES,
    AttachRefused,
    AttachReply,
    parse_request,
    peer_pid,
    reachable,
    reply_line,
)

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
LEASE_WAIT_S = 8.0
"""How long an attach for a lease the agent has not heard of waits for the controller's
answer to an early heartbeat (the lease was granted a moment ago)."""
MAX_CONNECTIONS = 32


class AttachServer:
    """Serves attach requests for `watch`; `learn` asks the controller now and returns once
    its answer is in (the lease may be new)."""

    def __init__(
        self, path: Path, watch: DirectWatch, learn: Callable[[], Awaitable[None]]
    ) -> None:
        self.path = path
        self.watch = watch
        self._learn = learn
        self._server: asyncio.AbstractServer | None = None
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self.attached = 0
        self.refused = 0

    async def start(self) -> None:
        await asyncio.to_thread(self._prepare)
        with reachable(self.path) as name:
            self._server = await asyncio.start_unix_server(
                self._serve, path=name, limit=MAX_LINE_BYTES + 2
            )
            # Any local user may connect: the lease's token, not the socket's mode, decides.
            os.chmod(name, 0o666)
        log.info("direct slices attach at %s", self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _prepare(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket left by an earlier agent

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._slots.locked():
            writer.close()
            return
        async with self._slots:
            try:
                reply = await self._answer(reader, writer)
                writer.write(reply_line(reply))
                await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                log.debug("attach connection ended early: %s", exc)
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> AttachReply:
        sock = writer.get_extra_info("socket")
        if sock is None:
            return self._refuse("cannot tell who connected")
        try:
            pid = peer_pid(sock)
        except OSError as exc:
            return self._refuse(f"cannot tell who connected: {exc}")
        try:
            line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
        except (ValueError, asyncio.LimitOverrunError):
            return self._refuse(f"request longer than {MAX_LINE_BYTES} bytes")
        except TimeoutError:
            return self._refuse(f"no request within {READ_TIMEOUT_S:g}s")
        try:
            request = parse_request(line)
        except ValueError as exc:
            return self._refuse(str(exc))
        if pid <= 0:
            return self._refuse("the kernel names no process for this connection")
        if not self.watch.knows(request.lease_id):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._learn(), LEASE_WAIT_S)
        try:
            await asyncio.to_thread(self.watch.attach, request.lease_id, request.token, pid)
        except AttachRefused as exc:
            return self._refuse(str(exc), pid)
        self.attached += 1
        return AttachReply(ok=True, pid=pid)

    def _refuse(self, reason: str, pid: int | None = None) -> AttachReply:
        self.refused += 1
        log.warning("attach refused%s: %s", f" (pid {pid})" if pid else "", reason)
        return AttachReply(ok=False, error=reason)
