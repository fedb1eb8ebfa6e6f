"""Real CPU worker processes on loopback, and a process attached to them as its cuda devices."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from torch_workers import TOKEN, WORKER_DEVICE, WorkerHandle, introduce, start_worker

__all__ = ["TOKEN", "WORKER_DEVICE", "WorkerHandle", "introduce", "start_worker"]


@pytest.fixture(scope="session")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerHandle]]:
    """Two CPU workers of one lease (cuda:0 over TCP, cuda:1 over a Unix socket)."""
    sock = tmp_path_factory.mktemp("sock") / "w1.sock"
    started = [start_worker("lease-t"), start_worker("lease-t", listen=f"unix:{sock}")]
    introduce(started)
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def attach(workers: list[WorkerHandle]) -> Iterator[Callable[..., list[object]]]:
    """attach(n=1): this process sees n remote GPUs until the test ends."""
    import torch

    import gpupool.torch

    torch.set_num_threads(1)

    def _attach(n: int = 1) -> list[object]:
        return list(
            gpupool.torch.attach(
                workers=[w.address for w in workers[:n]], token=TOKEN, lease="lease-t"
            )
        )

    yield _attach
    gpupool.torch.detach()


@pytest.fixture
def worker_factory(tmp_path: Path) -> Iterator[Callable[..., WorkerHandle]]:
    started: list[WorkerHandle] = []

    def _start(lease: str = "lease-x", **options: object) -> WorkerHandle:
        worker = start_worker(lease, **options)
        started.append(worker)
        return worker

    yield _start
    for worker in started:
        worker.stop()
