"""The compiled record loop (`gpupool/worker/_runloop.c`) against the Python path it speeds up:
the same decoded records for any body msgpack can make, the same refusals for bodies it cannot,
and the same handle table and replies for op streams, with and without its store shortcut."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.protocol.v1.dataplane import (
    ErrorKind,
    Ext,
    Frame,
    Kind,
    ProtocolError,
    Rec,
    pack_records,
)
from gpupool.protocol.v1.tensors import DTYPE_EXT, HOST_DEVICE_EXT, REMOTE_DEVICE_EXT, handle_ext
from gpupool.worker import executor as executor_module
from gpupool.worker.executor import Executor, Missing
from gpupool.worker.memory import HostMemory
from tests.worker.test_executor import Replies

runloop = pytest.importorskip("gpupool.worker._runloop")


class Recorder:
    """An executor stand-in whose Python record handler only writes down what it is given."""

    def __init__(self, tensors: dict[int, Any]) -> None:
        self.tensors = tensors
        self.ops: dict[int, Any] = {}
        self.error = None
        self.records: list[Any] = []

    def ext_hook(self, code: int, data: bytes) -> object:
        if code == Ext.TENSOR:
            handle = int.from_bytes(data, "big")
            return self.tensors.get(handle, Missing(handle))
        if code == 99:
            raise ProtocolError("unknown extension type 99")
        return ("ext", code, data)

    def run_record(self, record: Any, link: Any) -> None:
        self.records.append(record)


def loop_for(target: Any, fast_store: bool = False) -> Any:
    return runloop.Loop(
        executor=target,
        ext_hook=target.ext_hook,
        missing=Missing,
        tensor_type=torch.Tensor,
        slow=target.run_record,
        op_failed=None,
        op_store=None,
        protocol_error=ProtocolError,
        timestamp=msgpack.Timestamp.from_bytes,
        fast_store=fast_store,
    )


def compiled_records(body: bytes, tensors: dict[int, Any]) -> list[Any]:
    recorder = Recorder(tensors)
    loop = loop_for(recorder)
    head, offset = loop.head(body)
    count = loop.run(body, offset, None)
    assert count == len(recorder.records)
    return [head, *recorder.records]


def msgpack_records(body: bytes, tensors: dict[int, Any]) -> list[Any]:
    return list(Frame(body, 0).objects(Recorder(tensors).ext_hook))


def outcome(decode: Any, body: bytes, tensors: dict[int, Any]) -> Any:
    try:
        return decode(body, tensors)
    except ProtocolError:
        return "refused"


ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-40, 300),
    st.sampled_from([127, 128, -32, -33, 255, 256, 65535, 65536, 2**32 - 1, 2**32, -(2**31)]),
)
exts = st.one_of(
    st.integers(0, 40).map(lambda h: msgpack.ExtType(Ext.TENSOR, h.to_bytes(8, "big"))),
    st.sampled_from([Ext.DTYPE, Ext.DEVICE, Ext.LAYOUT, Ext.MEMORY_FORMAT, Ext.COMPLEX]).flatmap(
        lambda code: st.binary(max_size=20).map(lambda data: msgpack.ExtType(code, data))
    ),
)
leaves = st.one_of(
    st.none(), st.booleans(), ints, st.floats(allow_nan=False), st.text(max_size=40),
    st.binary(max_size=64), exts,
)  # fmt: skip
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20),
        st.dictionaries(st.one_of(st.text(max_size=10), st.binary(max_size=5)), inner, max_size=6),
    ),
    max_leaves=25,
)
records = st.lists(values, max_size=6)
HELD = {handle: torch.full((1,), float(handle)) for handle in range(0, 40, 3)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records)
def test_any_body_msgpack_makes_decodes_to_the_same_records(body_records: list[Any]) -> None:
    body = pack_records([Kind.BATCH], body_records)
    assert compiled_records(body, HELD) == msgpack_records(body, HELD)


@settings(max_examples=150, deadline=None)
@given(records, st.data())
def test_a_damaged_body_is_refused_or_decoded_as_msgpack_decodes_it(
    body_records: list[Any], data: st.DataObject
) -> None:
    body = bytearray(pack_records([Kind.BATCH], body_records))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(body)))
    damaged = bytes(body[:cut])
    assert outcome(compiled_records, damaged, HELD) == outcome(msgpack_records, damaged, HELD)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\x91\x03\xc1", "reserved"),
        (b"\x91\x03" + b"\x91" * 1025 + b"\xc0", "nested too deeply"),
        (b"\x91\x03\xdd\xff\xff\xff\xff", "longer than the body"),
        (b"\x91\x03\xdf\x7f\xff\xff\xff", "longer than the body"),
        (b"\x91\x03\x81\x01\x02", "neither str nor bytes"),
        (b"\x91\x03\xa2\xff\xfe", "not UTF-8"),
        (b"\x91\x03\xc6\x7f\xff\xff\xff", "ends inside a record"),
        (b"\x91\x03\x92\x01", "longer than the body"),
        (b"\x91\x03\x93\x01\xcd\x01", "ends inside a record"),
    ],
)
def test_hostile_bodies_are_refused_with_a_reason(body: bytes, why: str) -> None:
    assert msgpack_records(b"\x91\x03" + b"\x91" * 1024 + b"\xc0", {})  # msgpack's limit
    with pytest.raises(ProtocolError, match=why):
        compiled_records(body, {})
    with pytest.raises(ProtocolError):
        msgpack_records(body, {})


@pytest.mark.parametrize(
    "body",
    [
        b"\x92\x03\xd6\xff\x00\x00\x00\x01",  # msgpack's timestamp extension (-1), 32-bit
        b"\x92\x03\xd7\xff" + bytes(range(8)),  # 64-bit
        b"\x92\x03\xc7\x0c\xff" + bytes(12),  # 96-bit
        b"\x92\x03\xd5\xfe\x00\x01",  # another negative code: the extension hook's
    ],
)
def test_negative_extension_codes_decode_as_msgpack_decodes_them(body: bytes) -> None:
    assert compiled_records(body, {}) == msgpack_records(body, {})


def test_a_timestamp_of_a_wrong_length_is_refused() -> None:
    body = b"\x92\x03\xc7\x05\xff" + bytes(5)
    with pytest.raises(ProtocolError, match="invalid timestamp data"):
        compiled_records(body, {})
    with pytest.raises(ProtocolError, match="invalid timestamp data"):
        msgpack_records(body, {})


def test_an_extension_hook_error_ends_the_body() -> None:
    body = pack_records([Kind.BATCH], [[1, msgpack.ExtType(99, b"")]])
    with pytest.raises(ProtocolError, match="unknown extension type 99"):
        compiled_records(body, {})


# ---- op streams: the compiled loop against the Python one ---------------------------------


F32, DEV = DTYPE_EXT[torch.float32], REMOTE_DEVICE_EXT
STREAM: list[list[Any]] = [
    [Rec.DEF, 1, "aten::full"], [Rec.DEF, 2, "aten::add.Tensor"],
    [Rec.DEF, 3, "aten::max.dim"], [Rec.DEF, 4, "aten::mul_.Tensor"],
    [Rec.DEF, 5, "aten::from_file"], [Rec.DEF, 6, "aten::view"],
    [Rec.OP, 1, [[4], 2.0], {"dtype": F32, "device": DEV}, [10]],
    [Rec.OP, 1, [[4], 3.0], {"dtype": F32, "device": DEV}, [11]],
    [Rec.OP, 2, [handle_ext(10), handle_ext(11)], {}, [12]],
    [Rec.OP, 2, [handle_ext(12), handle_ext(12)], {"alpha": 2}, [12]],  # replaces 12
    [Rec.OP, 3, [handle_ext(12), 0], None, [13, 14]],  # two outputs
    [Rec.OP, 4, [handle_ext(11), handle_ext(10)], None, None],  # in place, no output
    [Rec.OP, 6, [handle_ext(11), [2, 2]], None, [15]],  # a view shares 11's storage
    [Rec.FREE, 10], [Rec.FREE, 999],
    [Rec.READ, 1, handle_ext(12)],
    [Rec.OP, 2, [handle_ext(10), handle_ext(11)], None, [16]],  # 10 is gone: sticky error
    [Rec.OP, 2, [handle_ext(11), handle_ext(11)], None, [17]],  # skipped
    [Rec.READ, 2, handle_ext(11)],  # reports the error, then the stream goes on
    [Rec.OP, 2, [handle_ext(11), handle_ext(15)], None, [18]],  # shape mismatch
    [Rec.READ, 3, handle_ext(11)],
    [Rec.OP, 5, ["/etc/passwd"], None, [19]],  # refused, named
    [Rec.READ, 4, handle_ext(11)],
    [Rec.OP, 2, [handle_ext(11), 1.0], None, [20]],
    [Rec.READ, 5, handle_ext(20)], [Rec.READ, 6, handle_ext(13)], [Rec.READ, 7, handle_ext(14)],
    [Rec.READ, 8, handle_ext(15)],
]  # fmt: skip


def run_stream(compiled: bool, fast_store: bool, batch: int) -> tuple[Any, Any, Any]:
    executor = Executor("lease-r", torch.device("cpu"), HostMemory(None))
    if not compiled:
        executor._loop = None
    elif fast_store:  # what a CUDA worker's allocator allows: no word of stores and frees
        executor._loop = executor_module._new_loop(executor, fast_store=True)
    replies = Replies()
    for start in range(0, len(STREAM), batch):
        executor.run_frame(pack_records([Kind.BATCH], STREAM[start : start + batch]), replies)
    table = {h: t.tolist() for h, t in sorted(executor.tensors.items())}
    return table, replies.heads, replies.tails


@pytest.mark.parametrize("batch", [1, 5, len(STREAM)])
@pytest.mark.parametrize("fast_store", [False, True], ids=["counting-store", "fast-store"])
def test_op_streams_leave_the_same_tensors_and_replies(fast_store: bool, batch: int) -> None:
    table, heads, tails = run_stream(True, fast_store, batch)
    assert (table, heads, tails) == run_stream(False, False, batch)
    errors = [head[2] for head in heads if head[0] == Kind.ERROR]
    assert len(errors) == 3
    assert "tensor 10 is not on the worker" in errors[0]["message"]
    assert "aten::add.Tensor" in errors[1]["message"]
    assert "aten::from_file" in errors[2]["message"]
    assert table[12] == [15.0] * 4 and 16 not in table and 17 not in table and 18 not in table


def test_the_executor_counts_records_run_by_the_compiled_loop() -> None:
    executor = Executor("lease-r", torch.device("cpu"), HostMemory(None))
    if executor._loop is None:
        pytest.skip("GPUPOOL_FASTPATH=0")
    before = executor.activity.ops_total
    executor.run_frame(pack_records([Kind.BATCH], STREAM[:9]), Replies())
    assert executor.activity.ops_total - before == 9


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_record_type_past_a_c_long_is_refused_as_unknown(compiled: bool) -> None:
    executor = Executor("lease-r", torch.device("cpu"), HostMemory(None))
    if not compiled:
        executor._loop = None
    with pytest.raises(ProtocolError, match="unknown record type"):
        executor.run_frame(pack_records([Kind.BATCH], [[2**64 - 1, 1]]), Replies())


def test_the_fast_store_hands_host_tensors_to_python_to_be_counted() -> None:
    """A CUDA worker's loop stores device tensors itself (its allocator holds the limit), but
    a host tensor an op makes there (device="cpu") is the lease's host memory: stored and freed
    through the executor, which counts it. A meta-device executor stands in for the GPU."""
    memory = HostMemory(1 << 20)
    executor = Executor("lease-r", torch.device("meta"), memory)
    stored: list[int] = []
    op_store = executor._op_store

    def counting_store(op: Any, args: Any, kwargs: Any, outs: Any, result: Any) -> None:
        stored.append(outs[0])
        op_store(op, args, kwargs, outs, result)

    executor._op_store = counting_store  # type: ignore[method-assign]
    executor._loop = executor_module._new_loop(executor, fast_store=True)
    f32 = DTYPE_EXT[torch.float32]
    records = [
        [Rec.DEF, 1, "aten::ones"],
        [Rec.OP, 1, [[1024]], {"dtype": f32, "device": REMOTE_DEVICE_EXT}, [10]],
        [Rec.OP, 1, [[1024]], {"dtype": f32, "device": HOST_DEVICE_EXT}, [11]],
    ]
    executor.run_frame(pack_records([Kind.BATCH], records), Replies())
    assert executor.tensors[10].is_meta and executor.tensors[11].is_cpu
    assert stored == [11] and memory.held_bytes() == 4096
    executor.run_frame(pack_records([Kind.BATCH], [[Rec.FREE, 10], [Rec.FREE, 11]]), Replies())
    assert executor.tensors == {} and memory.held_bytes() == 0
    # Past the host allowance: refused, as the lease's out-of-memory error.
    big = [Rec.OP, 1, [[1 << 20]], {"dtype": f32, "device": HOST_DEVICE_EXT}, [12]]
    replies = Replies()
    executor.run_frame(pack_records([Kind.BATCH], [big, [Rec.SYNC, 3]]), replies)
    assert (
        replies.heads[-1][0] == Kind.ERROR
        and replies.heads[-1][2]["kind"] == ErrorKind.OUT_OF_MEMORY
    )
    assert 12 not in executor.tensors and memory.held_bytes() == 0
