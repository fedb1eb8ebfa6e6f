"""Every aten op on a RemoteTensor lands here: encoded, its outputs inferred, streamed.

The hot path (one op of a training step) is: look up the op's schema facts, encode the
arguments while building the plan-cache key, look up the cached output plan, make wrappers
with fresh client-chosen handles, append one record. Nothing waits for the worker.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from typing import Any

import msgpack
import torch

from gpupool.protocol.v1.dataplane import BATCH_MAX_RECORDS, INLINE_PAYLOAD_BYTES, Ext, Rec
from gpupool.protocol.v1.tensors import (
    DTYPE_EXT,
    HOST_DEVICE_EXT,
    LAYOUT_EXT,
    MEMORY_FORMAT_EXT,
    REMOTE_DEVICE_EXT,
    complex_ext,
    dtype_from_name,
    literal_ext,
)
from gpupool.torch import autocast, pinned, rules, runtime
from gpupool.torch import stream as stream_module
from gpupool.torch.shapes import (
    PLAN_CACHE_MAX,
    NeedsWorker,
    OpInfo,
    Plan,
    infer_plan,
    meta_like,
    op_info,
    to_meta,
)
from gpupool.torch.stream import DeviceStream, stream_of
from gpupool.torch.tensor import (
    CONJ,
    NEG,
    Handle,
    RemoteTensor,
    bind_dispatch,
    contiguous_strides,
    is_remote_device,
    is_sparse_remote,
    read_values,
    restride,
    wrap,
    wrap_signature,
    wrap_sparse,
)

aten = torch.ops.aten
_OP = Rec.OP
_NO_KWARGS: dict[str, Any] = {}
_PLANS: dict[tuple[Any, ...], Plan] = {}

CALL_BLOCK = 1 << 16
_CALL_BLOCKS = itertools.count(1 << 20)
"""Handles for outputs the worker names (CALL) come from blocks far above the client's own."""


class RemoteDeviceError(RuntimeError):
    pass


class _Encoding:
    """Collects, while arguments are encoded, the stream they live on and the plan-cache key."""

    __slots__ = ("device_index", "key", "stream")

    def __init__(self) -> None:
        self.stream: DeviceStream | None = None
        self.device_index: int | None = None
        self.key: list[Any] = []


_TRUE, _FALSE = object(), object()


def _encode(value: Any, keyed: bool, enc: _Encoding) -> Any:
    if isinstance(value, RemoteTensor):
        return _encode_remote(value, enc)
    kind = type(value)
    if kind is int or kind is float or value is None or kind is str:
        enc.key.append(value if keyed else kind)
        return value
    if kind is bool:
        enc.key.append((_TRUE if value else _FALSE) if keyed else kind)
        return value
    if kind is list or kind is tuple or kind is torch.Size:
        key = enc.key
        key.append(len(value))
        out = []
        for item in value:
            # Lists of remote tensors (foreach ops, cat) inline, the rest the long way.
            if type(item) is RemoteTensor:
                handle = item._gp
                if enc.stream is not handle.stream:
                    _encode_remote(item, enc)
                else:
                    key.append(item._sig)
                out.append(handle.ext)
            elif type(item) is int:  # sizes, strides, dims
                key.append(item if keyed else int)
                out.append(item)
            else:
                out.append(_encode(item, keyed, enc))
        return out
    if kind is torch.dtype:
        enc.key.append(value)
        return DTYPE_EXT[value]
    if kind is torch.device:
        enc.key.append(value.type)
        if value.type == "cpu":
            return HOST_DEVICE_EXT
        if value.index is not None and enc.device_index is None and is_remote_device(value):
            enc.device_index = value.index
        return REMOTE_DEVICE_EXT
    if isinstance(value, torch.Tensor):
        return _encode_host_tensor(value, enc)
    if kind is torch.layout:
        enc.key.append(value)
        layout = LAYOUT_EXT.get(value)
        if layout is None:
            raise NotImplementedError(
                f"{value} tensors are not supported on gpupool remote devices (only strided ones)"
            )
        return layout
    if kind is torch.memory_format:
        enc.key.append(value)
        return MEMORY_FORMAT_EXT[value]
    if kind is complex:
        enc.key.append(kind)
        return complex_ext(value)
    if isinstance(value, torch.Generator):
        raise NotImplementedError(
            "gpupool remote devices do not take explicit torch.Generator objects"
        )
    raise NotImplementedError(
        f"gpupool cannot send an argument of type {kind.__name__} to a worker"
    )


def _encode_remote(value: RemoteTensor, enc: _Encoding) -> Any:
    handle = value._gp
    stream = handle.stream
    if enc.stream is not stream:
        if enc.stream is not None:
            raise RemoteDeviceError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, {enc.stream.device} and {stream.device}!"
            )
        enc.stream = stream_of(handle)
    enc.key.append(value._sig)
    return handle.ext


def _encode_host_tensor(value: torch.Tensor, enc: _Encoding) -> Any:
    if value.device.type == "meta":
        raise NotImplementedError(
            "a remote op received a tensor on the meta device: mixing meta and cuda tensors "
            "in one op is an error on a local GPU too"
        )
    if value.layout != torch.strided:
        raise NotImplementedError(
            f"{value.layout} tensors are not supported on gpupool remote devices (only strided "
            "ones): convert with .to_dense() first"
        )
    value = value.detach()
    enc.key.append(("host", value.shape, value.dtype))
    if value.numel() * value.element_size() <= INLINE_PAYLOAD_BYTES:
        return literal_ext(value)
    # Too big to ride in the op stream: upload it first, pass the handle.
    if enc.stream is None:
        enc.stream = runtime.stream(enc.device_index)
    return upload(value, enc.stream)._gp.ext


def _encode_call(
    info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], enc: _Encoding
) -> tuple[list[Any], dict[str, Any] | None]:
    keyed = info.keyed_scalars
    key = enc.key
    wire_args = []
    for i, value in enumerate(args):
        # The common arguments inline: this runs for every op of a training step.
        kind = type(value)
        if kind is RemoteTensor:
            handle = value._gp
            if handle.stream is enc.stream:
                key.append(value._sig)
                wire_args.append(handle.ext)
            else:
                wire_args.append(_encode_remote(value, enc))
        elif kind is int and i in keyed:
            key.append(value)
            wire_args.append(value)
        else:
            wire_args.append(_encode(value, i in keyed, enc))
    wire_kwargs: dict[str, Any] | None = None
    if kwargs:
        wire_kwargs = {}
        for name, value in kwargs.items():
            enc.key.append(name)
            wire_kwargs[name] = _encode(value, name in keyed, enc)
    return wire_args, wire_kwargs


# ---- the generic path ----------------------------------------------------------------------


_ROUTES: dict[int, tuple[Any, OpInfo | None, int]] = {}
"""id(op) → (its special handler or None, its OpInfo, the autocast lists it is on as
autocast.POLICY_BITS, 0 for none): one lookup per op (by id(): OpOverload hashes in Python;
overloads live as long as torch)."""


def _route(func: Any) -> tuple[Any, OpInfo | None, int]:
    special = _SPECIAL.get(id(func))
    if special is None:
        special = _composite_route(func)
    if special is not None:
        special = _guarded_special(special)
        route: tuple[Any, OpInfo | None, int] = (special, None, 0)
    else:
        info = op_info(func)
        route = (None, info, autocast.policy_bits(info.short_name))
    _ROUTES[id(func)] = route
    return route


_COMPOSITE_KEYS = (
    torch._C.DispatchKey.CompositeImplicitAutograd,
    torch._C.DispatchKey.CompositeExplicitAutograd,
)


_DEVICE_KEYS = (torch._C.DispatchKey.PrivateUse1,)
"""Library ops with a kernel of their own for PrivateUse1 (FSDP2's `fsdp::` copy-in and
split ops, written in aten ops for any accelerator): that kernel runs, in the client."""


COMPOSITE_KERNELS: dict[Any, Any] = {}
"""aten composites → the client's own kernel for them (gpupool.torch.kernels registers these at
AutogradPrivateUse1: attention, batch norm, dropout, the recurrent layers)."""
WHOLE_COMPOSITES: set[Any] = set()
"""aten composites that go to the worker as one op when they reach the remote dispatcher
(linear: kernels.linear sends it here below autograd when no gradient is needed)."""


def _composite_route(func: Any) -> Any:
    """Ops outside aten (library ops such as torch.nn's `torch_nn::` ones) never run on a
    worker, which takes aten ops only; where one is a composite of other ops, those run.

    aten's own composites (CompositeImplicitAutograd) reach this dispatcher only for inference
    tensors: those have no autograd key, where a normal tensor's composites decompose. They
    get what a normal tensor gets: the client's kernel where it has one, else the composite's
    parts. (Sent as one op, `aten::to` was taken for the view its schema allows, and `.cpu()`
    of an inference tensor came back remote.)"""
    name = func.name()
    if name.startswith("aten::"):
        implicit = torch._C._dispatch_has_kernel_for_dispatch_key(name, _COMPOSITE_KEYS[0])
        if not implicit or func in WHOLE_COMPOSITES:
            return None
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, _DEVICE_KEYS[0]):
            return None  # a kernel of its own here (kernels._KERNELS_OF_THEIR_OWN): whole
        kernel = COMPOSITE_KERNELS.get(func)
        if kernel is not None:
            return lambda func, args, kwargs: kernel(*args, **kwargs)
        return lambda func, args, kwargs: func.decompose(*args, **kwargs)
    keys = [
        k
        for k in (*_COMPOSITE_KEYS, *_DEVICE_KEYS)
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
    ]
    if not keys:
        return None
    key = keys[0]

    def composite(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return func._op_dk(key, *args, **kwargs)

    return composite


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    special, info, policy = _ROUTES.get(id(func)) or _route(func)
    if special is not None:
        return special(func, args, kwargs)
    assert info is not None
    if policy:
        args, kwargs = autocast.adjust(info, args, kwargs)
    return run(info, args, kwargs)


def run(
    info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], device_index: int | None = None
) -> Any:
    if info.is_view and _outside_inference(args):
        with torch.inference_mode(False):
            return run(info, args, kwargs, device_index)
    enc = _Encoding()
    enc.device_index = device_index
    wire_args, wire_kwargs = _encode_call(info, args, kwargs, enc)
    stream = enc.stream or runtime.stream(enc.device_index)
    if info.metadata_inplace:
        return _metadata_inplace(info, args, kwargs, stream)
    op_id = stream.op_id(info)
    if info.all_alias:
        stream.emit([_OP, op_id, wire_args, wire_kwargs, None])
        return _aliased_result(info, args, kwargs)
    if info.values_only:
        return _call(info, stream, wire_args, wire_kwargs)
    key = (info, *enc.key)
    plan = _PLANS.get(key)
    if plan is None:
        if _has_sparse(args) or _has_sparse(kwargs.values()):
            # A sparse tensor's outputs (how many values, coalesced or not) are the worker's
            # to say: every op on one is a round trip, and never cached.
            return _call(info, stream, wire_args, wire_kwargs)
        if not info.is_view and (_has_bits(args) or _has_bits(kwargs.values())):
            return _run_resolved(info, args, kwargs, device_index)
        plan = rules.plan(info, enc.key, args, kwargs)
        if plan is None:
            try:
                plan = autocast.infer_with_reconciliation(info, args, kwargs, infer_plan)
            except NeedsWorker:
                return _call(info, stream, wire_args, wire_kwargs)
            rules.learn(info, enc.key, args, kwargs, plan)
        if len(_PLANS) >= PLAN_CACHE_MAX:
            _PLANS.clear()
        # Ops on tensors with math bits stay off the cache, so the compiled path never sees
        # them (their outputs' bits come from meta inference each time).
        if not _has_bits(args) and not _has_bits(kwargs.values()):
            _PLANS[key] = plan
    outs, result = plan.build(stream.new_handle, args, kwargs)
    stream.emit([_OP, op_id, wire_args, wire_kwargs, outs])
    return result


def _run_resolved(
    info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], device_index: int | None
) -> Any:
    """An op that reads values, given a tensor with math bits (PyTorch's fallbacks pass a few
    through: clone, copy, the factories `*_like`): it gets the values, resolved on the worker."""
    args = tuple(_resolve(a) for a in args)
    kwargs = {k: _resolve(v) for k, v in kwargs.items()}
    return run(info, args, kwargs, device_index)


def _resolve(value: Any) -> Any:
    if type(value) is RemoteTensor:
        bits = _bits(value)
        return _apply_bits(value, bits) if bits else value
    if type(value) in (list, tuple):
        return type(value)(_resolve(v) for v in value)
    return value


def _aliased_result(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    targets = [args[p] if isinstance(p, int) else kwargs[str(p)] for p in info.returns_alias]
    if not targets:
        return None
    return targets[0] if len(targets) == 1 else tuple(targets)


def _call(
    info: OpInfo, stream: DeviceStream, wire_args: list[Any], wire_kwargs: dict[str, Any] | None
) -> Any:
    """Ops whose outputs only the worker can tell (values, data-dependent shapes): a round trip."""
    base = next(_CALL_BLOCKS) * CALL_BLOCK
    described = stream.call(info, wire_args, wire_kwargs, base)
    result = _materialize(described, stream)
    if len(info.returns_alias) > 1 and isinstance(result, list):
        return tuple(result)
    return result


def _materialize(described: Any, stream: DeviceStream) -> Any:
    tag = described[0]
    if tag == "T":
        _, handle, dtype, shape, stride, offset = described
        return wrap(shape, stride, offset, dtype_from_name(dtype), Handle(handle, stream))
    if tag == "S":  # a sparse COO tensor: the worker holds its indices and values
        _, handle, dtype, shape = described
        return wrap_sparse(shape, dtype_from_name(dtype), Handle(handle, stream))
    if tag == "L":
        return [_materialize(item, stream) for item in described[1]]
    if tag == "D":
        return dtype_from_name(described[1])
    return described[1]


def _metadata_inplace(
    info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], stream: DeviceStream
) -> Any:
    """unsqueeze_, t_, resize_, set_…: change the wrapper's own metadata. The tensor first gets
    a worker tensor of its own, so aliases made by detach() keep theirs."""
    target = args[0]
    if not isinstance(target, RemoteTensor):
        raise NotImplementedError(f"{info.name} on a host tensor with remote arguments")
    own = stream.new_handle()
    stream.emit([_OP, stream.op_id(op_info(aten.alias.default)), [target._gp.ext], None, [own.id]])
    target._gp = own
    # The new metadata is what the op does to a meta tensor of the same metadata.
    meta = meta_like(target)
    info.func(meta, *(to_meta(a) for a in args[1:]), **{k: to_meta(v) for k, v in kwargs.items()})
    restride(target, tuple(meta.shape), meta.stride(), int(meta.storage_offset()))
    enc = _Encoding()
    wire_args, wire_kwargs = _encode_call(info, args, kwargs, enc)
    stream.emit([_OP, stream.op_id(info), wire_args, wire_kwargs, None])
    return target


# ---- tensors in and out of the worker --------------------------------------------------------


def upload(host: torch.Tensor, stream: DeviceStream) -> RemoteTensor:
    """A new remote tensor with a host tensor's values (contiguous)."""
    host = host.detach().contiguous()
    stream.admit(host.numel() * host.element_size(), "aten::empty.memory_format")
    handle = stream.new_handle()
    stream.emit(
        [
            _OP,
            stream.op_id(op_info(aten.empty.memory_format)),
            [list(host.shape)],
            {"dtype": DTYPE_EXT[host.dtype], "device": REMOTE_DEVICE_EXT},
            [handle.id],
        ]
    )
    stream.put(handle, host)
    return wrap(tuple(host.shape), host.stride(), 0, host.dtype, handle)


def download(tensor: RemoteTensor) -> torch.Tensor:
    """The tensor's values in host memory (waits for everything queued before it), with its
    math bits as `.cpu()` of a local GPU tensor keeps them. A sparse tensor comes as one too,
    from its indices and values (read as the dense tensors they are)."""
    if is_sparse_remote(tensor):
        return torch.sparse_coo_tensor(
            read_values(aten._indices.default(tensor)), read_values(aten._values.default(tensor)),
            tensor.shape, is_coalesced=bool(aten.is_coalesced.default(tensor)),
        )  # fmt: skip
    return read_values(tensor)


def upload_sparse(
    host: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host sparse COO tensor on a remote device (its values cast to `dtype` if given): its
    indices and values moved as the dense tensors they are, made one again on the worker
    (which checks the indices against the size: the constructor the client's
    sparse_coo_tensor calls trusts them)."""
    return torch.sparse_coo_tensor(
        host._indices().to(device), host._values().to(device, dtype), host.shape,
        is_coalesced=host.is_coalesced(),
    )  # fmt: skip


def _has_sparse(values: Any) -> bool:
    return _any_remote(values, is_sparse_remote)


# ---- math bits (lazy conjugate and negative) --------------------------------------------------


def _bits(tensor: RemoteTensor) -> int:
    sig = tensor._sig
    return sig[4] if len(sig) == 5 else 0


def _raw(tensor: RemoteTensor) -> RemoteTensor:
    """The worker's tensor as it is, without the wrapper's math bits (same handle)."""
    return wrap_signature(tensor._sig[:4], tensor._gp)


def _apply_bits(tensor: RemoteTensor, bits: int) -> RemoteTensor:
    """A new remote tensor holding conj and/or neg of `tensor`'s raw values."""
    result = _raw(tensor)
    if bits & CONJ and result.is_complex():
        result = run(op_info(aten.conj_physical.default), (result,), _NO_KWARGS)
    if bits & NEG:
        result = run(op_info(aten.neg.default), (result,), _NO_KWARGS)
    return result


def _toggle_bit(bit: int) -> Any:
    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """_conj / _neg_view: the same worker tensor, the wrapper's bit flipped."""
        source = args[0]
        if bit == CONJ and not source.is_complex():
            return wrap_signature(source._sig, source._gp)
        bits = _bits(source) ^ bit
        sig = source._sig[:4]
        return wrap_signature((*sig, bits) if bits else sig, source._gp)

    return handler


def _has_bits(values: Any) -> bool:
    return _any_remote(values, lambda tensor: len(tensor._sig) == 5)


def _any_remote(values: Any, test: Any) -> bool:
    """Whether `test` holds for a remote tensor among `values`, lists and tuples of them
    included."""
    for value in values:
        if type(value) is RemoteTensor:
            if test(value):
                return True
        elif type(value) in (list, tuple) and _any_remote(value, test):
            return True
    return False


# ---- ops that are not plain ops -------------------------------------------------------------


def _local_scalar_dense(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return download(args[0]).item()


def _to_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    source = args[0]
    device = kwargs.get("device")
    if not isinstance(source, RemoteTensor):
        raise NotImplementedError("_to_copy of a host tensor reached the remote dispatcher")
    here = stream_of(source._gp)
    if device is None or (is_remote_device(device) and device.index in (None, here.index)):
        rest = {
            k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "non_blocking")
        }
        return run(op_info(func), args, rest)
    if is_remote_device(device):
        target = runtime.stream(device.index)
        if direct_copy(here, target) and not is_sparse_remote(source):
            return _transfer(source, target, kwargs.get("dtype") or source.dtype)
    host = download(source)
    dtype = kwargs.get("dtype")
    if host.layout == torch.sparse_coo and is_remote_device(device):
        return upload_sparse(host, device, dtype)
    if dtype is not None and dtype != host.dtype:
        host = host.to(dtype)
    if device.type == "cpu":
        memory_format = kwargs.get("memory_format")
        if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
            host = host.contiguous(memory_format=memory_format)
        return host
    if is_remote_device(device):
        return upload(host, runtime.stream(device.index))
    raise NotImplementedError(f"gpupool cannot copy a remote tensor to {device}")


_TRANSFER_IDS = itertools.count(1)
PEER_COPY = os.environ.get("GPUPOOL_PEER_COPY", "1") != "0"
"""`GPUPOOL_PEER_COPY=0`: copies between devices go through the client even where the workers
could exchange them (workers of one lease must reach each other's data-plane endpoints)."""


def direct_copy(source: DeviceStream, target: DeviceStream) -> bool:
    """Whether a copy between two devices of the lease can go worker to worker: both workers
    take part, neither stream is being captured, and the target's address as this process
    reaches it also works from the source's worker (both Unix sockets, i.e. all on this host,
    or both plain TCP). TLS workers have no client certificate for each other: via the client."""
    if not PEER_COPY or not (source.welcome.get("peer_copy") and target.welcome.get("peer_copy")):
        return False
    if source.recorder is not None or target.recorder is not None:
        return False
    kinds = (source.address.scheme, target.address.scheme)
    return kinds in (("unix", "unix"), ("tcp", "tcp"))


def _transfer(source: RemoteTensor, target: DeviceStream, dtype: torch.dtype) -> RemoteTensor:
    """`source` copied to another device of the lease as a new contiguous tensor."""
    handle = target.new_handle()
    _send(source, target, handle.id, dtype, into=False)
    shape = tuple(source.shape)
    return wrap(shape, contiguous_strides(shape), 0, dtype, handle)


def _send(
    source: RemoteTensor, target: DeviceStream, handle: int, dtype: torch.dtype | None, into: bool
) -> None:
    here = stream_of(source._gp)
    xid = next(_TRANSFER_IDS)
    here.emit([Rec.SEND, xid, source._gp.ext, str(target.address)])
    here.flush()  # the target's worker waits for these bytes: nothing may hold them back
    target.emit([Rec.RECV, xid, handle, None if dtype is None else DTYPE_EXT[dtype], into])


def _copy_(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """copy_ writes values: into a tensor with math bits it writes their inverse (both are
    involutions), so the raw values the worker holds are the source's with the bits of
    source and target applied."""
    target, source = args[0], args[1]
    if isinstance(target, RemoteTensor):
        target_bits = _bits(target)
        if isinstance(source, RemoteTensor):
            source_bits = _bits(source)
            if source._gp.stream is target._gp.stream:
                if not (source_bits or target_bits):
                    return run(op_info(func), args, kwargs)
                raw = _apply_bits(source, source_bits ^ target_bits)
                run(op_info(func), (_raw(target), raw, *args[2:]), kwargs)
                return target
            target_stream = stream_of(target._gp)
            if direct_copy(stream_of(source._gp), target_stream) and not (
                source_bits or target_bits
            ):
                _send(source, target_stream, target._gp.id, None, into=True)
                return target
            source = download(source)
        elif source.device.type == "meta":
            raise NotImplementedError("copy_ from a meta tensor into a remote tensor")
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if target_bits or source.is_conj() or source.is_neg():
            source, non_blocking = _host_raw(source, target_bits), False
        # As on a local GPU, only a pinned source copies asynchronously: pageable memory may
        # change the moment the call returns.
        non_blocking = non_blocking and pinned.is_pinned(source)
        stream_of(target._gp).put(target._gp, source, non_blocking)
        return target
    target.copy_(download(source))
    return target


def _host_raw(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The raw values a tensor with math bits `bits` holds to show `values`."""
    raw = values.resolve_conj().resolve_neg()
    if bits & CONJ and raw.is_complex():
        raw = raw.conj_physical()
    if bits & NEG:
        raw = raw.neg()
    return raw


def _share(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """detach() and alias() only matter to autograd, which lives in the client: no worker op."""
    source = args[0]
    if _outside_inference(args):
        with torch.inference_mode(False):
            return wrap_signature(source._sig, source._gp)
    return wrap_signature(source._sig, source._gp)


def _outside_inference(args: tuple[Any, ...]) -> bool:
    """Whether a view's output must be made outside inference mode: it is on and the view's
    base is a normal tensor. A wrapper made in inference mode is an inference tensor, and
    autograd's view bookkeeping then fails to share the base's version counter with it
    ("Cannot set version_counter for inference tensor"), where a local view of a normal
    tensor made in inference mode is a normal tensor."""
    if not torch.is_inference_mode_enabled():
        return False
    base = next((a for a in args if type(a) is RemoteTensor), None)
    return base is not None and not base.is_inference()


def _identity(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0]


def _nothing(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return None


def _false(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return False


def _same_kind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`.data =` asks whether two tensors can swap metadata: two remote tensors can."""
    return all(isinstance(t, RemoteTensor) for t in args[:2])


def _unsupported(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise NotImplementedError(f"{func} is not supported on gpupool remote devices")


def _in_the_client(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An aten op's device-generic kernel, run here: its tensor work goes to the worker op by
    op, and what it makes from host arguments stays on the host, as on a local GPU
    (`_pack_padded_sequence` makes its batch sizes from the host lengths: sent whole, they
    came back a remote tensor, which PackedSequence refuses)."""
    return func._op_dk(_COMPOSITE_KEYS[1], *args, **kwargs)


_SPECIAL: dict[int, Any] = {
    id(op): handler
    for op, handler in {
        aten._local_scalar_dense.default: _local_scalar_dense,
        aten._to_copy.default: _to_copy,
        aten.copy_.default: _copy_,
        aten.detach.default: _share,
        aten._conj.default: _toggle_bit(CONJ),
        aten._neg_view.default: _toggle_bit(NEG),
        aten.alias.default: _share,
        aten.lift_fresh.default: _identity,
        aten.record_stream.default: _nothing,
        aten.is_pinned.default: _false,
        aten._has_compatible_shallow_copy_type.default: _same_kind,
        aten._pin_memory.default: _unsupported,
        aten._pack_padded_sequence.default: _in_the_client,
        aten.set_.source_Storage: _unsupported,
        aten.set_.source_Storage_storage_offset: _unsupported,
    }.items()
}


def factory(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """empty / empty_strided on `cuda` (the kernels registered for the CUDA dispatch key):
    every factory (zeros, randn, arange, full, tensor(…, device=…), .to("cuda")) allocates
    through these, so all of them make RemoteTensors without a TorchFunctionMode."""
    device = kwargs.get("device")
    index = device.index if isinstance(device, torch.device) else None
    layout = kwargs.get("layout")
    if layout is not None and layout != torch.strided:
        # A sparse tensor made on the device allocates this way (a COO one moved there does
        # not: kernels moves its indices and values): fail at that op, before anything is
        # sent, so the session and every other tensor stay as they are. A compressed layout
        # (CSR and the others) cannot be a Python tensor subclass at all in PyTorch ("layout_impl
        # is only implemented for TensorImpl subclasses").
        raise NotImplementedError(
            f"{func.name()}: {layout} tensors are not supported on gpupool remote devices "
            "(strided and sparse COO ones are); use .to_sparse() or .to_dense() first"
        )
    on = runtime.current_index() if index is None else index
    stride = args[1] if func is aten.empty_strided.default else None
    runtime.stream(on).admit(
        stream_module.allocation_bytes(args[0], stride, kwargs.get("dtype")), func.name()
    )  # a lease too small for it raises here, at the allocating call
    kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory" and v is not None}
    return guarded_run(op_info(func), args, kwargs, on)


# ---- errors inside backward -----------------------------------------------------------------

_backward_depth = 0
_deferred: list[BaseException] = []


def begin_backward() -> None:
    """The autograd engine runs (gpupool.torch.kernels wraps it)."""
    global _backward_depth
    _backward_depth += 1


def end_backward() -> BaseException | None:
    """The engine returned: the first error a remote op of that backward raised, if any."""
    global _backward_depth
    _backward_depth -= 1
    if _backward_depth or not _deferred:
        return None
    error = _deferred[0]
    _deferred.clear()
    return error


def guarded_dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """dispatch(), whose errors inside backward are raised when the engine returns.

    An exception that leaves a remote op while the C++ autograd engine runs it unwinds
    through the engine's stream guard, whose PrivateUse1 implementation (PyTorch's Python
    one) calls into Python with the error still pending: the process aborts. So inside
    backward the op's outputs are made as empty tensors of the shapes meta inference gives,
    the error is kept, and the engine's caller raises it: the program gets the exception,
    with its session and tensors."""
    if not _backward_depth:
        return dispatch(func, args, kwargs)
    try:
        return dispatch(func, args, kwargs)
    except Exception as exc:
        return _stand_in(exc, op_info(func), args, kwargs, None)


def _guarded_special(handler: Any) -> Any:
    def guarded(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not _backward_depth:
            return handler(func, args, kwargs)
        try:
            return handler(func, args, kwargs)
        except Exception as exc:
            return _stand_in(exc, op_info(func), args, kwargs, None)

    return guarded


def guarded_run(
    info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], device_index: int | None = None
) -> Any:
    """run(), with guarded_dispatch()'s handling of errors inside backward."""
    if not _backward_depth:
        return run(info, args, kwargs, device_index)
    try:
        return run(info, args, kwargs, device_index)
    except Exception as exc:
        return _stand_in(exc, info, args, kwargs, device_index)


def _stand_in(
    exc: Exception,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_index: int | None,
) -> Any:
    try:
        plan = infer_plan(info, args, kwargs)
    except Exception:
        raise exc from None  # nothing to stand in with: as before
    enc = _Encoding()
    enc.device_index = device_index
    try:
        _encode_call(info, args, kwargs, enc)
    except Exception:
        raise exc from None
    stream = enc.stream or runtime.stream(enc.device_index)
    outs, result = plan.build(stream.new_handle, args, kwargs)
    made = {id(t._gp): t for t in _remote_leaves(result)}
    empty = stream.op_id(op_info(aten.empty_strided.default))
    for tensor in made.values():
        if tensor._gp.id in outs:
            kwargs_wire = {"dtype": DTYPE_EXT[tensor.dtype], "device": REMOTE_DEVICE_EXT}
            shape, stride = list(tensor.shape), list(tensor.stride())
            stream.emit([_OP, empty, [shape, stride], kwargs_wire, [tensor._gp.id]])
    if not _deferred:
        _deferred.append(exc)
    return result


def _remote_leaves(value: Any) -> list[RemoteTensor]:
    if isinstance(value, RemoteTensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _remote_leaves(v)]
    return []


bind_dispatch(guarded_dispatch)


# ---- the compiled hot path ----------------------------------------------------------------

_PY_TORCH_DISPATCH = RemoteTensor.__dict__["__torch_dispatch__"]
_PY_HANDLE_DEL = Handle.__dict__["__del__"]
_fastpath: Any = None
_torch_find_rule: Any = None


def _load_fastpath() -> Any:
    """gpupool.torch._fastpath (src/gpupool/torch/_fastpath.c), configured, or None.

    The C module does the cached-plan case of dispatch() and run() above and hands every
    other case to them; bench/dispatch_floor.py measured what it saves. Off where it was
    not built (no C compiler at install), with GPUPOOL_FASTPATH=0, and under
    CUDA_LAUNCH_BLOCKING=1 (every op waits then, so speed is moot)."""
    if os.environ.get("GPUPOOL_FASTPATH", "1") == "0" or stream_module.LAUNCH_BLOCKING:
        return None
    try:
        from gpupool.torch import _fastpath as module  # type: ignore[attr-defined]
    except ImportError:
        return None
    from torch._library import simple_registry

    global _torch_find_rule
    original = getattr(simple_registry, "find_torch_dispatch_rule", None)
    if original is module.find_rule:
        original = _torch_find_rule  # loaded before: delegate to torch's, never to itself
    _torch_find_rule = original
    try:
        _configure(module, original)
    except (KeyError, TypeError) as exc:
        warnings.warn(
            f"gpupool.torch._fastpath does not match this gpupool ({exc}): "
            "rebuild it (pip install -e . or python setup.py build_ext --inplace); "
            "ops take the slower Python path meanwhile",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    if original is not None:
        # torch looks this up (once) to ask, on every dispatch to a Python subclass, for a
        # rule registered with torch.library.register_torch_dispatch; none are for
        # RemoteTensor, so the C version answers for it at once and asks the original for
        # every other class. Where torch already holds the original, nothing changes.
        simple_registry.find_torch_dispatch_rule = module.find_rule
    return module


def _configure(module: Any, find_rule: Any) -> None:
    module.configure(
        {
            "remote_type": RemoteTensor,
            "handle_type": Handle,
            "size_type": torch.Size,
            "dtype_type": torch.dtype,
            "routes": _ROUTES,
            "plans": _PLANS,
            "slow_dispatch": guarded_dispatch,
            "slow_run": guarded_run,
            "adjust": autocast.adjust,
            "handle_ids": stream_module.HANDLE_IDS,
            "ext_type": msgpack.ExtType,
            "tensor_code": int(Ext.TENSOR),
            "dtype_ext": DTYPE_EXT,
            "true_key": _TRUE,
            "false_key": _FALSE,
            "make_wrapper": torch.Tensor._make_wrapper_subclass,
            "wrap_bits": wrap_signature,
            "op_code": int(_OP),
            "free_code": int(Rec.FREE),
            "perf_counter": time.perf_counter,
            "find_rule": find_rule if find_rule is not None else _no_rule,
            "batch_max": BATCH_MAX_RECORDS,
            "flush_after": stream_module.FLUSH_AFTER_S,
            "to_copy": aten._to_copy.default,
            "to_copy_info": op_info(aten._to_copy.default),
            "share_ops": (aten.detach.default, aten.alias.default),
            "inference_on": torch.is_inference_mode_enabled,
            "autocast_state": autocast._state,
            "current_node": torch._C._current_autograd_node,
            "casts": autocast._casts,
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "policy_bits": autocast.POLICY_BITS,
        }
    )


def _no_rule(op: Any, cls: Any) -> None:
    return None


def use_fastpath(enabled: bool) -> bool:
    """Turn the compiled hot path on or off (tests compare the two); returns whether it is
    on now (False where it is not built or GPUPOOL_FASTPATH=0)."""
    global _fastpath
    if enabled and _fastpath is None:
        _fastpath = _load_fastpath()
    on = enabled and _fastpath is not None
    stream_module.fast_pack = _fastpath.pack_records if on else None
    handler = classmethod(_fastpath.torch_dispatch) if on else _PY_TORCH_DISPATCH
    RemoteTensor.__torch_dispatch__ = handler  # type: ignore[assignment,method-assign]
    Handle.__del__ = _fastpath.handle_del_method() if on else _PY_HANDLE_DEL  # type: ignore[method-assign]
    return on


def fastpath_active() -> bool:
    """Whether ops on remote tensors go through the compiled hot path."""
    return RemoteTensor.__dict__["__torch_dispatch__"] is not _PY_TORCH_DISPATCH


use_fastpath(True)
