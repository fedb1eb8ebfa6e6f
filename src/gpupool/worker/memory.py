"""The lease's memory limit, enforced on the worker's device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

MiB = 1 << 20


class LimitExceeded(Exception):
    """An allocation would take the lease past its memory limit."""


class MemoryLimit(Protocol):
    limit_bytes: int | None

    def held_bytes(self) -> int: ...

    def peak_bytes(self) -> int: ...

    def charge(self, tensors: list[torch.Tensor]) -> None:
        """Account freshly stored tensors; raise LimitExceeded (after undoing) past the limit."""

    def release(self, tensor: torch.Tensor) -> None: ...

    def reset(self) -> None: ...

    def set_limit(self, limit_bytes: int | None) -> None:
        """A live resize: the next allocations are held to the new limit."""


class CudaMemory:
    """The caching allocator enforces the limit itself (a per-process fraction of the device),
    so an over-limit allocation fails inside the op with torch.cuda.OutOfMemoryError."""

    def __init__(self, device: torch.device, limit_bytes: int | None) -> None:
        self.device = device
        self.limit_bytes: int | None = None
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


@dataclass
class _Storage:
    nbytes: int
    refs: int


class HostMemory:
    """A CPU worker has no allocator to ask, so it counts the storages its handles keep alive
    (views share one storage, counted once) and refuses outputs that go past the limit."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes
        self._storages: dict[int, _Storage] = {}
        self._held = 0
        self._peak = 0

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
        self._peak = max(self._peak, self._held)

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

    def reset(self) -> None:
        self._storages.clear()
        self._held = 0
        self._peak = 0


def memory_limit_for(device: torch.device, limit_mib: int | None) -> MemoryLimit:
    limit_bytes = None if limit_mib is None else limit_mib * MiB
    if device.type == "cuda":
        return CudaMemory(device, limit_bytes)
    return HostMemory(limit_bytes)
