"""RemoteTensor: a tensor a worker holds, which PyTorch in this process sees as a cuda tensor.

It is a `__torch_dispatch__` wrapper subclass whose C++ device is `gpupool:N`, PyTorch's
PrivateUse1 backend under gpupool's name, while the Python `device` property reports the
remote `cuda:N`. It carries no data, only its metadata and a `Handle`.

Why PrivateUse1 (bench/tensor_design.py tried the options; docs/remote.md has the numbers):
PyTorch's C++ composites and autograd formulas make new tensors with their input's options
(`x[0] = 5` wraps 5 with x's device, clamp's backward makes zeros like its input), and no
tensor subclass sees those factory calls. With the C++ device `meta` they became plain meta
tensors the worker cannot run. With a device of its own, every factory call with a remote
tensor's options reaches the kernels gpupool registers for that backend (gpupool.torch.kernels),
which make remote tensors on the same device. A C++ device `cuda` would do the same but aborts
in autograd on a CPU-only torch (no CUDA device guard), and on a CUDA build initialises CUDA.
The device guard here is PyTorch's Python one (torch._C._acc); the autograd engine runs a
remote tensor's backward in the calling thread (gpupool.torch.kernels), as it does for meta.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.utils.backend_registration import rename_privateuse1_backend

from gpupool.protocol.v1.tensors import handle_ext

META = torch.device("meta")
BACKEND = "gpupool"
"""The name PyTorch's PrivateUse1 backend takes once gpupool has attached in this process."""
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


def _unbound_reduce(tensor: RemoteTensor, protocol: Any) -> Any:
    raise RuntimeError("gpupool.torch.serialization was not imported")


_reduce: Callable[[RemoteTensor, Any], Any] = _unbound_reduce


def bind_reduce(fn: Callable[[RemoteTensor, Any], Any]) -> None:
    """How a remote tensor pickles lives with torch.save's wrapper (gpupool.torch.serialization,
    which keeps the storages a save tags); it registers itself here when imported."""
    global _reduce
    _reduce = fn


class BackendTaken(RuntimeError):
    """PyTorch's PrivateUse1 backend, which remote tensors need, is not to be had: another
    library holds it, or this torch cannot give it a Python device guard."""


_ACC: Any = vars(torch._C).get("_acc")
"""PyTorch's Python backend hooks (torch._C._acc, untyped), None in a torch without them."""


def _backend_objects() -> tuple[Any, Any]:
    """A device guard and hooks for PrivateUse1, made of PyTorch's Python base classes."""

    class DeviceGuard(_ACC.DeviceGuard):  # type: ignore[misc]
        """Autograd and the dispatcher ask it which device is current; a remote op never
        switches devices on the worker, so none is tracked."""

        def type_(self) -> Any:
            return torch._C._autograd.DeviceType.PrivateUse1

    class Hooks(_ACC.PrivateUse1Hooks):  # type: ignore[misc]
        """What PyTorch asks of a backend before it runs autograd on its tensors."""

        def is_available(self) -> bool:
            return True

        def is_built(self) -> bool:
            return True

        def has_primary_context(self, device_index: int) -> bool:
            return True

    return DeviceGuard(), Hooks()


_BACKEND: tuple[Any, Any] | None = None
_CXX_DEVICES: dict[int, torch.device] = {}


def ensure_backend() -> None:
    """Name PyTorch's PrivateUse1 backend `gpupool` and give it a device guard: once per
    process (neither can be undone; both are harmless while nothing is attached)."""
    global _BACKEND
    if _BACKEND is not None:
        return
    if _ACC is None:
        raise BackendTaken(
            f"gpupool remote devices need PyTorch's Python backend hooks (torch._C._acc), "
            f"which torch {torch.__version__} does not have"
        )
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", BACKEND):
        raise BackendTaken(
            f"gpupool remote devices need PyTorch's PrivateUse1 backend, which {name!r} holds "
            "in this process"
        )
    if name != BACKEND:
        rename_privateuse1_backend(BACKEND)
    guard, hooks = _backend_objects()
    if not _ACC.register_python_privateuseone_device_guard(guard):
        raise BackendTaken(
            "gpupool remote devices need PyTorch's PrivateUse1 backend, whose device guard "
            "another library registered in this process"
        )
    _ACC.register_python_privateuseone_hook(hooks)
    _BACKEND = (guard, hooks)  # PyTorch holds them by pointer: they must live on


def cxx_device(index: int) -> torch.device:
    """The C++ device of remote tensors on cuda:`index` (what C++ composites see)."""
    device = _CXX_DEVICES.get(index)
    if device is None:
        ensure_backend()
        device = _CXX_DEVICES[index] = torch.device(BACKEND, index)
    return device


def is_remote_device(device: torch.device) -> bool:
    """cuda, or gpupool (the C++ device a composite passes on from a remote tensor)."""
    return device.type == "cuda" or device.type == BACKEND


class Holder(Protocol):
    """The op stream of the device a tensor lives on, as a tensor needs it
    (gpupool.torch.stream.DeviceStream, which makes the handles): its device, and the
    stream's read and release of a handle."""

    @property
    def device(self) -> torch.device: ...
    @property
    def index(self) -> int: ...
    @property
    def cxx_device(self) -> torch.device: ...

    def read(self, handle_ext: Any) -> torch.Tensor: ...

    def release(self, handle: int) -> None: ...


class Handle:
    """The worker's name for one tensor. Several RemoteTensors may share one (`detach()`),
    and the worker frees it when the last of them is gone."""

    __slots__ = ("__weakref__", "ext", "id", "stream")

    def __init__(self, handle_id: int, stream: Holder) -> None:
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
    """(shape, stride, offset, dtype), kept at hand: every op's plan-cache key is made of these.
    A tensor with a math bit (lazy conjugate, lazy negative) has the bits as a fifth item."""

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

    def __coerce_same_metadata_as_tangent__(
        self, expected_metadata: Any, expected_type: type | None = None
    ) -> RemoteTensor | None:
        """AOTAutograd's compiled backward asks this of a gradient whose type is not the one
        it traced. gpupool.torch.joint traces remote tensors as plain fake ones on their C++
        device, so a remote gradient is what the backward graph expects; nothing else is."""
        if expected_type is None or expected_type is torch.Tensor:
            return self
        return None

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
        return read_values(self).tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        with torch.no_grad():
            if self._sig[1] == SPARSE_COO:
                host = self.cpu()
            else:
                host = read_values(self).reshape(self.shape)
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
        return _reduce(self, protocol)


CONJ, NEG = 1, 2
"""Math bits. The worker's tensor never has them: it holds the raw values, and the client's
wrapper carries the bits, so PyTorch's conjugate and negative fallbacks (which run above the
Python key, before an op reaches the remote dispatcher) see them as on any device."""


def math_bits(tensor: torch.Tensor) -> int:
    return (CONJ if tensor.is_conj() else 0) | (NEG if tensor.is_neg() else 0)


def set_math_bits(tensor: torch.Tensor, bits: int) -> None:
    torch._C._set_conj(tensor, bool(bits & CONJ))
    torch._C._set_neg(tensor, bool(bits & NEG))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a standard contiguous tensor of `shape` (size-0 and size-1 dimensions
    step as size 1, as PyTorch's own)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def wrap(
    shape: Any, stride: Any, offset: int, dtype: torch.dtype, handle: Handle, bits: int = 0
) -> RemoteTensor:
    tensor: RemoteTensor = _make_wrapper(
        RemoteTensor, shape, strides=stride, storage_offset=offset, dtype=dtype,
        device=handle.stream.cxx_device,
    )  # fmt: skip
    tensor._gp = handle
    if bits:
        set_math_bits(tensor, bits)
        tensor._sig = (tuple(shape), tuple(stride), offset, dtype, bits)
    else:
        tensor._sig = (tuple(shape), tuple(stride), offset, dtype)
    return tensor


def wrap_signature(sig: tuple[Any, ...], handle: Handle) -> RemoteTensor:
    """wrap() from a signature already made (a cached plan's, another wrapper's): shared as is."""
    if sig[1] == SPARSE_COO:
        return wrap_sparse(sig[0], sig[3], handle)
    tensor: RemoteTensor = _make_wrapper(
        RemoteTensor, sig[0], strides=sig[1], storage_offset=sig[2], dtype=sig[3],
        device=handle.stream.cxx_device,
    )  # fmt: skip
    tensor._gp = handle
    tensor._sig = sig
    if len(sig) == 5:
        set_math_bits(tensor, sig[4])
    return tensor


SPARSE_COO = "sparse_coo"
"""A sparse COO tensor's signature has this where a strided one has its strides: (shape,
"sparse_coo", 0, dtype, 0), so that what reads a signature's shape and dtype reads them alike,
and with a fifth item, as a math-bit tensor's (here no bits), so that the compiled path hands
it to Python and the plan cache never keeps an op of it. Its indices, values and their count
live on the worker (every op on it asks the worker)."""


def wrap_sparse(shape: Any, dtype: torch.dtype, handle: Handle) -> RemoteTensor:
    """A remote sparse COO tensor: a wrapper of that layout, without strides or storage."""
    tensor: RemoteTensor = _make_wrapper(
        RemoteTensor, shape, dtype=dtype, layout=torch.sparse_coo,
        device=handle.stream.cxx_device,
    )  # fmt: skip
    tensor._gp = handle
    tensor._sig = (tuple(shape), SPARSE_COO, 0, dtype, 0)
    return tensor


def is_sparse_remote(value: Any) -> bool:
    return type(value) is RemoteTensor and value._sig[1] == SPARSE_COO


def restride(tensor: RemoteTensor, shape: Any, stride: Any, offset: int) -> None:
    """Give a wrapper other sizes, strides and offset in place (in-place view ops such as
    unsqueeze_, out= arguments the op resized), keeping its identity, autograd state and
    handle: its C++ metadata is swapped for that of a fresh wrapper, as `.data =` does."""
    bits = math_bits(tensor)
    fresh = _make_wrapper(
        RemoteTensor, shape, strides=stride, storage_offset=offset, dtype=tensor.dtype,
        device=tensor._gp.stream.cxx_device,
    )  # fmt: skip
    _DATA.__set__(tensor, fresh)
    set_math_bits(tensor, bits)
    refresh_signature(tensor)


def read_values(tensor: RemoteTensor) -> torch.Tensor:
    """The tensor in host memory, with its math bits (as `.cpu()` of a local GPU tensor)."""
    host = tensor._gp.stream.read(tensor._gp.ext)
    bits = tensor._sig[4] if len(tensor._sig) == 5 else 0
    if bits:
        set_math_bits(host, bits)
    return host


def refresh_signature(tensor: RemoteTensor) -> None:
    """After the wrapper's own metadata changed (in-place shape ops, out=, `.data =`)."""
    sig = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype)
    bits = math_bits(tensor)
    tensor._sig = (*sig, bits) if bits else sig
