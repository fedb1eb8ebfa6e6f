"""A client's whole GPU state as flat storages: a snapshot in place, a swap-out, a restore.

A worker's handle table may hold several tensors over one storage (a parameter and its views,
an optimizer's flat buffers), and in-place ops on one must keep showing through the others
after a restore. So the state is captured per storage, once, and every tensor as (storage,
offset, shape, stride): the same aliasing comes back on the new device, whichever it is.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import ProtocolError
from gpupool.protocol.v1.tensors import dtype_from_name, dtype_name


@dataclass(frozen=True)
class TensorView:
    """One handle of the table, over storage number `storage` of the snapshot."""

    handle: int
    storage: int
    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int

    def to_wire(self) -> list[Any]:
        return [self.handle, self.storage, self.dtype, self.shape, self.stride, self.offset]

    @classmethod
    def from_wire(cls, item: Any) -> TensorView:
        handle, storage, dtype, shape, stride, offset = item
        checked = [handle, storage, offset, *shape, *stride]
        if not all(isinstance(v, int) and v >= 0 for v in checked) or len(shape) != len(stride):
            raise ProtocolError(f"malformed tensor in a state transfer: {item!r:.200}")
        return cls(handle, storage, str(dtype), list(shape), list(stride), offset)


@dataclass
class ClientState:
    """Everything a client left on a worker, as one flat uint8 tensor per distinct storage.

    The storages are on the device (a snapshot in place: the handle table's own memory, shared
    with a successor without a copy) or in host memory (a swap-out: pinned where the device
    allows). `ops` maps the client's op ids to schema names, so the client's DEF records stay
    valid on whichever worker restores the state; `rng` is the device generator's state."""

    storages: list[torch.Tensor]
    tensors: list[TensorView]
    ops: dict[int, str] = field(default_factory=dict)
    rng: bytes | None = None
    error: dict[str, Any] | None = None
    took_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.storages)

    @property
    def on_host(self) -> bool:
        return all(s.device.type == "cpu" for s in self.storages)

    def meta(self) -> dict[str, Any]:
        return {
            "storages": [int(s.numel()) for s in self.storages],
            "tensors": [t.to_wire() for t in self.tensors],
            "ops": [[op_id, name] for op_id, name in self.ops.items()],
            "rng": self.rng,
            "error": self.error,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any], storages: list[torch.Tensor]) -> ClientState:
        """The other end of meta(), over storages the receiver filled."""
        ops = {int(op_id): str(name) for op_id, name in meta.get("ops", [])}
        tensors = [TensorView.from_wire(item) for item in meta.get("tensors", [])]
        rng = meta.get("rng")
        error = meta.get("error")
        return cls(
            storages,
            tensors,
            ops=ops,
            rng=bytes(rng) if isinstance(rng, bytes | bytearray) else None,
            error=error if isinstance(error, dict) else None,
        )


def storage_sizes(meta: dict[str, Any]) -> list[int]:
    """The byte sizes a STATE frame announces, checked before anything is allocated for them."""
    sizes = meta.get("storages")
    if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise ProtocolError("STATE without valid storage sizes")
    return sizes


def flat_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The storage as a 1-D uint8 tensor over the same memory (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    flat.set_(storage)
    return flat


STAGE_BYTES = 32 << 20
STAGE_SLOTS = 4
"""Swap copies between a GPU and host memory go through this many pinned buffers of this size.

Measured on an H200 VM (bench/gpu/host_copy_probe.py): pinning 5 GiB of fresh host memory
costs 5.5 s (1 GB/s, the kernel pins page by page) and a copy into pageable memory 4.2 s,
while a ring of four pinned buffers into pageable memory moves the same 5 GiB in 0.41 s: the
device-to-host copy of one chunk overlaps the memcpy of the one before. The ring (128 MiB) is
allocated per swap and kept by torch's pinned-memory cache, so later swaps do not pin again."""


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinnable memory left: pageable copies still work, slower
            pass
    return torch.empty(nbytes, dtype=torch.uint8)


def snapshot(tensors: dict[int, torch.Tensor]) -> ClientState:
    """The handle table as flat storages over its own memory: nothing is copied or freed, so a
    handoff that fails leaves the client's tensors exactly where they were."""
    index: dict[int, int] = {}
    storages: list[torch.Tensor] = []
    views: list[TensorView] = []
    for handle, tensor in tensors.items():
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -1 - handle
        number = index.get(key)
        if number is None:
            number = index[key] = len(storages)
            storages.append(flat_bytes(storage, tensor.device))
        views.append(
            TensorView(
                handle,
                number,
                dtype_name(tensor.dtype),
                list(tensor.shape),
                list(tensor.stride()),
                int(tensor.storage_offset()),
            )
        )
    return ClientState(storages, views)


def to_host(state: ClientState) -> ClientState:
    """The same state in host memory: from a GPU through the pinned staging ring into pageable
    memory (see STAGE_BYTES); storages already on the host are kept as they are."""
    started = time.perf_counter()
    on_device = [flat for flat in state.storages if flat.device.type != "cpu"]
    copies = iter(staged_to_host(on_device))
    hosts = [flat if flat.device.type == "cpu" else next(copies) for flat in state.storages]
    return ClientState(
        hosts, state.tensors, dict(state.ops), state.rng, state.error,
        took_s=time.perf_counter() - started,
    )  # fmt: skip


def _stage_chunks(sizes: list[int]) -> list[tuple[int, int, int]]:
    """(storage number, offset, bytes) of every staging chunk, in storage order."""
    return [
        (number, offset, min(STAGE_BYTES, size - offset))
        for number, size in enumerate(sizes)
        for offset in range(0, size, STAGE_BYTES)
    ]


class Ring:
    """Pinned chunk buffers, each with the event of the last device copy that used it: what
    swaps and handoffs stage their copies between a GPU and pageable memory or a socket in."""

    def __init__(self, slots: int, chunk_bytes: int) -> None:
        self.buffers = [host_buffer(chunk_bytes, pin=True) for _ in range(slots)]
        self.events = [torch.cuda.Event() for _ in range(slots)]
        self._views = [bytes_of(b) for b in self.buffers]

    def __len__(self) -> int:
        return len(self.buffers)

    def record(self, slot: int) -> None:
        self.events[slot].record()

    def wait(self, slot: int) -> None:
        self.events[slot].synchronize()  # an event never recorded returns at once

    def view(self, slot: int) -> memoryview:
        return self._views[slot]


def _staging_ring(chunk_count: int) -> Ring:
    return Ring(min(STAGE_SLOTS, max(chunk_count, 1)), STAGE_BYTES)


def staged_to_host(
    flats: list[torch.Tensor], into: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Copies of GPU storages (flat uint8) in pageable host memory (fresh, or `into`: flat
    uint8 host tensors of the same sizes, such as a shared-memory region), made chunk by chunk
    through the pinned ring: the GPU fills one slot while the CPU empties another."""
    if not flats:
        return []
    hosts = into if into is not None else [torch.empty(f.numel(), dtype=torch.uint8) for f in flats]
    if [h.numel() for h in hosts] != [f.numel() for f in flats]:
        raise ValueError("staging targets differ in size from their storages")
    chunks = _stage_chunks([flat.numel() for flat in flats])
    with torch.cuda.device(flats[0].device):
        ring = _staging_ring(len(chunks))
        waiting: deque[tuple[int, int, int, int]] = deque()

        def empty_oldest() -> None:
            number, offset, size, slot = waiting.popleft()
            ring.wait(slot)
            hosts[number][offset : offset + size].copy_(ring.buffers[slot][:size])

        for index, (number, offset, size) in enumerate(chunks):
            if len(waiting) == len(ring):
                empty_oldest()
            slot = index % len(ring)
            chunk = flats[number][offset : offset + size]
            ring.buffers[slot][:size].copy_(chunk, non_blocking=True)
            ring.record(slot)
            waiting.append((number, offset, size, slot))
        while waiting:
            empty_oldest()
    return hosts


def staged_to_device(hosts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copies of host storages on `device`: pageable ones chunk by chunk through the pinned
    ring (the CPU fills one slot while the GPU copies another in), pinned ones directly.
    Returns once every byte is on the device."""
    outs = [torch.empty(host.numel(), dtype=torch.uint8, device=device) for host in hosts]
    with torch.cuda.device(device):
        pageable = [number for number, host in enumerate(hosts) if not host.is_pinned()]
        for number, host in enumerate(hosts):
            if host.is_pinned() and host.numel():
                outs[number].copy_(host, non_blocking=True)
        chunks = _stage_chunks([hosts[number].numel() for number in pageable])
        ring = _staging_ring(len(chunks)) if chunks else None
        for index, (position, offset, size) in enumerate(chunks):
            assert ring is not None
            number = pageable[position]
            slot = index % len(ring)
            ring.wait(slot)  # the slot's last copy to the device is done
            ring.buffers[slot][:size].copy_(hosts[number][offset : offset + size])
            target = outs[number][offset : offset + size]
            target.copy_(ring.buffers[slot][:size], non_blocking=True)
            ring.record(slot)
        torch.cuda.current_stream().synchronize()
    return outs


def capture(tensors: dict[int, torch.Tensor], device: torch.device) -> ClientState:
    """Copy every storage the handles use to host memory; the caller then drops the device
    tensors."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return to_host(snapshot(tensors))


def restore(state: ClientState, device: torch.device) -> dict[int, torch.Tensor]:
    """The handle table on `device`, with the captured aliasing; waits until the bytes are in.
    Storages already on `device` (a successor filled them) are used as they are."""

    def here(flat: torch.Tensor) -> bool:
        return flat.device == device or (device.type == "cpu" and flat.device.type == "cpu")

    staged = device.type == "cuda"
    from_host = [flat for flat in state.storages if staged and flat.device.type == "cpu"]
    copies = iter(staged_to_device(from_host, device) if from_host else [])
    on_device = [
        flat if here(flat) else next(copies) if staged and flat.device.type == "cpu"
        else flat.to(device)  # another device of this process: a direct copy
        for flat in state.storages
    ]  # fmt: skip
    tensors: dict[int, torch.Tensor] = {}
    for view in state.tensors:
        if not 0 <= view.storage < len(on_device):
            raise ProtocolError(f"tensor {view.handle} names storage {view.storage}, not sent")
        dtype = dtype_from_name(view.dtype)
        tensor = torch.empty(0, dtype=dtype, device=device)
        tensor.set_(on_device[view.storage].untyped_storage(), view.offset, view.shape, view.stride)
        tensors[view.handle] = tensor
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return tensors


def bytes_of(host: torch.Tensor) -> memoryview:
    """A flat uint8 host tensor's memory, writable, without a copy."""
    if not host.numel():
        return memoryview(bytearray())
    return memoryview(host.numpy()).cast("B")  # type: ignore[arg-type]
