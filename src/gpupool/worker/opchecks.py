"""Argument checks for the aten ops a worker runs only after checking what PyTorch trusts.

PyTorch's kernels trust some of their arguments: a backward op trusts that the saved tensors it
is given are the ones its forward made, `_reshape_alias` trusts its strides, a sparse
constructor trusts its indices, `unsafe=True` switches bounds checks off. On a worker every
argument comes from a tenant, so an op the policy (`oppolicy`) marks "check" runs behind one of
the checks here, which refuse (`OpRefused`, a RuntimeError the client sees as the op's error)
before any kernel reads or writes memory the tensors do not own. Ops without a check keep the
bare C++ callable: the checks cost nothing where they are not needed.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gpupool.worker.cudnn_rnn import DROPOUT_STATES


class OpRefused(RuntimeError):
    """An op's arguments would make its kernel reach outside its tensors."""


Args = dict[str, Any]
Pre = Callable[[Args], None]
Post = Callable[[Args, Any], Any]


@dataclass(frozen=True)
class Check:
    """What guards one op: `pre` sees (and may fix) the bound arguments before the kernel runs;
    `post` sees the result before the executor stores it."""

    pre: Pre | None = None
    post: Post | None = None
    needs: frozenset[str] = frozenset()
    """Arguments the check reads by name: every op it guards has them, in every torch the
    table covers (a test compares them with each registry's schemas)."""
    grad: Callable[[Args], bool] | None = None
    """Autograd's mode the kernel runs under (a worker runs with it off): for a kernel that
    chooses by it what it computes, the mode its client had, as the arguments say it."""


# ---- binding ----------------------------------------------------------------------------------


class _Binder:
    """Names an op's arguments from its schema, the way the dispatcher would read them."""

    def __init__(self, schema: Any) -> None:
        self.positional = [a.name for a in schema.arguments if not a.kwarg_only]
        self.keyword = [a.name for a in schema.arguments if a.kwarg_only]
        self.defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        self.known = frozenset(self.positional) | frozenset(self.keyword)

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Args:
        if len(args) > len(self.positional):
            raise OpRefused(
                f"{len(args)} positional arguments, the op takes {len(self.positional)}"
            )
        bound: Args = dict(self.defaults)
        bound.update(zip(self.positional, args, strict=False))
        for name, value in kwargs.items():
            if name not in self.known:
                raise OpRefused(f"unknown argument {name!r}")
            bound[name] = value
        return bound

    def split(self, bound: Args) -> tuple[list[Any], dict[str, Any]]:
        """Back to the call's form: positional up to the last one given, the rest by name."""
        args = [bound[name] for name in self.positional if name in bound]
        kwargs = {name: bound[name] for name in self.keyword if name in bound}
        return args, kwargs


def guard(name: str, check: Check, fn: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` behind `check`: what `_Op.call` becomes for an op the policy checks."""
    binder = _Binder(fn._schema)
    pre, post, grad = check.pre, check.post, check.grad

    def checked(*args: Any, **kwargs: Any) -> Any:
        bound = binder.bind(args, kwargs)
        try:
            if pre is not None:
                pre(bound)
        except OpRefused as exc:
            raise OpRefused(f"{name} refused: {exc}") from None
        call_args, call_kwargs = binder.split(bound)
        if grad is None:
            result = call(*call_args, **call_kwargs)
        else:
            with torch.set_grad_enabled(grad(bound)):
                result = call(*call_args, **call_kwargs)
        if post is None:
            return result
        try:
            return post(bound, result)
        except OpRefused as exc:
            raise OpRefused(f"{name} refused: {exc}") from None

    checked.__name__ = f"checked_{name.replace('::', '_').replace('.', '_')}"
    return checked


# ---- enum arguments ----------------------------------------------------------------------------

ENUM_TYPES: dict[str, type] = {
    "ScalarType": torch.dtype,
    "Layout": torch.layout,
    "MemoryFormat": torch.memory_format,
    "Device": torch.device,
}
"""Schema types whose values the client sends as extensions (DTYPE, LAYOUT, MEMORY_FORMAT,
DEVICE). PyTorch's binding also takes a bare int for them and casts it unchecked: dtype -1
segfaulted `new_full`, `randn`, `_to_copy`, `log_softmax` and a dozen more (the fuzzer's most
common crash), 2**40 was truncated to another dtype."""


def _enum_arguments(schema: Any) -> tuple[tuple[int | None, str, type], ...]:
    """(position or None for keyword-only, name, type) of each enum-typed argument."""
    found: list[tuple[int | None, str, type]] = []
    position = 0
    for argument in schema.arguments:
        kind = str(argument.real_type).removeprefix("Optional[").removesuffix("]")
        expected = ENUM_TYPES.get(kind)
        if expected is not None:
            found.append((None if argument.kwarg_only else position, argument.name, expected))
        if not argument.kwarg_only:
            position += 1
    return tuple(found)


_INFERRING = frozenset(
    {"view", "view_copy", "reshape", "_reshape_copy", "_unsafe_view", "_mkldnn_reshape",
     "expand", "expand_copy", "broadcast_to", "unflatten"}
)  # fmt: skip
"""Ops whose size lists may hold -1: "infer this size" (view, reshape and their kin) or "keep
this size" (expand, broadcast_to)."""
_SIZE_NAMES = frozenset({"size", "sizes", "shape"})
_SIZE_SUFFIXES = ("_size", "_sizes", "_shape")
_INT_LISTS = frozenset({"List[int]", "List[SymInt]"})


def _size_arguments(schema: Any) -> tuple[tuple[int | None, str, int], ...]:
    """(position or None for keyword-only, name, smallest entry allowed) of each argument that
    lists a tensor's sizes: a list of ints (`SymInt[]`, `int[]`) named `size`, `sizes`, `shape`
    or `..._size(s)` / `..._shape` (`output_size`, `input_sizes`, `normalized_shape` ...)."""
    base = schema.name.partition("::")[2]
    lowest = -1 if base in _INFERRING else 0
    found: list[tuple[int | None, str, int]] = []
    position = 0
    for argument in schema.arguments:
        kind = str(argument.real_type)
        if kind.startswith("Optional["):
            kind = kind.removeprefix("Optional[").removesuffix("]")
        name = argument.name
        if kind in _INT_LISTS and (name in _SIZE_NAMES or name.endswith(_SIZE_SUFFIXES)):
            found.append((None if argument.kwarg_only else position, name, lowest))
        if not argument.kwarg_only:
            position += 1
    return tuple(found)


def _smallest(value: Any) -> Any:
    """The smallest entry of a size list as the client sent it (an int stands for a list of
    itself), or None where it holds no comparable numbers (torch's binding refuses those)."""
    if isinstance(value, list | tuple):
        if not value:
            return None
        try:
            return min(value)
        except TypeError:
            return None
    return value if isinstance(value, int) else None


def argument_guard(name: str, fn: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` behind what every op with such arguments needs, whatever the policy says of it:
    its enum arguments (dtype, layout, memory format, device) must be of their torch type, and
    its size lists hold no negative size (-1 only where it means "infer" or "keep"). ATen
    takes a negative size next to a 0 (the product is 0, nothing to allocate): `rand.out` with
    [-2, 0, 6, 2**62, 3] left its `out` with a negative size whose strides were never computed,
    and the next read of it crashed the worker. Ops with neither kind of argument keep `call`
    itself; the others pay one Python frame and a few comparisons."""
    enums = _enum_arguments(fn._schema)
    sizes = _size_arguments(fn._schema)
    if not enums and not sizes:
        return call

    def guarded(*args: Any, **kwargs: Any) -> Any:
        for position, arg, expected in enums:
            if position is not None and position < len(args):
                value = args[position]
            else:
                value = kwargs.get(arg)
            if value is not None and type(value) is not expected:
                raise OpRefused(
                    f"{name} refused: {arg} must be a torch.{expected.__name__}, "
                    f"not {type(value).__name__}"
                )
        for position, arg, lowest in sizes:
            if position is not None and position < len(args):
                value = args[position]
            else:
                value = kwargs.get(arg)
            smallest = _smallest(value)
            if smallest is not None and smallest < lowest:
                allowed = (
                    "-1 (infer) is the only negative size" if lowest else "a size is not negative"
                )
                raise OpRefused(f"{name} refused: {arg} holds {smallest}: {allowed}")
        return call(*args, **kwargs)

    guarded.__name__ = f"guarded_{name.replace('::', '_').replace('.', '_')}"
    return guarded


_RESIZING_IN_PLACE = ("resize", "set_", "as_strided_", "_resize_output")


def may_resize(schema: Any) -> bool:
    """Whether an op may change the sizes of a tensor it writes: one that writes an argument
    other than `self` (`out=`, `grad_input=` ...: resized to the result), or one of the
    in-place ops that change `self`'s sizes. In-place arithmetic (`add_`, `copy_`) only
    writes values: it keeps the bare call."""
    written = [
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]
    if any(name != "self" for name in written):
        return True
    base = schema.name.partition("::")[2]
    return bool(written) and base.startswith(_RESIZING_IN_PLACE)


# ---- small facts about tensors -----------------------------------------------------------------


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise OpRefused(f"{what} must be a tensor")
    return value


def _present(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() > 0


def _ints(value: Any, what: str) -> list[int]:
    if isinstance(value, torch.Size | list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise OpRefused(f"{what} must be a list of ints")


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise OpRefused(f"{what} must be an int")
    return value


def _integral(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise OpRefused(f"{what} must hold integers, not {tensor.dtype}")


def _in_range(tensor: torch.Tensor, low: int, high: int, what: str) -> None:
    """Every value of an index tensor in [low, high): one reduction (a sync on a GPU)."""
    _integral(tensor, what)
    if tensor.numel() == 0:
        return
    smallest, largest = int(tensor.min()), int(tensor.max())
    if smallest < low or largest >= high:
        raise OpRefused(f"{what} holds values in [{smallest}, {largest}], outside [{low}, {high})")


def _shape(tensor: torch.Tensor, expected: Sequence[int], what: str) -> None:
    if list(tensor.shape) != list(expected):
        raise OpRefused(f"{what} has shape {list(tensor.shape)}, expected {list(expected)}")


def _numel(tensor: torch.Tensor, expected: int, what: str) -> None:
    if tensor.numel() != expected:
        raise OpRefused(f"{what} has {tensor.numel()} elements, expected {expected}")


def _covers(tensor: torch.Tensor, count: int, what: str) -> None:
    """At least `count` elements that are really there: a kernel that walks the data pointer
    reads `count` elements past the offset, whatever the tensor's strides claim."""
    available = tensor.untyped_storage().nbytes() // max(tensor.element_size(), 1)
    available -= int(tensor.storage_offset())
    if tensor.numel() < count or available < count:
        raise OpRefused(f"{what} holds {min(tensor.numel(), available)} elements, needs {count}")


def reach_bytes(sizes: Sequence[int], strides: Sequence[int], offset: int, itemsize: int) -> int:
    """One past the last byte a strided view reads: 0 for an empty view."""
    if any(size == 0 for size in sizes):
        return 0
    last = offset + sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))
    return (last + 1) * itemsize


# ---- views -------------------------------------------------------------------------------------


def _within_storage(a: Args) -> None:
    """`_reshape_alias` takes sizes and strides as given, and `as_strided_` with a stride of
    2**63 - 1 got past torch's bounds check (its product overflowed; a READ of the view then
    crashed the worker): the view must stay in its storage, counted without overflow."""
    tensor = _tensor(a["self"], "self")
    sizes, strides = _ints(a["size"], "size"), _ints(a["stride"], "stride")
    if len(sizes) != len(strides):
        raise OpRefused(f"{len(sizes)} sizes and {len(strides)} strides")
    if any(s < 0 for s in sizes) or any(s < 0 for s in strides):
        raise OpRefused(f"negative sizes or strides {sizes} {strides}")
    given = a.get("storage_offset")
    offset = int(tensor.storage_offset()) if given is None else _int(given, "storage_offset")
    if offset < 0:
        raise OpRefused(f"negative storage offset {offset}")
    needed = reach_bytes(sizes, strides, offset, tensor.element_size())
    held = tensor.untyped_storage().nbytes()
    if needed > held:
        raise OpRefused(
            f"sizes {sizes} and strides {strides} at offset {offset} reach "
            f"byte {needed} of a storage of {held} bytes"
        )


def _copy_outputs(a: Args, result: Any) -> Any:
    """Index tensors a sparse or nested tensor keeps inside: the caller gets a copy, so writing
    into it cannot move the tensor's own indices out of range."""
    if isinstance(result, torch.Tensor):
        return result.clone()
    if isinstance(result, tuple | list):
        return type(result)(r.clone() if isinstance(r, torch.Tensor) else r for r in result)
    return result


# ---- memory the worker did not write ----------------------------------------------------------


class ZeroFillUnavailable(RuntimeError):
    """The worker's torch has no switch to zero-fill its CPU allocations: it must not serve."""


_ZERO_FILL_FLAG = "FLAGS_caffe2_cpu_allocator_do_zero_fill"


def zero_fill_cpu_allocations() -> None:
    """Make every CPU allocation of this process's torch start zeroed.

    `empty*`, `new_empty*`, `resize_`, `set_` growing a storage and `.out` ops that resize their
    outputs hand back memory no kernel wrote: freed heap chunks that held the worker's own data
    (its environment, heap pointers, earlier tensors). Wrapping each such op cannot catch the
    `.out` kernels that resize and then write only part of the result, so the allocator itself
    zero-fills (c10's `caffe2_cpu_allocator_do_zero_fill`, read on every `alloc_cpu`). Its cost is
    one memset per CPU allocation: nothing measurable for small tensors, up to one more pass over
    a large fresh output (a CUDA worker allocates host memory only for staging and host tensors).
    Device memory from the CUDA caching allocator only ever held this lease's own tensors.
    """
    import torch

    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(library)), _ZERO_FILL_FLAG)
    except (OSError, ValueError) as exc:
        raise ZeroFillUnavailable(f"cannot zero-fill CPU allocations ({library}): {exc}") from exc
    flag.value = True


# ---- unsafe switches ---------------------------------------------------------------------------


def _force_safe(a: Args) -> None:
    """`unsafe=True` skips the index checks of `segment_reduce` and `_index_put_impl_`: the
    worker always runs the checked path (same results for valid input)."""
    a["unsafe"] = False


# ---- sparse ------------------------------------------------------------------------------------


def _uncoalesced(a: Args) -> None:
    """`is_coalesced=True` is a promise (sorted, unique indices) kernels rely on and nothing
    checks: the worker drops it (the tensor is coalesced again when an op needs it)."""
    if a.get("is_coalesced") is not None:
        a["is_coalesced"] = None


def _valid_sparse(a: Args, result: Any) -> Any:
    """A sparse tensor is checked as PyTorch's own `check_invariants=True` would: indices in
    range, shapes that agree (the constructors skip it by default; the `_unsafe` and
    `_with_dims_and_tensors` ones always). Building one touches no memory at its indices; the
    first op that uses it would."""
    for value in result if isinstance(result, tuple | list) else (result,):
        if isinstance(value, torch.Tensor):
            _validate_sparse(value)
    return result


def _validate_sparse(tensor: torch.Tensor) -> None:
    layout = tensor.layout
    try:
        if layout == torch.sparse_coo:
            if tensor._indices().size(0) != tensor.sparse_dim():
                raise OpRefused("indices do not match the sparse dimensions")
            torch._validate_sparse_coo_tensor_args(
                tensor._indices(), tensor._values(), tensor.size()
            )
        elif layout in (torch.sparse_csr, torch.sparse_bsr):
            torch._validate_sparse_compressed_tensor_args(
                tensor.crow_indices(), tensor.col_indices(), tensor.values(), tensor.size(), layout
            )
        elif layout in (torch.sparse_csc, torch.sparse_bsc):
            torch._validate_sparse_compressed_tensor_args(
                tensor.ccol_indices(), tensor.row_indices(), tensor.values(), tensor.size(), layout
            )
    except (RuntimeError, ValueError, IndexError) as exc:
        if isinstance(exc, OpRefused):
            raise
        raise OpRefused(f"invalid sparse tensor: {str(exc).splitlines()[0]}") from None


# ---- ops whose saved tensors come from the client -------------------------------------------


def _segments(a: Args) -> None:
    """`segment_reduce` validates `lengths` on its checked path but never `offsets` (negative or
    decreasing offsets read outside the data), and neither is checked in its backward: both
    are checked here as torch documents them. Along `axis`, lengths are non-negative and sum to
    the data's size; offsets start at 0, never decrease and end at the size; their leading
    dimensions are the data's before `axis`."""
    data = _tensor(a["data"], "data")
    if _present(a.get("indices")):
        raise OpRefused("indices are not supported (use lengths or offsets)")
    axis = _int(a.get("axis", 0), "axis")
    if not -data.dim() <= axis < max(data.dim(), 1) or data.dim() == 0:
        raise OpRefused(f"axis {axis} out of range for {data.dim()} dimensions")
    axis %= data.dim()
    size = data.size(axis)
    lengths, offsets = a.get("lengths"), a.get("offsets")
    if (lengths is None) == (offsets is None):
        raise OpRefused("exactly one of lengths and offsets")
    given = _tensor(lengths if lengths is not None else offsets, "segments")
    what = "lengths" if lengths is not None else "offsets"
    _integral(given, what)
    if given.dim() != axis + 1 or list(given.shape[:axis]) != list(data.shape[:axis]):
        raise OpRefused(
            f"{what} has shape {list(given.shape)} for data {list(data.shape)} at axis {axis}"
        )
    if given.device != data.device:
        raise OpRefused(f"{what} is on {given.device}, data on {data.device}")
    values = given.to(torch.int64)
    if lengths is not None:
        if values.numel() and int(values.min()) < 0:
            raise OpRefused("lengths must not be negative")
        if values.numel() and bool((values.sum(-1) != size).any()):
            raise OpRefused(f"lengths must sum to data.size({axis}) = {size}")
        if values.numel() == 0 and size != 0:
            raise OpRefused(f"no lengths for data.size({axis}) = {size}")
        return
    if values.size(-1) == 0:
        raise OpRefused("offsets must hold at least one value")
    if bool((values[..., 0] != 0).any()) or bool((values[..., -1] != size).any()):
        raise OpRefused(f"offsets must start at 0 and end at data.size({axis}) = {size}")
    if values.size(-1) > 1 and bool((values[..., 1:] < values[..., :-1]).any()):
        raise OpRefused("offsets must not decrease")


def _segment_forward(a: Args) -> None:
    _segments(a)
    a["unsafe"] = False


def _segment_backward(a: Args) -> None:
    """`_segment_reduce_backward` trusts lengths/offsets: they are validated against the data,
    and grad and output must have the forward's shape."""
    _segments(a)
    data = _tensor(a["data"], "data")
    forward = torch.ops.aten.segment_reduce.default(
        data, a["reduce"], lengths=a.get("lengths"), offsets=a.get("offsets"),
        axis=a.get("axis", 0), unsafe=False, initial=a.get("initial"),
    )  # fmt: skip
    _shape(_tensor(a["output"], "output"), forward.shape, "output")
    _shape(_tensor(a["grad"], "grad"), forward.shape, "grad")


def _unchecked_indices(a: Args) -> None:
    """`_unsafe_index` and `_unsafe_index_put` skip the bounds check of `index`/`index_put`:
    each integer index tensor must lie in [-size, size) of the dimension it indexes (a boolean
    mask indexes as many dimensions as it has and must match them)."""
    inp = _tensor(a["self"], "self")
    indices = a["indices"]
    if not isinstance(indices, list | tuple):
        raise OpRefused("indices must be a list")
    dim = 0
    for i, index in enumerate(indices):
        if index is None:
            dim += 1
            continue
        index = _tensor(index, f"indices[{i}]")
        if index.dtype in (torch.bool, torch.uint8):
            span = max(index.dim(), 1)
            if list(inp.shape[dim : dim + span]) != list(index.shape):
                raise OpRefused(f"mask indices[{i}] {list(index.shape)} does not match self")
            dim += span
            continue
        if dim >= inp.dim():
            raise OpRefused(f"too many indices for {inp.dim()} dimensions")
        size = inp.size(dim)
        _in_range(index, -size, size, f"indices[{i}]")
        dim += 1


def _same_lengths(a: Args) -> None:
    """`_foreach_*` ops walk every list argument with the length of `self`: a shorter list
    crashed the worker."""
    first = a.get("self")
    if not isinstance(first, list | tuple):
        return
    for name, value in a.items():
        if isinstance(value, list | tuple) and len(value) != len(first):
            raise OpRefused(f"{name} has {len(value)} entries for {len(first)} in self")


MAX_POLYNOMIAL_DEGREE = 1 << 16
"""The largest degree the special polynomial family is evaluated at on a worker. Their CPU
kernels run a recurrence of `n` steps per element that no one can interrupt (2^62 held a worker
for good); a degree past 65,536 has no use in float arithmetic. A per-op CPU-time budget would
need to kill the worker mid-kernel, losing the lease's tensors: refusing the argument is exact
and costs one reduction."""


MAX_VIEWS = 1 << 16
"""How many tensors one split may return: each is a Python object and a reply entry, and a
count the tenant picks (`tensor_split(x, 2**40)`, `split(x.expand(2**40), 1)`) held the worker
for ever (the fuzzer's hang)."""


def _few_views(a: Args) -> None:
    """The split family returns a list whose length the arguments choose: bounded."""
    inp = a.get("self")
    dim = a.get("dim", 0)
    size = 0
    if isinstance(inp, torch.Tensor) and isinstance(dim, int) and -inp.dim() <= dim < inp.dim():
        size = int(inp.size(dim))
    choosers = ("sections", "chunks", "split_size", "split_sizes", "indices", "indices_or_sections")
    # unbind: one tensor per element along dim
    counts = [size] if not any(k in a for k in choosers) else []
    for name in ("sections", "chunks"):
        value = a.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            counts.append(value)
    split_size = a.get("split_size")
    if isinstance(split_size, int) and not isinstance(split_size, bool) and split_size > 0:
        counts.append(-(-size // split_size))
    for name in ("split_size", "split_sizes", "indices"):
        value = a.get(name)
        if isinstance(value, list | tuple):
            counts.append(len(value) + 1)
    many = max(counts, default=0)
    if many > MAX_VIEWS:
        raise OpRefused(f"it would return {many} tensors, past {MAX_VIEWS}")


def _polynomial_degree(a: Args) -> None:
    n = a["n"]
    if isinstance(n, torch.Tensor):
        if n.numel() == 0:
            return
        if n.dtype.is_complex:
            raise OpRefused("n must be real")
        largest = float(n.detach().abs().max()) if n.dtype != torch.bool else 1.0
    elif isinstance(n, int | float) and not isinstance(n, bool):
        largest = abs(float(n))
    else:
        return
    if not largest <= MAX_POLYNOMIAL_DEGREE:  # NaN too
        raise OpRefused(f"degree n up to {largest:g}, past {MAX_POLYNOMIAL_DEGREE}")


def _softmax_backward(a: Args) -> None:
    grad, output = _tensor(a["grad_output"], "grad_output"), _tensor(a["output"], "output")
    _shape(grad, output.shape, "grad_output")


def _layer_norm_backward(a: Args) -> None:
    inp = _tensor(a["input"], "input")
    normalized = _ints(a["normalized_shape"], "normalized_shape")
    axis = inp.dim() - len(normalized)
    if axis < 0 or list(inp.shape[axis:]) != normalized:
        raise OpRefused(f"normalized_shape {normalized} does not end input {list(inp.shape)}")
    _shape(_tensor(a["grad_out"], "grad_out"), inp.shape, "grad_out")
    rows, cols = math.prod(inp.shape[:axis]), math.prod(normalized)
    for name in ("mean", "rstd"):
        _covers(_tensor(a[name], name), rows, name)
    for name in ("weight", "bias"):
        if isinstance(a.get(name), torch.Tensor):
            _covers(a[name], cols, name)


_PER_CHANNEL = (
    "weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd", "save_var",
    "save_var_transform", "mean", "invstd", "sum_dy", "sum_dy_xmu",
)  # fmt: skip


_PARAMETERS = frozenset({"weight", "bias", "running_mean", "running_var"})


def _batch_norm(a: Args) -> None:
    """Batch-norm kernels (forward and backward) take an input of [batch, channels, ...], walk
    every per-channel tensor with its channel count and the gradient with its shape, and read
    the statistics their mode needs (`_batch_norm_statistics`)."""
    inp = _tensor(a["input"], "input")
    if inp.dim() < 2:
        # `_batch_norm_impl_index_backward` of an empty 1-d input wrote one size into an empty
        # list of them (the worker crashed); every kernel of the family reads size(1).
        raise OpRefused(f"input has {inp.dim()} dimensions, not [batch, channels, ...]")
    channels = inp.size(1)
    for name in ("grad_out", "grad_output"):
        if isinstance(a.get(name), torch.Tensor):
            _shape(a[name], inp.shape, name)
    for name in _PER_CHANNEL:
        value = a.get(name)
        # Saved statistics may be empty (eval mode saves none); a parameter or running
        # statistic that is given is read once per channel, empty or not (an empty weight
        # was read past its storage: the fuzzer's last two crashes).
        if isinstance(value, torch.Tensor) and (value.numel() > 0 or name in _PARAMETERS):
            _covers(value, channels, name)
    _batch_norm_statistics(a, inp)


_TRAINING_FLAGS = ("training", "train", "update")
_SAVED_SPREAD = ("save_invstd", "save_var", "save_var_transform")


def _batch_norm_statistics(a: Args, inp: torch.Tensor) -> None:
    """The CPU kernels read the statistics of their mode without asking whether they were given:
    in eval mode the running mean and variance, in a training backward the saved mean and
    inverse spread; a missing one was a null tensor read (`_native_batch_norm_legit.no_stats`
    with training=False crashed the worker). The forwards without a flag that take running
    statistics (`_batch_norm_no_update`; `_batch_norm_with_update` needs them anyway) read
    them too. And the training-flagged backward kernels divide by the batch's size: an empty
    input raised SIGFPE (`_batch_norm_impl_index_backward` answers an empty one itself)."""
    backward = any(isinstance(a.get(name), torch.Tensor) for name in ("grad_out", "grad_output"))
    flag = next((a[name] for name in _TRAINING_FLAGS if name in a), None)
    if flag is None:
        if backward or "running_mean" not in a:
            return  # the sync-batch-norm pieces and cuDNN's backward: their inputs are explicit
        training = False
    else:
        training = bool(flag)
    if not training:
        for name in ("running_mean", "running_var"):
            if not isinstance(a.get(name), torch.Tensor):
                raise OpRefused(f"{name} is needed in eval mode")
    elif backward:
        if not isinstance(a.get("save_mean"), torch.Tensor):
            raise OpRefused("save_mean is needed for a training backward")
        spread = next((name for name in _SAVED_SPREAD if name in a), None)
        if spread is not None and not isinstance(a.get(spread), torch.Tensor):
            raise OpRefused(f"{spread} is needed for a training backward")
    if backward and flag is not None and "impl_index" not in a and inp.numel() == 0:
        raise OpRefused("the backward of an empty batch")


def _group_norm_backward(a: Args) -> None:
    n, c, group = _int(a["N"], "N"), _int(a["C"], "C"), _int(a["group"], "group")
    hxw = _int(a["HxW"], "HxW")
    inp = _tensor(a["input"], "input")
    if min(n, c, group, hxw) < 0 or n * c * hxw != inp.numel():
        raise OpRefused(f"N={n} C={c} HxW={hxw} do not describe an input of {inp.numel()}")
    _shape(_tensor(a["grad_out"], "grad_out"), inp.shape, "grad_out")
    for name in ("mean", "rstd"):
        _covers(_tensor(a[name], name), n * group, name)
    if isinstance(a.get("weight"), torch.Tensor):
        _covers(a["weight"], c, "weight")


def _embedding_backward(a: Args) -> None:
    weights = _int(a["num_weights"], "num_weights")
    indices = _tensor(a["indices"], "indices")
    _in_range(indices, 0, weights, "indices")
    grad = _tensor(a["grad"], "grad" if "grad" in a else "grad_output")
    rows = math.prod(grad.shape[:-1]) if grad.dim() else 1
    if rows != indices.numel():
        raise OpRefused(f"grad has {rows} rows for {indices.numel()} indices")


def _embedding_grad(a: Args) -> None:
    a.setdefault("grad", a.get("grad_output"))
    _embedding_backward(a)


def _bag_offsets(offsets: torch.Tensor, count: int) -> None:
    _integral(offsets, "offsets")
    if offsets.dim() != 1:
        raise OpRefused("offsets must be one-dimensional")
    if offsets.numel() == 0:
        return
    if int(offsets[0]) != 0:
        raise OpRefused("offsets must start at 0")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise OpRefused("offsets must not decrease")
    if int(offsets[-1]) > count:
        raise OpRefused(f"offsets reach {int(offsets[-1])}, past {count} indices")


def _embedding_bag(a: Args) -> None:
    """The bag forward on CPU checks its offsets; the check here holds on every device."""
    weight, indices = _tensor(a["weight"], "weight"), _tensor(a["indices"], "indices")
    _in_range(indices, 0, weight.size(0) if weight.dim() else 0, "indices")
    offsets = a.get("offsets")
    if indices.dim() == 1 and isinstance(offsets, torch.Tensor):
        _bag_offsets(offsets, indices.numel())
    psw = a.get("per_sample_weights")
    if isinstance(psw, torch.Tensor):
        _numel(psw, indices.numel(), "per_sample_weights")


def _embedding_bag_backward(a: Args) -> None:
    """The bag backward ops read `offset2bag`, `bag_size` and `maximum_indices` that the
    forward made: each must fit the gradient and the indices it is used with."""
    indices = _tensor(a["indices"], "indices")
    grad = _tensor(a["grad"], "grad")
    if "num_weights" in a:
        _in_range(indices, 0, _int(a["num_weights"], "num_weights"), "indices")
    else:
        _in_range(indices, 0, _tensor(a["weight"], "weight").size(0), "indices")
    if grad.dim() != 2:
        raise OpRefused("grad must be [bags, embedding]")
    bags = grad.size(0)
    if isinstance(a.get("offsets"), torch.Tensor):
        _bag_offsets(a["offsets"], indices.numel())
    offset2bag = _tensor(a["offset2bag"], "offset2bag")
    if offset2bag.numel() > 0:
        _numel(offset2bag, indices.numel(), "offset2bag")
        _in_range(offset2bag, 0, max(bags, 1), "offset2bag")
    if isinstance(a.get("bag_size"), torch.Tensor):
        _numel(a["bag_size"], bags, "bag_size")
        _in_range(a["bag_size"], 0, indices.numel() + 1, "bag_size")
    maximum = a.get("maximum_indices")
    if a.get("mode") == 2 and isinstance(maximum, torch.Tensor):
        _shape(maximum, grad.shape, "maximum_indices")
        weights = a.get("num_weights")
        _in_range(maximum, -1, weights if isinstance(weights, int) else 0, "maximum_indices")
    psw = a.get("per_sample_weights")
    if isinstance(psw, torch.Tensor):
        _numel(psw, indices.numel(), "per_sample_weights")


def _pool_backward(a: Args, spatial: int) -> None:
    """Max-pool backward ops scatter into the input at the saved indices, unchecked."""
    grad = _tensor(a["grad_output"], "grad_output")
    indices = _tensor(a["indices"], "indices")
    inp = _tensor(a["self"], "self")
    _shape(indices, grad.shape, "indices")
    if inp.dim() < spatial:
        raise OpRefused(f"self has {inp.dim()} dimensions")
    _in_range(indices, 0, max(math.prod(inp.shape[-spatial:]), 1), "indices")
    if grad.dim() != inp.dim() or list(grad.shape[:-spatial]) != list(inp.shape[:-spatial]):
        raise OpRefused(f"grad_output {list(grad.shape)} does not match self {list(inp.shape)}")


def _ctc_backward(a: Args) -> None:
    """The CTC backward reads `log_alpha` as the forward shaped it: recompute the forward's
    shapes (which validates the lengths too) and compare."""
    log_probs, targets = _tensor(a["log_probs"], "log_probs"), _tensor(a["targets"], "targets")
    forward = (
        torch.ops.aten._ctc_loss.Tensor
        if isinstance(a["input_lengths"], torch.Tensor)
        else torch.ops.aten._ctc_loss.default
    )
    nll, alpha = forward(
        log_probs.detach(), targets, a["input_lengths"], a["target_lengths"],
        a.get("blank", 0), a.get("zero_infinity", False),
    )  # fmt: skip
    _shape(_tensor(a["log_alpha"], "log_alpha"), alpha.shape, "log_alpha")
    _shape(_tensor(a["neg_log_likelihood"], "neg_log_likelihood"), nll.shape, "neg_log_likelihood")
    _numel(_tensor(a["grad"], "grad"), nll.numel(), "grad")


def _pdist_backward(a: Args) -> None:
    inp = _tensor(a["self"], "self")
    rows = inp.size(0) if inp.dim() == 2 else -1
    if rows < 0:
        raise OpRefused("self must be two-dimensional")
    pairs = rows * (rows - 1) // 2
    _numel(_tensor(a["pdist"], "pdist"), pairs, "pdist")
    _covers(a["pdist"], pairs, "pdist")
    _shape(_tensor(a["grad"], "grad"), a["pdist"].shape, "grad")


def _cdist_backward(a: Args) -> None:
    x1, x2 = _tensor(a["x1"], "x1"), _tensor(a["x2"], "x2")
    if x1.dim() < 2 or x2.dim() < 2:
        raise OpRefused("x1 and x2 need two dimensions")
    try:
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    except RuntimeError as exc:
        raise OpRefused(str(exc)) from None
    expected = [*batch, x1.size(-2), x2.size(-2)]
    _shape(_tensor(a["cdist"], "cdist"), expected, "cdist")
    _shape(_tensor(a["grad"], "grad"), expected, "grad")


def _weight_norm_backward(a: Args) -> None:
    v = _tensor(a["saved_v"], "saved_v")
    dim = _int(a["dim"], "dim")
    _shape(_tensor(a["grad_w"], "grad_w"), v.shape, "grad_w")
    g, norms = _tensor(a["saved_g"], "saved_g"), _tensor(a["saved_norms"], "saved_norms")
    _shape(norms, g.shape, "saved_norms")
    if not -v.dim() <= dim < max(v.dim(), 1):
        raise OpRefused(f"dim {dim} out of range for {v.dim()} dimensions")
    _numel(norms, v.size(dim) if v.dim() else 1, "saved_norms")


def _weight_norm(a: Args) -> None:
    """`_weight_norm_interface` (weight_norm's fused forward) takes `dim` unwrapped (-1 read
    past its tensors), divides by `v.size(dim)` (0 raised SIGFPE) and reads one element of `g`
    per slice of `v` along `dim` without comparing sizes. `dim` is wrapped here, as
    `torch._weight_norm` wraps it before calling."""
    v, g = _tensor(a["v"], "v"), _tensor(a["g"], "g")
    dim = _int(a.get("dim", 0), "dim")
    if v.dim() == 0 or not -v.dim() <= dim < v.dim():
        raise OpRefused(f"dim {dim} out of range for v of {v.dim()} dimensions")
    dim %= v.dim()
    if dim not in (0, v.dim() - 1):
        raise OpRefused(f"dim {dim}: the fused kernel normalises along the first or last dim")
    a["dim"] = dim
    slices = v.size(dim)
    if slices == 0:
        raise OpRefused(f"v has no slices along dim {dim}")
    _numel(g, slices, "g")
    _covers(g, slices, "g")


def _batch_dims(a: Args) -> None:
    """`_new_zeros_with_same_feature_meta` (forward-mode AD's tangent maker) copies the first
    `self_num_batch_dims` sizes of `self` without comparing it with `self.dim()`: 255 read past
    the sizes and crashed the worker."""
    inp = _tensor(a["self"], "self")
    dims = _int(a.get("self_num_batch_dims", 0), "self_num_batch_dims")
    if not 0 <= dims <= inp.dim():
        raise OpRefused(f"self_num_batch_dims {dims} outside [0, {inp.dim()}]")


def _packed_batch_sizes(a: Args) -> None:
    """`_pad_packed_sequence` (`pad_packed_sequence`'s kernel) walks `batch_sizes` as
    `pack_padded_sequence` makes them and writes each sequence's length backwards from the end
    of a buffer of `batch_sizes[0]` entries: batch sizes that grow again wrote before that
    buffer (the worker crashed). They must be positive, never grow, and sum to the rows of
    `data`."""
    data, sizes = _tensor(a["data"], "data"), _tensor(a["batch_sizes"], "batch_sizes")
    if sizes.dim() != 1 or sizes.numel() == 0 or sizes.dtype != torch.int64:
        raise OpRefused("batch_sizes must be a non-empty 1-d int64 tensor")
    if data.dim() == 0:
        raise OpRefused("data must have at least one dimension")
    if int(sizes.min()) < 1:
        raise OpRefused("batch_sizes must be positive")
    if sizes.numel() > 1 and bool((sizes[1:] > sizes[:-1]).any()):
        raise OpRefused("batch_sizes must not grow")
    if int(sizes.sum()) != data.size(0):
        raise OpRefused(f"batch_sizes sum to {int(sizes.sum())}, data has {data.size(0)} rows")


def _repeats(a: Args) -> None:
    """`repeat_interleave` with `output_size` writes `sum(repeats)` elements into an output of
    `output_size` without comparing them, and takes negative repeats there: int32 repeats
    [2**31 - 1, -2**31, 7] sum to 6 and wrote far past it (the worker crashed). Repeats must
    not be negative and `output_size`, where given, must be their sum (for the `self` forms,
    each repeat counts once per element it repeats)."""
    repeats, inp = a["repeats"], a.get("self")
    if isinstance(repeats, torch.Tensor):
        _integral(repeats, "repeats")
        if repeats.dim() > 1:
            raise OpRefused("repeats must be 0-d or 1-d")
        if repeats.numel() and int(repeats.min()) < 0:
            raise OpRefused("repeats must not be negative")
        total = int(repeats.to(torch.int64).sum()) if repeats.numel() else 0
        single = repeats.numel() == 1
    else:
        total = _int(repeats, "repeats")
        if total < 0:
            raise OpRefused("repeats must not be negative")
        single = True
    size = a.get("output_size")
    if size is None:
        return
    if inp is not None and single:
        inp = _tensor(inp, "self")
        dim = a.get("dim")
        if dim is None:
            total *= inp.numel()
        else:
            dim = _int(dim, "dim")
            if not -max(inp.dim(), 1) <= dim < max(inp.dim(), 1):
                raise OpRefused(f"dim {dim} out of range for {inp.dim()} dimensions")
            total *= inp.size(dim) if inp.dim() else 1
    if _int(size, "output_size") != total:
        raise OpRefused(f"output_size {size} is not what repeats make ({total})")


def _chunk_cat(a: Args) -> None:
    """`_chunk_cat` (FSDP's) wraps `dim` as if a 0-d tensor had one dimension, then reads its
    size there: a 0-d input crashed the worker. Every input needs the dimension `dim` names."""
    tensors = a["tensors"]
    if not isinstance(tensors, list | tuple) or not tensors:
        raise OpRefused("tensors must be a non-empty list")
    dim = _int(a["dim"], "dim")
    for i, tensor in enumerate(tensors):
        ndim = _tensor(tensor, f"tensors[{i}]").dim()
        if not -ndim <= dim < ndim:
            raise OpRefused(f"dim {dim} out of range for tensors[{i}] of {ndim} dimensions")
    if _int(a["num_chunks"], "num_chunks") < 1:
        raise OpRefused("num_chunks must be positive")


MAX_ROUND_DECIMALS = 1024
"""The most decimals `round` takes on a worker: past about 308 a float64 rounds to itself or
to nan anyway, and the Python reference the worker's admission runs computes `10**-decimals`
as an exact integer (decimals -2**62 held the worker for good)."""


def _round_decimals(a: Args) -> None:
    decimals = a.get("decimals", 0)
    if abs(_int(decimals, "decimals")) > MAX_ROUND_DECIMALS:
        raise OpRefused(f"decimals {decimals} past +-{MAX_ROUND_DECIMALS}")


def _weight_norm_composite(a: Args) -> None:
    """`_weight_norm` runs the fused `_weight_norm_interface` (unguarded, below the worker's
    checks) when `dim` is 0 or the last dim: the same check then applies. Any other dim (-1
    normalises the whole tensor) goes through ordinary broadcasting ops."""
    v = _tensor(a["v"], "v")
    dim = _int(a.get("dim", 0), "dim")
    if v.dim() and dim in (0, v.dim() - 1):
        _weight_norm(a)


def _truncated_division(a: Args) -> None:
    """Integer `div(..., rounding_mode="trunc")` of the dtype's smallest value by -1 overflows
    in the CPU's divide instruction (SIGFPE killed the worker; "floor" handles it)."""
    if a.get("rounding_mode") != "trunc":
        return
    inp, other = a["self"], a["other"]
    if not isinstance(inp, torch.Tensor) or inp.dtype.is_floating_point or inp.dtype.is_complex:
        return
    if inp.dtype == torch.bool or inp.numel() == 0:
        return
    if isinstance(other, torch.Tensor):
        minus_one = other.numel() > 0 and bool((other == -1).any())
    else:
        minus_one = other == -1
    if minus_one and int(inp.min()) == torch.iinfo(inp.dtype).min:
        raise OpRefused(f"{torch.iinfo(inp.dtype).min} // -1 overflows {inp.dtype}")


def _unfold_backward(a: Args) -> None:
    """`unfold_backward` scatters `grad_in` into a tensor of `input_sizes` as `unfold(dim,
    size, step)` laid it out, without comparing `grad_in`'s shape: a forged one read past it
    (addresses of the worker's heap came back) and aborted. It must have the shape unfold
    makes (run on a meta tensor, whose checks apply too)."""
    grad = _tensor(a["grad_in"], "grad_in")
    sizes = _ints(a["input_sizes"], "input_sizes")
    dim, size, step = _int(a["dim"], "dim"), _int(a["size"], "size"), _int(a["step"], "step")
    try:
        expected = torch.empty(sizes, device="meta").unfold(dim, size, step).shape
    except (RuntimeError, ValueError, IndexError) as exc:
        raise OpRefused(f"invalid unfold: {str(exc).splitlines()[0]}") from None
    _shape(grad, expected, "grad_in")


FFT_NORMALIZATIONS = range(3)
"""`_fft_*`'s `normalization`: none, by 1/sqrt(n), by 1/n (aten's fft_norm_mode)."""


def _fft_dims(a: Args) -> None:
    """`_fft_r2c`, `_fft_c2r` and `_fft_c2c` (what every `torch.fft` function runs) take the
    dims as `torch.fft` wrapped them: a negative dim indexed before the tensor's sizes, one
    past the last after them, a repeated one freed a plan twice (all crashed the worker). The
    dims are wrapped here, must be distinct, and the transform sizes positive."""
    inp = _tensor(a["self"], "self")
    dims = _ints(a["dim"], "dim")
    if not dims:
        raise OpRefused("dim must name at least one dimension")
    ndim = inp.dim()
    if any(not -ndim <= d < ndim for d in dims):
        raise OpRefused(f"dim {dims} out of range for {ndim} dimensions")
    wrapped = [d % ndim for d in dims]
    if len(set(wrapped)) != len(wrapped):
        raise OpRefused(f"dim {dims} names a dimension twice")
    a["dim"] = wrapped
    if _int(a["normalization"], "normalization") not in FFT_NORMALIZATIONS:
        raise OpRefused(f"normalization {a['normalization']} is not 0, 1 or 2")
    if "last_dim_size" in a and _int(a["last_dim_size"], "last_dim_size") < 1:
        raise OpRefused(f"last_dim_size {a['last_dim_size']} must be positive")


def _cum_helper(a: Args) -> None:
    """`_cummax_helper` and `_cummin_helper` (cummax's and cummin's kernels) take `dim` as
    cummax wrapped it, and run on a non-empty input only (cummax answers the others itself):
    dim -1 of a [2, 3] input corrupted the worker's heap (it aborted when the session's tensors
    were freed), an empty input crashed or hung it. `dim` is wrapped here; values and indices
    must have the input's shape."""
    inp = _tensor(a["self"], "self")
    _shape(_tensor(a["values"], "values"), inp.shape, "values")
    _shape(_tensor(a["indices"], "indices"), inp.shape, "indices")
    if inp.numel() == 0 or inp.dim() == 0:
        raise OpRefused(f"self {list(inp.shape)} is empty or 0-d (cummax answers it without me)")
    dim = _int(a["dim"], "dim")
    if not -inp.dim() <= dim < inp.dim():
        raise OpRefused(f"dim {dim} out of range for {inp.dim()} dimensions")
    a["dim"] = dim % inp.dim()


_INT64_MIN = -(1 << 63)


def _matrix_power(a: Args) -> None:
    """`linalg_matrix_power` inverts the matrix and negates a negative exponent: -2**63 stays
    negative, and its square-and-multiply loop never ended (the fuzzer's hang). Any other
    exponent costs at most 63 squarings."""
    if _int(a["n"], "n") <= _INT64_MIN:
        raise OpRefused(f"exponent {a['n']} has no negation in int64")


def _copy_defined(a: Args) -> None:
    """The functional `copy` (and `copy.out`) clones `self` without asking whether it is a
    tensor: None, which the binding passes on as an undefined tensor, was a null read (the
    fuzzer's seed-12 crashes). Both operands must be tensors."""
    _tensor(a["self"], "self")
    _tensor(a["src"], "src")


MAX_QPARAM_BINS = 1 << 16
"""The most histogram bins `choose_qparams_optimized` searches on a worker (torch.ao asks for
200): each bin it gives up is one more pass over the input, and nothing interrupts a kernel."""


def _qparams_search(a: Args) -> None:
    """`choose_qparams_optimized` (torch.ao's qparams for embedding tables) reads `numel`
    floats at the input's data pointer from the host, then narrows a histogram of `n_bins`
    bins by up to `ratio` of them, one pass over the input per step: n_bins 2**24 with ratio
    1e308 held the worker for good. The input must be a float32 host tensor of at least
    `numel` elements, the bins at most MAX_QPARAM_BINS, the ratio in [0, 1]."""
    inp = _tensor(a["input"], "input")
    if inp.device.type != "cpu" or inp.dtype != torch.float32:
        raise OpRefused(f"input must be a float32 host tensor, not {inp.dtype} on {inp.device}")
    numel = _int(a["numel"], "numel")
    if not 0 <= numel <= inp.numel():
        raise OpRefused(f"numel {numel} outside [0, {inp.numel()}]")
    bins = _int(a["n_bins"], "n_bins")
    if not 1 <= bins <= MAX_QPARAM_BINS:
        raise OpRefused(f"n_bins {bins} outside [1, {MAX_QPARAM_BINS}]")
    ratio = a["ratio"]
    if not isinstance(ratio, int | float) or not 0.0 <= float(ratio) <= 1.0:
        raise OpRefused(f"ratio {ratio} outside [0, 1]")
    if not 1 <= _int(a["bit_width"], "bit_width") <= 16:
        raise OpRefused(f"bit_width {a['bit_width']} outside [1, 16]")


_OPTIMIZER_LISTS = (
    "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "momentum_buffer_list", "state_sums",
)  # fmt: skip


def _fused_optimizer(a: Args) -> None:
    """The fused optimizers walk every list with the params' sizes."""
    params = a["self"]
    if not isinstance(params, list | tuple):
        raise OpRefused("self must be a list of tensors")
    for name in _OPTIMIZER_LISTS:
        values = a.get(name)
        if not isinstance(values, list | tuple) or not values:
            continue
        if len(values) != len(params):
            raise OpRefused(f"{name} has {len(values)} tensors for {len(params)} params")
        for i, (value, param) in enumerate(zip(values, params, strict=True)):
            where = f"{name}[{i}]"
            _shape(_tensor(value, where), _tensor(param, f"self[{i}]").shape, where)
    steps = a.get("state_steps")
    if isinstance(steps, list | tuple) and steps:
        if len(steps) != len(params):
            raise OpRefused(f"state_steps has {len(steps)} tensors for {len(params)} params")
        for i, step in enumerate(steps):
            _numel(_tensor(step, f"state_steps[{i}]"), 1, f"state_steps[{i}]")


def _no_varlen(a: Args) -> None:
    """Packed variable-length attention reads the batch at cumulative offsets the caller gives:
    the worker runs attention on padded batches only (all the client's SDPA emits)."""
    for name in ("cum_seq_q", "cum_seq_k", "cu_seqlens_q", "cu_seqlens_k", "seqused_k"):
        if _present(a.get(name)):
            raise OpRefused(f"variable-length attention ({name}) does not run on a gpupool worker")


def _attention_backward(a: Args) -> None:
    """Fused attention backward ops read `out` and `logsumexp` with the query's sizes."""
    _no_varlen(a)
    query, out = _tensor(a["query"], "query"), _tensor(a["out"], "out")
    grad = _tensor(a["grad_out"] if "grad_out" in a else a["grad_out_"], "grad_out")
    if query.dim() != 4:
        raise OpRefused("query must be [batch, heads, length, dim]")
    _shape(grad, out.shape, "grad_out")
    if list(out.shape[:-1]) != list(query.shape[:-1]):
        raise OpRefused(f"out {list(out.shape)} does not match query {list(query.shape)}")
    batch, heads, length = query.shape[0], query.shape[1], query.shape[2]
    _covers(_tensor(a["logsumexp"], "logsumexp"), batch * heads * length, "logsumexp")
    for name in ("key", "value"):
        other = _tensor(a[name], name)
        if other.dim() != 4 or other.shape[0] != batch:
            raise OpRefused(f"{name} {list(other.shape)} does not match query {list(query.shape)}")


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


PADDINGS = tuple(f"{mode}_pad{n}d" for mode in ("reflection", "replication") for n in (1, 2, 3))
"""The padding forwards whose backward ops (`<forward>_backward`) `_pad_backward` checks."""


def _pad_backward(a: Args, forward: str) -> None:
    """Padding backward ops (`reflection_pad*d_backward`, `replication_pad*d_backward`) walk
    grad_output with the padded sizes of `self` and never compare them: grad_output must have
    the shape the forward makes (run on meta tensors, so the forward's own checks of the
    padding apply too)."""
    grad, inp = _tensor(a["grad_output"], "grad_output"), _tensor(a["self"], "self")
    padding = _ints(a["padding"], "padding")
    try:
        expected = getattr(torch.ops.aten, forward).default(_meta(inp), padding).shape
    except (RuntimeError, ValueError, IndexError) as exc:
        raise OpRefused(f"invalid padding {padding}: {str(exc).splitlines()[0]}") from None
    _shape(grad, expected, "grad_output")


def _slow_conv2d_backward(a: Args) -> None:
    """`_slow_conv2d_backward` (CPU conv2d's backward) trusts that weight, kernel_size, stride,
    padding and grad_output are the forward's: it unfolds `self` into columns of the kernel's
    size and multiplies them with grad_output. Each must describe one convolution of `self`."""
    grad, inp = _tensor(a["grad_output"], "grad_output"), _tensor(a["self"], "self")
    weight = _tensor(a["weight"], "weight")
    kernel = _ints(a["kernel_size"], "kernel_size")
    stride, padding = _ints(a["stride"], "stride"), _ints(a["padding"], "padding")
    if len(kernel) != 2 or len(stride) != 2 or len(padding) != 2:
        raise OpRefused("kernel_size, stride and padding need two values each")
    if min(kernel) < 1 or min(stride) < 1 or min(padding) < 0:
        raise OpRefused(f"kernel_size {kernel}, stride {stride}, padding {padding} out of range")
    if inp.dim() not in (3, 4):
        raise OpRefused(f"self must have 3 or 4 dimensions, not {inp.dim()}")
    channels, height, width = inp.shape[-3:]
    if weight.dim() not in (2, 4) or weight.numel() == 0:
        raise OpRefused(f"weight {list(weight.shape)} is not a conv2d weight")
    out_channels = weight.size(0)
    if weight.numel() != out_channels * channels * kernel[0] * kernel[1]:
        raise OpRefused(
            f"weight {list(weight.shape)} does not hold {channels} channels of kernel {kernel}"
        )
    if weight.dim() == 4 and list(weight.shape[1:]) != [channels, *kernel]:
        raise OpRefused(f"weight {list(weight.shape)} does not match self and kernel {kernel}")
    rows = (height + 2 * padding[0] - kernel[0]) // stride[0] + 1
    cols = (width + 2 * padding[1] - kernel[1]) // stride[1] + 1
    if rows < 1 or cols < 1:
        raise OpRefused(f"kernel {kernel} does not fit self {list(inp.shape)}")
    _shape(grad, [*inp.shape[:-3], out_channels, rows, cols], "grad_output")


# ---- oneDNN's LSTM layer ------------------------------------------------------------------------

_LSTM = 2
"""ideep::rnn_kind::LSTM, the only mode ATen asks of `mkldnn_rnn_layer` (its RNN and GRU modes
are never called by PyTorch)."""

_RNN_WORKSPACES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Each workspace an `mkldnn_rnn_layer` forward made on this worker, with the layer it was made
for: oneDNN's backward reads as many bytes of it as that layer's primitive says, whatever the
tensor holds, so a backward gets only a workspace this worker made for the same layer (by
identity: a tensor's `==` is elementwise, which weakref's dictionary would call)."""


def _dense(value: Any, shape: Sequence[int], dtype: torch.dtype, what: str) -> torch.Tensor:
    """A dense CPU tensor of `shape` and `dtype`: what the kernel makes contiguous itself (the
    weights, the incoming gradients) needs no more."""
    tensor = _tensor(value, what)
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        raise OpRefused(f"{what} must be a dense CPU tensor")
    if tensor.dtype != dtype:
        raise OpRefused(f"{what} is {tensor.dtype}, expected {dtype}")
    _shape(tensor, shape, what)
    return tensor


def _flat(value: Any, shape: Sequence[int], dtype: torch.dtype, what: str) -> torch.Tensor:
    """`_dense`, contiguous, and held by its storage: oneDNN views the data pointer with the
    layer's descriptor and never looks at sizes or strides."""
    tensor = _dense(value, shape, dtype, what)
    if not tensor.is_contiguous():
        raise OpRefused(f"{what} must be contiguous")
    _covers(tensor, tensor.numel(), what)
    return tensor


def _rnn_layer(a: Args, first: str) -> tuple[Any, ...]:
    """The layer both directions of the op describe: input [seq, batch, features] and the
    weights and hidden states that fit it. Returns what a workspace is made for."""
    if _int(a["mode"], "mode") != _LSTM:
        raise OpRefused(f"mode {a['mode']} is not LSTM ({_LSTM}), the only one PyTorch runs")
    if _ints(a["batch_sizes"], "batch_sizes"):
        raise OpRefused("packed sequences (batch_sizes) are not supported by this kernel")
    hidden = _int(a["hidden_size"], "hidden_size")
    if hidden < 1 or _int(a["num_layers"], "num_layers") < 1:
        raise OpRefused("hidden_size and num_layers must be positive")
    inp = _tensor(a["input"], "input")
    if inp.dim() != 3 or inp.numel() == 0:
        raise OpRefused("input must be a non-empty [seq, batch, features] tensor")
    seq, batch, features = inp.shape
    _flat(inp, inp.shape, torch.float32, "input")
    names = [first, *(f"weight{int(first[-1]) + i}" for i in (1, 2, 3))]
    _dense(a[names[0]], [4 * hidden, features], torch.float32, names[0])
    _dense(a[names[1]], [4 * hidden, hidden], torch.float32, names[1])
    if a["has_biases"]:
        for name in names[2:]:
            _dense(a[name], [4 * hidden], torch.float32, name)
    for name in ("hx_", "cx_" if "cx_" in a else "cx_tmp"):
        _flat(a[name], [batch, hidden], torch.float32, name)
    return (seq, batch, features, hidden, bool(a["reverse"]))


def _mkldnn_rnn_layer(a: Args) -> None:
    _rnn_layer(a, "weight0")


def _mkldnn_rnn_layer_made(a: Args, result: Any) -> Any:
    """Remember the workspace of a training forward, and the layer it is for."""
    workspace = result[3]
    if isinstance(workspace, torch.Tensor) and workspace.numel() > 0:
        _RNN_WORKSPACES[workspace] = (*_rnn_layer(a, "weight0"), workspace.numel())
    return result


def _mkldnn_rnn_layer_backward(a: Args) -> None:
    layer = _rnn_layer(a, "weight1")
    seq, batch, _, hidden, _ = layer
    workspace = _tensor(a["workspace"], "workspace")
    made = _RNN_WORKSPACES.get(workspace)
    if made is None or made[:-1] != layer:
        raise OpRefused("workspace was not made by this worker's forward of the same layer")
    _flat(workspace, [made[-1]], torch.uint8, "workspace")  # as made: not resized nor re-typed
    _flat(a["output"], [seq, batch, hidden], torch.float32, "output")
    for name in ("hy_", "cy_"):
        _flat(a[name], [batch, hidden], torch.float32, name)
    for name, shape in (("grad_output", [seq, batch, hidden]), ("grad_hy", [batch, hidden]),
                        ("grad_cy", [batch, hidden])):  # fmt: skip
        grad = a.get(name)
        if grad is not None:
            _dense(grad, shape, torch.float32, name)  # made contiguous by the kernel


_LSTM_LAYER_ARGS = (
    "input", "weight0", "weight1", "weight2", "weight3", "hx_", "cx_", "reverse", "batch_sizes",
    "mode", "hidden_size", "num_layers", "has_biases", "train",
)  # fmt: skip
_LSTM_LAYER_BACKWARD_ARGS = (
    "input", "weight1", "weight2", "weight3", "weight4", "hx_", "cx_tmp", "output", "hy_", "cy_",
    "grad_output", "grad_hy", "grad_cy", "reverse", "batch_sizes", "mode", "hidden_size",
    "num_layers", "has_biases", "workspace",
)  # fmt: skip


# ---- cuDNN's RNN --------------------------------------------------------------------------------

_CUDNN_GATES = {0: 1, 1: 1, 2: 4, 3: 3}
"""cudnnRNNMode_t (RNN_RELU, RNN_TANH, LSTM, GRU) → gates: a layer's weights have gates x hidden
rows."""
_CUDNN_LSTM = 2
_CUDNN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_CUDNN_BUFFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Each weight buffer a `_cudnn_rnn` forward made on this worker → the stack it was made for,
whether it trained, and its own and its reserve's sizes. cuDNN's backward reads as many bytes
of the weight buffer and the reserve as the stack's descriptors say, whatever the tensors
hold: a backward gets only a weight buffer this worker made for the same stack (by identity),
and a reserve of the size that forward's was (a retained graph passes a copy of it)."""

WEIGHT_FORMAT_WARNING = "RNN module weights are not part of single contiguous chunk of memory"
"""cuDNN's warning for a call without a weight buffer, which every call from a client is: its
weights arrive one by one and the worker copies them into cuDNN's layout (the advice,
`flatten_parameters()`, is for a local module)."""


def quiet_cudnn_rnn_warning() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=WEIGHT_FORMAT_WARNING, category=UserWarning)


def _on_device(value: Any, device: torch.device, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A dense tensor of `dtype` on the RNN's device: cuDNN reads its data pointer with the
    stack's data type."""
    tensor = _tensor(value, what)
    if tensor.layout != torch.strided or tensor.device != device:
        raise OpRefused(f"{what} must be a dense tensor on {device}")
    if tensor.dtype != dtype:
        raise OpRefused(f"{what} is {tensor.dtype}, expected {dtype}")
    return tensor


def _cudnn_stack(a: Args) -> tuple[Any, ...]:
    """The stack both `_cudnn_rnn` and its backward describe, checked: mode, sizes, the input
    [seq, batch, features] (or batch first) on a GPU, each layer's weights and the hidden
    states that fit them. Returns what a weight buffer is made for."""
    mode = _int(a["mode"], "mode")
    if mode not in _CUDNN_GATES:
        raise OpRefused(f"mode {mode} is not a cuDNN RNN mode (0-3)")
    if _ints(a["batch_sizes"], "batch_sizes"):
        raise OpRefused("packed sequences (batch_sizes) are not supported on a gpupool worker")
    hidden = _int(a["hidden_size"], "hidden_size")
    proj = _int(a["proj_size"], "proj_size")
    layers = _int(a["num_layers"], "num_layers")
    if hidden < 1 or layers < 1:
        raise OpRefused("hidden_size and num_layers must be positive")
    if proj < 0 or proj >= hidden or (proj and mode != _CUDNN_LSTM):
        raise OpRefused("proj_size must be 0, or smaller than hidden_size for an LSTM")
    inp = _tensor(a["input"], "input")
    if inp.layout != torch.strided or inp.device.type == "cpu":
        raise OpRefused("cuDNN's RNN runs on a CUDA worker, with a dense input on its GPU")
    if inp.dtype not in _CUDNN_DTYPES:
        raise OpRefused(f"input is {inp.dtype}; cuDNN's RNN takes floating tensors")
    if inp.dim() != 3 or inp.numel() == 0:
        raise OpRefused("input must be a non-empty three-dimensional tensor")
    device, dtype = inp.device, inp.dtype
    batch_first = bool(a["batch_first"])
    batch, seq = (inp.shape[0], inp.shape[1]) if batch_first else (inp.shape[1], inp.shape[0])
    features = inp.shape[2]
    directions = 2 if bool(a["bidirectional"]) else 1
    out = proj or hidden
    rows = _CUDNN_GATES[mode] * hidden
    hx = _on_device(a["hx"], device, dtype, "hx")
    _shape(hx, [layers * directions, batch, out], "hx")
    if not hx.is_contiguous():
        raise OpRefused("hx must be contiguous")
    cx = a.get("cx")
    if mode == _CUDNN_LSTM:
        cx = _on_device(cx, device, dtype, "cx")
        _shape(cx, [layers * directions, batch, hidden], "cx")
        if not cx.is_contiguous():
            raise OpRefused("cx must be contiguous")
    elif cx is not None:
        raise OpRefused("cx is for an LSTM only")
    stride0 = _int(a["weight_stride0"], "weight_stride0")
    if stride0 - (1 if proj else 0) not in (2, 4):
        raise OpRefused(f"weight_stride0 {stride0} does not fit the stack")
    has_biases = stride0 - (1 if proj else 0) == 4
    weights = a["weight"]
    if not isinstance(weights, list | tuple) or len(weights) != layers * directions * stride0:
        raise OpRefused(f"weight must be a list of {layers * directions * stride0} tensors")
    for layer in range(layers):
        inputs = features if layer == 0 else directions * out
        shapes = [[rows, inputs], [rows, out]]
        if has_biases:
            shapes += [[rows], [rows]]
        if proj:
            shapes.append([proj, hidden])
        for direction in range(directions):
            first = (layer * directions + direction) * stride0
            for i, shape in enumerate(shapes):
                what = f"weight[{first + i}]"
                _shape(_on_device(weights[first + i], device, dtype, what), shape, what)
    dropout = a["dropout"]
    if not isinstance(dropout, float | int) or not 0 <= dropout <= 1:
        raise OpRefused("dropout must be a probability")
    if a.get("dropout_state") is not None:
        raise OpRefused("dropout_state: the worker keeps cuDNN's dropout state (gpupool.worker."
                        "cudnn_rnn); the client sends none")  # fmt: skip
    return (mode, batch_first, seq, batch, features, hidden, proj, layers, directions,
            has_biases, dtype, device)  # fmt: skip


def _cudnn_rnn(a: Args) -> None:
    _cudnn_stack(a)
    if a.get("weight_buf") is not None:
        raise OpRefused("weight_buf: the worker makes the weight buffer (the client sends none)")


def _cudnn_rnn_made(a: Args, result: Any) -> Any:
    """Remember the weight buffer, for the stack it is, with the reserve's size and the
    dropout state the forward drew with (None without dropout)."""
    reserve, buffer = result[3], result[4]
    state = DROPOUT_STATES.get(buffer)
    _CUDNN_BUFFERS[buffer] = (
        _cudnn_stack(a),
        bool(a["train"]),
        buffer.numel(),
        reserve.numel(),
        state,
    )
    return result


def _exact_bytes(tensor: torch.Tensor, count: int, what: str) -> None:
    """Contiguous, `count` elements, all in its storage: read by its data pointer."""
    _numel(tensor, count, what)
    if not tensor.is_contiguous():
        raise OpRefused(f"{what} must be contiguous")
    _covers(tensor, count, what)


def _cudnn_rnn_backward(a: Args) -> None:
    stack = _cudnn_stack(a)
    batch_first, seq, batch = stack[1], stack[2], stack[3]
    hidden, proj, directions, dtype, device = stack[5], stack[6], stack[8], stack[10], stack[11]
    buffer = _tensor(a["weight_buf"], "weight_buf")
    made = _CUDNN_BUFFERS.get(buffer)
    if made is None or made[0] != stack:
        raise OpRefused("weight_buf was not made by this worker's forward of the same stack")
    if not bool(a["train"]) or not made[1]:
        raise OpRefused("cudnn RNN backward can only be called in training mode")
    _exact_bytes(buffer, made[2], "weight_buf")  # as made: not resized since
    a["dropout_state"] = made[4]  # the forward's, which the client's autograd did not see
    reserve = _on_device(a["reserve"], device, torch.uint8, "reserve")
    _exact_bytes(reserve, made[3], "reserve")
    output = _on_device(a["output"], device, dtype, "output")
    width = directions * (proj or hidden)
    shape = [batch, seq, width] if batch_first else [seq, batch, width]
    _shape(output, shape, "output")
    if not (output.transpose(0, 1) if batch_first else output).is_contiguous():
        raise OpRefused("output must be the forward's (sequence-major, contiguous)")
    grads = (
        ("grad_output", shape), ("grad_hy", list(a["hx"].shape)),
        ("grad_cy", list(a["cx"].shape) if a.get("cx") is not None else None),
    )  # fmt: skip
    for name, expected in grads:
        grad = a.get(name)
        if grad is None:
            continue
        if expected is None:
            raise OpRefused(f"{name} is for an LSTM only")
        _shape(_on_device(grad, device, dtype, name), expected, name)  # made contiguous


def _cudnn_rnn_gradients(a: Args, result: Any) -> Any:
    """The weights' gradients copied out of cuDNN's gradient buffer: as views into it their
    offsets would differ from the contiguous tensors the client describes."""
    dx, dhx, dcx, dw = result
    return dx, dhx, dcx, [g.clone() if isinstance(g, torch.Tensor) else g for g in dw]


_CUDNN_RNN_ARGS = (
    "input", "weight", "weight_stride0", "weight_buf", "hx", "cx", "mode", "hidden_size",
    "proj_size", "num_layers", "batch_first", "dropout", "train", "bidirectional",
    "batch_sizes", "dropout_state",
)  # fmt: skip
_CUDNN_RNN_BACKWARD_ARGS = (
    *_CUDNN_RNN_ARGS, "output", "grad_output", "grad_hy", "grad_cy", "reserve",
)  # fmt: skip


def _needs(*names: str) -> frozenset[str]:
    return frozenset(names)


CHECKS: dict[str, Check] = {
    "within_storage": Check(pre=_within_storage, needs=_needs("self", "size", "stride")),
    "copy_outputs": Check(post=_copy_outputs),
    "force_safe": Check(pre=_force_safe, needs=_needs("unsafe")),
    "segments": Check(pre=_segment_forward, needs=_needs("data", "unsafe", "axis")),
    "unchecked_indices": Check(pre=_unchecked_indices, needs=_needs("self", "indices")),
    "same_lengths": Check(pre=_same_lengths),
    "polynomial_degree": Check(pre=_polynomial_degree, needs=_needs("n")),
    "few_views": Check(pre=_few_views, needs=_needs("self")),
    "valid_sparse": Check(pre=_uncoalesced, post=_valid_sparse),
    "segment_backward": Check(
        pre=_segment_backward, needs=_needs("data", "reduce", "output", "grad")
    ),
    "softmax_backward": Check(pre=_softmax_backward, needs=_needs("grad_output", "output")),
    "layer_norm_backward": Check(
        pre=_layer_norm_backward,
        needs=_needs("input", "normalized_shape", "grad_out", "mean", "rstd"),
    ),
    "batch_norm": Check(pre=_batch_norm, needs=_needs("input")),
    # Forward under the client's autograd mode (`train` carries it: the kernel makes the
    # workspace a backward needs only with the mode on, and nothing else reads `train`).
    "mkldnn_rnn_layer": Check(
        pre=_mkldnn_rnn_layer,
        post=_mkldnn_rnn_layer_made,
        grad=lambda a: bool(a["train"]),
        needs=_needs(*_LSTM_LAYER_ARGS),
    ),
    "mkldnn_rnn_layer_backward": Check(
        pre=_mkldnn_rnn_layer_backward, needs=_needs(*_LSTM_LAYER_BACKWARD_ARGS)
    ),
    "cudnn_rnn": Check(pre=_cudnn_rnn, post=_cudnn_rnn_made, needs=_needs(*_CUDNN_RNN_ARGS)),
    "cudnn_rnn_backward": Check(
        pre=_cudnn_rnn_backward, post=_cudnn_rnn_gradients, needs=_needs(*_CUDNN_RNN_BACKWARD_ARGS)
    ),
    "group_norm_backward": Check(
        pre=_group_norm_backward,
        needs=_needs("N", "C", "HxW", "group", "input", "grad_out", "mean", "rstd"),
    ),
    "embedding_backward": Check(pre=_embedding_grad, needs=_needs("num_weights", "indices")),
    "embedding_bag": Check(pre=_embedding_bag, needs=_needs("weight", "indices")),
    "embedding_bag_backward": Check(
        pre=_embedding_bag_backward, needs=_needs("grad", "indices", "offset2bag")
    ),
    "pool2d_backward": Check(
        pre=partial(_pool_backward, spatial=2), needs=_needs("grad_output", "indices", "self")
    ),
    "pool3d_backward": Check(
        pre=partial(_pool_backward, spatial=3), needs=_needs("grad_output", "indices", "self")
    ),
    "ctc_backward": Check(
        pre=_ctc_backward,
        needs=_needs(
            "grad",
            "log_probs",
            "targets",
            "input_lengths",
            "target_lengths",
            "neg_log_likelihood",
            "log_alpha",
        ),
    ),
    "pdist_backward": Check(pre=_pdist_backward, needs=_needs("grad", "self", "pdist")),
    "cdist_backward": Check(pre=_cdist_backward, needs=_needs("grad", "x1", "x2", "cdist")),
    "weight_norm_backward": Check(
        pre=_weight_norm_backward,
        needs=_needs("grad_w", "saved_v", "saved_g", "saved_norms", "dim"),
    ),
    "slow_conv2d_backward": Check(
        pre=_slow_conv2d_backward,
        needs=_needs("grad_output", "self", "weight", "kernel_size", "stride", "padding"),
    ),
    **{
        f"{forward}_backward": Check(
            pre=partial(_pad_backward, forward=forward),
            needs=_needs("grad_output", "self", "padding"),
        )
        for forward in PADDINGS
    },
    "weight_norm": Check(pre=_weight_norm, needs=_needs("v", "g", "dim")),
    "weight_norm_composite": Check(pre=_weight_norm_composite, needs=_needs("v", "g", "dim")),
    "round_decimals": Check(pre=_round_decimals),
    "truncated_division": Check(pre=_truncated_division, needs=_needs("self", "other")),
    "unfold_backward": Check(
        pre=_unfold_backward, needs=_needs("grad_in", "input_sizes", "dim", "size", "step")
    ),
    "fft_dims": Check(pre=_fft_dims, needs=_needs("self", "dim", "normalization")),
    "batch_dims": Check(pre=_batch_dims, needs=_needs("self", "self_num_batch_dims")),
    "packed_batch_sizes": Check(pre=_packed_batch_sizes, needs=_needs("data", "batch_sizes")),
    "repeats": Check(pre=_repeats, needs=_needs("repeats")),
    "chunk_cat": Check(pre=_chunk_cat, needs=_needs("tensors", "dim", "num_chunks")),
    "cum_helper": Check(pre=_cum_helper, needs=_needs("self", "values", "indices", "dim")),
    "matrix_power": Check(pre=_matrix_power, needs=_needs("n")),
    "copy_defined": Check(pre=_copy_defined, needs=_needs("self", "src")),
    "qparams_search": Check(
        pre=_qparams_search, needs=_needs("input", "numel", "n_bins", "ratio", "bit_width")
    ),
    "fused_optimizer": Check(pre=_fused_optimizer, needs=_needs("self")),
    "no_varlen": Check(pre=_no_varlen),
    "attention_backward": Check(
        pre=_attention_backward, needs=_needs("query", "key", "value", "out", "logsumexp")
    ),
}
"""Every check the policy table may name, by name."""


# ---- index ranges a compiled program checks before it runs ----------------------------------

IndexRange = tuple[str, int, int]
"""(argument, low, high): every value of that index tensor must lie in [low, high)."""


def _embedding_range(a: Args) -> list[IndexRange]:
    return [("indices", 0, _int(a["num_weights"], "num_weights"))]


def _pool_range(a: Args, spatial: int) -> list[IndexRange]:
    inp = _tensor(a["self"], "self")
    return [("indices", 0, max(math.prod(inp.shape[-spatial:]), 1))]


INDEX_RANGES: dict[str, Callable[[Args], list[IndexRange]]] = {
    "embedding_backward": _embedding_range,
    "pool2d_backward": partial(_pool_range, spatial=2),
    "pool3d_backward": partial(_pool_range, spatial=3),
}
"""The checks (of CHECKS) whose only reading of tensor values is the range of index tensors,
with bounds that follow from constants and sizes: everything else they check is arguments and
geometry. A training step's backward has them (an embedding's and a max-pool's gradients), so
an Inductor-compiled program may hold such an op where the index tensor is one the program
takes in and never writes: the worker checks the range on that tensor before each compiled
call (`gpupool.worker.program`), the rest held in the op-by-op run on the same geometry, and a
kernel given indices in range stays inside its tensors whatever code Inductor wrote for it.
Each function takes the bound arguments (sizes real, values possibly fake) and returns the
ranges."""


def bind(fn: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Args:
    """An op's arguments by name, as its check sees them (`Check.pre`)."""
    return _Binder(fn._schema).bind(args, kwargs)


def check_range(tensor: Any, low: int, high: int, what: str) -> None:
    """Raise OpRefused unless `tensor` is an integer tensor with every value in [low, high)."""
    _in_range(_tensor(tensor, what), low, high, what)
