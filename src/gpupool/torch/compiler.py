"""torch.compile while attached: correct results on remote tensors, host graphs compiled as asked.

Dynamo does not trace a remote tensor's ops: RemoteTensor overrides __torch_dispatch__ without
Dynamo's subclass protocol (__tensor_flatten__), so Dynamo breaks the graph at them and they
run eagerly, each a remote op streamed to the worker. gpupool's own frames are never traced
(they would be retraced as user code). A graph that does reach the backend with remote (or
their C++ meta) inputs runs as the FX graph itself: Inductor would write kernels for a device
this process does not have. Graphs of host tensors go to the backend that was asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_ORIGINAL: Any = None


def _touches_remote(example_inputs: list[Any]) -> bool:
    """Dynamo's example inputs are fake tensors; a remote one reports cuda (or its C++ meta)."""
    return any(
        isinstance(t, torch.Tensor) and t.device.type in ("cuda", "meta") for t in example_inputs
    )


def _backend(requested: Any, mode: str | None, options: dict[str, Any] | None, dynamic: Any) -> Any:
    """The backend torch.compile would have used, as a callable, and the one used instead."""
    local: Callable[..., Any]
    if requested == "inductor":
        local = torch._TorchCompileInductorWrapper(mode, options, dynamic)
    else:
        local = torch._TorchCompileWrapper(requested, mode, options, dynamic)

    def gpupool_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if _touches_remote(example_inputs):
            return gm.forward
        return local(gm, example_inputs)

    return gpupool_backend


_skipped = False


def _skip_gpupool() -> None:
    """Dynamo must not trace gpupool's frames (at the first compile: importing Dynamo takes
    a while, and most programs never compile)."""
    global _skipped
    if not _skipped:
        import torch._dynamo.trace_rules as trace_rules

        trace_rules.add("gpupool")
        _skipped = True


def compile(
    model: Any = None,
    *,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: Any = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    disable: bool = False,
) -> Any:
    if model is None:

        def decorate(fn: Any) -> Any:
            return compile(
                fn, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                options=options, disable=disable,
            )  # fmt: skip

        return decorate
    _skip_gpupool()
    if mode is not None and options is not None:
        raise RuntimeError("Either mode or options can be specified, but both can't be specified")
    return _ORIGINAL(
        model,
        fullgraph=fullgraph,
        dynamic=dynamic,
        backend=_backend(backend, mode, options, dynamic),
        disable=disable,
    )


def install() -> None:
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    _ORIGINAL = torch.compile
    torch.compile = compile  # type: ignore[assignment]


def uninstall() -> None:
    global _ORIGINAL
    if _ORIGINAL is not None:
        torch.compile = _ORIGINAL
        _ORIGINAL = None
