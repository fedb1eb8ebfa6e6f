"""A hostile client's tools: data-plane frames and values packed by hand, and worker processes
started as an agent starts them. Shared by the tests that attack workers with raw frames
(test_op_attacks, test_frame_fuzz) and by the op fuzzer (worker_fuzzing)."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import psutil

from gpupool.protocol.v1.dataplane import (
    TOKEN_ENV,
    VERSION,
    Connection,
    Ext,
    Kind,
    Rec,
    connect,
    pack,
    pack_records,
    parse_address,
    parse_ready,
    recv_handshake,
    send_handshake,
    worker_argv,
)
from tests.timing import scaled

HEADER = struct.Struct(">II")
"""A frame's lengths: its body's, then its tail's (big-endian)."""


def framed(body: bytes, tail: bytes = b"") -> bytes:
    return HEADER.pack(len(body), len(tail)) + body + tail


# ---- values as the client encodes them ---------------------------------------------------------


def tensor(handle: int) -> msgpack.ExtType:
    """A handle, any int (taken modulo 2**64, as the wire's 8 bytes hold it)."""
    return msgpack.ExtType(Ext.TENSOR, (handle % 2**64).to_bytes(8, "big"))


def slot(index: int) -> msgpack.ExtType:
    """A captured program's slot."""
    return msgpack.ExtType(Ext.SLOT, index.to_bytes(4, "big"))


def literal(dtype: str, shape: list[int], fmt: str, values: list[Any]) -> msgpack.ExtType:
    """A small tensor carried in the record: `values` packed little-endian with `fmt`."""
    return msgpack.ExtType(Ext.LITERAL, pack([dtype, shape, struct.pack(fmt, *values)]))


def longs(values: list[int], shape: list[int] | None = None) -> msgpack.ExtType:
    return literal("int64", shape or [len(values)], f"<{len(values)}q", values)


def floats(values: list[float], shape: list[int] | None = None) -> msgpack.ExtType:
    return literal("float32", shape or [len(values)], f"<{len(values)}f", values)


def ext(code: Ext, name: str) -> msgpack.ExtType:
    """A named value: a dtype, layout, memory format or device."""
    return msgpack.ExtType(code, name.encode())


# ---- workers ----------------------------------------------------------------------------------


@dataclass
class Worker:
    proc: subprocess.Popen[str]
    address: str
    lease: str
    token: str
    log: Path

    def errors_logged(self) -> str:
        """Its stderr, if a traceback or a crash is in it."""
        text = self.log.read_text(errors="replace")
        markers = ("Traceback", "Exception in thread", "Segmentation", "Fatal Python error")
        return text if any(marker in text for marker in markers) else ""

    def fds(self) -> int:
        return int(psutil.Process(self.proc.pid).num_fds())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=scaled(10))


def start_worker(
    lease: str,
    token: str,
    log: Path,
    *,
    listen: str = "tcp://127.0.0.1:0",
    memory_limit_mib: int | None = None,
    env: dict[str, str] | None = None,
) -> Worker:
    """A worker as its agent starts it (one thread, the lease token in TOKEN_ENV), its stdout
    a pipe nobody reads after the ready line and its stderr kept in `log`."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1", TOKEN_ENV: token, **(env or {})}
    argv = worker_argv(lease, listen=listen, memory_limit_mib=memory_limit_mib, threads=1)
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=environ)
    assert proc.stdout is not None
    ready = parse_ready(proc.stdout.readline())
    return Worker(proc, str(ready.address), lease, token, log)


class RemoteRefusal(Exception):
    """The worker answered a HELLO with an ERROR (its body is the exception's argument)."""


def authenticate(
    worker: Worker, fds: list[int] | None = None, pinned: bool = False
) -> socket.socket:
    """A client connection of the worker's lease: HELLO with its token, WELCOME back
    (`pinned`: the second descriptor is offered as the client's shared pinned region)."""
    return authenticate_to(worker.address, worker.lease, worker.token, fds, pinned)[0]


def authenticate_to(
    address: str, lease: str, token: str, fds: list[int] | None = None, pinned: bool = False
) -> tuple[socket.socket, dict[str, Any]]:
    """The same, to a worker started elsewhere (one of a lease's workers that know each other,
    as tests/torch/torch_workers.py starts them); the WELCOME's facts with the socket."""
    sock = connect(parse_address(address))
    hello = {"v": VERSION, "lease": lease, "token": token, "shm": fds is not None,
             "pinned": pinned}  # fmt: skip
    send_handshake(sock, [Kind.HELLO, hello], fds or [])
    reply = recv_handshake(sock)
    for fd in reply.fds:
        os.close(fd)
    head = reply.head
    if head[0] == Kind.ERROR:
        sock.close()
        raise RemoteRefusal(head[2])
    assert head[0] == Kind.WELCOME, head
    return sock, head[1]


# ---- a hostile client -------------------------------------------------------------------------


class Raw:
    """A hostile client: records packed by hand, every reply kept to look for the secret."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(scaled(30))
        self.conn = Connection(self.sock)
        self.received = bytearray()
        self.req = 0
        self.op_ids: dict[str, int] = {}

    def send(self, records: list[Any]) -> None:
        body = pack_records([Kind.BATCH], records)
        self.sock.sendall(framed(body))

    def op(self, name: str) -> int:
        """The op id for `name`, DEF'd on first use."""
        if name not in self.op_ids:
            self.op_ids[name] = len(self.op_ids) + 1
            self.send([[Rec.DEF, self.op_ids[name], name]])
        return self.op_ids[name]

    def run(self, name: str, args: list[Any], kwargs: dict[str, Any] | None = None,
            outs: list[int | None] | None = None) -> None:  # fmt: skip
        self.send([[Rec.OP, self.op(name), args, kwargs or {}, outs or []]])

    def answer(self, record: list[Any]) -> tuple[list[Any], bytes]:
        self.send([record])
        frame = self.conn.recv()
        head = frame.head()
        tail = bytes(self.conn.read_tail()) if frame.tail_len else b""
        self.received += msgpack.packb(head) + tail
        assert head[1] == record[1], head
        return head, tail

    def sync(self) -> list[Any]:
        self.req += 1
        return self.answer([Rec.SYNC, self.req])[0]

    def read_floats(self, handle: int) -> list[float]:
        self.req += 1
        head, tail = self.answer([Rec.READ, self.req, tensor(handle)])
        assert head[0] == Kind.DATA and head[2] == "float32", head
        return list(struct.unpack(f"<{len(tail) // 4}f", tail))

    def close(self) -> None:
        self.sock.close()


def refused(client: Raw, *words: str) -> str:
    """The stream's sticky error, as the client's next sync hears it."""
    head = client.sync()
    assert head[0] == Kind.ERROR, f"the attack was not refused: {head}"
    message = str(head[2]["message"])
    for word in words:
        assert word in message, message
    return message
