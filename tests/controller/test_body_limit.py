"""A real controller refuses request bodies over its limit with a fast 413, before reading
them, and keeps answering everyone else meanwhile (real sockets, a real process)."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from tests.conftest import ADMIN_TOKEN
from tests.timing import scaled

pytestmark = pytest.mark.slow

LIMIT = 64 * 1024


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _head(path: str, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Type: application/json\r\n{extra}\r\n"
    ).encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole HTTP response (the server sends Content-Length); status, headers, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the response body"
        body += chunk
    return status, headers, body[:length]


def _lease_count(ctl: object) -> int:
    with ctl.client() as client:  # type: ignore[attr-defined]
        return len(client.get("/leases", params={"state": "all"}).json())


def test_declared_oversize_body_gets_413_before_any_body_byte_is_sent(
    start_controller: object,
) -> None:
    ctl = start_controller(max_body_bytes=LIMIT)  # type: ignore[operator]
    before = _lease_count(ctl)
    with _connect(ctl.port) as sock:
        # 50 MB announced, not one byte of it sent: the answer must come anyway.
        sock.sendall(_head("/api/v1/leases", "Content-Length: 50000000\r\n"))
        status, headers, body = _read_response(sock)
    assert status == 413
    assert headers["connection"] == "close"
    answer = json.loads(body)
    assert answer["error"] == "body_too_large"
    assert "64 KiB" in answer["detail"]
    assert _lease_count(ctl) == before


def test_chunked_body_is_cut_off_at_the_limit_while_it_streams(start_controller: object) -> None:
    ctl = start_controller(max_body_bytes=LIMIT)  # type: ignore[operator]
    before = _lease_count(ctl)
    chunk = b"[" + b"1," * 8000  # 16 kB of a JSON array that never ends
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    with _connect(ctl.port) as sock:
        sock.sendall(_head("/api/v1/leases", "Transfer-Encoding: chunked\r\n"))
        sent = 0
        # Stream until the server answers; it must do so after about LIMIT bytes, long before
        # the 100 MB this would send.
        while sent < 100_000_000:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        select.select([sock], [], [], 10)
        status, headers, body = _read_response(sock)
    assert status == 413
    assert headers["connection"] == "close"
    assert json.loads(body)["error"] == "body_too_large"
    assert sent < 100 * LIMIT
    assert _lease_count(ctl) == before


def test_health_answers_while_oversize_bodies_are_refused(start_controller: object) -> None:
    ctl = start_controller(max_body_bytes=LIMIT)  # type: ignore[operator]
    chunk = b" " * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    attackers = []
    try:
        for _ in range(6):
            sock = _connect(ctl.port)
            sock.sendall(_head("/api/v1/leases", "Content-Length: 50000000\r\n"))
            attackers.append(sock)
            sock = _connect(ctl.port)
            sock.sendall(_head("/api/v1/nodes", "Transfer-Encoding: chunked\r\n") + frame * 4)
            attackers.append(sock)
        refused = [_read_response(sock)[0] for sock in attackers]
        assert refused == [413] * len(attackers)
        # With the bodies refused, health answers at once (a generous bound: a shared CI box).
        with _connect(ctl.port) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, _, body = _read_response(sock)
            took_s = time.monotonic() - started
        assert status == 200, body
        assert took_s < scaled(5.0)
    finally:
        for sock in attackers:
            sock.close()


def test_body_under_the_limit_is_served(start_controller: object) -> None:
    ctl = start_controller(max_body_bytes=LIMIT)  # type: ignore[operator]
    with ctl.client() as client:  # type: ignore[attr-defined]
        body = {"name": "t-" + "x" * 50, "weight": 1.0}
        padded = json.dumps(body) + " " * (LIMIT - 200)  # just under the limit, all whitespace
        response = client.post(
            "/tenants", content=padded, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 201, response.text
        assert any(t["name"] == body["name"] for t in client.get("/tenants").json())
