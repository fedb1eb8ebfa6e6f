"""Swap-out and restore on a real GPU: the staged copies keep every byte and every alias."""

from __future__ import annotations

import pytest
import torch

from gpupool.worker import swap

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _table(device: torch.device) -> dict[int, torch.Tensor]:
    """Handles over storages of awkward sizes (empty, one byte, one past a staging chunk,
    several chunks), with views sharing storages."""
    generator = torch.Generator(device=device).manual_seed(7)
    big = torch.randint(0, 255, (3 * swap.STAGE_BYTES + 5,), dtype=torch.uint8, device=device)
    weights = torch.randn(swap.STAGE_BYTES // 4 + 3, device=device, generator=generator)
    return {
        1: torch.empty(0, device=device),
        2: torch.tensor([3], dtype=torch.uint8, device=device),
        3: big,
        4: big[7:1000].view(-1),
        5: weights,
        6: weights[::2],
        7: torch.randn(64, 64, device=device, generator=generator, dtype=torch.bfloat16).t(),
    }


def test_swap_out_and_restore_keep_bytes_and_aliasing() -> None:
    device = torch.device("cuda", 0)
    table = _table(device)
    expected = {h: t.cpu().clone() for h, t in table.items()}
    state = swap.capture(table, device)
    assert state.on_host
    assert not any(s.is_pinned() for s in state.storages), "swapped state lives in pageable memory"
    del table
    restored = swap.restore(state, device)
    for handle, tensor in restored.items():
        assert tensor.device == device
        assert torch.equal(tensor.cpu(), expected[handle]), handle
    restored[3][7] = 0  # an in-place write through one handle shows through its view
    assert restored[4][0].item() == 0
    restored[5][0] = 42.0
    assert restored[6][0].item() == 42.0


def test_restore_from_pinned_host_memory_copies_directly() -> None:
    device = torch.device("cuda", 0)
    table = _table(device)
    expected = {h: t.cpu().clone() for h, t in table.items()}
    state = swap.capture(table, device)
    state.storages = [s.pin_memory() if s.numel() else s for s in state.storages]
    restored = swap.restore(state, device)
    assert all(torch.equal(restored[h].cpu(), expected[h]) for h in expected)
