"""Real CPU worker processes on loopback: started by the fixtures in conftest.py and by tests
that need workers of their own (a module of its own: `from conftest import` would find
whichever conftest.py pytest imported first)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from gpupool.cli.local import stop_process
from gpupool.protocol.v1.dataplane import (
    WorkerCredentials,
    parse_address,
    send_control,
    start_worker_process,
)
from tests.timing import scaled

TOKEN = "test-token"
PEER_SECRET = "test-peer-secret"
"""The workers of one lease know each other by this (an agent gets the controller's)."""
WORKER_DEVICE = os.environ.get("GPUPOOL_TEST_WORKER_DEVICE", "cpu")
"""cpu in CI; on a GPU machine `GPUPOOL_TEST_WORKER_DEVICE=cuda:0` runs the workers on the GPU
(`GPUPOOL_TEST_WORKER_GPUS` is their CUDA_VISIBLE_DEVICES, default 0) while the test process
itself runs with CUDA_VISIBLE_DEVICES="", as a client without a GPU."""


@dataclass
class WorkerHandle:
    lease: str
    address: str
    proc: subprocess.Popen[str]
    control: str = ""
    """The worker's control secret, as its agent would hold it."""

    def stop(self) -> None:
        stop_process(self.proc)


def introduce(workers: list[WorkerHandle]) -> None:
    """Name each worker its lease's others, as their agent does: the only peers it sends to."""
    for worker in workers:
        send_control(
            parse_address(worker.address),
            worker.lease,
            worker.control,
            {"op": "peers", "endpoints": [w.address for w in workers]},
        )


def start_worker(lease: str, listen: str = "tcp://127.0.0.1:0", **options: object) -> WorkerHandle:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if WORKER_DEVICE != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("GPUPOOL_TEST_WORKER_GPUS", "0")
    options.setdefault("device", WORKER_DEVICE)
    options.setdefault("ready_timeout_s", scaled(120))
    credentials = WorkerCredentials.generate(TOKEN, PEER_SECRET)
    proc, ready = start_worker_process(
        lease, credentials, env=env, listen=listen, threads=1, **options
    )
    return WorkerHandle(lease, str(ready.address), proc, credentials.control)


def cuda_device_count(visible: str) -> tuple[int, str]:
    """How many CUDA GPUs a child process sees with CUDA_VISIBLE_DEVICES=`visible`, and why
    none where it failed. GPU tests run their own process as a client without a GPU
    (CUDA_VISIBLE_DEVICES=), so they ask a child what their workers will get."""
    import os
    import subprocess
    import sys

    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": visible},
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    lines = probe.stdout.split()
    count = int(lines[-1]) if probe.returncode == 0 and lines and lines[-1].isdigit() else 0
    why = f" ({(probe.stderr.strip().splitlines() or ['?'])[-1]})" if probe.returncode else ""
    return count, why
