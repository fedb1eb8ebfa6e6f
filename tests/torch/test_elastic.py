"""Swap-out, restore and migration in the middle of a training loop change nothing but time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_workers import PEER_SECRET, TOKEN, WorkerHandle, start_worker

import gpupool.torch
from gpupool.protocol.v1.dataplane import (
    VERSION,
    Connection,
    Kind,
    Role,
    connect,
    parse_address,
    recv_handshake,
    send_handshake,
)
from gpupool.torch import runtime
from gpupool.worker.handoff import Offer, host_key
from tests.timing import scaled

pytestmark = pytest.mark.slow
LEASE = "lease-elastic"


class Net(nn.Module):
    """Convolution, batch norm (running stats), dropout (the device RNG) and Adam state."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.head(self.drop(x.flatten(1)))


def train(
    device: str, steps: int, pause_at: int | None, pause: Callable[[], None]
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(steps)]  # fmt: skip
    if device != "cpu":
        torch.cuda.manual_seed(5)
    losses = []
    for step, (x, y) in enumerate(data):
        if step == pause_at:
            pause()
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {"losses": torch.tensor(losses), **weights}


def assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def started() -> Iterator[list[WorkerHandle]]:
    workers: list[WorkerHandle] = []
    yield workers
    gpupool.torch.detach()
    for worker in workers:
        worker.stop()


def attach_to(worker: WorkerHandle) -> None:
    torch.set_num_threads(1)
    gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease=LEASE)


def uninterrupted(started: list[WorkerHandle]) -> dict[str, Any]:
    worker = start_worker(LEASE)
    started.append(worker)
    attach_to(worker)
    result = train("cuda", 8, None, lambda: None)
    gpupool.torch.detach()
    return result


def test_swap_out_and_restore_mid_training_gives_the_same_weights(
    started: list[WorkerHandle],
) -> None:
    expected = uninterrupted(started)
    worker = start_worker(LEASE, idle_timeout_s=0.3)
    started.append(worker)
    attach_to(worker)
    stream = runtime.stream(0)

    def idle_until_swapped() -> None:
        wait_until(lambda: stream.elastic.swapped, "the idle client to be swapped out")

    result = train("cuda", 8, 4, idle_until_swapped)
    assert stream.elastic.swaps >= 1 and stream.elastic.resumes >= 1
    assert_equal(result, expected)


def attached_to_a_new_worker(started: list[WorkerHandle]) -> tuple[WorkerHandle, Any]:
    """A fresh worker of the lease, this process attached to it, and its device stream."""
    worker = start_worker(LEASE)
    started.append(worker)
    attach_to(worker)
    return worker, runtime.stream(0)


@pytest.mark.parametrize(
    ("paths", "expected_path"),
    [(None, "shm"), (("stream",), "stream")],
    ids=["same-host-shared-memory", "chunked-stream"],
)
def test_migration_to_a_successor_worker_mid_training_gives_the_same_weights(
    started: list[WorkerHandle], paths: tuple[str, ...] | None, expected_path: str
) -> None:
    expected = uninterrupted(started)
    first, stream = attached_to_a_new_worker(started)

    def migrate() -> None:
        second = start_worker(LEASE, restore_from=first.address, handoff_paths=paths)
        started.append(second)
        wait_until(lambda: stream.elastic.moves == 1, "the client to follow its state")
        assert str(stream.address) == second.address
        assert stream.elastic.last_path == expected_path

    result = train("cuda", 8, 4, migrate)
    assert_equal(result, expected)


def cut_off_successor(address: str) -> None:
    """A successor that registers, takes the first chunk of the state and hangs up."""
    sock = connect(parse_address(address))
    hello = {"v": VERSION, "lease": LEASE, "token": PEER_SECRET, "role": Role.SUCCESSOR}
    send_handshake(sock, [Kind.HELLO, hello])
    assert recv_handshake(sock).head[0] == Kind.WELCOME
    conn = Connection(sock)
    offer = Offer("tcp://127.0.0.1:9", host_key(), "cpu", (), ("stream",))
    conn.send([Kind.CONTROL, 1, offer.to_wire()])
    assert conn.recv().head()[0] == Kind.STATE
    frame = conn.recv()
    assert frame.head()[0] == Kind.PUT
    conn.close()


def test_a_handoff_cut_off_halfway_leaves_the_client_on_its_worker_with_nothing_lost(
    started: list[WorkerHandle],
) -> None:
    expected = uninterrupted(started)
    first, stream = attached_to_a_new_worker(started)

    def cut_then_migrate() -> None:
        cutter = threading.Thread(target=cut_off_successor, args=(first.address,))
        cutter.start()
        wait_until(lambda: stream.elastic.resumes >= 1 and not cutter.is_alive(), "the cut")
        cutter.join()
        assert stream.elastic.moves == 0 and str(stream.address) == first.address
        # The predecessor kept the state: a successor that comes next takes it over.
        second = start_worker(LEASE, restore_from=first.address, handoff_paths=("stream",))
        started.append(second)
        wait_until(lambda: stream.elastic.moves == 1, "the client to follow its state")

    result = train("cuda", 8, 4, cut_then_migrate)
    assert_equal(result, expected)
