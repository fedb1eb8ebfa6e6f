"""LeaseKeeper fences its holder: a controller silent for longer than the lease's ttl has
released the lease by now, so the holder is told to stop using its GPUs."""

from __future__ import annotations

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
