"""Tensor.to / .cuda / .cpu and torch.tensor / as_tensor, taught about remote devices.

A CPU-only torch resolves an index-less `cuda` device through CUDA's device guard, which it
does not have; these wrappers add the current index and leave the rest to the dispatcher.
They also return a remote tensor unchanged when it already is where it is asked to go, and
keep gradients flowing when a tensor that needs them crosses between hosts and devices.
"""

from __future__ import annotations

from typing import Any

import torch

from gpupool.torch import pinned, runtime
from gpupool.torch.tensor import RemoteTensor

_TensorBase = torch._C.TensorBase
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_OWN: dict[str, bool] = {}


def _resolve(device: Any) -> Any:
    """`cuda` → `cuda:<current>`; an int means a cuda index, as in PyTorch."""
    if isinstance(device, str):
        if device == "cuda" or device.startswith("cuda:"):
            device = torch.device(device)
        else:
            return device
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    if isinstance(device, torch.device) and device.type == "cuda":
        if device.index is None:
            return torch.device("cuda", runtime.current_index())
        own = runtime.alias()
        if own is not None and device.index == 0:  # a rank's cuda:0 is its cuda:<local rank>
            return torch.device("cuda", own)
    return device


def _parse_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, bool, bool, Any]:
    """(device, dtype, non_blocking, copy, memory_format) of a Tensor.to call."""
    items = list(args)
    options = dict(kwargs)
    copy = bool(options.pop("copy", False))
    if items and isinstance(items[0], torch.Tensor):
        other = items.pop(0)
        items[:0] = [other.device, other.dtype]
    if len(items) >= 2 and isinstance(items[0], torch.dtype):
        # to(dtype, non_blocking, copy)
        if len(items) >= 3:
            copy = bool(items[2])
        items = items[:2]
    elif len(items) >= 4:
        copy = bool(items[3])
        items = items[:3]
    if items and not isinstance(items[0], torch.dtype):
        items[0] = _resolve(items[0])
    if "device" in options:
        options["device"] = _resolve(options["device"])
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*items, **options)
    return device, dtype, bool(non_blocking), copy, memory_format


_COMPRESSED = frozenset({torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


def _refuse_compressed(self: torch.Tensor, device: Any) -> None:
    """A CSR/CSC/BSR/BSC tensor copied to a remote device fails here, before torch's copy
    runs: that copy builds the compressed tensor in C++ for the target device, which torch
    2.13 refuses with NotImplementedError and torch 2.11 with a RuntimeError of its own.
    (A COO tensor moves: gpupool.torch.kernels moves its indices and values.)"""
    if (
        self.layout in _COMPRESSED
        and isinstance(device, torch.device)
        and device.type == "cuda"
        and not isinstance(self, RemoteTensor)
    ):
        raise NotImplementedError(
            f"aten::_to_copy: {self.layout} tensors are not supported on gpupool remote "
            "devices (strided and sparse COO ones are); use .to_sparse() or .to_dense() first"
        )


def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    device, dtype, non_blocking, copy, memory_format = _parse_to(args, kwargs)
    _refuse_compressed(self, device)
    if isinstance(self, RemoteTensor):
        here = self.device
        stays = device is None or device == here
        same_dtype = dtype is None or dtype == self.dtype
        keeps_format = memory_format in (None, torch.preserve_format)
        if stays and same_dtype and keeps_format and not copy:
            return self
        if not stays and torch.is_grad_enabled() and self.requires_grad:
            return _Move.apply(self, device, dtype)
        if stays:
            device = None
    options: dict[str, Any] = {"non_blocking": non_blocking, "copy": copy}
    if memory_format is not None:
        options["memory_format"] = memory_format
    if device is not None and dtype is not None:
        return _TensorBase.to(self, device, dtype, **options)
    if device is not None:
        return _TensorBase.to(self, device, **options)
    if dtype is not None:
        return _TensorBase.to(self, dtype, **options)
    return _TensorBase.to(self, **options)


def cuda(
    self: torch.Tensor,
    device: Any = None,
    non_blocking: bool = False,
    memory_format: Any = torch.preserve_format,
) -> torch.Tensor:
    target = _resolve(torch.device("cuda") if device is None else device)
    return to(self, target, non_blocking=non_blocking, memory_format=memory_format)


def cpu(self: torch.Tensor, memory_format: Any = torch.preserve_format) -> torch.Tensor:
    if isinstance(self, RemoteTensor):
        return to(self, "cpu", memory_format=memory_format)
    return _ORIGINALS[(torch.Tensor, "cpu")](self, memory_format=memory_format)


def new_tensor(self: torch.Tensor, data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    original = _ORIGINALS[(torch.Tensor, "new_tensor")]
    if isinstance(self, RemoteTensor):
        kwargs.setdefault("device", self.device)
        kwargs.setdefault("dtype", self.dtype)
        # Built from the host copy of self's options, not self's own (they say `meta`).
        host_self = torch.empty(0, dtype=self.dtype)
        return _build_then_move(lambda **kw: original(host_self, data, *args, **kw), kwargs)
    return _build_then_move(lambda **kw: original(self, data, *args, **kw), kwargs)


def _with_device(name: str) -> Any:
    original = _ORIGINALS[(torch, name)]

    def make(*args: Any, **kwargs: Any) -> Any:
        return _build_then_move(lambda **kw: original(*args, **kw), kwargs)

    make.__name__ = name
    make.__doc__ = original.__doc__
    return make


def _build_then_move(build: Any, kwargs: dict[str, Any]) -> Any:
    """torch.tensor(data, device="cuda") writes the data straight into the new tensor's
    memory, which a remote tensor does not have: build it on the host, then copy it over."""
    device = _resolve(kwargs.pop("device")) if "device" in kwargs else None
    if not (isinstance(device, torch.device) and device.type == "cuda"):
        if device is not None:
            kwargs["device"] = device
        return build(**kwargs)
    requires_grad = kwargs.pop("requires_grad", False)
    kwargs.pop("pin_memory", None)
    moved = to(build(**kwargs), device)
    return moved.requires_grad_(True) if requires_grad else moved


class _Move(torch.autograd.Function):
    """A remote tensor that needs gradients goes to the host or another device; its gradient
    comes back to where it was (autograd's own record of the copy would name `meta`)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None
    ) -> torch.Tensor:
        ctx.source_device, ctx.source_dtype = tensor.device, tensor.dtype
        return _TensorBase.to(tensor.detach(), device, dtype or tensor.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return to(grad, ctx.source_device, ctx.source_dtype), None, None


def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    """Pinned host memory without a local GPU (see gpupool.torch.pinned); `device` is
    deprecated in PyTorch and means the accelerator, which here is always the remote one."""
    return pinned.pin(self)


def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    if isinstance(self, RemoteTensor):
        return False
    return pinned.is_pinned(self)


_DLPACK_MODULE: Any = torch.utils.dlpack


def _no_dlpack(tensor: torch.Tensor) -> BufferError:
    return BufferError(
        f"DLPack cannot share a gpupool remote tensor ({tensor.device}): its memory is on the "
        "lease's worker, not in this process; copy it to the host first (tensor.cpu())"
    )


def dlpack(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if isinstance(self, RemoteTensor):
        raise _no_dlpack(self)
    return _ORIGINALS[(torch.Tensor, "__dlpack__")](self, *args, **kwargs)


def dlpack_device(self: torch.Tensor) -> Any:
    if isinstance(self, RemoteTensor):
        raise _no_dlpack(self)
    return _ORIGINALS[(torch.Tensor, "__dlpack_device__")](self)


def to_dlpack(tensor: torch.Tensor) -> Any:
    if isinstance(tensor, RemoteTensor):
        raise _no_dlpack(tensor)
    return _ORIGINALS[(_DLPACK_MODULE, "to_dlpack")](tensor)


_TENSOR_METHODS = {
    "__dlpack__": dlpack,
    "__dlpack_device__": dlpack_device,
    "to": to,
    "cuda": cuda,
    "cpu": cpu,
    "new_tensor": new_tensor,
    "pin_memory": pin_memory,
    "is_pinned": is_pinned,
}
_TORCH_FUNCTIONS = ("tensor", "as_tensor", "asarray")


def install() -> None:
    if _ORIGINALS:
        return
    for name, replacement in _TENSOR_METHODS.items():
        # (defined on torch.Tensor itself?, what callers got before)
        _ORIGINALS[(torch.Tensor, name)] = getattr(torch.Tensor, name)
        _OWN[name] = name in torch.Tensor.__dict__
        setattr(torch.Tensor, name, replacement)
    for name in _TORCH_FUNCTIONS:
        _ORIGINALS[(torch, name)] = getattr(torch, name)
        setattr(torch, name, _with_device(name))
    _ORIGINALS[(_DLPACK_MODULE, "to_dlpack")] = _DLPACK_MODULE.to_dlpack
    _DLPACK_MODULE.to_dlpack = to_dlpack
    install_module_swap()


def uninstall() -> None:
    for (owner, name), original in _ORIGINALS.items():
        if owner is torch.Tensor and not _OWN.get(name, True):
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _ORIGINALS.clear()
    _OWN.clear()
    uninstall_module_swap()


# ---- nn.Module.to keeps parameters' identity ------------------------------------------------


def _swaps_into_place(tensor: object) -> bool:
    """Module._apply swaps a converted parameter into the existing Parameter object (instead
    of making a new one) for these; so tied weights (GPT-2's embedding and head) stay tied."""
    return isinstance(tensor, RemoteTensor) or _ORIGINAL_TRACEABLE(tensor)


_ORIGINAL_TRACEABLE: Any = None


def install_module_swap() -> None:
    global _ORIGINAL_TRACEABLE
    module_py = torch.nn.modules.module
    if _ORIGINAL_TRACEABLE is None:
        _ORIGINAL_TRACEABLE = module_py.is_traceable_wrapper_subclass  # type: ignore[attr-defined]
        module_py.is_traceable_wrapper_subclass = _swaps_into_place  # type: ignore[attr-defined,assignment]


def uninstall_module_swap() -> None:
    global _ORIGINAL_TRACEABLE
    if _ORIGINAL_TRACEABLE is not None:
        torch.nn.modules.module.is_traceable_wrapper_subclass = _ORIGINAL_TRACEABLE  # type: ignore[attr-defined]
        _ORIGINAL_TRACEABLE = None
