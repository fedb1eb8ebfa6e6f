"""Hostile data-plane traffic against real worker processes: no crash, no effect on other leases.

Two workers serve two leases. Lease B has an ordinary client (the PyTorch runtime) holding
tensors. Lease A's token is in hostile hands: its connections send random bytes, frames with
wrong or huge lengths, truncated frames, bodies with unknown kinds and records, values of the
wrong types, bad handles, tensors of absurd shapes, strides and dtypes, PUT chunk streams out of
order, and shared-memory descriptors that point nowhere or are not memory at all. Lease B's
worker meanwhile gets handshakes that are garbage or carry the wrong token.

Every hostile connection must end with an ERROR frame when what it sent was complete (or be
answered normally where the garbage happened to be valid); neither worker may crash, log a
traceback or leak descriptors; both go on serving; B's client finds its tensors as they were.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpupool.torch
from gpupool.protocol.v1.dataplane import (
    MAX_FRAME_BYTES,
    PINNED_REGION,
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
)
from gpupool.protocol.v1.tensors import DTYPES
from tests.timing import scaled
from tests.worker.raw_frames import (
    HEADER,
    RemoteRefusal,
    Worker,
    authenticate,
    framed,
    start_worker,
    tensor,
)

pytestmark = pytest.mark.slow

TOKEN_A, TOKEN_B = "hostile-lease-token", "victim-lease-token"
SYNC_REQ = 424_242
"""The request id of the SYNC appended to every hostile stream: its answer shows the worker
went on serving after all that came before it."""
ANSWER_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, Worker]]:
    # Unix-socket paths must be short: keep them out of pytest's deep temporary directories.
    short = Path(f"/tmp/gp-fuzz-{os.getpid()}")
    short.mkdir(exist_ok=True)
    logs = tmp_path_factory.mktemp("logs")
    # The hostile lease's worker listens on a Unix socket: descriptors (shared memory) travel
    # on it, and a refusal is never lost to a TCP reset when the worker closes on unread bytes.
    hostile = start_worker(
        "lease-a", TOKEN_A, logs / "a.log", listen=f"unix:{short}/a.sock", memory_limit_mib=64
    )
    victim = start_worker("lease-b", TOKEN_B, logs / "b.log", memory_limit_mib=64)
    yield hostile, victim
    for worker in (hostile, victim):
        worker.stop()
    for leftover in short.iterdir():
        leftover.unlink()
    short.rmdir()


@dataclass
class Session:
    x: torch.Tensor
    y: torch.Tensor
    expected_x: torch.Tensor
    expected: torch.Tensor


@pytest.fixture(scope="module")
def victim_session(workers: tuple[Worker, Worker]) -> Iterator[Session]:
    """Lease B's own client, with tensors on its worker that must stay as they were."""
    _, victim = workers
    gpupool.torch.attach(workers=[victim.address], token=TOKEN_B, lease=victim.lease)
    try:
        x = torch.arange(64 * 64, dtype=torch.float32, device="cuda").reshape(64, 64) / 64
        y = x @ x.T
        yield Session(x, y, x.cpu(), y.cpu())
    finally:
        gpupool.torch.detach()


def check_unharmed(workers: tuple[Worker, Worker], session: Session) -> None:
    for worker in workers:
        assert worker.proc.poll() is None, f"worker {worker.lease} died"
        assert not worker.errors_logged(), worker.errors_logged()[-3000:]
    assert torch.equal(session.y.cpu(), session.expected), "the other lease's tensors changed"
    assert torch.equal(session.x.cpu(), session.expected_x), "the other lease's tensors changed"
    # Its ops still run.
    assert torch.equal((session.x @ session.x.T).cpu(), session.expected)


# ---- talking to the hostile lease's worker ---------------------------------------------------


@dataclass
class Outcome:
    answered: bool
    """The SYNC after the hostile bytes was answered: the connection still serves."""
    protocol_error: bool
    """An ERROR frame of kind PROTOCOL came, then the worker closed."""
    closed: bool


def converse(sock: socket.socket, hostile: bytes, complete: bool) -> Outcome:
    """Send the hostile bytes and a SYNC after them; read until that answer or the close.

    An incomplete stream (a truncated frame, a tail shorter than announced) leaves the worker
    waiting for the rest: the write side is then shut, so the worker sees the end of it.
    """
    sock.settimeout(ANSWER_TIMEOUT_S)
    tail = b""
    if complete:
        tail = framed(pack_records([Kind.BATCH], [[Rec.SYNC, SYNC_REQ]]))
    with_sync = hostile + tail
    with contextlib.suppress(OSError):  # the worker may close before it has read all of it
        sock.sendall(with_sync)
    if not complete:
        with contextlib.suppress(OSError):  # the worker may have closed already
            sock.shutdown(socket.SHUT_WR)
    conn = Connection(sock)
    protocol_error = False
    try:
        while True:
            frame = conn.recv()
            head = frame.head()
            if frame.tail_len:
                conn.read_tail()
            assert head[0] in (Kind.RESULT, Kind.DATA, Kind.ERROR), head
            if head[0] == Kind.ERROR and head[1] is None:
                assert head[2]["kind"] == ErrorKind.PROTOCOL, head
                protocol_error = True
            if head[1] == SYNC_REQ and head[0] in (Kind.RESULT, Kind.ERROR):
                return Outcome(True, protocol_error, False)
    except ConnectionClosed:
        return Outcome(False, protocol_error, True)
    except TimeoutError:
        raise AssertionError("the worker neither answered nor closed the connection") from None
    except ProtocolError as exc:
        raise AssertionError(f"the worker sent a malformed frame: {exc}") from None
    finally:
        sock.close()


# ---- strategies --------------------------------------------------------------------------------

OPS = [
    "aten::add.Tensor", "aten::mul.Tensor", "aten::zeros", "aten::ones", "aten::arange",
    "aten::empty.memory_format", "aten::empty_strided", "aten::as_strided", "aten::view",
    "aten::reshape", "aten::sum", "aten::cat", "aten::index_select", "aten::copy_",
    "aten::from_file", "aten::nonexistent", "prim::device", "os::system", "aten::", "::",
    "aten::add.NoSuchOverload",
]  # fmt: skip
"""Real ops, ops the worker refuses, and names that are not ops at all."""

small_ints = st.integers(min_value=-4, max_value=64)
# Sizes either small or so large that no allocator even tries: a fuzzer must not fill the
# shared test machine's memory through an op the worker is allowed to run.
sizes = st.one_of(small_ints, st.integers(min_value=2**50, max_value=2**64 - 1))
any_ints = st.one_of(
    small_ints,
    st.sampled_from([-(2**63), 2**31, 2**32, 2**53, 2**63 - 1, 2**64 - 1]),
)
handles = st.one_of(st.integers(min_value=0, max_value=8), any_ints.filter(lambda i: i >= 0))


dtype_names = st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=12))
shapes = st.lists(sizes, max_size=4)
literals = st.builds(
    lambda dtype, shape, raw: msgpack.ExtType(Ext.LITERAL, pack([dtype, shape, raw])),
    dtype_names,
    st.one_of(shapes, any_ints),
    st.binary(max_size=64),
)
extensions = st.one_of(
    handles.map(tensor),
    st.builds(msgpack.ExtType, st.just(Ext.TENSOR), st.binary(max_size=12)),
    dtype_names.map(lambda n: msgpack.ExtType(Ext.DTYPE, n.encode(errors="surrogatepass"))),
    st.builds(msgpack.ExtType, st.sampled_from(list(Ext)), st.binary(max_size=16)),
    st.sampled_from([b"", b"cpu", b"cuda", b"\xff"]).map(lambda d: msgpack.ExtType(Ext.DEVICE, d)),
    literals,
    st.builds(
        lambda value: msgpack.ExtType(Ext.COMPLEX, pack(value)),
        st.one_of(st.lists(st.floats(), max_size=3), any_ints, st.text(max_size=4)),
    ),
    st.builds(msgpack.ExtType, st.integers(min_value=8, max_value=127), st.binary(max_size=8)),
)
scalars = st.one_of(
    st.none(), st.booleans(), sizes, st.floats(), st.text(max_size=16), st.binary(max_size=32)
)
values = st.recursive(
    st.one_of(scalars, extensions),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
ints_or_anything = st.one_of(handles, values)


def record(kind: Rec, *fields: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    return st.tuples(st.just(int(kind)), *fields).map(list)


records = st.one_of(
    record(Rec.DEF, st.one_of(small_ints, values), st.one_of(st.sampled_from(OPS), values)),
    record(
        Rec.OP,
        st.one_of(small_ints, values),
        st.lists(values, max_size=4),
        st.one_of(st.dictionaries(st.text(max_size=8), values, max_size=2), values),
        st.one_of(st.lists(st.one_of(st.none(), handles), max_size=3), values),
    ),
    record(
        Rec.PUT,
        ints_or_anything,
        st.one_of(dtype_names, values),
        st.one_of(shapes, values),
        st.one_of(st.none(), st.binary(max_size=64)),
        st.one_of(sizes, values),
        st.one_of(st.none(), sizes, any_ints),
    ),
    record(Rec.READ, ints_or_anything, st.one_of(handles.map(tensor), values)),
    record(
        Rec.CALL,
        ints_or_anything,
        st.one_of(small_ints, values),
        st.lists(values, max_size=4),
        st.one_of(st.dictionaries(st.text(max_size=8), values, max_size=2), values),
        st.one_of(handles, values),
    ),
    record(Rec.FREE, ints_or_anything),
    record(Rec.SYNC, ints_or_anything),
    record(Rec.SEED, st.one_of(any_ints, values)),
    record(Rec.STATS, ints_or_anything),
    record(Rec.RNG_STATE, ints_or_anything),
    record(Rec.SET_RNG_STATE, st.one_of(st.binary(max_size=64), any_ints, values)),
    # Any type number, any arity.
    st.tuples(st.integers(min_value=-1, max_value=20), st.lists(values, max_size=6)).map(
        lambda t: [t[0], *t[1]]
    ),
    values,
)


@dataclass
class Hostile:
    data: bytes
    complete: bool
    """Every frame is whole: the worker has all it needs to answer or to refuse."""
    valid_frames: bool
    """Every frame's lengths and head are right: only records (or their values) may be wrong."""


@st.composite
def batches(draw: st.DrawFn) -> Hostile:
    """BATCH frames of random records; sometimes with a tail, a wrong head, or PUT chunks."""
    parts: list[bytes] = []
    complete = valid = True
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        head: Any = draw(
            st.one_of(
                st.just([Kind.BATCH]),
                st.lists(st.one_of(st.sampled_from(list(Kind)), values), max_size=3),
                values,
            )
        )
        valid = valid and head == [Kind.BATCH]
        body = pack_records(head, draw(st.lists(records, max_size=6)))
        tail = draw(st.one_of(st.just(b""), st.binary(min_size=1, max_size=32)))
        valid = valid and not tail
        parts.append(framed(body, tail))
        # PUT chunk frames, in or out of order, for whatever PUT the records announced.
        for _chunk in range(draw(st.integers(min_value=0, max_value=2))):
            chunk_head = [Kind.PUT, draw(handles), draw(st.one_of(sizes, values))]
            parts.append(framed(pack(chunk_head), draw(st.binary(min_size=0, max_size=32))))
    how = draw(st.sampled_from(["whole", "whole", "whole", "truncated", "lengths"]))
    data = b"".join(parts)
    if how == "truncated":
        data = data[: draw(st.integers(min_value=1, max_value=max(1, len(data) - 1)))]
        complete = valid = False
    elif how == "lengths":
        body_len = draw(
            st.one_of(
                st.integers(min_value=0, max_value=64),
                st.integers(min_value=MAX_FRAME_BYTES - 8, max_value=2**32 - 1),
            )
        )
        tail_len = draw(st.one_of(st.just(0), st.integers(min_value=0, max_value=2**32 - 1)))
        data = HEADER.pack(body_len, tail_len) + data[HEADER.size :]
        complete = valid = body_len + tail_len > MAX_FRAME_BYTES or body_len == 0
    return Hostile(data, complete, valid)


# ---- the tests ---------------------------------------------------------------------------------

FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.timeout(600)
def test_hostile_frames_end_their_connection_with_an_error_and_harm_no_one(
    workers: tuple[Worker, Worker], victim_session: Session
) -> None:
    hostile_worker, _ = workers
    baseline_fds = hostile_worker.fds()
    seen = {"answered": 0, "refused": 0, "left": 0}

    @settings(FUZZ, max_examples=250)
    @given(hostile=batches())
    def run(hostile: Hostile) -> None:
        outcome = converse(authenticate(hostile_worker), hostile.data, hostile.complete)
        if outcome.answered:
            seen["answered"] += 1
        elif outcome.protocol_error:
            seen["refused"] += 1
        else:
            # Closed without a word: only right when the stream ended inside a frame.
            assert not hostile.complete, "the worker closed a connection without an error"
            seen["left"] += 1
        assert hostile_worker.proc.poll() is None, "the worker died"
        assert not hostile_worker.errors_logged(), hostile_worker.errors_logged()[-3000:]

    run()
    # The fuzzer reached all three endings: served, refused with an error, and left.
    assert all(seen.values()), seen
    check_unharmed(workers, victim_session)
    still_serves(hostile_worker)
    assert hostile_worker.fds() <= baseline_fds + 2, "descriptors leak per connection"


@pytest.mark.timeout(300)
def test_random_bytes_after_the_handshake_never_crash_the_worker(
    workers: tuple[Worker, Worker], victim_session: Session
) -> None:
    hostile_worker, _ = workers

    @settings(FUZZ, max_examples=100)
    @given(garbage=st.binary(min_size=1, max_size=4096))
    def run(garbage: bytes) -> None:
        converse(authenticate(hostile_worker), garbage, complete=False)
        assert hostile_worker.proc.poll() is None, "the worker died"
        assert not hostile_worker.errors_logged(), hostile_worker.errors_logged()[-3000:]

    run()
    check_unharmed(workers, victim_session)
    still_serves(hostile_worker)


def memfd(size: int) -> int:
    fd = os.memfd_create("gpupool-fuzz")
    os.ftruncate(fd, size)
    return fd


def sealed_memfd(size: int) -> int:
    """A pinned region as a client makes it: sealed against shrinking."""
    fd = os.memfd_create("gpupool-fuzz", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def put_from_region(handle: int, offset: Any, where: list[Any] | None = None) -> list[Any]:
    """A PUT of 16 bytes naming the client's pinned region."""
    return [Rec.PUT, handle, "float32", [4], None, 16, offset, *(where or [PINNED_REGION])]


@pytest.mark.timeout(300)
def test_shared_memory_that_points_nowhere_is_refused(
    workers: tuple[Worker, Worker], victim_session: Session
) -> None:
    hostile_worker, _ = workers
    baseline_fds = hostile_worker.fds()
    read_end, write_end = os.pipe()
    cases: list[tuple[list[int], list[Any]]] = [
        # An empty memfd cannot be mapped; a pipe is no memory at all.
        ([memfd(0)], [[Rec.SYNC, 1]]),
        ([os.dup(read_end)], [[Rec.SYNC, 1]]),
        # A real arena of 4 KiB, and PUTs reading past its end or before its start.
        ([memfd(4096)], [[Rec.PUT, 1, "float32", [2048], None, 8192, 0]]),
        ([memfd(4096)], [[Rec.PUT, 1, "float32", [4], None, 16, 4090]]),
        ([memfd(4096)], [[Rec.PUT, 1, "float32", [4], None, 16, -8]]),
        # Several descriptors where one is expected.
        ([memfd(4096), memfd(4096), memfd(4096)], [[Rec.SYNC, 1]]),
    ]
    # The client's pinned region (a second descriptor): one that is not sealed against
    # shrinking (it could fault the worker mid-copy) is not used, and PUTs naming it, its
    # bytes out of range, or another region are protocol errors.
    pinned_cases: list[tuple[list[int], list[Any]]] = [
        ([memfd(4096), memfd(1 << 20)], [put_from_region(1, 0)]),
        ([memfd(4096), os.dup(read_end)], [put_from_region(1, 0)]),
        ([memfd(4096), sealed_memfd(4096)], [put_from_region(1, 4090)]),
        ([memfd(4096), sealed_memfd(4096)], [put_from_region(1, -4)]),
        ([memfd(4096), sealed_memfd(4096)], [put_from_region(1, 0, where=[2])]),
        ([memfd(4096), sealed_memfd(4096)], [put_from_region(1, "0", where=[PINNED_REGION])]),
        ([memfd(4096)], [put_from_region(1, 0)]),
    ]
    for fds, recs, pinned in [(f, r, False) for f, r in cases] + [
        (f, r, True) for f, r in pinned_cases
    ]:
        try:
            sock = authenticate(hostile_worker, fds, pinned=pinned)
        except RemoteRefusal as refusal:
            assert refusal.args[0]["kind"] == ErrorKind.PROTOCOL, refusal.args
        else:
            outcome = converse(sock, framed(pack_records([Kind.BATCH], recs)), complete=True)
            assert outcome.answered or outcome.protocol_error, (fds, recs, outcome)
        finally:
            for fd in fds:
                os.close(fd)
    os.close(read_end)
    os.close(write_end)
    check_unharmed(workers, victim_session)
    still_serves(hostile_worker)
    assert hostile_worker.fds() <= baseline_fds + 2, "descriptors leak per connection"


@pytest.mark.timeout(300)
def test_garbage_handshakes_to_a_busy_worker_leave_its_client_alone(
    workers: tuple[Worker, Worker], victim_session: Session
) -> None:
    _, victim = workers

    @settings(FUZZ, max_examples=60)
    @given(
        hello=st.one_of(
            st.binary(min_size=1, max_size=256),
            st.builds(
                lambda body: framed(pack([Kind.HELLO, body])),
                st.one_of(
                    values,
                    st.fixed_dictionaries(
                        {
                            "v": st.one_of(st.just(VERSION), values),
                            "lease": st.sampled_from(["lease-b", "lease-a", ""]),
                            "token": st.one_of(st.just(TOKEN_A), st.text(max_size=24), values),
                        }
                    ),
                ),
            ),
        )
    )
    def run(hello: bytes) -> None:
        sock = connect(parse_address(victim.address))
        sock.settimeout(ANSWER_TIMEOUT_S)
        try:
            with contextlib.suppress(OSError):  # refused (and closed) before all of it was sent
                sock.sendall(hello)
                sock.shutdown(socket.SHUT_WR)
            try:
                reply = sock.recv(1 << 16)
            except ConnectionResetError:
                reply = b""  # refused with bytes of ours unread: TCP resets, the refusal is lost
            if reply:
                length, tail = HEADER.unpack(reply[: HEADER.size])
                head = msgpack.unpackb(reply[HEADER.size : HEADER.size + length])
                assert head[0] == Kind.ERROR and tail == 0, head
                assert head[2]["kind"] in (ErrorKind.PROTOCOL, ErrorKind.AUTH), head
        finally:
            sock.close()
        assert torch.equal(victim_session.y.cpu(), victim_session.expected)

    run()
    check_unharmed(workers, victim_session)


def still_serves(worker: Worker) -> None:
    """A well-behaved client of the same lease is served after all that."""
    deadline = time.monotonic() + scaled(10)
    while True:
        try:
            sock = authenticate(worker)
            break
        except RemoteRefusal as refusal:  # the last hostile connection may still be ending
            assert refusal.args[0]["kind"] == ErrorKind.BUSY and time.monotonic() < deadline
    conn = Connection(sock)
    conn.send_body(pack_records([Kind.BATCH], [[Rec.STATS, 7]]))
    head = conn.recv().head()
    assert head[:2] == [Kind.RESULT, 7], head
    assert head[2]["tensors"] == 0, "the previous client's tensors were not freed"
    conn.close()
