"""A controller that stalls (SIGSTOP) for longer than the leases' ttl treats the stall like a
restart: holders that kept heartbeating keep their leases, silent ones still expire after."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.conftest import register_fake_node
from tests.timing import scaled

pytestmark = pytest.mark.slow

TTL_S = 2.0
STOPPED_S = 3 * TTL_S
"""The attack's own parameter: stopped three ttls long, every lease would be past its ttl."""


def _wait(predicate, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_stall_longer_than_the_ttl_releases_no_lease_whose_holder_heartbeats(
    start_controller,  # type: ignore[no-untyped-def]
) -> None:
    ctl = start_controller(
        None, lease_ttl_s=TTL_S, node_timeout_s=TTL_S, reconcile_interval_s=0.2
    )
    stop = threading.Event()
    beats = {"ok": 0, "failed": 0}
    with ctl.client() as client:
        register_fake_node(client, gpus=2)
        kept = [
            client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"}).json()["id"]
            for _ in range(3)
        ]
        silent = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"}).json()["id"]

        def heartbeat_forever() -> None:
            # The holders and the agent beat every ttl/4, as they would; during the stop their
            # requests wait in the controller's socket buffers.
            with ctl.client() as mine:
                while not stop.is_set():
                    try:
                        for lease_id in kept:
                            mine.post(f"/leases/{lease_id}/heartbeat", json={"active": True})
                        mine.post("/nodes/node-a/heartbeat", json={})
                        beats["ok"] += 1
                    except httpx.HTTPError:
                        beats["failed"] += 1
                    stop.wait(TTL_S / 4)

        beater = threading.Thread(target=heartbeat_forever, daemon=True)
        beater.start()
        try:
            _wait(lambda: beats["ok"] >= 2)
            ctl.proc.send_signal(signal.SIGSTOP)
            try:
                time.sleep(STOPPED_S)
            finally:
                ctl.proc.send_signal(signal.SIGCONT)

            def states() -> list[str]:
                return [client.get(f"/leases/{lease_id}").json()["state"] for lease_id in kept]

            def stalled() -> bool:
                return any(e["kind"] == "controller.stalled" for e in client.get("/events").json())

            # The first round after the stop either sees the stall and says so, or (the bug)
            # releases every lease at once.
            _wait(lambda: stalled() or "released" in states())
            assert "released" not in states()
            assert client.get("/nodes").json()[0]["state"] == "up"
            # A holder that really stopped still loses its lease, one ttl after the stall ...
            _wait(lambda: client.get(f"/leases/{silent}").json()["state"] == "released")
            lease = client.get(f"/leases/{silent}").json()
            assert lease["release_reason"] == "holder stopped heartbeating"
            # ... while those that beat on keep theirs.
            beats_then = beats["ok"]
            _wait(lambda: beats["ok"] >= beats_then + 4)
            for lease_id in kept:
                assert client.get(f"/leases/{lease_id}").json()["state"] != "released"
        finally:
            stop.set()
            beater.join(timeout=30)
        stalls = [e for e in client.get("/events").json() if e["kind"] == "controller.stalled"]
        assert len(stalls) == 1, stalls
        assert "as after a restart" in stalls[0]["message"]
