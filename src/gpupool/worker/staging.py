"""Page-locked buffers a CUDA worker reads socket puts into, so their copies to the device run
on the stream instead of stopping the worker until the GPU has caught up.

A put that arrives over TCP (no shared arena) used to land in a fresh pageable `bytearray`,
and a copy from pageable memory waits for every op queued on the stream before it: the worker
stopped issuing work until the GPU drained, once per batch a training loop moved. Here the
bytes land in one of two registered host buffers used in turn, the copy is asynchronous, and
an event recorded after it says when that buffer may be written again (one put later, so a
loop's copy has a whole step to finish). Each buffer is charged to the lease's host allowance
for as long as it exists, and given back, unregistered, when the client leaves.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpupool.protocol.v1.dataplane import SharedArena
from gpupool.worker.memory import LimitExceeded, Reservation

STAGING_BUFFERS = 2
REGISTER_GRANULE_BYTES = 64 << 20
"""A client's shared pinned region is registered in aligned pieces of this size, each the
first time a put names it: registrations never overlap, and untouched parts are never pinned."""

log = logging.getLogger("gpupool.worker")


@dataclass
class _Buffer:
    block: mmap.mmap
    view: torch.Tensor
    reservation: Reservation
    event: torch.cuda.Event | None = None


class PinnedStaging:
    """Two registered host buffers, each reused once the copy out of it has finished."""

    def __init__(self, reserve_host: Callable[[int, str], Reservation]) -> None:
        self._reserve = reserve_host
        self._buffers: list[_Buffer | None] = [None] * STAGING_BUFFERS
        self._turn = 0
        self._last: _Buffer | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of nbytes in registered memory, free to be written (raises
        memory.LimitExceeded where the lease's host allowance cannot hold a buffer that big)."""
        index = self._turn
        self._turn = (index + 1) % STAGING_BUFFERS
        buffer = self._buffers[index]
        if buffer is not None and buffer.event is not None:
            buffer.event.synchronize()  # its last copy out (issued a put ago) is done
            buffer.event = None
        if buffer is None or buffer.view.numel() < nbytes:
            if buffer is not None:
                self._free(buffer)
                self._buffers[index] = None
            buffer = self._buffers[index] = self._allocate(nbytes)
        self._last = buffer
        return buffer.view[:nbytes]

    def copied(self) -> None:
        """The copy out of the buffer last taken is queued on the current stream."""
        if self._last is not None:
            self._last.event = torch.cuda.Event()
            self._last.event.record()
            self._last = None

    def close(self) -> None:
        """Give every buffer back (the client left): waits for copies still reading them."""
        for i, buffer in enumerate(self._buffers):
            if buffer is not None:
                self._free(buffer)
                self._buffers[i] = None
        self._last = None

    def _allocate(self, nbytes: int) -> _Buffer:
        reservation = self._reserve(nbytes, "a put's page-locked staging buffer")
        try:
            block = mmap.mmap(-1, nbytes)
            view = torch.frombuffer(block, dtype=torch.uint8, count=nbytes)
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(view.data_ptr(), nbytes, 0))
        except BaseException:
            reservation.release()
            raise
        return _Buffer(block, view, reservation)

    @staticmethod
    def _free(buffer: _Buffer) -> None:
        if buffer.event is not None:
            buffer.event.synchronize()
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(buffer.view.data_ptr())
        del buffer.view
        with contextlib.suppress(BufferError):
            buffer.block.close()
        buffer.reservation.release()


def granule_pieces(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """[offset, offset + nbytes) cut at the registration granules' boundaries, as (start,
    length) pairs relative to offset. CUDA takes a copy out of registered host memory only
    within one registration (a range across two fails with cudaErrorInvalidValue, pageable
    copies included), so a put that spans granules is copied piece by piece."""
    pieces = []
    at = offset
    end = offset + nbytes
    while at < end:
        cut = min(end, (at // REGISTER_GRANULE_BYTES + 1) * REGISTER_GRANULE_BYTES)
        pieces.append((at - offset, cut - at))
        at = cut
    return pieces


class RegisteredRegion:
    """A client's shared pinned region (its pinned tensors' own memory) as this CUDA worker
    registers it with CUDA: copies out of it are DMA on the stream, as from local pinned
    memory. Each granule is charged to the lease's host allowance while registered; where the
    allowance or CUDA refuses, copies out of that memory are pageable (synchronous), never
    refused."""

    def __init__(self, region: SharedArena, reserve_host: Callable[[int, str], Reservation]):
        self.region = region
        self._reserve = reserve_host
        self._base = int(torch.frombuffer(region.map, dtype=torch.uint8, count=1).data_ptr())
        self._granules: dict[int, Reservation] = {}
        self._refused = False

    def touches(self, offset: int, nbytes: int) -> bool:
        """Whether any granule of [offset, offset + nbytes) is registered: then a copy out of
        the range must keep within one granule at a time (`granule_pieces`)."""
        if not self._granules or nbytes <= 0:
            return False
        first = offset // REGISTER_GRANULE_BYTES
        last = (offset + nbytes - 1) // REGISTER_GRANULE_BYTES
        return any(g in self._granules for g in range(first, last + 1))

    def ready(self, offset: int, nbytes: int) -> bool:
        """Whether [offset, offset + nbytes) is registered, registering what is not yet."""
        if self._refused or nbytes <= 0:
            return False
        first = offset // REGISTER_GRANULE_BYTES
        last = (offset + nbytes - 1) // REGISTER_GRANULE_BYTES
        for granule in range(first, last + 1):
            if granule not in self._granules and not self._register(granule):
                return False
        return True

    def _register(self, granule: int) -> bool:
        start = granule * REGISTER_GRANULE_BYTES
        length = min(REGISTER_GRANULE_BYTES, self.region.size - start)
        try:
            reservation = self._reserve(length, "the client's pinned memory, registered")
        except LimitExceeded:
            return False  # this copy is pageable; a later one may fit
        try:
            torch.cuda.check_error(
                torch.cuda.cudart().cudaHostRegister(self._base + start, length, 0)
            )
        except Exception as exc:
            reservation.release()
            log.warning("copies from the client's pinned memory are pageable: %s", exc)
            self._refused = True
            return False
        self._granules[granule] = reservation
        return True

    def close(self) -> None:
        """Unregister everything (the client left): waits for copies still reading it."""
        if self._granules:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        for granule, reservation in self._granules.items():
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(
                    self._base + granule * REGISTER_GRANULE_BYTES
                )
            reservation.release()
        self._granules.clear()
