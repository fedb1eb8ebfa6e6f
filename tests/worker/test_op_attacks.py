"""Ops that reached outside their tensors, sent as raw data-plane frames to a real worker.

Each attack was seen working before the op policy (issue 20): `segment_reduce(unsafe=True)`
read the worker's memory (the agent's token came out of its environment), an `add_` into a
sparse tensor with out-of-range indices wrote 21 kB away, `_print` filled the worker's unread
stdout until it hung, and `_reshape_alias` / `_segment_reduce_backward` reached past their
storage. Now each must be refused with an error that says why, the worker must stay up and
answer, the lease's other tensors must be as they were, and the secret planted in the worker's
environment must never come back.
"""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from gpupool.protocol.v1.dataplane import (
    PROGRAM_VERSION,
    VERSION,
    Connection,
    Ext,
    Kind,
    Rec,
    connect,
    pack,
    pack_records,
    parse_address,
    parse_ready,
    recv_handshake,
    send_handshake,
    worker_argv,
)
from tests.timing import scaled

pytestmark = pytest.mark.slow

TOKEN = "op-attack-lease-token"
SECRET = "planted-secret-7f3a9c0e1d2b4a68"
HEADER = struct.Struct(">II")
INTACT = list(range(16))
"""Handle 1 of every session: arange(16), which no attack may change."""


@dataclass
class Worker:
    proc: subprocess.Popen[str]
    address: str
    log: Path


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker as an agent starts it, a secret in its environment and its stdout a pipe that
    nobody reads (as the agent's is, after the ready line)."""
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "GPUPOOL_WORKER_TOKEN": TOKEN,
        "GPUPOOL_PLANTED_SECRET": SECRET,
    }  # fmt: skip
    argv = worker_argv("lease-attack", listen="tcp://127.0.0.1:0", threads=1)
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    ready = parse_ready(proc.stdout.readline())
    yield Worker(proc, str(ready.address), log)
    proc.terminate()
    proc.wait(timeout=scaled(10))


class Raw:
    """A hostile client: records packed by hand, every reply kept to look for the secret."""

    def __init__(self, worker: Worker) -> None:
        self.sock = connect(parse_address(worker.address))
        hello = {"v": VERSION, "lease": "lease-attack", "token": TOKEN, "shm": False}
        send_handshake(self.sock, [Kind.HELLO, hello])
        assert recv_handshake(self.sock).head[0] == Kind.WELCOME
        self.sock.settimeout(30)
        self.conn = Connection(self.sock)
        self.received = bytearray()
        self.req = 0
        self.op_ids: dict[str, int] = {}

    def send(self, records: list[Any]) -> None:
        body = pack_records([Kind.BATCH], records)
        self.sock.sendall(HEADER.pack(len(body), 0) + body)

    def op(self, name: str) -> int:
        """The op id for `name`, DEF'd on first use."""
        if name not in self.op_ids:
            self.op_ids[name] = len(self.op_ids) + 1
            self.send([[Rec.DEF, self.op_ids[name], name]])
        return self.op_ids[name]

    def run(self, name: str, args: list[Any], kwargs: dict[str, Any] | None = None,
            outs: list[int | None] | None = None) -> None:  # fmt: skip
        self.send([[Rec.OP, self.op(name), args, kwargs or {}, outs or []]])

    def answer(self, record: list[Any]) -> tuple[list[Any], bytes]:
        self.send([record])
        frame = self.conn.recv()
        head = frame.head()
        tail = bytes(self.conn.read_tail()) if frame.tail_len else b""
        self.received += msgpack.packb(head) + tail
        assert head[1] == record[1], head
        return head, tail

    def sync(self) -> list[Any]:
        self.req += 1
        return self.answer([Rec.SYNC, self.req])[0]

    def read_floats(self, handle: int) -> list[float]:
        self.req += 1
        head, tail = self.answer([Rec.READ, self.req, tensor(handle)])
        assert head[0] == Kind.DATA and head[2] == "float32", head
        return list(struct.unpack(f"<{len(tail) // 4}f", tail))

    def close(self) -> None:
        self.sock.close()


def slot(index: int) -> msgpack.ExtType:
    return msgpack.ExtType(Ext.SLOT, index.to_bytes(4, "big"))


def tensor(handle: int) -> msgpack.ExtType:
    return msgpack.ExtType(Ext.TENSOR, handle.to_bytes(8, "big"))


def literal(dtype: str, shape: list[int], fmt: str, values: list[Any]) -> msgpack.ExtType:
    return msgpack.ExtType(Ext.LITERAL, pack([dtype, shape, struct.pack(fmt, *values)]))


def longs(values: list[int], shape: list[int] | None = None) -> msgpack.ExtType:
    return literal("int64", shape or [len(values)], f"<{len(values)}q", values)


def ext(code: Ext, name: str) -> msgpack.ExtType:
    return msgpack.ExtType(code, name.encode())


@pytest.fixture
def raw(worker: Worker) -> Iterator[Raw]:
    client = Raw(worker)
    client.run("aten::arange.start_step", [0, 16, 1], {"dtype": ext(Ext.DTYPE, "float32")}, [1])
    assert client.sync()[0] == Kind.RESULT
    yield client
    try:
        assert_unharmed(worker, client)
    finally:
        client.close()


def refused(client: Raw, *words: str) -> str:
    """The stream's sticky error, as the client's next sync hears it."""
    head = client.sync()
    assert head[0] == Kind.ERROR, f"the attack was not refused: {head}"
    message = str(head[2]["message"])
    for word in words:
        assert word in message, message
    return message


def assert_unharmed(worker: Worker, client: Raw) -> None:
    assert worker.proc.poll() is None, "the worker died"
    assert client.read_floats(1) == INTACT, "another tensor of the lease changed"
    assert SECRET.encode() not in client.received, "the worker's environment leaked"
    log = worker.log.read_text(errors="replace")
    assert "Traceback" not in log and "Segmentation" not in log, log[-3000:]


def test_segment_reduce_unsafe_cannot_read_past_its_data(raw: Raw) -> None:
    """With unsafe=True the lengths went unchecked: a segment 2**40 elements long read the
    worker's heap. The worker runs the checked path, which refuses the lengths."""
    raw.run("aten::segment_reduce", [tensor(1), "sum"],
            {"lengths": longs([1 << 40, 1]), "unsafe": True}, [2])  # fmt: skip
    refused(raw, "aten::segment_reduce")


def test_segment_reduce_unsafe_with_valid_lengths_still_runs(raw: Raw) -> None:
    """Forcing the checked path changes nothing for valid input: same sums."""
    raw.run("aten::segment_reduce", [tensor(1), "sum"],
            {"lengths": longs([4, 12]), "unsafe": True}, [2])  # fmt: skip
    assert raw.read_floats(2) == [6.0, sum(range(4, 16))]


def sparse_program(raw: Raw, program_id: int, steps: list[list[Any]], slots: int) -> None:
    """Sparse tensors live in a captured program's slots (the handle table holds dense ones):
    slot 0 is the program's input, a dense float32 [4] that the steps add into."""
    program = {
        "v": PROGRAM_VERSION, "inputs": [["float32", [4], [1]]], "slots": slots,
        "externals": [], "steps": steps, "outputs": [slots - 1], "escapes": [], "graph": False,
    }  # fmt: skip
    raw.send([[Rec.PROGRAM, program_id, pack(program)]])


def sparse_coo(raw: Raw, index: int, value: float, out: int) -> list[Any]:
    dims = raw.op("aten::_sparse_coo_tensor_with_dims_and_tensors")
    kwargs = {"dtype": ext(Ext.DTYPE, "float32"), "layout": ext(Ext.LAYOUT, "sparse_coo")}
    values = literal("float32", [1], "<f", [value])
    return ["op", dims, [1, 0, [4], longs([index], [1, 1]), values], kwargs, [out]]


def test_sparse_tensor_with_out_of_range_indices_is_refused_before_any_write(raw: Raw) -> None:
    """`_sparse_coo_tensor_with_dims_and_tensors` never checks its indices: index 5000 of a
    4-element tensor, then `add_` into a dense tensor, wrote 20 kB past it."""
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float32")}, [3])
    add = raw.op("aten::add_.Tensor")
    sparse_program(
        raw, 1, [sparse_coo(raw, 5000, 1.0, 1), ["op", add, [slot(0), slot(1)], None, [2]]], 3
    )
    raw.send([[Rec.RUN, 1, [tensor(3)], [8]]])
    refused(raw, "_sparse_coo_tensor_with_dims_and_tensors refused", "invalid sparse tensor")
    assert raw.read_floats(3) == [0.0] * 4


def test_sparse_tensor_with_valid_indices_still_adds(raw: Raw) -> None:
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float32")}, [3])
    add = raw.op("aten::add_.Tensor")
    sparse_program(
        raw, 2, [sparse_coo(raw, 2, 5.0, 1), ["op", add, [slot(0), slot(1)], None, [2]]], 3
    )
    raw.send([[Rec.RUN, 2, [tensor(3)], [8]]])
    assert raw.read_floats(8) == [0.0, 0.0, 5.0, 0.0]


def test_writing_into_a_sparse_tensors_indices_cannot_move_them(raw: Raw) -> None:
    """`_indices()` aliased the sparse tensor's own indices: an in-place add moved them out of
    range before the next op used them. The worker hands out a copy."""
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float32")}, [3])
    add, add_scalar = raw.op("aten::add_.Tensor"), raw.op("aten::add_.Scalar")
    indices = raw.op("aten::_indices")
    steps = [
        sparse_coo(raw, 1, 2.0, 1),
        ["op", indices, [slot(1)], None, [2]],
        ["op", add_scalar, [slot(2), 1 << 20], None, [3]],
        ["op", add, [slot(0), slot(1)], None, [4]],
    ]
    sparse_program(raw, 3, steps, 5)
    raw.send([[Rec.RUN, 3, [tensor(3)], [8]]])
    assert raw.read_floats(8) == [0.0, 2.0, 0.0, 0.0]


def test_print_is_refused_and_the_worker_keeps_answering(raw: Raw) -> None:
    """`_print` wrote to a stdout nobody reads: 200 prints of 64 KiB filled the pipe and the
    worker hung. Refused at once: every later sync is answered."""
    for _ in range(200):
        raw.run("aten::_print", ["x" * 65536])
    message = refused(raw, "aten::_print is not allowed", "stdout")
    assert "x" * 100 not in message
    assert raw.sync()[0] == Kind.RESULT


def test_as_strided_past_its_storage_is_refused(raw: Raw) -> None:
    """PyTorch checks `as_strided` against the storage (a test in test_oppolicy pins it)."""
    raw.run("aten::as_strided", [tensor(1), [1 << 20], [1], 0], {}, [2])
    refused(raw, "out of bounds")
    raw.run("aten::as_strided", [tensor(1), [4], [1], 1 << 40], {}, [2])
    refused(raw, "out of bounds")
    raw.run("aten::as_strided_", [tensor(1), [4], [-1], 8], {}, [1])
    refused(raw, "Negative strides")


def test_set_past_its_source_storage_is_refused(raw: Raw) -> None:
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float32")}, [3])
    raw.run("aten::set_.source_Tensor_storage_offset", [tensor(3), tensor(1), 1 << 30, [4], [1]],
            {}, [3])  # fmt: skip
    refused(raw, "out of bounds")


def test_reshape_alias_past_its_storage_is_refused(raw: Raw) -> None:
    """`_reshape_alias` takes sizes and strides as given and checks nothing (torch 2.11 and
    2.13): a 1 MiB view of a 64-byte tensor read whatever followed it."""
    raw.run("aten::_reshape_alias", [tensor(1), [1 << 18], [1]], {}, [2])
    message = refused(raw, "_reshape_alias refused", "storage of 64 bytes")
    raw.run("aten::_reshape_alias", [tensor(1), [4], [4]], {}, [2])
    assert raw.read_floats(2) == [0.0, 4.0, 8.0, 12.0], message


def test_segment_reduce_backward_with_forged_lengths_is_refused(raw: Raw) -> None:
    """The backward trusted lengths it did not make: two segments of 1000 over 16 elements
    corrupted the worker's heap (it aborted)."""
    raw.run("aten::ones", [[2]], {"dtype": ext(Ext.DTYPE, "float32")}, [6])
    raw.run("aten::_segment_reduce_backward", [tensor(6), tensor(6), tensor(1), "sum"],
            {"lengths": longs([1000, 1000])}, [7])  # fmt: skip
    refused(raw, "_segment_reduce_backward")


def test_sparse_index_conversion_that_crashed_the_worker_is_refused(raw: Raw) -> None:
    """`_convert_indices_from_csr_to_coo` with a row pointer past its columns segfaulted."""
    raw.run("aten::_convert_indices_from_csr_to_coo", [longs([0, 100_000]), longs([0])], {}, [2])
    refused(raw, "is not allowed on a gpupool worker", "crashed the worker")


def test_an_op_of_another_namespace_or_a_scripting_op_is_refused(raw: Raw) -> None:
    raw.run("aten::Int.str", ["12"], {}, [None])
    refused(raw, "TorchScript interpreter op")
    raw.run("prim::device", [tensor(1)], {}, [None])
    refused(raw, "not allowed")
