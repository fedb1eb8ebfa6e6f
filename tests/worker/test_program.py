"""Captured programs on the worker: replayed as recorded, and hostile bodies refused whole."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from test_executor import empty, make, read, run

from gpupool.protocol.v1.dataplane import (
    PROGRAM_VERSION,
    VERSION,
    Connection,
    ConnectionClosed,
    ErrorKind,
    Ext,
    Kind,
    ProtocolError,
    Rec,
    connect,
    pack,
    pack_records,
    parse_address,
    recv_handshake,
    send_handshake,
    start_worker_process,
)
from gpupool.protocol.v1.tensors import handle_ext
from gpupool.worker.executor import SHIMS
from gpupool.worker.program import GRAPH_AFTER_RUNS
from tests.timing import scaled


def slot(index: int) -> msgpack.ExtType:
    return msgpack.ExtType(Ext.SLOT, index.to_bytes(4, "big"))


def body(**changes: Any) -> dict[str, Any]:
    """out = (input + weight) * input, where weight is the client's tensor 10; the sum is kept
    under handle 77 (an escape), as a gradient would be."""
    program = {
        "v": PROGRAM_VERSION,
        "inputs": [["float32", [3], [1]]],
        "slots": 4,
        "externals": [[1, 10]],
        "steps": [
            ["op", 3, [slot(0), slot(1)], None, [2]],
            ["op", 4, [slot(2), slot(0)], None, [3]],
        ],
        "outputs": [3],
        "escapes": [[2, 77]],
        "graph": True,
    }
    return program | changes


def define(executor: Any, program: dict[str, Any] | bytes, program_id: int = 5) -> None:
    encoded = program if isinstance(program, bytes) else pack(program)
    run(executor, [[Rec.PROGRAM, program_id, encoded]])


def prepared() -> Any:
    executor = make()
    run(executor, [[Rec.DEF, 4, "aten::mul.Tensor"], empty(10, 3),
                   [Rec.OP, 2, [handle_ext(10), 2.0], None, None], empty(20, 3),
                   [Rec.OP, 2, [handle_ext(20), 3.0], None, None]])  # fmt: skip
    return executor


def test_a_program_replays_on_new_inputs_with_outputs_under_new_handles() -> None:
    executor = prepared()
    define(executor, body())
    run(executor, [[Rec.RUN, 5, [handle_ext(20)], [30]]])
    assert read(executor, 30) == [15.0, 15.0, 15.0]  # (3 + 2) * 3
    assert read(executor, 77) == [5.0, 5.0, 5.0]
    run(executor, [[Rec.OP, 2, [handle_ext(20), 1.0], None, None],
                   [Rec.RUN, 5, [handle_ext(20)], [31]]])  # fmt: skip
    assert read(executor, 31) == [3.0, 3.0, 3.0] and read(executor, 30) == [15.0] * 3
    assert read(executor, 77) == [3.0, 3.0, 3.0]
    assert executor.stats()["programs"] == [[5, "ops", 2, None]]


def test_a_run_on_an_input_of_another_shape_is_an_error_at_the_next_read() -> None:
    executor = prepared()
    define(executor, body())
    run(executor, [empty(21, 4), [Rec.RUN, 5, [handle_ext(21)], [30]]])
    error = read(executor, 30)
    assert error["kind"] == ErrorKind.OP and "recorded for [3]" in error["message"]


def test_a_program_reading_a_freed_tensor_fails_that_run_only() -> None:
    executor = prepared()
    define(executor, body())
    run(executor, [[Rec.FREE, 10], [Rec.RUN, 5, [handle_ext(20)], [30]]])
    error = read(executor, 30)
    assert "tensor 10" in error["message"] and "captured step" in error["message"]
    assert read(executor, 20) == [3.0, 3.0, 3.0]


def test_a_failing_run_names_the_op_it_stopped_at() -> None:
    executor = prepared()
    run(executor, [[Rec.DEF, 6, "aten::mm"]])
    define(executor, body(steps=[["op", 3, [slot(0), slot(1)], None, [2]],
                                 ["op", 6, [slot(2), slot(0)], None, [3]]]))  # fmt: skip
    run(executor, [[Rec.RUN, 5, [handle_ext(20)], [30]]])
    error = read(executor, 30)
    assert error["kind"] == ErrorKind.OP
    assert "captured step (program 5) at op 2 of 2 (aten::mm)" in error["message"]
    assert "must be a matrix" in error["message"]


def test_a_program_runs_eval_batch_norm_through_the_workers_shim() -> None:
    """A CUDA worker's own `_batch_norm_no_update` is CPU-only; a program resolves its ops as
    single ops do, so captured eval-mode batch norm goes through the same device-generic shim."""
    executor = prepared()
    run(executor, [[Rec.DEF, 6, "aten::_batch_norm_no_update"]])
    bn = ["op", 6, [slot(0), slot(1), None, slot(1), slot(1), 0.1, 0.0], None, [2] + [None] * 3]
    define(executor, body(inputs=[["float32", [1, 3], [3, 1]]], externals=[[1, 10]],
                          steps=[bn], outputs=[2], escapes=[], slots=3))  # fmt: skip
    step = executor.programs.get(5).steps[0]
    # The step runs what a single op runs: the shim, behind the batch-norm argument check.
    assert executor.ops[6].fn is SHIMS["aten::_batch_norm_no_update"]
    assert step.fn is executor.ops[6].call
    run(executor, [[Rec.DEF, 7, "aten::ones"], [Rec.OP, 7, [[1, 3]], None, [21]],
                   [Rec.RUN, 5, [handle_ext(21)], [30]]])  # fmt: skip
    # weight, mean and variance are all 2: (1 - 2) / sqrt(2) * 2
    assert read(executor, 30) == [pytest.approx([-(2.0**0.5)] * 3)]


class _CaptureOnCpu:
    """What CUDA graph capture does to a step, on a CPU worker: ops that wait for the device
    (nonzero must read how many elements it found) fail while capturing, and ending a capture
    that saw an error raises again with a message that does not name the op."""

    SYNCING = frozenset({torch.ops.aten.nonzero.default})

    class Mode(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.failed = False

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func in _CaptureOnCpu.SYNCING:
                self.failed = True
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return func(*args, **(kwargs or {}))

    class Graph:
        def replay(self) -> None:
            raise AssertionError("a failed capture is never replayed")

    @staticmethod
    @contextlib.contextmanager
    def graph(graph: Any, **options: Any) -> Iterator[None]:
        mode = _CaptureOnCpu.Mode()
        try:
            with mode:
                yield
        finally:
            if mode.failed:
                raise RuntimeError("CUDA error: operation failed due to a previous error")


def test_a_capture_that_fails_logs_the_op_and_replays_op_by_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "graph", _CaptureOnCpu.graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _CaptureOnCpu.Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    executor = prepared()
    run(executor, [[Rec.DEF, 6, "aten::nonzero"]])
    define(executor, body(steps=[["op", 3, [slot(0), slot(1)], None, [2]],
                                 ["op", 6, [slot(2)], None, [3]]]))  # fmt: skip
    program = executor.programs.get(5)
    program.graph_allowed = True  # as on a CUDA worker, past its warm-up runs
    program.runs = GRAPH_AFTER_RUNS
    with caplog.at_level(logging.WARNING, logger="gpupool.worker"):
        run(executor, [[Rec.RUN, 5, [handle_ext(20)], [30]]])
    assert executor.error is None
    assert executor.stats()["programs"] == [[5, "ops", GRAPH_AFTER_RUNS + 1, None]]
    (record,) = [r for r in caplog.records if "replays op by op" in r.getMessage()]
    assert "capture failed at op 2 of 2 (aten::nonzero)" in record.getMessage()
    assert "not permitted when stream is capturing" in record.getMessage()
    run(executor, [[Rec.RUN, 5, [handle_ext(20)], [31]]])  # op by op from now on, no retry
    assert executor.stats()["programs"] == [[5, "ops", GRAPH_AFTER_RUNS + 2, None]]


def test_the_worker_logs_how_a_program_will_run(caplog: pytest.LogCaptureFixture) -> None:
    executor = prepared()
    with caplog.at_level(logging.INFO, logger="gpupool.worker"):
        define(executor, body())
    assert "program 5 defined (2 steps): op by op (a cpu worker" in caplog.text


def _updating(**changes: Any) -> dict[str, Any]:
    """out = (input + weight) * input, then weight += out in place (an optimizer's update of
    the client's tensor 10), the sum kept under handle 77."""
    return body(
        steps=[
            ["op", 3, [slot(0), slot(1)], None, [2]],
            ["op", 4, [slot(2), slot(0)], None, [3]],
            ["op", 8, [slot(1), slot(3)], {"alpha": 0.5}, [None]],
        ],
        **changes,
    )


def _updating_worker() -> Any:
    executor = prepared()
    run(executor, [[Rec.DEF, 8, "aten::add_.Tensor"]])
    return executor


def _three_runs(executor: Any) -> list[Any]:
    seen = []
    for i in range(3):
        run(executor, [[Rec.RUN, 5, [handle_ext(20)], [30 + i]]])
        seen += [read(executor, 30 + i), read(executor, 77), read(executor, 10)]
    return seen


def test_a_program_compiled_by_inductor_gives_the_op_by_op_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first RUN goes op by op (every guard sees the arguments), the second compiles: the
    outputs, the escape and the in-place update of the client's tensor are the same."""
    by_ops, compiled = _updating_worker(), _updating_worker()
    define(by_ops, _updating())
    with caplog.at_level(logging.INFO, logger="gpupool.worker"):
        define(compiled, _updating(compile="inductor"))
        assert "op by op for 1 run, then compiled by Inductor" in caplog.text
        assert _three_runs(compiled) == _three_runs(by_ops)
    assert "program 5 compiled by Inductor (3 ops)" in caplog.text
    assert compiled.stats()["programs"] == [[5, "inductor", 3, None]]
    assert by_ops.stats()["programs"] == [[5, "ops", 3, None]]
    # The client's tensor grown behind the program's back: the compiled kernels would index
    # it with the old geometry, so the run is refused and the worker goes on.
    run(compiled, [[Rec.DEF, 12, "aten::resize_"], [Rec.OP, 12, [handle_ext(10), [64]], None, None],
                   [Rec.RUN, 5, [handle_ext(20)], [40]]])  # fmt: skip
    assert "has changed its layout or storage since the step was compiled" in str(
        read(compiled, 40)
    )
    assert compiled.error is None and read(compiled, 20) == [3.0, 3.0, 3.0]


def test_a_program_compiles_only_after_a_run_op_by_op_passed_on_that_geometry() -> None:
    """A view past its storage is refused op by op (`within_storage`, a check of geometry
    alone); a program whose RUNs keep failing so is never compiled, so Inductor never gets to
    index past the storage. Nor does one whose tensors changed since their last good RUN."""
    executor = prepared()
    run(executor, [[Rec.DEF, 13, "aten::as_strided"], [Rec.DEF, 14, "aten::sum"]])
    reach = ["op", 13, [slot(1), [3], [1000]], None, [2]]  # tensor 10 has 3 elements
    define(executor, body(steps=[reach, ["op", 14, [slot(2)], None, [3]]], outputs=[3],
                          escapes=[], compile="inductor"))  # fmt: skip
    for i in range(4):
        run(executor, [[Rec.RUN, 5, [handle_ext(20)], [30 + i]]])
        assert "reach" in str(read(executor, 30 + i)) or "storage" in str(read(executor, 30 + i))
    assert executor.stats()["programs"] == [[5, "ops", 4, None]]
    # Good RUNs, but the client's tensor regrows before every one: it never compiles either.
    executor = _updating_worker()
    define(executor, _updating(compile="inductor"))
    run(executor, [[Rec.DEF, 12, "aten::resize_"]])
    for i in range(3):
        run(executor, [[Rec.OP, 12, [handle_ext(10), [3 + 61 * (i % 2)]], None, None],
                       [Rec.RUN, 5, [handle_ext(20)], [40 + i]]])  # fmt: skip
    assert executor.stats()["programs"][0][1] == "ops"


def test_a_compiled_program_returns_its_outputs_in_the_dtypes_the_ops_gave_them() -> None:
    """Batch norm of a bf16 input with float32 weights (a model under autocast) saves its
    mean in float32 by ATen's CPU kernel, which is what the client inferred and holds, but in
    bf16 under fake tensors and Inductor: the compiled program's output is cast to the dtype
    of the op-by-op run's, so the next program that takes it (the backward) finds it so."""
    from gpupool.protocol.v1.tensors import DTYPE_EXT, REMOTE_DEVICE_EXT

    executor = make()
    run(executor, [[Rec.DEF, 20, "aten::_native_batch_norm_legit_functional"]])
    bf16 = {"dtype": DTYPE_EXT[torch.bfloat16], "device": REMOTE_DEVICE_EXT}
    records: list[Any] = [
        [Rec.OP, 1, [[8, 4]], bf16, [9]],
        [Rec.OP, 2, [handle_ext(9), 2.0], None, None],
    ]
    for handle, value in ((10, 1.0), (11, 0.0), (12, 0.0), (13, 1.0)):
        records += [empty(handle, 4), [Rec.OP, 2, [handle_ext(handle), value], None, None]]
    run(executor, records)
    norm = ["op", 20, [slot(0), slot(1), slot(2), slot(3), slot(4), True, 0.1, 1e-5], None,
            [5, 6, 7, 8, 9]]  # fmt: skip
    define(executor, {
        "v": PROGRAM_VERSION, "inputs": [["bfloat16", [8, 4], [4, 1]]], "slots": 10,
        "externals": [[1, 10], [2, 11], [3, 12], [4, 13]], "steps": [norm],
        "outputs": [5, 6, 7], "escapes": [], "graph": False, "compile": "inductor",
    })  # fmt: skip
    for i in range(3):
        run(executor, [[Rec.RUN, 5, [handle_ext(9)], [30 + 3 * i, 31 + 3 * i, 32 + 3 * i]]])
        outputs = [executor.tensors.get(30 + 3 * i + k) for k in range(3)]
        assert [t.dtype for t in outputs] == [torch.bfloat16, torch.float32, torch.float32], i
    assert executor.stats()["programs"][0][1] == "inductor"


def test_the_checks_inductor_may_skip_are_checks_of_the_op_policy() -> None:
    from gpupool.worker.inductor import GEOMETRY_CHECKS
    from gpupool.worker.opchecks import CHECKS

    assert set(CHECKS) >= GEOMETRY_CHECKS


def test_inductor_never_compiles_what_the_op_path_guards(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checked op, a shim, or a string that is not an identifier keep the program op by op,
    and the log says which; so does a compile that fails."""
    executor = prepared()
    run(executor, [[Rec.DEF, 6, "aten::_batch_norm_no_update"], [Rec.DEF, 9, "aten::gelu"],
                   [Rec.DEF, 11, "aten::repeat_interleave.Tensor"]])  # fmt: skip
    bn = ["op", 6, [slot(0), slot(1), None, slot(1), slot(1), 0.1, 0.0], None, [2] + [None] * 3]
    cases = {
        "runs through the worker's own implementation": [bn],
        "takes a string argument": [
            ["op", 9, [slot(0)], {"approximate": "tanh'); import os; ('"}, [2]]
        ],
        "runs behind a check of its tensors' values": [
            ["op", 11, [slot(1)], {"output_size": 3}, [2]]
        ],
    }
    for program_id, (reason, steps) in enumerate(cases.items(), start=40):
        define(executor, body(steps=steps, outputs=[2], escapes=[], slots=3 + 3 * (steps == [bn]),
                              compile="inductor"), program_id)  # fmt: skip
        assert reason in (executor.programs.get(program_id).compile_problem or ""), reason
    from gpupool.worker import inductor

    def refuse(*args: Any) -> Any:
        raise inductor.NotCompilable("RuntimeError: no C++ compiler")

    monkeypatch.setattr(inductor, "compile_steps", refuse)
    executor = _updating_worker()
    define(executor, _updating(compile="inductor"))
    with caplog.at_level(logging.WARNING, logger="gpupool.worker"):
        seen = _three_runs(executor)
    assert "program 5 replays op by op: Inductor could not compile it: RuntimeError: no C++" in (
        caplog.text
    )
    assert seen == _three_runs_fresh()
    assert executor.stats()["programs"] == [
        [5, "ops", 3, "Inductor could not compile it: RuntimeError: no C++ compiler"]
    ]


def _embedding_backward_worker() -> Any:
    """A worker holding a gradient [4, 2] of 1.0 (handle 20) and indices [4] of 1 (21)."""
    from gpupool.protocol.v1.tensors import DTYPE_EXT, REMOTE_DEVICE_EXT

    executor = make()
    long = {"dtype": DTYPE_EXT[torch.int64], "device": REMOTE_DEVICE_EXT}
    f32 = {"dtype": DTYPE_EXT[torch.float32], "device": REMOTE_DEVICE_EXT}
    run(executor, [[Rec.DEF, 11, "aten::embedding_dense_backward"], [Rec.DEF, 12, "aten::clone"],
                   [Rec.DEF, 13, "aten::add_.Tensor"],
                   [Rec.OP, 1, [[4, 2]], f32, [20]], [Rec.OP, 2, [handle_ext(20), 1.0], None, None],
                   [Rec.OP, 1, [[4]], long, [21]], [Rec.OP, 2, [handle_ext(21), 1], None, None]])  # fmt: skip
    return executor


def _embedding_backward(steps: list[Any], slots: int = 3) -> dict[str, Any]:
    return {
        "v": PROGRAM_VERSION, "inputs": [["float32", [4, 2], [2, 1]], ["int64", [4], [1]]],
        "slots": slots, "externals": [], "steps": steps, "outputs": [slots - 1], "escapes": [],
        "graph": False, "compile": "inductor",
    }  # fmt: skip


def test_a_compiled_backward_checks_its_embedding_indices_before_every_call() -> None:
    """An embedding's gradient (a training step's backward has one) is compiled: its check
    reads only the range of the indices, which the program takes in and never writes, so the
    worker checks that range before each compiled call. Indices out of range are refused at
    that call, as op by op, and the next call is served."""
    executor = _embedding_backward_worker()
    program = _embedding_backward([["op", 11, [slot(0), slot(1), 3, -1, False], None, [2]]])
    define(executor, program)
    assert executor.programs.get(5).compile_problem is None
    for i in range(3):
        run(executor, [[Rec.RUN, 5, [handle_ext(20), handle_ext(21)], [30 + i]]])
        assert read(executor, 30 + i) == [[0.0, 0.0], [4.0, 4.0], [0.0, 0.0]], i
    assert executor.stats()["programs"] == [[5, "inductor", 3, None]]
    run(executor, [[Rec.OP, 2, [handle_ext(21), 7], None, None],
                   [Rec.RUN, 5, [handle_ext(20), handle_ext(21)], [40]]])  # fmt: skip
    error = read(executor, 40)
    assert error["kind"] == ErrorKind.OP, error
    assert (
        "aten::embedding_dense_backward refused: indices holds values in [7, 7], outside [0, 3)"
        in (error["message"])
    )
    assert "op 1 of 1 (aten::embedding_dense_backward)" in error["message"]
    run(executor, [[Rec.OP, 2, [handle_ext(21), 2], None, None],
                   [Rec.RUN, 5, [handle_ext(20), handle_ext(21)], [41]]])  # fmt: skip
    assert read(executor, 41) == [[0.0, 0.0], [0.0, 0.0], [4.0, 4.0]]
    assert executor.stats()["programs"] == [[5, "inductor", 5, None]]


@pytest.mark.parametrize("how", ["made", "written"])
def test_indices_the_program_makes_or_writes_keep_it_op_by_op(how: str) -> None:
    """The range check before a compiled call can only see the tensors the call takes in:
    indices the program computes, or writes before the op, keep it op by op, checked there."""
    executor = _embedding_backward_worker()
    first = (
        ["op", 12, [slot(1)], None, [2]] if how == "made"
        else ["op", 13, [slot(1), slot(1)], None, [2]]
    )  # fmt: skip
    index = slot(2) if how == "made" else slot(1)
    program = _embedding_backward(
        [first, ["op", 11, [slot(0), index, 3, -1, False], None, [3]]], slots=4
    )
    define(executor, program)
    run(executor, [[Rec.OP, 2, [handle_ext(21), 0], None, None]])  # 0 + 0 stays in range
    for i in range(3):
        run(executor, [[Rec.RUN, 5, [handle_ext(20), handle_ext(21)], [30 + i]]])
        assert read(executor, 30 + i) == [[4.0, 4.0], [0.0, 0.0], [0.0, 0.0]], i
    [[_, mode, runs, problem]] = executor.stats()["programs"]
    assert (mode, runs) == ("ops", 3)
    assert "aten::embedding_dense_backward's indices is made or written by the program" in problem


def _three_runs_fresh() -> list[Any]:
    executor = _updating_worker()
    define(executor, _updating())
    return _three_runs(executor)


HOSTILE: dict[str, Any] = {
    "not a map": pack([1, 2, 3]),
    "not msgpack": b"\xc1\xc1\xc1",
    "other version": body(v=PROGRAM_VERSION + 1),
    "slot read before set": body(
        steps=[["op", 4, [slot(3), slot(0)], None, [2]], ["op", 3, [slot(2), slot(0)], None, [3]]]
    ),
    "slot out of range": body(steps=[["op", 3, [slot(0), slot(9)], None, [2]]]),
    "slot written twice": body(
        steps=[["op", 3, [slot(0), slot(1)], None, [2]], ["op", 4, [slot(0), slot(0)], None, [2]]]
    ),
    "writes an input": body(steps=[["op", 3, [slot(0), slot(1)], None, [0]]]),
    "undefined op": body(steps=[["op", 99, [slot(0)], None, [2]]]),
    "handle inside": body(steps=[["op", 3, [handle_ext(10), slot(0)], None, [2]]]),
    "unknown step": body(steps=[["exec", "rm -rf /"]]),
    "short step": body(steps=[["op", 3]]),
    "bad escape": body(escapes=[[2]]),
    "escape never set": body(escapes=[[3, 77]], steps=[]),
    "output never set": body(steps=[]),
    "unknown compiler": body(compile="tvm"),
    "external on an input": body(externals=[[0, 10]]),
    "huge slot count": body(slots=1 << 40),
    "bad input spec": body(inputs=[["float32", "3", [1]]]),
    "bad dtype": body(inputs=[["float99", [3], [1]]]),
    "put of the wrong size": body(steps=[["put", 0, "float32", [3], b"\x00" * 5]]),
}


@pytest.mark.parametrize("program", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_program_is_a_protocol_error_before_anything_runs(program: Any) -> None:
    executor = prepared()
    with pytest.raises(ProtocolError):
        define(executor, program)
    assert executor.programs.programs == {}
    assert read(executor, 10) == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "record",
    [
        [Rec.RUN, 6, [handle_ext(20)], [30]],  # never defined
        [Rec.RUN, 5, [handle_ext(20)], [30, 31]],  # two outputs named, one recorded
        [Rec.RUN, 5, handle_ext(20), [30]],  # inputs not a list
        [Rec.PROGRAM, 5, pack(body())],  # defined twice
        [Rec.PROGRAM, "5", pack(body())],
    ],
    ids=["unknown", "outputs", "inputs", "twice", "bad id"],
)
def test_hostile_runs_are_protocol_errors(record: list[Any]) -> None:
    executor = prepared()
    define(executor, body())
    with pytest.raises(ProtocolError):
        run(executor, [record])


def test_dropping_a_program_and_the_connection_forget_it() -> None:
    executor = prepared()
    define(executor, body())
    run(executor, [[Rec.DROP_PROGRAM, 5]])
    with pytest.raises(ProtocolError, match="not defined"):
        run(executor, [[Rec.RUN, 5, [handle_ext(20)], [30]]])
    define(executor, body(), program_id=6)
    executor.reset()
    assert executor.programs.programs == {}


# ---- a real worker process ---------------------------------------------------------------------

TOKEN = "program-test-token"


@pytest.fixture(scope="module")
def worker_address() -> Iterator[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, ready = start_worker_process("lease-p", TOKEN, env=env, threads=1)
    yield str(ready.address)
    proc.terminate()
    try:
        proc.wait(timeout=scaled(10))
    except subprocess.TimeoutExpired:
        proc.kill()


def _client(address: str) -> Connection:
    sock: socket.socket = connect(parse_address(address))
    send_handshake(sock, [Kind.HELLO, {"v": VERSION, "lease": "lease-p", "token": TOKEN}])
    assert recv_handshake(sock).head[0] == Kind.WELCOME
    return Connection(sock)


@pytest.mark.slow
def test_a_hostile_program_closes_only_that_connection(worker_address: str) -> None:
    conn = _client(worker_address)
    conn.send_body(pack_records([Kind.BATCH], [[Rec.PROGRAM, 1, pack(HOSTILE["handle inside"])]]))
    head = conn.recv().head()
    assert head[0] == Kind.ERROR and head[1] is None
    assert head[2]["kind"] == ErrorKind.PROTOCOL and "slot" in head[2]["message"]
    with pytest.raises(ConnectionClosed):
        conn.recv()
    conn.close()
    # The worker serves the next client as if nothing happened.
    again = _client(worker_address)
    again.send_body(
        pack_records(
            [Kind.BATCH],
            [
                [Rec.DEF, 1, "aten::ones"],
                [Rec.OP, 1, [[2]], None, [5]],
                [Rec.READ, 9, handle_ext(5)],
            ],
        )
    )
    head = again.recv().head()
    assert head[0] == Kind.DATA and head[1] == 9
    assert torch.frombuffer(again.read_tail(), dtype=torch.float32).tolist() == [1.0, 1.0]
    again.close()
