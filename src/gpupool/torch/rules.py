"""Output metadata by rule for op families whose outputs follow their inputs' sizes.

The plan cache is keyed by exact shapes, so a loop whose shapes change every step (decoding
grows its sequence by one each token) misses on every op, and each miss is a meta-kernel call
(on torch 2.13 many are Python references: 0.3 ms for `add`, 2 ms for `native_layer_norm`).
For the families here the output's sizes and strides are a plain function of the inputs'
sizes (broadcasting, a matrix product, a reduction, a concatenation), and its dtypes depend
only on what the *family key* holds: the op, each tensor argument's dtype and rank, and every
other argument as the plan cache keys it. So:

- the first miss of a family key still runs the meta kernel, and the rule is checked against
  it: the rule is used for that family key only if it gave exactly the meta kernel's sizes,
  strides and offsets (the dtypes are learned from it); a disagreement turns the rule off for
  that key for good;
- later misses of the key with other sizes take the rule: a few microseconds of Python;
- each rule states the preconditions under which it is exact (standard contiguous inputs for
  the elementwise families), and any call outside them goes to the meta kernel.

`tests/torch/test_shape_rules.py` checks every family against the meta kernels over many
random shapes, size-1 and broadcast dimensions included.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpupool.torch.shapes import _COUNTS, OpInfo, Plan, Seq, TensorSpec
from gpupool.torch.tensor import RemoteTensor, contiguous_strides

Shape = tuple[int, ...]
Layout = tuple[Shape, Shape]
"""(sizes, strides) of one output; its offset is 0."""
Rule = Callable[[tuple[Any, ...], dict[str, Any]], list[Layout] | None]

ENABLED = os.environ.get("GPUPOOL_SHAPE_RULES", "1") != "0"
"""`GPUPOOL_SHAPE_RULES=0`: every plan-cache miss calls the meta kernel (and attention asks
the worker for its kernel at every new shape), as before the rules: for comparisons."""
_UNKNOWN = object()
_KNOWN: dict[tuple[Any, ...], tuple[torch.dtype, ...] | None] = {}
"""Family key → the outputs' dtypes (the rule agreed with the meta kernel), or None (it did
not: that key always takes the meta kernel)."""
_RULES: dict[int, Rule | None] = {}
KNOWN_MAX = 8192


def _dense(tensor: RemoteTensor) -> Shape | None:
    """A remote tensor's shape if it is standard contiguous, without math bits and not empty."""
    sig = tensor._sig
    shape = sig[0]
    if len(sig) != 4 or sig[1] != contiguous_strides(shape) or 0 in shape:
        return None
    return shape


def _broadcast(shapes: list[Shape]) -> Shape | None:
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for shape in shapes:
        offset = rank - len(shape)
        for i, size in enumerate(shape):
            have = out[offset + i]
            if size == have or size == 1:
                continue
            if have != 1:
                return None
            out[offset + i] = size
    return tuple(out)


_LAYOUT_KEEPING = (None, torch.preserve_format, torch.contiguous_format)


def pointwise(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
    """Elementwise ops (torch's `pointwise` tag): standard contiguous inputs broadcast to a
    standard contiguous output. 0-dim host tensors (scalars) take part; anything else that is
    a tensor (a list of them, a host tensor with dimensions) leaves it to the meta kernel."""
    shapes: list[Shape] = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind is RemoteTensor:
            shape = _dense(value)
            if shape is None:
                return None
            shapes.append(shape)
        elif kind is torch.memory_format:
            if value not in _LAYOUT_KEEPING:
                return None
        elif isinstance(value, torch.Tensor):
            if value.dim() != 0:
                return None
        elif kind in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return None
    if not shapes:
        return None
    out = _broadcast(shapes)
    return None if out is None else [(out, contiguous_strides(out))]


def same_shape(outputs: int) -> Rule:
    """Ops whose every output has the first argument's shape (`_to_copy`, softmax, dropout),
    for a standard contiguous input and no layout asked for."""

    def rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
        first = args[0]
        if type(first) is not RemoteTensor or kwargs.get("memory_format") not in _LAYOUT_KEEPING:
            return None
        shape = _dense(first)
        if shape is None:
            return None
        for value in (*args[1:], *kwargs.values()):
            if isinstance(value, torch.Tensor) and not (
                type(value) is RemoteTensor and _dense(value) == shape
            ):
                return None
        return [(shape, contiguous_strides(shape))] * outputs

    return rule


def _sizes(value: Any, rank: int) -> Shape | None:
    if type(value) is not RemoteTensor or len(value._sig) != 4:
        return None
    shape: Shape = value._sig[0]
    return shape if len(shape) == rank and 0 not in shape else None


def matmul(rank: int, first: int) -> Rule:
    """mm / addmm (rank 2) and bmm / baddbmm (rank 3): a new contiguous [.., n, m] whatever
    the inputs' strides (a transposed weight). `first` is the position of the left matrix."""

    def rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
        if len(args) < first + 2:
            return None
        a, b = _sizes(args[first], rank), _sizes(args[first + 1], rank)
        if a is None or b is None or a[-1] != b[-2] or a[:-2] != b[:-2]:
            return None
        out = (*a[:-1], b[-1])
        return [(out, contiguous_strides(out))]

    return rule


def linear(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
    """linear of a contiguous [..., k] input and a [n, k] weight: a new contiguous [..., n]."""
    if len(args) < 2 or type(args[0]) is not RemoteTensor:
        return None
    shape = _dense(args[0])
    weight = _sizes(args[1], 2)
    if shape is None or not shape or weight is None or shape[-1] != weight[1]:
        return None
    out = (*shape[:-1], weight[0])
    return [(out, contiguous_strides(out))]


def layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
    """native_layer_norm: the output as the input; mean and rstd keep the leading dimensions
    with ones for the normalised ones."""
    x = args[0]
    if type(x) is not RemoteTensor or len(args) < 2:
        return None
    shape = _dense(x)
    normalized = args[1]
    if shape is None or not normalized or len(normalized) > len(shape):
        return None
    axis = len(shape) - len(normalized)
    if tuple(shape[axis:]) != tuple(normalized):
        return None
    stats = (*shape[:axis], *([1] * len(normalized)))
    stats_layout = (stats, contiguous_strides(stats))
    return [(shape, contiguous_strides(shape)), stats_layout, stats_layout]


def cat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
    """cat of standard contiguous tensors of one rank: their sizes summed along `dim`."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, list | tuple) or not tensors or type(dim) is not int:
        return None
    shapes = []
    for tensor in tensors:
        if type(tensor) is not RemoteTensor:
            return None
        shape = _dense(tensor)
        if shape is None:
            return None
        shapes.append(shape)
    rank = len(shapes[0])
    if rank == 0 or not -rank <= dim < rank:
        return None
    dim %= rank
    total = 0
    for shape in shapes:
        if len(shape) != rank or shape[:dim] != shapes[0][:dim]:
            return None
        if shape[dim + 1 :] != shapes[0][dim + 1 :]:
            return None
        total += shape[dim]
    out = (*shapes[0][:dim], total, *shapes[0][dim + 1 :])
    return [(out, contiguous_strides(out))]


def embedding(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
    weight, indices = args[0], args[1]
    if _sizes(weight, 2) is None or type(indices) is not RemoteTensor:
        return None
    shape = _dense(indices)
    if shape is None:
        return None
    out = (*shape, weight._sig[0][1])
    return [(out, contiguous_strides(out))]


def reduction(dim_at: int, keepdim_at: int) -> Rule:
    """Reductions over a dim (argmax) or a list of them (sum, mean, amax): the reduced
    dimensions dropped, or kept as ones; none given means all."""

    def rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
        x = args[0]
        if type(x) is not RemoteTensor:
            return None
        shape = _dense(x)
        if shape is None or not shape:
            return None
        dims = args[dim_at] if len(args) > dim_at else kwargs.get("dim")
        keep = args[keepdim_at] if len(args) > keepdim_at else kwargs.get("keepdim", False)
        rank = len(shape)
        if dims is None or (isinstance(dims, list | tuple) and not dims):
            chosen = set(range(rank))
        else:
            listed = [dims] if type(dims) is int else list(dims)
            if any(type(d) is not int or not -rank <= d < rank for d in listed):
                return None
            chosen = {d % rank for d in listed}
            if len(chosen) != len(listed):
                return None
        if keep:
            out: Shape = tuple(1 if i in chosen else n for i, n in enumerate(shape))
        else:
            out = tuple(n for i, n in enumerate(shape) if i not in chosen)
        return [(out, contiguous_strides(out))]

    return rule


def attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Layout] | None:
    """aten::scaled_dot_product_attention (the composite, sent whole when no gradient is
    needed): [..., L, Ev] of the query's batch dimensions and the value's last."""
    if len(args) < 3:
        return None
    q, k, v = args[0], args[1], args[2]
    if any(type(t) is not RemoteTensor or len(t._sig) != 4 for t in (q, k, v)):
        return None
    qs, ks, vs = q._sig[0], k._sig[0], v._sig[0]
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4 or 0 in qs or 0 in ks or 0 in vs:
        return None
    if qs[0] != ks[0] or qs[1] != ks[1] or ks[:3] != vs[:3] or qs[3] != ks[3]:
        return None
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if mask is not None or kwargs.get("enable_gqa"):
        return None
    out = (*qs[:3], vs[3])
    return [(out, contiguous_strides(out))]


aten = torch.ops.aten
_NAMED: dict[Any, Rule] = {
    aten._to_copy.default: same_shape(1),
    aten._softmax.default: same_shape(1),
    aten._log_softmax.default: same_shape(1),
    aten.native_dropout.default: same_shape(2),
    aten.mm.default: matmul(2, 0),
    aten.addmm.default: matmul(2, 1),
    aten.bmm.default: matmul(3, 0),
    aten.baddbmm.default: matmul(3, 1),
    aten.linear.default: linear,
    aten.native_layer_norm.default: layer_norm,
    aten.cat.default: cat,
    aten.embedding.default: embedding,
    aten.argmax.default: reduction(1, 2),
    aten.argmin.default: reduction(1, 2),
    aten.sum.dim_IntList: reduction(1, 2),
    aten.mean.dim: reduction(1, 2),
    aten.amax.default: reduction(1, 2),
    aten.amin.default: reduction(1, 2),
    aten.scaled_dot_product_attention.default: attention,
}


def rule_of(info: OpInfo) -> Rule | None:
    """The op's rule: named above, or `pointwise` for ops torch tags so (one tensor out)."""
    rule = _RULES.get(id(info), _UNKNOWN)
    if rule is _UNKNOWN:
        func = info.func
        rule = _NAMED.get(func)
        if rule is None and torch.Tag.pointwise in func.tags and not info.has_out:
            returns = func._schema.returns
            if len(returns) == 1 and str(returns[0].type) == "Tensor":
                rule = pointwise
        _RULES[id(info)] = rule
    return rule  # type: ignore[return-value]


def _family(key: Sequence[Any]) -> tuple[Any, ...]:
    """The plan-cache key with each tensor's signature cut to its dtype and rank."""
    out: list[Any] = []
    for item in key:
        if type(item) is tuple:
            if item and item[0] == "host":  # ("host", shape, dtype)
                out.append(("host", len(item[1]), item[2]))
            else:  # (shape, stride, offset, dtype[, bits])
                out.append((len(item[0]), item[3], len(item)))
        else:
            out.append(item)
    return tuple(out)


def plan(
    info: OpInfo, key: Sequence[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Plan | None:
    """The op's plan from its rule, where its family key was checked against the meta kernel;
    None sends the caller to the meta kernel."""
    if not ENABLED:
        return None
    rule = rule_of(info)
    if rule is None:
        return None
    dtypes = _KNOWN.get((info, *_family(key)))
    if dtypes is None:
        return None
    layouts = rule(args, kwargs)
    if layouts is None or len(layouts) != len(dtypes):
        return None
    _COUNTS["rules"] += 1
    return _plan(layouts, dtypes)


def learn(
    info: OpInfo, key: Sequence[Any], args: tuple[Any, ...], kwargs: dict[str, Any], made: Plan
) -> None:
    """After a meta-kernel call: whether the rule gives what the meta kernel gave, for this
    family key (decided once: a key the rule got wrong never uses it)."""
    rule = rule_of(info)
    if rule is None:
        return
    family = (info, *_family(key))
    if family in _KNOWN:
        return
    layouts = rule(args, kwargs)
    if layouts is None:
        return  # outside the rule's preconditions: a later call may decide
    specs = _specs(made.template)
    agrees = specs is not None and len(specs) == len(layouts)
    if agrees:
        assert specs is not None
        for spec, (shape, stride) in zip(specs, layouts, strict=True):
            if (spec.shape, spec.stride, spec.offset, spec.bits) != (shape, stride, 0, 0):
                agrees = False
                break
    if len(_KNOWN) >= KNOWN_MAX:
        _KNOWN.clear()
    _KNOWN[family] = tuple(s.dtype for s in specs) if agrees and specs is not None else None


def _specs(template: Any) -> list[TensorSpec] | None:
    if type(template) is TensorSpec:
        return [template]
    if type(template) is Seq and template.kind is tuple:
        items = list(template.items)
        if all(type(i) is TensorSpec for i in items):
            return items
    return None


def _plan(layouts: list[Layout], dtypes: tuple[torch.dtype, ...]) -> Plan:
    specs = [
        TensorSpec(shape, stride, 0, dtype)
        for (shape, stride), dtype in zip(layouts, dtypes, strict=True)
    ]
    return Plan(specs[0] if len(specs) == 1 else Seq(tuple, tuple(specs)))


def known_families() -> dict[str, int]:
    """How many family keys each way (`rule`: checked and used; `meta`: the rule disagreed)."""
    used = sum(1 for v in _KNOWN.values() if v is not None)
    return {"rule": used, "meta": len(_KNOWN) - used}
