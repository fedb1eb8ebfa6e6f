"""LeaseKeeper fences its holder: a controller silent for longer than the lease's ttl has
released the lease by now, so the holder is told to stop using its GPUs."""

from __future__ import annotations

import http.server
import json
import socket
import threading

from gpupool.client.sdk import LeaseKeeper
from gpupool.protocol.v1.api import LeaseOut
from tests.timing import scaled


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_keeper_ends_the_lease_after_its_ttl_without_an_answer() -> None:
    ended = threading.Event()
    reasons: list[str] = []
    errors: list[Exception] = []

    def on_end(_lease: LeaseOut | None, reason: str) -> None:
        reasons.append(reason)
        ended.set()

    keeper = LeaseKeeper(
        _dead_url(), "l-1", interval_s=0.05, on_end=on_end, on_error=errors.append,
        expire_after_s=0.5,
    )  # fmt: skip
    keeper.start()
    try:
        assert ended.wait(timeout=scaled(15)), "the keeper never gave the lease up"
    finally:
        keeper.stop()
    assert errors, "each failed heartbeat was reported first"
    assert reasons[0].startswith("no answer from the controller for ")
    assert "longer than the lease's ttl (0.5 s)" in reasons[0]
    assert keeper.end_reason == reasons[0]


def test_keeper_without_a_ttl_keeps_trying() -> None:
    ended = threading.Event()
    errors: list[Exception] = []
    keeper = LeaseKeeper(
        _dead_url(), "l-1", interval_s=0.05, on_end=lambda *_: ended.set(), on_error=errors.append
    )
    keeper.start()
    try:
        assert not ended.wait(timeout=1.0)
    finally:
        keeper.stop()
    assert len(errors) >= 3


class _Controller(http.server.BaseHTTPRequestHandler):
    """Answers the first heartbeat 503 (a controller that is restarting), the second 404;
    while it answers the first, the keeper's interval becomes an hour."""

    seen: list[str] = []
    keeper: LeaseKeeper | None = None

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(self.path)
        if self.keeper is not None:
            self.keeper.interval_s = 3600.0
        status = 503 if len(self.seen) == 1 else 404
        body = json.dumps({"code": "unavailable", "detail": "try again"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def test_a_failed_heartbeat_is_tried_again_soon_not_an_interval_later() -> None:
    """With three or four heartbeats a ttl, waiting a whole interval after each failure lets
    two failures in a row expire a live holder's lease."""
    _Controller.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Controller)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ended = threading.Event()
    errors: list[Exception] = []
    reasons: list[str] = []
    try:
        keeper = LeaseKeeper(
            f"http://127.0.0.1:{server.server_address[1]}", "l-1", interval_s=0.05,
            on_end=lambda _lease, why: (reasons.append(why), ended.set()),
            on_error=errors.append, retry_s=0.05,
        )  # fmt: skip
        _Controller.keeper = keeper
        keeper.start()
        try:
            assert ended.wait(timeout=scaled(15)), "the failed heartbeat was not tried again"
        finally:
            keeper.stop()
    finally:
        server.shutdown()
        server.server_close()
    assert len(_Controller.seen) == 2, _Controller.seen
    assert len(errors) == 1 and "try again" in str(errors[0])
    assert reasons == ["lease l-1 is unknown to the controller"]
