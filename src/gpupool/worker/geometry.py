"""A tensor an op failed to resize keeps the sizes it had, not the ones the op was asked for.

ATen's resize paths (`resize_`, `set_`, and `resize_output` behind every `out=` variant) set a
tensor's new sizes and strides first and grow its storage after: when the growth fails (the
lease's GPU memory limit inside the CUDA allocator, the worker's process cap, an overflowing
size), the op raises but the tensor already claims the new sizes over its old, smaller
storage. Every later op on it would then read and write past its storage: memory of the
worker's other tensors, or whatever the allocator holds there. So the ops that may resize a
tensor they write run behind this guard, which puts back each written tensor's sizes, strides
and offset when the op raises. In-place ops that write `self` without resizing it (`add_`,
`copy_`) cannot do this and skip the guard: a stream's common ops pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

RESIZING_SELF = frozenset({"resize_", "resize_as_", "set_", "_resize_output_", "as_strided_"})
"""Ops that change the geometry of `self` (the others written in place keep it)."""

Geometry = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], int]


def written_arguments(fn: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments the op may resize: `out=` tensors (every written
    argument that is not `self`) and `self` for the resizing ops. Empty for the rest."""
    schema = getattr(fn, "_schema", None)
    if schema is None:
        return ()
    base = schema.name.partition("::")[2]
    found = []
    for position, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        if argument.name != "self" or base in RESIZING_SELF:
            found.append((position, argument.name))
    return tuple(found)


def keeping_geometry(
    call: Callable[..., Any], written: Sequence[tuple[int, str]]
) -> Callable[..., Any]:
    """`call`, putting back the geometry of the tensors at `written` when it raises."""

    def run(*args: Any, **kwargs: Any) -> Any:
        saved = _geometries(args, kwargs, written)
        try:
            return call(*args, **kwargs)
        except BaseException:
            _restore(saved)
            raise

    return run


def _geometries(
    args: tuple[Any, ...], kwargs: dict[str, Any], written: Sequence[tuple[int, str]]
) -> list[Geometry]:
    saved: list[Geometry] = []
    for position, name in written:
        value = args[position] if position < len(args) else kwargs.get(name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided:
                saved.append(
                    (
                        tensor,
                        tuple(tensor.size()),
                        tuple(tensor.stride()),
                        int(tensor.storage_offset()),
                    )
                )
    return saved


def _restore(saved: list[Geometry]) -> None:
    for tensor, size, stride, offset in saved:
        if (tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset()) == (
            size,
            stride,
            offset,
        ):
            continue
        # The old geometry fitted the old storage, and a storage never shrinks.
        with torch.no_grad():
            tensor.as_strided_(size, stride, offset)
