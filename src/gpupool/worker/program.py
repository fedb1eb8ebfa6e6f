"""Captured steps on the worker: a program validated once, replayed per RUN op by op, compiled
by Inductor where the client asks for it (`gpupool.worker.inductor`), and on a CUDA worker
captured as a CUDA graph.

A program names its tensors by slot: the call's inputs, the client's persistent tensors
(externals: parameters, optimizer state, looked up by handle at each run), and temporaries
made by its own ops. Everything a malformed body could do wrong (a slot read before it is
written, a slot out of range, an op the connection never defined) is found when the program
is defined, so a bad program closes the connection before anything of it runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import torch

from gpupool.protocol.v1.dataplane import PROGRAM_VERSION, Ext, ProtocolError
from gpupool.protocol.v1.tensors import dtype_from_name, tensor_from_bytes
from gpupool.worker import inductor
from gpupool.worker.inductor import GEOMETRY_CHECKS, NotCompilable, constant_problem, geometry
from gpupool.worker.opchecks import INDEX_RANGES, IndexRange, OpRefused, bind, check_range

log = logging.getLogger("gpupool.worker")

MAX_PROGRAMS = 64
"""Programs one connection may hold at once (each may pin a CUDA graph's memory pool)."""
MAX_PROGRAM_STEPS = 200_000
MAX_PROGRAM_SLOTS = 1_000_000
GRAPH_AFTER_RUNS = 1
"""Runs op by op (on a side stream: the warm-up CUDA graph capture wants) before capturing."""


class DefinedOp(Protocol):
    """An op the connection defined, as the executor resolved it."""

    @property
    def name(self) -> str: ...
    @property
    def fn(self) -> Callable[..., Any] | None: ...
    @property
    def call(self) -> Callable[..., Any] | None: ...
    @property
    def problem(self) -> str | None: ...
    @property
    def check(self) -> str | None: ...


class ExecutorView(Protocol):
    """What a program needs of the executor that defines and runs it
    (gpupool.worker.executor.Executor, which holds the connection's programs): its device,
    the ops and tensors the connection has, and how it decodes the client's extension types."""

    @property
    def device(self) -> torch.device: ...
    @property
    def ops(self) -> Mapping[int, DefinedOp]: ...
    @property
    def tensors(self) -> Mapping[int, torch.Tensor]: ...

    def ext_hook(self, code: int, data: bytes) -> object: ...


class ProgramError(RuntimeError):
    """A RUN that cannot run (input of another shape than recorded): a sticky op error."""


@dataclass(frozen=True, slots=True)
class Slot:
    index: int


Binder = Callable[[list[Any]], Any]


def _binder(value: Any) -> Binder | None:
    """A function that rebuilds `value` with its slots filled in, or None if it has none:
    most arguments (dims, scalars, dtypes) are constants bound once at definition."""
    if type(value) is Slot:
        index = value.index
        return lambda slots: slots[index]
    if isinstance(value, list | tuple):
        parts = [_binder(item) for item in value]
        bound = [(i, part) for i, part in enumerate(parts) if part is not None]
        if not bound:
            return None
        constant = list(value)

        def bind_list(slots: list[Any]) -> list[Any]:
            out = constant.copy()
            for i, part in bound:
                out[i] = part(slots)
            return out

        return bind_list
    return None


def _slots_in(value: Any) -> Iterator[int]:
    if type(value) is Slot:
        yield value.index
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _slots_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _slots_in(item)


def _flatten(value: Any) -> Iterator[Any]:
    if isinstance(value, list | tuple):
        for item in value:
            yield from _flatten(item)
    else:
        yield value


class _OpStep:
    __slots__ = (
        "args", "bare", "bind_args", "bind_kwargs", "fn", "kwargs", "name", "outs", "problem",
        "ranges",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        fn: Any,
        problem: str | None,
        args: list[Any],
        kwargs: dict[str, Any] | None,
        outs: list[int | None] | None,
        bare: Any = None,
        ranges: Callable[[dict[str, Any]], list[IndexRange]] | None = None,
    ) -> None:
        self.name, self.fn, self.problem, self.bare = name, fn, problem, bare
        self.args, self.kwargs, self.outs = args, kwargs or {}, outs
        self.ranges = ranges
        """The index ranges its check bounds (`opchecks.INDEX_RANGES`), where the program is
        to be compiled: checked on the program's tensors before each compiled call."""
        self.bind_args = _binder(args)
        self.bind_kwargs = {k: b for k, v in self.kwargs.items() if (b := _binder(v)) is not None}

    def run(self, slots: list[Any]) -> None:
        self.apply(self.fn, slots)

    def index_ranges(self, slots: list[Any]) -> list[tuple[Any, int, int, str]]:
        """(the index argument as recorded, a Slot where it is a tensor, low, high, its name)
        of each range the op's check bounds, its bounds from the tensors in `slots` (fake ones
        while Inductor traces: only their sizes are read)."""
        assert self.ranges is not None and self.bare is not None
        args, kwargs = self._arguments(slots)
        recorded = bind(self.bare, self.args, self.kwargs)
        return [
            (recorded.get(name), low, high, name)
            for name, low, high in self.ranges(bind(self.bare, args, kwargs))
        ]

    def _arguments(self, slots: list[Any]) -> tuple[Any, dict[str, Any]]:
        """The recorded arguments with the tensors in `slots` in place of their slots."""
        args = self.bind_args(slots) if self.bind_args is not None else self.args
        kwargs = self.kwargs
        if self.bind_kwargs:
            kwargs = dict(kwargs)
            for name, bind_value in self.bind_kwargs.items():
                kwargs[name] = bind_value(slots)
        return args, kwargs

    def apply(self, fn: Any, slots: list[Any]) -> None:
        """Run with `fn`: the guarded call (`run`), or the bare overload Inductor traces."""
        if fn is None:
            raise ProgramError(self.problem or f"{self.name} cannot run on this worker")
        args, kwargs = self._arguments(slots)
        result = fn(*args, **kwargs)
        outs = self.outs
        if outs:
            if len(outs) == 1 and isinstance(result, torch.Tensor):
                if outs[0] is not None:
                    slots[outs[0]] = result
                return
            flat = list(_flatten(result))
            if len(flat) != len(outs):
                raise ProgramError(f"{self.name} returned {len(flat)} values, recorded {len(outs)}")
            for value, slot in zip(flat, outs, strict=True):
                if slot is not None:
                    slots[slot] = value


class _PutStep:
    """Constant bytes the step copied into a tensor (a `torch.tensor([...], device="cuda")`)."""

    __slots__ = ("slot", "source")

    def __init__(self, slot: int, source: torch.Tensor) -> None:
        self.slot, self.source = slot, source

    def run(self, slots: list[Any]) -> None:
        slots[self.slot].copy_(self.source)


def _dtype(value: Any) -> torch.dtype | None:
    return value.dtype if isinstance(value, torch.Tensor) else None


class _CompiledStep:
    """The whole program as one call of its Inductor-compiled form."""

    __slots__ = ("compiled", "geometry", "inputs", "results")
    name = "the program compiled by Inductor"

    def __init__(
        self, compiled: Any, inputs: list[int], results: list[int], shapes: list[Any]
    ) -> None:
        self.compiled, self.inputs, self.results = compiled, inputs, results
        self.geometry = shapes
        """The geometry of the tensors it was compiled for (`Program._geometry`)."""

    def run(self, slots: list[Any]) -> None:
        tensors = [slots[i] for i in self.inputs]
        for i, (tensor, expected) in enumerate(zip(tensors, self.geometry, strict=True)):
            if geometry(tensor) != expected:
                raise ProgramError(
                    f"tensor {i} of the compiled step has changed its layout or storage since "
                    "the step was compiled (capture the step again)"
                )
        values = self.compiled(*tensors)
        for slot, value in zip(self.results, values, strict=True):
            slots[slot] = value


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    static_inputs: list[torch.Tensor]
    slots: list[Any]


class Program:
    """One captured step, as the worker runs it."""

    def __init__(self, program_id: int, body: dict[str, Any], executor: ExecutorView) -> None:
        self.id = program_id
        self.device = executor.device
        if body.get("v") != PROGRAM_VERSION:
            raise ProtocolError(
                f"program version {body.get('v')!r}, this worker speaks {PROGRAM_VERSION}"
            )
        self.input_specs = _input_specs(body.get("inputs"))
        n_inputs = len(self.input_specs)
        self.n_slots = _int(body.get("slots"), "slots", n_inputs, MAX_PROGRAM_SLOTS)
        self.externals = _pairs(body.get("externals"), "externals", self.n_slots)
        defined = [False] * self.n_slots
        for i in range(n_inputs):
            defined[i] = True
        for slot, _ in self.externals:
            if slot < n_inputs or defined[slot]:
                raise ProtocolError(f"program external slot {slot} is also another slot")
            defined[slot] = True
        steps = body.get("steps")
        if not isinstance(steps, list) or len(steps) > MAX_PROGRAM_STEPS:
            raise ProtocolError("program steps must be a list of bounded length")
        self.steps: list[_OpStep | _PutStep | _CompiledStep] = []
        self.mutated_inputs: set[int] = set()
        self._written: set[int] = set()
        """Every slot a step writes in place (outputs aside): an index tensor a compiled call
        checks beforehand must not be one."""
        self._ranges: list[tuple[int, int, int, str, str, str]] = []
        """(slot, low, high, argument, op name, where in the program) of the index tensors the
        compiled call checks first: the ranges the checks of its compiled-away ops bound
        (`_OpStep.index_ranges`)."""
        asked = body.get("compile")
        if asked not in (None, "inductor"):
            raise ProtocolError(f"program compile must be 'inductor' or absent, not {asked!r:.40}")
        self.compile_problem: str | None = None
        """Why the program is not compiled although asked to be (None: not asked, or fine)."""
        if asked == "inductor" and os.environ.get("GPUPOOL_INDUCTOR", "1") == "0":
            self.compile_problem = "the worker's operator turned compiling off (GPUPOOL_INDUCTOR=0)"
        self._compile_pending = asked == "inductor" and self.compile_problem is None
        self._passed: Any = None
        self._passed_dtypes: list[torch.dtype | None] = []
        """The dtypes of the results (`_results`) of the op-by-op run that set `_passed`."""
        """The geometry of the tensors in the last RUN that went op by op without an error:
        the program compiles only at a RUN whose tensors have just that geometry, so every
        guard the compiled call skips has passed for what it computes."""
        for step in steps:
            self.steps.append(self._compile(step, defined, n_inputs, executor))
        self.outputs = [_slot(s, self.n_slots, defined, "output") for s in _list(body, "outputs")]
        self.escapes = _pairs(body.get("escapes"), "escapes", self.n_slots)
        for slot, _ in self.escapes:
            if not defined[slot]:
                raise ProtocolError(f"program escape slot {slot} is never written")
        self.graph_allowed = bool(body.get("graph", True)) and self.device.type == "cuda"
        self.mode = "ops"
        """ops: op by op; graph: a CUDA graph replay; inductor: one call of the program compiled
        by Inductor; inductor+graph: that call captured as a CUDA graph (STATS says which)."""
        self.runs = 0
        self._graph_from_run = GRAPH_AFTER_RUNS + (2 if self._compile_pending else 1)
        """The run that captures the CUDA graph: after the op-by-op warm-up, and where Inductor
        compiles, after the compiled call's own first run (Triton loads its kernels then)."""
        self._graph: _Graph | None = None
        self.failed_step: str | None = None
        """The step the last failed run stopped at ("op 12 of 40 (aten::nonzero)")."""
        self._step_error: str | None = None
        log.info("program %d defined (%d steps): %s", self.id, len(self.steps), self._plan())

    def _plan(self) -> str:
        """How this program will run, so a worker log says why one never became a graph (or
        was not compiled)."""
        if self._compile_pending:
            plan = "op by op for 1 run, then compiled by Inductor"
        elif self.compile_problem is not None:
            plan = f"op by op, not compiled: {self.compile_problem}"
        else:
            plan = "op by op"
        if self.device.type != "cuda":
            return f"{plan} (a {self.device.type} worker has no CUDA graphs)"
        if not self.graph_allowed:
            return f"{plan} (the client asked for graph=False)"
        return f"{plan}, then captured as a CUDA graph from run {self._graph_from_run}"

    # ---- definition ----------------------------------------------------------------------

    def _compile(
        self, step: Any, defined: list[bool], n_inputs: int, executor: ExecutorView
    ) -> _OpStep | _PutStep:
        if not isinstance(step, list) or not step:
            raise ProtocolError("a program step must be a non-empty list")
        if step[0] == "put":
            _, target, dtype, shape, payload = step
            slot = _slot(target, self.n_slots, defined, "put target")
            if not isinstance(payload, bytes):
                raise ProtocolError("a program put carries bytes")
            source = tensor_from_bytes(payload, dtype_from_name(dtype), shape)
            if self.device.type == "cuda":
                source = source.to(self.device)  # a device copy: capturable in a CUDA graph
            if slot < n_inputs:
                self.mutated_inputs.add(slot)
            self._written.add(slot)
            return _PutStep(slot, source)
        if step[0] != "op" or len(step) != 5:
            raise ProtocolError(f"unknown program step {step[0]!r}")
        _, op_id, args, kwargs, outs = step
        if not isinstance(args, list) or not (kwargs is None or isinstance(kwargs, dict)):
            raise ProtocolError("program op arguments must be a list and a map")
        op = executor.ops.get(op_id) if isinstance(op_id, int) else None
        if op is None:
            raise ProtocolError(f"program uses op id {op_id!r}, which was never defined")
        for index in _slots_in([args, kwargs]):
            if not 0 <= index < self.n_slots or not defined[index]:
                raise ProtocolError(f"program op {op.name} reads slot {index} before it is set")
        self._note_mutations(op.fn, args, kwargs or {}, n_inputs)
        if outs is not None:
            if not isinstance(outs, list):
                raise ProtocolError("program op outputs must be a list")
            for slot in outs:
                if slot is None:
                    continue
                if not isinstance(slot, int) or not n_inputs <= slot < self.n_slots:
                    raise ProtocolError(f"program op {op.name} writes a bad slot {slot!r}")
                if defined[slot]:
                    raise ProtocolError(f"program op {op.name} writes slot {slot} twice")
                defined[slot] = True
        ranges = None
        if self._compile_pending:
            ranges = self._note_compilable(op, args, kwargs or {})
        # op.call, not op.fn: a checked op runs behind its check, and where the lease counts
        # storages each step is charged before it runs.
        call = op.call if op.fn is not None else None
        return _OpStep(op.name, call, op.problem, args, kwargs, outs, op.fn, ranges)

    def _note_compilable(
        self, op: DefinedOp, args: list[Any], kwargs: dict[str, Any]
    ) -> Callable[[dict[str, Any]], list[IndexRange]] | None:
        """Whether this op may be part of an Inductor graph (`gpupool.worker.inductor` says
        what never is); the first one that may not keeps the program op by op. Returns the
        index ranges of an op whose check reads values only so (`opchecks.INDEX_RANGES`)."""
        problem = None
        ranges = INDEX_RANGES.get(op.check) if op.check is not None else None
        if op.fn is None or not isinstance(op.fn, torch._ops.OpOverload):
            problem = f"{op.name} runs through the worker's own implementation"
        elif op.check is not None and op.check not in GEOMETRY_CHECKS and ranges is None:
            problem = f"{op.name} runs behind a check of its tensors' values each time"
        else:
            found = constant_problem([args, list(kwargs.values())], lambda v: type(v) is Slot)
            if found is not None:
                problem = f"{op.name} takes {found}"
        if problem is not None:
            self.compile_problem, self._compile_pending = problem, False
            return None
        return ranges

    def _note_mutations(
        self, fn: Any, args: list[Any], kwargs: dict[str, Any], n_inputs: int
    ) -> None:
        """Inputs an op writes: a CUDA graph writes its static copy, so they are copied back."""
        if fn is None:
            return
        for i, arg in enumerate(fn._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only else (args[i] if i < len(args) else None)
            for index in _slots_in(value):
                self._written.add(index)
                if index < n_inputs:
                    self.mutated_inputs.add(index)

    # ---- running -------------------------------------------------------------------------

    def check_inputs(self, inputs: list[Any]) -> None:
        if len(inputs) != len(self.input_specs):
            raise ProtocolError(
                f"RUN of program {self.id} with {len(inputs)} inputs, it takes "
                f"{len(self.input_specs)}"
            )
        for i, (tensor, spec) in enumerate(zip(inputs, self.input_specs, strict=True)):
            if not isinstance(tensor, torch.Tensor):
                continue  # a Missing handle: the executor reports it
            got = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            if got != spec:
                raise ProgramError(
                    f"captured step input {i} is {list(got[0])} {got[2]}, the program was "
                    f"recorded for {list(spec[0])} {spec[2]}"
                )

    def run(self, inputs: list[torch.Tensor], executor: ExecutorView) -> list[Any]:
        """Run once; returns the slots (outputs and escapes are read from them)."""
        self.runs += 1
        self.failed_step = None
        n_inputs = len(self.input_specs)
        if self._graph is not None:
            if self._ranges:
                held = self._graph.slots  # the externals it was captured with
                self._check_ranges(lambda i: inputs[i] if i < n_inputs else held[i])
            return self._replay(inputs)
        before = None
        if self._compile_pending:
            before = self._geometry(inputs, executor)
            if before is not None and before == self._passed:
                self._compile_now(inputs, executor, before)
                before = None
        if self._ranges:
            handles = dict(self.externals)
            self._check_ranges(
                lambda i: inputs[i] if i < n_inputs else executor.tensors.get(handles[i])
            )
        slots = self._run(inputs, executor)
        if before is not None:
            self._passed = before  # only once the run op by op succeeded
            self._passed_dtypes = [_dtype(slots[slot]) for slot in self._results()]
        return slots

    def _results(self) -> list[int]:
        """The slots a compiled call returns: outputs and escapes it does not take in."""
        fixed = set(range(len(self.input_specs))) | {slot for slot, _ in self.externals}
        wanted = dict.fromkeys([*self.outputs, *(slot for slot, _ in self.escapes)])
        return [slot for slot in wanted if slot not in fixed]

    def _geometry(self, inputs: list[torch.Tensor], executor: ExecutorView) -> Any:
        """The geometry of the tensors a compiled call would take, or None if one is missing."""
        tensors = executor.tensors
        shapes = []
        for tensor in [*inputs, *(tensors.get(handle) for _, handle in self.externals)]:
            if not isinstance(tensor, torch.Tensor):
                return None
            shapes.append(geometry(tensor))
        return shapes

    def _run(self, inputs: list[torch.Tensor], executor: ExecutorView) -> list[Any]:
        if self.graph_allowed and self.runs >= self._graph_from_run:
            try:
                return self._capture(inputs, executor)
            except torch.OutOfMemoryError as exc:
                self._give_up_graph(f"its memory does not fit the lease's limit ({exc})")
            except Exception as exc:  # an op that cannot be captured: replay op by op
                self._give_up_graph(self._capture_failure(exc))
        if self.graph_allowed:
            return self._warm_up(inputs, executor)
        slots = self._slots(inputs, executor)
        self._run_steps(slots)
        return slots

    def _compile_now(
        self, inputs: list[torch.Tensor], executor: ExecutorView, shapes: list[Any]
    ) -> None:
        """Replace the steps by one call of their Inductor-compiled form (after a run op by
        op on tensors of this geometry: every guard passed with these arguments). A failure
        keeps the steps, once."""
        self._compile_pending = False
        n_inputs = len(self.input_specs)
        external = [slot for slot, _ in self.externals]
        results = self._results()
        steps = list(self.steps)
        taken = {*range(n_inputs), *external}
        ranges: list[tuple[int, int, int, str, str, str]] = []

        def run(*tensors: torch.Tensor) -> list[Any]:
            slots: list[Any] = [None] * self.n_slots
            slots[:n_inputs] = tensors[:n_inputs]
            for slot, tensor in zip(external, tensors[n_inputs:], strict=True):
                slots[slot] = tensor
            ranges.clear()
            for index, step in enumerate(steps):
                if isinstance(step, _OpStep):
                    if step.ranges is not None:
                        ranges.extend(self._hoisted(index, step, slots, taken))
                    step.apply(step.bare, slots)
                else:
                    step.run(slots)
            return [slots[slot] for slot in results]

        slots = self._slots(inputs, executor)
        examples = [*slots[:n_inputs], *(slots[slot] for slot in external)]
        try:
            compiled = inductor.compile_steps(run, examples, self._passed_dtypes)
        except NotCompilable as exc:
            self.compile_problem = f"Inductor could not compile it: {exc}"
            log.warning("program %d replays op by op: %s", self.id, self.compile_problem)
            return
        self.steps = [_CompiledStep(compiled, [*range(n_inputs), *external], results, shapes)]
        self._ranges = list(ranges)
        self.mode = "inductor"
        self._graph_from_run = self.runs + GRAPH_AFTER_RUNS
        log.info("program %d compiled by Inductor (%d ops)", self.id, len(steps))

    def _hoisted(
        self, index: int, step: _OpStep, slots: list[Any], taken: set[int]
    ) -> list[tuple[int, int, int, str, str, str]]:
        """The ranges of `step`'s index tensors for the compiled call to check first; raises
        (so the program is not compiled) where such a tensor is one the program computes or
        writes: its values are known only inside the compiled call."""
        found = []
        for recorded, low, high, name in step.index_ranges(slots):
            slot = recorded.index if type(recorded) is Slot else None
            if slot is None or slot not in taken or slot in self._written:
                raise NotCompilable(
                    f"{step.name}'s {name} is made or written by the program, so its values "
                    "cannot be checked before a compiled call"
                )
            where = f"op {index + 1} of {len(self.steps)} ({step.name})"
            found.append((slot, low, high, name, step.name, where))
        return found

    def _check_ranges(self, tensor: Callable[[int], Any]) -> None:
        """The index checks the compiled call's ops had op by op, on the tensors it takes
        (`tensor(slot)`), before it runs."""
        for slot, low, high, name, op, where in self._ranges:
            try:
                check_range(tensor(slot), low, high, name)
            except OpRefused as exc:
                self.failed_step, self._step_error = where, _one_line(exc)
                raise OpRefused(f"{op} refused: {exc}") from None

    def _run_steps(self, slots: list[Any]) -> None:
        """Every step in order; a failing one is named in `failed_step`, for the client's error
        and the worker's log (a capture that fails says which op could not be captured)."""
        self.failed_step = self._step_error = None
        for index, step in enumerate(self.steps):
            try:
                step.run(slots)
            except Exception as exc:
                name = getattr(step, "name", "a constant copied in")
                self.failed_step = f"op {index + 1} of {len(self.steps)} ({name})"
                self._step_error = _one_line(exc)  # text only: a traceback would pin the slots
                raise

    def output_tensors(self, slots: list[Any], inputs: list[torch.Tensor]) -> list[Any]:
        """What RUN stores under the client's new handles: inputs and externals as themselves,
        temporaries of a CUDA graph cloned (the next replay overwrites them)."""
        n_inputs = len(self.input_specs)
        external = {slot for slot, _ in self.externals}
        out = []
        for slot in self.outputs:
            if slot < n_inputs:
                out.append(inputs[slot])
            elif self._graph is not None and slot not in external:
                out.append(slots[slot].clone())
            else:
                out.append(slots[slot])
        return out

    def _slots(self, inputs: list[torch.Tensor], executor: ExecutorView) -> list[Any]:
        slots: list[Any] = [None] * self.n_slots
        slots[: len(inputs)] = inputs
        tensors = executor.tensors
        for slot, handle in self.externals:
            tensor = tensors.get(handle)
            if tensor is None:
                raise ProgramError(
                    f"captured step reads tensor {handle}, which the worker does not hold"
                )
            slots[slot] = tensor
        return slots

    def _warm_up(self, inputs: list[torch.Tensor], executor: ExecutorView) -> list[Any]:
        """Op by op on a side stream, as CUDA graph capture wants its first run (cuBLAS and
        cuDNN set up their workspaces outside the graph)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        slots = self._slots(inputs, executor)
        with torch.cuda.stream(side):
            self._run_steps(slots)
        current.wait_stream(side)
        for value in slots:
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                value.record_stream(current)
        return slots

    def _capture(self, inputs: list[torch.Tensor], executor: ExecutorView) -> list[Any]:
        static = []
        for tensor in inputs:
            buffer = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device
            )
            buffer.copy_(tensor)
            static.append(buffer)
        graph = torch.cuda.CUDAGraph()
        slots = self._slots(static, executor)
        # thread_local: the worker's other threads (status file, allocator stats) may touch
        # CUDA while this one captures.
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self._run_steps(slots)
        self._graph = _Graph(graph, static, slots)
        self.mode = "inductor+graph" if self.mode == "inductor" else "graph"
        log.info("program %d captured as a CUDA graph (%d steps)", self.id, len(self.steps))
        graph.replay()
        self._copy_back(inputs)
        return slots

    def _replay(self, inputs: list[torch.Tensor]) -> list[Any]:
        graph = self._graph
        assert graph is not None
        for buffer, tensor in zip(graph.static_inputs, inputs, strict=True):
            buffer.copy_(tensor)
        graph.graph.replay()
        self._copy_back(inputs)
        return graph.slots

    def _copy_back(self, inputs: list[torch.Tensor]) -> None:
        graph = self._graph
        assert graph is not None
        for index in self.mutated_inputs:
            inputs[index].copy_(graph.static_inputs[index])

    def release(self) -> None:
        """Let the CUDA graph and its memory pool go once no replay of it is in flight."""
        if self._graph is not None:
            torch.cuda.synchronize(self.device)
            self._graph = None

    def _capture_failure(self, exc: BaseException) -> str:
        """Why a capture failed: the op that failed and its own error. When an op fails inside
        the capture, leaving the capture raises again ("operation failed due to a previous
        error during capture"); the op's error is the one that says what to fix."""
        if self.failed_step is None or self._step_error is None:
            return f"capture failed: {_one_line(exc)}"
        return f"capture failed at {self.failed_step}: {self._step_error}"

    def _give_up_graph(self, why: str) -> None:
        log.warning("program %d replays op by op: %s", self.id, why)
        self.graph_allowed = False
        self._graph = None
        self.mode = "inductor" if self.steps and isinstance(self.steps[0], _CompiledStep) else "ops"
        with contextlib.suppress(Exception):  # a broken capture may leave an error behind
            torch.cuda.synchronize(self.device)


class Programs:
    """The programs one connection defined."""

    def __init__(self) -> None:
        self.programs: dict[int, Program] = {}

    def define(self, program_id: Any, body: Any, executor: ExecutorView) -> None:
        if not isinstance(program_id, int) or not isinstance(body, bytes):
            raise ProtocolError("PROGRAM needs an id and a body")
        if program_id in self.programs:
            raise ProtocolError(f"program {program_id} is already defined")
        if len(self.programs) >= MAX_PROGRAMS:
            raise ProtocolError(f"more than {MAX_PROGRAMS} captured programs on one connection")
        decoded = decode_body(body, executor)
        if not isinstance(decoded, dict):
            raise ProtocolError("a program body must be a map")
        self.programs[program_id] = Program(program_id, decoded, executor)

    def get(self, program_id: Any) -> Program:
        program = self.programs.get(program_id) if isinstance(program_id, int) else None
        if program is None:
            raise ProtocolError(f"RUN of program {program_id!r}, which is not defined")
        return program

    def drop(self, program_id: Any) -> None:
        program = self.programs.pop(program_id, None)
        if program is not None:
            program.release()

    def clear(self) -> None:
        for program in self.programs.values():
            program.release()
        self.programs.clear()

    def describe(self) -> list[list[Any]]:
        """[id, mode, runs, why not compiled (None where not asked or compiled)] per program."""
        return [[p.id, p.mode, p.runs, p.compile_problem] for p in self.programs.values()]


def decode_body(body: bytes, executor: ExecutorView) -> Any:
    """Tensors in a program are slots; a handle there would bind the program to whatever the
    handle holds at definition, so it is refused."""

    def hook(code: int, data: bytes) -> object:
        if code == Ext.SLOT:
            if len(data) != 4:
                raise ProtocolError("a slot is 4 bytes")
            return Slot(int.from_bytes(data, "big"))
        if code == Ext.TENSOR:
            raise ProtocolError("a program names tensors by slot, not by handle")
        return executor.ext_hook(code, data)

    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=hook)
    except ProtocolError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed program body: {exc}") from exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else '(no message)'}"


# ---- validation helpers ---------------------------------------------------------------------


def _int(value: Any, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"program {what} must be an integer in [{low}, {high}]")
    return value


def _list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise ProtocolError(f"program {key} must be a list")
    return value


def _slot(value: Any, n_slots: int, defined: list[bool], what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_slots:
        raise ProtocolError(f"program {what} is not a slot: {value!r}")
    if not defined[value]:
        raise ProtocolError(f"program {what} slot {value} is never set")
    return value


def _pairs(value: Any, what: str, n_slots: int) -> list[tuple[int, int]]:
    if not isinstance(value, list):
        raise ProtocolError(f"program {what} must be a list of [slot, handle]")
    pairs = []
    for item in value:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            or not 0 <= item[0] < n_slots
            or item[1] < 0
        ):
            raise ProtocolError(f"program {what} entry {item!r:.80} is not [slot, handle]")
        pairs.append((item[0], item[1]))
    return pairs


def _input_specs(value: Any) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    if not isinstance(value, list):
        raise ProtocolError("program inputs must be a list of [dtype, shape, stride]")
    specs = []
    for item in value:
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError("a program input is [dtype, shape, stride]")
        dtype, shape, stride = item
        if not all(isinstance(x, list) and all(type(v) is int for v in x) for x in (shape, stride)):
            raise ProtocolError("a program input's shape and stride are lists of integers")
        specs.append((tuple(shape), tuple(stride), dtype_from_name(dtype)))
    return specs
