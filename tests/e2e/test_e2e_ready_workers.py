"""`gpupool agent --ready-workers N` with a real controller, agent and workers: the pool of
ready workers shows in `gpupool nodes` (READY), in the agent's status API and its metrics; a
remote lease is served by a ready worker, under its own memory limit, and the pool refills;
the controller wakes the agent at the grant, so a lease does not wait for the agent's next
heartbeat; with `--ready-workers 0` the column says off and the lease's worker starts cold."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_pool import Pool, gpupool_argv, start_pool, stop_pool

from gpupool.client.sdk import PoolClient
from gpupool.protocol.v1.api import LeaseCreate
from gpupool.protocol.v1.dataplane import (
    VERSION,
    Kind,
    connect,
    parse_address,
    recv_handshake,
    send_handshake,
)
from tests.conftest import ADMIN_TOKEN
from tests.timing import scaled

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

READY_S = 120.0


def _pool(
    tmp_path: Path, ready: int, *options: str, controller: tuple[str, ...] = ()
) -> Iterator[Pool]:
    started = start_pool(
        tmp_path, "1xH100-80GB", *controller,
        agent_options=("--ready-workers", str(ready), *options),
    )  # fmt: skip
    try:
        yield started
    finally:
        stop_pool(started)


@pytest.fixture
def ready_pool(tmp_path: Path) -> Iterator[Pool]:
    yield from _pool(tmp_path, 1)


@pytest.fixture
def cold_pool(tmp_path: Path) -> Iterator[Pool]:
    yield from _pool(tmp_path, 0)


HEARTBEAT_S = 30.0


@pytest.fixture
def slow_heartbeat_pool(tmp_path: Path) -> Iterator[Pool]:
    """An agent that heartbeats every 30 s (the controller keeps it up for 120 s between)."""
    interval = ("--interval", f"{HEARTBEAT_S:g}")
    yield from _pool(tmp_path, 1, *interval, controller=("--node-timeout", "120"))


def _agent_status(pool: Pool) -> dict[str, Any]:
    (node,) = pool.json("nodes")
    response = httpx.get(node["agent_url"] + "/agent/v1/status", timeout=scaled(5))
    return dict(response.json()["ready_workers"])


def _metrics(pool: Pool) -> str:
    (node,) = pool.json("nodes")
    return httpx.get(node["agent_url"] + "/metrics", timeout=scaled(5)).text


def _ready_column(pool: Pool) -> str:
    """The READY cell of the node's row in `gpupool nodes`, as a user reads it."""
    lines = pool.ok("nodes").stdout.splitlines()
    header = next(line for line in lines if "READY" in line)
    names = [cell.strip() for cell in header.strip("┃ ").split("┃")]
    row = next(line for line in lines if line.startswith("│") and " up " in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    return cells[names.index("READY")]


def _remote_lease(pool: Pool, memory: str) -> tuple[str, str, str]:
    with PoolClient(pool.url, token=ADMIN_TOKEN) as client:
        lease = client.create_lease(
            LeaseCreate(compute_pct=20, memory=memory, access="remote", ttl_s=600)
        )
        token = lease.token or ""
        lease = client.wait_for_workers(lease.id, timeout=scaled(READY_S))
    endpoint = lease.slices[0].endpoint
    assert endpoint is not None
    return lease.id, token, endpoint


def _welcome(endpoint: str, lease: str, token: str) -> dict[str, Any]:
    with connect(parse_address(endpoint)) as sock:
        send_handshake(sock, [Kind.HELLO, {"v": VERSION, "lease": lease, "token": token}])
        head = recv_handshake(sock).head
    assert head[0] == Kind.WELCOME, head
    return dict(head[1])


def test_a_remote_lease_takes_a_ready_worker_and_the_pool_refills(ready_pool: Pool) -> None:
    pool = ready_pool
    pool.wait_for("a ready worker", lambda: _agent_status(pool)["gpus"], READY_S)
    pool.wait_for("1/1 in gpupool nodes", lambda: _ready_column(pool) == "1/1", READY_S)
    (node,) = pool.json("nodes")
    assert node["host"]["ready_workers"] == 1 and node["host"]["ready_workers_wanted"] == 1
    assert "gpupool_agent_ready_workers_wanted 1.0" in _metrics(pool)
    lease, token, endpoint = _remote_lease(pool, "96MiB")
    status = _agent_status(pool)
    assert status["handed_over"] == 1 and status["per_gpu"] == 1
    welcome = _welcome(endpoint, lease, token)
    assert welcome["memory_limit_bytes"] == 96 << 20
    # Refilled in the background: a fresh worker, ready for the next lease.
    pool.wait_for("a refill", lambda: _agent_status(pool)["started"] == 2, READY_S)
    pool.wait_for("1/1 again", lambda: _ready_column(pool) == "1/1", READY_S)
    assert "gpupool_agent_ready_workers_handed_over_total 1.0" in _metrics(pool)
    pool.ok("lease", "release", lease)


def test_with_no_ready_workers_a_remote_lease_starts_its_worker_cold(cold_pool: Pool) -> None:
    pool = cold_pool
    pool.wait_for("the agent's facts", lambda: pool.json("nodes")[0]["host"].get("cpu_pct"))
    pool.wait_for("READY off", lambda: _ready_column(pool) == "off")
    lease, token, endpoint = _remote_lease(pool, "64MiB")
    assert _welcome(endpoint, lease, token)["memory_limit_bytes"] == 64 << 20
    status = _agent_status(pool)
    assert status["handed_over"] == 0 and status["started"] == 0 and status["per_gpu"] == 0
    pool.ok("lease", "release", lease)


def test_a_bad_ready_workers_setting_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        gpupool_argv("agent", "--url", "http://127.0.0.1:9", "--fake", "1xH100-80GB",
                     "--ready-workers", "9", "--data-dir", str(tmp_path)),
        capture_output=True, text=True, timeout=scaled(60), env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 2 and "--ready-workers must be 0..8, got 9" in done.stderr


def test_the_grant_wakes_the_agent_instead_of_waiting_for_its_heartbeat(
    slow_heartbeat_pool: Pool,
) -> None:
    pool = slow_heartbeat_pool
    pool.wait_for("a ready worker", lambda: _agent_status(pool)["gpus"].get(_gpu(pool)), READY_S)
    # Just after a heartbeat, the next one is HEARTBEAT_S away: a lease that reaches the agent
    # sooner was brought by the controller's wake call.
    seen = _heartbeats(pool)
    pool.wait_for("a heartbeat", lambda: _heartbeats(pool) > seen, HEARTBEAT_S + 10)
    beat_s = time.time()
    with PoolClient(pool.url, token=ADMIN_TOKEN) as client:
        lease = client.create_lease(LeaseCreate(compute_pct=20, memory="64MiB", access="remote"))
        assert lease.state == "granted", lease
        lease = client.wait_for_workers(lease.id, timeout=scaled(20))
    assert lease.slices[0].endpoint
    (started,) = _agent_status(pool)["workers"]
    assert started["ready"] is True and started["lease_id"] == lease.id
    assert started["asked_at"] < beat_s + HEARTBEAT_S - 5, "the agent waited for its heartbeat"


def _heartbeats(pool: Pool) -> float:
    """Heartbeats the controller accepted from the agent, by the agent's metrics."""
    for line in _metrics(pool).splitlines():
        if line.startswith("gpupool_agent_heartbeats_total "):
            return float(line.split()[1])
    raise AssertionError("no gpupool_agent_heartbeats_total")


def _gpu(pool: Pool) -> str:
    (gpu,) = pool.json("gpus")
    return str(gpu["uuid"])
