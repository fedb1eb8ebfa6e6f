"""Pinned host memory for a process whose GPUs are remote: `pin_memory()` and `is_pinned()`.

A CPU-only torch (or a CUDA build that sees no GPU, as a pool client does) cannot pin: its
`pin_memory()` asks CUDA for page-locked memory and raises "No CUDA GPUs are available". Real
loaders pin every batch (`DataLoader(pin_memory=True)`) and copy it with `non_blocking=True`.
For a remote device, page locking buys nothing in this process (the bytes leave through a
socket or the shared arena, never by DMA from here), so a pinned tensor is a host tensor in
memory of its own that `is_pinned()` recognises, as long as any tensor or view uses it.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref

import torch

from gpupool.torch.tensor import contiguous_strides

_PINNED: dict[int, tuple[int, int]] = {}
"""Start address → (length, block number) of every pinned block alive (its views share the
storage). The number tells blocks at one address apart: a freed mmap unmaps its memory before
its finalizer runs, with the GIL released, so the loader's pin thread can map the next block at
that very address first; the old finalizer must then leave the new block's entry alone."""
_numbers = itertools.count()
_lock = threading.Lock()
"""DataLoader pins in a thread of its own while the program's thread asks is_pinned()."""


class _Block(mmap.mmap):
    """Anonymous page-aligned memory; a subclass only so that its end can be watched."""


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a host tensor in pinned memory (the tensor itself if it is pinned already),
    with its shape, strides (where they are dense) and dtype; autograd sees a copy."""
    if is_pinned(tensor):
        return tensor
    if tensor.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{tensor.device}' memory: only host tensors can be pinned")
    if tensor.layout is not torch.strided:
        raise RuntimeError(f"gpupool cannot pin a {tensor.layout} tensor")
    strides = tensor.stride() if _dense(tensor) else contiguous_strides(tuple(tensor.shape))
    span = _span(tuple(tensor.shape), strides) * tensor.element_size()
    block = _Block(-1, max(span, 1))
    flat = torch.frombuffer(block, dtype=torch.uint8, count=max(span, 1))
    address, number = flat.data_ptr(), next(_numbers)
    with _lock:
        _PINNED[address] = (span, number)
    weakref.finalize(block, _forget, address, number)
    del block  # the storage keeps it alive: it ends when the last view of it does
    pinned = flat[:span].view(tensor.dtype).as_strided(tuple(tensor.shape), strides)
    with torch.no_grad():
        pinned.copy_(tensor)
    if tensor.requires_grad:
        return _PinCopy.apply(tensor, pinned)
    return pinned


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether a host tensor lives in memory `pin` made."""
    if tensor.device.type != "cpu" or tensor.layout is not torch.strided:
        return False
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return False
    with _lock:
        return address in _PINNED


def pinned_blocks() -> int:
    """How many pinned blocks are alive (tests check that they go with their tensors)."""
    with _lock:
        return len(_PINNED)


def _forget(address: int, number: int) -> None:
    with _lock:
        if _PINNED.get(address, (0, -1))[1] == number:
            del _PINNED[address]


def _fresh_lock_in_child() -> None:
    """A loader forks while its pin thread may hold the lock: the child gets one of its own."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense: its strides describe a block of exactly numel elements."""
    if tensor.is_contiguous():
        return True
    return tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)


def _span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))


class _PinCopy(torch.autograd.Function):
    """pin_memory() of a tensor that needs gradients is a copy autograd goes through."""

    @staticmethod
    def forward(ctx: object, source: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
        return pinned

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
