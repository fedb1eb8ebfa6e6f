"""Reads (device to host) of remote tensors: chunked DATA frames received straight into the
output over TCP (cuda:0), chunks announced through the shared arena over a Unix socket
(cuda:1), exact for every dtype, for sizes that do not end on a chunk, for views that are not
one block, and behind non-blocking puts still streaming."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpupool.protocol.v1.dataplane import CHUNK_BYTES

DEVICES = ("cuda:0", "cuda:1")
"""cuda:0's worker is reached over TCP, cuda:1's over a Unix socket with shared memory."""

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip


def _values(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(numel, generator=generator, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (numel,), generator=generator, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_reads_of_every_dtype_across_a_chunk_boundary_are_exact(
    attach: Callable[..., Any], device: str
) -> None:
    attach(2)
    for i, dtype in enumerate(DTYPES):
        itemsize = torch.empty((), dtype=dtype).element_size()
        # Past one 8 MiB chunk by an odd count of elements: the last chunk is a short one.
        host = _values(dtype, CHUNK_BYTES // itemsize + 7, seed=i)
        back = host.to(device).cpu()
        assert back.dtype == dtype and back.shape == host.shape and back.device.type == "cpu"
        assert torch.equal(back, host), dtype


@pytest.mark.parametrize("device", DEVICES)
def test_reads_of_large_odd_small_and_empty_tensors_are_exact(
    attach: Callable[..., Any], device: str
) -> None:
    attach(2)
    for numel in (
        3 * CHUNK_BYTES // 4 + 1,  # 24 MiB and 4 bytes: four chunks
        (1 << 20) // 4 + 3,  # just above the size that goes through shared memory
        (1 << 20) // 4,  # just at it: in the reply frame
        1,
        0,
    ):
        host = _values(torch.float32, numel, seed=numel).reshape(-1, 1)
        back = host.to(device).cpu()
        assert back.shape == host.shape and torch.equal(back, host), numel
    scalar = torch.tensor(2.5, dtype=torch.float64)
    assert scalar.to(device).cpu().shape == () and scalar.to(device).item() == 2.5


@pytest.mark.parametrize("device", DEVICES)
def test_reads_of_views_that_are_not_one_block(attach: Callable[..., Any], device: str) -> None:
    attach(2)
    host = _values(torch.float32, 3000 * 1500, seed=1).reshape(3000, 1500)  # 18 MiB
    remote = host.to(device)
    assert torch.equal(remote.t().cpu(), host.t())
    assert torch.equal(remote[::3, 1::2].cpu(), host[::3, 1::2])
    assert torch.equal(remote[:, :1].expand(3000, 4000).cpu(), host[:, :1].expand(3000, 4000))
    assert torch.equal(remote.t().contiguous().cpu(), host.t().contiguous())
    cplx = _values(torch.complex64, 2 * CHUNK_BYTES // 8 + 5, seed=2)
    back = cplx.to(device).conj().cpu()
    assert torch.equal(back.resolve_conj(), cplx.conj().resolve_conj())
    flags = _values(torch.bool, 4096 * 3001, seed=3).reshape(4096, 3001)
    assert torch.equal(flags.to(device).t().cpu(), flags.t())


@pytest.mark.parametrize("device", DEVICES)
def test_a_read_while_non_blocking_puts_are_still_streaming(
    attach: Callable[..., Any], device: str
) -> None:
    attach(2)
    before = _values(torch.float32, 5 * CHUNK_BYTES // 4 + 9, seed=4)
    remote_before = before.to(device)
    batches = [_values(torch.float32, 3 * CHUNK_BYTES // 4, seed=10 + i).pin_memory()
               for i in range(3)]  # fmt: skip
    moved = [batch.to(device, non_blocking=True) for batch in batches]
    # Behind the puts' bytes in the stream: a large read, then one of a value made from them.
    assert torch.equal(remote_before.cpu(), before)
    total = moved[0] + moved[1] * 2 - moved[2]
    assert torch.equal(total.cpu(), batches[0] + batches[1] * 2 - batches[2])
    assert torch.equal(moved[2].cpu(), batches[2])
