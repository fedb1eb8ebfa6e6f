"""A tensor an op wrote keeps geometry that fits its storage, whether the op raised or returned.

ATen's resize paths (`resize_`, `set_`, and `resize_output` behind every `out=` variant) set a
tensor's new sizes and strides first and grow its storage after: when the growth fails (the
lease's GPU memory limit inside the CUDA allocator, the worker's process cap, an overflowing
size), the op raises but the tensor already claims the new sizes over its old, smaller
storage. Every later op on it would then read and write past its storage: memory of the
worker's other tensors, or whatever the allocator holds there. `rand.generator_out` with sizes
[-2, 0, 6, 2**62, 3] even left sizes whose strides were never computed: reading them crashed
the worker. So the ops that may resize a tensor they write (`opchecks.may_resize`) run behind
this guard, which puts back each written tensor's sizes, strides and offset when the op
raises, without reading what the op left. An op that returns but leaves a written tensor
outside its storage (a negative size ATen accepted because another size was 0) has its
tensor put back the same way and is refused. In-place ops that write `self` without resizing
it (`add_`, `copy_`) skip the guard: a stream's common ops pay nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gpupool.worker.admission import written_arguments, written_tensors
from gpupool.worker.opchecks import OpRefused, may_resize

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]


_INT64_LIMIT = 1 << 63


def sound(tensor: torch.Tensor) -> bool:
    """Whether a strided tensor's sizes, strides and offset stay inside its storage, with an
    element count int64 holds (an overflowed `resize` left [2**62, 4] with strides (1, 0): in
    its storage, but no kernel could walk it)."""
    if tensor.is_nested or tensor.layout != torch.strided:
        return True
    sizes, strides, offset = list(tensor.shape), list(tensor.stride()), tensor.storage_offset()
    if any(size < 0 for size in sizes) or offset < 0:
        return False
    if any(size == 0 for size in sizes):
        return True
    if math.prod(sizes) >= _INT64_LIMIT:
        return False
    lowest = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True) if s < 0)
    highest = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True) if s > 0)
    return (
        lowest >= 0 and (highest + 1) * tensor.element_size() <= tensor.untyped_storage().nbytes()
    )


def geometry(tensor: torch.Tensor) -> Geometry:
    return tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset())


def restore(tensor: torch.Tensor, saved: Geometry) -> None:
    """Put `saved` back on `tensor`, whatever the op left on it (nothing of it is read). The old
    geometry fitted the old storage, and a storage never shrinks; should torch refuse it all
    the same, the tensor is left empty (its values are undefined after a failed op anyway)."""
    size, stride, offset = saved
    with torch.no_grad():
        try:
            tensor.as_strided_(size, stride, offset)
        except RuntimeError:
            tensor.set_(tensor.untyped_storage(), 0, (0,), (1,))


def keeping_geometry(fn: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (running op `fn`), putting back the geometry of the tensors it writes when it
    raises or leaves them unsound; `call` itself for an op that resizes nothing."""
    schema = getattr(fn, "_schema", None)
    if schema is None or not may_resize(schema):
        return call
    positions, names = written_arguments(schema)
    name = str(schema.name) + (f".{schema.overload_name}" if schema.overload_name else "")

    def run(*args: Any, **kwargs: Any) -> Any:
        saved = [
            (t, geometry(t))
            for t in written_tensors(args, kwargs, positions, names)
            if t.layout is torch.strided
        ]
        try:
            result = call(*args, **kwargs)
        except BaseException:
            for tensor, before in saved:
                restore(tensor, before)
            raise
        for tensor, before in saved:
            if geometry(tensor) != before and not sound(tensor):
                left = list(tensor.shape)
                restore(tensor, before)
                raise OpRefused(
                    f"{name} refused: it left a tensor it writes with sizes {left} "
                    "outside its storage"
                )
        return result

    return run
