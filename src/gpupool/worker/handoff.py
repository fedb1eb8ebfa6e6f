"""Shipping a client's state to its successor worker: CUDA IPC or shared memory on one host,
else a pipelined stream over the connection.

The successor says what it can take (an `Offer`: its host, device, GPUs, the paths it accepts);
the predecessor tries the fastest path both can use, and when the successor answers that a path
failed on its side (an IPC handle it cannot open: another container, a GPU it cannot see) the
next one. Until the successor confirms that it holds the state, the predecessor keeps its own
copy: a handoff cut off halfway leaves the client where it was, with nothing lost.

- `cuda_ipc`: each storage's CUDA IPC handle, offset and size (bytes and ints in msgpack; no
  torch object is pickled). The successor opens them, copies device to device (a peer copy
  when the GPUs differ), waits once, and closes them; the bytes never leave the GPUs.
- `shm`: one memfd holding every storage; the successor maps it through /proc/<pid>/fd/<n>
  (same host, same user) and copies it in. What CPU workers use on one host.
- `stream`: STATE, then PUT frames of CHUNK_BYTES. Device-to-host copies, the socket and
  host-to-device copies overlap through a ring of pinned buffers on each side.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import (
    CHUNK_BYTES,
    Connection,
    DataPlaneError,
    Kind,
    ProtocolError,
)
from gpupool.worker.memory import NO_RESERVATION, Reservation
from gpupool.worker.swap import (
    ClientState,
    Ring,
    bytes_of,
    flat_bytes,
    staged_to_device,
    staged_to_host,
    storage_sizes,
)

log = logging.getLogger("gpupool.worker.handoff")

PATHS = ("cuda_ipc", "shm", "stream")
"""Fastest first."""
RING_SLOTS = 4
"""Pinned chunk buffers per side of a stream: one on the wire, the others being copied."""
_ALIGN = 64


class HandoffFailed(DataPlaneError):
    """No path moved the state: the predecessor keeps it and the client stays there."""


# ---- who is where -------------------------------------------------------------------------


def host_key() -> str:
    """Equal for two processes that can share memory: the same kernel boot and the same pid
    and IPC namespaces (two containers on one server are not one host for /proc/<pid>/fd)."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    for ns in ("pid", "ipc"):
        with contextlib.suppress(OSError):
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
    return "/".join(parts)


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpus() -> list[str]:
    """The GPUs this process can open IPC handles of (CUDA_VISIBLE_DEVICES narrows them)."""
    if not torch.cuda.is_available():
        return []
    return [gpu_uuid(i) for i in range(torch.cuda.device_count())]


@dataclass(frozen=True)
class Offer:
    """What a successor can take, sent with its `adopt` request."""

    address: str
    host: str = ""
    device_type: str = "cpu"
    gpus: tuple[str, ...] = ()
    paths: tuple[str, ...] = ("stream",)

    def to_wire(self) -> dict[str, Any]:
        return {
            "op": "adopt",
            "address": self.address,
            "host": self.host,
            "device": self.device_type,
            "gpus": list(self.gpus),
            "paths": list(self.paths),
        }

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Offer:
        address = body.get("address")
        if body.get("op") != "adopt" or not isinstance(address, str):
            raise ProtocolError("a successor must say where it listens")
        gpus = body.get("gpus", [])
        paths = body.get("paths", ["stream"])  # a successor that names none takes the stream
        host, device = body.get("host", ""), body.get("device", "cpu")
        if not isinstance(host, str) or device not in ("cpu", "cuda"):
            raise ProtocolError("an adopt request names its host and device type")
        if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
            raise ProtocolError("gpus must be a list of GPU UUIDs")
        if not isinstance(paths, list) or not set(paths) <= set(PATHS):
            raise ProtocolError(f"paths must be some of {', '.join(PATHS)}")
        return cls(address, host, device, tuple(gpus), tuple(paths))


def paths_for(state: ClientState, offer: Offer, device: torch.device) -> list[str]:
    """The paths to try for this state and this successor, fastest first."""
    same_host = bool(offer.host) and offer.host == host_key()
    paths = []
    if (
        same_host
        and "cuda_ipc" in offer.paths
        and offer.device_type == "cuda"
        and device.type == "cuda"
        and not state.on_host
        and gpu_uuid(device.index or 0) in offer.gpus
    ):
        paths.append("cuda_ipc")
    shm = same_host and "shm" in offer.paths
    # From host memory (CPU workers, a swapped state) shared memory is one copy on each side;
    # from a GPU the stream overlaps its copies and was faster on an H200 (5 GiB GPU 0 -> GPU 1:
    # 3.3 GB/s against 2.3 GB/s through the memfd), so it goes first there.
    if shm and state.on_host:
        paths.append("shm")
    if "stream" in offer.paths:
        paths.append("stream")
    if shm and not state.on_host:
        paths.append("shm")
    return paths


# ---- the predecessor's side ----------------------------------------------------------------


def send(conn: Connection, state: ClientState, offer: Offer, device: torch.device) -> str:
    """Ship `state` and return the path that worked, once the successor holds the state.

    A path that fails here (an export the driver refuses) or there (the successor's answer)
    falls through to the next; a connection that breaks raises, and nothing here changed."""
    reasons: list[str] = []
    for path in paths_for(state, offer, device):
        with contextlib.ExitStack() as stack:
            try:
                extra = stack.enter_context(_EXPORTS[path](state, device))
            except Exception as exc:  # whatever the driver or torch refuses: try the next path
                reasons.append(f"{path}: {type(exc).__name__}: {exc}")
                log.warning("handoff path %s unusable here: %s", path, exc)
                continue
            conn.send([Kind.STATE, state.meta() | {"path": path} | extra])
            if path == "stream":
                _send_chunks(conn, state)
            answer = _answer(conn)
        if answer.get("ok"):
            return path
        reasons.append(f"{path}: {answer.get('why')}")
        log.warning("the successor could not take the state by %s: %s", path, answer.get("why"))
    raise HandoffFailed("no way to hand the state over: " + ("; ".join(reasons) or "no path"))


def _answer(conn: Connection) -> dict[str, Any]:
    head = conn.recv().head()
    if head[0] != Kind.RESULT or len(head) != 3 or head[1] != 1 or not isinstance(head[2], dict):
        raise ProtocolError(f"the successor answered {head!r:.200}")
    return head[2]


@contextlib.contextmanager
def _ipc_export(state: ClientState, device: torch.device) -> Iterator[dict[str, Any]]:
    """Each storage's IPC handle: the allocation it lives in, and where in it."""
    uuid = gpu_uuid(device.index or 0)
    items: list[list[Any] | None] = []
    for flat in state.storages:
        if not flat.numel():
            items.append(None)
            continue
        _dev, handle, size, offset, ref, ref_offset, event, event_sync = (
            flat.untyped_storage()._share_cuda_()
        )
        items.append([uuid, handle, size, offset, ref, ref_offset, event, bool(event_sync)])
    yield {"ipc": items}


@contextlib.contextmanager
def _shm_export(state: ClientState, device: torch.device) -> Iterator[dict[str, Any]]:
    """Every storage copied into one memfd, open until the successor has copied it out."""
    offsets, total = [], 0
    for flat in state.storages:
        offsets.append(total)
        total += -(-flat.numel() // _ALIGN) * _ALIGN
    fd = os.memfd_create("gpupool-handoff", os.MFD_CLOEXEC)
    region: mmap.mmap | None = None
    try:
        os.ftruncate(fd, max(total, 1))
        region = mmap.mmap(fd, max(total, 1))
        views = [
            torch.frombuffer(region, dtype=torch.uint8, count=flat.numel(), offset=offset)
            if flat.numel()
            else torch.empty(0, dtype=torch.uint8)
            for flat, offset in zip(state.storages, offsets, strict=True)
        ]
        # From a GPU through the pinned staging ring (a direct copy into pageable memory runs
        # at about 1 GB/s, the ring at 13 GB/s on an H200); host storages copy directly.
        on_gpu = [i for i, flat in enumerate(state.storages) if flat.device.type == "cuda"]
        staged_to_host([state.storages[i] for i in on_gpu], into=[views[i] for i in on_gpu])
        for i, flat in enumerate(state.storages):
            if flat.device.type != "cuda" and flat.numel():
                views[i].copy_(flat)
        del views  # the region closes below only once no tensor points into it
        yield {"shm": {"pid": os.getpid(), "fd": fd, "size": total, "offsets": offsets}}
    finally:
        if region is not None:
            with contextlib.suppress(BufferError):
                region.close()
        os.close(fd)


@contextlib.contextmanager
def _stream_export(state: ClientState, device: torch.device) -> Iterator[dict[str, Any]]:
    yield {}


_EXPORTS: dict[
    str, Callable[[ClientState, torch.device], contextlib.AbstractContextManager[dict[str, Any]]]
] = {
    "cuda_ipc": _ipc_export,
    "shm": _shm_export,
    "stream": _stream_export,
}


def _chunks_of(state: ClientState) -> list[tuple[int, int, int]]:
    return [
        (number, offset, min(CHUNK_BYTES, flat.numel() - offset))
        for number, flat in enumerate(state.storages)
        for offset in range(0, flat.numel(), CHUNK_BYTES)
    ]


def _send_chunks(conn: Connection, state: ClientState) -> None:
    """PUT frames in storage order; from a GPU, each chunk is staged through the pinned ring
    while the chunks before it are on the wire."""
    chunks = _chunks_of(state)
    if state.on_host:
        for number, offset, size in chunks:
            conn.send(
                [Kind.PUT, number, offset], bytes_of(state.storages[number])[offset : offset + size]
            )
        return
    ring = Ring(RING_SLOTS, CHUNK_BYTES)

    def stage(i: int) -> None:
        number, offset, size = chunks[i]
        slot = i % RING_SLOTS
        ring.buffers[slot][:size].copy_(
            state.storages[number][offset : offset + size], non_blocking=True
        )
        ring.record(slot)

    for i in range(min(RING_SLOTS, len(chunks))):
        stage(i)
    for i, (number, offset, size) in enumerate(chunks):
        slot = i % RING_SLOTS
        ring.wait(slot)
        conn.send([Kind.PUT, number, offset], ring.view(slot)[:size])
        if i + RING_SLOTS < len(chunks):
            stage(i + RING_SLOTS)


# ---- the successor's side ------------------------------------------------------------------


def receive(
    conn: Connection,
    device: torch.device,
    install: Callable[[ClientState], None],
    ring: Ring | None,
    reserve: Callable[[int], Reservation] | None = None,
) -> ClientState:
    """Take STATE frames until one path delivers; `install` puts the state in the handle table.
    A same-host path that fails here is reported back (the predecessor tries the next one); a
    stream that breaks raises, as the connection is then of no more use. `reserve` charges the
    announced storages to the lease before they are allocated: a state that cannot fit raises
    LimitExceeded, by any path, with nothing allocated."""
    while True:
        head = conn.recv().head()
        if head[0] != Kind.STATE or len(head) != 2 or not isinstance(head[1], dict):
            raise ProtocolError(f"expected a STATE frame, got kind {head[0]}")
        meta = head[1]
        sizes = storage_sizes(meta)
        path = meta.get("path", "stream")
        charge = NO_RESERVATION if reserve is None else reserve(sum(sizes))
        if path == "stream":
            with charge:
                storages = _receive_chunks(conn, sizes, device, ring)
            state = ClientState.from_meta(meta, storages)
            install(state)  # counts the storages as the handle table's
        else:
            try:
                with charge:
                    if path == "cuda_ipc":
                        storages = _ipc_open(meta.get("ipc"), sizes, device)
                    elif path == "shm":
                        storages = _shm_open(meta.get("shm"), sizes, device)
                    else:
                        raise ProtocolError(f"unknown handoff path {path!r}")
                state = ClientState.from_meta(meta, storages)
                install(state)
            except Exception as exc:  # any failure of a same-host path: the next one may work
                why = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "could not take the state by %s (%s); asking for the next way", path, why
                )
                conn.send([Kind.RESULT, 1, {"ok": False, "why": why[:500]}])
                continue
        log.info("state received by %s: %.1f MiB", path, state.nbytes / (1 << 20))
        conn.send([Kind.RESULT, 1, {"ok": True, "bytes": state.nbytes, "path": path}])
        return state


def _ipc_open(items: Any, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    """Open every handle, queue the device-to-device copies, wait once, close the handles."""
    if not isinstance(items, list) or len(items) != len(sizes):
        raise ProtocolError("cuda_ipc STATE without one handle per storage")
    local = {uuid: index for index, uuid in enumerate(visible_gpus())}
    copies: list[torch.Tensor] = []
    opened: list[torch.Tensor] = []
    for size, item in zip(sizes, items, strict=True):
        if item is None or size == 0:
            copies.append(torch.empty(0, dtype=torch.uint8, device=device))
            continue
        if not isinstance(item, list) or len(item) != 8 or item[2] != size:
            raise ProtocolError(f"malformed IPC handle in a state transfer: {item!r:.200}")
        uuid, handle, nbytes, offset, ref, ref_offset, event, event_sync = item
        source = local.get(uuid)
        if source is None:
            raise RuntimeError(f"GPU {uuid} is not visible to this worker")
        storage = torch.UntypedStorage._new_shared_cuda(
            source, handle, nbytes, offset, ref, ref_offset, event, event_sync
        )
        src = flat_bytes(storage, torch.device("cuda", source))
        dst = torch.empty(size, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)
        opened.append(src)
        copies.append(dst)
    for index in {t.device.index for t in opened} | {device.index}:
        torch.cuda.synchronize(index)
    opened.clear()  # the predecessor may free its copy once these are gone
    return copies


def _shm_open(info: Any, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    if not isinstance(info, dict) or not isinstance(info.get("offsets"), list):
        raise ProtocolError("shm STATE without its region")
    pid, fd, offsets = info.get("pid"), info.get("fd"), info["offsets"]
    if not isinstance(pid, int) or not isinstance(fd, int) or len(offsets) != len(sizes):
        raise ProtocolError("shm STATE without pid, fd and one offset per storage")
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    try:
        length = os.fstat(own).st_size
        region = mmap.mmap(own, length, access=mmap.ACCESS_COPY)
    finally:
        os.close(own)
    try:
        views = []
        for size, offset in zip(sizes, offsets, strict=True):
            if not isinstance(offset, int) or offset < 0 or offset + size > length:
                raise ProtocolError(f"storage of {size} bytes at {offset} outside the region")
            views.append(
                torch.frombuffer(region, dtype=torch.uint8, count=size, offset=offset)
                if size
                else torch.empty(0, dtype=torch.uint8)
            )
        if device.type == "cuda":  # pageable shared memory: through the pinned staging ring
            copies = staged_to_device(views, device)
        else:
            copies = [view.clone() for view in views]
        del views  # the region closes below only once no tensor points into it
        return copies
    finally:
        with contextlib.suppress(BufferError):
            region.close()


def _receive_chunks(
    conn: Connection, sizes: list[int], device: torch.device, ring: Ring | None
) -> list[torch.Tensor]:
    """PUT frames into freshly allocated storages; to a GPU through the pinned ring, each
    chunk's host-to-device copy running while the next one is read from the socket."""
    storages = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    staged = device.type == "cuda" and ring is not None
    i = 0
    for number, flat in enumerate(storages):
        direct = None if staged else bytes_of(flat)
        for offset in range(0, flat.numel(), CHUNK_BYTES):
            frame = conn.recv()
            part = frame.head()
            if part[0] != Kind.PUT or part[1:] != [number, offset]:
                raise ProtocolError(
                    f"expected storage {number} at byte {offset}, got {part!r:.200}"
                )
            size = frame.tail_len
            if size != min(CHUNK_BYTES, flat.numel() - offset):
                raise ProtocolError(f"a chunk of {size} bytes at {offset} of storage {number}")
            if direct is not None:
                conn.read_tail_into(direct[offset : offset + size])
                continue
            assert ring is not None
            slot = i % RING_SLOTS
            ring.wait(slot)
            conn.read_tail_into(ring.view(slot)[:size])
            flat[offset : offset + size].copy_(ring.buffers[slot][:size], non_blocking=True)
            ring.record(slot)
            i += 1
    if staged:
        torch.cuda.current_stream(device).synchronize()
    return storages
