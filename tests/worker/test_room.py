"""A CPU worker's allocations on a simulated GPU: they fit the GPU's ledger with the other
workers' holdings, wait for room when it lacks, and fail when refused."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpupool.protocol.v1.simgpu import SimulatedGpuMemory
from gpupool.worker.activity import Activity
from gpupool.worker.memory import HostMemory, LimitExceeded, MiB
from gpupool.worker.room import Room

torch = pytest.importorskip("torch")


def ledger(tmp_path: Path, total_mib: int = 100) -> SimulatedGpuMemory:
    return SimulatedGpuMemory.create(tmp_path / "gpu.json", total_mib * MiB)


def test_ledger_claims_fit_the_total_and_prune_forgets_gone_workers(tmp_path: Path) -> None:
    gpu = ledger(tmp_path)
    assert gpu.claim("1", 60 * MiB) == 0
    assert gpu.claim("2", 50 * MiB) == 10 * MiB
    assert gpu.usage() == (60 * MiB, 100 * MiB)
    gpu.record("1", 20 * MiB)
    assert gpu.claim("2", 50 * MiB) == 0
    gpu.prune(["2"])
    assert gpu.usage() == (50 * MiB, 100 * MiB)


def test_an_allocation_waits_until_another_worker_frees_the_room(tmp_path: Path) -> None:
    gpu = ledger(tmp_path)
    assert gpu.claim("other", 70 * MiB) == 0
    activity = Activity(lease_id="l-b")
    asked = threading.Event()
    room = Room(activity, timeout_s=20, flush=lambda: asked.set() if activity.room_seq else None)
    memory = HostMemory(60 * MiB, gpu, room)
    freed = threading.Thread(target=lambda: (asked.wait(10), gpu.record("other", 0)))
    freed.start()
    memory.charge([torch.empty(40 * MiB // 4)])
    freed.join()
    assert activity.room_seq == 1 and activity.room_wanted_bytes == 0
    assert gpu.usage()[0] == memory.held_bytes() == 40 * MiB


def test_a_refused_request_fails_the_allocation_and_holds_nothing(tmp_path: Path) -> None:
    gpu = ledger(tmp_path)
    assert gpu.claim("other", 70 * MiB) == 0
    activity = Activity(lease_id="l-b")
    room = Room(activity, timeout_s=20)
    refuse = threading.Timer(0.2, lambda: room.deny(1))
    refuse.start()
    memory = HostMemory(60 * MiB, gpu, room)
    with pytest.raises(LimitExceeded, match="no other session on this GPU can give way"):
        memory.charge([torch.empty(40 * MiB // 4)])
    assert memory.held_bytes() == 0 and gpu.usage()[0] == 70 * MiB
    assert room.take_refusal() is None  # said once, in that error


def test_a_request_nobody_answers_fails_at_the_timeout_saying_so(tmp_path: Path) -> None:
    gpu = ledger(tmp_path)
    assert gpu.claim("other", 70 * MiB) == 0
    room = Room(Activity(lease_id="l-b"), timeout_s=1)
    memory = HostMemory(60 * MiB, gpu, room)
    with pytest.raises(LimitExceeded, match="no other session on this GPU made room within 1 s"):
        memory.charge([torch.empty(40 * MiB // 4)])
    assert memory.held_bytes() == 0 and room.waits == 1


def test_the_lease_limit_is_checked_before_the_gpu(tmp_path: Path) -> None:
    gpu = ledger(tmp_path)
    room = Room(Activity(lease_id="l-b"), timeout_s=20)
    memory = HostMemory(10 * MiB, gpu, room)
    with pytest.raises(LimitExceeded, match="over the limit"):
        memory.charge([torch.empty(20 * MiB // 4)])
    assert room.waits == 0
