"""The lease's memory limit on the worker: device memory, host memory, and charges taken before
anything is allocated."""

from __future__ import annotations

import os
import re
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from gpupool.protocol.v1.simgpu import SimulatedGpuMemory
    from gpupool.worker.room import Room

MiB = 1 << 20
LEDGER_SLACK_BYTES = 16 * MiB
"""A simulated GPU's ledger learns of frees in steps of this much (not at every freed tensor)."""
PROCESS_CAP_MARGIN_BYTES = 512 * MiB
"""What a CPU worker's process may hold past its baseline and its lease's limit: the stream's
frames (64 MiB each, decoded), torch's thread pools and the transient peak of the op that is
refused; `ProcessCap` adds a stack for each of torch's threads."""
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ([KMGT]i?B)")
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_HOST_ALLOC_FAILED = "DefaultCPUAllocator: can't allocate memory"


class LimitExceeded(Exception):
    """An allocation would take the lease past its memory limit."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an op's error is the lease running out of memory: its own limit, the device's
    allocator, or the host allocator refused by the worker's process cap (`ProcessCap`)."""
    if isinstance(exc, LimitExceeded | torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and _HOST_ALLOC_FAILED in str(exc)


class _Ledger(Protocol):
    def unreserve(self, nbytes: int) -> None: ...


class Reservation:
    """Bytes charged to a ledger ahead of an allocation (a buffer, an op's outputs): released
    once the memory is freed or counted as a stored tensor. Releasing twice is harmless."""

    __slots__ = ("_ledger", "nbytes")

    def __init__(self, ledger: _Ledger | None, nbytes: int) -> None:
        self._ledger = ledger
        self.nbytes = nbytes

    def release(self) -> None:
        ledger, self._ledger = self._ledger, None
        if ledger is not None and self.nbytes:
            ledger.unreserve(self.nbytes)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


NO_RESERVATION = Reservation(None, 0)


class MemoryLimit(Protocol):
    limit_bytes: int | None
    counts_storages: bool
    """charge() and release() must hear of every stored and dropped tensor (else they only
    count host tensors, which the compiled record loop hands to Python: see `_runloop.c`), and
    an op's outputs are charged before it runs (`gpupool.worker.admission`)."""
    room: Room | None
    """Where an allocation waits for other sessions' memory (None: it fails at once); it also
    says why the last wait failed, for the OutOfMemoryError."""

    @property
    def host_limit_bytes(self) -> int | None:
        """The lease's host-memory allowance: host tensors and every host buffer the worker
        allocates for the lease (staging, reads, transfers, swap)."""

    def bounded(self) -> bool:
        """Whether anything holds this memory (a limit, a simulated GPU's room): without, an
        op's charge ahead of it has nothing to refuse, and is skipped."""

    def held_bytes(self) -> int: ...

    def host_held_bytes(self) -> int: ...

    def peak_bytes(self) -> int: ...

    def reset_peak(self) -> None:
        """The peak starts again from what is held now (torch.cuda.reset_peak_memory_stats)."""

    def charge(self, tensors: list[torch.Tensor]) -> None:
        """Account freshly stored tensors; raise LimitExceeded (after undoing) past the limit."""

    def recount(self, tensors: list[torch.Tensor]) -> None:
        """Tensors an op wrote in place (resize_, set_, out=): their storages may have grown or
        be others now. Raise LimitExceeded if the lease is now past its limit."""

    def reserve(self, nbytes: int) -> Reservation:
        """Charge an op's outputs before it runs (what `counts_storages` limits need); raise
        LimitExceeded, with nothing allocated, if they cannot fit."""

    def reserve_host(self, nbytes: int, what: str) -> Reservation:
        """Charge a host buffer before it is allocated; raise LimitExceeded if it cannot fit."""

    def hold_outside(self, nbytes: int, what: str) -> Reservation:
        """Memory a library allocates behind the counted allocator (a process group's
        communication buffers: NCCL's on the device, gloo's on the host), held to the lease's
        limit for as long as the reservation lasts; raise LimitExceeded if it cannot fit."""

    def release(self, tensor: torch.Tensor) -> None: ...

    def reset(self) -> None: ...

    def set_limit(self, limit_bytes: int | None) -> None:
        """A live resize: the next allocations are held to the new limit."""

    def make_room(self, exc: BaseException) -> bool:
        """An op failed with `exc`, an out-of-memory error: if the lease's own limit had room
        and the GPU did not, wait for other sessions to give way. True: run the op again."""


class ProcessCap:
    """A hard cap on a CPU worker's data segment (RLIMIT_DATA: its heap and private mappings,
    not the shared arenas): the host allocator then refuses what no count foresaw, such as the
    intermediates inside one op, with torch's "can't allocate memory" (the lease's
    out-of-memory error) instead of the host running out. Set once the worker is up and again
    at each live resize; the hard limit stays as it was, so a resize may raise the cap again."""

    def __init__(self, margin_bytes: int = PROCESS_CAP_MARGIN_BYTES) -> None:
        # torch starts its thread pools at their first parallel op, after the baseline is
        # taken, and each thread's stack is a private mapping the cap counts (8 MiB apiece:
        # a GiB on a 128-core host).
        threads = torch.get_num_threads() + torch.get_num_interop_threads()
        self.margin_bytes = margin_bytes + threads * _thread_stack_bytes()
        self.baseline_bytes = data_segment_bytes()
        """What the worker itself holds before any client: its interpreter, torch, threads."""
        self.cap_bytes: int | None = None

    def apply(self, limit_bytes: int | None) -> None:
        if limit_bytes is None and self.cap_bytes is None:
            return  # never capped: leave the process's limit as it was given
        hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        if limit_bytes is None:
            soft = hard
            self.cap_bytes = None
        else:
            soft = self.baseline_bytes + limit_bytes + self.margin_bytes
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            self.cap_bytes = soft
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _thread_stack_bytes() -> int:
    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return 8 * MiB if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


def data_segment_bytes() -> int:
    """This process's data segment (VmData), what RLIMIT_DATA holds."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmData line")


class CudaMemory:
    """The caching allocator enforces the device limit itself (a per-process fraction of the
    device), so an over-limit allocation fails inside the op with torch.cuda.OutOfMemoryError,
    before anything moves. Host memory is the lease's allowance in `host`: host tensors its ops
    make (counted when stored: the compiled loop passes them to Python) and the worker's host
    buffers for it (charged before they are allocated)."""

    counts_storages = False

    def __init__(
        self,
        device: torch.device,
        limit_bytes: int | None,
        room: Room | None = None,
        host_limit_bytes: int | None = None,
    ) -> None:
        self.device = device
        self.limit_bytes: int | None = None
        self.room = room
        self._host_follows = host_limit_bytes is None
        """Without an allowance of its own, host memory is held to the device limit."""
        self.host = HostMemory(limit_bytes if host_limit_bytes is None else host_limit_bytes)
        self.outside_bytes = 0
        """Device memory of the lease's that the caching allocator does not see (NCCL's
        buffers): the allocator's share is the limit less this."""
        self._outside_lock = threading.Lock()
        self.set_limit(limit_bytes)

    @property
    def host_limit_bytes(self) -> int | None:
        return self.host.limit_bytes

    def set_limit(self, limit_bytes: int | None) -> None:
        total = torch.cuda.get_device_properties(self.device).total_memory
        allocator = None if limit_bytes is None else max(0, limit_bytes - self.outside_bytes)
        fraction = 1.0 if allocator is None else min(1.0, allocator / total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        self.limit_bytes = limit_bytes
        if self._host_follows:
            self.host.set_limit(limit_bytes)

    def bounded(self) -> bool:
        return self.limit_bytes is not None

    def held_bytes(self) -> int:
        """The allocator's bytes and the libraries' beside it (NCCL's buffers): both are the
        lease's, and what the pool shows as held must say so (a process group's 580 MiB were
        shown as 4 MiB when only the allocator was asked)."""
        return self._allocated("current") + self.outside_bytes

    def host_held_bytes(self) -> int:
        return self.host.held_bytes()

    def peak_bytes(self) -> int:
        return self._allocated("peak") + self.outside_bytes

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

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
        self.host.charge(tensors)  # counts the host tensors among them only

    def recount(self, tensors: list[torch.Tensor]) -> None:
        self.host.recount(tensors)

    def reserve(self, nbytes: int) -> Reservation:
        return NO_RESERVATION  # the allocator refuses an over-limit output inside the op

    def reserve_host(self, nbytes: int, what: str) -> Reservation:
        return self.host.reserve_host(nbytes, what)

    def hold_outside(self, nbytes: int, what: str) -> Reservation:
        """The allocator's share shrinks by `nbytes` (its per-process fraction), so the
        allocator and the library together stay within the lease's limit."""
        if nbytes <= 0:
            return NO_RESERVATION
        with self._outside_lock:
            limit = self.limit_bytes
            if limit is not None and nbytes + self.held_bytes() > limit:
                raise LimitExceeded(
                    f"{what} ({nbytes / MiB:.1f} MiB) does not fit the lease's limit of "
                    f"{limit // MiB} MiB ({self.held_bytes() / MiB:.1f} MiB held)"
                )
            self.outside_bytes += nbytes
            self.set_limit(limit)
        return Reservation(self, nbytes)

    def unreserve(self, nbytes: int) -> None:
        """An outside hold ended (its process group was destroyed)."""
        with self._outside_lock:
            self.outside_bytes = max(0, self.outside_bytes - nbytes)
            self.set_limit(self.limit_bytes)

    def release(self, tensor: torch.Tensor) -> None:
        self.host.release(tensor)

    def reset(self) -> None:
        self.host.reset()
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
    storage: torch.UntypedStorage
    """Kept alive while counted: its key (the StorageImpl's address) cannot be another
    storage's meanwhile, and what is counted is what the ledger keeps."""


class HostMemory:
    """Host memory has no allocator to ask, so this counts the host storages the handle table
    keeps alive (views share one storage, counted once) and the buffers charged ahead of their
    allocation. A storage is known by its StorageImpl (`_cdata`), which stays the same when
    resize_ moves its bytes (the data pointer does not); each stored tensor object remembers
    the storage it was charged under, so a set_ that moves it to another storage is seen at
    its recount and at its release. On a CPU worker this is the lease's whole limit; on a CUDA
    worker, its host allowance."""

    counts_storages = True

    def __init__(
        self,
        limit_bytes: int | None,
        gpu: SimulatedGpuMemory | None = None,
        room: Room | None = None,
        cap: ProcessCap | None = None,
    ) -> None:
        self.limit_bytes = limit_bytes
        self._storages: dict[int, _Storage] = {}
        self._charged: dict[int, tuple[int, int, torch.Tensor]] = {}
        """id(tensor) → (the storage key it was charged under, how many handles hold it, the
        tensor: kept, so that its id is no other tensor's until it is released)."""
        self._held = 0
        """Bytes of the counted storages."""
        self._reserved = 0
        """Bytes charged ahead of their allocation (open reservations): a reset keeps them,
        their owners release them."""
        self._peak = 0
        self._lock = threading.Lock()
        """Reservations come from peer threads (transfers) too."""
        self.gpu = gpu
        """The simulated GPU's physical memory this worker shares with the GPU's others."""
        self.room = room
        self.cap = cap
        self._key = str(os.getpid())
        self._recorded = 0
        """What the simulated GPU's ledger says this worker holds."""
        if cap is not None:
            cap.apply(limit_bytes)

    @property
    def host_limit_bytes(self) -> int | None:
        return self.limit_bytes

    def bounded(self) -> bool:
        return self.limit_bytes is not None or self.gpu is not None

    def held_bytes(self) -> int:
        return self._held + self._reserved

    def host_held_bytes(self) -> int:
        return self._held + self._reserved

    def set_limit(self, limit_bytes: int | None) -> None:
        # What is held already stays (as with CUDA); the next outputs are charged against it.
        self.limit_bytes = limit_bytes
        if self.cap is not None:
            self.cap.apply(limit_bytes)

    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._held + self._reserved

    # ---- stored tensors ----------------------------------------------------------------------

    def charge(self, tensors: list[torch.Tensor]) -> None:
        added: list[torch.Tensor] = []
        with self._lock:
            for tensor in tensors:
                if self._add(tensor):
                    added.append(tensor)
        if added:
            self._admit(lambda: self._undo(added))

    def _undo(self, added: list[torch.Tensor]) -> None:
        for tensor in added:
            self.release(tensor)

    def _admit(self, undo: Callable[[], None]) -> None:
        """After the count grew: past the lease's limit or the simulated GPU's room, undo and
        refuse."""
        wanted = self._held + self._reserved
        if self.limit_bytes is not None and wanted > self.limit_bytes:
            undo()
            raise LimitExceeded(
                f"would hold {wanted / MiB:.1f} MiB, "
                f"over the limit of {self.limit_bytes / MiB:.0f} MiB"
            )
        if self.gpu is not None and wanted > self._recorded and not self._claim():
            undo()
            held, total = self.gpu.usage()
            why = (self.room.take_refusal() if self.room is not None else None) or (
                "no other session could give way"
            )
            raise LimitExceeded(
                f"would hold {wanted / MiB:.1f} MiB, within the lease's limit, but the "
                f"(simulated) GPU has {max(0, total - held) / MiB:.1f} of {total / MiB:.0f} MiB "
                f"free and {why}"
            )
        self._peak = max(self._peak, wanted)

    def _add(self, tensor: torch.Tensor) -> bool:
        """Count one more handle on `tensor` (lock held). False: nothing to count."""
        if not tensor.is_cpu:
            return False
        storage = _storage_of(tensor)
        key = storage._cdata
        charged = self._charged.get(id(tensor))
        if charged is not None and charged[0] == key:
            self._charged[id(tensor)] = (key, charged[1] + 1, tensor)
            self._storage_ref(key, storage)
            return True
        if charged is not None:  # moved to another storage since (set_): count it there
            self._move(tensor, charged, key, storage)
            charged = self._charged[id(tensor)]
            self._charged[id(tensor)] = (key, charged[1] + 1, tensor)
            self._storage_ref(key, storage)
            return True
        self._charged[id(tensor)] = (key, 1, tensor)
        self._storage_ref(key, storage)
        return True

    def _storage_ref(self, key: int, storage: torch.UntypedStorage) -> None:
        entry = self._storages.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            self._storages[key] = _Storage(nbytes, 1, storage)
            self._held += nbytes
        else:
            entry.refs += 1

    def _storage_unref(self, key: int, count: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry.refs -= count
        if entry.refs <= 0:
            del self._storages[key]
            self._held -= entry.nbytes

    def _move(
        self,
        tensor: torch.Tensor,
        charged: tuple[int, int, torch.Tensor],
        key: int,
        storage: torch.UntypedStorage,
    ) -> None:
        """`tensor` was charged under another storage: its handles now hold `key`'s."""
        old, count, _ = charged
        self._storage_unref(old, count)
        entry = self._storages.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            self._storages[key] = _Storage(nbytes, count, storage)
            self._held += nbytes
        else:
            entry.refs += count
        self._charged[id(tensor)] = (key, count, tensor)

    def recount(self, tensors: list[torch.Tensor]) -> None:
        grew = False
        with self._lock:
            for tensor in tensors:
                charged = self._charged.get(id(tensor))
                if charged is None or not tensor.is_cpu:
                    continue
                storage = _storage_of(tensor)
                key, nbytes = storage._cdata, storage.nbytes()
                before = self._held
                if charged[0] != key:
                    self._move(tensor, charged, key, storage)
                entry = self._storages[key]
                if nbytes > entry.nbytes:  # resize_ grew it; storages never shrink
                    self._held += nbytes - entry.nbytes
                    entry.nbytes = nbytes
                grew = grew or self._held > before
        if grew:
            # The op has run: its memory is there, and counted; the stream fails with the
            # lease's out-of-memory error if it is past the limit (the op's pre-charge, from
            # its meta kernel, should have refused it before).
            self._admit(lambda: None)
        elif self.gpu is not None and self._recorded - self.held_bytes() >= LEDGER_SLACK_BYTES:
            self._sync()

    def release(self, tensor: torch.Tensor) -> None:
        with self._lock:
            charged = self._charged.get(id(tensor))
            if charged is None:
                return
            key, count, _ = charged
            if count > 1:
                self._charged[id(tensor)] = (key, count - 1, tensor)
            else:
                del self._charged[id(tensor)]
            self._storage_unref(key, 1)
        if self._recorded - self.held_bytes() >= LEDGER_SLACK_BYTES:
            self._sync()

    # ---- reservations ------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> Reservation:
        return self._reserve(nbytes, "the op's outputs")

    def reserve_host(self, nbytes: int, what: str) -> Reservation:
        return self._reserve(nbytes, what)

    def hold_outside(self, nbytes: int, what: str) -> Reservation:
        return self._reserve(nbytes, what)

    def _reserve(self, nbytes: int, what: str) -> Reservation:
        if nbytes <= 0:
            return NO_RESERVATION
        with self._lock:
            self._reserved += nbytes
        try:
            self._admit(lambda: self.unreserve(nbytes))
        except LimitExceeded as exc:
            raise LimitExceeded(f"{what} ({nbytes / MiB:.1f} MiB) {exc}") from None
        return Reservation(self, nbytes)

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes
        if self._recorded - self.held_bytes() >= LEDGER_SLACK_BYTES:
            self._sync()

    # ---- the simulated GPU -------------------------------------------------------------------

    def _claim(self) -> bool:
        """Record the new holding in the simulated GPU's ledger, waiting for room if it lacks."""
        assert self.gpu is not None
        gpu, key = self.gpu, self._key

        def missing() -> int:
            return gpu.claim(key, self.held_bytes())

        if missing() <= 0 or (self.room is not None and self.room.wait(missing)):
            self._recorded = self.held_bytes()
            return True
        return False

    def _sync(self) -> None:
        if self.gpu is not None:
            held = self.held_bytes()
            self.gpu.record(self._key, held)
            self._recorded = held

    def make_room(self, exc: BaseException) -> bool:
        return False  # charge() waits for the room itself, before it refuses

    def reset(self) -> None:
        with self._lock:
            self._storages.clear()
            self._charged.clear()
            self._held = 0
            self._peak = self._reserved
        if self._recorded:
            self._sync()


def memory_limit_for(
    device: torch.device,
    limit_mib: int | None,
    room: Room | None = None,
    simulated_gpu: SimulatedGpuMemory | None = None,
    host_limit_mib: int | None = None,
    process_cap: bool = False,
) -> MemoryLimit:
    """The limit of a worker's lease; with `room`, an allocation the GPU (on the CPU: the
    simulated GPU) lacks memory for waits for other sessions to give way before it fails.
    `host_limit_mib` is a CUDA worker's host allowance (default: its device limit);
    `process_cap` caps a CPU worker's whole process at its limit plus a margin (`ProcessCap`)."""
    limit_bytes = None if limit_mib is None else limit_mib * MiB
    if device.type == "cuda":
        host = None if host_limit_mib is None else host_limit_mib * MiB
        return CudaMemory(device, limit_bytes, room, host)
    cap = ProcessCap() if process_cap else None
    return HostMemory(limit_bytes, simulated_gpu, room, cap)


def _tried_bytes(message: str) -> int | None:
    """`Tried to allocate 2.00 GiB` in torch's out-of-memory message, in bytes."""
    match = _TRIED.search(message)
    if match is None:
        return None
    unit = match.group(2) if match.group(2).endswith("iB") else match.group(2)[0] + "iB"
    return int(float(match.group(1)) * _UNITS.get(unit, 1))


class _SparseHeld:
    """What a sparse COO tensor holds, counted as one storage of its own: its indices' and
    values' bytes (a view of its values handed out as a tensor of its own counts them again:
    more, never less). Keyed by the tensor; its size is taken afresh at each count, so an
    in-place op that adds values is counted too."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._cdata = ("sparse", id(tensor))
        indices, values = tensor._indices(), tensor._values()
        self._nbytes = (
            indices.untyped_storage().nbytes() + values.untyped_storage().nbytes()
        )

    def nbytes(self) -> int:
        return self._nbytes


def _storage_of(tensor: torch.Tensor) -> Any:
    if tensor.layout == torch.sparse_coo:
        return _SparseHeld(tensor)
    return tensor.untyped_storage()
