"""On a machine with two GPUs: copies between the two CUDA workers of one lease go worker to
worker (SEND / RECV records), and give what the same program gives locally.

tests/torch/test_peer_copy.py covers the same path with two CPU workers. Here each worker
gets a GPU of its own, as an agent starts them (CUDA_VISIBLE_DEVICES names one GPU, the worker
runs on its cuda:0); the test process is a client without a GPU. Run with

    GPUPOOL_TEST_WORKER_DEVICE=cuda:0 CUDA_VISIBLE_DEVICES= pytest -m gpu <this file>

`GPUPOOL_TEST_PEER_GPUS` (default `0,1`) names the two GPUs. That the bytes went worker to
worker is shown as in the CPU tests: the client never read the source device (its stream's
round trips did not change), and `dispatch.direct_copy` chose the direct path.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_workers import TOKEN, WORKER_DEVICE, WorkerHandle, cuda_device_count, start_worker

import gpupool.torch
from gpupool.torch import dispatch, runtime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    # Each transport starts two CUDA workers in its first test.
    *([pytest.mark.timeout(300)] if importlib.util.find_spec("pytest_timeout") else []),
]

LEASE = "lease-peer-gpu"
GPUS = [g.strip() for g in os.environ.get("GPUPOOL_TEST_PEER_GPUS", "0,1").split(",") if g.strip()]
RTOL, ATOL = 1e-4, 1e-5
"""float32 on the GPU against float32 on this process's CPU (as tests/torch/test_conformance.py
compares CPU workers with local CPU runs): the same arithmetic, summed in another order."""


def _two_gpus_or_skip() -> None:
    if not WORKER_DEVICE.startswith("cuda"):
        pytest.skip("GPUPOOL_TEST_WORKER_DEVICE is not cuda: test_peer_copy.py covers CPU workers")
    if len(GPUS) < 2:
        pytest.skip(f"GPUPOOL_TEST_PEER_GPUS names {len(GPUS)} GPU(s), two are needed")
    # This process runs with CUDA_VISIBLE_DEVICES= (a client without a GPU): ask a child that
    # sees the GPUs the workers will get. `0,0` puts both workers on one GPU (two processes,
    # two CUDA contexts: the copies still go worker to worker), for a one-GPU machine.
    distinct = list(dict.fromkeys(GPUS[:2]))
    visible = ",".join(distinct)
    count, why = cuda_device_count(visible)
    if count < len(distinct):
        pytest.skip(f"needs two CUDA GPUs, CUDA_VISIBLE_DEVICES={visible} shows {count}{why}")


@pytest.fixture(scope="module", params=["tcp", "unix"])
def gpu_workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerHandle]]:
    """Two CUDA workers of one lease, one GPU each, both over TCP or both over Unix sockets."""
    _two_gpus_or_skip()
    if request.param == "tcp":
        listen = ["tcp://127.0.0.1:0"] * 2
    else:
        sock = tmp_path_factory.mktemp("peer-sock")
        listen = [f"unix:{sock}/w{i}.sock" for i in range(2)]
    started: list[WorkerHandle] = []
    try:
        for gpu, address in zip(GPUS[:2], listen, strict=True):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("GPUPOOL_TEST_WORKER_GPUS", gpu)  # start_worker's CUDA_VISIBLE_DEVICES
                started.append(start_worker(LEASE, listen=address))
        yield started
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture
def two_gpus(gpu_workers: list[WorkerHandle]) -> Iterator[None]:
    """cuda:0 and cuda:1 of this process are the two workers; the copies go directly."""
    gpupool.torch.attach(workers=[w.address for w in gpu_workers], token=TOKEN, lease=LEASE)
    try:
        source, target = runtime.stream(0), runtime.stream(1)
        if WORKER_DEVICE.startswith("cuda"):
            assert source.is_cuda_worker and target.is_cuda_worker
        assert dispatch.direct_copy(source, target), "the copies would go through the client"
        yield
    finally:
        gpupool.torch.detach()


def _reads(index: int) -> int:
    """Requests that waited for cuda:<index>'s worker: a copy through the client reads."""
    return runtime.stream(index).round_trips


def test_to_another_gpu_goes_worker_to_worker(two_gpus: None) -> None:
    host = torch.randn(64, 32)
    a = host.cuda(0)
    before = _reads(0), _reads(1)
    b = a.to("cuda:1")
    c = a.t().to("cuda:1", dtype=torch.float64)  # a strided source, and a cast on arrival
    d = (a * 2).to("cuda:1").mul_(3)  # the received tensor is an ordinary one
    e = a[::2, 3:7].to("cuda:1")  # a view with an offset
    assert (_reads(0), _reads(1)) == before  # nobody waited: no read, no sync
    assert b.device == torch.device("cuda", 1) and c.dtype == torch.float64
    assert c.is_contiguous() and c.shape == (32, 64)
    assert torch.equal(b.cpu(), host)
    assert torch.equal(c.cpu(), host.t().double())
    assert torch.equal(d.cpu(), (host * 2) * 3)
    assert torch.equal(e.cpu(), host[::2, 3:7])
    back = b.to("cuda:0")  # and the other way
    assert torch.equal(back.cpu(), host)
    assert _reads(0) == before[0] + 1  # only `back` was read from cuda:0


def test_copy_into_a_tensor_on_another_gpu(two_gpus: None) -> None:
    host = torch.arange(12.0).reshape(3, 4)
    a = host.cuda(0)
    same = torch.zeros(3, 4, device="cuda:1", dtype=torch.float64)
    wider = torch.zeros(2, 3, 4, device="cuda:1")
    half = torch.zeros(3, 4, device="cuda:1", dtype=torch.float16)
    before = _reads(0)
    same.copy_(a)
    wider.copy_(a)  # broadcast on arrival, as copy_ does
    half.copy_(a)
    assert _reads(0) == before
    assert torch.equal(same.cpu(), host.double())
    assert torch.equal(wider.cpu(), host.expand(2, 3, 4))
    assert torch.equal(half.cpu(), host.half())
    into0 = torch.full((3, 4), -1.0, device="cuda:0")
    before = _reads(1)
    into0.copy_(wider[1] * 2)  # a view, from cuda:1 into cuda:0
    assert _reads(1) == before
    assert torch.equal(into0.cpu(), host * 2)


def test_gradients_flow_back_across_gpus(two_gpus: None) -> None:
    """Backward of .to("cuda:1") is a copy back to cuda:0: the same path the other way."""
    w = torch.randn(5, 5, device="cuda:0", requires_grad=True)
    before = _reads(0)
    y = (w.to("cuda:1") * 2).sum()
    y.backward()
    assert _reads(0) == before
    assert w.grad is not None and w.grad.device == torch.device("cuda", 0)
    assert torch.equal(w.grad.cpu(), torch.full((5, 5), 2.0))


def _train_split(devices: tuple[str, str], steps: int = 5) -> dict[str, torch.Tensor]:
    """A small model with its first half on devices[0] and its head on devices[1], trained
    with SGD with momentum: activations cross forward, their gradients cross back. Reads
    nothing until the end; the losses stay on devices[1] until then."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU()).to(devices[0])
    second = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(devices[1])
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    x0, y1 = x.to(devices[0]), y.to(devices[1])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        hidden = first(x0)
        loss = F.cross_entropy(second(hidden.to(devices[1])), y1)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "hidden": first(x0).detach().to(devices[1]),
        **{f"first.{k}": v.detach() for k, v in first.state_dict().items()},
        **{f"second.{k}": v.detach() for k, v in second.state_dict().items()},
    }


def test_a_model_split_over_two_gpus_trains_as_locally(two_gpus: None) -> None:
    local = _train_split(("cpu", "cpu"))
    before = _reads(0)
    remote = _train_split(("cuda:0", "cuda:1"))
    assert _reads(0) == before, "the activations and gradients crossed through the client"
    assert remote["first.0.weight"].device == torch.device("cuda", 0)
    assert remote["second.0.weight"].device == torch.device("cuda", 1)
    assert remote["hidden"].device == torch.device("cuda", 1)
    assert local.keys() == remote.keys()
    for key, expected in local.items():
        got = remote[key].cpu()
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        torch.testing.assert_close(
            got, expected, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert not torch.equal(local["losses"][0], local["losses"][-1]), "the model did not train"


def test_a_64_mib_tensor_crosses_in_chunks(two_gpus: None) -> None:
    """Larger than a frame's chunk (8 MiB) many times over: 64 MiB, and a view whose last
    chunk is a short one."""
    host = torch.randn(4096, 4096)  # 64 MiB of float32
    assert host.numel() * host.element_size() == 64 << 20
    a = host.cuda(0)
    before = _reads(0)
    b = a.to("cuda:1")
    tail = a[1:].to("cuda:1")  # 64 MiB less one row: the last chunk is short
    into = torch.empty(4096, 4096, device="cuda:0")
    into.copy_(b.neg())  # and back, into an existing tensor
    assert _reads(0) == before
    assert torch.equal(b.cpu(), host)
    assert torch.equal(tail.cpu(), host[1:])
    assert torch.equal(into.cpu(), host.neg())
