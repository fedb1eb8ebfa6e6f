"""Real PyTorch programs give the same results locally and on gpupool remote GPUs (CPU workers)."""

from __future__ import annotations

import io
from collections.abc import Callable
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

pytestmark = pytest.mark.slow


def assert_same(local: dict[str, Any], remote: dict[str, Any], rtol: float, atol: float) -> None:
    assert local.keys() == remote.keys()
    for key, expected in local.items():
        got = remote[key]
        if isinstance(expected, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.device.type == "cpu", key
            assert got.dtype == expected.dtype and got.shape == expected.shape, key
            torch.testing.assert_close(
                got, expected, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}"
            )
        elif isinstance(expected, dict):
            assert_same(expected, got, rtol, atol)


def test_mlp_training_on_a_dataloader_matches_local(attach: Callable[..., Any]) -> None:
    local = mlp_training("cpu")
    attach()
    remote = mlp_training("cuda")
    assert_same(local, remote, rtol=1e-4, atol=1e-5)


def test_cnn_with_batch_norm_and_adam_matches_local(attach: Callable[..., Any]) -> None:
    local = cnn_training("cpu")
    attach()
    remote = cnn_training("cuda")
    assert_same(local, remote, rtol=1e-4, atol=1e-5)


def test_transformer_under_bf16_autocast_matches_local(attach: Callable[..., Any]) -> None:
    local = transformer_bf16("cpu")
    attach()
    remote = transformer_bf16("cuda")
    assert bool(remote["logits_bf16"]), "autocast('cuda', bfloat16) must give bf16 logits"
    # CPU and CUDA autocast keep different ops in float32 (CUDA: layer norm, softmax): bf16-level
    # agreement, on losses and on the trained weights.
    torch.testing.assert_close(remote["losses"], local["losses"], rtol=2e-2, atol=2e-2)
    for key in ("tok.weight", "blocks.0.qkv.weight", "blocks.1.mlp.2.weight", "ln.weight"):
        torch.testing.assert_close(remote[key], local[key], rtol=0, atol=2e-2)


def test_pytorch_transformer_encoder_under_bf16_autocast_matches_local(
    attach: Callable[..., Any],
) -> None:
    local = encoder_bf16("cpu")
    attach()
    remote = encoder_bf16("cuda")
    torch.testing.assert_close(remote["losses"], local["losses"], rtol=3e-2, atol=3e-2)
    assert remote["losses"][-1] < remote["losses"][0]
    for key, expected in local.items():
        if key != "losses":
            torch.testing.assert_close(remote[key], expected, rtol=0, atol=3e-2)


def test_residual_cnn_under_bf16_autocast_matches_local(attach: Callable[..., Any]) -> None:
    local = resnet_bf16("cpu")
    attach()
    remote = resnet_bf16("cuda")
    assert_same(local, remote, rtol=1e-2, atol=1e-2)


def test_checkpoint_saved_mid_training_resumes_to_the_same_weights(
    attach: Callable[..., Any],
) -> None:
    local = checkpoint_resume("cpu")
    attach()
    remote = checkpoint_resume("cuda")
    assert bool(remote["state_on_device"]), "torch.load puts cuda storages back on the remote GPU"
    assert_same(local["resumed"], remote["resumed"], rtol=1e-5, atol=1e-6)
    import gpupool.torch

    gpupool.torch.detach()
    # The checkpoint is an ordinary one whose tensors were on cuda:0: it loads anywhere.
    state = torch.load(io.BytesIO(remote["checkpoint"]), map_location="cpu")
    assert state["step"] == 3 and state["model"]["0.weight"].shape == (16, 8)


def test_a_model_split_over_two_remote_gpus_matches_local(attach: Callable[..., Any]) -> None:
    local = two_device_pipeline(("cpu", "cpu"))
    attach(2)
    assert torch.cuda.device_count() == 2
    remote = two_device_pipeline(("cuda:0", "cuda:1"))
    assert remote["placed"] == ("cuda:0", "cuda:1")
    del local["placed"], remote["placed"]
    assert_same(local, remote, rtol=1e-5, atol=1e-6)
