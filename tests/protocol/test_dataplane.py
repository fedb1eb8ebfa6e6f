"""Data-plane protocol v1: addresses, frames, limits, and what a worker does with bad input."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

import msgpack
import pytest

from gpupool.protocol.v1.dataplane import (
    VERSION,
    Address,
    Connection,
    ErrorKind,
    Kind,
    ProtocolError,
    Rec,
    connect,
    pack,
    pack_records,
    parse_address,
    recv_handshake,
    send_handshake,
    start_worker_process,
)
from tests.timing import scaled

TOKEN = "protocol-test-token"


def test_addresses_parse_tcp_ipv6_and_unix() -> None:
    assert parse_address("tcp://127.0.0.1:4000") == Address("tcp", host="127.0.0.1", port=4000)
    assert parse_address("tcp://[::1]:5") == Address("tcp", host="::1", port=5)
    assert str(parse_address("tcp://[::1]:5")) == "tcp://[::1]:5"
    assert parse_address("unix:/run/w.sock") == Address("unix", path="/run/w.sock")
    for bad in ("127.0.0.1:4000", "tcp://host", "tcp://host:99999", "unix:", "http://x:1"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_frames_carry_a_body_and_a_raw_tail() -> None:
    left, right = socket.socketpair()
    sender, receiver = Connection(left), Connection(right)
    sender.send([Kind.DATA, 1, "float32", [2], 0, 8, False], b"\x00" * 8)
    sender.send_body(pack_records([Kind.BATCH], [[Rec.FREE, 3], [Rec.FREE, 4]]))
    frame = receiver.recv()
    assert frame.head()[:2] == [Kind.DATA, 1] and frame.tail_len == 8
    assert bytes(receiver.read_tail()) == b"\x00" * 8
    assert list(receiver.recv().objects()) == [[Kind.BATCH], [Rec.FREE, 3], [Rec.FREE, 4]]
    sender.close()
    receiver.close()


def test_oversized_or_malformed_frames_are_protocol_errors() -> None:
    left, right = socket.socketpair()
    receiver = Connection(right, max_frame_bytes=1024)
    left.sendall(struct.pack(">II", 4096, 0))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        receiver.recv()
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        Connection(left, max_frame_bytes=16).send([Kind.BATCH, "x" * 32])
    left2, right2 = socket.socketpair()
    left2.sendall(struct.pack(">II", 3, 0) + b"\xc1\xc1\xc1")
    with pytest.raises(ProtocolError):
        Connection(right2).recv().head()
    for s in (left, right, left2, right2):
        s.close()


@pytest.fixture(scope="module")
def worker_address() -> Iterator[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, ready = start_worker_process("lease-p", TOKEN, env=env, threads=1)
    yield str(ready.address)
    proc.terminate()
    proc.wait(timeout=scaled(10))


def framed(body: bytes) -> bytes:
    return struct.pack(">II", len(body), 0) + body


def authenticated(address: str) -> socket.socket:
    sock = connect(parse_address(address))
    send_handshake(sock, [Kind.HELLO, {"v": VERSION, "lease": "lease-p", "token": TOKEN}])
    head = recv_handshake(sock).head
    assert head[0] == Kind.WELCOME, head
    return sock


def error_then_close(sock: socket.socket) -> dict[str, object]:
    conn = Connection(sock)
    head = conn.recv().head()
    assert head[0] == Kind.ERROR
    assert sock.recv(1) == b"", "the worker closed the connection"
    sock.close()
    return head[2]  # type: ignore[no-any-return]


def still_serves(address: str) -> None:
    sock = authenticated(address)
    conn = Connection(sock)
    conn.send_body(pack_records([Kind.BATCH], [[Rec.STATS, 1]]))
    head = conn.recv().head()
    assert head[:2] == [Kind.RESULT, 1]
    conn.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(struct.pack(">II", 1 << 30, 0), id="oversized"),
        pytest.param(struct.pack(">II", 4, 0) + b"\xc1\xc1\xc1\xc1", id="not-msgpack"),
        pytest.param(framed(pack([99])), id="unknown-kind"),
        pytest.param(framed(pack([Kind.BATCH]) + pack([77, 1])), id="unknown-record"),
        pytest.param(framed(pack([Kind.DATA])), id="wrong-kind"),
        pytest.param(framed(pack([Kind.BATCH]) + pack([Rec.OP, 1])), id="short-record"),
    ],
)
def test_a_bad_frame_closes_that_connection_with_an_error_and_nothing_else(
    worker_address: str, garbage: bytes
) -> None:
    sock = authenticated(worker_address)
    sock.sendall(garbage)
    body = error_then_close(sock)
    assert body["kind"] == ErrorKind.PROTOCOL
    still_serves(worker_address)


@pytest.mark.slow
def test_a_connection_must_start_with_a_valid_hello(worker_address: str) -> None:
    sock = connect(parse_address(worker_address))
    send_handshake(sock, [Kind.BATCH])
    head = recv_handshake(sock).head
    assert head[0] == Kind.ERROR and head[2]["kind"] == ErrorKind.PROTOCOL
    sock.close()
    sock = connect(parse_address(worker_address))
    send_handshake(sock, [Kind.HELLO, {"v": 99, "lease": "lease-p", "token": TOKEN}])
    assert recv_handshake(sock).head[2]["kind"] == ErrorKind.PROTOCOL
    sock.close()
    sock = connect(parse_address(worker_address))
    sock.sendall(struct.pack(">II", 1 << 20, 0))
    assert recv_handshake(sock).head[2]["kind"] == ErrorKind.PROTOCOL
    sock.close()
    still_serves(worker_address)


def test_msgpack_limits_reject_absurd_lengths() -> None:
    left, right = socket.socketpair()
    body = b"\xdb\xff\xff\xff\xff"  # a str32 claiming 4 GiB inside a 5-byte body
    left.sendall(struct.pack(">II", len(body), 0) + body)
    with pytest.raises(ProtocolError):
        Connection(right).recv().head()
    left.close()
    right.close()
    assert msgpack.packb([1]) == pack([1])
