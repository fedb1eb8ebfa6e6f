"""Captured steps: `step = gpupool.torch.capture(fn)` records fn's ops on remote tensors, sends
them to the worker once, and from then on every call is one RUN record: the new inputs in,
handles to the outputs back, no Python per op.

How a call goes, per input signature (shapes, dtypes, strides of the tensor arguments, the
other arguments' values, grad mode and autocast):
  1. the first calls run fn eagerly while a `Recorder` sees every op, put and read; each
     recording is turned into a program whose tensors are slots (inputs, the client's
     persistent tensors, temporaries). Warm-up calls differ (optimizer state is created on the
     first step), so a program is sent only once two consecutive recordings are identical,
     constant scalars included: a value that changes every call (a learning-rate schedule, a
     step count computed on the host) never stabilises and the step stays eager.
  2. later calls check the guards (the step's persistent tensors still exist, the tensors and
     modules it closes over are the same objects, optimizer hyperparameters and train/eval
     modes unchanged) and send RUN. A failed guard re-captures with a warning.
A step that cannot be replayed faithfully (it reads values, uses two GPUs, seeds the
generator, reshapes an input in place) runs eagerly for good, with a `CaptureWarning` that
says why. Only the step's ops are replayed: Python side effects inside fn (counters, lists)
happen only on the eager calls, and outputs come back without autograd history.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpupool.protocol.v1.dataplane import PROGRAM_VERSION, Ext, Rec, pack
from gpupool.protocol.v1.tensors import dtype_name, tensor_bytes
from gpupool.torch import autocast, runtime
from gpupool.torch.stream import DeviceStream
from gpupool.torch.tensor import Handle, RemoteTensor, wrap_signature

MAX_RECORDINGS = 4
"""Eager recordings of one signature before giving up: warm-up needs two or three."""
MAX_SIGNATURES = 8
"""Input signatures (each its own program) per step before new ones run eagerly."""
MAX_RECAPTURES = 8
"""Guard failures per signature before the step stays eager (it changes all the time)."""

METADATA_CALLS = frozenset({"aten::_fused_sdp_choice"})
"""Ops the worker answers (a round trip) from shapes, dtypes and the device alone: what they
return cannot change while the signature holds, so they may run inside a captured step
(only while it is recorded; the replay runs the kernels they chose)."""

_TENSOR = int(Ext.TENSOR)
_SLOT = int(Ext.SLOT)
_PROGRAM_IDS = itertools.count(1)
OUTPUT = object()
_FLAT = frozenset({RemoteTensor, torch.nn.Parameter, int, float, bool, str, type(None)})
"""Argument types that need no pytree walk (a Parameter of a remote model is a RemoteTensor)."""
"""Marks a tensor output's place among a result's leaves."""


class CaptureWarning(UserWarning):
    """A captured step fell back to eager execution, or was captured again."""


def capture(
    fn: Callable[..., Any] | None = None, *, graph: bool = True, compile: bool = False
) -> Any:
    """Capture a step: `step = capture(train_step)` or `@capture` / `@capture(graph=False)`.

    graph=False keeps a CUDA worker replaying op by op instead of as a CUDA graph.
    compile=True asks the worker to compile the step's program with Inductor (fused Triton
    kernels on a CUDA worker, C++ on a CPU one) after its first replay; a program it may not
    or cannot compile keeps replaying op by op, and the worker's log says why."""
    if fn is None:
        return lambda f: CapturedStep(f, graph=graph, compile=compile)
    return CapturedStep(fn, graph=graph, compile=compile)


# ---- recording -------------------------------------------------------------------------------


class Recorder:
    """What one eager call of the step sent: its op records and puts, the handles it made,
    and the first reason (if any) it cannot be replayed."""

    def __init__(self) -> None:
        self.stream: DeviceStream | None = None
        self.steps: list[list[Any]] = []
        self.new: dict[int, weakref.ref[Handle]] = {}
        self.released: set[int] = set()
        self.optimizers: list[torch.optim.Optimizer] = []
        self.problem: str | None = None

    def _fail(self, why: str) -> None:
        if self.problem is None:
            self.problem = why

    def _on(self, stream: DeviceStream) -> None:
        if self.stream is None:
            self.stream = stream
        elif stream is not self.stream:
            self._fail("uses more than one GPU")

    def on_new_handle(self, stream: DeviceStream, handle: Handle) -> None:
        self._on(stream)
        self.new[handle.id] = weakref.ref(handle)

    def on_emit(self, stream: DeviceStream, record: list[Any]) -> None:
        kind = record[0]
        if kind == Rec.OP:
            self._on(stream)
            self.steps.append(record)
        elif kind != Rec.PUT:  # puts arrive whole through on_put
            self._fail(f"sends {Rec(kind).name} (seeds or restores the generator) inside the step")

    def on_put(self, stream: DeviceStream, handle: Handle, host: torch.Tensor) -> None:
        self._on(stream)
        self.steps.append(["put", handle.id, host.clone()])

    def on_wait(self, stream: DeviceStream, what: str) -> None:
        self._fail(what)

    def on_call(self, stream: DeviceStream, op: str) -> None:
        if op not in METADATA_CALLS:
            self._fail(f"runs {op.partition('.')[0]}, whose outputs depend on values")

    def on_release(self, handle: int) -> None:
        self.released.add(handle)

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
        make_capturable(optimizer)


_told_capturable: set[str] = set()


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Adam, AdamW and their kin compute bias corrections on the host from a CPU step count
    unless `capturable=True`: a replayed program would repeat the recorded step's numbers.
    With capturable the count lives on the GPU and the step is the same arithmetic there."""
    changed = False
    for group in optimizer.param_groups:
        if group.get("capturable") is not False:
            continue
        if not any(isinstance(p, RemoteTensor) for p in group["params"]):
            continue
        group["capturable"] = True
        changed = True
        for param in group["params"]:
            state: dict[str, Any] = optimizer.state.get(param) or {}
            step = state.get("step")
            if isinstance(step, torch.Tensor) and not isinstance(step, RemoteTensor):
                state["step"] = step.to(param.device)
    name = type(optimizer).__name__
    if changed and name not in _told_capturable:
        _told_capturable.add(name)
        warnings.warn(
            f"gpupool.torch.capture: {name} now keeps its step count on the GPU "
            "(capturable=True), so a captured step replays its updates exactly",
            CaptureWarning,
            stacklevel=4,
        )


@dataclass
class Recording:
    """One recorded call as a program: `canon` is what two calls must share to be replayed."""

    stream: DeviceStream
    body: dict[str, Any]
    canon: tuple[Any, ...]
    externals: frozenset[int]
    escapes: list[Handle]
    outputs: list[tuple[Any, ...]]
    """Signatures of the tensor outputs, in order."""
    result_spec: Any
    result_template: list[Any]
    """The result's leaves, `OUTPUT` where a tensor output goes."""
    op_names: list[str]
    single: bool = False
    """The result is one leaf (a tensor, None): no pytree to rebuild."""


def _convert(value: Any, slot_of: Callable[[int], int]) -> Any:
    if isinstance(value, msgpack.ExtType):
        if value.code == _TENSOR:
            slot = slot_of(int.from_bytes(value.data, "big"))
            return msgpack.ExtType(_SLOT, slot.to_bytes(4, "big"))
        return value
    if isinstance(value, list | tuple):
        return [_convert(item, slot_of) for item in value]
    if isinstance(value, dict):
        return {key: _convert(item, slot_of) for key, item in value.items()}
    return value


def build_recording(
    recorder: Recorder, inputs: list[RemoteTensor], result: Any, graph: bool,
    compile: bool = False,
) -> Recording | str:  # fmt: skip
    """The program of a recorded call, or why it cannot be one."""
    if recorder.problem is not None:
        return recorder.problem
    stream = recorder.stream
    if stream is None:
        return "runs no op on a remote GPU"
    slots: dict[int, int] = {}
    for tensor in inputs:
        slots.setdefault(tensor._gp.id, len(slots))
    n_inputs = len(inputs)
    n_slots = len(slots)
    externals: list[list[int]] = []

    def slot_of(handle: int) -> int:
        nonlocal n_slots
        slot = slots.get(handle)
        if slot is None:
            slot = slots[handle] = n_slots
            n_slots += 1
            externals.append([slot, handle])
        return slot

    # Inputs passed twice share one slot; the program names each input position.
    input_slots = [slots[t._gp.id] for t in inputs]
    if len(set(input_slots)) != n_inputs:
        return "takes the same tensor twice as an argument"
    names = {op_id: info.wire_name for info, op_id in stream._op_ids.items()}
    steps: list[list[Any]] = []
    op_names: list[str] = []
    for record in recorder.steps:
        if record[0] == "put":
            _, handle, host = record
            steps.append(
                ["put", slot_of(handle), dtype_name(host.dtype), list(host.shape),
                 tensor_bytes(host)]
            )  # fmt: skip
            op_names.append("copy_ (host to device)")
            continue
        _, op_id, args, kwargs, outs = record
        wire_args = _convert(args, slot_of)
        wire_kwargs = _convert(kwargs, slot_of) if kwargs else None
        out_slots: list[int | None] | None = None
        if outs is not None:
            out_slots = []
            for handle in outs:
                if handle is None:
                    out_slots.append(None)
                    continue
                slots[handle] = n_slots
                out_slots.append(n_slots)
                n_slots += 1
        steps.append(["op", op_id, wire_args, wire_kwargs, out_slots])
        op_names.append(names.get(op_id, f"op {op_id}"))
    leaves, result_spec = tree_flatten(result)
    template: list[Any] = []
    outputs: list[tuple[Any, ...]] = []
    output_slots: list[int] = []
    output_handles: set[int] = set()
    for leaf in leaves:
        if isinstance(leaf, RemoteTensor):
            if leaf._gp.stream is not stream:
                return "returns a tensor of another GPU"
            output_slots.append(slot_of(leaf._gp.id))
            output_handles.add(leaf._gp.id)
            outputs.append(leaf._sig)
            template.append(OUTPUT)
        elif isinstance(leaf, torch.Tensor):
            return "returns a host tensor (a value read from the GPU)"
        else:
            template.append(leaf)
    gc.collect()  # tensors the step dropped in reference cycles are not its outputs
    freed = {handle for _, handle in externals} & recorder.released
    if freed:
        return "frees a tensor it reads that was made before the step (state replaced each call)"
    escapes: list[Handle] = []
    escape_slots: list[list[int]] = []
    for handle_id, ref in recorder.new.items():
        handle = ref()
        if handle is None or handle_id in output_handles or handle_id not in slots:
            continue
        escapes.append(handle)
        escape_slots.append([slots[handle_id], handle_id])
    escape_slots.sort()
    input_specs = [[dtype_name(t.dtype), list(t._sig[0]), list(t._sig[1])] for t in inputs]
    body = {
        "v": PROGRAM_VERSION, "inputs": input_specs, "slots": n_slots, "externals": externals,
        "steps": steps, "outputs": output_slots, "escapes": escape_slots, "graph": graph,
    }  # fmt: skip
    if compile:
        body["compile"] = "inductor"
    canon = (
        n_slots, steps, externals, output_slots, outputs, result_spec, template,
        [slot for slot, _ in escape_slots],
    )  # fmt: skip
    return Recording(
        stream, body, canon, frozenset(h for _, h in externals), escapes, outputs,
        result_spec, template, op_names, result_spec.is_leaf(),
    )  # fmt: skip


def first_difference(a: Recording, b: Recording) -> str:
    """Where two recordings of one signature part: for the warning."""
    steps_a, steps_b = a.canon[1], b.canon[1]
    for i, (x, y) in enumerate(zip(steps_a, steps_b, strict=False)):
        if x != y:
            return f"op {i + 1} ({b.op_names[i]})"
    if len(steps_a) != len(steps_b):
        return f"the number of ops ({len(steps_a)} then {len(steps_b)})"
    if a.canon[2] != b.canon[2]:
        return "the persistent tensors it reads (a state tensor replaced every call)"
    return "its outputs or the tensors it keeps"


# ---- guards ------------------------------------------------------------------------------------


def closure_values(fn: Callable[..., Any]) -> list[tuple[Callable[[], Any], Any]]:
    """(getter, value) of what fn closes over: cells, the globals it names, a method's self."""
    found: list[tuple[Callable[[], Any], Any]] = []
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, types.MethodType):
        owner = target.__self__
        found.append((functools.partial(_same, owner), owner))
        target = target.__func__
    code = getattr(target, "__code__", None)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            found.append((functools.partial(_cell_contents, cell), cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    if code is not None:
        namespace: dict[str, Any] = getattr(target, "__globals__", {})
        for name in code.co_names:
            if name in namespace:
                found.append((functools.partial(namespace.get, name), namespace[name]))
    return found


def _same(value: Any) -> Any:
    return value


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # emptied since: not what the program saw
        return _EMPTY


_EMPTY = object()


@dataclass
class Guards:
    """What a replay assumes about the client's Python state, checked on every call (tens of
    microseconds for a ResNet-50: the walk below reads dictionaries, no generators)."""

    identities: list[tuple[Callable[[], Any], Any]]
    modules: list[torch.nn.Module]
    """Every submodule of the modules the step closes over, found once."""
    state: list[Any]
    optimizers: list[torch.optim.Optimizer]
    hyper: tuple[Any, ...]

    @classmethod
    def of(cls, fn: Callable[..., Any], optimizers: list[torch.optim.Optimizer]) -> Guards:
        identities = []
        modules: list[torch.nn.Module] = []
        for getter, value in closure_values(fn):
            # Everything fn names: a rebound tensor, module or constant means other ops.
            identities.append((getter, value))
            if isinstance(value, torch.nn.Module):
                modules.extend(value.modules())
        return cls(identities, modules, _module_state(modules), optimizers, _hyper(optimizers))

    def broken(self) -> str | None:
        for getter, value in self.identities:
            if getter() is not value:
                return "a tensor, module or value it closes over was replaced"
        if _module_state(self.modules) != self.state:
            return "a module switched between train() and eval(), or its tensors were replaced"
        if _hyper(self.optimizers) != self.hyper:
            return "an optimizer's hyperparameters changed (learning rate, momentum, ...)"
        return None


def _module_state(modules: list[torch.nn.Module]) -> list[Any]:
    """Train/eval modes and which tensors and children the modules hold: a parameter or
    buffer replaced (`model.fc.weight = …`, `.data = …`) means the program reads the wrong
    tensor. Remote tensors count by handle id (never reused); others by identity."""
    state: list[Any] = []
    append = state.append
    for module in modules:
        append(module.training)
        for table in (module._parameters, module._buffers, module._modules):
            append(len(table))
            for value in table.values():
                if type(value) is RemoteTensor or isinstance(value, RemoteTensor):
                    append(value._gp.id)
                else:
                    append(id(value))
    return state


def _hyper(optimizers: list[torch.optim.Optimizer]) -> tuple[Any, ...]:
    snapshot: list[Any] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in sorted(group):
                value = group[key]
                if key == "params":
                    snapshot.append(len(value))
                elif isinstance(value, torch.Tensor):
                    snapshot.append(id(value))
                else:
                    snapshot.append((key, value))
    return tuple(snapshot)


# ---- the step ------------------------------------------------------------------------------------


class _Program:
    """A program the worker holds, and how to call it."""

    def __init__(self, recording: Recording, guards: Guards) -> None:
        self.id = next(_PROGRAM_IDS)
        self.recording = recording
        self.guards = guards
        self.grads = _grad_bindings(recording, guards)
        stream = self.stream = recording.stream
        # A swap-out or a move to another worker drops the worker's programs (their CUDA
        # graphs point at memory that is gone): the step is captured again afterwards.
        self.epoch = (stream.conn, stream.elastic.swaps)
        stream.watched |= recording.externals
        stream.emit([Rec.PROGRAM, self.id, pack(recording.body)])

    def broken(self) -> str | None:
        stream = self.stream
        if not stream.open or stream not in runtime.streams():
            return "its GPU was detached"
        if (stream.conn, stream.elastic.swaps) != self.epoch:
            return "its state was swapped out or moved to another worker"
        if not self.recording.externals.isdisjoint(stream.released):
            return "a tensor it reads was freed (new tensors made outside the step)"
        return self.guards.broken()

    def run(self, inputs: list[RemoteTensor]) -> Any:
        stream = self.stream
        recording = self.recording
        handles = [stream.new_handle() for _ in recording.outputs]
        stream.emit([Rec.RUN, self.id, [t._gp.ext for t in inputs], [h.id for h in handles]])
        stream.flush()
        for param, grad in self.grads:
            if param.grad is not grad:  # another program or an eager call ran in between
                param.grad = grad
        made = iter(
            wrap_signature(sig, h) for sig, h in zip(recording.outputs, handles, strict=True)
        )
        leaves = [next(made) if leaf is OUTPUT else leaf for leaf in recording.result_template]
        if recording.single:
            return leaves[0]  # one tensor or None, as most steps return
        return tree_unflatten(leaves, recording.result_spec)

    def drop(self) -> None:
        if self.stream.open:
            self.stream.emit([Rec.DROP_PROGRAM, self.id])


def _grad_bindings(recording: Recording, guards: Guards) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gradients the step made (set_to_none) are escapes: each replay writes them under the
    recorded handles. When another signature's program or an eager call ran in between, the
    parameters hold other gradient tensors; a replay puts its own back, so `.grad` after a
    call is that call's, as in eager."""
    escapes = {handle.id for handle in recording.escapes}
    params = [p for m in guards.modules for p in m._parameters.values() if p is not None]
    params += [p for o in guards.optimizers for g in o.param_groups for p in g["params"]]
    bindings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if isinstance(grad, RemoteTensor) and grad._gp.id in escapes:
            bindings[id(param)] = (param, grad)
    return list(bindings.values())


@dataclass
class _Entry:
    """One input signature of a step."""

    last: Recording | None = None
    recordings: int = 0
    recaptures: int = 0
    program: _Program | None = None
    eager: bool = False
    history: list[str] = field(default_factory=list)


class CapturedStep:
    """A step function that the worker replays; see the module's docstring."""

    def __init__(
        self,
        fn: Callable[..., Any],
        graph: bool = True,
        compile: bool = False,
        aten_graph: bool = False,
    ) -> None:
        self.fn = fn
        self.graph = graph
        self.compile = compile
        self.aten_graph = aten_graph
        """fn runs a fixed graph of aten ops (AOTAutograd's, gpupool.torch.joint) without
        autograd: whether its inputs require grad changes none of its ops, so it is not part
        of the signature (a parameter passed through the forward graph comes back from a
        replay as a tensor that does not)."""
        self._entries: dict[Any, _Entry] = {}
        self._warned: set[str] = set()
        functools.update_wrapper(self, fn)

    # ---- introspection (tests, benchmarks) -----------------------------------------------

    @property
    def replaying(self) -> bool:
        """Whether some signature of this step is replayed by its worker."""
        return any(e.program is not None for e in self._entries.values())

    def worker_modes(self) -> list[str]:
        """How the worker runs this step's programs (a round trip): "ops", "graph" (a CUDA
        graph), "inductor" (compiled by Inductor) or "inductor+graph"."""
        return [mode for mode, _runs in self.worker_programs()]

    def worker_programs(self) -> list[tuple[str, int]]:
        """(mode, RUNs so far) of each of this step's programs on its worker (a round trip).
        A CUDA worker runs a program's first RUNs op by op before it captures the graph, so a
        mode means little without the count."""
        return [(mode, runs) for mode, runs, _ in self._programs()]

    def not_compiled(self) -> list[str]:
        """Why the worker keeps programs of a `compile=True` step op by op (a round trip):
        an op it never compiles, or Inductor's own error; empty when all compiled."""
        return [why for _, _, why in self._programs() if why]

    def _programs(self) -> list[tuple[str, int, str | None]]:
        ids = {e.program.id for e in self._entries.values() if e.program is not None}
        programs = []
        for stream in runtime.streams():
            for program_id, mode, runs, *why in stream.stats().get("programs", []):
                if program_id in ids:
                    programs.append((str(mode), int(runs), str(why[0]) if why and why[0] else None))
        return programs

    # ---- calls ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not runtime.attached() or runtime.pending():
            # Pending: a lazy lease is taken inside this call; recording starts at the next.
            return self.fn(*args, **kwargs)
        spec: Any
        if kwargs or not all(type(a) in _FLAT for a in args):
            leaves, spec = tree_flatten((args, kwargs))
        else:  # tensors and scalars only, the common step: no pytree walk
            leaves, spec = list(args), len(args)
        key, inputs, problem = self._signature(leaves, spec)
        if problem is not None:
            self._warn(f"{self._name} runs eagerly: {problem}")
            return self.fn(*args, **kwargs)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= MAX_SIGNATURES:
                self._warn(
                    f"{self._name} runs eagerly for new argument shapes: it was already "
                    f"captured for {MAX_SIGNATURES} signatures"
                )
                return self.fn(*args, **kwargs)
            if self._entries:
                self._warn(
                    f"{self._name} is captured again for other arguments (shapes, dtypes, "
                    "values, grad mode or autocast): each signature records its own program"
                )
            entry = self._entries[key] = _Entry()
        if entry.eager:
            return self.fn(*args, **kwargs)
        program = entry.program
        if program is not None:
            why = program.broken()
            if why is None:
                return program.run(inputs)
            program.drop()
            entry.program = None
            entry.recaptures += 1
            if entry.recaptures > MAX_RECAPTURES:
                entry.eager = True
                self._warn(f"{self._name} runs eagerly: it changed {MAX_RECAPTURES} times ({why})")
                return self.fn(*args, **kwargs)
            self._warn(f"{self._name} is captured again: {why}")
        return self._record(entry, args, kwargs, inputs)

    @property
    def _name(self) -> str:
        return f"captured step {getattr(self.fn, '__qualname__', repr(self.fn))}"

    def _signature(
        self, leaves: list[Any], spec: Any
    ) -> tuple[Any, list[RemoteTensor], str | None]:
        parts: list[Any] = [spec, torch.is_grad_enabled(), autocast._enabled()]
        inputs: list[RemoteTensor] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, RemoteTensor):
                inputs.append(leaf)
                parts.append(
                    (leaf._sig, leaf._gp.stream.index, leaf.requires_grad and not self.aten_graph)
                )
            elif isinstance(leaf, torch.Tensor):
                return (
                    None,
                    inputs,
                    (f"argument {i} is a {leaf.device} tensor: move it to the GPU before the call"),
                )
            else:
                try:
                    hash(leaf)
                except TypeError:
                    return None, inputs, f"argument {i} ({type(leaf).__name__}) is not hashable"
                parts.append((type(leaf), leaf))
        return tuple(parts), inputs, None

    def _record(
        self,
        entry: _Entry,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[RemoteTensor],
    ) -> Any:
        recorder = Recorder()
        streams = runtime.streams()
        before = [(t._gp, t._sig) for t in inputs]
        hook = register_optimizer_step_pre_hook(recorder.on_optimizer_step)
        for stream in streams:
            stream.recorder = recorder
        try:
            result = self.fn(*args, **kwargs)
            if any(t._gp is not h or t._sig != s for t, (h, s) in zip(inputs, before, strict=True)):
                recorder._fail("changes an argument's shape or storage in place")
            recording = build_recording(recorder, inputs, result, self.graph, self.compile)
        finally:
            for stream in streams:
                stream.recorder = None
            hook.remove()
        if isinstance(recording, str):
            entry.eager = True
            self._warn(f"{self._name} runs eagerly: the step {recording}")
            return result
        previous, entry.last = entry.last, recording
        entry.recordings += 1
        if previous is not None and previous.canon == recording.canon:
            entry.program = _Program(recording, Guards.of(self.fn, recorder.optimizers))
            entry.last, entry.recordings = None, 0
        elif previous is not None and entry.recordings >= MAX_RECORDINGS:
            entry.eager = True
            entry.last = None
            self._warn(
                f"{self._name} runs eagerly: its ops change from call to call, first at "
                f"{first_difference(previous, recording)}; a value computed on the host "
                "(a learning-rate schedule, a step count) or a Python branch differs each call"
            )
        return result

    def _warn(self, message: str) -> None:
        if message in self._warned:
            return
        self._warned.add(message)
        warnings.warn(message, CaptureWarning, stacklevel=4)

    def __del__(self) -> None:
        for entry in getattr(self, "_entries", {}).values():
            if entry.program is not None:
                with contextlib.suppress(Exception):  # the stream may be gone at exit
                    entry.program.drop()
