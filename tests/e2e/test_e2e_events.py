"""`gpupool events` shows who did what."""

from __future__ import annotations

import pytest
from e2e_pool import ACTOR, Pool

from tests.timing import scaled

pytestmark = pytest.mark.slow


def test_events_record_lease_and_gpu_actions_with_their_actor(pool: Pool) -> None:
    lease = pool.json("lease", "create", "--compute", "20%")
    pool.ok("lease", "release", lease["id"])
    uuid = pool.json("gpus")[0]["uuid"]
    pool.ok("gpu", "isolate", uuid, "--reason", "testing")

    events = pool.json("events")
    kinds = [e["kind"] for e in events]
    for kind in ("node.registered", "lease.created", "lease.granted", "lease.released"):
        assert kind in kinds
    about_lease = pool.json("events", "--subject", lease["id"])
    assert {e["kind"] for e in about_lease} >= {"lease.created", "lease.released"}
    assert any(e["actor"] == ACTOR for e in about_lease)
    isolated = pool.json("events", "--kind", "gpu.isolated")
    assert [e["subject"] for e in isolated] == [uuid]

    newest = max(e["id"] for e in events)
    assert pool.json("events", "--since", str(newest)) == []
    assert lease["id"] in pool.ok("events").stdout


def test_follow_prints_new_events(pool: Pool) -> None:
    follower = pool.spawn("events", "--follow", "-o", "json")
    try:
        pool.wait_for("the follower to start", lambda: True)
        lease = pool.json("lease", "create", "--compute", "5%")
        seen: list[str] = []
        assert follower.stdout is not None
        while not any(lease["id"] in line for line in seen):
            line = follower.stdout.readline()
            assert line, "follower ended"
            seen.append(line)
    finally:
        follower.terminate()
        follower.wait(timeout=scaled(10))
