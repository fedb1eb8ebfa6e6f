"""The client's global torch switches, applied in the worker: what FLAGS records may set.

A program that calls `torch.use_deterministic_algorithms(True)` or sets
`torch.backends.cudnn.benchmark` means the GPU that runs its ops, which is the worker's. Every
name and value is the tenant's: only the names below, each with its type (and for strings
its values), are accepted; anything else is a protocol error. A new client is served with
torch's defaults again (`reset`), whatever the previous one set.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import ProtocolError

DEFAULT_DTYPES = ("float32", "float64", "float16", "bfloat16")
"""What `torch.set_default_dtype` accepts."""
MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclass(frozen=True)
class Flag:
    kind: type
    apply: Callable[[Any], None]
    read: Callable[[], Any]
    choices: tuple[str, ...] = ()


def _quiet(setter: Callable[[Any], None]) -> Callable[[Any], None]:
    """The legacy TF32 switches warn that newer ones exist; the tenant set them, so no noise."""

    def apply(value: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            setter(value)

    return apply


CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
"""What cuBLAS needs for deterministic results, and PyTorch checks at every cuBLAS call in
deterministic mode (a RuntimeError otherwise). On a local GPU the user sets it; a worker's
environment is the agent's, so the worker sets it when a client turns the mode on, unless it
is set already (the size is PyTorch's default workspace on Hopper GPUs anyway)."""


def _set_deterministic(value: bool) -> None:
    if value and torch.cuda.is_available():
        os.environ.setdefault(*CUBLAS_WORKSPACE)
    # torch.use_deterministic_algorithms also imports Inductor for its own switch (seconds,
    # and nothing compiles on a worker): the switch the kernels read is this one.
    torch._C._set_deterministic_algorithms(
        value, warn_only=torch.is_deterministic_algorithms_warn_only_enabled()
    )


def _set_warn_only(value: bool) -> None:
    torch._C._set_deterministic_algorithms(
        torch.are_deterministic_algorithms_enabled(), warn_only=value
    )


def _set_fill(value: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = value  # type: ignore[attr-defined]


def _setattr(owner: Any, name: str) -> Callable[[Any], None]:
    return _quiet(lambda value: setattr(owner, name, value))


def _getattr(owner: Any, name: str) -> Callable[[], Any]:
    def read() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return getattr(owner, name)

    return read


def _matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # set through the newer per-backend switches
        return "high" if torch.backends.cuda.matmul.allow_tf32 else "highest"


_CUDNN = torch.backends.cudnn
_MATMUL = torch.backends.cuda.matmul

FLAGS: dict[str, Flag] = {
    "deterministic": Flag(bool, _set_deterministic, torch.are_deterministic_algorithms_enabled),
    "deterministic_warn_only": Flag(
        bool, _set_warn_only, torch.is_deterministic_algorithms_warn_only_enabled
    ),
    "fill_uninitialized_memory": Flag(
        bool,
        _set_fill,
        lambda: bool(torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
    ),
    "cudnn_enabled": Flag(bool, _setattr(_CUDNN, "enabled"), _getattr(_CUDNN, "enabled")),
    "cudnn_deterministic": Flag(
        bool, _setattr(_CUDNN, "deterministic"), _getattr(_CUDNN, "deterministic")
    ),
    "cudnn_benchmark": Flag(bool, _setattr(_CUDNN, "benchmark"), _getattr(_CUDNN, "benchmark")),
    "cudnn_allow_tf32": Flag(bool, _setattr(_CUDNN, "allow_tf32"), _getattr(_CUDNN, "allow_tf32")),
    "float32_matmul_precision": Flag(
        str, _quiet(torch.set_float32_matmul_precision), _matmul_precision, MATMUL_PRECISIONS
    ),
    "matmul_allow_tf32": Flag(
        bool, _setattr(_MATMUL, "allow_tf32"), _getattr(_MATMUL, "allow_tf32")
    ),
    "matmul_allow_fp16_reduced_precision_reduction": Flag(
        bool,
        _setattr(_MATMUL, "allow_fp16_reduced_precision_reduction"),
        _getattr(_MATMUL, "allow_fp16_reduced_precision_reduction"),
    ),
    "matmul_allow_bf16_reduced_precision_reduction": Flag(
        bool,
        _setattr(_MATMUL, "allow_bf16_reduced_precision_reduction"),
        _getattr(_MATMUL, "allow_bf16_reduced_precision_reduction"),
    ),
    "default_dtype": Flag(
        str,
        lambda name: torch.set_default_dtype(getattr(torch, name)),
        lambda: str(torch.get_default_dtype()).removeprefix("torch."),
        DEFAULT_DTYPES,
    ),
}
"""In the order they are applied: the precision before the TF32 switch it also sets."""


def current() -> dict[str, Any]:
    """The worker's values now (STATS reports them)."""
    return {name: flag.read() for name, flag in FLAGS.items()}


_DEFAULTS = current()
"""torch's values when the worker started: what each new client begins with."""


def validate(values: Any) -> dict[str, Any]:
    """A FLAGS record's body, checked name by name before anything is applied."""
    if not isinstance(values, dict):
        raise ProtocolError("FLAGS needs a map of names to values")
    checked: dict[str, Any] = {}
    for name, value in values.items():
        flag = FLAGS.get(name) if isinstance(name, str) else None
        if flag is None:
            raise ProtocolError(f"FLAGS names an unknown switch {name!r:.60}")
        if type(value) is not flag.kind:
            raise ProtocolError(f"FLAGS {name} must be a {flag.kind.__name__}")
        if flag.choices and value not in flag.choices:
            raise ProtocolError(f"FLAGS {name} must be one of {', '.join(flag.choices)}")
        checked[name] = value
    return checked


def apply(values: dict[str, Any]) -> None:
    """Set validated values, in FLAGS order."""
    for name, flag in FLAGS.items():
        if name in values and flag.read() != values[name]:
            flag.apply(values[name])


def reset() -> None:
    """torch's switches as the worker started with them (a new client comes)."""
    apply(_DEFAULTS)
