"""What an op returns, worked out in the client: from its schema, or from meta tensors, cached.

Uncached meta inference costs ~200 µs an op; a training step repeats the same few hundred
(op, shapes, dtypes) signatures, so the plans are cached per signature and a step's ops cost a
dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpupool.protocol.v1.tensors import op_name
from gpupool.torch.tensor import (
    META,
    Handle,
    RemoteTensor,
    is_remote_device,
    math_bits,
    restride,
    set_math_bits,
    wrap,
    wrap_signature,
)

PLAN_CACHE_MAX = 16384

_COUNTS = {"meta": 0, "rules": 0}
"""Plan-cache misses answered by a meta-kernel call and by a shape rule (gpupool.torch.rules)."""


def inference_counts() -> dict[str, int]:
    """How many plan-cache misses this process answered with a meta-kernel call (`meta`) and
    how many with a shape rule (`rules`): a loop whose shapes change every step (decoding)
    should make no meta calls once its ops' rules are known."""
    return dict(_COUNTS)


METADATA_INPLACE = frozenset(
    {
        "resize_", "resize_as_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_",
        "swapdims_", "swapaxes_", "set_",
    }
)  # fmt: skip
"""In-place ops that change a tensor's shape or strides: the client's wrapper must follow."""

FLOAT_SHAPED = ("arange", "linspace", "logspace", "range", "upsample", "_upsample")
"""Ops whose output shape depends on float argument values (everywhere else only the type does)."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    bits: int = 0
    """Math bits (tensor.CONJ, tensor.NEG) the wrapper carries; the worker's tensor has none."""


@dataclass(frozen=True, slots=True)
class AliasOf:
    """The output is this input (in-place ops, out= arguments), whose metadata becomes spec."""

    position: int | str
    spec: TensorSpec | None = None


@dataclass(frozen=True, slots=True)
class Value:
    value: Any


@dataclass(frozen=True, slots=True)
class Seq:
    kind: type
    items: tuple[Any, ...]


class OpInfo:
    """Per-op facts read once from the schema."""

    __slots__ = (
        "all_alias", "func", "has_out", "is_view", "keyed_scalars", "metadata_inplace", "name",
        "returns_alias", "short_name", "values_only", "wire_name",
    )  # fmt: skip

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.func = func
        self.name = schema.name
        self.wire_name = op_name(func)
        self.short_name = schema.name.partition("::")[2]
        arguments = schema.arguments
        alias_sets: dict[str, int | str] = {}
        for i, arg in enumerate(arguments):
            info = arg.alias_info
            if info is not None and info.is_write:
                for name in info.before_set:
                    alias_sets[name] = arg.name if arg.kwarg_only else i
        returns_alias: list[int | str | None] = []
        for ret in schema.returns:
            info = ret.alias_info
            target = None
            if info is not None and info.is_write:
                target = next((alias_sets[n] for n in info.before_set if n in alias_sets), None)
            returns_alias.append(target)
        self.returns_alias = tuple(returns_alias)
        self.is_view = bool(schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        """Its outputs are views of an input: math bits pass through it unresolved."""
        self.has_out = any(arg.is_out for arg in arguments)
        # In-place ops return their input unchanged in shape: no inference needed. out= ops may
        # resize their out tensors, so they are inferred like any other op.
        self.all_alias = all(r is not None for r in returns_alias) and not self.has_out
        self.values_only = bool(schema.returns) and not any(
            "Tensor" in str(r.type) for r in schema.returns
        )
        self.metadata_inplace = self.short_name in METADATA_INPLACE
        floats_matter = self.short_name.startswith(FLOAT_SHAPED)
        # Which arguments key the plan cache by value: ints, bools and lists of them (dims,
        # sizes). Scalars (`x * 0.5`, `add(alpha=...)`) change only by type, so optimizer
        # steps whose learning rates change every step still hit the cache.
        keyed: set[int | str] = set()
        for i, arg in enumerate(arguments):
            kind = str(arg.type)
            if floats_matter or not kind.startswith(("Scalar", "float")):
                keyed.add(arg.name if arg.kwarg_only else i)
        self.keyed_scalars = frozenset(keyed)


_INFO: dict[int, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    # Keyed by id(): OpOverload hashes in Python; the overloads live as long as torch does.
    info = _INFO.get(id(func))
    if info is None:
        info = _INFO[id(func)] = OpInfo(func)
    return info


class Plan:
    """How to build an op's outputs: new wrappers from specs, inputs for aliases, values."""

    __slots__ = ("flat", "single", "template")

    def __init__(self, template: Any) -> None:
        self.template = template
        # The common shapes precomputed: one new tensor (most ops), or a sequence of new
        # tensors and values (batch norm, convolution backward); wrappers get these
        # signature tuples as they are.
        self.single = _signature(template) if type(template) is TensorSpec else None
        self.flat: tuple[type, tuple[Any, ...]] | None = None
        if type(template) is Seq and all(type(i) in (TensorSpec, Value) for i in template.items):
            self.flat = (
                template.kind,
                tuple(_signature(i) if type(i) is TensorSpec else i for i in template.items),
            )

    def build(
        self, new_handle: Callable[[], Handle], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[int | None], Any]:
        sig = self.single
        if sig is not None:
            handle = new_handle()
            return [handle.id], wrap_signature(sig, handle)
        outs: list[int | None] = []
        flat = self.flat
        if flat is not None:
            items: list[Any] = []
            for node in flat[1]:
                if type(node) is tuple:
                    handle = new_handle()
                    outs.append(handle.id)
                    items.append(wrap_signature(node, handle))
                else:
                    outs.append(None)
                    items.append(node.value)
            return outs, (items if flat[0] is list else tuple(items))
        result = _build(self.template, new_handle, args, kwargs, outs)
        return outs, result


def _signature(spec: TensorSpec) -> tuple[Any, ...]:
    if spec.bits:
        return (spec.shape, spec.stride, spec.offset, spec.dtype, spec.bits)
    return (spec.shape, spec.stride, spec.offset, spec.dtype)


def _build(
    node: Any,
    new_handle: Callable[[], Handle],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    outs: list[int | None],
) -> Any:
    kind = type(node)
    if kind is TensorSpec:
        handle = new_handle()
        outs.append(handle.id)
        return wrap(node.shape, node.stride, node.offset, node.dtype, handle, node.bits)
    if kind is Seq:
        items = [_build(item, new_handle, args, kwargs, outs) for item in node.items]
        return items if node.kind is list else tuple(items)
    if kind is AliasOf:
        outs.append(None)
        position = node.position
        target = args[position] if isinstance(position, int) else kwargs[position]
        if node.spec is not None and isinstance(target, RemoteTensor):
            set_metadata(target, node.spec)
        return target
    outs.append(None)
    return node.value


class NeedsWorker(Exception):
    """Meta inference cannot say (data-dependent shape, no meta kernel): ask the worker."""


Layout = Callable[[tuple[Any, ...], dict[str, Any]], Any]
"""An op's outputs as a Plan template (TensorSpec, Seq, Value), or None for the meta kernel."""

EXACT: dict[Any, Layout] = {}
"""OpOverload → its outputs' layout, for ops whose meta kernel is missing or differs from the
device kernel the worker runs (cuDNN's RNN: gpupool.torch.rnn). Consulted before the meta
kernel, on plan-cache misses only."""


def infer_plan(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    exact = EXACT.get(info.func)
    if exact is not None:
        template = exact(args, kwargs)
        if template is not None:
            _COUNTS["rules"] += 1
            return Plan(template)
    _COUNTS["meta"] += 1
    meta_args = [to_meta(a) for a in args]
    meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    try:
        out = info.func(*meta_args, **meta_kwargs)
    except Exception as exc:
        raise NeedsWorker(f"{info.name}: {exc}") from exc
    returns = [out] if len(info.returns_alias) <= 1 else list(out)
    for value in returns:
        if isinstance(value, torch.Tensor) and value.layout == torch.sparse_coo:
            raise NeedsWorker(f"{info.name}: a sparse COO output, which the worker describes")
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            raise NotImplementedError(
                f"{info.name}: {value.layout} tensors are not supported on gpupool remote "
                "devices (strided and sparse COO ones are); use .to_sparse() or .to_dense() first"
            )
    nodes: list[Any] = []
    for value, alias in zip(returns, info.returns_alias or (None,), strict=False):
        if alias is None:
            nodes.append(describe(value))
        else:
            spec = describe(value) if info.has_out else None
            nodes.append(AliasOf(alias, spec if isinstance(spec, TensorSpec) else None))
    template = nodes[0] if len(info.returns_alias) <= 1 else Seq(tuple, tuple(nodes))
    return Plan(template)


def describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(
            tuple(value.shape), tuple(value.stride()), int(value.storage_offset()), value.dtype,
            math_bits(value),
        )  # fmt: skip
    if isinstance(value, list | tuple):
        return Seq(list if isinstance(value, list) else tuple, tuple(describe(v) for v in value))
    return Value(value)


def to_meta(value: Any) -> Any:
    if isinstance(value, RemoteTensor):
        return meta_like(value)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.dim() > 0:
            return meta_like(value)
        return value
    if isinstance(value, list | tuple):
        return (
            type(value)(to_meta(v) for v in value) if not isinstance(value, torch.Size) else value
        )
    if isinstance(value, torch.device) and (value.type == "meta" or is_remote_device(value)):
        return META
    return value


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the tensor's metadata, math bits included."""
    shape, stride, offset = tuple(tensor.shape), tensor.stride(), tensor.storage_offset()
    if offset == 0:
        meta = torch.empty_strided(shape, stride, dtype=tensor.dtype, device=META)
    else:
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True) if n > 0)
        if any(size == 0 for size in shape):
            extent = 0
        base = torch.empty(offset + extent, dtype=tensor.dtype, device=META)
        meta = base.as_strided(shape, stride, offset)
    bits = math_bits(tensor)
    if bits:
        set_math_bits(meta, bits)
    return meta


def set_metadata(tensor: RemoteTensor, spec: TensorSpec) -> None:
    """Make a wrapper's shape and strides those the worker's tensor now has (after out=)."""
    if (tuple(tensor.shape), tensor.stride(), tensor.storage_offset()) == (
        spec.shape,
        spec.stride,
        spec.offset,
    ):
        return
    restride(tensor, spec.shape, spec.stride, spec.offset)
