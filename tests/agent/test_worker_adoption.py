"""Workers outlive their agent: a new agent adopts those still running, reports those gone,
and stops adopted workers whose lease ended."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from gpupool.agent.mps import MpsSupervisor
from gpupool.agent.workers import GONE_WHILE_AWAY, WorkerSupervisor
from gpupool.protocol.v1.api import RemoteLease, RemoteSlice
from tests.timing import scaled

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

LEASE = RemoteLease(
    token="t0ken",
    slices=[RemoteSlice(gpu_uuid="GPU-x", gpu_index=0, compute_pct=10, memory_mib=64)],
)


def _supervisor(root: Path) -> WorkerSupervisor:
    mps = MpsSupervisor(root / "mps")
    mps.enabled = False
    return WorkerSupervisor(root / "workers", mps, simulated=True)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Our own child: a zombie until reaped.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1].startswith("Z")


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + scaled(20)
    while not _gone(pid):
        assert time.monotonic() < deadline, f"worker {pid} still runs"
        time.sleep(0.1)


def test_next_agent_adopts_a_running_worker_and_stops_it_when_its_lease_ends(
    tmp_path: Path,
) -> None:
    first = _supervisor(tmp_path)
    first.reconcile({"l-1": LEASE})
    (report,) = first.reports()
    assert report.alive and report.endpoint
    pid = first.workers[("l-1", "GPU-x", 0)].proc.pid
    try:
        # The first agent dies without stopping anything: a new one starts on the same dir.
        second = _supervisor(tmp_path)
        (adopted,) = second.reports()
        assert adopted.alive and adopted.endpoint == report.endpoint
        assert second.workers[("l-1", "GPU-x", 0)].proc.pid == pid
        second.reconcile({"l-1": LEASE})
        assert second.workers[("l-1", "GPU-x", 0)].proc.pid == pid, "kept, not started again"
        second.reconcile({})
        _wait_gone(pid)
        assert second.reports() == []
        assert _supervisor(tmp_path).reports() == [], "the registry forgot the ended lease"
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_worker_gone_while_no_agent_ran_is_reported_dead_not_restarted(tmp_path: Path) -> None:
    first = _supervisor(tmp_path)
    first.reconcile({"l-1": LEASE})
    pid = first.workers[("l-1", "GPU-x", 0)].proc.pid
    os.kill(pid, signal.SIGKILL)
    first.workers[("l-1", "GPU-x", 0)].proc.wait()

    second = _supervisor(tmp_path)
    (report,) = second.reports()
    assert not report.alive and report.error == GONE_WHILE_AWAY
    second.reconcile({"l-1": LEASE})
    assert second.workers == {}, "no empty worker is started in its place"
    (report,) = second.reports()
    assert report.error == GONE_WHILE_AWAY


def test_a_recycled_pid_is_not_adopted(tmp_path: Path) -> None:
    root = tmp_path / "workers"
    root.mkdir()
    # This test's own pid stands for a pid some other program got after the worker died.
    (root / "workers.json").write_text(
        f'[{{"lease_id": "l-1", "gpu_uuid": "GPU-x", "pid": {os.getpid()}, '
        f'"create_time": 1.0, "endpoint": "tcp://127.0.0.1:1", "status_file": "s"}}]'
    )
    supervisor = _supervisor(tmp_path)
    assert supervisor.workers == {}
    (report,) = supervisor.reports()
    assert not report.alive
