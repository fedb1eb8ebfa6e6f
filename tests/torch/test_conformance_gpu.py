"""On the GPU machine: the conformance programs on real CUDA workers give what the same
programs give on the local GPU.

Run with `GPUPOOL_TEST_WORKER_DEVICE=cuda:0 CUDA_VISIBLE_DEVICES= pytest -m gpu ...`: the test
process is a client without a GPU, its workers get the GPU (GPUPOOL_TEST_WORKER_GPUS, default
0), and the local baseline runs in a child process that sees the same GPU. Both sides run the
same CUDA kernels (the worker receives convolution, batch norm and attention whole), so the
tolerances are tighter than the CPU suite's CPU-against-remote comparison.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_programs import (
    checkpoint_resume,
    cnn_training,
    encoder_bf16,
    mlp_training,
    resnet_bf16,
    transformer_bf16,
    two_device_pipeline,
)
from test_conformance import assert_same

from tests.torch.conftest import TOKEN, WORKER_DEVICE, WorkerHandle, start_worker

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

HERE = Path(__file__).resolve().parent


def _cuda_or_skip() -> None:
    if not WORKER_DEVICE.startswith("cuda"):
        pytest.skip("GPUPOOL_TEST_WORKER_DEVICE is not cuda: the CPU suite covers CPU workers")


@pytest.fixture(scope="module")
def cuda_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerHandle]]:
    _cuda_or_skip()
    sock = tmp_path_factory.mktemp("gpu-sock") / "w.sock"
    started = [
        start_worker("lease-gpu"),
        start_worker("lease-gpu", listen=f"unix:{sock}"),
    ]
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def attach_cuda(cuda_workers: list[WorkerHandle]) -> Iterator[Callable[[int], None]]:
    import gpupool.torch

    def _attach(n: int = 1) -> None:
        gpupool.torch.attach(
            workers=[w.address for w in cuda_workers[:n]], token=TOKEN, lease="lease-gpu"
        )

    yield _attach
    gpupool.torch.detach()


def local_cuda(program: str, arg: str, tmp_path: Path) -> Any:
    """Run conformance_programs.<program>(arg) on this machine's real GPU, in a child."""
    out = tmp_path / f"{program}.pt"
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import conformance_programs as p\n"
        f"arg = {arg!r}\n"
        "arg = tuple(arg.split(',')) if ',' in arg else arg\n"
        f"torch.save(getattr(p, {program!r})(arg), {str(out)!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("GPUPOOL_TEST_WORKER_GPUS", "0")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600)
    return torch.load(out, weights_only=False)


def test_mlp_on_a_cuda_worker_matches_the_local_gpu(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    local = local_cuda("mlp_training", "cuda", tmp_path)
    attach_cuda(1)
    assert_same(local, mlp_training("cuda"), rtol=1e-5, atol=1e-6)


def test_cnn_with_batch_norm_on_a_cuda_worker_matches_the_local_gpu(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    local = local_cuda("cnn_training", "cuda", tmp_path)
    attach_cuda(1)
    assert_same(local, cnn_training("cuda"), rtol=1e-4, atol=1e-5)


def test_transformer_bf16_on_a_cuda_worker_matches_the_local_gpu(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    local = local_cuda("transformer_bf16", "cuda", tmp_path)
    attach_cuda(1)
    remote = transformer_bf16("cuda")
    assert bool(remote["logits_bf16"])
    assert_same(local, remote, rtol=1e-2, atol=1e-2)


def test_pytorch_transformer_encoder_bf16_on_a_cuda_worker_matches_the_local_gpu(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    local = local_cuda("encoder_bf16", "cuda", tmp_path)
    attach_cuda(1)
    assert_same(local, encoder_bf16("cuda"), rtol=1e-2, atol=1e-2)


def test_residual_cnn_bf16_on_a_cuda_worker_matches_the_local_gpu(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    local = local_cuda("resnet_bf16", "cuda", tmp_path)
    attach_cuda(1)
    assert_same(local, resnet_bf16("cuda"), rtol=1e-2, atol=1e-2)


def test_checkpoint_on_a_cuda_worker_matches_the_local_gpu(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    local = local_cuda("checkpoint_resume", "cuda", tmp_path)
    attach_cuda(1)
    remote = checkpoint_resume("cuda")
    assert bool(remote["state_on_device"])
    assert_same(local["resumed"], remote["resumed"], rtol=1e-5, atol=1e-6)
    import gpupool.torch

    gpupool.torch.detach()
    state = torch.load(io.BytesIO(remote["checkpoint"]), map_location="cpu")
    assert state["step"] == 3


def test_a_model_split_over_two_cuda_workers_matches_the_local_gpu(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    local = local_cuda("two_device_pipeline", "cuda:0,cuda:0", tmp_path)
    attach_cuda(2)
    remote = two_device_pipeline(("cuda:0", "cuda:1"))
    assert remote["placed"] == ("cuda:0", "cuda:1")
    del local["placed"], remote["placed"]
    assert_same(local, remote, rtol=1e-5, atol=1e-6)
