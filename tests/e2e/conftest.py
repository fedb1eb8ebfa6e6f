"""Fixtures: `pool` (a controller and a fake-GPU agent on loopback, started by the CLI) and
`netpool` (controller, agents and client each in a network namespace of its own)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_pool import HaPool, Pool, start_ha_pool, start_pool, stop_ha_pool, stop_pool
from netns import unavailable_reason
from netpool import NetPool, build
from pool_checks import FaultRecord


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    started = start_pool(tmp_path)
    try:
        yield started
    finally:
        stop_pool(started)


@pytest.fixture
def netpool(tmp_path: Path) -> Iterator[NetPool]:
    """Hosts `ctl`, `gpu-a`, `gpu-b` and `client` in network namespaces (nothing started);
    skipped with the reason where namespaces cannot be built, always torn down."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    yield from build(tmp_path)


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Iterator[FaultRecord]:
    """What a fault-injection test did and saw, for bench/results/reliability.md."""
    started = time.monotonic()
    rec = FaultRecord(fault=request.node.name)
    yield rec
    rec.seconds = round(time.monotonic() - started, 1)
    rec.save(request.node.name)


@pytest.fixture
def ha_pool(tmp_path: Path, ha_pg_url: str) -> Iterator[HaPool]:
    """Three `gpupool controller --ha` on one PostgreSQL and a fake-GPU agent knowing them all;
    nodes are marked down after 5 s of silence, so an agent that does not reconnect shows."""
    pool = start_ha_pool(tmp_path, ha_pg_url, 3, "--node-timeout", "5")
    try:
        yield pool
    finally:
        stop_ha_pool(pool)
