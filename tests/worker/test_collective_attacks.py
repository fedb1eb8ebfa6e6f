"""DIST records packed by hand: a client that lies about a rooted collective (reduce, gather,
scatter, all_to_all) is refused by its worker with an error naming the collective, before gloo
or NCCL sees the tensors. NCCL trusts sizes: a gather whose root has too few or too small
outputs would have it write past them. The worker stays up, the lease's other tensors are as
they were, and a rank whose lie is refused leaves the group, so its peers fail at once rather
than wait out the group's timeout."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from gpupool.protocol.v1.dataplane import Ext, Kind, Rec
from tests.torch.torch_workers import TOKEN as PAIR_TOKEN
from tests.torch.torch_workers import WorkerHandle, introduce
from tests.torch.torch_workers import start_worker as start_lease_worker
from tests.worker.raw_frames import (
    Raw,
    Worker,
    authenticate,
    authenticate_to,
    ext,
    refused,
    start_worker,
    tensor,
)

pytestmark = pytest.mark.slow

TOKEN = "collective-attack-lease-token"
INTACT = list(range(16))
"""Handle 1 of every session: arange(16), which no refused collective may change."""
FLOAT16, SHORT, LONG16 = 2, 3, 4
"""Handles: zeros(16) float32, zeros(3) float32, zeros(16) int64."""


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    worker = start_worker("lease-collective-attack", TOKEN, log)
    yield worker
    worker.stop()


def make_tensors(client: Raw) -> None:
    float32, int64 = ext(Ext.DTYPE, "float32"), ext(Ext.DTYPE, "int64")
    client.run("aten::arange.start_step", [0, 16, 1], {"dtype": float32}, [1])
    client.run("aten::zeros", [[16]], {"dtype": float32}, [FLOAT16])
    client.run("aten::zeros", [[3]], {"dtype": float32}, [SHORT])
    client.run("aten::zeros", [[16]], {"dtype": int64}, [LONG16])


def join(client: Raw, group: str, rank: int = 0, size: int = 1, host: str = "") -> None:
    """The client's worker joins process group `group` (of one rank: no peer to wait for)."""
    body = {"rank": rank, "size": size, "host": host, "timeout_s": 300}
    client.send([[Rec.DIST, "init", group, body]])


def lease_client(worker: WorkerHandle) -> Raw:
    return Raw(authenticate_to(worker.address, worker.lease, PAIR_TOKEN)[0])


@pytest.fixture
def raw(worker: Worker) -> Iterator[tuple[Raw, str]]:
    """A client of the worker, its tensors made and its worker in a group of one rank."""
    client = Raw(authenticate(worker))
    make_tensors(client)
    group = uuid.uuid4().hex
    join(client, group)
    assert client.sync()[0] == Kind.RESULT
    yield client, group
    try:
        assert worker.proc.poll() is None, "the worker died"
        assert client.read_floats(1) == INTACT, "another tensor of the lease changed"
        assert not worker.errors_logged(), worker.errors_logged()[-3000:]
    finally:
        client.close()


T1, T2, SHORT_T, LONG_T = tensor(1), tensor(FLOAT16), tensor(SHORT), tensor(LONG16)
ATTACKS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("gather", {"input": T1, "outputs": [], "root": 0}, ("one per rank", "not 0")),
    ("gather", {"input": T1, "outputs": [T2, T2], "root": 0}, ("one per rank", "not 2")),
    ("gather", {"input": T1, "outputs": [SHORT_T], "root": 0}, ("shape [3]",)),
    ("gather", {"input": T1, "outputs": [LONG_T], "root": 0}, ("torch.int64",)),
    ("gather", {"input": T1, "outputs": [T2], "root": 1}, ("a rank of this group is 0 to 0",)),
    ("gather", {"input": tensor(99), "outputs": [T2], "root": 0}, ("not held by this worker",)),
    ("gather", {"input": T1, "outputs": "T2", "root": 0}, ("tensors are a list",)),
    ("scatter", {"output": T2, "inputs": [SHORT_T], "root": 0}, ("shape [3]",)),
    ("scatter", {"output": T2, "inputs": [], "root": 0}, ("one per rank", "not 0")),
    ("scatter", {"output": T2, "inputs": [T1], "root": -1}, ("a rank of this group",)),
    ("reduce", {"tensors": [T2, T2], "root": 0, "op": "sum"}, ("reduce takes one tensor",)),
    ("reduce", {"tensors": [T2], "root": 5, "op": "sum"}, ("a rank of this group",)),
    ("reduce", {"tensors": [T2], "root": 0, "op": "premul_sum"}, ("unknown reduce op",)),
    ("all_to_all", {"outputs": [T2], "inputs": []}, ("1 inputs and 1 outputs",)),
    ("all_to_all", {"outputs": [LONG_T], "inputs": [T1]}, ("one dtype",)),
]


@pytest.mark.parametrize(("action", "body", "words"), ATTACKS)
def test_a_rooted_collective_that_lies_about_its_tensors_is_refused_naming_it(
    raw: tuple[Raw, str], action: str, body: dict[str, Any], words: tuple[str, ...]
) -> None:
    client, group = raw
    client.send([[Rec.DIST, action, group, body]])
    message = refused(client, f"torch.distributed {action}", f"{action} failed on rank 0", *words)
    assert "lease-collective-attack" in message
    assert client.read_floats(FLOAT16) == [0.0] * 16, "a refused collective wrote its output"


def test_the_same_collectives_with_true_tensors_run(raw: tuple[Raw, str]) -> None:
    """The checks refuse only lies: each collective of one rank copies or reduces as it
    should."""
    client, group = raw
    client.send([[Rec.DIST, "gather", group, {"input": T1, "outputs": [T2], "root": 0}]])
    assert client.read_floats(FLOAT16) == INTACT
    client.run("aten::zeros", [[16]], {"dtype": ext(Ext.DTYPE, "float32")}, [5])
    client.send([[Rec.DIST, "scatter", group, {"output": tensor(5), "inputs": [T1], "root": 0}]])
    assert client.read_floats(5) == INTACT
    client.send([[Rec.DIST, "reduce", group, {"tensors": [T2], "root": 0, "op": "avg"}]])
    assert client.read_floats(FLOAT16) == INTACT
    client.run("aten::zeros", [[16]], {"dtype": ext(Ext.DTYPE, "float32")}, [6])
    client.send([[Rec.DIST, "all_to_all", group, {"outputs": [tensor(6)], "inputs": [T1]}]])
    assert client.read_floats(6) == INTACT
    assert client.sync()[0] == Kind.RESULT


def test_a_rank_that_passes_a_root_list_it_is_not_owed_fails_its_peers_at_once() -> None:
    """Rank 1 passes outputs to a gather rooted at rank 0: refused on its worker, which
    leaves the group; rank 0's worker, waiting in the gather, fails as its connections
    close, well before the group's 300 s timeout (the client's socket gives up at 30)."""
    workers: list[WorkerHandle] = [start_lease_worker("lease-pair") for _ in range(2)]
    clients: list[Raw] = []
    try:
        introduce(workers)
        clients = [lease_client(w) for w in workers]
        group = uuid.uuid4().hex
        for rank, client in enumerate(clients):
            make_tensors(client)
            join(client, group, rank, 2, workers[0].address)
        root, other = clients
        root.send([[Rec.DIST, "gather", group, {"input": T1, "outputs": [T2, T2], "root": 0}]])
        other.send([[Rec.DIST, "gather", group, {"input": T1, "outputs": [T2], "root": 0}]])
        refused(other, "only the root (rank 0)", "rank 1 of 2")
        refused(root, "gather failed on rank 0 of 2")
        assert [c.read_floats(1) for c in clients] == [INTACT, INTACT]
    finally:
        for client in clients:
            client.close()
        for worker in workers:
            worker.stop()
