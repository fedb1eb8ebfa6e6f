"""A resize that fails leaves the tensor as it was, over raw frames against a real worker.

ATen sets a tensor's new sizes before it grows the storage: without the worker's guard, a
resize_ whose size calculation overflows (or whose allocation fails) left a 4-float tensor
claiming 2^64 elements over its 16-byte storage, and every later op on it read past it. The
worker here has no memory limit, so nothing refuses the op before it runs: the guard alone
keeps the tensor whole."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gpupool.protocol.v1.dataplane import ErrorKind, Kind, Rec
from gpupool.protocol.v1.tensors import DTYPE_EXT, handle_ext
from tests.worker import test_memory_attacks as attacks
from tests.worker.test_memory_attacks import Client, WorkerProcess

pytestmark = pytest.mark.slow

F32 = DTYPE_EXT[torch.float32]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with attacks.running_worker() as running:  # no memory limit: nothing refuses the op first
        yield running


@pytest.fixture
def client(worker: WorkerProcess) -> Iterator[Client]:
    with attacks.session(worker) as c:
        yield c


def expect_error(client: Client, says: str) -> None:
    head, _ = client.ask([Rec.SYNC])
    assert head[0] == Kind.ERROR, head
    assert head[2]["kind"] != ErrorKind.PROTOCOL, head[2]
    assert says in head[2]["message"], head[2]


def shape_of(client: Client, handle: int) -> list[int]:
    """The tensor's shape as the worker reads it out (DATA: kind, request, dtype, shape, ...)."""
    head, _ = client.ask([Rec.READ, handle_ext(handle)])
    assert head[0] == Kind.DATA, head
    return list(head[3])


def test_a_resize_whose_size_overflows_leaves_the_tensor_whole(client: Client) -> None:
    client.op(2, [handle_ext(10), [1 << 62, 4]], None)
    expect_error(client, "overflow")
    assert shape_of(client, 10) == [4]
    assert client.read_floats(10) == [1.0] * 4
    attacks.intact(client)


def test_an_out_variant_whose_output_cannot_grow_leaves_it_whole(client: Client) -> None:
    """add.out resizes its output to the broadcast shape; an expand to 2^62 rows fails there."""
    client.op(3, [handle_ext(10), [1 << 62, 4]], 20)
    client.op(6, [handle_ext(20), handle_ext(20)], None, out=handle_ext(10))
    head, _ = client.ask([Rec.SYNC])
    assert head[0] == Kind.ERROR, head
    assert shape_of(client, 10) == [4]
    assert client.read_floats(10) == [1.0] * 4
    attacks.intact(client)
