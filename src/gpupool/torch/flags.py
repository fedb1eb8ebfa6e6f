"""torch's global switches, followed to the workers: deterministic algorithms, cuDNN and TF32
flags, matmul precision, the default dtype.

The switches a program sets are read by the kernels that run its ops, which run on the worker:
each stream sends a FLAGS record whenever they differ from what it last sent. The setters that
PyTorch's own functions call (`torch.use_deterministic_algorithms`, `torch.backends.cudnn.flags()`,
`torch.backends.cuda.matmul.allow_tf32 = …`, `torch.set_float32_matmul_precision`,
`torch.set_default_dtype`, `torch.backends.cudnn.benchmark = …`) send it at once, in stream order
with the ops around them; any other way of changing a switch is caught at the next batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpupool.torch import runtime
from gpupool.torch import stream as stream_module

_C = torch._C


def _first(value: Any) -> bool:
    """The fp16/bf16 reduction getters answer (allowed, split-k) on newer torch, a bool before."""
    return bool(value[0] if isinstance(value, tuple) else value)


def _matmul_precision() -> str | None:
    try:
        return str(_C._get_float32_matmul_precision())
    except RuntimeError:  # set through the newer per-backend switches: allow_tf32 says it
        return None


_READERS: list[tuple[str, Callable[[], Any]]] = [
    ("deterministic", lambda: bool(_C._get_deterministic_algorithms())),
    ("deterministic_warn_only", lambda: bool(_C._get_deterministic_algorithms_warn_only())),
    ("fill_uninitialized_memory", lambda: bool(_C._get_deterministic_fill_uninitialized_memory())),
    ("cudnn_enabled", lambda: bool(_C._get_cudnn_enabled())),
    ("cudnn_deterministic", lambda: bool(_C._get_cudnn_deterministic())),
    ("cudnn_benchmark", lambda: bool(_C._get_cudnn_benchmark())),
    ("cudnn_allow_tf32", lambda: bool(_C._get_cudnn_allow_tf32())),
    ("float32_matmul_precision", _matmul_precision),
    ("matmul_allow_tf32", lambda: bool(_C._get_cublas_allow_tf32())),
    (
        "matmul_allow_fp16_reduced_precision_reduction",
        lambda: _first(_C._get_cublas_allow_fp16_reduced_precision_reduction()),
    ),
    (
        "matmul_allow_bf16_reduced_precision_reduction",
        lambda: _first(_C._get_cublas_allow_bf16_reduced_precision_reduction()),
    ),
    ("default_dtype", lambda: str(torch.get_default_dtype()).removeprefix("torch.")),
]
"""The names `gpupool.worker.flags` takes, in its order; each read as this torch stores it."""


def snapshot() -> dict[str, Any]:
    """The switches' values now (a name whose value this torch cannot say is left out)."""
    values: dict[str, Any] = {}
    for name, read in _READERS:
        value = read()
        if value is not None:
            values[name] = value
    return values


def changed() -> None:
    """A switch was set: every open stream sends what differs, after the ops queued so far."""
    for stream in runtime.streams():
        stream.note_flags()


_SETTERS = (
    "_set_deterministic_algorithms",
    "_set_deterministic_fill_uninitialized_memory",
    "_set_cudnn_enabled",
    "_set_cudnn_deterministic",
    "_set_cudnn_benchmark",
    "_set_cudnn_allow_tf32",
    "_set_cublas_allow_tf32",
    "_set_cublas_allow_fp16_reduced_precision_reduction",
    "_set_cublas_allow_bf16_reduced_precision_reduction",
    "_set_float32_matmul_precision",
    "_set_default_dtype",
)
"""torch._C setters that PyTorch's Python functions look up at each call."""
_CUDNN_PROPS = ("enabled", "deterministic", "benchmark", "allow_tf32")
"""`torch.backends.cudnn.X = …` calls a setter bound when torch was imported: replaced too."""

_ORIGINALS: dict[str, Any] = {}
_ORIGINAL_PROPS: dict[str, Any] = {}


def _following(setter: Callable[..., Any]) -> Callable[..., Any]:
    def set_and_follow(*args: Any, **kwargs: Any) -> Any:
        result = setter(*args, **kwargs)
        changed()
        return result

    set_and_follow.__name__ = getattr(setter, "__name__", "setter")
    return set_and_follow


def install() -> None:
    if _ORIGINALS:
        return
    for name in _SETTERS:
        original = getattr(_C, name, None)
        if original is not None:
            _ORIGINALS[name] = original
            setattr(_C, name, _following(original))
    cudnn_type = type(torch.backends.cudnn)
    for name in _CUDNN_PROPS:
        prop = vars(cudnn_type).get(name)
        if isinstance(prop, torch.backends.ContextProp):
            _ORIGINAL_PROPS[name] = prop
            setattr(
                cudnn_type, name, torch.backends.ContextProp(prop.getter, _following(prop.setter))
            )
    stream_module.flags_snapshot = snapshot


def uninstall() -> None:
    stream_module.flags_snapshot = None
    for name, original in _ORIGINALS.items():
        setattr(_C, name, original)
    _ORIGINALS.clear()
    cudnn_type = type(torch.backends.cudnn)
    for name, prop in _ORIGINAL_PROPS.items():
        setattr(cudnn_type, name, prop)
    _ORIGINAL_PROPS.clear()
