"""`gpupool tenant set` changes only the limits it is given and can remove one."""

from __future__ import annotations

import pytest

from gpupool.cli.errors import BadInput
from gpupool.cli.tenants import QuotaChange
from gpupool.protocol.v1.api import TenantOut


def tenant(**limits: int | None) -> TenantOut:
    base: dict[str, object] = {
        "name": "team",
        "weight": 1.0,
        "max_gpus": 2,
        "max_memory_mib": 81920,
        "max_compute_pct": 400,
        "max_leases": 10,
        "max_priority": 100,
        "used_gpus": 0,
        "used_memory_mib": 0,
        "used_compute_pct": 0,
        "used_leases": 0,
        "queued_leases": 0,
    }
    base.update(limits)
    return TenantOut.model_validate(base)


def test_set_keeps_the_limits_it_is_not_given() -> None:
    change = QuotaChange.parse("4", None, None, None, None)
    quota = change.applied_to(tenant())
    assert quota.max_gpus == 4
    assert quota.max_memory == "81920MiB"
    assert quota.max_compute_pct == 400
    assert quota.max_leases == 10
    assert quota.max_priority == 100


def test_unlimited_removes_a_limit() -> None:
    change = QuotaChange.parse(None, "unlimited", "none", None, None)
    quota = change.applied_to(tenant())
    assert quota.max_memory is None
    assert quota.max_compute_pct is None
    assert quota.max_gpus == 2


def test_sizes_and_percents_are_read_as_people_write_them() -> None:
    change = QuotaChange.parse(None, "1.5GiB", "250%", None, None)
    quota = change.applied_to(None)
    assert quota.max_memory == "1536MiB"
    assert quota.max_compute_pct == 250


@pytest.mark.parametrize("text", ["-1", "2.5", "lots"])
def test_limits_must_be_whole_numbers(text: str) -> None:
    with pytest.raises(BadInput):
        QuotaChange.parse(text, None, None, None, None)
