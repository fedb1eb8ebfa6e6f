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

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or _NO_KWARGS)

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return self._gp.stream.device

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return True

    @property  # type: ignore[override]
    def is_meta(self) -> bool:
        return False

    @property  # type: ignore[override]
    def is_cpu(self) -> bool:
        return False

    def get_device(self) -> int:  # type: ignore[override]
        return self._gp.stream.index

    # `t.data = other` swaps the C++ metadata; the handle must follow it.
    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch.Tensor.data.__set__(self, value)  # type: ignore[attr-defined]
        if isinstance(value, RemoteTensor):
            self._gp = value._gp

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
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
            return memo[id(self)]  # type: ignore[no-any-return]
        with torch.no_grad():
            new = self.clone()
        assert isinstance(new, RemoteTensor)
        new.requires_grad_(self.requires_grad)
        for key, value in self.__dict__.items():
            if key != "_gp":
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
    return tensor


def is_remote(value: object) -> bool:
    return isinstance(value, RemoteTensor)
