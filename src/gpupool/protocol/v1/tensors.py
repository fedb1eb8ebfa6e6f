"""How torch values travel on the data plane: dtype names, shapes and raw bytes, never pickles.

Imported only by the worker and the client runtime (both have torch); the torch versions of
the two sides may differ, so everything here is spelled in names both understand.
"""

from __future__ import annotations

import ctypes
from typing import Any

import msgpack
import torch

from gpupool.protocol.v1.dataplane import Ext, ProtocolError

DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name in (
        "float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128",
        "uint8", "int8", "int16", "int32", "int64", "bool",
        "uint16", "uint32", "uint64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}  # fmt: skip
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
DTYPE_EXT: dict[torch.dtype, msgpack.ExtType] = {
    dtype: msgpack.ExtType(Ext.DTYPE, name.encode()) for dtype, name in DTYPE_NAMES.items()
}

LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}
LAYOUT_EXT = {v: msgpack.ExtType(Ext.LAYOUT, k.encode()) for k, v in LAYOUTS.items()}
MEMORY_FORMAT_EXT = {
    v: msgpack.ExtType(Ext.MEMORY_FORMAT, k.encode()) for k, v in MEMORY_FORMATS.items()
}
REMOTE_DEVICE_EXT = msgpack.ExtType(Ext.DEVICE, b"")
HOST_DEVICE_EXT = msgpack.ExtType(Ext.DEVICE, b"cpu")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"gpupool cannot move tensors of dtype {dtype}") from None


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolError(f"unknown dtype {name!r}")
    return DTYPES[name]


_new_tuple = tuple.__new__
_TENSOR = int(Ext.TENSOR)


def handle_ext(handle: int) -> msgpack.ExtType:
    # ExtType's own constructor validates in Python; one of these is made per tensor.
    return _new_tuple(msgpack.ExtType, (_TENSOR, handle.to_bytes(8, "big")))


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without copying (keep the tensor alive)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    return memoryview(buf).cast("B")


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of a host tensor's values, row-major."""
    return bytes(host_bytes(tensor.detach().contiguous()))


def tensor_from_bytes(
    data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: Any
) -> torch.Tensor:
    """A host tensor over `data` (a writable buffer is shared, not copied)."""
    shape = checked_shape(shape)
    numel = 1
    for size in shape:
        numel *= size
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != numel * itemsize:
        raise ProtocolError(f"{len(data)} bytes do not hold {list(shape)} of {dtype}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(data, bytes):
        data = bytearray(data)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def checked_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ProtocolError(f"bad shape {shape!r}")
    return tuple(shape)


def literal_ext(tensor: torch.Tensor) -> msgpack.ExtType:
    """A small host tensor passed by value as an op argument."""
    payload = msgpack.packb(
        [dtype_name(tensor.dtype), list(tensor.shape), tensor_bytes(tensor)], use_bin_type=True
    )
    return msgpack.ExtType(Ext.LITERAL, payload)


def literal_from_ext(data: bytes) -> torch.Tensor:
    try:
        dtype, shape, raw = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed tensor literal: {exc}") from exc
    if not isinstance(raw, bytes):
        raise ProtocolError("tensor literal without bytes")
    return tensor_from_bytes(raw, dtype_from_name(dtype), shape)


def complex_ext(value: complex) -> msgpack.ExtType:
    return msgpack.ExtType(Ext.COMPLEX, msgpack.packb([value.real, value.imag]))


def complex_from_ext(data: bytes) -> complex:
    try:
        real, imag = msgpack.unpackb(data)
        return complex(float(real), float(imag))
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed complex number: {exc}") from exc


def op_overload(name: str) -> Any:
    """`aten::add.Tensor` → torch.ops.aten.add.Tensor (`default` when no overload is named)."""
    namespace, sep, rest = name.partition("::")
    if not sep or not namespace.isidentifier():
        raise ProtocolError(f"bad op name {name!r}")
    op_name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace), op_name)
    return getattr(packet, overload or "default")


def op_name(op: Any) -> str:
    """torch.ops.aten.add.Tensor → `aten::add.Tensor`."""
    schema = op._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
