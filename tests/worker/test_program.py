"""Captured programs on the worker: replayed as recorded, and hostile bodies refused whole."""

from __future__ import annotations

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
    assert executor.stats()["programs"] == [[5, "ops", 2]]


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
        proc.wait(timeout=10)
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
