"""Kernels registered with PyTorch's dispatcher while attached.

- CUDA dispatch key, `empty.memory_format` / `empty_strided`: every factory and every copy to
  `cuda:N` allocates through these two, so `torch.zeros(…, device="cuda")`, `.to("cuda:0")` and
  the factories inside library code all make RemoteTensors, at any call depth.
- AutogradMeta dispatch key, three composite ops whose C++ picks its kernel by the tensor's
  device (which is `meta` for a RemoteTensor, so they would decompose in the client):
  `scaled_dot_product_attention` (the worker picks flash / efficient / cuDNN, the client calls
  that fused op), `batch_norm` (→ `_batch_norm_with_update`, cuDNN on a CUDA worker) and
  `dropout` (→ the fused `native_dropout`). Plain meta tensors get the stock behaviour.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gpupool.torch import dispatch
from gpupool.torch.shapes import op_info
from gpupool.torch.tensor import RemoteTensor

aten = torch.ops.aten
_LIBRARIES: list[Any] = []

MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3
_SDP_CHOICES: dict[tuple[Any, ...], int] = {}


OVERRIDE_WARNING = (
    r"(?s).*Overriding a previously registered kernel for the same operator and the same "
    r"dispatch key"
)
"""What a CUDA build of torch warns, once per kernel, when these replace its own: on purpose
here, so not printed (only this warning, only while registering them)."""


def install() -> None:
    if _LIBRARIES:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OVERRIDE_WARNING, category=UserWarning)
        cuda = torch.library.Library("aten", "IMPL", "CUDA")
        for name, op in (
            ("empty.memory_format", aten.empty.memory_format),
            ("empty_strided", aten.empty_strided.default),
        ):
            cuda.impl(name, _factory_kernel(op))
        autograd_meta = torch.library.Library("aten", "IMPL", "AutogradMeta")
        autograd_meta.impl("scaled_dot_product_attention", scaled_dot_product_attention)
        autograd_meta.impl("batch_norm", batch_norm)
        autograd_meta.impl("dropout", dropout)
    _LIBRARIES.extend([cuda, autograd_meta])


def uninstall() -> None:
    for library in _LIBRARIES:
        library._destroy()
    _LIBRARIES.clear()
    _SDP_CHOICES.clear()


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
    choice = _sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    mask = _float_mask(attn_mask, query.dtype)
    on_cuda = query._gp.stream.is_cuda_worker
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


def _sdp_choice(
    query: RemoteTensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
) -> int:  # fmt: skip
    """The fused kernel the worker's own SDPA would pick, asked once per signature."""
    if enable_gqa:
        return MATH
    signature = (
        query._gp.stream.index,
        *(_signature(t) for t in (query, key, value, mask)),
        dropout_p > 0, is_causal, scale is None, torch.is_grad_enabled(),
    )  # fmt: skip
    choice = _SDP_CHOICES.get(signature)
    if choice is None:
        result = dispatch.run(
            op_info(aten._fused_sdp_choice.default),
            (query, key, value, mask, dropout_p, is_causal),
            {"scale": scale},
        )
        choice = _SDP_CHOICES[signature] = int(result)
    # The client's own switches (torch.backends.cuda.enable_flash_sdp(False), sdpa_kernel())
    # narrow the worker's choice.
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


# ---- batch norm and dropout ------------------------------------------------------------------


def batch_norm(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
    momentum: float, eps: float, cudnn_enabled: bool,
) -> torch.Tensor:  # fmt: skip
    if isinstance(input, RemoteTensor) and running_mean is not None and running_var is not None:
        if training:
            return aten._batch_norm_with_update.default(
                input, weight, bias, running_mean, running_var, momentum, eps
            )[0]
        return aten._batch_norm_no_update.default(
            input, weight, bias, running_mean, running_var, momentum, eps
        )[0]
    return aten._batch_norm_impl_index.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
    )[0]


def dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        return input * 0
    return aten.native_dropout.default(input, p, train)[0]
