"""A CUDA worker's memory, against a hostile client over raw frames: device memory held by the
caching allocator's fraction (an over-limit resize_ fails inside the op), host memory by the
lease's host allowance (host tensors its ops make counted, what does not fit refused, a huge
transfer refused before anything is allocated)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gpupool.protocol.v1.dataplane import Kind, Rec
from gpupool.protocol.v1.tensors import DTYPE_EXT, HOST_DEVICE_EXT, REMOTE_DEVICE_EXT, handle_ext
from tests.worker import test_memory_attacks as attacks
from tests.worker.test_memory_attacks import Client, GiB, MiB, WorkerProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

F32 = DTYPE_EXT[torch.float32]
LIMIT_MIB = 256
HOST_LIMIT_MIB = 128


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with attacks.running_worker(
        device="cuda:0", memory_limit_mib=LIMIT_MIB, host_memory_limit_mib=HOST_LIMIT_MIB
    ) as running:
        yield running


@pytest.fixture
def client(worker: WorkerProcess) -> Iterator[Client]:
    with attacks.session(worker) as c:
        yield c


def host_held(client: Client) -> int:
    return int(client.stats()["host_memory_held_bytes"])


def test_host_tensors_a_cuda_workers_ops_make_count_against_the_host_allowance(
    client: Client,
) -> None:
    assert client.stats()["host_memory_limit_bytes"] == HOST_LIMIT_MIB * MiB
    client.op(1, [[16 * MiB]], 20, dtype=F32, device=HOST_DEVICE_EXT)  # 64 MiB on the host
    assert host_held(client) == 64 * MiB
    client.op(1, [[16 * MiB]], 21, dtype=F32, device=HOST_DEVICE_EXT)  # 128: the whole
    client.op(1, [[1]], 22, dtype=F32, device=HOST_DEVICE_EXT)  # one float more: refused
    client.expect_oom()
    assert host_held(client) == 128 * MiB
    client.batch([[Rec.FREE, 20], [Rec.FREE, 21]])
    assert host_held(client) == 0
    attacks.intact(client)


def test_device_growth_past_the_limit_fails_inside_the_op(client: Client) -> None:
    client.op(1, [[4]], 30, dtype=F32, device=REMOTE_DEVICE_EXT)
    client.op(2, [handle_ext(30), [GiB // 4]], None)
    client.expect_oom()
    assert client.read_floats(30) == [1.0] * 4
    attacks.intact(client)


def test_a_huge_transfer_to_a_cuda_worker_is_refused_without_allocating(
    worker: WorkerProcess, client: Client
) -> None:
    peak = worker.peak_rss_bytes()
    conn = attacks.peer(worker)
    try:
        conn.send([Kind.TRANSFER, 7, "float32", [64 * GiB], 256 * GiB])
        client.batch([[Rec.RECV, 7, 100, F32, False]])
        assert "transfer 7" in client.expect_oom()
        assert worker.peak_rss_bytes() - peak < attacks.PEAK_GROWTH_BYTES
        assert host_held(client) == 0
        attacks.intact(client)
    finally:
        conn.close()
