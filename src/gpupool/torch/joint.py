"""Training calls of a torch.compile'd module or function: forward and backward graphs compiled
on the worker.

A local `torch.compile` of a training forward hands Dynamo's graph to AOTAutograd, which traces
forward and backward together on fake tensors, splits them into a forward graph (which also
returns what the backward needs) and a backward graph, and has Inductor compile each. Dynamo
does not trace remote tensors (gpupool.torch.compiler), so here AOTAutograd traces the module
itself, per call signature, on fake stand-ins of its remote parameters, buffers and inputs.
Each of the two graphs becomes a captured step (`gpupool.torch.capture`, compile=True): its
first calls run op by op, then the worker replays it as one program and compiles it with
Inductor (Triton and a CUDA graph on a CUDA worker, C++ on a CPU one). AOTAutograd's own
runtime ties the two together with an autograd Function, so the call's outputs carry autograd
history like any compiled module's, and `loss.backward()` outside the call runs the backward
graph: one RUN record each way instead of an op per aten op.

The stand-ins live on the tensors' C++ device (`gpupool:N`): a fake `cuda` tensor aborts in
autograd on a CPU-only torch (no CUDA device guard), and factory calls in the graphs then name
the remote tensors' own C++ device, which gpupool's kernels take.

A compiled function is traced the same way, as a module whose children are the modules it
names (its closure cells, the globals it reads, a bound method's `self`), so their parameters
and buffers are the graph's inputs as a module's own are (`_Calls`). A tensor it closes over
directly is not lifted: the trace sees it as a constant and declines. A function that calls
`backward()`, `torch.autograd.grad` or an optimizer's `step()` inside the call (a whole
training step compiled) declines too: the graphs would leave out those effects on `.grad` and
on the weights, so it runs eagerly.

Under bf16/fp16 autocast the trace runs with autocast on for the fakes' device, so the
graphs hold its casts (gpupool.torch.autocast.traced_autocast), and the signature holds the
autocast dtype. What the trace cannot stand for runs the module eagerly (remote ops one by
one, correct): a forward that reads a value or holds a tensor that is not a parameter,
buffer or argument, host tensors among the arguments, results that are not tensors and
plain constants, and more than `MAX_SIGNATURES` signatures. The reason is kept per signature
(`declined()`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpupool.torch import autocast
from gpupool.torch.capture import CapturedStep, CaptureWarning
from gpupool.torch.tensor import RemoteTensor

MAX_SIGNATURES = 8
"""Traced signatures per module (each its own pair of programs); others run eagerly."""

_CONSTANTS = (int, float, bool, str, type(None))
"""Result leaves a graph may leave out and the call puts back as they were traced."""

_TRACE_LOCK = threading.Lock()
"""One trace at a time: each swaps and restores what _tracing() swaps."""
_OUTPUT = object()
"""Marks a tensor output's place among a result's traced leaves."""


class Declined(Exception):
    """The trace cannot stand for this call; the message says why."""


@contextlib.contextmanager
def _tracing() -> Iterator[None]:
    """While AOTAutograd traces: remote tensors report their C++ device (their fake stand-ins
    are made on it), and `torch.compiler.is_compiling()` is True, as under Dynamo, so that
    libraries skip the value checks they skip for torch.compile (transformers' masks do).

    Both are swapped, not checked per access: `device` is read on every remote op, and a trace
    happens once per signature. Another thread meanwhile would see them swapped too; the lock
    keeps two traces from restoring each other's."""
    with _TRACE_LOCK:
        device = RemoteTensor.__dict__["device"]
        is_compiling = torch.compiler.is_compiling
        RemoteTensor.device = property(  # type: ignore[assignment,method-assign]
            lambda self: self._gp.stream.cxx_device
        )
        torch.compiler.is_compiling = lambda: True
        try:
            yield
        finally:
            RemoteTensor.device = device  # type: ignore[method-assign]
            torch.compiler.is_compiling = is_compiling


class _Calls(torch.nn.Module):
    """A compiled function as AOTAutograd takes a module: the modules it names are children,
    so that their parameters and buffers are lifted as the graph's inputs."""

    def __init__(self, function: Callable[..., Any], modules: list[torch.nn.Module]) -> None:
        super().__init__()
        self.function = function
        self.named = torch.nn.ModuleList(modules)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


@contextlib.contextmanager
def _no_side_effects() -> Iterator[None]:
    """While tracing: what the graphs would leave out declines the trace, before it happens.
    `backward()` inside the call would fill `.grad` of the fake stand-ins, not of the weights;
    `torch.autograd.grad` from the program's code is refused too (torch's own calls, AOTAutograd's
    that make the backward graph among them, go through); an optimizer's step would update
    the weights outside any graph. Only the tracing thread is refused: another thread's
    backward and steps meanwhile run as ever (the swapped functions are process-wide)."""
    autograd = torch.autograd
    backward, grad = autograd.backward, autograd.grad
    tracing = threading.get_ident()

    def no_backward(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == tracing:
            raise Declined("the call runs backward() inside it")
        return backward(*args, **kwargs)

    def only_aot_grad(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if threading.get_ident() == tracing and not caller.startswith("torch."):
            raise Declined("the call runs torch.autograd.grad inside it")
        return grad(*args, **kwargs)

    def no_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == tracing:
            raise Declined(f"the call steps a {type(optimizer).__name__} inside it")

    hook = register_optimizer_step_pre_hook(no_step)
    autograd.backward, autograd.grad = no_backward, only_aot_grad
    try:
        yield
    finally:
        autograd.backward, autograd.grad = backward, grad
        hook.remove()


class _Flat(torch.nn.Module):
    """The module as AOTAutograd wants it: tensors in, a tuple of tensors out. The call's other
    leaves (scalars, None, strings) are fixed for the signature, and so are the result's."""

    def __init__(self, module: torch.nn.Module, leaves: list[Any], spec: Any) -> None:
        super().__init__()
        self.module = module
        self._leaves = leaves
        self._spec = spec
        self._positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.result_spec: Any = None
        self.result_leaves: list[Any] = []

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for position, tensor in zip(self._positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, self._spec)
        result = self.module(*args, **kwargs)
        out, self.result_spec = tree_flatten(result)
        for leaf in out:
            if not isinstance(leaf, (torch.Tensor, *_CONSTANTS)):
                raise Declined(f"the forward returns a {type(leaf).__name__}")
        self.result_leaves = [_OUTPUT if isinstance(leaf, torch.Tensor) else leaf for leaf in out]
        return tuple(leaf for leaf in out if isinstance(leaf, torch.Tensor))


@dataclass
class _Traced:
    call: Callable[..., Any]
    flat: _Flat
    steps: list[CapturedStep]
    calls: int = 0


def _graph_compiler(steps: list[CapturedStep]) -> Callable[..., Any]:
    """AOTAutograd's forward or backward compiler: the graph becomes a captured step that the
    worker compiles (boxed calling convention: AOTAutograd passes one list of arguments)."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        for node in gm.graph.nodes:
            held = getattr(gm, str(node.target), None) if node.op == "get_attr" else None
            if isinstance(held, torch.Tensor):
                raise Declined("the forward makes a tensor constant")

        orders: list[tuple[int, ...] | None] = [None]
        """How a call's distinct arguments fill the graph's inputs; 0 (None): one to one."""
        known: dict[tuple[int, ...], int] = {}

        def expanded(order: int, *unique: Any) -> Any:
            places = orders[order]
            return gm(*unique) if places is None else gm(*[unique[i] for i in places])

        step = CapturedStep(expanded, compile=True, aten_graph=True)
        steps.append(step)

        def run(args: list[Any]) -> Any:
            values = list(args)
            args.clear()  # the boxed convention: the graph's inputs may be freed as it runs
            order = 0
            if len({id(value) for value in values}) != len(values):
                # A captured step takes each tensor once: a tensor passed twice (labels given
                # as input_ids) goes once, and where it goes is part of the step's signature.
                values, places = _distinct_tensors(values)
                order = known.get(places, 0)
                if order == 0:
                    order = known[places] = len(orders)
                    orders.append(places)
            with warnings.catch_warnings(), autocast.suspended():
                # The graph holds autocast's casts: its ops are not cast again.
                warnings.simplefilter("ignore", CaptureWarning)
                return step(order, *values)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compile_graph


def _distinct_tensors(values: list[Any]) -> tuple[list[Any], tuple[int, ...]]:
    """Each tensor once (other values as they come), and where each value went."""
    unique: list[Any] = []
    places: list[int] = []
    seen: dict[int, int] = {}
    for value in values:
        at = seen.get(id(value)) if isinstance(value, torch.Tensor) else None
        if at is None:
            at = len(unique)
            unique.append(value)
            if isinstance(value, torch.Tensor):
                seen[id(value)] = at
        places.append(at)
    return unique, tuple(places)


def _distinct_modules(values: list[Any]) -> list[torch.nn.Module]:
    """The modules among `values`, each once."""
    seen: set[int] = set()
    out: list[torch.nn.Module] = []
    for value in values:
        if isinstance(value, torch.nn.Module) and id(value) not in seen:
            seen.add(id(value))
            out.append(value)
    return out


class TrainingGraphs:
    """One compiled module's or function's training calls, traced per signature (see the
    module docstring). `target`: the module, or the function."""

    def __init__(self, target: torch.nn.Module | Callable[..., Any]) -> None:
        self.target = target
        self._traced: dict[Any, _Traced] = {}
        self._declined: dict[Any, str] = {}
        self._seen: set[Any] = set()

    def declined(self) -> list[str]:
        """Why calls of some signatures run eagerly."""
        return list(self._declined.values())

    def steps(self) -> list[CapturedStep]:
        """The captured forward and backward graphs of every traced signature."""
        return [step for traced in self._traced.values() for step in traced.steps]

    def __call__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        modules: list[torch.nn.Module],
        state: list[Any],
        fallback: Callable[..., Any],
        named: list[Any] | None = None,
    ) -> Any:
        """The call through the traced graphs, or through `fallback` (the module or function,
        eagerly) where they cannot stand for it. A signature's first call takes the fallback: it
        runs the Python for real, so the caller sees whether it changes Python state before
        a trace that would run it on fakes. `modules`: every module the call may use (each
        submodule listed), for the signature; `named`: everything a function names (the
        modules among it are those whose parameters and buffers its graphs take in)."""
        leaves, spec = tree_flatten((args, kwargs))
        key, why = self._key(leaves, spec, modules, state)
        if why is None and any(isinstance(value, torch.Tensor) for value in named or ()):
            why = "the function closes over a tensor (the graphs would hold it as a constant)"
        if why is not None:
            self._declined.setdefault(why, why)
            return fallback(*args, **kwargs)
        traced = self._traced.get(key)
        if traced is None:
            if key in self._declined:
                return fallback(*args, **kwargs)
            if key not in self._seen:
                self._seen.add(key)
                return fallback(*args, **kwargs)
            if len(self._traced) >= MAX_SIGNATURES:
                self._declined[key] = f"more than {MAX_SIGNATURES} signatures"
                return fallback(*args, **kwargs)
            try:
                traced = self._trace(leaves, spec, _distinct_modules(named or []))
            except Exception as error:  # the trace stands for nothing: eager calls
                self._declined[key] = f"{type(error).__name__}: {error}"
                return fallback(*args, **kwargs)
            self._traced[key] = traced
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if traced.calls == 0:
            # The graph's first call runs its ops one by one in this process: an op the
            # remote runtime refuses there leaves nothing changed (the graph is functional,
            # its writes into buffers come last), so the eager call takes over.
            try:
                outputs = traced.call(*tensors)
            except Exception as error:
                self._declined[key] = f"{type(error).__name__}: {error}"
                del self._traced[key]
                return fallback(*args, **kwargs)
        else:
            outputs = traced.call(*tensors)
        traced.calls += 1
        it = iter(outputs)
        result = [next(it) if leaf is _OUTPUT else leaf for leaf in traced.flat.result_leaves]
        return tree_unflatten(result, traced.flat.result_spec)

    def _key(
        self, leaves: list[Any], spec: Any, modules: list[torch.nn.Module], state: list[Any]
    ) -> tuple[Any, str | None]:
        enabled, dtype = autocast._enabled()
        parts: list[Any] = [spec, dtype if enabled else None]
        for leaf in leaves:
            if isinstance(leaf, RemoteTensor):
                parts.append((leaf._sig, leaf._gp.stream.index, leaf.requires_grad))
            elif isinstance(leaf, torch.Tensor):
                return None, "a host tensor argument"
            elif isinstance(leaf, _CONSTANTS):
                parts.append((type(leaf), leaf))
            else:
                return None, f"a {type(leaf).__name__} argument"
        for module in modules:
            parts.append(module.training)
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None:
                        parts.append((name, None))
                    elif isinstance(tensor, RemoteTensor):
                        parts.append((name, id(tensor), tensor._sig, tensor.requires_grad))
                    else:
                        return None, f"{name} is a {tensor.device} tensor"
        try:
            key = (tuple(parts), tuple(state))
            hash(key)
        except TypeError:
            return None, "unhashable Python state"
        return key, None

    def _trace(self, leaves: list[Any], spec: Any, roots: list[torch.nn.Module]) -> _Traced:
        from torch._functorch import config as functorch_config
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        target = self.target
        module = target if isinstance(target, torch.nn.Module) else _Calls(target, roots)
        flat = _Flat(module, leaves, spec)
        steps: list[CapturedStep] = []
        compiler = _graph_compiler(steps)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        enabled, dtype = autocast._enabled()
        # Under autocast("cuda") the casts are traced into the graphs, as a local
        # torch.compile traces them (gpupool.torch.autocast.traced_autocast).
        casts = autocast.traced_autocast(dtype) if enabled else contextlib.nullcontext()
        # The backward graph is compiled (made a captured step) now, not at the first
        # backward: what it cannot stand for declines the signature here, where the module
        # can still run eagerly, rather than failing inside the caller's loss.backward().
        eager_backward = (
            functorch_config.patch(force_non_lazy_backward_lowering=True)
            if hasattr(functorch_config, "force_non_lazy_backward_lowering")
            else contextlib.nullcontext()
        )
        with _tracing(), _no_side_effects(), casts, eager_backward:
            call = aot_module_simplified(
                flat,  # type: ignore[arg-type]  # typed for Dynamo's graphs; takes any module
                tensors,
                fw_compiler=compiler,
                bw_compiler=compiler,
                partition_fn=min_cut_rematerialization_partition,
                # Updates autograd does not see (batch norm's running statistics) stay in the
                # forward graph, as torch.compile keeps them: AOTAutograd would otherwise
                # write each buffer back with its own copy_ after the graph, an op apiece.
                keep_inference_input_mutations=True,
            )
        return _Traced(call, flat, steps)
