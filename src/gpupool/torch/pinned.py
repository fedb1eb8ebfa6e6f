"""Pinned host memory for a process whose GPUs are remote: `pin_memory()` and `is_pinned()`.

A CPU-only torch (or a CUDA build that sees no GPU, as a pool client does) cannot pin: its
`pin_memory()` asks CUDA for page-locked memory and raises "No CUDA GPUs are available". Real
loaders pin every batch (`DataLoader(pin_memory=True)`) and copy it with `non_blocking=True`.
For a remote device, page locking buys nothing in this process (the bytes leave through a
socket or the shared arena, never by DMA from here), so a pinned tensor is a host tensor in
memory of its own that `is_pinned()` recognises, as long as any tensor or view uses it.

Pinned tensors of 1 MiB or more live in one shared region of this process (`SharedPinned`, a
sealed memfd) that every worker on this host maps when its stream opens and registers with
CUDA as it is used: `x.to("cuda", non_blocking=True)` of such a tensor names its bytes there
and the worker's GPU copies them by DMA, as a local GPU copies pinned memory; no copy is made
in this process. Like CUDA's caching host allocator, freed blocks are kept for the next pin of
that size, and a block is reused only once every stream that copied from it has synchronised
since (a read or a sync waits for the worker's stream). Forked children (DataLoader workers)
never allocate there: the region is the parent's.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import threading
import weakref
from collections import deque
from typing import Any, Protocol

import torch

from gpupool.torch.tensor import contiguous_strides

_PINNED: dict[int, tuple[int, int]] = {}
"""Start address → (length, block number) of every pinned block alive (its views share the
storage). The number tells blocks at one address apart: a freed mmap unmaps its memory before
its finalizer runs, with the GIL released, so the loader's pin thread can map the next block at
that very address first; the old finalizer must then leave the new block's entry alone."""
_numbers = itertools.count()
_lock = threading.RLock()
"""DataLoader pins in a thread of its own while the program's thread asks is_pinned();
reentrant, since a block's finalizer may run in a thread that holds it."""


SHARED_MIN_BYTES = 1 << 20
"""Smaller pinned tensors keep memory of their own: their puts ride in batches or the stream's
arena, and a 2 MiB block each would waste more than the copy costs."""
BLOCK_ALIGN = 2 << 20
"""Shared blocks start and end on 2 MiB boundaries (huge-page sized, and few registration
granules on the worker cross a block's end)."""
SHARED_PINNED_MIB = int(os.environ.get("GPUPOOL_PINNED_MIB", "8192"))
"""The shared region's size: address space only until blocks are used (memfd pages are made
when written). Beyond it, pinned tensors fall back to memory of their own (copied on put)."""


class _Block(mmap.mmap):
    """Anonymous page-aligned memory; a subclass only so that its end can be watched."""


class StreamClock(Protocol):
    """What a device stream tells the allocator: how many times it has drained its worker's
    stream (each read and sync waits for every copy queued before it)."""

    open: bool
    sync_epoch: int


class SharedPinned:
    """The process's pinned region that workers on this host map: blocks by size, reused once
    every copy out of them is known to be done."""

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("gpupool-pinned", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # A worker maps the whole region: sealed, it can never shrink under the worker's
            # copies (a shrunk mapping would fault the worker, not this process).
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size = fd, size
        self._anchor = (ctypes.c_uint8 * 1).from_buffer(self.map)
        self.base = ctypes.addressof(self._anchor)
        self._top = 0
        self._free: dict[int, list[int]] = {}
        """Block size → offsets of free blocks of that size."""
        self._copied: dict[int, list[tuple[weakref.ref[Any], int]]] = {}
        """Block offset → (stream, its sync epoch) of every put that read the block."""
        self._waiting: list[tuple[int, int]] = []
        """Freed blocks (offset, size) that a stream may still be copying from."""
        self._released: deque[tuple[int, int]] = deque()
        """Blocks whose last tensor died (appended by finalizers, at any moment, lock-free)."""

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor over a free block of at least nbytes (None: the region is full)."""
        size = -(-nbytes // BLOCK_ALIGN) * BLOCK_ALIGN
        with _lock:
            self._collect()
            taken = self._take(size)
            if taken is None:
                return None
            offset, size = taken
        buffer = (ctypes.c_uint8 * size).from_buffer(self.map, offset)
        weakref.finalize(buffer, self._released.append, (offset, size))
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
        _remember(flat, buffer)  # the storage keeps the buffer alive: it ends with the last view
        return flat

    def offset_of(self, tensor: torch.Tensor, nbytes: int) -> int | None:
        """Where a host tensor's nbytes start in the region (None: not in it)."""
        offset = tensor.data_ptr() - self.base
        if offset >= 0 and offset + nbytes <= self.size:
            return offset
        return None

    def copied_by(self, tensor: torch.Tensor, stream: StreamClock) -> None:
        """A put on `stream` reads the tensor's block until that stream next synchronises."""
        block = tensor.untyped_storage().data_ptr() - self.base
        with _lock:
            self._copied.setdefault(block, []).append((weakref.ref(stream), stream.sync_epoch))

    def _take(self, size: int) -> tuple[int, int] | None:
        free = self._free.get(size)
        if free:
            return free.pop(), size
        if self._top + size <= self.size:
            offset, self._top = self._top, self._top + size
            return offset, size
        larger = sorted(s for s, offsets in self._free.items() if offsets and s > size)
        if larger:
            return self._free[larger[0]].pop(), larger[0]
        return None

    def _collect(self) -> None:
        while self._released:
            self._waiting.append(self._released.popleft())
        still: list[tuple[int, int]] = []
        for offset, size in self._waiting:
            if self._done(offset):
                self._copied.pop(offset, None)
                self._free.setdefault(size, []).append(offset)
            else:
                still.append((offset, size))
        self._waiting = still

    def _done(self, offset: int) -> bool:
        for ref, epoch in self._copied.get(offset, ()):
            stream = ref()
            if stream is not None and stream.open and stream.sync_epoch <= epoch:
                return False
        return True

    def in_use_bytes(self) -> int:
        """Bytes of blocks handed out and not yet free again (tests check reuse)."""
        with _lock:
            self._collect()
            free = sum(size * len(offsets) for size, offsets in self._free.items())
            return self._top - free


_shared: SharedPinned | None = None
_shared_off = False
"""Set in forked children, and where the region cannot be made: memory of their own."""


def shared_region() -> SharedPinned | None:
    """The process's shared pinned region, made on first use (None where it cannot be)."""
    global _shared, _shared_off
    if _shared is None and not _shared_off and SHARED_PINNED_MIB > 0:
        with _lock:
            if _shared is None and not _shared_off:
                try:
                    _shared = SharedPinned(SHARED_PINNED_MIB << 20)
                except OSError:
                    _shared_off = True
    return _shared


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
    flat = _shared_block(span) if span >= SHARED_MIN_BYTES else None
    if flat is None:
        block = _Block(-1, max(span, 1))
        flat = torch.frombuffer(block, dtype=torch.uint8, count=max(span, 1))
        _remember(flat, block)
        del block  # the storage keeps it alive: it ends when the last view of it does
    pinned = flat[:span].view(tensor.dtype).as_strided(tuple(tensor.shape), strides)
    with torch.no_grad():
        pinned.copy_(tensor)
    if tensor.requires_grad:
        return _PinCopy.apply(tensor, pinned)
    return pinned


def _shared_block(nbytes: int) -> torch.Tensor | None:
    region = shared_region()
    return region.allocate(nbytes) if region is not None else None


def _remember(flat: torch.Tensor, owner: object) -> None:
    """is_pinned() knows the block until `owner`, the buffer its storage keeps, goes."""
    address, number = flat.data_ptr(), next(_numbers)
    with _lock:
        _PINNED[address] = (flat.numel(), number)
    weakref.finalize(owner, _forget, address, number)


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
    """A loader forks while its pin thread may hold the lock: the child gets one of its own,
    and never allocates in the parent's shared region (both would hand out the same blocks)."""
    global _lock, _shared, _shared_off
    _lock = threading.RLock()
    _shared, _shared_off = None, True


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
