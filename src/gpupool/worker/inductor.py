"""A captured program compiled by Inductor on the worker, when its client asks for it.

A program (`gpupool.worker.program`) is a list of aten ops on slots. Compiled, it is one call:
the ops are traced on fake tensors into an FX graph (`make_fx`), and Inductor turns that graph
into fused kernels (Triton on a CUDA worker, C++ on a CPU one), the way `torch.compile` does
on a local GPU. The worker compiles only after the program has run once op by op: every op's
argument guard and the lease's admission ran with the very arguments the graph fixes (a
program's constants never change and its inputs keep their recorded shapes and strides), so
the compiled call computes nothing that the ops did not already pass.

What is never compiled, so that a tenant cannot reach past what the op-by-op path enforces:
  - an op the policy runs behind a check (`gpupool.worker.opchecks`) that reads its tensors'
    values or fixes an argument, which a traced graph would skip. The checks that read only
    the arguments and the tensors' geometry (GEOMETRY_CHECKS) passed in the op-by-op run and
    hold for every later one: the arguments are the program's constants, and each compiled
    call first checks that its tensors still have the geometry they were compiled for
    (sizes, strides, storage offset and size), which is what those checks read. The checks
    whose only value reading is an index tensor's range (`opchecks.INDEX_RANGES`: embedding
    and max-pool backward, which a training step's backward has) are compiled where that
    tensor is one the program takes in and never writes: the program checks its range before
    every compiled call and CUDA graph replay, so the kernels only ever see indices in range;
  - an op the worker runs through a shim of its own (not a bare aten overload);
  - an argument other than numbers, bools, None, dtypes, devices, layouts, memory formats,
    short identifier-like strings ("sum", "tanh") and lists of those: nothing a tenant sends
    becomes text in generated code that is not one of those.
Indices that kernels read from tensors (gather, index, embedding) stay bounds-checked in the
generated code (`assert_indirect_indexing`), as ATen's kernels check them.
Inductor writes its generated code and compiled kernels to a cache directory private to this
worker process (made at the first compile, removed when the process ends), never to the shared
default under /tmp, and compiles in this process (no compile workers). Random ops keep ATen's
kernels (`fallback_random`), so a compiled program draws the same numbers as the op-by-op one.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

Traced = Callable[..., Any]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_PLAIN = (
    type(None), bool, int, float, torch.dtype, torch.device, torch.layout, torch.memory_format,
)  # fmt: skip
_lock = threading.Lock()
_configured = False


GEOMETRY_CHECKS = frozenset({
    "within_storage", "same_lengths", "few_views", "softmax_backward", "layer_norm_backward",
    "batch_norm", "group_norm_backward", "attention_backward", "no_varlen", "fused_optimizer",
})  # fmt: skip
"""Checks of `gpupool.worker.opchecks.CHECKS` that read arguments, sizes, strides, storage
offsets and sizes only, never a tensor's values, and change nothing."""


class NotCompilable(Exception):
    """Why a program stays op by op (said in the worker's log and the program's plan)."""


def constant_problem(value: Any, is_slot: Callable[[Any], bool]) -> str | None:
    """None if `value` (an op argument, slots allowed) may appear in a compiled graph."""
    if is_slot(value) or isinstance(value, _PLAIN):
        return None  # NaN and infinities too: Inductor writes float("nan"), float("inf")
    if isinstance(value, str):
        return None if _IDENTIFIER.fullmatch(value) else f"a string argument {value[:20]!r}"
    if isinstance(value, list | tuple):
        for item in value:
            problem = constant_problem(item, is_slot)
            if problem is not None:
                return problem
        return None
    return f"an argument of type {type(value).__name__}"


def _configure() -> None:
    """Inductor's settings for a worker, once per process, before its first compile."""
    global _configured
    if _configured:
        return
    cache = tempfile.mkdtemp(prefix="gpupool-inductor-")
    atexit.register(shutil.rmtree, cache, True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    import torch._inductor.config as config

    config.compile_threads = 1
    config.fallback_random = True
    # Indices read from tensors (gather, index, embedding) are bounds-checked in the kernels
    # Inductor writes, as ATen's own kernels check them: out of range raises (a CPU worker)
    # or fails the device assert (a CUDA one), as on a local device; never a read past.
    config.assert_indirect_indexing = True
    for name in ("autotune_remote_cache", "fx_graph_remote_cache", "bundled_autotune_remote_cache"):
        if hasattr(config, name):
            setattr(config, name, False)
    _configured = True


def geometry(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a compiled call needs unchanged of a tensor it takes (its kernels index the
    storage with the sizes and strides they were compiled for)."""
    return (
        tensor.dtype, tensor.device, tensor.shape, tensor.stride(), tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
    )  # fmt: skip


def compile_steps(
    run: Traced, examples: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype | None]
) -> Traced:
    """Inductor's compiled form of `run(*tensors) -> list of tensors` (the program's steps on
    its inputs and externals), for tensors laid out as `examples` are, returning tensors of
    `dtypes` (what `run` returned, op by op, on tensors laid out so). Raises NotCompilable
    with Inductor's own reason when it cannot compile them."""
    with _lock:  # one compile at a time: Inductor's global state is not per thread
        _configure()
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx

        try:
            with torch.no_grad():
                graph = make_fx(run, tracing_mode="fake")(*examples)
                compiled = compile_fx(graph, list(examples))
        except NotCompilable:
            raise
        except Exception as exc:
            text = str(exc).strip().splitlines()
            raise NotCompilable(
                f"{type(exc).__name__}: {text[0][:300] if text else '(no message)'}"
            ) from None
    if not callable(compiled):
        raise NotCompilable(f"Inductor returned {type(compiled).__name__}, not a callable")
    return _in_dtypes(compiled, list(dtypes))


def _in_dtypes(compiled: Traced, dtypes: list[torch.dtype | None]) -> Traced:
    """The compiled call, its outputs in the dtypes the ops gave them.

    Fake tensors and Inductor's decompositions may give another dtype than the kernel: batch
    norm of a CPU bf16 input with float32 weights saves its mean and inverse deviation in
    bf16 under both, where ATen's kernel (and the client, which inferred the program's
    outputs from it) says float32. A local torch.compile never sees the difference, since it
    traced its graphs on fake tensors too; here the outputs are what the client holds, so an
    output of another dtype is cast to its own. The first call finds which outputs need it;
    later calls cast those only (a program's inputs keep their geometry, so its outputs
    keep theirs)."""
    casts: list[tuple[int, torch.dtype]] | None = None

    def call(*tensors: torch.Tensor) -> Any:
        nonlocal casts
        values = compiled(*tensors)
        if casts is None:
            casts = [
                (i, dtype)
                for i, (value, dtype) in enumerate(zip(values, dtypes, strict=True))
                if dtype is not None and isinstance(value, torch.Tensor) and value.dtype != dtype
            ]
        if casts:
            values = list(values)
            for i, dtype in casts:
                values[i] = values[i].to(dtype)
        return values

    return call
