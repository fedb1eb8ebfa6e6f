"""Real CPU worker processes on loopback, and a process attached to them as its cuda devices."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpupool.protocol.v1.dataplane import start_worker_process

TOKEN = "test-token"
WORKER_DEVICE = os.environ.get("GPUPOOL_TEST_WORKER_DEVICE", "cpu")
"""cpu in CI; on a GPU machine `GPUPOOL_TEST_WORKER_DEVICE=cuda:0` runs the workers on the GPU
(`GPUPOOL_TEST_WORKER_GPUS` is their CUDA_VISIBLE_DEVICES, default 0) while the test process
itself runs with CUDA_VISIBLE_DEVICES="", as a client without a GPU."""


@dataclass
class WorkerHandle:
    lease: str
    address: str
    proc: subprocess.Popen[str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_worker(lease: str, listen: str = "tcp://127.0.0.1:0", **options: object) -> WorkerHandle:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if WORKER_DEVICE != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("GPUPOOL_TEST_WORKER_GPUS", "0")
    options.setdefault("device", WORKER_DEVICE)
    proc, ready = start_worker_process(lease, TOKEN, env=env, listen=listen, threads=1, **options)
    return WorkerHandle(lease, str(ready.address), proc)


@pytest.fixture(scope="session")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerHandle]]:
    """Two CPU workers of one lease (cuda:0 over TCP, cuda:1 over a Unix socket)."""
    sock = tmp_path_factory.mktemp("sock") / "w1.sock"
    started = [start_worker("lease-t"), start_worker("lease-t", listen=f"unix:{sock}")]
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
