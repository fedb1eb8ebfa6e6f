"""Kernels registered with PyTorch's dispatcher while attached.

- CUDA dispatch key, `empty.memory_format` / `empty_strided`: every factory and every copy to
  `cuda:N` allocates through these two, so `torch.zeros(…, device="cuda")`, `.to("cuda:0")` and
  the factories inside library code all make RemoteTensors, at any call depth.
- PrivateUse1 (`gpupool`, a remote tensor's C++ device), the same two: what C++ composites and
  autograd formulas allocate with a remote tensor's options (`x[0] = 5`, `x[mask] = 0`, the
  zeros of clamp's backward) comes out as a remote tensor on the same device. Also the three
  ops that have a device kernel and a composite (`silu_backward`, ...), so they are not
  decomposed for a remote tensor. Everything else
  C++ runs on a remote tensor with the Python key excluded (host data turned into an index
  tensor, `x[[0, 2]]`) reaches the backend's fallback, which is the remote dispatcher.
- AutogradPrivateUse1, composite ops whose C++ picks its kernel by the tensor's device
  (which is not `cuda` in C++, so they would decompose in the client):
  `scaled_dot_product_attention` (the worker picks flash / efficient / cuDNN, the client calls
  that fused op), `batch_norm` (→ `_batch_norm_with_update`, cuDNN on a CUDA worker),
  `dropout` (→ the fused `native_dropout`), and the recurrent layers (`lstm`, `gru`,
  `rnn_tanh`, `rnn_relu`: gpupool.torch.rnn runs cuDNN on a CUDA worker as a local GPU
  does, the CPU path's cells on a CPU worker); and `linear`, sent whole
  when no gradient is needed (see linear()).

The autograd engine would run a device's backward on a thread of its own, one per device that
the device guard counts (PyTorch's Python guard counts one); remote ops need no such thread, so
backward runs in the calling thread while attached, as it does for CPU and meta tensors.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gpupool.torch import dispatch, rnn, rules, runtime
from gpupool.torch.shapes import op_info
from gpupool.torch.stream import stream_of
from gpupool.torch.tensor import BACKEND, RemoteTensor, ensure_backend, is_remote_device

aten = torch.ops.aten
_LIBRARIES: list[Any] = []

MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3
_SDP_CHOICES: dict[tuple[Any, ...], int] = {}
_SDP_ASKED: dict[tuple[Any, ...], int] = {}
"""Signatures asked about per shape-free family: past SDP_ASK_MAX the shapes vary (decoding),
and attention that needs no gradient goes to the worker whole instead of asking again."""
SDP_ASK_MAX = 2


OVERRIDE_WARNING = (
    r"(?s).*Overriding a previously registered kernel for the same operator and the same "
    r"dispatch key"
)
"""What a CUDA build of torch warns, once per kernel, when these replace its own: on purpose
here, so not printed (only this warning, only while registering them)."""


def install() -> None:
    if _LIBRARIES:
        return
    ensure_backend()
    if not hasattr(torch, BACKEND):
        torch._register_device_module(BACKEND, _BackendModule())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OVERRIDE_WARNING, category=UserWarning)
        cuda = torch.library.Library("aten", "IMPL", "CUDA")
        backend = torch.library.Library("aten", "IMPL", "PrivateUse1")
        for name, op in (
            ("empty.memory_format", aten.empty.memory_format),
            ("empty_strided", aten.empty_strided.default),
        ):
            cuda.impl(name, _factory_kernel(op))
            backend.impl(name, _factory_kernel(op))
        for name, op in {**_BELOW_PYTHON, **_KERNELS_OF_THEIR_OWN}.items():
            backend.impl(name, _op_kernel(op))
        backend.impl("_efficientzerotensor", _zeros)
        sparse = torch.library.Library("aten", "IMPL", "SparseCPU")
        sparse.impl("_to_copy", _sparse_to_copy)
        autograd = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
        for name, op, kernel in _COMPOSITES:
            autograd.impl(name, kernel)
            dispatch.COMPOSITE_KERNELS[op] = kernel
        dispatch.WHOLE_COMPOSITES.add(aten.linear.default)
    _LIBRARIES.extend([cuda, backend, autograd, sparse])
    rnn.install(_cudnn_accepts)
    _install_engine_thread()


def _sparse_to_copy(self: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """A host sparse COO tensor moved to a remote device (`.to("cuda")`, `.cuda()`): ATen's
    copy would allocate an empty sparse tensor there and fill it through sparse internals; the
    client moves its indices and values instead (dispatch.upload_sparse). Every other copy of
    a host sparse tensor is ATen's."""
    device = kwargs.get("device")
    layout = kwargs.get("layout")
    if device is not None and is_remote_device(device) and layout in (None, torch.sparse_coo):
        return dispatch.upload_sparse(self, device, kwargs.get("dtype"))
    return aten._to_copy.default._op_dk(
        torch._C.DispatchKey.CompositeExplicitAutograd, self, **kwargs
    )


def _cudnn_accepts(tensor: torch.Tensor) -> bool:
    """ATen's `cudnn_is_acceptable`, answered by the worker's ATen: the client's composite of it
    sees the remote tensor's C++ device, which is not cuda, and answers False."""
    return bool(dispatch.run(op_info(aten.cudnn_is_acceptable.default), (tensor,), {}))


def uninstall() -> None:
    dispatch.COMPOSITE_KERNELS.clear()
    dispatch.WHOLE_COMPOSITES.clear()
    for library in _LIBRARIES:
        library._destroy()
    _LIBRARIES.clear()
    _SDP_CHOICES.clear()
    rnn.uninstall()
    _uninstall_engine_thread()


class _BackendModule:
    """`torch.gpupool`: what PyTorch's Python asks of the module of a device type (lazy
    initialisation, the current device) when C++ code names a remote tensor's C++ device."""

    @staticmethod
    def is_available() -> bool:
        """torch.accelerator.is_available() asks this module (PrivateUse1 is PyTorch's
        accelerator once named): the program's devices are cuda, which torch.cuda answers for;
        PrivateUse1 is how remote tensors look to C++ and nothing a program should pick."""
        return False

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _lazy_init() -> None:
        return None

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def current_device() -> int:
        return runtime.current_index()

    @staticmethod
    def device_count() -> int:
        return runtime.device_count()

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        return None  # torch.manual_seed seeds the remote devices through torch.cuda

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(_index(device))

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.cuda.set_rng_state(state, _index(device))


def _index(device: Any) -> int:
    if device is None:
        return runtime.current_index()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return runtime.current_index() if index is None else index


_BELOW_PYTHON = {
    "copy_": aten.copy_.default,
    "_copy_from": aten._copy_from.default,
    "_copy_from_and_resize": aten._copy_from_and_resize.default,
    "_local_scalar_dense": aten._local_scalar_dense.default,
}
"""Ops C++ runs on a remote tensor with the Python dispatch key excluded: host data turned into
a device tensor (`torch.tensor(data, device=...)`, a list index, `x[[0, 2]]`) is copied with
the Python key off. They go to the remote dispatcher all the same; any other op that gets
there fails with PyTorch's own error naming the op and the `gpupool` backend."""


_KERNELS_OF_THEIR_OWN = {
    "silu_backward": aten.silu_backward.default,
    "mish_backward": aten.mish_backward.default,
    "native_channel_shuffle": aten.native_channel_shuffle.default,
}
"""The aten ops with both a CPU/CUDA kernel and a C++ composite: a device without a kernel of
its own gets the composite, so on a remote tensor silu's backward ran as sigmoid and muls in
the client and rounded otherwise than the worker's kernel (a Llama MLP's gradients). A
PrivateUse1 kernel of their own makes autograd and the dispatcher treat them as on CUDA: they
reach the worker whole."""


def _zeros(
    size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None
) -> torch.Tensor:
    """Autograd's zero gradients (`_efficientzerotensor`): a tensor of zeros on the worker."""
    index = device.index if isinstance(device, torch.device) else None
    on = torch.device("cuda", runtime.current_index() if index is None else index)
    return dispatch.factory(aten.zeros.default, (list(size),), {"dtype": dtype, "device": on})


def _op_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return dispatch.guarded_dispatch(op, args, kwargs)

    return kernel


_ORIGINAL_RUN_BACKWARD: Any = None
_AUTOGRAD: Any = torch.autograd
"""torch.autograd.backward and grad call the engine through this module-level name."""


def _install_engine_thread() -> None:
    global _ORIGINAL_RUN_BACKWARD
    if _ORIGINAL_RUN_BACKWARD is not None:
        return
    original = _ORIGINAL_RUN_BACKWARD = _AUTOGRAD._engine_run_backward

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        dispatch.begin_backward()
        try:
            with torch.autograd.set_multithreading_enabled(False):
                result = original(*args, **kwargs)
        finally:
            error = dispatch.end_backward()
        if error is not None:
            raise error
        return result

    _AUTOGRAD._engine_run_backward = run_backward


def _uninstall_engine_thread() -> None:
    global _ORIGINAL_RUN_BACKWARD
    if _ORIGINAL_RUN_BACKWARD is not None:
        _AUTOGRAD._engine_run_backward = _ORIGINAL_RUN_BACKWARD
        _ORIGINAL_RUN_BACKWARD = None


def _factory_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return dispatch.factory(op, args, kwargs)

    return kernel


# ---- scaled dot product attention ------------------------------------------------------------


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if not isinstance(query, RemoteTensor):
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if _whole_on_worker(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        # Shapes that change every call (a growing key/value cache) would ask the worker for
        # its kernel choice every call: a round trip that also drains its queue. Without
        # gradients nothing here needs to know the kernel: the composite runs on the worker,
        # which picks it, and a contiguous copy gives the result the layout the client's
        # shape rules say (a fused kernel's own output may be transposed).
        out = dispatch.run(
            op_info(aten.scaled_dot_product_attention.default),
            (query, key, value, attn_mask, dropout_p, is_causal),
            {"scale": scale, "enable_gqa": enable_gqa},
        )
        return aten.clone.default(out, memory_format=torch.contiguous_format)
    choice = _sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    mask = _float_mask(attn_mask, query.dtype)
    on_cuda = stream_of(query._gp).is_cuda_worker
    if choice == FLASH and not on_cuda:
        return aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale
        )[0]
    if choice == FLASH and mask is None and query.size(-1) % 8 == 0:
        return aten._scaled_dot_product_flash_attention.default(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    logsumexp = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    if choice == EFFICIENT:
        bias = None if mask is None else _efficient_bias(mask, query, key)
        return aten._scaled_dot_product_efficient_attention.default(
            query, key, value, bias, logsumexp, dropout_p, is_causal, scale=scale
        )[0]
    if choice == CUDNN:
        return aten._scaled_dot_product_cudnn_attention.default(
            query, key, value, mask, logsumexp, dropout_p, is_causal, False, scale=scale
        )[0]
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _math(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
) -> torch.Tensor:  # fmt: skip
    if is_causal and isinstance(query, RemoteTensor):
        # The math kernel builds its causal mask with a factory call that, under a tensor
        # subclass, comes out on the meta device; the same mask made here is a remote tensor.
        if attn_mask is not None:
            raise RuntimeError("scaled_dot_product_attention: attn_mask and is_causal both set")
        causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device)
        attn_mask, is_causal = causal.tril(), False
    mask = _float_mask(attn_mask, query.dtype)
    return aten._scaled_dot_product_attention_math.default(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def _whole_on_worker(
    query: RemoteTensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
) -> bool:  # fmt: skip
    """Whether attention goes to the worker as one composite op: no gradient is needed, the
    client's SDP switches are torch's defaults (the worker's own apply), and its shape-free
    family has already been asked about SDP_ASK_MAX times (the shapes keep changing)."""
    if (
        not rules.ENABLED
        or enable_gqa
        or (
            torch.is_grad_enabled()
            and (query.requires_grad or key.requires_grad or value.requires_grad)
        )
    ):
        return False
    backends = torch.backends.cuda
    if not (
        backends.flash_sdp_enabled()
        and backends.mem_efficient_sdp_enabled()
        and backends.math_sdp_enabled()
    ):
        return False
    tensors = (query, key, value, mask)
    exact = (
        query._gp.stream.index, *(_signature(t) for t in tensors),
        dropout_p > 0, is_causal, scale is None, torch.is_grad_enabled(),
    )  # fmt: skip
    if exact in _SDP_CHOICES:
        return False
    family = (
        query._gp.stream.index,
        *(None if t is None else (t.dim(), t.dtype) for t in tensors),
        dropout_p > 0, is_causal, scale is None,
    )  # fmt: skip
    asked = _SDP_ASKED.get(family, 0)
    if asked < SDP_ASK_MAX:
        _SDP_ASKED[family] = asked + 1
        return False
    return True


def _sdp_choice(
    query: RemoteTensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
) -> int:  # fmt: skip
    """The fused kernel the worker's own SDPA would pick, asked once per signature."""
    signature = (
        query._gp.stream.index,
        *(_signature(t) for t in (query, key, value, mask)),
        dropout_p > 0, is_causal, scale is None, torch.is_grad_enabled(), enable_gqa,
    )  # fmt: skip
    choice = _SDP_CHOICES.get(signature)
    if choice is None:
        # enable_gqa goes along: the fused kernels that take fewer key/value heads than query
        # heads (flash, CPU's and CUDA's, and cuDNN) are picked for it, as a local run picks
        # them (a Llama-shaped model's attention).
        kwargs = {"scale": scale, "enable_gqa": True} if enable_gqa else {"scale": scale}
        result = dispatch.run(
            op_info(aten._fused_sdp_choice.default),
            (query, key, value, mask, dropout_p, is_causal),
            kwargs,
        )
        choice = _SDP_CHOICES[signature] = int(result)
    # The client's own switches (torch.backends.cuda.enable_flash_sdp(False), sdpa_kernel())
    # narrow the worker's choice.
    mask_needs_grad = mask is not None and mask.requires_grad and torch.is_grad_enabled()
    if mask_needs_grad and choice != EFFICIENT:
        # The worker's tensors never need gradients, so its answer cannot see that the mask
        # does; the flash kernel for CPU and cuDNN's refuse such a mask (PyTorch's
        # check_attn_mask_shape), the memory-efficient kernel differentiates it.
        choice = MATH
    backends = torch.backends.cuda
    allowed = {
        FLASH: backends.flash_sdp_enabled(),
        EFFICIENT: backends.mem_efficient_sdp_enabled(),
        CUDNN: backends.cudnn_sdp_enabled(),
    }
    return choice if allowed.get(choice, False) else MATH


def _signature(tensor: torch.Tensor | None) -> Any:
    if tensor is None:
        return None
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.requires_grad)


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    # Both sides as device tensors: a Python scalar here is wrapped into a tensor that, under
    # a tensor subclass, lands on the meta device.
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    minus_inf = torch.full((), float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, minus_inf)


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The memory-efficient kernel wants a 4-d bias whose last dimension is 16-aligned."""
    alignment = 16
    bias = mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    last = bias.size(-1)
    if last % alignment:
        pad = alignment - last % alignment
        return torch.nn.functional.pad(bias, (0, pad))[..., :last]
    if any(bias.stride(i) % alignment for i in range(3)):
        return bias.contiguous()
    return bias


# ---- linear -----------------------------------------------------------------------------------


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    """`linear` as one remote op when nothing needs its gradient (inference, `no_grad`).

    Its C++ composite is three to four ops (`view`, `t`, `addmm`, `view`), each a trip through
    Python that a local GPU makes in C++: on a 3-d input that was 24 us of client time per
    linear against 10 us as one op (a CPU worker, 2-core x86 machine), and a transformer's
    inference is mostly linears. The worker runs `aten::linear` itself, which decomposes
    there as it does on a local device, so the values are the same, with one exception kept
    here: on a non-contiguous input of three or more dimensions `matmul` folds the input into
    a matrix (a copy, then `mm`) when the weight requires grad, even under no_grad, and else
    multiplies batch by batch, which rounds differently; the worker's weight never requires
    grad, so that case decomposes here (an nn.GRU with batch_first in eval mode, whose input
    projection sees the transposed sequence). With a gradient to record (or forward-mode AD
    on) the composite runs here as before: autograd needs its parts."""
    if (
        type(input) is RemoteTensor
        and not _needs_grad(input, weight, bias)
        and (input.dim() <= 2 or not weight.requires_grad or input.is_contiguous())
    ):
        with torch._C._AutoDispatchBelowAutograd():
            return aten.linear.default(input, weight, bias)
    return aten.linear.default.decompose(input, weight, bias)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    if torch.autograd.forward_ad._current_level >= 0:
        return True  # a dual level is open: tangents may ride on any input
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---- batch norm and dropout ------------------------------------------------------------------


def batch_norm(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
    momentum: float, eps: float, cudnn_enabled: bool,
) -> torch.Tensor:  # fmt: skip
    remote = isinstance(input, RemoteTensor)
    stats = running_mean is not None and running_var is not None
    if remote and stats and training and weight is not None:
        # Without a weight no local GPU runs cuDNN here, and this op's backward takes a weight
        # (its schema's `Tensor weight` cannot be None from Python): the native kernel below,
        # through _batch_norm_impl_index, as locally.
        return aten._batch_norm_with_update.default(
            input, weight, bias, running_mean, running_var, momentum, eps
        )[0]
    if remote and stats and not training:
        # Evaluation: native_batch_norm, whose backward (native, on the running statistics) is
        # the one a local GPU's cuDNN or native forward records. _batch_norm_no_update's
        # backward would pick its kernel on the worker when it runs, cuDNN's among them, which
        # differentiates the batch statistics instead.
        return aten.native_batch_norm.default(
            input, weight, bias, running_mean, running_var, False, momentum, eps
        )[0]
    no_stats = running_mean is None and running_var is None
    if remote and training and no_stats and _cudnn_batch_norm(input, weight, bias):
        # Training on batch statistics alone: a local GPU runs cuDNN's batch norm here, but
        # the composite below picks its kernel by the device C++ sees (not cuda), the native
        # one, whose backward rounds otherwise. `_batch_norm_with_update` makes the worker
        # pick as a local GPU would; statistics it may update are given and dropped (cuDNN's
        # outputs and saved statistics do not depend on them).
        stats_dtype = weight.dtype if weight is not None else input.dtype
        channels = input.size(1)
        mean = torch.zeros(channels, dtype=stats_dtype, device=input.device)
        var = torch.ones(channels, dtype=stats_dtype, device=input.device)
        out = aten._batch_norm_with_update.default(input, weight, bias, mean, var, momentum, eps)
        return out[0]
    return aten._batch_norm_impl_index.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
    )[0]


def _cudnn_batch_norm(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> bool:
    """Whether a local GPU would run cuDNN's batch norm on batch statistics (ATen's
    _select_batch_norm_backend, training without running statistics; the epsilon bound is
    cuDNN's CUDNN_BN_MIN_EPSILON, 0 since cuDNN 8)."""
    return (
        type(input) is RemoteTensor
        and stream_of(input._gp).is_cuda_worker
        and weight is not None
        and bias is not None
        and torch.backends.cudnn.enabled
        and input.dtype != torch.bfloat16
        and weight.dtype != torch.bfloat16
        and (input.dtype != torch.float16 or weight.dtype == torch.float32)
        and input.dim() >= 3
        and input.size(0) <= 880801
        and input.numel() < 2**31 - 1
    )


def dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        return input * 0
    return aten.native_dropout.default(input, p, train)[0]


_COMPOSITES: tuple[tuple[str, Any, Any], ...] = (
    ("scaled_dot_product_attention", aten.scaled_dot_product_attention.default,
     scaled_dot_product_attention),
    ("batch_norm", aten.batch_norm.default, batch_norm),
    ("dropout", aten.dropout.default, dropout),
    ("lstm.input", aten.lstm.input, rnn.lstm),
    ("gru.input", aten.gru.input, rnn.gru),
    ("rnn_tanh.input", aten.rnn_tanh.input, rnn.rnn_tanh),
    ("rnn_relu.input", aten.rnn_relu.input, rnn.rnn_relu),
    ("lstm.data", aten.lstm.data, rnn.lstm_packed),
    ("gru.data", aten.gru.data, rnn.gru_packed),
    ("linear", aten.linear.default, linear),
)  # fmt: skip
"""(overload name, OpOverload, kernel) of the composites the client runs its own way: registered
at AutogradPrivateUse1 by install(), and dispatch's route for an inference tensor's call."""
