"""Fixtures: `pool` (a controller and a fake-GPU agent on loopback, started by the CLI) and
`netpool` (controller, agents and client each in a network namespace of its own)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_pool import (
    FAKE_SPEC,
    START_TIMEOUT_S,
    HaPool,
    Pool,
    free_port,
    gpu_count,
    gpupool_argv,
    healthy,
    start_ha_pool,
    stop,
    stop_ha_pool,
)
from netns import unavailable_reason
from netpool import NetPool, build
from pool_checks import FaultRecord


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "controller.log").open("wb") as log:
        controller = subprocess.Popen(
            gpupool_argv("controller", "--port", str(port), "--data-dir", str(tmp_path / "ctl")),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    agent: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(url):
            assert controller.poll() is None, (tmp_path / "controller.log").read_text()
            assert time.monotonic() < deadline, "controller did not start"
            time.sleep(0.1)
        agent_args = ["--url", url, "--fake", FAKE_SPEC, "--interval", "0.3"]
        agent_args += ["--data-dir", str(tmp_path / "agent")]
        with (tmp_path / "agent.log").open("wb") as log:
            agent = subprocess.Popen(
                gpupool_argv("agent", *agent_args),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        while gpu_count(url) < 2:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, "agent did not register its GPUs"
            time.sleep(0.1)
        yield Pool(url, tmp_path, controller, agent)
    finally:
        if agent is not None:
            stop(agent)
        stop(controller)


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
