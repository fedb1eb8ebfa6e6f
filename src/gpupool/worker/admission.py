"""An op's new memory, charged before it runs: sizes from meta kernels, never from the client.

A worker whose limit counts storages (a CPU worker: no allocator holds its limit) would learn
of an op's outputs only once they exist, so an op whose output does not fit would have taken
the memory before it was refused. Here the op runs first on meta tensors rebuilt from the
worker's own tensors (same sizes, strides, dtypes, storage sizes and offsets, views sharing one
meta storage): what it returns that aliases no input is new memory, and an input storage that
grew is in-place growth (resize_, set_, out= variants that resize their outputs). That much is
charged before the real op runs; it does not run if it cannot fit. Meta kernels cost tens to
hundreds of microseconds, so each op keeps the answer per signature (the inputs' layouts and
the other arguments' values); a training step repeats its signatures, and costs the signature's
walk over the arguments (bench/worker_charge.py).

What meta kernels cannot see (an op with data-dependent outputs, intermediates inside one op)
is held by the worker's process cap (`gpupool.worker.memory.ProcessCap`) and counted once
stored."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from gpupool.worker.memory import NO_RESERVATION, MemoryLimit

MAX_SIGNATURES_PER_OP = 4096
"""A stream of ever new signatures (a hostile one) makes the cache start afresh, not grow."""
_META = torch.device("meta")
_SCALARS = frozenset({int, float, bool, complex, str, type(None)})
MIN_RESERVED_BYTES = 64 << 10
"""Outputs smaller than this are charged when stored, not reserved first: an over-limit one
is then refused a moment after it was allocated, never more than this much past the limit,
and most ops of a step skip the reservation's bookkeeping."""
_UNPREDICTABLE = -1
"""A cached answer: the meta kernel cannot tell (no meta kernel, data-dependent outputs)."""


class _Unsupported(Exception):
    """An argument meta tensors cannot stand for (a sparse tensor, an unknown object)."""


def written_arguments(schema: torch._C.FunctionSchema) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions (for positional arguments) and names of the arguments an op writes."""
    positions: list[int] = []
    names: list[str] = []
    for index, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            names.append(arg.name)
            if not arg.kwarg_only:
                positions.append(index)
    return tuple(positions), tuple(names)


_warming: threading.Thread | None = None
_warmed = False


def warm_up() -> None:
    """Load torch's Python meta kernels in the background, once per process: the first meta
    call imports them (seconds, as long as torch's own import), which would otherwise delay a
    new lease's first op rather than the idle time before its client connects. For a worker
    process only, which leaves by os._exit: an interpreter that finalizes while the thread is
    inside torch aborts. A client's ops wait for it (`warmed`): they never run beside it."""
    global _warming
    if _warming is None and not _warmed:
        _warming = threading.Thread(target=_meta_op, name="gpupool-meta-warm-up", daemon=True)
        _warming.start()


def warm_up_now() -> None:
    """The same, in this thread and done on return: a ready worker loads them before it says
    it is ready (gpupool.worker.standby)."""
    global _warmed
    _meta_op()
    _warmed = True


def warmed() -> None:
    """Return once the meta kernels are loaded: a cold worker's first client waits here rather
    than run its ops while the warm-up thread still imports and registers kernels."""
    if _warming is not None:
        _warming.join()


def _meta_op() -> None:
    torch.empty(1, device=_META).add(1)


class Admission:
    """Wraps ops so that their new memory is charged to `memory` before they run."""

    def __init__(self, memory: MemoryLimit) -> None:
        self.memory = memory
        self.predicted = 0
        """Signatures whose bytes a meta kernel told (cache misses), for the benchmark."""

    def wrap(self, fn: Callable[..., Any], call: Callable[..., Any]) -> Callable[..., Any]:
        """`call` (what runs `fn`), charging its outputs first. `fn` is the op (an OpOverload,
        whose schema says what it writes) or a shim, which writes nothing."""
        schema = getattr(fn, "_schema", None)
        positions, names = written_arguments(schema) if schema is not None else ((), ())
        writes = bool(names)
        cache: dict[Hashable, int] = {}
        memory = self.memory
        meta_call = getattr(fn, "_op", fn)

        def admitted(*args: Any, **kwargs: Any) -> Any:
            if not memory.bounded():  # nothing to refuse: the store counts what it holds
                try:
                    return call(*args, **kwargs) if kwargs else call(*args)
                finally:
                    if writes:
                        memory.recount(written_tensors(args, kwargs, positions, names))
            key = signature(args, kwargs, writes)
            need = _UNPREDICTABLE if key is None else cache.get(key)
            if need is None:
                need = self._predict(meta_call, args, kwargs)
                if len(cache) >= MAX_SIGNATURES_PER_OP:
                    cache.clear()
                cache[key] = need
            reservation = memory.reserve(need) if need >= MIN_RESERVED_BYTES else NO_RESERVATION
            try:
                return call(*args, **kwargs) if kwargs else call(*args)
            finally:
                reservation.release()
                if writes:  # an op that failed halfway may have grown its output already
                    memory.recount(written_tensors(args, kwargs, positions, names))

        return admitted

    def _predict(self, meta_call: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> int:
        """The bytes the op will allocate, from its meta kernel; _UNPREDICTABLE if it cannot."""
        self.predicted += 1
        storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
        try:
            meta_args = [_to_meta(a, storages) for a in args]
            meta_kwargs = {k: _to_meta(v, storages) for k, v in kwargs.items()}
            result = meta_call(*meta_args, **meta_kwargs)
        except Exception:  # no meta kernel, data-dependent sizes, an argument it cannot take
            return _UNPREDICTABLE
        inputs = {meta._cdata for meta, _ in storages.values()}
        new = 0
        seen: set[int] = set()
        for out in _leaves(result):
            if not isinstance(out, torch.Tensor) or out.layout != torch.strided:
                continue
            storage = out.untyped_storage()
            key = storage._cdata
            if key in inputs or key in seen:
                continue
            seen.add(key)
            new += storage.nbytes()
        for meta, nbytes in storages.values():
            new += max(0, meta.nbytes() - nbytes)  # in-place growth of an input's storage
        return new


def signature(args: Any, kwargs: dict[str, Any], storages: bool) -> Hashable | None:
    """What an op's output sizes depend on: every tensor's dtype, sizes and strides (with
    `storages`, for ops that write their arguments, also its offset, storage size and which
    arguments share a storage), every other argument's value. None: not to be predicted."""
    shared: dict[int, int] | None = {} if storages else None
    try:
        described = tuple(_describe(a, shared) for a in args)
        if kwargs:
            return described, tuple((k, _describe(v, shared)) for k, v in kwargs.items())
        return described
    except _Unsupported:
        return None


def _describe(value: Any, shared: dict[int, int] | None) -> Hashable:
    kind = type(value)
    if kind in _SCALARS:
        return (kind, value)  # the type too: 1, 1.0 and True are equal keys, not equal args
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        if shared is None:
            try:
                return (value.dtype, value.shape, value.stride())
            except RuntimeError:  # no strides (sparse, mkldnn): meta tensors cannot stand in
                raise _Unsupported from None
        if value.layout != torch.strided:
            raise _Unsupported
        storage = value.untyped_storage()
        group = shared.setdefault(storage._cdata, len(shared))
        return (
            value.dtype, value.shape, value.stride(), value.storage_offset(),
            storage.nbytes(), group,
        )  # fmt: skip
    if kind is list or kind is tuple:
        return (kind, *[_describe(v, shared) for v in value])
    if isinstance(value, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return value
    raise _Unsupported  # a handle the worker does not hold, or anything else


def _to_meta(value: Any, storages: dict[int, tuple[torch.UntypedStorage, int]]) -> Any:
    """`value` with tensors rebuilt on the meta device over meta storages of the real storages'
    sizes (views of one storage over one meta storage), devices as the meta device."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise _Unsupported
        storage = value.untyped_storage()
        entry = storages.get(storage._cdata)
        if entry is None:
            nbytes = storage.nbytes()
            entry = storages[storage._cdata] = (torch.UntypedStorage(nbytes, device=_META), nbytes)
        meta = torch.empty(0, dtype=value.dtype, device=_META)
        meta.set_(entry[0], value.storage_offset(), value.shape, value.stride())
        return meta
    if isinstance(value, torch.device):
        return _META
    if isinstance(value, list):
        return [_to_meta(v, storages) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_meta(v, storages) for v in value)
    return value


def written_tensors(
    args: Any, kwargs: dict[str, Any], positions: tuple[int, ...], names: tuple[str, ...]
) -> list[torch.Tensor]:
    """The tensors of a call that its op writes (`written_arguments` of its schema)."""
    values = [args[i] for i in positions if i < len(args)]
    values += [kwargs[name] for name in names if name in kwargs]
    return [t for t in _leaves(values) if isinstance(t, torch.Tensor)]


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield value
