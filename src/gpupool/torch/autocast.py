"""torch.autocast("cuda") for remote tensors, applied where their ops are dispatched.

PyTorch's own CUDA autocast is keyed by the tensor's C++ device, which for a RemoteTensor is
`meta`, so it never fires. The client applies CUDA's op lists itself, below autograd: an op of
the lower-precision list gets its float32 inputs cast (on the worker) to the autocast dtype, an
op of the float32 list gets its 16-bit inputs cast up. Autograd saw the op with its original
inputs, so the backward ops meet mixed dtypes (a bf16 gradient and the float32 weight it
saved); those are reconciled the same way, and autograd casts each gradient back to its
input's dtype, as it does after a real autocast region.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gpupool.torch.shapes import NeedsWorker, OpInfo, Plan
from gpupool.torch.tensor import RemoteTensor

LOWER_PRECISION = frozenset(
    {
        "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "addr", "mv", "matmul", "linear",
        "convolution", "_convolution", "conv_tbc", "_prelu_kernel", "linalg_vecdot",
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    }
)  # fmt: skip
FLOAT32 = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "native_layer_norm",
        "native_group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss_forward", "nll_loss2d_forward",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss_forward", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
        "_pdist_forward", "_cdist_forward", "renorm", "logsumexp", "_softmax", "_log_softmax",
        "prod", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "norm",
    }
)  # fmt: skip
FLOAT32_BY_DTYPE_ARG = frozenset({"sum", "prod", "cumsum", "cumprod", "linalg_vector_norm"})
"""CUDA autocast runs these in float32 by passing dtype=float32 when the caller gave none."""
PROMOTE = frozenset(
    {
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "linalg_cross", "dot", "vdot",
        "grid_sampler", "index_put", "index_put_", "scatter_add", "tensordot", "cat", "stack",
    }
)  # fmt: skip
LOWER_PRECISION_BACKWARD = frozenset(
    {
        "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "convolution_backward",
    }
)  # fmt: skip
"""Backward ops of lower-precision ops that meet a 16-bit gradient and a saved float32 input
(attention's, whose float32 logsumexp must stay so, are ATTENTION_BACKWARD below)."""
FLOAT32_BACKWARD = frozenset(
    {
        "native_layer_norm_backward", "native_group_norm_backward", "_softmax_backward_data",
        "_log_softmax_backward_data", "nll_loss_backward", "nll_loss2d_backward",
        "mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward", "l1_loss_backward",
        "binary_cross_entropy_backward", "kl_div_backward", "soft_margin_loss_backward",
    }
)  # fmt: skip
"""Backward ops of float32-list ops whose saved input is still 16-bit. (Batch norm is on
neither list: its kernels take a 16-bit input with float32 statistics, both ways.)"""
SOFTMAX_BACKWARD = frozenset({"_softmax_backward_data", "_log_softmax_backward_data"})
ATTENTION_BACKWARD = {
    "_scaled_dot_product_flash_attention_backward": 5,
    "_scaled_dot_product_flash_attention_for_cpu_backward": 5,
    "_scaled_dot_product_efficient_attention_backward": 6,
    "_scaled_dot_product_cudnn_attention_backward": 5,
}
"""Attention backward ops → the position of their logsumexp. Autograd saved the float32
query, key and value an attention op met under autocast (the casts ran below it), while its
output and gradient are 16-bit: they are cast like the forward's, all but the float32
logsumexp (nn.MultiheadAttention's projections reach attention in float32)."""
POLICY_OPS = (
    LOWER_PRECISION
    | FLOAT32
    | FLOAT32_BY_DTYPE_ARG
    | PROMOTE
    | LOWER_PRECISION_BACKWARD
    | FLOAT32_BACKWARD
    | ATTENTION_BACKWARD.keys()
)
"""Ops whose dispatch asks this module first (a frozenset lookup for every other op)."""
POLICY_LISTS = (
    LOWER_PRECISION,
    FLOAT32,
    FLOAT32_BY_DTYPE_ARG,
    PROMOTE,
    LOWER_PRECISION_BACKWARD,
    FLOAT32_BACKWARD,
    SOFTMAX_BACKWARD,
    frozenset(ATTENTION_BACKWARD),
)
POLICY_BITS = tuple(1 << i for i in range(len(POLICY_LISTS)))
"""One bit per list above, in its order: the compiled dispatch (gpupool.torch._fastpath)
makes adjust()'s decisions from an op's bits without looking up its name."""


def policy_bits(short_name: str) -> int:
    """The lists an op is on, as POLICY_BITS (0: autocast leaves it alone)."""
    if short_name not in POLICY_OPS:
        return 0
    lists = zip(POLICY_BITS, POLICY_LISTS, strict=True)
    return sum(bit for bit, names in lists if short_name in names)


_state = threading.local()
_casts: weakref.WeakKeyDictionary[Any, tuple[int, torch.dtype, Any]] = weakref.WeakKeyDictionary()
"""Weight → its 16-bit copy, valid while the weight's version is unchanged."""
_ORIGINALS: dict[str, Any] = {}


def _enabled() -> tuple[bool, torch.dtype]:
    """Whether autocast("cuda") is on in this thread, and its dtype. Inside __torch_dispatch__
    PyTorch hides its own autocast state (every key above Python is excluded), so the state is
    mirrored as torch.autocast sets it."""
    return getattr(_state, "enabled", False), getattr(_state, "dtype", torch.float16)


def _set_autocast_enabled(*args: Any) -> None:
    _ORIGINALS["set_autocast_enabled"](*args)
    was = getattr(_state, "enabled", False)
    if len(args) == 2 and args[0] == "cuda":
        _state.enabled = bool(args[1])
    elif len(args) == 1:  # the old signature meant CUDA
        _state.enabled = bool(args[0])
    if _state.enabled and not was:
        _casts.clear()  # a new region (the next step): last step's weight copies are stale


def _set_autocast_dtype(device_type: str, dtype: torch.dtype) -> None:
    _ORIGINALS["set_autocast_dtype"](device_type, dtype)
    if device_type == "cuda":
        _state.dtype = dtype


def install() -> None:
    if _ORIGINALS:
        return
    _ORIGINALS["set_autocast_enabled"] = torch.set_autocast_enabled
    _ORIGINALS["set_autocast_dtype"] = torch.set_autocast_dtype
    torch.set_autocast_enabled = _set_autocast_enabled  # type: ignore[assignment]
    torch.set_autocast_dtype = _set_autocast_dtype
    _state.enabled = torch.is_autocast_enabled("cuda")
    _state.dtype = torch.get_autocast_dtype("cuda")


def uninstall() -> None:
    if _ORIGINALS:
        torch.set_autocast_enabled = _ORIGINALS.pop("set_autocast_enabled")
        torch.set_autocast_dtype = _ORIGINALS.pop("set_autocast_dtype")


_SIXTEEN = (torch.float16, torch.bfloat16)
_PLAIN = (int, bool, float)
_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
_current_node = torch._C._current_autograd_node


Cast = tuple[torch.dtype, tuple[torch.dtype, ...]]
FLOAT32_DTYPE = "dtype=float32"
"""forward_rule's answer for an op of FLOAT32_BY_DTYPE_ARG: pass dtype=torch.float32."""


def forward_rule(
    name: str,
    target: torch.dtype,
    dtypes: Callable[[], set[torch.dtype]],
    dtype_given: bool,
    takes_dtype: bool = True,
) -> Cast | str | None:
    """What autocast does to a forward op under autocast to `target`: (dtype, the dtypes of
    tensors cast to it), FLOAT32_DTYPE, or None (nothing). `dtypes()` gives the float dtypes
    of the op's positional device tensors (asked only where the lists need it). The one
    decision eager autocast (`adjust`) and the trace's kernels (`_trace_kernel`) both make;
    the client's compiled path (`_fastpath.c`, "autocast") makes it for plain tensors."""
    if name in LOWER_PRECISION:
        return target, (torch.float32,)
    if name in FLOAT32_BY_DTYPE_ARG:
        if takes_dtype and not dtype_given and dtypes().intersection(_SIXTEEN):
            return FLOAT32_DTYPE
        return (torch.float32, _SIXTEEN) if name in FLOAT32 else None
    if name in FLOAT32:
        return torch.float32, _SIXTEEN
    if name in PROMOTE:
        widest = _widest_of(dtypes())
        return None if widest is None else (widest, _ELIGIBLE)
    return None


def adjust(
    info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The op's arguments after autocast's casts (unchanged outside autocast and backward)."""
    name = info.short_name
    enabled, target = _enabled()
    if enabled:
        rule = forward_rule(
            name, target, lambda: _float_dtypes(args), kwargs.get("dtype") is not None
        )
        if rule is None:
            return args, kwargs
        if isinstance(rule, str):  # FLOAT32_DTYPE
            return args, {**kwargs, "dtype": torch.float32}
        dtype, sources = rule
        return _cast(args, dtype, sources), _cast_kw(kwargs, dtype, sources)
    if name in SOFTMAX_BACKWARD and _float32_output_of_16bit_input(args):
        # The forward ran in float32 (autocast), but autograd recorded the 16-bit input
        # dtype: compute the gradient in float32; autograd casts it back to the input's dtype.
        return (*args[:3], torch.float32, *args[4:]), kwargs
    if _current_node() is None:
        return args, kwargs
    # In backward: only ops that meet both a 16-bit and a float32 input need help.
    dtypes = _float_dtypes(args)
    if torch.float32 not in dtypes or not dtypes.intersection(_SIXTEEN):
        return args, kwargs
    logsumexp = ATTENTION_BACKWARD.get(name)
    if logsumexp is not None:
        return _attention_backward(args, kwargs, logsumexp)
    if name in LOWER_PRECISION_BACKWARD:
        low = torch.bfloat16 if torch.bfloat16 in dtypes else torch.float16
        return _cast(args, low, (torch.float32,)), _cast_kw(kwargs, low, (torch.float32,))
    if name in FLOAT32_BACKWARD or name in FLOAT32:
        return _cast(args, torch.float32, _SIXTEEN), _cast_kw(kwargs, torch.float32, _SIXTEEN)
    return args, kwargs


def _attention_backward(
    args: tuple[Any, ...], kwargs: dict[str, Any], logsumexp: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The float32 tensors of an attention backward op, its logsumexp aside, in the dtype of
    its 16-bit gradient (the dtype its forward ran in)."""
    grad = args[0]
    if not isinstance(grad, RemoteTensor) or grad.dtype not in _SIXTEEN:
        return args, kwargs
    low, sources = grad.dtype, (torch.float32,)
    cast = list(_cast(args, low, sources))
    cast[logsumexp] = args[logsumexp]
    return tuple(cast), _cast_kw(kwargs, low, sources)


def infer_with_reconciliation(
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    infer: Callable[[OpInfo, tuple[Any, ...], dict[str, Any]], Plan],
) -> Plan:
    """Meta inference; a backward op that fails only for mixing 16-bit and float32 inputs is
    a leftover of autocast this module does not list, so say so instead of guessing."""
    try:
        return infer(info, args, kwargs)
    except NeedsWorker as exc:
        dtypes = _float_dtypes(args)
        mixed = torch.float32 in dtypes and dtypes.intersection(_SIXTEEN)
        if mixed and _current_node() is not None and "dtype" in str(exc).lower():
            raise NotImplementedError(
                f"{info.name} met mixed float32/16-bit inputs in backward after autocast; "
                "gpupool's autocast emulation does not cover this op yet"
            ) from exc
        raise


def _float32_output_of_16bit_input(args: tuple[Any, ...]) -> bool:
    output, input_dtype = args[1], args[3] if len(args) > 3 else None
    return (
        isinstance(output, RemoteTensor)
        and output.dtype == torch.float32
        and input_dtype in _SIXTEEN
    )


def _cast(
    args: tuple[Any, ...], dtype: torch.dtype, sources: tuple[torch.dtype, ...]
) -> tuple[Any, ...]:
    # Most calls cast nothing (activations already in the target dtype), and where one does
    # (a convolution's float32 weight) the other arguments are sizes and flags: only tensors
    # and tensor lists are looked at, with the dtype kept in each wrapper's signature, and a
    # new tuple is built only when something changes.
    out: list[Any] | None = None
    for i, a in enumerate(args):
        kind = type(a)
        if kind is RemoteTensor:
            current = a._sig[3]
            if current not in sources or current == dtype:
                continue
        elif kind is list or kind is tuple:
            # Sizes, strides and paddings (int lists) never cast; tensor lists (cat, foreach)
            # go to _cast_value, which casts them when their first item is remote.
            if not a or not isinstance(a[0], RemoteTensor):
                continue
        elif not isinstance(a, RemoteTensor):
            continue
        cast = _cast_value(a, dtype, sources)
        if cast is not a:
            if out is None:
                out = list(args)
            out[i] = cast
    return args if out is None else tuple(out)


def _cast_kw(
    kwargs: dict[str, Any], dtype: torch.dtype, sources: tuple[torch.dtype, ...]
) -> dict[str, Any]:
    if not kwargs:
        return kwargs
    return {k: _cast_value(v, dtype, sources) for k, v in kwargs.items()}


def _cast_value(value: Any, dtype: torch.dtype, sources: tuple[torch.dtype, ...]) -> Any:
    kind = type(value)
    if kind is int or kind is float or kind is bool or value is None:
        return value  # most arguments of a convolution or matmul: nothing to look at
    if kind is RemoteTensor or isinstance(value, RemoteTensor):
        current = value.dtype
        if current in sources and current != dtype:
            if value.is_leaf and value.requires_grad:
                return _cached_cast(value, dtype)
            # Goes through the dispatcher below autograd: a worker-side cast, invisible to autograd.
            return torch.ops.aten._to_copy.default(value, dtype=dtype)
        return value
    if isinstance(value, list | tuple) and value and isinstance(value[0], RemoteTensor):
        return type(value)(_cast_value(v, dtype, sources) for v in value)
    return value


def _cached_cast(weight: RemoteTensor, dtype: torch.dtype) -> Any:
    """A weight's 16-bit copy, made once per step: its forward and its backward (which meets
    the saved float32 weight again) share it, as CUDA autocast's own cast cache does."""
    cached = _casts.get(weight._gp)
    if cached is not None and cached[0] == weight._version and cached[1] == dtype:
        return cached[2]
    cast = torch.ops.aten._to_copy.default(weight, dtype=dtype)
    _casts[weight._gp] = (weight._version, dtype, cast)
    return cast


def _float_dtypes(args: tuple[Any, ...]) -> set[torch.dtype]:
    found: set[torch.dtype] = set()
    for value in args:
        if type(value) is RemoteTensor:
            dtype = value._sig[3]
            if dtype in _ELIGIBLE:
                found.add(dtype)
        elif isinstance(value, RemoteTensor):
            if value.dtype in _ELIGIBLE:
                found.add(value.dtype)
        elif isinstance(value, list | tuple) and value and type(value[0]) not in _PLAIN:
            found |= _float_dtypes(tuple(value))  # tensor lists; sizes and masks hold none
    return found


def _widest_of(dtypes: set[torch.dtype]) -> torch.dtype | None:
    """What a promote-list op casts its float tensors to: None unless their dtypes differ."""
    if len(dtypes) < 2:
        return None
    return torch.float32 if torch.float32 in dtypes else torch.bfloat16


# ---- autocast inside a trace (torch.compile'd training calls, gpupool.torch.joint) ---------
#
# AOTAutograd traces a compiled module on fake tensors of the remote tensors' C++ device
# (`gpupool:N`, PyTorch's PrivateUse1), which none of the above sees. There the casts must be
# in the graph, as a local torch.compile puts them: above autograd, so that the backward
# graph casts each gradient back to its input's dtype. PyTorch keeps no op lists for
# PrivateUse1's autocast key, so the same lists as above are registered there, with the same
# decisions; the key only takes part while autocast is on for that device type, which
# `traced_autocast` turns on for the length of a trace.

_TRACE_KEY = torch._C.DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]
_TRACE_LIBRARY: list[Any] = []
"""The torch.library registrations (kept alive: dropping the Library drops its kernels)."""


def _backend() -> str:
    """PrivateUse1's name (gpupool's, once a remote device is attached): only its tensors
    are autocast's to cast, as CUDA autocast casts CUDA tensors only (not CPU scalars)."""
    return torch._C._get_privateuse1_backend_name()


def _trace_cast(value: Any, dtype: torch.dtype, sources: tuple[torch.dtype, ...]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dtype in sources and value.dtype != dtype and value.device.type == _backend():
            return value.to(dtype)
        return value
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return type(value)(_trace_cast(v, dtype, sources) for v in value)
    return value


def _trace_dtypes(values: Any) -> set[torch.dtype]:
    found: set[torch.dtype] = set()
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type == _backend():
            if value.dtype in _ELIGIBLE:
                found.add(value.dtype)
        elif isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
            found |= _trace_dtypes(value)
    return found


def _trace_kernel(op: Any, name: str) -> Callable[..., Any]:
    """adjust()'s decisions for one op at PrivateUse1's autocast key (casts on the fakes)."""
    takes_dtype = any(argument.name == "dtype" for argument in op._schema.arguments)
    exclude = torch._C.DispatchKeySet(_TRACE_KEY)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        target = torch.get_autocast_dtype(_backend())
        rule = forward_rule(
            name, target, lambda: _trace_dtypes(args), kwargs.get("dtype") is not None, takes_dtype
        )
        cast = None
        if isinstance(rule, str):  # FLOAT32_DTYPE
            kwargs = {**kwargs, "dtype": torch.float32}
        else:
            cast = rule
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if cast is not None:
                args = tuple(_trace_cast(a, *cast) for a in args)
                kwargs = {k: _trace_cast(v, *cast) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return kernel


def _register_trace_kernels() -> None:
    if _TRACE_LIBRARY:
        return
    if not torch._C._dispatch_has_backend_fallback(_TRACE_KEY):
        # Every other op passes the key by, as CUDA's autocast key lets them pass.
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(torch.library.fallthrough_kernel, _TRACE_KEY.name)
        _TRACE_LIBRARY.append(fallback)
    library = torch.library.Library("aten", "IMPL")
    for name in sorted(LOWER_PRECISION | FLOAT32 | FLOAT32_BY_DTYPE_ARG | PROMOTE):
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:  # not in this torch version
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            qualified = name if overload == "default" else f"{name}.{overload}"
            if not any("Tensor" in str(argument.type) for argument in op._schema.arguments):
                continue
            try:
                if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), _TRACE_KEY):
                    library.impl(qualified, _trace_kernel(op, name), _TRACE_KEY.name)
            except RuntimeError:  # an overload Python names but the dispatcher does not have
                continue
    _TRACE_LIBRARY.append(library)


@contextlib.contextmanager
def traced_autocast(dtype: torch.dtype) -> Iterator[None]:
    """Autocast to `dtype` for fake tensors of gpupool's C++ device, while a trace runs."""
    _register_trace_kernels()
    device_type = _backend()
    was = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    set_enabled = _ORIGINALS.get("set_autocast_enabled", torch.set_autocast_enabled)
    set_dtype = _ORIGINALS.get("set_autocast_dtype", torch.set_autocast_dtype)
    set_enabled(device_type, True)
    set_dtype(device_type, dtype)
    try:
        yield
    finally:
        set_enabled(device_type, was[0])
        set_dtype(device_type, was[1])


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """This thread's autocast("cuda") off: for the ops of a graph traced under autocast,
    whose casts are in it (cast again here, a decomposition's op could change dtype)."""
    was = getattr(_state, "enabled", False)
    _state.enabled = False
    try:
        yield
    finally:
        _state.enabled = was
