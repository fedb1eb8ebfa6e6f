"""Attaching a direct lease's process to its agent's watch: one JSON line each way, over the
agent's Unix socket.

The agent learns which process connected from the kernel (SO_PEERCRED), never from the
message: the process that connects is the one attached, with every process it starts later.
The lease's token proves that the caller holds the lease; the agent compares its SHA-256
with the one the controller gave it. So no tenant can attach a process of its own to
another's lease (it lacks the token), nor another's process to its lease (it cannot connect
as that process).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError

from gpupool.protocol.v1.api import Strict

MAX_LINE_BYTES = 4096
ATTACH_TIMEOUT_S = 15.0
"""How long `gpupool run` waits for the agent: it may first have to hear of the lease from
the controller (one heartbeat)."""
_SUN_PATH_MAX = 100
"""A socket path longer than this does not fit sockaddr_un (108 bytes with its NUL, less on
some systems): such paths are reached through /proc/self/fd/N/<name>."""


class AttachRefused(Exception):
    """The agent would not attach the process (no such lease here, wrong token, ...)."""


class AttachRequest(Strict):
    lease_id: Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$")]
    token: Annotated[str, Field(min_length=1, max_length=256)]


class AttachReply(BaseModel):
    ok: bool
    pid: int | None = None
    """The process the agent attached (the caller's own pid, as the kernel says)."""
    error: str | None = None


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def peer_pid(sock: Any) -> int:
    """The pid of the process at the other end of a connected Unix socket (SO_PEERCRED);
    `sock` is a socket or asyncio's wrapper of one."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", raw)
    return int(pid)


def parse_request(line: bytes) -> AttachRequest:
    """One request line; ValueError with a reason for anything else."""
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"request longer than {MAX_LINE_BYTES} bytes")
    try:
        return AttachRequest.model_validate_json(line.strip())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "request"
        raise ValueError(f"bad attach request ({where}: {first.get('msg', 'invalid')})") from None


def reply_line(reply: AttachReply) -> bytes:
    return reply.model_dump_json(exclude_none=True).encode() + b"\n"


@contextlib.contextmanager
def reachable(path: Path) -> Iterator[str]:
    """A name for `path` short enough for sockaddr_un: itself, or the socket's name through a
    descriptor of its directory when the full path is too long."""
    if len(os.fsencode(str(path))) <= _SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def attach(path: Path, lease_id: str, token: str, timeout_s: float = ATTACH_TIMEOUT_S) -> int:
    """Attach the calling process (and so all it starts later) to `lease_id`; returns the pid
    the agent attached. AttachRefused with the agent's reason, OSError when unreachable."""
    request = AttachRequest(lease_id=lease_id, token=token)
    with reachable(path) as name, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(name)
        sock.sendall(request.model_dump_json().encode() + b"\n")
        line = _read_line(sock)
    try:
        reply = AttachReply.model_validate(json.loads(line))
    except (ValueError, ValidationError):
        raise AttachRefused(f"the agent answered something else: {line[:200]!r}") from None
    if not reply.ok or reply.pid is None:
        raise AttachRefused(reply.error or "refused without a reason")
    return reply.pid


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data:
        chunk = sock.recv(MAX_LINE_BYTES)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_LINE_BYTES:
            raise AttachRefused("the agent's answer is too long")
    if not data:
        raise AttachRefused("the agent closed the connection without an answer")
    return data.split(b"\n", 1)[0]
