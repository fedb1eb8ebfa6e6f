"""A tensor an op failed to resize keeps the sizes it had, not the ones the op was asked for.

ATen's resize paths (`resize_`, `set_`, and `resize_output` behind every `out=` variant) set a
tensor's new sizes and strides first and grow its storage after: when the growth fails (the
lease's GPU memory limit inside the CUDA allocator, the worker's process cap, an overflowing
size), the op raises but the tensor already claims the new sizes over its old, smaller
storage. Every later op on it would then read and write past its storage: memory of the
worker's other tensors, or whatever the allocator holds there. So the ops that may resize a
tensor they write (`opchecks.may_resize`) run behind this guard, which puts back each written
tensor's sizes, strides and offset when the op raises. In-place ops that write `self` without
resizing it (`add_`, `copy_`) skip the guard: a stream's common ops pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpupool.worker.admission import written_arguments, written_tensors
from gpupool.worker.opchecks import may_resize


def keeping_geometry(fn: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (running op `fn`), putting back the geometry of the tensors it writes when it
    raises; `call` itself for an op that resizes nothing."""
    schema = getattr(fn, "_schema", None)
    if schema is None or not may_resize(schema):
        return call
    positions, names = written_arguments(schema)

    def run(*args: Any, **kwargs: Any) -> Any:
        saved = [
            (t, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))
            for t in written_tensors(args, kwargs, positions, names)
            if t.layout is torch.strided
        ]
        try:
            return call(*args, **kwargs)
        except BaseException:
            for tensor, size, stride, offset in saved:
                now = (tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset()))
                if now != (size, stride, offset):
                    # The old geometry fitted the old storage, and a storage never shrinks.
                    with torch.no_grad():
                        tensor.as_strided_(size, stride, offset)
            raise

    return run
