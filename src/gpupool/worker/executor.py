"""Runs one client's op stream in order: the handle table, ops, reads, puts and sticky errors."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import torch

from gpupool.protocol.v1.dataplane import (
    CHUNK_BYTES,
    PINNED_REGION,
    PUT_LANES,
    DataPlaneError,
    ErrorBody,
    ErrorKind,
    Ext,
    Frame,
    Kind,
    ProtocolError,
    Rec,
    SharedArena,
)
from gpupool.protocol.v1.tensors import (
    LAYOUTS,
    MEMORY_FORMATS,
    complex_from_ext,
    dtype_from_name,
    dtype_name,
    host_bytes,
    literal_from_ext,
    op_overload,
    tensor_from_bytes,
)
from gpupool.worker import flags
from gpupool.worker.activity import Activity
from gpupool.worker.admission import Admission
from gpupool.worker.collectives import COLLECTIVES, Collectives
from gpupool.worker.cudnn_rnn import DROPOUT, CudnnRnn
from gpupool.worker.geometry import keeping_geometry
from gpupool.worker.memory import (
    NO_RESERVATION,
    LimitExceeded,
    MemoryLimit,
    MiB,
    Reservation,
    is_out_of_memory,
)
from gpupool.worker.opchecks import (
    CHECKS,
    argument_guard,
    guard,
    quiet_cudnn_rnn_warning,
    zero_fill_cpu_allocations,
)
from gpupool.worker.oppolicy import Decision, ruling
from gpupool.worker.program import Programs
from gpupool.worker.staging import PinnedStaging, RegisteredRegion, granule_pieces
from gpupool.worker.streams import StreamError, Streams
from gpupool.worker.swap import ClientState, restore, snapshot, to_host
from gpupool.worker.transfer import Arrivals, PeerLinks, PeerNotNamed, TransferFailed

ALLOWED_NAMESPACES = frozenset({"aten"})
"""Ops of other namespaces (custom libraries, prims, distributed) never run on a worker; aten's
own are decided one by one by the op policy (`gpupool.worker.oppolicy`)."""

SHM_READ_MIN_BYTES = 1 << 20
"""Smaller reads ride in the reply frame; larger ones go through the shared arena."""

STAGED_READS = os.environ.get("GPUPOOL_STAGED_READS") == "1"
"""A CUDA worker's reads through its page-locked staging buffers and asynchronous chunked
copies into the shared arena: written, not yet run on a GPU, so off unless this is set
(`bench/gpu/run_issue26_d2h.sh` sets it to measure them; the agent does not pass it on).
Off, a CUDA worker's reads take the plain copies, chunked into the arena synchronously."""


_MALFORMED = (IndexError, ValueError, TypeError, KeyError, AttributeError, OverflowError)
"""What a record of the wrong shape or with values of the wrong type raises in its handler."""

_BUILTIN_ERRORS = frozenset(
    {"RuntimeError", "ValueError", "TypeError", "IndexError", "NotImplementedError", "KeyError"}
)

log = logging.getLogger("gpupool.worker")


class Link(Protocol):
    """What the executor needs from the connection it serves."""

    client_arena: SharedArena | None
    worker_arena: SharedArena | None
    pinned_region: SharedArena | None
    """The client's pinned tensors' memory (same host), where it shared it."""
    pinned: bool
    """The arenas are registered with CUDA: copies from and to them are DMA at full speed."""

    def reply(self, head: list[Any], tail: memoryview | None = None) -> None: ...

    def read_put(self, handle: int, dest: memoryview, lanes: bool = False) -> None:
        """Fill dest from the PUT frames that follow the current batch (`lanes`: from the
        session's lanes, chunk by chunk side by side)."""

    def skip_put(self, handle: int, nbytes: int, lanes: bool = False) -> None:
        """Read and drop the PUT frames of a put that has nowhere to go."""


class Elastic(Protocol):
    """What runs a client's SWAP and RESUME records (the worker's swap and handoff logic)."""

    def swap(self, req: int, link: Link) -> None: ...

    def resume(self, req: int, link: Link) -> None: ...


@dataclass(frozen=True)
class Missing:
    """A handle the table does not hold (freed, or made by an op that failed or was skipped)."""

    handle: int


class Unsupported(Exception):
    pass


def _movable_dtype(tensor: torch.Tensor) -> str:
    """The wire name of a tensor's dtype, or Unsupported where the wire cannot carry it."""
    if tensor.is_nested or tensor.layout is not torch.strided:
        kind = "a nested tensor" if tensor.is_nested else f"a tensor of layout {tensor.layout}"
        raise Unsupported(f"gpupool cannot move {kind} (only strided ones)")
    try:
        return dtype_name(tensor.dtype)
    except TypeError as exc:
        raise Unsupported(str(exc)) from None


@dataclass
class _Op:
    name: str
    fn: Callable[..., Any] | None
    problem: str | None = None
    check: str | None = None
    """The check the op policy runs it behind (`gpupool.worker.opchecks.CHECKS`), if any."""
    call: Callable[..., Any] | None = field(init=False, default=None)
    """What runs the op: an OpOverload's C++ callable itself (`_op`, what its __call__ calls),
    one Python frame less for every op of a stream."""

    def __post_init__(self) -> None:
        self.call = getattr(self.fn, "_op", self.fn)


class _BatchNormNoUpdate:
    """`aten::_batch_norm_no_update` (what the client sends for batch norm in eval mode) has
    only a CPU kernel behind its composite on some torch versions: on a CUDA worker it fails
    with "Expected tensor to have CPU Backend". The same arithmetic, device-generic, is
    `_native_batch_norm_legit_no_training`; the fourth output (cuDNN's reserve) is empty in
    eval mode anyway."""

    def __init__(self) -> None:
        self._schema = torch.ops.aten._batch_norm_no_update.default._schema
        self._legit = torch.ops.aten._native_batch_norm_legit_no_training.default

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        out, mean, rstd = self._legit(*args, **kwargs)
        return out, mean, rstd, out.new_empty((0,), dtype=torch.uint8)


SHIMS: dict[str, Callable[..., Any]] = {
    "aten::_batch_norm_no_update": _BatchNormNoUpdate(),
    "aten::_cudnn_rnn": CudnnRnn(),  # cuDNN's dropout state, where the stack draws dropout
}


_FREE = int(Rec.FREE)


def _compiled() -> Any:
    """The compiled record loop, or None: not built here, or GPUPOOL_FASTPATH=0 (the switch
    that turns the client's compiled path off too)."""
    if os.environ.get("GPUPOOL_FASTPATH", "1") == "0":
        return None
    try:
        from gpupool.worker import _runloop  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _runloop


_runloop = _compiled()


def compiled_loop() -> bool:
    """Whether this worker runs its records through the compiled loop."""
    return _runloop is not None


def _new_loop(executor: Executor, fast_store: bool | None = None) -> Any:
    """The executor's compiled loop; `fast_store` overrides what its memory limit says (tests)."""
    assert _runloop is not None
    if fast_store is None:
        # A CUDA worker's allocator holds the limit itself: stores and frees need no word.
        fast_store = not executor.memory.counts_storages
    return _runloop.Loop(
        executor=executor,
        ext_hook=executor.ext_hook,
        missing=Missing,
        tensor_type=torch.Tensor,
        slow=executor._run_record,
        op_failed=executor._op_failed,
        op_store=executor._op_store,
        protocol_error=ProtocolError,
        timestamp=msgpack.Timestamp.from_bytes,
        fast_store=fast_store,
        # A device other than the host's: host tensors there are the lease's host memory,
        # counted even where the device's allocator holds the device limit.
        host_store=executor.device.type != "cpu",
    )


def _check_batch_head(head: Any) -> None:
    if not isinstance(head, list) or not head or head[0] != Kind.BATCH:
        kind = head[0] if isinstance(head, list) and head else None
        raise ProtocolError(f"expected a BATCH frame, got kind {kind}")


def first_line(exc: BaseException) -> str:
    """An exception's message for a one-line report (CUDA's run on for several lines)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class Executor:
    lease_id: str
    device: torch.device
    memory: MemoryLimit
    activity: Activity = field(default_factory=Activity)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    ops: dict[int, _Op] = field(default_factory=dict)
    error: ErrorBody | None = None
    programs: Programs = field(default_factory=Programs)
    elastic: Elastic | None = None
    arrivals: Arrivals = field(default_factory=Arrivals)
    """Tensors other workers of the lease sent for RECV records."""
    peers: PeerLinks | None = None
    """Connections to the lease's other workers, for SEND records (set by the server)."""
    collectives: Collectives | None = None
    """torch.distributed process groups among the lease's workers, for DIST records (set by
    the server)."""

    def __post_init__(self) -> None:
        zero_fill_cpu_allocations()  # a tenant never gets memory no kernel of its wrote
        quiet_cudnn_rnn_warning()
        self._host = torch.device("cpu")
        self.streams = Streams(self.device)
        """The client's torch.cuda streams and events (STREAM, EVENT, QUERY)."""
        self.activity.watch_memory(self.memory.held_bytes)
        self._admission = Admission(self.memory) if self.memory.counts_storages else None
        """Charges each op's outputs before it runs, where no allocator holds the limit."""
        self.arrivals.bind(self.memory.reserve_host)
        self._staging = (
            PinnedStaging(self.memory.reserve_host) if self.device.type == "cuda" else None
        )
        """Where a CUDA worker's socket puts land (page-locked: their copies are async)."""
        self._registered: RegisteredRegion | None = None
        """The client's shared pinned region as registered for DMA (a CUDA worker's)."""
        self._handlers: dict[int, Callable[[list[Any], Link], None]] = {
            Rec.DEF: self._def,
            Rec.OP: self._op,
            Rec.PUT: self._put,
            Rec.READ: self._read,
            Rec.CALL: self._call,
            Rec.FREE: self._free,
            Rec.SYNC: self._sync,
            Rec.SEED: self._seed,
            Rec.STATS: self._stats,
            Rec.RNG_STATE: self._rng_state,
            Rec.SET_RNG_STATE: self._set_rng_state,
            Rec.PROGRAM: self._program,
            Rec.RUN: self._run,
            Rec.DROP_PROGRAM: self._drop_program,
            Rec.SWAP: self._swap,
            Rec.SEND: self._send,
            Rec.RECV: self._recv,
            Rec.RESUME: self._resume,
            Rec.FLAGS: self._flags,
            Rec.STREAM: self._stream,
            Rec.EVENT: self._event,
            Rec.QUERY: self._query,
            Rec.DIST: self._dist,
            Rec.STORAGE: self._storage,
        }
        self._loop = None if _runloop is None else _new_loop(self)

    # ---- decoding ------------------------------------------------------------------------

    def ext_hook(self, code: int, data: bytes) -> object:
        """Resolves handles while a record is decoded, i.e. after the records before it ran."""
        if code == Ext.TENSOR:
            handle = int.from_bytes(data, "big")
            tensor = self.tensors.get(handle)
            return Missing(handle) if tensor is None else tensor
        if code == Ext.DTYPE:
            return dtype_from_name(data.decode())
        if code == Ext.DEVICE:
            return self._host if data == b"cpu" else self.device
        if code == Ext.LITERAL:
            return literal_from_ext(data)
        if code == Ext.LAYOUT:
            return _lookup(LAYOUTS, data, "layout")
        if code == Ext.MEMORY_FORMAT:
            return _lookup(MEMORY_FORMATS, data, "memory format")
        if code == Ext.COMPLEX:
            return complex_from_ext(data)
        raise ProtocolError(f"unknown extension type {code}")

    # ---- the stream ----------------------------------------------------------------------

    def run_frame(self, body: bytes, link: Link) -> None:
        """Run a BATCH frame's records in order: the compiled loop (`_runloop.c`) where it is
        built, else msgpack's decoding and `_run_record`, which the loop matches record for
        record."""
        started, started_cpu = time.perf_counter(), time.thread_time()
        if self._loop is None:
            records = Frame(body, 0).objects(self.ext_hook)
            _check_batch_head(next(records, None))
            count = 0
            for record in records:
                self._run_record(record, link)
                count += 1  # noqa: SIM113 - records is a generator: no len() to take
        else:
            head, offset = self._loop.head(body)
            _check_batch_head(head)
            count = self._loop.run(body, offset, link)
        self.activity.ran(
            count,
            busy_s=time.perf_counter() - started,
            busy_cpu_s=time.thread_time() - started_cpu,
        )

    def _run_record(self, record: Any, link: Link) -> None:
        # FREE is half of a training step's records: no handler lookup for it.
        if type(record) is list and len(record) == 2 and record[0] == _FREE:
            try:
                self._drop(record[1])
            except TypeError as exc:
                raise ProtocolError(f"malformed record FREE: {exc}") from exc
            return
        if not isinstance(record, list) or not record or not isinstance(record[0], int):
            raise ProtocolError("a record must be a list starting with its type")
        handler = self._handlers.get(record[0])
        if handler is None:
            raise ProtocolError(f"unknown record type {record[0]}")
        try:
            handler(record, link)
        except _MALFORMED as exc:
            raise ProtocolError(f"malformed record {Rec(record[0]).name}: {exc}") from exc

    def reset(self) -> None:
        """Forget everything the previous client left (it disconnected)."""
        self.arrivals.clear()
        if self.collectives is not None:
            self.collectives.clear()
        if self.peers is not None:
            self.peers.close()
        self.tensors.clear()
        self.ops.clear()
        self.programs.clear()
        self.error = None
        if self._staging is not None:
            self._staging.close()
        if self._registered is not None:
            self._registered.close()
            self._registered = None
        self.memory.reset()
        self.activity.memory_held_bytes = self.memory.held_bytes()
        self.streams.reset()
        flags.reset()

    # ---- records -------------------------------------------------------------------------

    def _def(self, rec: list[Any], link: Link) -> None:
        _, op_id, name = rec
        if not isinstance(op_id, int) or not isinstance(name, str):
            raise ProtocolError("DEF needs an op id and a name")
        self.ops[op_id] = self._keep_geometry(self._resolve_op(name, self._admission))

    def _keep_geometry(self, op: _Op) -> _Op:
        """An op that may resize a tensor it writes puts that tensor's sizes, strides and
        offset back when it fails (`gpupool.worker.geometry`): outermost, so whatever inside
        raised (the argument guard, the check, the admission, the kernel), the tensor is as it
        was before the op."""
        if op.fn is not None and op.call is not None:
            op.call = keeping_geometry(op.fn, op.call)
        return op

    def _resolve_op(self, name: str, admission: Admission | None = None) -> _Op:
        """The op a DEF names, as the op policy decides it: refused ops keep their reason (the
        client hears it when it runs them), checked ops run behind their check.

        With `admission` (where the memory limit counts storages), the op's outputs and in-place
        growth are charged before it runs (`gpupool.worker.admission`): it runs only if they
        fit. What runs, outermost first: the enum arguments' types (`opchecks.argument_guard`), the
        op's check, the admission's meta call, the kernel. The meta call comes after the check:
        meta kernels trust what the real ones trust (`_foreach_copy.out`'s segfaulted on lists
        of three lengths), and after the types (a bare-int dtype crashed them too)."""
        namespace = name.partition("::")[0]
        if namespace not in ALLOWED_NAMESPACES:
            return _Op(name, None, f"{name} is not allowed on a gpupool worker")
        decided = ruling(name)
        if decided.decision is Decision.REFUSE:
            return _Op(name, None, f"{name} is not allowed on a gpupool worker: {decided.detail}")
        fn: Any = SHIMS.get(name)
        if fn is None:
            try:
                fn = op_overload(name)
            except (AttributeError, RuntimeError, ProtocolError):
                fn = None
            if not isinstance(fn, torch._ops.OpOverload):
                return _Op(
                    name, None, f"{name} is unknown to the worker's torch {torch.__version__}"
                )
        op = _Op(name, fn)
        call = op.call or fn
        if admission is not None:
            call = admission.wrap(fn, call)
        if decided.decision is Decision.CHECK:
            check = CHECKS.get(decided.detail)
            if check is None:
                return _Op(name, None, f"{name}: the op policy names an unknown check")
            call = guard(name, check, fn, call)
            op.check = decided.detail
        op.call = argument_guard(name, fn, call)
        return op

    def _op(self, rec: list[Any], link: Link) -> None:
        _, op_id, args, kwargs, outs = rec
        if self.error is not None:
            return
        op = self.ops[op_id]
        try:
            call = op.call
            if call is None:
                raise Unsupported(op.problem)
            result = call(*args, **kwargs) if kwargs else call(*args)
        except Exception as exc:
            self._op_failed(op, args, kwargs, outs, exc)
            return
        self._op_store(op, args, kwargs, outs, result)

    def _op_failed(
        self, op: _Op, args: list[Any], kwargs: dict[str, Any], outs: Any, exc: Exception
    ) -> None:
        """An op raised: within the lease's limit but not the GPU's free memory
        (oversubscription), others give way and it runs again (the allocation failed before its
        kernel); any other error becomes the stream's sticky error."""
        try:
            again = isinstance(exc, torch.OutOfMemoryError) and self.memory.make_room(exc)
            if not again:
                raise exc
            result = self._invoke(op, args, kwargs)
        except Exception as failed:
            self._fail(failed, op.name, args, kwargs)
            return
        self._op_store(op, args, kwargs, outs, result)

    def _op_store(
        self, op: _Op, args: list[Any], kwargs: dict[str, Any], outs: Any, result: Any
    ) -> None:
        """Put an op's outputs in the handle table under the handles the client chose."""
        if not outs:
            return
        try:
            if len(outs) == 1 and type(result) is torch.Tensor and outs[0] is not None:
                self._store_one(result, outs[0])  # most ops: one new tensor
            else:
                self._store(result, outs)
        except Exception as exc:
            self._fail(exc, op.name, args, kwargs)

    def _invoke(self, op: _Op, args: list[Any], kwargs: dict[str, Any] | None) -> Any:
        call = op.call
        if call is None:
            raise Unsupported(op.problem)
        return call(*args, **kwargs) if kwargs else call(*args)

    def _store_one(self, value: torch.Tensor, handle: int) -> None:
        tensors = self.tensors
        if handle in tensors:
            self._drop(handle)
        tensors[handle] = value
        try:
            self.memory.charge([value])
        except LimitExceeded:
            tensors.pop(handle, None)
            raise

    def _store(self, result: Any, outs: list[int | None]) -> None:
        flat = [result] if type(result) is torch.Tensor else list(_flatten(result))
        if len(flat) != len(outs):
            raise RuntimeError(
                f"the op returned {len(flat)} values where the client expected {len(outs)}"
            )
        stored: list[torch.Tensor] = []
        for value, handle in zip(flat, outs, strict=True):
            if handle is None:
                continue
            if value is None:
                # An optional output the op left undefined (`_native_multi_head_attention`
                # without weights, the fused attentions' unused statistics): C++ gives an
                # undefined tensor where the client's meta kernel made an empty one.
                value = torch.empty(0, device=self.device)
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(
                    f"the op returned {type(value).__name__} where a tensor was expected"
                )
            self._drop(handle)
            self.tensors[handle] = value
            stored.append(value)
        try:
            self.memory.charge(stored)
        except LimitExceeded:
            for handle in outs:
                if handle is not None:
                    self.tensors.pop(handle, None)
            raise

    def _drop(self, handle: int) -> None:
        old = self.tensors.pop(handle, None)
        if old is not None:
            self.memory.release(old)

    def _put(self, rec: list[Any], link: Link) -> None:
        _, handle, dtype, shape, payload, nbytes, shm_offset, *where = rec
        dtype = dtype_from_name(dtype)
        target = self.tensors.get(handle)
        _check_put_size(dtype, shape, nbytes, target)
        lanes = where == [PUT_LANES]
        if where and not lanes:
            self._put_from_region(handle, dtype, shape, nbytes, shm_offset, where, link)
            return
        if lanes and (payload is not None or shm_offset is not None):
            raise ProtocolError("a PUT over lanes carries its bytes in no other place")
        if payload is None and shm_offset is None:
            # The bytes follow in PUT frames; they must be consumed even when the put is skipped.
            if target is None or self.error is not None:
                # Nowhere to copy them: drop them as they come rather than hold a buffer of
                # whatever size the record claims (a hostile one claims terabytes).
                link.skip_put(handle, nbytes, lanes)
                if self.error is None:
                    self._fail(_put_without_target(handle), "copy_ (host to device)", [], None)
                return
            if _fills_in_place(target, dtype, shape):
                # The bytes are the tensor's own, in its layout: read them straight into its
                # memory, with no staging buffer to charge.
                link.read_put(handle, host_bytes(target), lanes)
                return
            if (
                self._staging is not None
                and target.is_cuda
                and self._put_pinned(handle, dtype, shape, nbytes, link, lanes)
            ):
                return
            try:
                staging = self.memory.reserve_host(nbytes, "a put's staging buffer")
            except LimitExceeded as exc:
                link.skip_put(handle, nbytes, lanes)
                self._fail(exc, "copy_ (host to device)", [], None)
                return
            with staging:
                buffer = bytearray(nbytes)
                link.read_put(handle, memoryview(buffer), lanes)
                self._copy_in(handle, buffer, dtype, shape, non_blocking=False)
            return
        if payload is None:
            if link.client_arena is None:
                raise ProtocolError("PUT from shared memory without an arena")
            payload = link.client_arena.view(shm_offset, nbytes)
        if self.error is not None:
            return
        # From the pinned arena the copy runs on the stream; the client reuses that memory
        # only after a read or sync, which wait for the stream.
        self._copy_in(handle, payload, dtype, shape, link.pinned and shm_offset is not None)

    def _put_from_region(
        self, handle: int, dtype: torch.dtype, shape: list[int], nbytes: int, offset: Any,
        where: list[Any], link: Link,
    ) -> None:  # fmt: skip
        """A put whose bytes are the client's pinned tensor itself, in the shared region: one
        DMA copy on the stream where the region is registered (the client reuses that memory
        only once a read or sync has shown the stream past this copy)."""
        region = link.pinned_region
        if where != [PINNED_REGION] or region is None:
            raise ProtocolError("PUT from a pinned region the client did not share")
        if not isinstance(offset, int):
            raise ProtocolError("PUT from the pinned region without an offset")
        payload = region.view(offset, nbytes)
        if self.error is not None:
            return
        registered = False
        if self.device.type == "cuda":
            if self._registered is None or self._registered.region is not region:
                self._registered = RegisteredRegion(region, self.memory.reserve_host)
            registered = self._registered.ready(offset, nbytes)
            pieces = granule_pieces(offset, nbytes)
            if len(pieces) > 1 and (registered or self._registered.touches(offset, nbytes)):
                self._copy_in_pieces(handle, payload, dtype, shape, pieces, registered)
                return
        self._copy_in(handle, payload, dtype, shape, non_blocking=registered)

    def _copy_in_pieces(
        self, handle: int, payload: memoryview, dtype: torch.dtype, shape: list[int],
        pieces: list[tuple[int, int]], non_blocking: bool,
    ) -> None:  # fmt: skip
        """A put whose bytes span registered granules: one copy per granule (`granule_pieces`),
        into the target's own bytes where they are the put's layout, else into a device buffer
        the target then copies from (on the stream: the buffer is freed behind it)."""
        try:
            source = tensor_from_bytes(payload, dtype, shape).reshape(-1).view(torch.uint8)
            target = self.tensors.get(handle)
            if target is None:
                raise RuntimeError(f"copy into tensor {handle}, which the worker does not hold")
            direct = (
                target.dtype == dtype
                and list(target.shape) == list(shape)
                and target.is_contiguous()
                and target.numel() > 0
            )
            into = (
                target.reshape(-1).view(torch.uint8)
                if direct
                else torch.empty(source.numel(), dtype=torch.uint8, device=target.device)
            )
            for start, length in pieces:
                into[start : start + length].copy_(
                    source[start : start + length], non_blocking=non_blocking
                )
            if not direct:
                target.copy_(into.view(dtype).reshape(shape))
        except Exception as exc:
            self._fail(exc, "copy_ (host to device)", [], None)

    def _put_pinned(
        self, handle: int, dtype: torch.dtype, shape: list[int], nbytes: int, link: Link,
        lanes: bool,
    ) -> bool:  # fmt: skip
        """A socket put through a page-locked staging buffer, its copy queued on the stream
        (the worker goes on issuing ops). False where the buffers cannot be registered (the
        pageable path still works); a lease whose host allowance cannot hold the buffer gets
        its out-of-memory error, as with the pageable buffer."""
        assert self._staging is not None
        try:
            buffer = self._staging.take(nbytes)
        except LimitExceeded as exc:
            link.skip_put(handle, nbytes, lanes)
            self._fail(exc, "copy_ (host to device)", [], None)
            return True
        except Exception as exc:  # registration refused: pageable copies still work
            log.warning("page-locked staging is off: %s", first_line(exc))
            self._staging = None
            return False
        data = host_bytes(buffer)
        link.read_put(handle, data, lanes)
        self._copy_in(handle, data, dtype, shape, non_blocking=True)
        self._staging.copied()
        return True

    def _copy_in(
        self, handle: int, payload: Any, dtype: torch.dtype, shape: list[int], non_blocking: bool
    ) -> None:
        try:
            source = tensor_from_bytes(payload, dtype, shape)
            target = self.tensors.get(handle)
            if target is None:
                raise RuntimeError(f"copy into tensor {handle}, which the worker does not hold")
            target.copy_(source, non_blocking=non_blocking)
        except Exception as exc:
            self._fail(exc, "copy_ (host to device)", [], None)

    def _read(self, rec: list[Any], link: Link) -> None:
        _, req, tensor = rec
        if self._report_error(req, link):
            return
        if isinstance(tensor, Missing):
            link.reply([Kind.ERROR, req, _missing_error(tensor).to_wire()])
            return
        if not isinstance(tensor, torch.Tensor):
            raise ProtocolError(f"READ of {type(tensor).__name__}, not of a tensor handle")
        try:
            dtype = _movable_dtype(tensor)
        except Unsupported as exc:
            # An op made it (quint8, complex32, nested, sparse): the client's read of it is
            # that op's error, not a broken connection.
            self._fail(exc, "read", [tensor], None)
            self._report_error(req, link)
            return
        head: list[Any] = [
            Kind.DATA,
            req,
            dtype,
            list(tensor.shape),
            0,
            0,
            0,
        ]
        # offset, total, and the bytes of this chunk in the shared arena at offset (0: the
        # chunk is the frame's tail).
        total = tensor.numel() * tensor.element_size()
        arena = link.worker_arena
        staging = NO_RESERVATION
        try:
            if arena is not None and SHM_READ_MIN_BYTES < total <= arena.size:
                # One copy, device (or worker memory) straight into the shared arena.
                into = torch.frombuffer(arena.map, dtype=torch.uint8, count=total)
                head[5] = total
                if not self._read_arena_chunked(head, tensor, into, link):
                    into.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
                    head[6] = total
                    link.reply(head)
                return
            if (
                STAGED_READS
                and self._staging is not None
                and tensor.is_cuda
                and total > CHUNK_BYTES
                and self._read_pinned(head, tensor, total, link)
            ):
                return
            # A copy to host memory (from the device, or of a view that is not one block: an
            # expanded tensor's copy may be far larger than its storage) is charged first.
            if not (tensor.is_cpu and tensor.is_contiguous()):
                staging = self.memory.reserve_host(total, "a read's host copy")
            host = tensor.detach().contiguous().to(self._host)
        except DataPlaneError:
            raise  # the connection broke while chunks were going out: the server closes it
        except Exception as exc:
            staging.release()
            self._fail(exc, "read", [tensor], None)
            self._report_error(req, link)
            return
        with staging:
            self._send_tensor(head, host, link)
            del host

    def _read_arena_chunked(
        self, head: list[Any], tensor: torch.Tensor, into: torch.Tensor, link: Link
    ) -> bool:
        """A read of a contiguous tensor into the shared arena in chunks, each announced as
        soon as it is there: the client copies chunk i out while chunk i+1 is copied in (a
        CUDA worker queues every chunk's DMA at once and announces each as its event
        completes). False where the tensor is not one plain block (one whole copy then)."""
        source = tensor.detach()
        if not source.is_contiguous() or source.is_conj() or source.is_neg():
            return False
        flat = source.reshape(-1).view(torch.uint8)
        total = into.numel()
        starts = range(0, total, CHUNK_BYTES)
        if STAGED_READS and tensor.is_cuda and link.pinned:
            events = []
            for start in starts:
                end = min(start + CHUNK_BYTES, total)
                into[start:end].copy_(flat[start:end], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                events.append(done)
            for start, done in zip(starts, events, strict=True):
                done.synchronize()
                head[4], head[6] = start, min(CHUNK_BYTES, total - start)
                link.reply(head)
            return True
        for start in starts:
            end = min(start + CHUNK_BYTES, total)
            into[start:end].copy_(flat[start:end])
            head[4], head[6] = start, end - start
            link.reply(head)
        return True

    def _read_pinned(self, head: list[Any], tensor: torch.Tensor, total: int, link: Link) -> bool:
        """A large read of a CUDA tensor streamed through the two page-locked staging
        buffers: the asynchronous copy of chunk i+1 runs while chunk i is sent, instead of one
        pageable copy of the whole tensor into fresh memory before the first byte leaves.
        False (nothing sent) where the buffers cannot be had: the pageable path answers."""
        assert self._staging is not None
        flat = tensor.detach()
        if flat.is_conj() or flat.is_neg():
            return False  # math bits travel as they are: the plain path keeps them
        flat = flat.contiguous().reshape(-1).view(torch.uint8)
        starts = range(0, total, CHUNK_BYTES)
        pending: list[tuple[torch.Tensor, torch.cuda.Event, int]] = []
        head[5] = total
        for i, start in enumerate(starts):
            size = min(CHUNK_BYTES, total - start)
            try:
                # Only the first two takes can allocate (each later one reuses the buffer of
                # two chunks before, already sent, of the full chunk size): a refusal comes
                # before any byte went out.
                buffer = self._staging.take(size)
            except Exception as exc:
                if i >= 2:
                    raise
                for _, queued, _ in pending:
                    queued.synchronize()  # no copy may still write a buffer a put reuses
                if not isinstance(exc, LimitExceeded):
                    log.warning("page-locked staging is off: %s", first_line(exc))
                    self._staging = None
                return False
            buffer.copy_(flat[start : start + size], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            pending.append((buffer, done, start))
            if len(pending) == 2:
                self._send_staged(head, pending.pop(0), link)
        for chunk in pending:
            self._send_staged(head, chunk, link)
        return True

    @staticmethod
    def _send_staged(
        head: list[Any], chunk: tuple[torch.Tensor, torch.cuda.Event, int], link: Link
    ) -> None:
        buffer, done, start = chunk
        done.synchronize()
        head[4] = start
        link.reply(head, host_bytes(buffer))

    def _send_tensor(self, head: list[Any], host: torch.Tensor, link: Link) -> None:
        data = host_bytes(host)
        total = head[5] = len(data)
        if total <= CHUNK_BYTES:
            link.reply(head, data)
            return
        for offset in range(0, total, CHUNK_BYTES):
            head[4] = offset
            link.reply(head, data[offset : offset + CHUNK_BYTES])

    def _call(self, rec: list[Any], link: Link) -> None:
        """An op whose outputs the client cannot infer (data-dependent shapes, no meta kernel)."""
        _, req, op_id, args, kwargs, handle_base = rec
        if self._report_error(req, link):
            return
        op = self.ops[op_id]
        try:
            result = self._invoke(op, args, kwargs)
            flat = list(_flatten(result))
            outs = [
                handle_base + i if isinstance(v, torch.Tensor) else None for i, v in enumerate(flat)
            ]
            # Described before it is stored: an output the wire cannot describe (a nested or
            # sparse tensor, a dtype it cannot carry) fails the op, not the stream.
            described = _describe(result, iter(range(handle_base, handle_base + len(flat))))
            self._store(result, outs)
        except Exception as exc:
            self._fail(exc, op.name, args, kwargs)
            self._report_error(req, link)
            return
        link.reply([Kind.RESULT, req, described])

    # ---- captured steps (gpupool.worker.program) -------------------------------------------

    def _program(self, rec: list[Any], link: Link) -> None:
        _, program_id, body = rec
        self.programs.define(program_id, body, self)

    def _run(self, rec: list[Any], link: Link) -> None:
        _, program_id, inputs, outs = rec
        program = self.programs.get(program_id)
        if not isinstance(inputs, list) or not isinstance(outs, list):
            raise ProtocolError("RUN needs a list of inputs and a list of output handles")
        if len(outs) != len(program.outputs) or not all(isinstance(h, int) for h in outs):
            raise ProtocolError(
                f"RUN of program {program_id} names {len(outs)} outputs, it has "
                f"{len(program.outputs)}"
            )
        if self.error is not None:
            return
        name = f"captured step (program {program_id})"
        try:
            if any(isinstance(t, Missing) for t in inputs):
                raise RuntimeError("an input is missing")
            program.check_inputs(inputs)
            slots = program.run(inputs, self)
            if outs:
                self._store(program.output_tensors(slots, inputs), outs)
            if program.escapes:
                self._store(
                    [slots[slot] for slot, _ in program.escapes],
                    [handle for _, handle in program.escapes],
                )
        except ProtocolError:
            raise
        except Exception as exc:
            if program.failed_step is not None:
                name = f"{name} at {program.failed_step}"
            self._fail(exc, name, inputs, None)
        self.activity.ran(len(program.steps))

    def _drop_program(self, rec: list[Any], link: Link) -> None:
        self.programs.drop(rec[1])

    def _send(self, rec: list[Any], link: Link) -> None:
        _, xid, tensor, address = rec
        if not isinstance(xid, int) or not isinstance(address, str):
            raise ProtocolError("SEND needs a transfer id and an address")
        if self.peers is None:
            raise ProtocolError("this worker does not send to other workers")
        if self.error is not None:
            # An earlier op failed: the receiver must not wait for its timeout.
            self.peers.send_failure(address, xid, f"an earlier op failed: {self.error.message}")
            return
        try:
            if not isinstance(tensor, torch.Tensor):
                raise RuntimeError("copy to another device: the source is not a tensor")
            copies = tensor.device.type != "cpu" or not tensor.is_contiguous()
            nbytes = tensor.numel() * tensor.element_size() if copies else 0
            # The host copy is memory too: charged before it exists, freed once it is sent.
            with self.memory.reserve_host(nbytes, "a send's host copy"):
                host = tensor.detach().to(self._host).contiguous()
                self.peers.send(address, xid, host)
                del host
        except PeerNotNamed as exc:  # nobody to tell: the address is no worker of the lease
            self._fail(exc, "copy to another device", [tensor], None)
        except Exception as exc:
            self.peers.send_failure(address, xid, first_line(exc))
            self._fail(exc, "copy to another device", [tensor], None)

    def _recv(self, rec: list[Any], link: Link) -> None:
        _, xid, handle, dtype, into = rec
        if not isinstance(xid, int) or not isinstance(handle, int) or not isinstance(into, bool):
            raise ProtocolError("RECV needs a transfer id, a handle and whether to copy into it")
        if self.error is not None:  # the client learns of the earlier error at its next read
            self.arrivals.abandon(xid)
            return
        try:
            host, arrived = self.arrivals.take_charged(xid)
        except (TransferFailed, LimitExceeded) as exc:
            self._fail(exc, "copy from another device", [], None)
            return
        # The arrived bytes stay charged (as the transfer's buffer) until they are stored as
        # the tensor or copied into one.
        with arrived:
            try:
                if into:
                    target = self.tensors.get(handle)
                    if target is None:
                        raise RuntimeError(
                            f"copy into tensor {handle}, which the worker does not hold"
                        )
                    target.copy_(host)
                else:
                    cast = dtype if isinstance(dtype, torch.dtype) else None
                    with self._conversion(host, cast):
                        value = host.to(self.device, dtype=cast)
                    del host  # the buffer is gone now, or is `value` itself
                    arrived.release()
                    self._store_one(value, handle)
            except Exception as exc:
                self._fail(exc, "copy from another device", [], None)

    def _conversion(self, host: torch.Tensor, dtype: torch.dtype | None) -> Reservation:
        """What `host.to(self.device, dtype)` allocates in counted memory, charged first (a
        CUDA worker's device copy is held by its allocator)."""
        if self.device.type != "cpu" or dtype is None or dtype == host.dtype:
            return NO_RESERVATION
        return self.memory.reserve(host.numel() * dtype.itemsize)

    def _free(self, rec: list[Any], link: Link) -> None:
        self._drop(rec[1])

    def _sync(self, rec: list[Any], link: Link) -> None:
        _, req = rec
        try:
            self.streams.synchronize()  # every stream of the client's, as torch.cuda does
        except Exception as exc:
            self._fail(exc, "synchronize", [], None)
        if self._report_error(req, link):
            return
        link.reply([Kind.RESULT, req, self.stats()])

    def _stats(self, rec: list[Any], link: Link) -> None:
        link.reply([Kind.RESULT, rec[1], self.stats()])

    def stats(self) -> dict[str, Any]:
        return {
            "memory_held_bytes": self.memory.held_bytes(),
            "memory_peak_bytes": self.memory.peak_bytes(),
            "memory_limit_bytes": self.memory.limit_bytes,
            "host_memory_held_bytes": self.memory.host_held_bytes(),
            "host_memory_limit_bytes": self.memory.host_limit_bytes,
            "tensors": len(self.tensors),
            "ops_total": self.activity.ops_total,
            "busy_s": self.activity.busy_s,
            "busy_cpu_s": self.activity.busy_cpu_s,
            "programs": self.programs.describe(),
            "flags": flags.current(),
            "dist": {} if self.collectives is None else self.collectives.describe(),
        }

    def _seed(self, rec: list[Any], link: Link) -> None:
        seed = int(rec[1])
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
            DROPOUT.generator_seeded(self.device)  # as the generator's own flag for ATen
        else:
            torch.manual_seed(seed)

    def _rng_state(self, rec: list[Any], link: Link) -> None:
        if self._report_error(rec[1], link):
            return
        if self.device.type == "cuda":
            state = torch.cuda.get_rng_state(self.device)
        else:
            state = torch.get_rng_state()
        link.reply([Kind.RESULT, rec[1], bytes(host_bytes(state))])

    def _set_rng_state(self, rec: list[Any], link: Link) -> None:
        if not isinstance(rec[1], bytes):
            # bytearray(n) of an int would allocate n bytes: a generator state is bytes.
            raise ProtocolError("SET_RNG_STATE needs the state as bytes")
        if self.error is not None:
            return
        state = torch.frombuffer(bytearray(rec[1]), dtype=torch.uint8)
        try:
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(state, self.device)
                DROPOUT.generator_seeded(self.device)
            else:
                torch.set_rng_state(state)
        except Exception as exc:
            self._fail(exc, "set_rng_state", [], None)

    # ---- global switches, streams and events (gpupool.worker.flags, gpupool.worker.streams) ----

    def _flags(self, rec: list[Any], link: Link) -> None:
        _, values = rec
        checked = flags.validate(values)
        if self.error is not None:
            return
        try:
            flags.apply(checked)
        except Exception as exc:
            self._fail(exc, "torch flags", [], None)

    def _stream(self, rec: list[Any], link: Link) -> None:
        _, action, stream_id, arg = rec
        if self.error is not None and action != "free":
            return
        try:
            self.streams.stream_record(action, stream_id, arg)
        except ProtocolError:
            raise
        except Exception as exc:
            self._fail(exc, f"stream {action}", [arg], None)

    def _event(self, rec: list[Any], link: Link) -> None:
        _, action, event_id, stream_id, timing = rec
        if self.error is not None and action != "free":
            return
        try:
            self.streams.event_record(action, event_id, stream_id, timing)
        except ProtocolError:
            raise
        except Exception as exc:
            self._fail(exc, f"event {action}", [], None)

    def _query(self, rec: list[Any], link: Link) -> None:
        _, req, what, a, b = rec
        if self._report_error(req, link):
            return
        try:
            if what == "reset_peak":
                self.memory.reset_peak()
                answer = None
            else:
                answer = self.streams.query(what, a, b)
        except ProtocolError:
            raise
        except StreamError as exc:
            link.reply([Kind.ERROR, req, ErrorBody(ErrorKind.OP, str(exc), None).to_wire()])
            return
        except Exception as exc:
            self._fail(exc, str(what), [], None)
            self._report_error(req, link)
            return
        link.reply([Kind.RESULT, req, answer])

    def _dist(self, rec: list[Any], link: Link) -> None:
        _, action, group, body = rec
        if not isinstance(action, str) or not isinstance(group, str) or not isinstance(body, dict):
            raise ProtocolError("DIST needs an action, a group and a body")
        if self.collectives is None:
            raise ProtocolError("this worker takes no process groups")
        if action == "destroy":
            self.collectives.destroy(group)
            return
        if action != "init" and action not in COLLECTIVES:
            raise ProtocolError(f"unknown DIST action {action!r:.40}")
        if self.error is not None:
            # This rank cannot take part: leaving the group fails the other ranks' collective
            # at once (their connections to it close), rather than after its timeout.
            self.collectives.destroy(group)
            return
        try:
            if action == "init":
                self.collectives.init(group, body)
            else:
                self.collectives.run(action, group, body)
        except ProtocolError:
            raise
        except Exception as exc:
            self.collectives.destroy(group)
            self._fail(exc, f"torch.distributed {action}", [], None)

    def _storage(self, rec: list[Any], link: Link) -> None:
        _, tensor, nbytes = rec
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ProtocolError("STORAGE needs a size in bytes")
        if self.error is not None:
            return
        try:
            if not isinstance(tensor, torch.Tensor):
                raise RuntimeError("resize of a storage the worker does not hold")
            storage = tensor.untyped_storage()
            grows = nbytes > storage.nbytes()
            span = (
                tensor.storage_offset()
                + 1
                + sum(
                    (size - 1) * stride
                    for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
                )
            )
            if grows and nbytes > span * tensor.element_size():
                raise ValueError(f"a storage grows to what its tensor spans, not {nbytes} bytes")
            # A CPU worker's storages are counted: a new size is charged before it exists.
            with self.memory.reserve(nbytes - storage.nbytes() if grows else 0):
                storage.resize_(nbytes)
            self.memory.recount([tensor])
        except Exception as exc:
            self._fail(exc, "storage resize_", [tensor], None)

    def _swap(self, rec: list[Any], link: Link) -> None:
        if self.elastic is None:
            raise ProtocolError("this worker does not swap")
        self.elastic.swap(int(rec[1]), link)

    def _resume(self, rec: list[Any], link: Link) -> None:
        if self.elastic is None:
            raise ProtocolError("this worker does not hand over its state")
        self.elastic.resume(int(rec[1]), link)

    # ---- the state as a whole (swap-out, restore, migration) -------------------------------

    def client_state(self) -> ClientState:
        """The client's state where it is (no copy): what a successor on the same host opens
        or a stream reads from, while this worker keeps serving if the handoff fails."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        state = snapshot(self.tensors)
        state.ops = {op_id: op.name for op_id, op in self.ops.items()}
        # Keep the generator state alive while its bytes are copied out of it.
        rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        rng = torch.get_rng_state() if rng is None else rng
        state.rng = bytes(host_bytes(rng))
        state.error = None if self.error is None else self.error.to_wire()
        return state

    def export_state(self) -> ClientState:
        """Move everything the client left here to host memory and free the device memory."""
        state = self.client_state()
        # The host copies of device storages are charged to the lease's host allowance before
        # they are made: a swap that cannot fit is refused (LimitExceeded) with the tensors
        # still on the device, as they were.
        on_device = sum(flat.numel() for flat in state.storages if not flat.is_cpu)
        with self.memory.reserve_host(on_device, "swapping the tensors to host memory"):
            state = to_host(state)
        self.drop_state()
        if self.device.type != "cpu":
            # Swapped, the state is the lease's host memory (a CPU worker's state stays where
            # it was and frees its simulated GPU). It fitted a moment ago; a transfer that
            # arrived since may have taken the room, and the state must be kept regardless.
            with contextlib.suppress(LimitExceeded):
                self.memory.charge(state.storages)
        return state

    def drop_state(self) -> None:
        """Free the client's tensors: they live on elsewhere (host memory or a successor)."""
        # Captured programs (CUDA graphs) point at the device memory that is about to go: they
        # are dropped, and the client captures its step again after the restore.
        self.programs.clear()
        self.tensors.clear()
        self.memory.reset()
        self.activity.memory_held_bytes = self.memory.held_bytes()

    def reserve_state(self, nbytes: int) -> Reservation:
        """Charge a state of `nbytes` that a predecessor announces, before it is allocated here
        (a successor worker); LimitExceeded if it cannot fit the lease's limit."""
        limit = self.memory.limit_bytes
        if self.memory.counts_storages:  # its host memory is its device memory
            return self.memory.reserve_host(nbytes, "the state handed over")
        if limit is not None and nbytes > limit:
            # The allocator would refuse it too, storage by storage, after some had moved.
            raise LimitExceeded(
                f"a state of {nbytes / MiB:.1f} MiB does not fit the lease's limit of "
                f"{limit / MiB:.0f} MiB"
            )
        return NO_RESERVATION

    def import_state(self, state: ClientState) -> None:
        """Put a captured state on this worker's device: the client continues where it was."""
        self.tensors = restore(state, self.device)
        self.memory.reset()
        self.memory.charge(list(self.tensors.values()))
        self.ops = {
            op_id: self._keep_geometry(self._resolve_op(name, self._admission))
            for op_id, name in state.ops.items()
        }
        if state.rng is not None:
            rng = torch.frombuffer(bytearray(state.rng), dtype=torch.uint8)
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(rng, self.device)
            else:
                torch.set_rng_state(rng)
        self.error = None if state.error is None else ErrorBody.from_wire(state.error)
        self.activity.memory_held_bytes = self.memory.held_bytes()

    # ---- errors --------------------------------------------------------------------------

    def _fail(self, exc: BaseException, op: str, args: Any, kwargs: Any) -> None:
        if self.error is not None:
            return
        self.error = self._classify(exc, op, args, kwargs)

    def _classify(self, exc: BaseException, op: str, args: Any, kwargs: Any) -> ErrorBody:
        missing = [m for m in _leaves([args, kwargs]) if isinstance(m, Missing)]
        if missing:
            return _missing_error(missing[0], op)
        if is_out_of_memory(exc):
            return ErrorBody(
                ErrorKind.OUT_OF_MEMORY, self._oom_message(op, exc), op, "OutOfMemoryError"
            )
        if isinstance(exc, Unsupported):
            return ErrorBody(ErrorKind.UNSUPPORTED, str(exc), op, "NotImplementedError")
        name = type(exc).__name__
        return ErrorBody(
            ErrorKind.OP, f"{op}: {exc}", op, name if name in _BUILTIN_ERRORS else "RuntimeError"
        )

    def _oom_message(self, op: str, exc: BaseException) -> str:
        limit = self.memory.limit_bytes
        limit_text = "no limit" if limit is None else f"a limit of {limit // MiB} MiB"
        held = self.memory.held_bytes() / MiB
        detail = first_line(exc)
        room = self.memory.room
        refusal = room.take_refusal() if room is not None else None
        why = f"; {refusal}" if refusal else ""
        return (
            f"gpupool lease {self.lease_id} is out of GPU memory ({limit_text}, "
            f"{held:.1f} MiB held) in {op}: {detail}{why}"
        )

    def _report_error(self, req: int, link: Link) -> bool:
        """Reads are where streamed errors surface: report the first one, then start afresh."""
        if self.error is None:
            return False
        link.reply([Kind.ERROR, req, self.error.to_wire()])
        self.error = None
        return True


def _check_put_size(dtype: torch.dtype, shape: Any, nbytes: Any, target: Any) -> None:
    """Before the worker allocates anything for a put: its size must be what its dtype and
    shape say, and no more elements than the tensor it is copied into."""
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ProtocolError(f"PUT with a bad shape {shape!r}")
    numel = 1
    for size in shape:
        numel *= size
    if nbytes != numel * dtype.itemsize:
        raise ProtocolError(f"PUT of {nbytes!r} bytes for {shape} {dtype}")
    if isinstance(target, torch.Tensor) and numel > max(target.numel(), 1):
        raise ProtocolError(f"PUT of {numel} elements into a tensor of {target.numel()}")


def _fills_in_place(target: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    """Whether a put's bytes can go straight into `target`'s host memory: same dtype, same
    shape, one contiguous block (what a parameter's first upload is)."""
    return (
        target.is_cpu
        and target.dtype == dtype
        and target.layout == torch.strided
        and list(target.shape) == shape
        and target.is_contiguous()
        and target.numel() > 0
    )


def _put_without_target(handle: int) -> RuntimeError:
    return RuntimeError(f"copy into tensor {handle}, which the worker does not hold")


def _missing_error(missing: Missing, op: str | None = None) -> ErrorBody:
    where = f"{op}: " if op else ""
    return ErrorBody(
        ErrorKind.OP,
        f"{where}tensor {missing.handle} is not on the worker (freed, or its op failed earlier)",
        op,
    )


def _lookup(table: dict[str, Any], data: bytes, what: str) -> Any:
    try:
        return table[data.decode()]
    except (KeyError, UnicodeDecodeError):
        raise ProtocolError(f"unknown {what} {data!r}") from None


def _flatten(value: Any) -> Iterator[Any]:
    if isinstance(value, list | tuple):
        for item in value:
            yield from _flatten(item)
    else:
        yield value


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _describe(value: Any, handles: Iterator[int]) -> Any:
    """Output of a CALL for the client: tensors as [T, handle, dtype, shape, stride, offset],
    a sparse COO tensor as [S, handle, dtype, shape] (its indices and values stay here)."""
    if isinstance(value, torch.Tensor) and value.layout == torch.sparse_coo:
        return ["S", next(handles), dtype_name(value.dtype), list(value.shape)]
    if isinstance(value, torch.Tensor):
        return [
            "T", next(handles), _movable_dtype(value), list(value.shape),
            list(value.stride()), value.storage_offset(),
        ]  # fmt: skip
    if isinstance(value, list | tuple):
        described = []
        for item in value:
            described.append(_describe(item, handles))
        return ["L", described]
    next(handles)  # every flattened leaf used one slot
    if value is None or isinstance(value, bool | int | float | str):
        return ["V", value]
    if isinstance(value, torch.dtype):
        return ["D", dtype_name(value)]
    return ["V", repr(value)]
