"""Handing a client's state over: what goes over the wire, and a predecessor lost halfway."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import pytest
import torch

from gpupool.protocol.v1.dataplane import (
    CHUNK_BYTES,
    VERSION,
    Connection,
    ErrorKind,
    Kind,
    ProtocolError,
    connect,
    parse_address,
    recv_handshake,
    send_handshake,
    start_worker_process,
)
from gpupool.worker.handoff import RING_SLOTS, Offer, host_key, paths_for, receive, send
from gpupool.worker.swap import ClientState, Ring, restore, snapshot
from tests.timing import scaled

TOKEN = "handoff-token"
CPU = torch.device("cpu")


def table() -> dict[int, torch.Tensor]:
    """Two storages bigger than a chunk, a view sharing one of them, and an empty tensor."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(CHUNK_BYTES // 4 * 2 + 123, generator=g)
    other = torch.randint(0, 1000, (77, 5), generator=g)
    return {1: big, 2: big[10:20], 3: other.t(), 4: torch.empty(0)}


def hand_over(
    offer_paths: tuple[str, ...], device: torch.device = CPU
) -> tuple[str, dict[int, torch.Tensor]]:
    """send() on one end of a socket pair, receive() on the other: the path and the table."""
    tensors = {handle: tensor.to(device) for handle, tensor in table().items()}
    tensors[2] = tensors[1][10:20]  # .to() of a view makes a storage of its own: share again
    state = snapshot(tensors)
    state.ops, state.rng = {7: "aten::add.Tensor"}, b"\x01\x02"
    left, right = socket.socketpair()
    installed: list[ClientState] = []
    ring = Ring(RING_SLOTS, CHUNK_BYTES) if device.type == "cuda" else None
    try:
        receiver = threading.Thread(
            target=lambda: receive(Connection(right), device, installed.append, ring)
        )
        receiver.start()
        offer = Offer("tcp://127.0.0.1:9", host_key(), device.type, (), offer_paths)
        path = send(Connection(left), state, offer, device)
        receiver.join(10)
    finally:
        left.close()
        right.close()
    (got,) = installed
    assert got.ops == {7: "aten::add.Tensor"} and got.rng == b"\x01\x02"
    return path, restore(got, device)


@pytest.mark.parametrize("paths", [("shm", "stream"), ("stream",)], ids=["shm", "stream"])
def test_handed_over_tensors_are_bit_identical_and_keep_their_aliasing(
    paths: tuple[str, ...],
) -> None:
    path, got = hand_over(paths)
    assert path == paths[0]
    expected = table()
    for handle, tensor in expected.items():
        assert got[handle].shape == tensor.shape and got[handle].stride() == tensor.stride()
        assert torch.equal(got[handle], tensor)
    got[2].fill_(-1.0)  # a view of tensor 1 in the original: still one after the handoff
    assert torch.all(got[1][10:20] == -1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paths", [("shm",), ("stream",)], ids=["shm", "stream"])
def test_gpu_state_handed_over_through_host_memory_is_bit_identical(
    paths: tuple[str, ...],
) -> None:
    """The staged GPU paths (shared memory through the pinned ring, the chunked stream); CUDA
    IPC needs two processes and is measured by bench/migration.py."""
    device = torch.device("cuda", 0)
    path, got = hand_over(paths, device)
    assert path == paths[0]
    for handle, tensor in table().items():
        assert got[handle].device == device and got[handle].shape == tensor.shape
        assert torch.equal(got[handle].cpu(), tensor)
    got[2].fill_(-1.0)
    assert torch.all(got[1][10:20] == -1.0)


def test_a_successor_on_another_host_gets_the_stream_only() -> None:
    state = snapshot(table())
    elsewhere = Offer("tcp://10.0.0.2:1", "another-host", "cpu", (), ("cuda_ipc", "shm", "stream"))
    assert paths_for(state, elsewhere, CPU) == ["stream"]
    here = Offer("tcp://127.0.0.1:1", host_key(), "cpu", (), ("cuda_ipc", "shm", "stream"))
    assert paths_for(state, here, CPU) == ["shm", "stream"]  # no IPC between CPU workers


@pytest.mark.parametrize(
    "body",
    [
        {"op": "adopt"},
        {"op": "adopt", "address": "tcp://h:1", "paths": ["carrier-pigeon"]},
        {"op": "adopt", "address": "tcp://h:1", "device": "tpu"},
        {"op": "adopt", "address": "tcp://h:1", "gpus": "GPU-1"},
    ],
)
def test_a_malformed_adopt_request_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        Offer.from_wire(body)


@pytest.mark.slow
def test_a_predecessor_lost_in_the_middle_leaves_a_successor_that_says_why() -> None:
    """The old worker dies after sending part of the state: the successor does not hang and
    does not serve a half state; a client that comes to it is told what happened."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def dying_predecessor() -> None:
        sock, _ = listener.accept()
        assert recv_handshake(sock).head[0] == Kind.HELLO
        send_handshake(sock, [Kind.WELCOME, {"v": VERSION, "lease": "lease-h"}])
        conn = Connection(sock)
        assert conn.recv().head()[2]["op"] == "adopt"
        size = CHUNK_BYTES * 2
        meta = {"storages": [size], "tensors": [[1, 0, "float32", [size // 4], [1], 0]],
                "ops": [], "path": "stream"}  # fmt: skip
        conn.send([Kind.STATE, meta])
        conn.send([Kind.PUT, 0, 0], bytes(CHUNK_BYTES))
        listener.close()  # gone: the successor's next attempt is refused
        conn.close()

    thread = threading.Thread(target=dying_predecessor, daemon=True)
    thread.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, ready = start_worker_process(
        "lease-h", TOKEN, env=env, threads=1, restore_from=f"tcp://127.0.0.1:{port}",
        handoff_paths=["stream"],
    )  # fmt: skip
    try:
        thread.join(30)
        sock = connect(parse_address(str(ready.address)))
        send_handshake(sock, [Kind.HELLO, {"v": VERSION, "lease": "lease-h", "token": TOKEN}])
        sock.settimeout(30)
        head = recv_handshake(sock).head
        sock.close()
        assert head[0] == Kind.ERROR
        assert head[2]["kind"] == ErrorKind.PROTOCOL
        assert "could not take over" in head[2]["message"]
        assert proc.poll() is None  # the worker itself keeps running for the agent to stop
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(10))


@pytest.mark.parametrize("path", ["stream", "shm"])
def test_a_state_past_the_successors_limit_is_refused_before_it_is_allocated(path: str) -> None:
    """A predecessor (or whoever holds the successor role's credential) announcing storages
    past the lease's limit: refused by any path before one byte is allocated for them."""
    from gpupool.worker.executor import Executor
    from gpupool.worker.memory import HostMemory, LimitExceeded

    executor = Executor("lease-h", CPU, HostMemory(64 << 20))
    left, right = socket.socketpair()
    installed: list[ClientState] = []
    try:
        meta = {"storages": [1 << 40], "tensors": [], "path": path, "shm": {}}
        Connection(left).send([Kind.STATE, meta])
        with pytest.raises(
            LimitExceeded, match=r"the state handed over \(1048576.0 MiB\) would hold"
        ):
            receive(Connection(right), CPU, installed.append, None, executor.reserve_state)
    finally:
        left.close()
        right.close()
    assert installed == [] and executor.memory.held_bytes() == 0
