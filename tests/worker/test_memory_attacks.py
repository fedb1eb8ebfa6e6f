"""A hostile client against a real CPU worker's memory limit: raw data-plane frames that used
to take memory past the lease's limit (in-place growth, outputs charged after they existed, an
op's transient peak, reads and puts through expanded views, peer transfers) are refused before
the memory moves, with the lease's out-of-memory error at the next read; the worker's peak
resident memory stays where it was, and the client's other tensors are intact."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from gpupool.protocol.v1.dataplane import (
    CHUNK_BYTES,
    VERSION,
    Connection,
    ErrorKind,
    Kind,
    Rec,
    Role,
    connect,
    pack_records,
    parse_address,
    recv_handshake,
    role_handshake,
    send_handshake,
    start_worker_process,
)
from gpupool.protocol.v1.tensors import DTYPE_EXT, REMOTE_DEVICE_EXT, handle_ext
from tests.timing import scaled

pytestmark = pytest.mark.slow

TOKEN = "memory-attack-token"
LEASE = "lease-mem"
LIMIT_MIB = 64
MiB = 1 << 20
GiB = 1 << 30
PEAK_GROWTH_BYTES = 256 * MiB
"""How much the worker's peak resident memory may grow over a whole attack: the attacks ask
for a GiB or more each; refused before allocating, they move next to nothing."""
F32 = DTYPE_EXT[torch.float32]

OPS = {
    1: "aten::ones",
    2: "aten::resize_",
    3: "aten::expand",
    4: "aten::median",
    5: "aten::set_.source_Tensor_storage_offset",
    6: "aten::add.out",
    7: "aten::arange",
}


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[str]
    address: str
    peer_secret: str
    """The lease's worker secret: what a peer worker shows (never the client's token)."""

    def peak_rss_bytes(self) -> int:
        """The process's resident high-water mark (VmHWM): what it ever took, not what it
        holds now, so an allocation that came and went still shows."""
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")


@contextlib.contextmanager
def running_worker(**options: Any) -> Iterator[WorkerProcess]:
    """A real worker process of lease LEASE (one op thread), with start_worker_process's
    options (memory limits, device), stopped on the way out."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, ready = start_worker_process(LEASE, TOKEN, env=env, threads=1, **options)
    assert ready.credentials is not None
    try:
        yield WorkerProcess(proc, str(ready.address), ready.credentials.peer)
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(30))


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with running_worker(memory_limit_mib=LIMIT_MIB) as running:
        yield running


class Client:
    """One client session over raw frames."""

    def __init__(self, address: str) -> None:
        sock = connect(parse_address(address))
        hello = {"v": VERSION, "lease": LEASE, "token": TOKEN, "shm": False}
        send_handshake(sock, [Kind.HELLO, hello])
        assert recv_handshake(sock).head[0] == Kind.WELCOME
        sock.settimeout(60)
        self.conn = Connection(sock)
        self.req = 0
        self.batch([[Rec.DEF, op_id, name] for op_id, name in OPS.items()])

    def batch(self, records: list[list[Any]]) -> None:
        self.conn.send_body(pack_records([Kind.BATCH], records))

    def op(self, op_id: int, args: list[Any], into: int | None, **kwargs: Any) -> None:
        self.batch([[Rec.OP, op_id, args, kwargs or None, None if into is None else [into]]])

    def ask(self, record: list[Any]) -> tuple[list[Any], bytes]:
        """A record with a request id (READ, SYNC, STATS): its answer, with any DATA tail."""
        self.req += 1
        self.batch([[record[0], self.req, *record[1:]]])
        while True:
            frame = self.conn.recv()
            head = frame.head()
            tail = self.conn.read_tail() if frame.tail_len else b""
            if head[0] != Kind.NOTICE and head[1] == self.req:
                return head, bytes(tail)

    def read_floats(self, handle: int) -> list[float]:
        head, tail = self.ask([Rec.READ, handle_ext(handle)])
        assert head[0] == Kind.DATA, head
        return list(struct.unpack(f"<{len(tail) // 4}f", tail))

    def stats(self) -> dict[str, Any]:
        head, _ = self.ask([Rec.STATS])
        assert head[0] == Kind.RESULT, head
        return head[2]  # type: ignore[no-any-return]

    def expect_oom(self) -> str:
        """The stream's sticky error, at the next read: the lease's out-of-memory error."""
        head, _ = self.ask([Rec.SYNC])
        assert head[0] == Kind.ERROR, head
        assert head[2]["kind"] == ErrorKind.OUT_OF_MEMORY, head[2]
        assert f"gpupool lease {LEASE} is out of GPU memory" in head[2]["message"], head[2]
        return str(head[2]["message"])

    def close(self) -> None:
        self.conn.close()


@contextlib.contextmanager
def session(worker: WorkerProcess) -> Iterator[Client]:
    """A client session holding tensor 10 (four ones on the worker's device), which every
    attack must leave as it was (`intact`)."""
    c = Client(worker.address)
    c.op(1, [[4]], 10, dtype=F32, device=REMOTE_DEVICE_EXT)
    assert c.read_floats(10) == [1.0] * 4
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def client(worker: WorkerProcess) -> Iterator[Client]:
    with session(worker) as c:
        yield c


def held(client: Client) -> int:
    return int(client.stats()["memory_held_bytes"])


def intact(client: Client) -> None:
    """After a refusal the stream goes on: the other tensor reads as it was, ops run again."""
    assert client.read_floats(10) == [1.0] * 4
    client.op(1, [[2]], 11, dtype=F32, device=REMOTE_DEVICE_EXT)
    assert client.read_floats(11) == [1.0, 1.0]


def test_resize_growth_past_the_limit_is_refused_before_the_storage_grows(
    worker: WorkerProcess, client: Client
) -> None:
    before, peak = held(client), worker.peak_rss_bytes()
    client.op(1, [[4]], 20, dtype=F32, device=REMOTE_DEVICE_EXT)
    client.op(2, [handle_ext(20), [GiB // 4]], None)  # 4 bytes a float: 1 GiB
    message = client.expect_oom()
    assert "MiB" in message and "aten::resize_" in message
    assert client.read_floats(20) == [1.0] * 4  # the tensor is as it was, not grown
    assert held(client) == before + 16
    assert worker.peak_rss_bytes() - peak < PEAK_GROWTH_BYTES
    intact(client)


def test_resize_growth_within_the_limit_is_charged(client: Client) -> None:
    before = held(client)
    client.op(1, [[4]], 20, dtype=F32, device=REMOTE_DEVICE_EXT)
    client.op(2, [handle_ext(20), [8 * MiB]], None)  # 32 MiB: fits the 64 MiB lease
    assert held(client) == before + 32 * MiB
    # A second one does not fit with the first one counted at its grown size.
    client.op(1, [[4]], 21, dtype=F32, device=REMOTE_DEVICE_EXT)
    client.op(2, [handle_ext(21), [8 * MiB]], None)
    client.expect_oom()
    assert held(client) == before + 32 * MiB + 16
    intact(client)


def test_set_growing_another_tensors_storage_is_refused(
    worker: WorkerProcess, client: Client
) -> None:
    """set_ with sizes past the source's storage grows that storage (another handle's)."""
    before, peak = held(client), worker.peak_rss_bytes()
    client.op(1, [[1]], 30, dtype=F32, device=REMOTE_DEVICE_EXT)
    client.op(1, [[1]], 31, dtype=F32, device=REMOTE_DEVICE_EXT)
    client.op(5, [handle_ext(30), handle_ext(31), 0, [GiB // 4], [1]], None)
    head, _ = client.ask([Rec.SYNC])
    assert head[0] == Kind.ERROR, head
    # Refused as the lease's out-of-memory error here; a worker that refuses set_ past its
    # storage outright (argument checks) refuses it before that.
    assert head[2]["kind"] in (ErrorKind.OUT_OF_MEMORY, ErrorKind.UNSUPPORTED), head[2]
    assert held(client) == before + 8
    assert client.read_floats(31) == [1.0]
    assert worker.peak_rss_bytes() - peak < PEAK_GROWTH_BYTES
    intact(client)


def test_an_out_variant_resizing_its_output_past_the_limit_is_refused(client: Client) -> None:
    before = held(client)
    client.op(1, [[4]], 40, dtype=F32, device=REMOTE_DEVICE_EXT)
    client.op(3, [handle_ext(40), [GiB // 16, 4]], 41)  # a 1 GiB view of 16 bytes
    client.op(6, [handle_ext(41), handle_ext(41)], None, out=handle_ext(40))  # out resized to 1 GiB
    client.expect_oom()
    assert client.read_floats(40) == [1.0] * 4
    assert held(client) == before + 16
    intact(client)


def test_an_output_that_does_not_fit_is_refused_before_it_is_allocated(
    worker: WorkerProcess, client: Client
) -> None:
    before, peak = held(client), worker.peak_rss_bytes()
    client.op(1, [[GiB // 4]], 50, dtype=F32, device=REMOTE_DEVICE_EXT)  # ones: writes 1 GiB
    message = client.expect_oom()
    assert "the op's outputs (1024.0 MiB)" in message
    assert worker.peak_rss_bytes() - peak < PEAK_GROWTH_BYTES
    assert held(client) == before
    intact(client)


def test_an_ops_transient_peak_is_held_by_the_process_cap(
    worker: WorkerProcess, client: Client
) -> None:
    """median returns one value but copies its (expanded: 1 GiB) input first: what no meta
    kernel sees, the process cap refuses in the allocator, as the lease's out-of-memory."""
    before, peak = held(client), worker.peak_rss_bytes()
    client.op(3, [handle_ext(10), [GiB // 16, 4]], 60)
    client.op(4, [handle_ext(60)], 61)
    message = client.expect_oom()
    assert "can't allocate memory" in message
    assert worker.peak_rss_bytes() - peak < PEAK_GROWTH_BYTES
    assert held(client) == before  # the view shares the client's tensor's storage
    intact(client)


def test_a_read_whose_host_copy_does_not_fit_is_refused(
    worker: WorkerProcess, client: Client
) -> None:
    """A read of an expanded view copies it whole: 1 GiB out of 16 bytes."""
    peak = worker.peak_rss_bytes()
    client.op(3, [handle_ext(10), [GiB // 16, 4]], 70)
    head, _ = client.ask([Rec.READ, handle_ext(70)])
    assert head[0] == Kind.ERROR and head[2]["kind"] == ErrorKind.OUT_OF_MEMORY, head
    assert "a read's host copy (1024.0 MiB)" in head[2]["message"]
    assert worker.peak_rss_bytes() - peak < PEAK_GROWTH_BYTES
    intact(client)


def test_a_put_whose_staging_buffer_does_not_fit_is_refused(client: Client) -> None:
    """A put into an expanded view needs a staging buffer of the view's size: refused, and its
    bytes are read and dropped so that the stream goes on."""
    before = held(client)
    client.op(3, [handle_ext(10), [8 * MiB, 4]], 80)  # 128 MiB of view, 16 bytes
    nbytes = 128 * MiB
    client.batch([[Rec.PUT, 80, "float32", [8 * MiB, 4], None, nbytes, None]])
    chunk = b"\x00" * CHUNK_BYTES
    for offset in range(0, nbytes, CHUNK_BYTES):
        client.conn.send([Kind.PUT, 80, offset], chunk)
    message = client.expect_oom()
    assert "a put's staging buffer (128.0 MiB)" in message
    assert held(client) == before
    intact(client)


def test_a_put_into_a_whole_tensor_needs_no_staging(client: Client) -> None:
    """The common put (a parameter's upload): straight into the tensor, even one that fills
    most of the lease."""
    client.op(1, [[12 * MiB]], 90, dtype=F32, device=REMOTE_DEVICE_EXT)  # 48 MiB of 64
    nbytes = 48 * MiB
    client.batch([[Rec.PUT, 90, "float32", [12 * MiB], None, nbytes, None]])
    chunk = b"\x00" * CHUNK_BYTES
    for offset in range(0, nbytes, CHUNK_BYTES):
        client.conn.send([Kind.PUT, 90, offset], chunk)
    head, _ = client.ask([Rec.SYNC])
    assert head[0] == Kind.RESULT, head
    client.op(7, [4], 91, dtype=F32, device=REMOTE_DEVICE_EXT)
    assert client.read_floats(91) == [0.0, 1.0, 2.0, 3.0]


def peer(worker: WorkerProcess) -> Connection:
    sock = connect(parse_address(worker.address))
    role_handshake(sock, LEASE, worker.peer_secret, Role.PEER)
    return Connection(sock)


def test_a_huge_transfer_head_is_refused_without_allocating(
    worker: WorkerProcess, client: Client
) -> None:
    """One 30-byte TRANSFER head used to make the worker allocate and zero-fill what it
    claimed (up to 256 GiB); now the claim is charged first, and the RECV fails with the
    lease's out-of-memory error."""
    before, peak = held(client), worker.peak_rss_bytes()
    conn = peer(worker)
    try:
        conn.send([Kind.TRANSFER, 7, "float32", [64 * GiB], 256 * GiB])
        client.batch([[Rec.RECV, 7, 100, F32, False]])
        message = client.expect_oom()
        assert "the copy from another device (transfer 7)" in message
        assert worker.peak_rss_bytes() - peak < PEAK_GROWTH_BYTES
        assert held(client) == before
        intact(client)
    finally:
        conn.close()


def test_transfer_buffers_are_charged_until_their_recv_stores_them(
    worker: WorkerProcess, client: Client
) -> None:
    before = held(client)
    conn = peer(worker)
    try:
        nbytes = 40 * MiB
        conn.send([Kind.TRANSFER, 8, "float32", [nbytes // 4], nbytes])
        for offset in range(0, nbytes, CHUNK_BYTES):
            conn.send([Kind.PUT, 8, offset], b"\x01" * CHUNK_BYTES)
        # Arrived, not yet taken by a RECV: the lease holds it.
        wait_for(lambda: held(client) == before + nbytes)
        # A second one does not fit beside it: refused, its bytes dropped as they come.
        conn.send([Kind.TRANSFER, 9, "float32", [nbytes // 4], nbytes])
        for offset in range(0, nbytes, CHUNK_BYTES):
            conn.send([Kind.PUT, 9, offset], b"\x01" * CHUNK_BYTES)
        client.batch([[Rec.RECV, 8, 110, F32, False], [Rec.RECV, 9, 111, F32, False]])
        client.expect_oom()
        assert held(client) == before + nbytes  # the first, stored as tensor 110, only
        head, tail = client.ask([Rec.READ, handle_ext(110)])
        assert head[0] == Kind.DATA and head[5] == nbytes and tail[:4] == b"\x01" * 4
        intact(client)
    finally:
        conn.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until `predicate` holds (a transfer is received on a thread of its own)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
