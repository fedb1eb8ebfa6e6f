"""On the GPU machine: a client op that trips a device-side assert breaks the worker's CUDA
context for good. The client learns it at its next read, with CUDA's reason; the worker keeps
serving it until it leaves, then ends with WORKER_EXIT_DEVICE_BROKEN, and the agent reports
that worker as ended by the client's error.

tests/worker/test_worker_process.py covers the same path without a GPU (a reset that fails
as a broken context does, and the agent's text for that exit status). Run with

    GPUPOOL_TEST_WORKER_DEVICE=cuda:0 CUDA_VISIBLE_DEVICES= pytest -m gpu <this file>

the test process a client without a GPU, its worker on GPUPOOL_TEST_WORKER_GPUS (default 0).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpupool.torch
from gpupool.agent.workers import Worker as AgentWorker
from gpupool.cli.local import stop_process
from gpupool.protocol.v1.dataplane import WORKER_EXIT_DEVICE_BROKEN, start_worker_process
from tests.torch.torch_workers import cuda_device_count

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    *([pytest.mark.timeout(300)] if importlib.util.find_spec("pytest_timeout") else []),
]

WORKER_DEVICE = os.environ.get("GPUPOOL_TEST_WORKER_DEVICE", "cpu")
TOKEN = "sticky-test-token"
LEASE = "lease-sticky"
EXIT_WITHIN_S = 30.0


def _gpu_or_skip() -> str:
    """The GPU the worker gets (its CUDA_VISIBLE_DEVICES), or skip where there is none."""
    if not WORKER_DEVICE.startswith("cuda"):
        pytest.skip("GPUPOOL_TEST_WORKER_DEVICE is not cuda: a CPU worker has no sticky errors")
    gpu = os.environ.get("GPUPOOL_TEST_WORKER_GPUS", "0").split(",")[0]
    count, why = cuda_device_count(gpu)
    if count < 1:
        pytest.skip(f"needs a CUDA GPU, CUDA_VISIBLE_DEVICES={gpu} shows none{why}")
    return gpu


@pytest.fixture
def cuda_worker(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """One CUDA worker (over TCP or a Unix socket, `request.param`) with a status file."""
    gpu = _gpu_or_skip()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": gpu}
    with tempfile.TemporaryDirectory(prefix="gpupool-sticky-") as scratch:
        listen = "tcp://127.0.0.1:0" if request.param == "tcp" else f"unix:{scratch}/w.sock"
        status = Path(scratch) / "status.json"
        proc, ready = start_worker_process(
            LEASE,
            TOKEN,
            env=env,
            listen=listen,
            threads=1,
            device=WORKER_DEVICE,
            status_file=status,
        )
        try:
            assert ready.device.startswith("cuda"), ready.device
            yield proc, str(ready.address), status
        finally:
            stop_process(proc)  # nothing to do when the test saw it end


@pytest.mark.parametrize(
    ("cuda_worker", "bad_op"),
    [("tcp", "advanced indexing"), ("unix", "index_select")],
    indirect=["cuda_worker"],
)
def test_a_device_side_assert_is_reported_and_ends_the_worker_after_the_client(
    cuda_worker: tuple[subprocess.Popen[str], str, Path], bad_op: str
) -> None:
    proc, address, status = cuda_worker
    gpupool.torch.attach(workers=[address], token=TOKEN, lease=LEASE)
    try:
        x = torch.arange(4.0, device="cuda")
        assert x.sum().item() == 6.0, "the worker works before the bad op"
        index = torch.tensor([7], device="cuda")  # out of bounds: caught only on the device
        bad = x[index] if bad_op == "advanced indexing" else torch.index_select(x, 0, index)
        # The op streamed without an answer; the next read says why it failed.
        with pytest.raises(RuntimeError, match="device-side assert triggered"):
            bad.cpu()
        # Sticky: the context is gone, every later op on this worker fails too.
        with pytest.raises(RuntimeError, match="CUDA error"):
            torch.ones(2, device="cuda").sum().item()
        assert proc.poll() is None, "the worker ends only once its client has left"
    finally:
        gpupool.torch.detach()
    try:
        code = proc.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker still runs {EXIT_WITHIN_S:g} s after its client left")
    assert code == WORKER_EXIT_DEVICE_BROKEN

    # What the agent says of that worker in its heartbeat.
    agent_view = AgentWorker(
        lease_id=LEASE, gpu_uuid="GPU-test", proc=proc, endpoint=address, status_file=status
    )
    report = agent_view.report()
    assert not report.alive and report.endpoint is None
    assert report.error is not None and "the client's error left the GPU context unusable" in (
        report.error
    )
