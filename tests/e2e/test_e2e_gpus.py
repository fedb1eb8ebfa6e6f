"""GPU modes through the CLI: a busy GPU drains before it switches; drain, isolate, clear."""

from __future__ import annotations

import json

import pytest
from e2e_pool import Pool

from tests.timing import scaled

pytestmark = pytest.mark.slow


def test_busy_gpu_switches_to_physical_through_draining(pool: Pool) -> None:
    lease = pool.json("lease", "create", "--compute", "25%")
    uuid = lease["slices"][0]["gpu_uuid"]

    draining = pool.json("gpu", "mode", uuid, "physical")
    assert draining["mode"] == "draining"
    assert draining["target_mode"] == "physical"
    assert "draining" in pool.ok("gpu", "show", uuid).stdout

    pool.ok("lease", "release", lease["id"])
    switched = pool.wait_for(
        "the GPU to finish draining",
        lambda: (gpu := pool.json("gpu", "show", uuid))["mode"] == "physical" and gpu,
    )
    assert switched["target_mode"] is None

    whole = pool.json("lease", "create", "--physical")
    assert whole["state"] == "granted"
    assert whole["slices"][0]["gpu_uuid"] == uuid
    assert whole["slices"][0]["whole"] is True


def test_idle_gpu_switches_at_once_and_back(pool: Pool) -> None:
    uuid = pool.json("gpus")[0]["uuid"]
    assert pool.json("gpu", "mode", uuid, "physical")["mode"] == "physical"
    assert [g["uuid"] for g in pool.json("gpus", "--mode", "physical")] == [uuid]
    assert pool.json("gpu", "mode", uuid, "virtual")["mode"] == "virtual"


def test_gpu_can_be_named_by_node_and_index(pool: Pool) -> None:
    gpu = pool.json("gpus")[1]
    shown = pool.json("gpu", "show", f"{gpu['node']}:{gpu['index']}")
    assert shown["uuid"] == gpu["uuid"]


def test_isolated_gpu_takes_no_leases_until_cleared(pool: Pool) -> None:
    gpus = pool.json("gpus")
    for gpu in gpus:
        isolated = pool.json("gpu", "isolate", gpu["uuid"], "--reason", "ECC errors")
        assert isolated["mode"] == "isolated"
    refused = pool.cli("lease", "create", "--compute", "10%", "--no-queue")
    assert refused.returncode == 2
    cleared = pool.json("gpu", "clear", gpus[0]["uuid"])
    assert cleared["mode"] == "virtual"
    assert pool.json("lease", "create", "--compute", "10%")["state"] == "granted"


def test_drained_gpu_takes_no_new_leases(pool: Pool) -> None:
    first, second = pool.json("gpus")
    drained = pool.json("gpu", "drain", first["uuid"])
    assert (drained["mode"], drained["target_mode"]) == ("draining", None)
    lease = pool.json("lease", "create", "--compute", "10%")
    assert lease["slices"][0]["gpu_uuid"] == second["uuid"]
    assert "stays drained" in pool.ok("gpu", "drain", first["uuid"]).stdout
    assert pool.json("gpu", "mode", first["uuid"], "virtual")["mode"] == "virtual"


def test_mode_wait_shows_the_drain_and_ends_when_the_gpu_switched(pool: Pool) -> None:
    lease = pool.json("lease", "create", "--compute", "25%")
    uuid = lease["slices"][0]["gpu_uuid"]
    waiting = pool.spawn("gpu", "mode", uuid, "physical", "--wait", "-o", "json")
    try:
        pool.wait_for(
            "the drain to start",
            lambda: pool.json("gpu", "show", uuid)["mode"] == "draining",
        )
        assert waiting.poll() is None, "--wait returns only once the GPU has switched"
        pool.ok("lease", "release", lease["id"])
        out, err = waiting.communicate(timeout=scaled(60))
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 0, err
    assert json.loads(out)["mode"] == "physical"
