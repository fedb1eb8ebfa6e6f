"""The lease's memory limit, enforced on the worker's device."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from gpupool.protocol.v1.simgpu import SimulatedGpuMemory
    from gpupool.worker.room import Room

MiB = 1 << 20
LEDGER_SLACK_BYTES = 16 * MiB
"""A simulated GPU's ledger learns of frees in steps of this much (not at every freed tensor)."""
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ([KMGT]i?B)")
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


class LimitExceeded(Exception):
    """An allocation would take the lease past its memory limit."""


class MemoryLimit(Protocol):
    limit_bytes: int | None
    counts_storages: bool
    """charge() and release() must hear of every stored and dropped tensor (else they are
    no-ops, and the compiled record loop stores and frees without calling them)."""

    def held_bytes(self) -> int: ...

    def peak_bytes(self) -> int: ...

    def charge(self, tensors: list[torch.Tensor]) -> None:
        """Account freshly stored tensors; raise LimitExceeded (after undoing) past the limit."""

    def release(self, tensor: torch.Tensor) -> None: ...

    def reset(self) -> None: ...

    def set_limit(self, limit_bytes: int | None) -> None:
        """A live resize: the next allocations are held to the new limit."""

    def make_room(self, exc: BaseException) -> bool:
        """An op failed with `exc`, an out-of-memory error: if the lease's own limit had room
        and the GPU did not, wait for other sessions to give way. True: run the op again."""


class CudaMemory:
    """The caching allocator enforces the limit itself (a per-process fraction of the device),
    so an over-limit allocation fails inside the op with torch.cuda.OutOfMemoryError."""

    counts_storages = False

    def __init__(
        self, device: torch.device, limit_bytes: int | None, room: Room | None = None
    ) -> None:
        self.device = device
        self.limit_bytes: int | None = None
        self.room = room
        self.set_limit(limit_bytes)

    def set_limit(self, limit_bytes: int | None) -> None:
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = 1.0 if limit_bytes is None else min(1.0, limit_bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        self.limit_bytes = limit_bytes

    def held_bytes(self) -> int:
        return self._allocated("current")

    def peak_bytes(self) -> int:
        return self._allocated("peak")

    def _allocated(self, which: str) -> int:
        # The allocator's nested stats, not torch.cuda.memory_allocated: that one flattens the
        # whole dictionary into a sorted OrderedDict on every call (hundreds of microseconds).
        try:
            stats = getattr(torch._C, "_cuda_memoryStats")(self.device.index or 0)  # noqa: B009
            return int(stats["allocated_bytes"]["all"][which])
        except Exception:
            if which == "peak":
                return int(torch.cuda.max_memory_allocated(self.device))
            return int(torch.cuda.memory_allocated(self.device))

    def charge(self, tensors: list[torch.Tensor]) -> None:
        return None

    def release(self, tensor: torch.Tensor) -> None:
        return None

    def reset(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def make_room(self, exc: BaseException) -> bool:
        """The caching allocator has already freed its cache and tried again when it raises,
        so what the driver reports free is what the GPU has; the request is what the error
        says it tried to allocate (or, unsaid, the rest of the lease's grant)."""
        if self.room is None or self.limit_bytes is None:
            return False
        grant_left = self.limit_bytes - self.held_bytes()
        tried = _tried_bytes(str(exc))
        wanted = grant_left if tried is None else min(tried, grant_left)
        if wanted <= 0:
            return False  # the lease's own limit is what is full: no one else's to free
        if torch.cuda.mem_get_info(self.device)[0] >= wanted:
            return False  # the GPU had room: fragmentation, not other sessions, is at fault

        def missing() -> int:
            return wanted - int(torch.cuda.mem_get_info(self.device)[0])

        return self.room.wait(missing)


@dataclass
class _Storage:
    nbytes: int
    refs: int


class HostMemory:
    """A CPU worker has no allocator to ask, so it counts the storages its handles keep alive
    (views share one storage, counted once) and refuses outputs that go past the limit."""

    counts_storages = True

    def __init__(
        self,
        limit_bytes: int | None,
        gpu: SimulatedGpuMemory | None = None,
        room: Room | None = None,
    ) -> None:
        self.limit_bytes = limit_bytes
        self._storages: dict[int, _Storage] = {}
        self._held = 0
        self._peak = 0
        self.gpu = gpu
        """The simulated GPU's physical memory this worker shares with the GPU's others."""
        self.room = room
        self._key = str(os.getpid())
        self._recorded = 0
        """What the simulated GPU's ledger says this worker holds."""

    def held_bytes(self) -> int:
        return self._held

    def set_limit(self, limit_bytes: int | None) -> None:
        # What is held already stays (as with CUDA); the next outputs are charged against it.
        self.limit_bytes = limit_bytes

    def peak_bytes(self) -> int:
        return self._peak

    def charge(self, tensors: list[torch.Tensor]) -> None:
        added: list[torch.Tensor] = []
        for tensor in tensors:
            self._add(tensor)
            added.append(tensor)
        if self.limit_bytes is not None and self._held > self.limit_bytes:
            wanted = self._held
            for tensor in added:
                self.release(tensor)
            raise LimitExceeded(
                f"would hold {wanted / MiB:.1f} MiB, "
                f"over the limit of {self.limit_bytes / MiB:.0f} MiB"
            )
        if self.gpu is not None and self._held > self._recorded and not self._claim():
            wanted = self._held
            for tensor in added:
                self.release(tensor)
            held, total = self.gpu.usage()
            raise LimitExceeded(
                f"would hold {wanted / MiB:.1f} MiB, within the lease's limit, but the "
                f"(simulated) GPU has {max(0, total - held) / MiB:.1f} of {total / MiB:.0f} MiB "
                "free and no other session could give way"
            )
        self._peak = max(self._peak, self._held)

    def _claim(self) -> bool:
        """Record the new holding in the simulated GPU's ledger, waiting for room if it lacks."""
        assert self.gpu is not None
        gpu, key = self.gpu, self._key

        def missing() -> int:
            return gpu.claim(key, self._held)

        if missing() <= 0 or (self.room is not None and self.room.wait(missing)):
            self._recorded = self._held
            return True
        return False

    def _sync(self) -> None:
        if self.gpu is not None:
            self.gpu.record(self._key, self._held)
            self._recorded = self._held

    def make_room(self, exc: BaseException) -> bool:
        return False  # charge() waits for the room itself, before it refuses

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return
        entry = self._storages.get(key)
        if entry is None:
            self._storages[key] = _Storage(storage.nbytes(), 1)
            self._held += storage.nbytes()
        else:
            entry.refs += 1

    def release(self, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage().data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs == 0:
            del self._storages[key]
            self._held -= entry.nbytes
            if self._recorded - self._held >= LEDGER_SLACK_BYTES:
                self._sync()

    def reset(self) -> None:
        self._storages.clear()
        self._held = 0
        self._peak = 0
        if self._recorded:
            self._sync()


def memory_limit_for(
    device: torch.device,
    limit_mib: int | None,
    room: Room | None = None,
    simulated_gpu: SimulatedGpuMemory | None = None,
) -> MemoryLimit:
    """The limit of a worker's lease; with `room`, an allocation the GPU (on the CPU: the
    simulated GPU) lacks memory for waits for other sessions to give way before it fails."""
    limit_bytes = None if limit_mib is None else limit_mib * MiB
    if device.type == "cuda":
        return CudaMemory(device, limit_bytes, room)
    return HostMemory(limit_bytes, simulated_gpu, room)


def _tried_bytes(message: str) -> int | None:
    """`Tried to allocate 2.00 GiB` in torch's out-of-memory message, in bytes."""
    match = _TRIED.search(message)
    if match is None:
        return None
    unit = match.group(2) if match.group(2).endswith("iB") else match.group(2)[0] + "iB"
    return int(float(match.group(1)) * _UNITS.get(unit, 1))
