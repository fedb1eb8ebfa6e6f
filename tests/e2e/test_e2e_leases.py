"""Leases through the CLI against a real controller and agent: create, list, show, queue, release."""

from __future__ import annotations

import signal

import pytest
from e2e_pool import Pool

from tests.timing import scaled

pytestmark = pytest.mark.slow


def test_lease_is_created_listed_shown_and_released(pool: Pool) -> None:
    lease = pool.json("lease", "create", "--compute", "25%", "--memory", "20GiB")
    assert lease["state"] == "granted"
    assert lease["ttl_s"] == 3600
    assert len(lease["slices"]) == 1
    assert lease["slices"][0]["compute_pct"] == 25
    assert lease["slices"][0]["memory_mib"] == 20 * 1024

    listed = pool.json("lease", "ls")
    assert [item["id"] for item in listed] == [lease["id"]]
    table = pool.ok("lease", "ls").stdout
    assert lease["id"] in table and "25%" in table

    shown = pool.lease(lease["id"])
    assert shown["slices"] == lease["slices"]

    released = pool.ok("lease", "release", lease["id"])
    assert f"released lease {lease['id']}" in released.stdout
    assert pool.json("lease", "ls") == []
    ended = pool.json("lease", "ls", "--all")
    assert ended[0]["id"] == lease["id"]
    assert ended[0]["state"] == "released"
    # Releasing twice is harmless.
    pool.ok("lease", "release", lease["id"])


def test_renew_keeps_a_lease_and_reports_its_ttl(pool: Pool) -> None:
    lease = pool.json("lease", "create", "--compute", "10%", "--ttl", "120")
    renewed = pool.ok("lease", "renew", lease["id"])
    assert f"renewed lease {lease['id']}" in renewed.stdout
    assert "120 s" in renewed.stdout


def test_no_wait_prints_the_queued_lease_and_it_is_granted_when_room_frees(pool: Pool) -> None:
    first = pool.json("lease", "create", "--compute", "100%")
    second = pool.json("lease", "create", "--compute", "100%")
    assert first["state"] == second["state"] == "granted"

    queued = pool.json("lease", "create", "--compute", "50%", "--no-wait")
    assert queued["state"] == "queued"
    assert queued["queue_position"] == 1
    assert queued["waiting_reason"]

    entries = pool.json("queue")
    assert [(e["position"], e["lease"]["id"]) for e in entries] == [(1, queued["id"])]
    assert queued["id"] in pool.ok("queue").stdout

    pool.ok("lease", "release", first["id"])
    granted = pool.wait_for(
        "the queued lease to be granted",
        lambda: (lease := pool.lease(queued["id"]))["state"] == "granted" and lease,
    )
    assert granted["slices"][0]["compute_pct"] == 50


def test_no_queue_refuses_at_once_with_exit_2(pool: Pool) -> None:
    pool.json("lease", "create", "--gpus", "2", "--compute", "100%")
    done = pool.cli("lease", "create", "--compute", "10%", "--no-queue")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: ")


def test_waiting_create_is_granted_when_another_lease_ends(pool: Pool) -> None:
    held = pool.json("lease", "create", "--gpus", "2", "--compute", "100%")
    waiting = pool.spawn("lease", "create", "--compute", "100%", "-o", "json")
    pool.wait_for("the request to queue", lambda: pool.json("queue"))
    pool.ok("lease", "release", held["id"])
    out, err = waiting.communicate(timeout=scaled(30))
    assert waiting.returncode == 0, err
    assert '"state": "granted"' in out
    assert "queued at position" in err


def test_unknown_lease_is_exit_2_with_one_line(pool: Pool) -> None:
    done = pool.cli("lease", "show", "l-nope")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "not_found" in done.stderr


def test_sigterm_while_waiting_cancels_the_request(pool: Pool) -> None:
    pool.json("lease", "create", "--gpus", "2", "--compute", "100%")
    waiting = pool.spawn("lease", "create", "--compute", "10%")
    queued = pool.wait_for("the request to queue", lambda: pool.json("queue"))
    waiting.send_signal(signal.SIGTERM)
    _, err = waiting.communicate(timeout=scaled(30))
    assert waiting.returncode == 128 + signal.SIGTERM
    assert "cancelled lease" in err
    lease = pool.lease(queued[0]["lease"]["id"])
    assert lease["state"] == "released"
    assert pool.json("queue") == []


def test_lease_takes_server_cpu_and_memory(pool: Pool) -> None:
    lease = pool.json("lease", "create", "--compute", "10%", "-m", "1GiB", "--cpu", "1", "--host-memory", "1GiB")
    assert lease["state"] == "granted"
    refused = pool.cli("lease", "create", "--compute", "10%", "-m", "1GiB", "--cpu", "100000")
    assert refused.returncode == 2 and "never be granted" in refused.stderr
