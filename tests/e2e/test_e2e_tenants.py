"""Tenants and quotas through the CLI."""

from __future__ import annotations

import pytest
from e2e_pool import Pool

pytestmark = pytest.mark.slow


def test_request_beyond_the_tenant_quota_is_refused_with_exit_2(pool: Pool) -> None:
    team = pool.json("tenant", "create", "team", "--max-compute", "50", "--max-memory", "40GiB")
    assert team["max_compute_pct"] == 50
    assert team["max_memory_mib"] == 40 * 1024

    refused = pool.cli("lease", "create", "--tenant", "team", "--compute", "60%")
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "quota" in refused.stderr

    granted = pool.json("lease", "create", "--tenant", "team", "--compute", "40%", "-m", "8GiB")
    assert granted["state"] == "granted"
    used = pool.json("tenant", "show", "team")
    assert used["used_compute_pct"] == 40


def test_set_changes_one_limit_and_keeps_the_others(pool: Pool) -> None:
    pool.json("tenant", "create", "team", "--max-gpus", "1", "--max-leases", "3")
    changed = pool.json("tenant", "set", "team", "--max-gpus", "2", "--weight", "2.5")
    assert changed["max_gpus"] == 2
    assert changed["max_leases"] == 3
    assert changed["weight"] == 2.5
    cleared = pool.json("tenant", "set", "team", "--max-leases", "unlimited")
    assert cleared["max_leases"] is None
    assert cleared["max_gpus"] == 2
    assert "team" in pool.ok("tenant", "ls").stdout


def test_tenant_is_deleted(pool: Pool) -> None:
    pool.ok("tenant", "create", "gone")
    assert "deleted tenant gone" in pool.ok("tenant", "delete", "gone").stdout
    assert pool.cli("tenant", "show", "gone").returncode == 2


def test_guarantee_is_set_and_kept_when_other_limits_change(pool: Pool) -> None:
    created = pool.json("tenant", "create", "prod", "--guaranteed-gpus", "2", "--max-gpus", "4")
    assert created["guaranteed_gpus"] == 2
    changed = pool.json("tenant", "set", "prod", "--max-gpus", "6")
    assert (changed["guaranteed_gpus"], changed["max_gpus"]) == (2, 6)
    changed = pool.json("tenant", "set", "prod", "--guaranteed-gpus", "1")
    assert (changed["guaranteed_gpus"], changed["max_gpus"]) == (1, 6)


def test_lease_with_locality_and_max_wait_reaches_the_controller(pool: Pool) -> None:
    lease = pool.json(
        "lease", "create", "--compute", "10%", "-m", "1GiB", "--locality", "any", "--max-wait", "120"
    )
    assert lease["state"] == "granted"
