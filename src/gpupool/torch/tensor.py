"""RemoteTensor: a tensor a worker holds, which PyTorch in this process sees as a cuda tensor.

It is a `__torch_dispatch__` wrapper subclass whose C++ device is `meta` (so autograd, whose
device guards need a linked backend, works in a CPU-only torch) while the Python `device`
property reports the remote `cuda:N`. It carries no data, only its metadata and a `Handle`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gpupool.protocol.v1.tensors import handle_ext

if TYPE_CHECKING:
    from gpupool.torch.stream import DeviceStream

META = torch.device("meta")
_make_wrapper = torch.Tensor._make_wrapper_subclass
_NO_KWARGS: dict[str, Any] = {}
_DATA: Any = torch._C.TensorBase.__dict__["data"]


def _unbound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError("gpupool.torch.dispatch was not imported")


_dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] = _unbound


def bind_dispatch(fn: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> None:
    """The dispatcher lives in its own module; it registers itself here when imported."""
    global _dispatch
    _dispatch = fn


class Handle:
    """The worker's name for one tensor. Several RemoteTensors may share one (`detach()`),
    and the worker frees it when the last of them is gone."""

    __slots__ = ("__weakref__", "ext", "id", "stream")

    def __init__(self, handle_id: int, stream: DeviceStream) -> None:
        self.id = handle_id
        self.ext = handle_ext(handle_id)
        self.stream = stream

    def __del__(self) -> None:
        self.stream.release(self.id)


class RemoteTensor(torch.Tensor):
    """A tensor on a gpupool remote GPU."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _gp: Handle
    _sig: tuple[Any, ...]
    """(shape, stride, offset, dtype), kept at hand: every op's plan-cache key is made of these."""

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or _NO_KWARGS)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._gp.stream.device

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:
        return self._gp.stream.index

    # `t.data = other` swaps the C++ metadata; the handle must follow it.
    @property
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _DATA.__set__(self, value)
        if isinstance(value, RemoteTensor):
            self._gp = value._gp
            refresh_signature(self)

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def tolist(self) -> Any:
        return self._gp.stream.read(self._gp.ext).tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        with torch.no_grad():
            host = self._gp.stream.read(self._gp.ext).reshape(self.shape)
        text = repr(host)
        extras = [f"device='{self.device}'"]
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        if text.endswith(")"):
            return text[:-1] + ", " + ", ".join(extras) + ")"
        return text

    def __deepcopy__(self, memo: dict[int, Any]) -> RemoteTensor:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        assert isinstance(new, RemoteTensor)
        new.requires_grad_(self.requires_grad)
        for key, value in self.__dict__.items():
            if key not in ("_gp", "_sig"):
                new.__dict__[key] = copy.deepcopy(value, memo)
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        from gpupool.torch.serialization import reduce_remote

        return reduce_remote(self, protocol)


def wrap(shape: Any, stride: Any, offset: int, dtype: torch.dtype, handle: Handle) -> RemoteTensor:
    tensor: RemoteTensor = _make_wrapper(
        RemoteTensor, shape, strides=stride, storage_offset=offset, dtype=dtype, device=META
    )
    tensor._gp = handle
    tensor._sig = (tuple(shape), tuple(stride), offset, dtype)
    return tensor


def wrap_signature(sig: tuple[Any, ...], handle: Handle) -> RemoteTensor:
    """wrap() from a signature already made (a cached plan's, another wrapper's): shared as is."""
    shape, stride, offset, dtype = sig
    tensor: RemoteTensor = _make_wrapper(
        RemoteTensor, shape, strides=stride, storage_offset=offset, dtype=dtype, device=META
    )
    tensor._gp = handle
    tensor._sig = sig
    return tensor


def refresh_signature(tensor: RemoteTensor) -> None:
    """After the wrapper's own metadata changed (in-place shape ops, out=, `.data =`)."""
    tensor._sig = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype)
