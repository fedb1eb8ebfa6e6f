"""One remote device: the ordered op stream to its worker, batched, with reads that wait."""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, cast

import torch

from gpupool.protocol.v1.dataplane import (
    BATCH_MAX_RECORDS,
    CHUNK_BYTES,
    INLINE_PAYLOAD_BYTES,
    MAX_FRAME_BYTES,
    PINNED_REGION,
    PUT_LANES,
    VERSION,
    Address,
    Connection,
    DataPlaneError,
    ErrorBody,
    ErrorKind,
    Kind,
    ProtocolError,
    Rec,
    SharedArena,
    connect,
    pack_records,
    parse_address,
    recv_handshake,
    send_handshake,
)
from gpupool.protocol.v1.tensors import (
    checked_shape,
    dtype_from_name,
    dtype_name,
    host_bytes,
    tensor_bytes,
)
from gpupool.torch import pinned
from gpupool.torch.lanes import LANE_PUT_MIN_BYTES, PutLanes
from gpupool.torch.tensor import Handle, cxx_device

if TYPE_CHECKING:
    from gpupool.torch.shapes import OpInfo

HANDLE_IDS = itertools.count(1)
"""Handles are chosen by the client, so making a tensor needs no round trip."""

MiB = 1 << 20
ADMIT_ASK_FRACTION = 8
"""Allocations of at least 1/8 of the lease's memory ask the worker whether they fit."""
FLUSH_AFTER_S = 0.001
"""A batch leaves at the latest this long after its first record (the flusher covers idle gaps)."""
BATCH_MAX_BYTES = 8 * MiB
FLAGS_CATCH_UP_S = 0.05
"""How often a flush also compares all of torch's switches with what the worker was told (a
few microseconds): the setters PyTorch's functions call send theirs at once anyway."""
NOTICE_POLL_S = 0.05
"""While the program is busy the flusher still reads the worker's notices this often."""
REPLY_SPIN_S = int(os.environ.get("GPUPOOL_SPIN_US", "0") or 0) / 1e6
"""A request may poll for its reply this long before it sleeps in recv (`GPUPOOL_SPIN_US`), so
that short replies (`.item()`) arrive without a scheduler wakeup. Off by default: it helps only
with a core to spare."""
LAUNCH_BLOCKING = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
"""As with CUDA: every op waits for the worker, so an error surfaces at the op that caused it."""
_BATCH_HEAD = [Kind.BATCH]
CLOSE_SEND_WAIT_S = 30.0
"""How long closing a stream waits for background sends still in progress."""
fast_pack: Callable[[Any, list[Any]], bytes | None] | None = None
"""gpupool.torch._fastpath.pack_records while the compiled hot path is on (dispatch.use_fastpath
sets it): the same bytes as msgpack, or None for a kind it leaves to msgpack."""

log = logging.getLogger("gpupool.torch.stream")


flags_snapshot: Callable[[], dict[str, Any]] | None = None
"""gpupool.torch.flags.snapshot while attached: torch's global switches, which each stream's
worker follows (FLAGS records)."""


def _unanswered(stream: DeviceStream, idle: bool) -> None:
    raise RuntimeError("gpupool.torch.session was not imported")


settle: Callable[[DeviceStream, bool], None] = _unanswered
"""gpupool.torch.session.settle, which session sets when imported: answers a swap or move
notice, and resumes a swapped stream before it sends ops (lock held). It lives above this
module, as a move reconnects through open_stream."""


def pack_batch(batch: list[Any]) -> bytes:
    """One BATCH frame body of these records."""
    packed = fast_pack(_BATCH_HEAD, batch) if fast_pack is not None else None
    return packed if packed is not None else pack_records(_BATCH_HEAD, batch)


class AttachError(RuntimeError):
    """The worker refused the client (bad token, busy) or could not be reached."""


class WorkerLost(RuntimeError):
    """The connection to a worker broke; its tensors are gone.

    The message names the lease and the worker, and says what was seen, so that a program
    stopped by it can be told apart from a bug of its own.
    """


class Elastic:
    """What one DeviceStream knows about its slice's elasticity."""

    __slots__ = (
        "event", "last_bytes", "last_path", "last_pause_s", "last_swap_s", "moves", "paused_s",
        "resumes", "swapped", "swaps",
    )  # fmt: skip

    def __init__(self) -> None:
        self.event: str | None = None
        """The last notice not answered yet: "swap" or "move"."""
        self.swapped = False
        self.swaps = 0
        self.resumes = 0
        self.moves = 0
        self.paused_s = 0.0
        """Time this program waited in RESUME (restores and handoffs), in total."""
        self.last_pause_s = 0.0
        self.last_swap_s = 0.0
        """How long the worker took for the last swap-out (its own measure)."""
        self.last_bytes = 0
        """Bytes of state the last swap-out or handoff moved."""
        self.last_path: str | None = None
        """How the last handoff moved the state: cuda_ipc, shm or stream (the worker says)."""


class OpRecorder(Protocol):
    """What a stream tells whoever records a step's ops (gpupool.torch.capture's Recorder)."""

    def on_new_handle(self, stream: DeviceStream, handle: Handle) -> None: ...

    def on_emit(self, stream: DeviceStream, record: list[Any]) -> None: ...

    def on_put(self, stream: DeviceStream, handle: Handle, host: torch.Tensor) -> None: ...

    def on_wait(self, stream: DeviceStream, what: str) -> None: ...

    def on_call(self, stream: DeviceStream, op: str) -> None: ...

    def on_release(self, handle: int) -> None: ...


class _Wire:
    """The frames a background thread sends, in order, while non-blocking puts stream their
    bytes: `x.to("cuda", non_blocking=True)` of a pinned tensor returns at once, and the
    batches the program issues meanwhile queue behind those bytes (the worker reads a put's
    chunks right after the batch that holds its record). Idle, it is not in the way: the
    stream sends on its own thread as before."""

    def __init__(self, stream: DeviceStream) -> None:
        self.stream = stream
        self.cv = threading.Condition()
        self.queue: deque[tuple[bytes | None, int, memoryview | None, Any]] = deque()
        self.active = False
        self.error: DataPlaneError | None = None
        self._thread: threading.Thread | None = None

    def push(self, body: bytes | None, handle: int = 0, data: memoryview | None = None,
             keep: Any = None) -> None:  # fmt: skip
        """Queue a frame body, or a put's bytes (`data`, kept alive by `keep`) for `handle`."""
        with self.cv:
            self.queue.append((body, handle, data, keep))
            self.active = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"gpupool-wire-{self.stream.index}", daemon=True
                )
                self._thread.start()
            self.cv.notify_all()

    def push_if_active(self, body: bytes) -> bool:
        """Queue a batch behind frames still being sent; False when none are (send it now)."""
        if not self.active:
            return False
        with self.cv:
            if not self.active:
                return False
            self.queue.append((body, 0, None, None))
            self.cv.notify_all()
            return True

    def quiet(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued is sent (False: still sending after timeout_s)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cv:
            while self.active:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cv.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue:
                    self.active = False
                    self.cv.notify_all()
                    self.cv.wait()
                body, handle, data, keep = self.queue[0]
            try:
                conn = self.stream.conn
                if body is None and data is None:
                    keep()  # a copy into the shared arena, before the batch naming it
                elif data is None:
                    assert body is not None
                    conn.send_body(body)
                else:
                    for offset in range(0, len(data), CHUNK_BYTES):
                        conn.send([Kind.PUT, handle, offset], data[offset : offset + CHUNK_BYTES])
            except (DataPlaneError, RuntimeError) as exc:
                with self.cv:
                    self.error = (
                        exc
                        if isinstance(exc, DataPlaneError)
                        else DataPlaneError(f"a copy into shared memory failed: {exc}")
                    )
                    self.queue.clear()
                    continue
            del keep, data
            with self.cv:
                self.queue.popleft()


class DeviceStream:
    """cuda:<index> as this process sees it: a connection to one worker and its op stream.

    Records are appended lock-free to a deque (also from `Handle.__del__`, at any moment);
    a flush drains them in order under `lock`, which also spans each request and its reply.
    """

    def __init__(
        self,
        index: int,
        address: Address,
        conn: Connection,
        welcome: dict[str, Any],
        client_arena: SharedArena | None,
        worker_arena: SharedArena | None,
    ) -> None:
        self.index = index
        self.address = address
        self.device = torch.device("cuda", index)
        self.cxx_device = cxx_device(index)
        """What PyTorch's C++ sees as the device of this stream's tensors (gpupool:N)."""
        self.conn = conn
        self.welcome = welcome
        self.records: deque[list[Any]] = deque()
        self.lock = threading.RLock()
        self.open = True
        self._forked = False
        self.round_trips = 0
        """Requests that waited for the worker (reads, calls, syncs): the only waits."""
        self._first_at = 0.0
        self._pending_bytes = 0
        self._sends = 0
        """Batches sent, by whichever thread: the flusher tells a busy program by it."""
        self._sends_seen = 0
        self._polled_at = 0.0
        self._op_ids: dict[OpInfo, int] = {}
        self._op_counter = itertools.count(1)
        self._requests = itertools.count(1)
        self._client_arena = client_arena
        self._worker_arena = worker_arena
        self._arena_cursor = 0
        self.sync_epoch = 0
        """How many times a reply has said the worker's stream ran everything sent before it
        (reads, syncs): puts from pinned memory sent earlier have been copied."""
        self._shares_pinned = bool(welcome.get("pinned")) and client_arena is not None
        """The worker maps this process's shared pinned region (same host, Unix socket)."""
        self.pinned_puts = 0
        """Puts the worker copied straight out of a pinned tensor's memory (no copy here)."""
        self._lanes: PutLanes | None = None
        """Extra connections for large puts over TCP, opened at the first such put."""
        self._lanes_tried = False
        self.recorder: OpRecorder | None = None
        """Set while gpupool.torch.capture records a step: it sees every op, put and read."""
        self.watched: set[int] = set()
        """Handles captured programs read; `released` collects those the client dropped."""
        self.released: set[int] = set()
        self.elastic = Elastic()
        self.token = ""
        self.shm_mib = 0
        """How open_stream connected: what a move to a successor worker connects with."""
        self.flags_sent: dict[str, Any] = {}
        """The global switches as the worker was last told them."""
        self._flags_checked_at = 0.0
        self.worker_stream = 0
        """The torch.cuda stream (client-chosen id, 0: default) the worker runs records on."""
        self._wire: _Wire | None = None
        """Sends non-blocking puts' bytes, and what queues behind them, in the background."""
        self.lease_gpu = index
        """Which GPU of the lease this is (a rank's one GPU is its cuda:0 but GPU r)."""
        self.dist_rank: int | None = None
        """This process's rank in a torch.distributed group on this device, once it has one."""

    # ---- facts ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return str(self.welcome.get("device_name", "gpupool remote device"))

    @property
    def lease(self) -> str:
        return str(self.welcome.get("lease", ""))

    @property
    def who(self) -> str:
        """The device as error messages name it: with the program's rank, where it has one."""
        rank = "" if self.dist_rank is None else f"rank {self.dist_rank}, "
        return f"{rank}{self.device} (GPU {self.lease_gpu} of the lease, worker {self.address})"

    @property
    def is_cuda_worker(self) -> bool:
        return self.welcome.get("device_type") == "cuda"

    # ---- appending -----------------------------------------------------------------------

    def new_handle(self) -> Handle:
        handle = Handle(next(HANDLE_IDS), self)
        if self.recorder is not None:
            self.recorder.on_new_handle(self, handle)
        return handle

    def op_id(self, op: OpInfo) -> int:
        op_id = self._op_ids.get(op)
        if op_id is None:
            op_id = next(self._op_counter)
            # DEF goes in before the id is visible, so no thread can use an undefined id.
            self.records.append([Rec.DEF, op_id, op.wire_name])
            self._op_ids[op] = op_id
        return op_id

    def emit(self, record: list[Any]) -> None:
        records = self.records
        records.append(record)
        if self.recorder is not None:
            self.recorder.on_emit(self, record)
        if LAUNCH_BLOCKING:
            self.sync()
            return
        if len(records) >= BATCH_MAX_RECORDS:
            self.flush()
            return
        now = time.perf_counter()
        first = self._first_at
        if not first:
            self._first_at = now
        elif now - first > FLUSH_AFTER_S:
            self.flush()

    def release(self, handle: int) -> None:
        """A handle's last client reference died (called from __del__: append only)."""
        if self.open:
            self.records.append([Rec.FREE, handle])
            if handle in self.watched:
                self.released.add(handle)
            if self.recorder is not None:
                self.recorder.on_release(handle)

    # ---- sending -------------------------------------------------------------------------

    def flush(self) -> None:
        with self.lock:
            self._flush_locked()

    def try_flush(self, now: float) -> bool:
        """For the background flusher: send what the program left unsent, and read the
        worker's notices (swap, move). Never waits behind a read in progress.

        Returns True when the program is busy: it sent a batch itself since the last call
        and what is queued now is younger than FLUSH_AFTER_S, so its own flushes keep the
        stream moving. Then this touches no lock and no socket (each would hand the GIL back
        and forth with the program's thread, which measured 15 ms of a 65 ms GPT-2 step on
        the H200 box), and the flusher may call less often."""
        if not self.open:
            return False
        sends, first = self._sends, self._first_at
        busy = sends != self._sends_seen and (not first or now - first < FLUSH_AFTER_S)
        self._sends_seen = sends
        if busy and now - self._polled_at < NOTICE_POLL_S and not self.elastic.event:
            return True
        if self.lock.acquire(blocking=False):
            try:
                self._polled_at = now
                poll_notices(self)
                if self.elastic.event:
                    self.quiet_wire()
                    settle(self, not self.records)
                if self.records and not busy:
                    self._flush_locked()
            finally:
                self.lock.release()
        return busy

    def note_flags(self) -> None:
        """Tell the worker the global switches that changed since it was last told (in stream
        order: the ops queued before run with the old values)."""
        if self.open:
            record = self._flags_record()
            if record is not None:
                self.records.append(record)

    def _flags_record(self) -> list[Any] | None:
        """A FLAGS record of the switches that differ from what the worker was told, or None."""
        if flags_snapshot is None or not self.welcome.get("flags"):
            return None
        values = flags_snapshot()
        if values == self.flags_sent:
            return None
        diff = {k: v for k, v in values.items() if self.flags_sent.get(k) != v}
        self.flags_sent = values
        return [Rec.FLAGS, diff]

    def _flush_locked(self) -> None:
        self._check_open()
        if self.elastic.event or self.elastic.swapped:
            self.quiet_wire()
            settle(self, False)
        now = time.perf_counter()
        if now - self._flags_checked_at > FLAGS_CATCH_UP_S:
            # A switch set behind the setters gpupool follows: sent ahead of this batch.
            self._flags_checked_at = now
            changed = self._flags_record()
            if changed is not None:
                self.records.appendleft(changed)
        records = self.records
        n = len(records)
        if not n:
            self._first_at = 0.0  # nothing waits: the next record starts a batch's age afresh
            return
        batch = [records.popleft() for _ in range(n)]
        self._pending_bytes = 0
        self._first_at = 0.0
        self._sends += 1
        body = pack_batch(batch)
        wire = self._wire
        if wire is not None:
            if wire.error is not None:
                self._lost(wire.error)
            if wire.push_if_active(body):
                return
        try:
            self.conn.send_body(body)
        except DataPlaneError as exc:
            self._lost(exc)

    def _lanes_for(self, nbytes: int) -> PutLanes | None:
        """The lanes a put of nbytes goes over (None: the stream's own connection)."""
        if nbytes < LANE_PUT_MIN_BYTES or self.recorder is not None:
            return None
        if self._lanes is None and not self._lanes_tried:
            self._lanes_tried = True
            self._lanes = PutLanes.open(
                self.address, self.lease, self.token, self.welcome.get("lanes")
            )
        return self._lanes

    def _close_lanes(self) -> None:
        if self._lanes is not None:
            with contextlib.suppress(DataPlaneError):
                self._lanes.wait()
            self._lanes.close()
        self._lanes, self._lanes_tried = None, False

    def _wire_of(self) -> _Wire:
        if self._wire is None:
            self._wire = _Wire(self)
        return self._wire

    @property
    def sending(self) -> bool:
        """Whether non-blocking puts (and batches queued behind them) are still being sent."""
        wire = self._wire is not None and self._wire.active
        return wire or (self._lanes is not None and self._lanes.busy)

    @property
    def lanes(self) -> int:
        """How many lanes this stream's large puts go over (0: its own connection only)."""
        return self._lanes.count if self._lanes is not None else 0

    def quiet_wire(self) -> None:
        """Wait until the background sends are done (before the connection is used directly)."""
        wire = self._wire
        if wire is not None:
            wire.quiet()
            if wire.error is not None:
                self._lost(wire.error)

    def _check_open(self) -> None:
        if not self.open:
            if self._forked:
                raise WorkerLost(
                    f"{self.device} is a gpupool remote GPU of the parent process; a forked "
                    "subprocess cannot use it (as with CUDA: use the 'spawn' start method)"
                )
            raise WorkerLost(
                f"lease {self.lease}: {self.who} is no longer connected; the tensors it held "
                "are gone"
            )

    def forked(self) -> None:
        """In a forked child (a DataLoader worker): never touch the parent's connection.

        Nothing the parent had queued is sent from here, and the child's copy of the socket is
        closed, so that the parent's close() still ends the connection while the child lives
        on (persistent loader workers): the worker would otherwise keep waiting for a client
        that left."""
        self._forked = True
        self.open = False
        self._wire = None  # its thread is the parent's
        if self._lanes is not None:
            self._lanes.forget()
            self._lanes = None
        self.records = deque()
        self.lock = threading.RLock()
        self._first_at = 0.0
        self._pending_bytes = 0
        self.recorder = None
        with contextlib.suppress(Exception):
            self.conn.forget()

    def _lost(self, exc: BaseException) -> NoReturn:
        self.open = False
        self.records.clear()
        raise WorkerLost(
            f"lease {self.lease}: lost the connection to {self.who}: {exc}. The worker died, "
            "was stopped (the lease ended) or cannot be reached; the tensors it held are gone"
        ) from exc

    # ---- bytes in ------------------------------------------------------------------------

    def put(self, handle: Handle, host: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy a host tensor into the worker's tensor (broadcast and dtype cast on the worker).

        `non_blocking` (a pinned source, as CUDA requires for an asynchronous copy): where the
        bytes go by socket, this returns once the record is queued and a background thread
        sends them; like a local GPU's copy, the source must not change until the stream
        has synchronised (a read, a sync)."""
        host = host.detach()
        if host.device.type != "cpu":
            raise TypeError(f"put expects a host tensor, got {host.device}")
        host = host.contiguous()
        if self.recorder is not None:
            self.recorder.on_put(self, handle, host)
        nbytes = host.numel() * host.element_size()
        dtype, shape = dtype_name(host.dtype), list(host.shape)
        if nbytes <= INLINE_PAYLOAD_BYTES:
            self._pending_bytes += nbytes
            self.emit([Rec.PUT, handle.id, dtype, shape, tensor_bytes(host), nbytes, None])
            if self._pending_bytes > BATCH_MAX_BYTES:
                self.flush()
            return
        with self.lock:
            if non_blocking and self._shares_pinned and self.recorder is None:
                region = pinned.shared_region()
                offset = region.offset_of(host, nbytes) if region is not None else None
                if region is not None and offset is not None:
                    # The worker copies straight out of the pinned tensor's own memory.
                    region.copied_by(host, self)
                    self.pinned_puts += 1
                    self.records.append(
                        [Rec.PUT, handle.id, dtype, shape, None, nbytes, offset, PINNED_REGION]
                    )
                    self._flush_locked()
                    return
            arena = self._client_arena
            if arena is not None and nbytes <= arena.size:
                if self._arena_cursor + nbytes > arena.size:
                    self._roundtrip_locked()  # wait until the worker copied out everything before
                offset = self._arena_cursor
                into = torch.frombuffer(arena.map, dtype=torch.uint8, count=nbytes, offset=offset)
                source = host.reshape(-1).view(torch.uint8)
                self._arena_cursor += nbytes
                if non_blocking and self.recorder is None:
                    # The copy into the arena runs on the wire's thread (torch releases the
                    # GIL); the batch naming it is queued behind it.
                    self._wire_of().push(None, 0, None, lambda: into.copy_(source))
                else:  # its batch still queues behind any background sends
                    into.copy_(source)
                self.records.append([Rec.PUT, handle.id, dtype, shape, None, nbytes, offset])
                self._flush_locked()
                return
            lanes = self._lanes_for(nbytes)
            if lanes is not None:
                self.records.append(
                    [Rec.PUT, handle.id, dtype, shape, None, nbytes, None, PUT_LANES]
                )
                self._flush_locked()
                try:
                    job = lanes.send(handle.id, host_bytes(host), host)
                    if not non_blocking or self.recorder is not None:
                        lanes.wait(job)
                except DataPlaneError as exc:
                    self._lost(exc)
                return
            self.records.append([Rec.PUT, handle.id, dtype, shape, None, nbytes, None])
            self._flush_locked()
            data = host_bytes(host)
            if non_blocking and self.recorder is None:
                self._wire_of().push(None, handle.id, data, host)
                return
            self.quiet_wire()
            try:
                for offset in range(0, nbytes, CHUNK_BYTES):
                    self.conn.send(
                        [Kind.PUT, handle.id, offset], data[offset : offset + CHUNK_BYTES]
                    )
            except DataPlaneError as exc:
                self._lost(exc)

    # ---- requests (the only places the client waits) -------------------------------------

    def read(self, handle_ext: Any) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder.on_wait(self, "reads a tensor's values (.item(), .cpu(), print, a bool)")
        with self.lock:
            value = self._receive_tensor(self._request_locked(Rec.READ, handle_ext))
            self._drained()  # a read waits for the worker's stream: puts are done
            return value

    def call(
        self, op: OpInfo, args: list[Any], kwargs: dict[str, Any] | None, handle_base: int
    ) -> Any:
        """Run an op now and return the worker's description of its outputs."""
        if self.recorder is not None:
            self.recorder.on_call(self, op.wire_name)
        with self.lock:
            op_id = self.op_id(op)
            return self._receive_result(
                self._request_locked(Rec.CALL, op_id, args, kwargs, handle_base)
            )

    def sync(self) -> dict[str, Any]:
        if self.recorder is not None:
            self.recorder.on_wait(self, "synchronizes with the GPU")
        with self.lock:
            stats = self._receive_result(self._request_locked(Rec.SYNC))
            self._drained()
            return stats

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return self._receive_result(self._request_locked(Rec.STATS))

    def reset_peak(self) -> None:
        self.query("reset_peak")

    # ---- memory the lease has ------------------------------------------------------------

    def admit(self, nbytes: int, op: str) -> None:
        """Before an allocation of `nbytes` is sent: raise torch.OutOfMemoryError here, at the
        allocating call, where the lease cannot hold it (as a local GPU's allocator does),
        instead of at a later read. One that alone exceeds the limit raises at once; one of
        at least ADMIT_ASK_FRACTION of the limit asks the worker what it holds (one round
        trip: rare, and small beside the tensor itself)."""
        limit = self.welcome.get("memory_limit_bytes")
        if not isinstance(limit, int) or nbytes * ADMIT_ASK_FRACTION < limit:
            return
        held = 0 if nbytes > limit else int(self.stats().get("memory_held_bytes", 0))
        if held + nbytes > limit:
            raise torch.OutOfMemoryError(
                f"gpupool lease {self.lease} is out of GPU memory (a limit of {limit // MiB} "
                f"MiB, {held / MiB:.1f} MiB held) in {op}: tried to allocate "
                f"{nbytes / MiB:.1f} MiB on {self.device}"
            )

    # ---- streams and events (gpupool.torch.streams) --------------------------------------

    def takes_streams(self) -> bool:
        return bool(self.welcome.get("streams"))

    def use_stream(self, stream_id: int, priority: int) -> None:
        """The records after this run on the worker's stream `stream_id`."""
        if stream_id != self.worker_stream:
            self.emit([Rec.STREAM, "use", stream_id, priority])
            self.worker_stream = stream_id

    def free_stream(self, stream_id: int) -> None:
        """A Stream object died (called from __del__: append only)."""
        if self.open:
            self.records.append([Rec.STREAM, "free", stream_id, None])

    def free_event(self, event_id: int) -> None:
        if self.open:
            self.records.append([Rec.EVENT, "free", event_id, 0, False])

    def query(self, what: str, a: Any = None, b: Any = None) -> Any:
        """A question about streams, events or memory counters, answered after everything
        queued before it ran (and, for syncs, finished)."""
        if self.recorder is not None:
            self.recorder.on_wait(self, f"waits for the worker ({what})")
        with self.lock:
            return self._receive_result(self._request_locked(Rec.QUERY, what, a, b))

    def seed(self, seed: int) -> None:
        self.emit([Rec.SEED, int(seed)])

    def rng_state(self) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder.on_wait(self, "reads the random generator's state")
        with self.lock:
            state = self._receive_result(self._request_locked(Rec.RNG_STATE))
        return torch.frombuffer(bytearray(state), dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.emit([Rec.SET_RNG_STATE, tensor_bytes(state.to(torch.uint8))])

    def op_names(self) -> set[str]:
        """The ops this stream has sent to its worker so far."""
        return {op.wire_name for op in self._op_ids}

    def _request_locked(self, kind: Rec, *fields: Any) -> int:
        req = next(self._requests)
        self.records.append([kind, req, *fields])
        self._flush_locked()
        self.round_trips += 1
        return req

    def _roundtrip_locked(self) -> None:
        self._receive_result(self._request_locked(Rec.SYNC))
        self._drained()

    def _drained(self) -> None:
        """The worker's stream has run every put sent so far: their host memory is free."""
        self._arena_cursor = 0
        self.sync_epoch += 1
        if self._lanes is not None:
            # The worker has read every lane byte sent before its reply: the senders' last
            # sends have returned, and a lane that broke says so here.
            try:
                self._lanes.wait()
            except DataPlaneError as exc:
                self._lost(exc)

    def _receive_head(self, req: int) -> tuple[list[Any], int]:
        try:
            if REPLY_SPIN_S:
                self.conn.wait(REPLY_SPIN_S)
            frame = self.conn.recv()
            head = frame.head()
            while head[0] == Kind.NOTICE:  # answered at the next flush, after this reply
                on_notice(self, head)
                frame = self.conn.recv()
                head = frame.head()
        except DataPlaneError as exc:
            self._lost(exc)
        if head[0] == Kind.ERROR:
            body = ErrorBody.from_wire(head[2] if len(head) > 2 else None)
            if head[1] is None:
                self.open = False
                raise WorkerLost(
                    f"lease {self.lease}: the worker of {self.who} closed the connection: "
                    f"{body.message}"
                )
            raise remote_exception(body)
        if len(head) < 2 or head[1] != req:
            self._lost(
                ProtocolError(
                    f"reply to request {head[1] if len(head) > 1 else None}, expected {req}"
                )
            )
        return head, frame.tail_len

    def _receive_result(self, req: int) -> Any:
        head, _ = self._receive_head(req)
        if head[0] != Kind.RESULT:
            self._lost(ProtocolError(f"expected RESULT, got {Kind(head[0]).name}"))
        return head[2]

    def _receive_tensor(self, req: int) -> torch.Tensor:
        """The values of a READ, landed straight in the memory of the tensor returned: DATA
        frames are received into it chunk by chunk (the worker streams them back to back, so
        the socket's buffers keep the next chunks in flight while one is read), a read through
        the shared arena is one torch copy out of it. No Python bytes object holds them."""
        head, tail_len = self._receive_head(req)
        if head[0] != Kind.DATA:
            self._lost(ProtocolError(f"expected DATA, got {Kind(head[0]).name}"))
        _, _, dtype, shape, offset, total, in_arena = head
        try:
            out = _empty_for(dtype_from_name(dtype), shape, total)
            if in_arena:
                if self._worker_arena is None:
                    raise ProtocolError("DATA in shared memory, but no arena was shared")
                into = out.view(-1).view(torch.uint8)
                filled = 0
                while True:
                    size = int(in_arena)
                    if offset != filled or size <= 0 or filled + size > total:
                        raise ProtocolError(f"DATA of {size} bytes in shared memory at "
                                            f"{offset}, expected {filled} of {total}")  # fmt: skip
                    source = self._worker_arena.view(offset, size)
                    into[filled : filled + size].copy_(torch.frombuffer(source, dtype=torch.uint8))
                    filled += size
                    if filled >= total:
                        return out
                    head, _ = self._receive_head(req)
                    if head[0] != Kind.DATA:
                        raise ProtocolError(f"expected DATA, got {Kind(head[0]).name}")
                    offset, in_arena = head[4], head[6]
            view = host_bytes(out)
            filled = 0
            while filled < total or tail_len:
                if offset != filled or filled + tail_len > total:
                    raise ProtocolError(f"DATA chunk of {tail_len} bytes at {offset}, expected "
                                        f"{filled} of {total}")  # fmt: skip
                self.conn.read_tail_into(view[filled : filled + tail_len])
                filled += tail_len
                if filled >= total:
                    break
                head, tail_len = self._receive_head(req)
                if head[0] != Kind.DATA:
                    raise ProtocolError(f"expected DATA, got {Kind(head[0]).name}")
                offset = head[4]
        except DataPlaneError as exc:
            self._lost(exc)
        return out

    def adopt_connection(self, fresh: DeviceStream) -> None:
        """Continue on `fresh`'s connection (a successor worker holding this stream's state):
        handles and op ids stay valid, the shared arenas are the new worker's."""
        self.quiet_wire()
        self._close_lanes()  # the successor offers lanes of its own
        for arena in (self._client_arena, self._worker_arena):
            if arena is not None:
                arena.close()
        self.conn, self.address, self.welcome = fresh.conn, fresh.address, fresh.welcome
        # The successor starts on its default stream and torch's default switches.
        self.worker_stream, self.flags_sent, self._flags_checked_at = 0, {}, 0.0
        self._client_arena, self._worker_arena = fresh._client_arena, fresh._worker_arena
        self._shares_pinned = fresh._shares_pinned
        self._drained()  # the predecessor ran everything before it handed over

    def close(self) -> None:
        if not self.open:
            return
        with contextlib.suppress(WorkerLost, DataPlaneError):
            self.flush()
            if self._wire is not None:
                # A worker that stopped reading must not hold the program's exit: closing
                # the connection below ends the sender's write.
                self._wire.quiet(CLOSE_SEND_WAIT_S)
        self.open = False
        if self._lanes is not None:
            self._lanes.close()
        self.conn.close()
        for arena in (self._client_arena, self._worker_arena):
            if arena is not None:
                arena.close()


HUGE_PAGE_BYTES = 2 * MiB
HUGE_READ_MIN_BYTES = 2 * HUGE_PAGE_BYTES
"""Reads from this size on land in transparent huge pages where the kernel offers them."""
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_libc_madvise: Callable[..., int] | None = None
if _MADV_HUGEPAGE is not None:
    with contextlib.suppress(OSError, AttributeError):
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc_madvise = _libc.madvise
        _libc_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc_madvise.restype = ctypes.c_int


def on_notice(stream: DeviceStream, head: list[Any]) -> None:
    body = head[1] if len(head) > 1 else None
    event = body.get("event") if isinstance(body, dict) else None
    if event not in ("swap", "move"):
        raise ProtocolError(f"unknown notice {body!r:.200}")
    stream.elastic.event = event


def poll_notices(stream: DeviceStream) -> None:
    """Read notices the worker sent while the client was not waiting for a reply (lock held)."""
    conn = stream.conn
    while conn.readable(0):
        try:
            head = conn.recv().head()
        except DataPlaneError as exc:
            stream._lost(exc)
        if head[0] == Kind.NOTICE:
            on_notice(stream, head)
            continue
        stream._lost(ProtocolError(f"unexpected frame {Kind(head[0]).name} between requests"))


def stream_of(handle: Handle) -> DeviceStream:
    """The stream that made `handle` (DeviceStream.new_handle makes them all): gpupool.torch.tensor,
    below this module, knows a handle's stream only as its `Holder` protocol."""
    return cast(DeviceStream, handle.stream)


def _empty_for(dtype: torch.dtype, shape: Any, total: int) -> torch.Tensor:
    """An uninitialised host tensor for a read of `total` bytes (no zero fill: each page is
    first touched by the bytes received into it), checked to hold exactly that many.

    A large one asks for transparent huge pages (as PyTorch's THP_MEM_ALLOC_ENABLE does for
    all its allocations): the fresh memory of a read is faulted in as it is received, and
    one fault per 4 KiB page cost more than the copy itself (a 64 MiB read into fresh pages
    ran at 0.5 GB/s over loopback where the same socket filled touched memory at 1.4 GB/s);
    one fault per 2 MiB leaves the socket's speed."""
    sizes = checked_shape(shape)
    out = torch.empty(sizes, dtype=dtype)
    if out.numel() * out.element_size() != total:
        raise ProtocolError(f"{total} bytes do not hold {list(sizes)} of {dtype}")
    if total >= HUGE_READ_MIN_BYTES and _libc_madvise is not None:
        start = -(-out.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (out.data_ptr() + total) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start:  # only whole huge pages inside the tensor: its neighbours untouched
            _libc_madvise(start, end - start, _MADV_HUGEPAGE)  # advice: a refusal is harmless
    return out


def allocation_bytes(size: Any, stride: Any, dtype: torch.dtype | None) -> int:
    """Bytes of the storage that empty(size) / empty_strided(size, stride) allocate."""
    itemsize = (dtype or torch.get_default_dtype()).itemsize
    sizes = [int(s) for s in size]
    if any(s == 0 for s in sizes):
        return 0
    if stride is None:
        numel = 1
        for s in sizes:
            numel *= s
        return numel * itemsize
    return (1 + sum((s - 1) * int(st) for s, st in zip(sizes, stride, strict=False))) * itemsize


def remote_exception(body: ErrorBody) -> BaseException:
    """The worker's error as the exception local PyTorch would have raised."""
    if body.kind == ErrorKind.OUT_OF_MEMORY:
        return torch.OutOfMemoryError(body.message)
    if body.kind == ErrorKind.UNSUPPORTED:
        return NotImplementedError(body.message)
    if body.kind in (ErrorKind.AUTH, ErrorKind.BUSY):
        return AttachError(body.message)
    cls = getattr(builtins, body.exc_type, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        return cls(body.message)
    return RuntimeError(body.message)


BUSY_RETRY_S = 3.0
"""A worker frees itself a moment after its previous client left; wait that long for it."""
GONE_CLIENT_WAIT_S = 600.0
"""How long to wait for a worker that is finishing the last call of a client that has gone
(a killed program's compile or long kernel): that worker will be free, so waiting is
better than failing; the bound keeps a call that never ends from hanging the program."""


def open_stream(
    index: int, address: Address, lease: str, token: str, shm_mib: int = 256
) -> DeviceStream:
    """Connect, authenticate with the lease's token, and learn the device's facts."""
    deadline = time.monotonic() + BUSY_RETRY_S
    gone_since: float | None = None
    hops = 0
    while True:
        try:
            opened = _open_stream(index, address, lease, token, shm_mib)
            opened.token, opened.shm_mib = token, shm_mib
            return opened
        except _Moved as moved:
            # The worker handed this lease's state on (a migration): follow it, a few times.
            hops += 1
            if hops > MAX_MOVED_HOPS:
                raise AttachError(f"lease {lease} keeps moving; last at {moved.address}") from None
            address = parse_address(moved.address)
        except _Busy as busy:
            now = time.monotonic()
            if busy.client_gone and gone_since is None:
                gone_since = now
                deadline = max(deadline, now + GONE_CLIENT_WAIT_S)
                log.warning(
                    "the worker at %s is finishing the last call of a client that has left; "
                    "waiting up to %.0f s for it",
                    address,
                    GONE_CLIENT_WAIT_S,
                )
            if now > deadline:
                if gone_since is not None:
                    raise AttachError(
                        f"the worker at {address} was still finishing the last call of a "
                        f"client that left {now - gone_since:.0f} s ago"
                    ) from None
                raise AttachError(
                    f"the worker at {address} already serves another client"
                ) from None
            time.sleep(0.05)


class _Busy(Exception):
    def __init__(self, client_gone: bool) -> None:
        super().__init__()
        self.client_gone = client_gone


class _Moved(Exception):
    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.address = address


MAX_MOVED_HOPS = 4


def _open_stream(
    index: int, address: Address, lease: str, token: str, shm_mib: int
) -> DeviceStream:
    try:
        sock = connect(address)
    except OSError as exc:
        raise AttachError(f"cannot reach the worker of lease {lease} at {address}: {exc}") from exc
    client_arena = SharedArena.create(shm_mib * MiB) if address.is_unix and shm_mib > 0 else None
    region = pinned.shared_region() if client_arena is not None else None
    fds = [client_arena.fd] if client_arena else []
    if region is not None:
        fds.append(region.fd)
    hello = {
        "v": VERSION,
        "lease": lease,
        "token": token,
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "shm": client_arena is not None,
        "pinned": region is not None,
    }
    try:
        send_handshake(sock, [Kind.HELLO, hello], fds)
        sock.settimeout(30)
        reply = recv_handshake(sock)
        sock.settimeout(None)
    except (OSError, DataPlaneError) as exc:
        sock.close()
        raise AttachError(f"handshake with the worker at {address} failed: {exc}") from exc
    head = reply.head
    if head[0] == Kind.ERROR:
        sock.close()
        if client_arena is not None:
            client_arena.close()
        body = ErrorBody.from_wire(head[2] if len(head) > 2 else None)
        if body.kind == ErrorKind.BUSY:
            raise _Busy(body.client_gone)
        if body.kind == ErrorKind.MOVED:
            raise _Moved(body.message)
        raise AttachError(f"worker at {address} refused lease {lease}: {body.message}")
    if head[0] != Kind.WELCOME or not isinstance(head[1], dict):
        sock.close()
        raise AttachError(f"worker at {address} answered {head[0]} instead of WELCOME")
    welcome: dict[str, Any] = head[1]
    worker_arena = SharedArena.adopt(reply.fds[0]) if welcome.get("shm") and reply.fds else None
    if worker_arena is None and client_arena is not None:
        client_arena.close()
        client_arena = None
    conn = Connection(sock, int(welcome.get("max_frame_bytes", MAX_FRAME_BYTES)))
    return DeviceStream(index, address, conn, welcome, client_arena, worker_arena)
