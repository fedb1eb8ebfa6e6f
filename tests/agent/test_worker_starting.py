"""A worker is the agent's from the moment its process exists, not from its ready line.

On a real GPU a worker's CUDA context appears before it is ready; the direct-slice watch, which
stops GPU processes that are neither tenants' direct programs nor the agent's own, stopped a
remote lease's worker in that window (seen on the H200 machine). The supervisor's pids()
includes workers still starting."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpupool.agent.mps import MpsSupervisor
from gpupool.agent.workers import WorkerSupervisor
from tests.agent.test_worker_isolation import _lease

pytest.importorskip("torch")
pytestmark = pytest.mark.slow


def test_a_starting_worker_counts_among_the_agents_processes(tmp_path: Path) -> None:
    mps = MpsSupervisor(tmp_path / "mps")
    mps.enabled = False
    supervisor = WorkerSupervisor(tmp_path / "workers", mps, simulated=True)
    seen_starting: set[int] = set()
    done = threading.Event()

    def start() -> None:
        try:
            supervisor.reconcile({"l-iso": _lease()})
        finally:
            done.set()

    thread = threading.Thread(target=start)
    thread.start()
    try:
        # The worker imports torch before it is ready: seconds, while this loop looks at
        # every millisecond what the supervisor counts as its own.
        while not done.is_set():
            with supervisor._lock:
                ready = {w.proc.pid for w in supervisor.workers.values()}
            seen_starting |= supervisor.pids() - ready
            done.wait(0.001)
        thread.join()
        (worker,) = supervisor.workers.values()
        assert worker.proc.pid in seen_starting, "the worker was the agent's before it was ready"
        assert supervisor.pids() == {worker.proc.pid}
    finally:
        supervisor.reconcile({})
    assert supervisor.pids() == set()
