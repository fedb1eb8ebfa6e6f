"""Copies between two devices of one lease go worker to worker (SEND / RECV records): the
client neither waits nor carries the bytes, and the results equal the copy through it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch_workers import TOKEN, WorkerHandle, introduce

import gpupool.torch
from gpupool.torch import dispatch, runtime

LEASE = "lease-peer"


@pytest.fixture(params=["tcp", "unix"])
def two_devices(
    request: pytest.FixtureRequest,
    worker_factory: Callable[..., WorkerHandle],
    tmp_path: Path,
) -> Iterator[None]:
    """cuda:0 and cuda:1 of one lease, both over TCP or both over Unix sockets."""
    listen = (
        ["tcp://127.0.0.1:0"] * 2
        if request.param == "tcp"
        else [f"unix:{tmp_path}/w{i}.sock" for i in range(2)]
    )
    workers = [worker_factory(LEASE, listen=address) for address in listen]
    introduce(workers)
    torch.set_num_threads(1)
    gpupool.torch.attach(workers=[w.address for w in workers], token=TOKEN, lease=LEASE)
    yield
    gpupool.torch.detach()


def _reads(index: int) -> int:
    return runtime.stream(index).round_trips


def test_to_another_device_goes_worker_to_worker(two_devices: Any) -> None:
    source, target = runtime.stream(0), runtime.stream(1)
    assert dispatch.direct_copy(source, target)
    host = torch.randn(64, 32)
    a = host.cuda(0)
    before = _reads(0), _reads(1)
    b = a.to("cuda:1")
    c = a.t().to("cuda:1", dtype=torch.float64)  # a strided source, and a cast on arrival
    d = (a * 2).to("cuda:1").mul_(3)  # the received tensor is an ordinary one
    assert (_reads(0), _reads(1)) == before  # nobody waited: no read, no sync
    assert b.device == torch.device("cuda", 1) and c.dtype == torch.float64
    assert c.is_contiguous() and c.shape == (32, 64)
    assert torch.equal(b.cpu(), host)
    assert torch.equal(c.cpu(), host.t().double())
    assert torch.equal(d.cpu(), host * 6)
    assert _reads(0) == before[0]  # the source device was never read


def test_copy_into_a_tensor_of_another_device(two_devices: Any) -> None:
    host = torch.arange(12.0).reshape(3, 4)
    a = host.cuda(0)
    same = torch.zeros(3, 4, device="cuda:1", dtype=torch.float64)
    wider = torch.zeros(2, 3, 4, device="cuda:1")
    before = _reads(0)
    same.copy_(a)
    wider.copy_(a)  # broadcast on arrival, as copy_ does
    assert _reads(0) == before
    assert torch.equal(same.cpu(), host.double())
    assert torch.equal(wider.cpu(), host.expand(2, 3, 4))


def test_gradients_flow_back_across_devices(two_devices: Any) -> None:
    """Backward of .to("cuda:1") is a copy back to cuda:0: the same path the other way."""
    w = torch.randn(5, 5, device="cuda:0", requires_grad=True)
    y = (w.to("cuda:1") * 2).sum()
    y.backward()
    assert w.grad is not None and w.grad.device == torch.device("cuda", 0)
    assert torch.equal(w.grad.cpu(), torch.full((5, 5), 2.0))


def test_a_failed_source_fails_the_copy_at_the_next_read(two_devices: Any) -> None:
    """An op that failed on cuda:0 before the copy: cuda:1 learns at once that nothing
    comes, and its next read says why (not after a timeout)."""
    a = torch.zeros(4, device="cuda:0")
    bad = a[torch.tensor([7], device="cuda:0")]  # out of bounds: fails on the worker
    moved = bad.to("cuda:1")
    with pytest.raises(RuntimeError, match="could not send"):
        moved.cpu()
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        bad.cpu()


def test_peer_copies_can_be_turned_off(two_devices: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUPOOL_PEER_COPY=0 (workers that cannot reach each other): through the client."""
    monkeypatch.setattr(dispatch, "PEER_COPY", False)
    assert not dispatch.direct_copy(runtime.stream(0), runtime.stream(1))
    host = torch.randn(8)
    a = host.cuda(0)
    before = _reads(0)
    b = a.to("cuda:1")
    assert _reads(0) == before + 1  # the client read it from cuda:0
    assert torch.equal(b.cpu(), host)
