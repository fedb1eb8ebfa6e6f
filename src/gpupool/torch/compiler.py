"""torch.compile while attached: Inductor on the worker where a call allows it, correct results
on remote tensors always, host graphs compiled as asked.

A call of a compiled model or function with remote tensors and no gradient to record (an
inference call: under `torch.no_grad()` or `inference_mode()`, or with nothing that requires
grad) becomes a captured step (`gpupool.torch.capture`, `compile=True`): its aten ops are
recorded as it runs, sent once, and the worker compiles them with Inductor, the way a local
torch.compile would compile them on the local GPU. What a replay would not reproduce keeps the
call on Dynamo's path: module hooks (they run Python at every call), a model or function seen
changing Python state during a call (a counter bumped, a cache filled, a flag flipped: a replay
would not repeat it; from then on), and whatever capture itself declines (a value read inside
the call, shapes that keep changing, non-tensor results); those run as below, without the
warnings capture gives for them, since a local torch.compile prints none either.

Dynamo does not trace a remote tensor's ops: RemoteTensor overrides __torch_dispatch__ without
Dynamo's subclass protocol (__tensor_flatten__), so Dynamo breaks the graph at them and they
run eagerly, each a remote op streamed to the worker. gpupool's own frames are never traced
(they would be retraced as user code). A graph that does reach the backend with remote (or
their C++ meta) inputs runs as the FX graph itself: Inductor would write kernels for a device
this process does not have. Graphs of host tensors go to the backend that was asked for.
A compiled module's or function's calls that need gradients (a training forward whose loss is
differentiated outside the call) get their forward and backward graphs from AOTAutograd, each
compiled on the worker (gpupool.torch.joint), and a call those graphs cannot stand for runs
the module or function eagerly. `GPUPOOL_COMPILED_TRAINING=0` keeps every training call on
Dynamo's path.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from gpupool.torch import runtime
from gpupool.torch.capture import CapturedStep, CaptureWarning, closure_values
from gpupool.torch.joint import TrainingGraphs
from gpupool.torch.tensor import RemoteTensor

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
    compiled = _ORIGINAL(
        model,
        fullgraph=fullgraph,
        dynamic=dynamic,
        backend=_backend(backend, mode, options, dynamic),
        disable=disable,
    )
    if disable or backend != "inductor":
        return compiled  # another backend was asked for: it never sees the worker's graph
    if isinstance(model, torch.nn.Module) and isinstance(compiled, torch.nn.Module):
        # The OptimizedModule stays what the program holds (its parameters, state_dict, train
        # and eval); only its forward, Dynamo's, is routed.
        compiled.forward = _WorkerRoute(model, compiled.forward, model)
        return compiled
    if callable(model):
        return functools.wraps(model)(_WorkerRoute(model, compiled, None))
    return compiled


class _WorkerRoute:
    """One compiled model or function: each call goes to the worker's Inductor (a captured
    step) or to Dynamo's compiled callable, as the module's docstring says."""

    def __init__(self, target: Callable[..., Any], dynamo: Callable[..., Any], module: Any) -> None:
        self.dynamo = dynamo
        self.module: torch.nn.Module | None = module
        self.side_effects = False
        """Set once a call was seen changing Python state: replays would not, so from then on
        every call takes Dynamo's path."""
        self.target = target
        self._getters: list[Callable[[], Any]] = []
        """A function's: what it closes over and the globals it names, read at each call (a
        global rebound to another model is what the next call uses)."""
        if module is None:
            # The function itself: capture guards what it closes over and the globals it names.
            self.step = CapturedStep(target, compile=True)
            self._getters = [getter for getter, _ in closure_values(target)]
        else:

            def call(*args: Any, **kwargs: Any) -> Any:
                return target(*args, **kwargs)

            self.step = CapturedStep(call, compile=True)
        self.training: TrainingGraphs | None = (
            TrainingGraphs(module if module is not None else target)
            if os.environ.get("GPUPOOL_COMPILED_TRAINING", "1") != "0"
            else None
        )
        """The calls that need gradients (None: they take Dynamo's path)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.side_effects or not runtime.attached():
            return self.dynamo(*args, **kwargs)
        # The module tree is walked once a call: for hooks, parameters and buffers, and the
        # Python state before the call (and once more after it).
        named = self._named()
        watched = self._flattened(named)
        modules = [m for m in watched if isinstance(m, torch.nn.Module)]
        route = self._route(args, kwargs, watched, modules)
        if route is None:
            return self.dynamo(*args, **kwargs)
        before = _python_state(watched)
        if route == "training":
            assert self.training is not None
            # Where the graphs cannot stand for the call the module or function runs eagerly:
            # Dynamo would break its graph at every remote op anyway, and on a client without
            # CUDA its fake cuda tensors (a mask made with torch.arange(device=...)) fail in
            # autograd.
            if self.module is None:
                result = self.training(args, kwargs, modules, before, self.target, named)
            else:
                result = self.training(args, kwargs, modules, before, self.module)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CaptureWarning)
                result = self.step(*args, **kwargs)
        # A recorded call ran the Python; a replay did not, and changes nothing here.
        self.side_effects = _python_state(watched) != before
        return result

    def _named(self) -> list[Any]:
        """What the call may use beyond its arguments: the module, or what the function names
        now."""
        if self.module is not None:
            return [self.module]
        return [getter() for getter in self._getters]

    @staticmethod
    def _flattened(named: list[Any]) -> list[Any]:
        """What is watched, each module replaced by itself and every submodule."""
        out: list[Any] = []
        for value in named:
            out.extend(value.modules() if isinstance(value, torch.nn.Module) else (value,))
        return out

    def _route(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        watched: list[Any],
        modules: list[torch.nn.Module],
    ) -> str | None:
        """Where the call goes: "inference" (a captured step), "training" (the traced forward
        and backward graphs) or None (Dynamo's path). `watched`: _flattened()'s list;
        `modules`: the modules among it."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors += [t for t in watched if isinstance(t, torch.Tensor)]  # a function's closure
        if _hooked(modules):  # the module's, or those the function names
            return None
        for m in modules:
            tensors += [t for t in m._parameters.values() if t is not None]
            tensors += [t for t in m._buffers.values() if t is not None]
        if not any(isinstance(t, RemoteTensor) for t in tensors):
            return None
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return "inference"
        return "training" if self.training is not None else None


_SCALARS = (int, float, bool, str, bytes, type(None))
_TABLES = frozenset(
    {"_parameters", "_buffers", "_modules"} | (set(torch.nn.Module().__dict__) - {"training"})
)
"""What capture's guards already follow (tensors and children replaced), and nn.Module's own
bookkeeping: its hook tables (_hooked() looks at those that run in a call) and state-dict
hooks, which no forward reads."""


def _python_state(values: list[Any]) -> list[Any]:
    """A fingerprint of the Python state a compiled call could change: for each module among
    `values` (flattened: submodules listed) its attributes, for anything else itself; a scalar
    by value, a list, dict or set by identity and length, anything else by identity. A counter
    bumped, an entry added to a cache, a flag flipped: the fingerprint changes."""
    state: list[Any] = []
    for value in values:
        if isinstance(value, torch.nn.Module):
            state.extend(
                (key, _fingerprint(item))
                for key, item in value.__dict__.items()
                if key not in _TABLES
            )
        else:
            state.append(_fingerprint(value))
    return state


_SIZED = (list, dict, set)


def _fingerprint(value: Any) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, _SIZED):
        return (id(value), len(value))
    return id(value)


def _hooked(modules: list[torch.nn.Module]) -> bool:
    """Whether a call runs hooks (Python at every call, which a replay would skip)."""
    hooks = torch.nn.modules.module
    if (
        hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    ):
        return True
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        for m in modules
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
