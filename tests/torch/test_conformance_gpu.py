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
    recurrent_off_cudnn,
    recurrent_stacks,
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


def test_recurrent_stacks_on_a_cuda_worker_are_the_local_gpus_cudnn_bit_for_bit(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    """LSTM, GRU and RNN stacks run through cuDNN on the worker as on the local GPU: outputs,
    final states, every gradient (a retained graph's second backward too) and the output's
    strides are the local GPU's exactly."""
    local = local_cuda("recurrent_stacks", "cuda", tmp_path)
    attach_cuda(1)
    assert_bit_identical(local, recurrent_stacks("cuda"))


def assert_bit_identical(local: dict[str, Any], remote: dict[str, Any]) -> None:
    assert local.keys() == remote.keys()
    for key, expected in local.items():
        assert torch.equal(remote[key], expected), key


def test_recurrent_stacks_off_cudnn_and_under_autocast_are_the_local_gpus_bit_for_bit(
    attach_cuda: Callable[[int], None], tmp_path: Path
) -> None:
    """bfloat16 stacks and float32 ones with cuDNN off run ATen's fused cells step by step as a
    local GPU does; under autocast cuDNN runs in float16 as ATen's autocast kernel casts."""
    local = local_cuda("recurrent_off_cudnn", "cuda", tmp_path)
    attach_cuda(1)
    assert_bit_identical(local, recurrent_off_cudnn("cuda"))


def test_cudnn_rnn_layouts_are_what_the_gpus_cudnn_makes() -> None:
    """The client's layouts of `_cudnn_rnn` (gpupool.torch.rnn) against the op on this GPU:
    every output's shape and strides, the weight buffer's size included (the reserve is
    cuDNN's to size: the client describes it empty)."""
    _cuda_or_skip()
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(HERE.parents[1] / 'src')!r})\n"
        "from gpupool.torch import rnn\n"
        "aten = torch.ops.aten\n"
        "cases = [(2, 8, 6, 0, 2, False, True, True), (2, 8, 6, 4, 2, True, True, False),\n"
        "         (3, 5, 7, 0, 1, True, False, True), (1, 4, 3, 0, 3, False, True, False),\n"
        "         (0, 4, 3, 0, 2, True, True, True)]\n"
        "for mode, features, hidden, proj, layers, bidir, biases, batch_first in cases:\n"
        "    d = 2 if bidir else 1; g = rnn.CUDNN_GATES[mode]; out = proj or hidden\n"
        "    ws = []\n"
        "    for layer in range(layers):\n"
        "        inputs = features if layer == 0 else d * out\n"
        "        for _ in range(d):\n"
        "            ws += [torch.randn(g * hidden, inputs), torch.randn(g * hidden, out)]\n"
        "            ws += [torch.randn(g * hidden), torch.randn(g * hidden)] if biases else []\n"
        "            ws += [torch.randn(proj, hidden)] if proj else []\n"
        "    ws = [w.cuda() for w in ws]\n"
        "    x = torch.randn((3, 5, features) if batch_first else (5, 3, features)).cuda()\n"
        "    hx = torch.randn(layers * d, 3, out).cuda()\n"
        "    cx = torch.randn(layers * d, 3, hidden).cuda() if mode == 2 else None\n"
        "    stride0 = (4 if biases else 2) + (1 if proj else 0)\n"
        "    args = (x, ws, stride0, None, hx, cx, mode, hidden, proj, layers, batch_first,\n"
        "            0.0, True, bidir, [], None)\n"
        "    real = aten._cudnn_rnn.default(*args)\n"
        "    told = rnn._cudnn_rnn_layout(args, {}).items\n"
        "    for i, (r, t) in enumerate(zip(real, told)):\n"
        "        if i == 3: continue\n"
        "        assert (tuple(r.shape), r.stride(), r.dtype) == (t.shape, t.stride, t.dtype), (\n"
        "            mode, i, tuple(r.shape), r.stride(), t)\n"
        "print('layouts agree')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("GPUPOOL_TEST_WORKER_GPUS", "0")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "layouts agree" in done.stdout


def test_a_forged_cudnn_rnn_backward_is_refused_and_the_session_lives(
    attach_cuda: Callable[[int], None],
) -> None:
    """cuDNN's backward trusts its weight buffer and reserve: a weight buffer this worker did
    not make, or a reserve of another size, is refused at that op, and the tensors live on."""
    attach_cuda(1)
    aten = torch.ops.aten
    lstm = torch.nn.LSTM(4, 3).to("cuda")
    x = torch.randn(5, 2, 4).to("cuda")
    h0, c0 = torch.zeros(1, 2, 3).to("cuda"), torch.zeros(1, 2, 3).to("cuda")
    weights = [w.detach() for w in lstm._flat_weights]
    args = (x, weights, 4, None, h0, c0, 2, 3, 0, 1, False, 0.0, True, False, [], None)
    output, _, _, reserve, buffer = aten._cudnn_rnn.default(*args)
    grad = torch.ones_like(output)

    def backward(buffer: torch.Tensor, reserve: torch.Tensor) -> Any:
        return aten._cudnn_rnn_backward.default(
            x, weights, 4, buffer, h0, c0, output, grad, None, None, 2, 3, 0, 1, False, 0.0,
            True, False, [], None, reserve, [True, True, True, True],
        )  # fmt: skip

    dx = backward(buffer, reserve)[0]
    assert dx.cpu().shape == (5, 2, 4)
    forged_buffer = torch.zeros(4).to("cuda")
    with pytest.raises(RuntimeError, match="weight_buf was not made"):
        backward(forged_buffer, reserve)[0].cpu()
    with pytest.raises(RuntimeError, match="reserve"):
        backward(buffer, torch.zeros(16, dtype=torch.uint8).to("cuda"))[0].cpu()
    assert torch.equal(lstm(x)[0].cpu(), lstm(x)[0].cpu())
