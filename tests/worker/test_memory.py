"""The lease's memory ledger: storages counted once and at their grown size, tensors moved to
another storage by set_ released from that one, reservations ahead of allocations, and the
process cap that holds what no count foresees."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from gpupool.worker.memory import (
    CudaMemory,
    HostMemory,
    LimitExceeded,
    MiB,
    ProcessCap,
    data_segment_bytes,
    is_out_of_memory,
)


def test_a_storage_grown_by_resize_is_counted_at_its_new_size() -> None:
    memory = HostMemory(None)
    tensor = torch.zeros(4)
    view = tensor[:2]
    memory.charge([tensor, view])
    assert memory.held_bytes() == 16
    tensor.resize_(1000)  # moves the bytes: the data pointer changes, the storage stays
    memory.recount([tensor])
    assert memory.held_bytes() == 4000
    memory.release(tensor)
    assert memory.held_bytes() == 4000  # the view still holds the grown storage
    memory.release(view)
    assert memory.held_bytes() == 0


def test_a_tensor_moved_by_set_is_released_from_its_new_storage_only() -> None:
    """The hole: a small tensor set_ onto a big one's storage, then freed, took the big
    storage's count with it while the big tensor still held the memory."""
    memory = HostMemory(None)
    big, small = torch.zeros(1000), torch.zeros(1)
    memory.charge([big, small])
    assert memory.held_bytes() == 4004
    small.set_(big)
    memory.recount([small])
    assert memory.held_bytes() == 4000  # small's own storage is gone, big's counted once
    memory.release(small)
    assert memory.held_bytes() == 4000
    memory.release(big)
    assert memory.held_bytes() == 0


def test_a_tensor_stored_twice_is_released_per_handle() -> None:
    memory = HostMemory(None)
    tensor = torch.zeros(10)
    memory.charge([tensor])
    memory.charge([tensor])  # add_ returns its input: one object under two handles
    memory.release(tensor)
    assert memory.held_bytes() == 40
    memory.release(tensor)
    assert memory.held_bytes() == 0


def test_growth_past_the_limit_is_refused_at_the_recount_and_stays_counted() -> None:
    memory = HostMemory(1000)
    tensor = torch.zeros(4)
    memory.charge([tensor])
    tensor.resize_(500)
    with pytest.raises(LimitExceeded):
        memory.recount([tensor])
    assert memory.held_bytes() == 2000  # what the storage really holds now


def test_reservations_refuse_past_the_limit_and_outlive_a_reset() -> None:
    memory = HostMemory(100)
    first = memory.reserve_host(60, "a buffer")
    with pytest.raises(LimitExceeded, match=r"another buffer \(0.0 MiB\) would hold"):
        memory.reserve_host(50, "another buffer")
    assert memory.held_bytes() == 60
    with pytest.raises(LimitExceeded):
        memory.charge([torch.zeros(12)])  # 48 bytes beside the 60 reserved
    assert memory.held_bytes() == 60
    memory.reset()  # the client left; the buffer's owner still holds it
    assert memory.held_bytes() == 60
    first.release()
    first.release()
    assert memory.held_bytes() == 0


def test_a_reservation_ends_with_its_block() -> None:
    memory = HostMemory(100)
    with memory.reserve(80):
        assert memory.held_bytes() == 80
    assert memory.held_bytes() == memory.peak_bytes() - 80 == 0


def test_only_host_tensors_are_counted() -> None:
    memory = HostMemory(10)
    memory.charge([torch.empty(1 << 20, device="meta")])
    assert memory.held_bytes() == 0


def test_out_of_memory_errors_of_every_source_are_the_leases() -> None:
    assert is_out_of_memory(LimitExceeded("over"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_the_process_cap_refuses_what_passes_its_limit_and_moves_with_a_resize() -> None:
    """In a process of its own: the cap is the whole process's."""
    script = textwrap.dedent(
        """
        import torch
        from gpupool.worker.memory import ProcessCap, is_out_of_memory
        cap = ProcessCap(margin_bytes=32 << 20)
        cap.apply(32 << 20)
        keep = torch.ones(16 << 20, dtype=torch.uint8)  # within the cap
        try:
            torch.empty(256 << 20, dtype=torch.uint8)
            print("allocated")
        except RuntimeError as exc:
            print("refused" if is_out_of_memory(exc) else f"other: {exc}")
        cap.apply(512 << 20)  # a live resize raises it again
        more = torch.ones(128 << 20, dtype=torch.uint8)
        cap.apply(None)
        print("resized", int(more.sum()) == 128 << 20)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["refused", "resized", "True"], done.stdout + done.stderr


def test_a_process_cap_without_a_limit_leaves_the_process_alone() -> None:
    cap = ProcessCap()
    cap.apply(None)
    assert cap.cap_bytes is None
    assert data_segment_bytes() >= cap.baseline_bytes - 64 * MiB


class _FakeProperties:
    total_memory = 80 << 30


def _no_gpu_needed(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """CudaMemory's calls into CUDA, stood in for: its host-allowance logic runs on the CPU."""
    fractions: list[float] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _FakeProperties())
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f)
    )
    return fractions


def test_a_cuda_workers_host_allowance_follows_its_device_limit_unless_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fractions = _no_gpu_needed(monkeypatch)
    following = CudaMemory(torch.device("cuda", 0), 8 << 30)
    assert following.host_limit_bytes == 8 << 30 and fractions == [0.1]
    following.set_limit(16 << 30)  # a live resize moves both
    assert following.host_limit_bytes == 16 << 30
    own = CudaMemory(torch.device("cuda", 0), 8 << 30, host_limit_bytes=MiB)
    own.set_limit(16 << 30)
    assert own.host_limit_bytes == MiB


def test_a_cuda_workers_host_tensors_and_buffers_count_against_its_allowance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_gpu_needed(monkeypatch)
    memory = CudaMemory(torch.device("cuda", 0), 8 << 30, host_limit_bytes=1000)
    memory.charge([torch.zeros(200), torch.empty(1 << 30, device="meta")])  # host: 800 bytes
    assert memory.host_held_bytes() == 800
    with pytest.raises(LimitExceeded, match="a read's host copy"):
        memory.reserve_host(400, "a read's host copy")
    assert memory.reserve(1 << 40).nbytes == 0  # device outputs: the allocator's to refuse
    memory.release(torch.zeros(1))  # never charged: nothing happens
    assert memory.host_held_bytes() == 800


def test_a_cuda_workers_library_buffers_are_held_shown_and_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL's buffers beside the caching allocator: the allocator's share shrinks by them, the
    lease shows them as held (a process group's 580 MiB were once shown as 4 MiB), one that does
    not fit is refused, and they leave the count with their process group."""
    fractions = _no_gpu_needed(monkeypatch)
    allocated = {"current": 4 * MiB, "peak": 6 * MiB}
    memory = CudaMemory(torch.device("cuda", 0), 1024 * MiB)
    monkeypatch.setattr(memory, "_allocated", lambda which: allocated[which])
    held = memory.hold_outside(580 * MiB, "NCCL's buffers for the process group")
    assert memory.held_bytes() == 584 * MiB and memory.peak_bytes() == 586 * MiB
    assert fractions[-1] == pytest.approx((1024 - 580) * MiB / (80 << 30))
    with pytest.raises(LimitExceeded, match=r"NCCL's buffers .* 1024 MiB \(584.0 MiB held\)"):
        memory.hold_outside(441 * MiB, "NCCL's buffers for the process group")
    assert memory.held_bytes() == 584 * MiB  # the refused hold left nothing behind
    held.release()
    assert memory.held_bytes() == 4 * MiB
    assert fractions[-1] == pytest.approx(1024 * MiB / (80 << 30))
