"""A client's whole GPU state as host memory: swap-out, restore, and shipping it to a successor.

A worker's handle table may hold several tensors over one storage (a parameter and its views,
an optimizer's flat buffers), and in-place ops on one must keep showing through the others
after a restore. So the state is captured per storage, once, and every tensor as (storage,
offset, shape, stride): the same aliasing comes back on the new device, whichever it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import CHUNK_BYTES, Connection, Kind, ProtocolError
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
class HostState:
    """Everything a client left on a worker, in host memory (pinned where the device allows).

    `ops` maps the client's op ids to schema names, so the client's DEF records stay valid on
    whichever worker restores the state; `rng` is the device generator's state."""

    storages: list[torch.Tensor]
    """One flat uint8 host tensor per distinct device storage."""
    tensors: list[TensorView]
    ops: dict[int, str] = field(default_factory=dict)
    rng: bytes | None = None
    error: dict[str, Any] | None = None
    took_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.storages)

    def meta(self) -> dict[str, Any]:
        return {
            "storages": [int(s.numel()) for s in self.storages],
            "tensors": [t.to_wire() for t in self.tensors],
            "ops": [[op_id, name] for op_id, name in self.ops.items()],
            "rng": self.rng,
            "error": self.error,
        }


def _flat_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The storage as a 1-D uint8 tensor over the same memory (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    flat.set_(storage)
    return flat


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinnable memory left: pageable copies still work, slower
            pass
    return torch.empty(nbytes, dtype=torch.uint8)


def capture(tensors: dict[int, torch.Tensor], device: torch.device) -> HostState:
    """Copy every storage the handles use to host memory; the caller then drops the device
    tensors. Copies are queued on the current stream and waited for once, at the end."""
    started = time.perf_counter()
    pin = device.type == "cuda"
    index: dict[int, int] = {}
    storages: list[torch.Tensor] = []
    views: list[TensorView] = []
    for handle, tensor in tensors.items():
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -1 - handle
        number = index.get(key)
        if number is None:
            number = index[key] = len(storages)
            host = _host_buffer(storage.nbytes(), pin)
            if storage.nbytes():
                host.copy_(_flat_bytes(storage, tensor.device), non_blocking=pin)
            storages.append(host)
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
    if pin:
        torch.cuda.current_stream(device).synchronize()
    return HostState(storages, views, took_s=time.perf_counter() - started)


def restore(state: HostState, device: torch.device) -> dict[int, torch.Tensor]:
    """The handle table on `device`, with the captured aliasing; waits until the bytes are in."""
    on_device: list[torch.Tensor] = []
    for host in state.storages:
        flat = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        flat.copy_(host, non_blocking=host.is_pinned())
        on_device.append(flat)
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


# ---- shipping a state to a successor worker -------------------------------------------------


def send_state(conn: Connection, state: HostState) -> None:
    """[STATE, meta], then each storage as PUT frames [PUT, storage, offset] with the bytes."""
    conn.send([Kind.STATE, state.meta()])
    for number, host in enumerate(state.storages):
        data = _bytes_of(host)
        for offset in range(0, len(data), CHUNK_BYTES):
            conn.send([Kind.PUT, number, offset], data[offset : offset + CHUNK_BYTES])


def receive_state(conn: Connection, pin: bool) -> HostState:
    """The other end of send_state: a state in (pinned) host memory, checked as it arrives."""
    head = conn.recv().head()
    if head[0] != Kind.STATE or len(head) != 2 or not isinstance(head[1], dict):
        raise ProtocolError(f"expected a STATE frame, got kind {head[0]}")
    meta = head[1]
    sizes = meta.get("storages")
    if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise ProtocolError("STATE without valid storage sizes")
    storages = [_host_buffer(n, pin) for n in sizes]
    for number, host in enumerate(storages):
        view = _bytes_of(host)
        for offset in _chunks(len(view)):
            frame = conn.recv()
            part = frame.head()
            if part[0] != Kind.PUT or part[1:] != [number, offset]:
                raise ProtocolError(f"expected storage {number} at byte {offset}, got {part!r}")
            if offset + frame.tail_len > len(view) or frame.tail_len == 0:
                raise ProtocolError("state bytes do not fit their storage")
            conn.read_tail_into(view[offset : offset + frame.tail_len])
    ops = {int(op_id): str(name) for op_id, name in meta.get("ops", [])}
    tensors = [TensorView.from_wire(item) for item in meta.get("tensors", [])]
    rng = meta.get("rng")
    error = meta.get("error")
    return HostState(
        storages,
        tensors,
        ops=ops,
        rng=bytes(rng) if isinstance(rng, bytes | bytearray) else None,
        error=error if isinstance(error, dict) else None,
    )


def _bytes_of(host: torch.Tensor) -> memoryview:
    """A flat uint8 host tensor's memory, writable, without a copy."""
    if not host.numel():
        return memoryview(bytearray())
    return memoryview(host.numpy()).cast("B")  # type: ignore[arg-type]


def _chunks(total: int) -> Iterator[int]:
    return iter(range(0, total, CHUNK_BYTES))
