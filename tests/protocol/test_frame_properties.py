"""Properties of the data-plane codec under arbitrary input: it decodes what was sent, and
anything else is a ProtocolError or a closed connection, never another exception."""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.protocol.v1.dataplane import (
    Connection,
    ConnectionClosed,
    Kind,
    ProtocolError,
    pack,
    pack_records,
    recv_handshake,
)
from gpupool.protocol.v1.tensors import (
    DTYPES,
    complex_from_ext,
    dtype_from_name,
    literal_ext,
    literal_from_ext,
    tensor_from_bytes,
)

EXPECTED = (ProtocolError, ConnectionClosed)
HEADER = struct.Struct(">II")

msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(),
        st.text(max_size=20),
        st.binary(max_size=40),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def feed(data: bytes) -> Connection:
    """A connection whose peer sent `data` and hung up."""
    left, right = socket.socketpair()
    # A writer thread: more than a socket buffer of data must not block the test.
    writer = threading.Thread(target=lambda: (left.sendall(data), left.close()), daemon=True)
    writer.start()
    return Connection(right, max_frame_bytes=1 << 20)


def drain(conn: Connection) -> list[list[object]]:
    """Read frames until the stream ends; return the heads; only expected errors may escape."""
    heads: list[list[object]] = []
    try:
        while True:
            frame = conn.recv()
            heads.append(list(frame.objects()))
            if frame.tail_len:
                conn.read_tail()
    except EXPECTED:
        return heads
    finally:
        conn.close()


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2048))
def test_any_bytes_are_frames_or_a_protocol_error(data: bytes) -> None:
    drain(feed(data))


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(
        st.tuples(
            st.lists(msgpack_values, min_size=1, max_size=3),
            st.binary(max_size=64),
        ),
        min_size=1,
        max_size=4,
    ),
    cut=st.integers(min_value=0, max_value=10_000),
)
def test_frames_arrive_as_sent_and_a_cut_stream_ends_cleanly(
    frames: list[tuple[list[object], bytes]], cut: int
) -> None:
    data = b"".join(
        HEADER.pack(len(body), len(tail)) + body + tail
        for body, tail in ((pack_records([Kind.BATCH], objs), tail) for objs, tail in frames)
    )
    left, right = socket.socketpair()
    threading.Thread(target=lambda: (left.sendall(data), left.close()), daemon=True).start()
    conn = Connection(right)
    for objs, tail in frames:
        frame = conn.recv()
        # Bytes, not values: NaN is not equal to itself.
        assert frame.body == pack_records([Kind.BATCH], objs)
        assert pack_records(*_split(list(frame.objects()))) == frame.body
        assert bytes(conn.read_tail()) == tail if tail else frame.tail_len == 0
    with pytest.raises(ConnectionClosed):
        conn.recv()
    conn.close()
    # The same stream cut anywhere: whole frames, then a clean end, nothing else.
    assert len(drain(feed(data[: min(cut, len(data))]))) <= len(frames)


def _split(objects: list[object]) -> tuple[list[object], list[object]]:
    head = objects[0]
    assert isinstance(head, list)
    return head, objects[1:]


@settings(max_examples=200, deadline=None)
@given(
    declared=st.tuples(
        st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=0, max_value=2**32 - 1)
    ),
    rest=st.binary(max_size=256),
)
def test_declared_lengths_never_make_the_reader_allocate_or_hang(
    declared: tuple[int, int], rest: bytes
) -> None:
    drain(feed(HEADER.pack(*declared) + rest))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=512))
def test_a_handshake_of_any_bytes_is_read_or_refused(data: bytes) -> None:
    left, right = socket.socketpair()
    left.sendall(data)
    left.close()
    try:
        head = recv_handshake(right).head
        assert isinstance(head, list) and isinstance(head[0], int)
    except EXPECTED:
        pass
    finally:
        right.close()


dtype_names = st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=10), msgpack_values)


@settings(max_examples=300, deadline=None)
@given(
    dtype=dtype_names,
    shape=st.one_of(
        st.lists(st.integers(min_value=-3, max_value=2**64 - 1), max_size=4), msgpack_values
    ),
    raw=st.one_of(st.binary(max_size=64), msgpack_values),
)
def test_tensor_literals_of_any_shape_and_dtype_decode_or_are_refused(
    dtype: object, shape: object, raw: object
) -> None:
    try:
        tensor = literal_from_ext(pack([dtype, shape, raw]))
    except ProtocolError:
        return
    assert isinstance(raw, bytes)
    assert tensor.numel() * tensor.element_size() == len(raw)
    assert list(tensor.shape) == shape and tensor.dtype == dtype_from_name(dtype)


@settings(max_examples=100, deadline=None)
@given(data=st.one_of(st.binary(max_size=32), msgpack_values.map(pack)))
def test_complex_numbers_decode_or_are_refused(data: bytes) -> None:
    try:
        value = complex_from_ext(data)
    except ProtocolError:
        return
    assert isinstance(value, complex)


def test_a_literal_round_trips_and_its_bytes_must_match_its_shape() -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(literal_from_ext(literal_ext(tensor).data), tensor)
    with pytest.raises(ProtocolError):
        tensor_from_bytes(b"\0" * 8, torch.float32, [2**62, 2**62])
    with pytest.raises(ProtocolError):
        literal_from_ext(msgpack.packb(["float32", [3], b"\0" * 8]))
