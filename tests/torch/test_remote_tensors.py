"""What a program sees of remote GPUs: torch.cuda, tensors, reads, errors, limits."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpupool.torch
from gpupool.torch import runtime
from tests.timing import scaled

pytestmark = pytest.mark.slow


def test_torch_cuda_reports_the_lease(attach: Callable[..., Any]) -> None:
    assert attach(2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert torch.cuda.is_available() and torch.cuda.device_count() == 2
    assert "gpupool worker" in torch.cuda.get_device_name(0)
    assert torch.cuda.get_device_properties(1).gpupool_lease == "lease-t"
    assert torch.cuda.current_device() == 0 and torch.cuda.is_bf16_supported()
    with torch.cuda.device(1):
        assert torch.zeros(2, device="cuda").device == torch.device("cuda", 1)
    assert torch.zeros(2, device="cuda").device == torch.device("cuda", 0)
    torch.cuda.synchronize()


def test_attach_raises_the_collectors_threshold_and_detach_puts_it_back(
    attach: Callable[..., Any],
) -> None:
    import gc

    from gpupool.startup import GC_YOUNG_THRESHOLD

    before = gc.get_threshold()
    if not 0 < before[0] < GC_YOUNG_THRESHOLD:
        pytest.skip(f"this process runs with threshold {before[0]}")
    attach()
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
    gpupool.torch.detach()
    assert gc.get_threshold() == before


def test_memory_allocated_follows_the_tensors_held(attach: Callable[..., Any]) -> None:
    attach()
    before = torch.cuda.memory_allocated()
    x = torch.empty(1024, 1024, device="cuda")
    assert torch.cuda.memory_allocated() - before == 4 * 1024 * 1024
    view = x[0]
    del x  # the view keeps the storage
    assert torch.cuda.memory_allocated() - before == 4 * 1024 * 1024
    del view
    assert torch.cuda.memory_allocated() == before


def test_ops_stream_without_waiting_and_only_reads_wait(attach: Callable[..., Any]) -> None:
    attach()
    stream = runtime.stream(0)
    x = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    waits = stream.round_trips
    for _ in range(300):
        x = x * 1.01 + 0.5
    assert stream.round_trips == waits, "ops must not wait for the worker"
    expected = torch.ones(8)
    for _ in range(300):
        expected = expected * 1.01 + 0.5
    torch.testing.assert_close(x.cpu(), expected)
    assert stream.round_trips == waits + 1


def test_reads_and_comparisons_give_host_values(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], device="cuda")
    assert x.device.type == "cuda" and x.is_cuda and x.get_device() == 0
    assert x.sum().item() == 6.0
    assert x.tolist() == [[1.0, -2.0], [3.0, 4.0]]
    assert bool((x > 3).any()) and not torch.equal(x, x + 1)
    assert "device='cuda:0'" in repr(x) and "4." in str(x)
    assert f"{x[1, 1]:.1f}" == "4.0"
    assert (x * torch.tensor(2.0)).cpu().tolist() == [[2.0, -4.0], [6.0, 8.0]]
    with pytest.raises(TypeError, match="numpy"):
        x.numpy()
    assert x.to("cuda") is x and x.cuda() is x and x.to(torch.device("cuda", 0)) is x


def test_data_dependent_shapes_come_back_from_the_worker(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.tensor([3.0, -1.0, 0.0, 5.0], device="cuda")
    assert x[x > 0].cpu().tolist() == [3.0, 5.0]
    assert torch.nonzero(x).cpu().flatten().tolist() == [0, 1, 3]
    assert torch.unique(torch.tensor([2, 1, 2], device="cuda")).cpu().tolist() == [1, 2]


def test_in_place_shape_changes_and_out_arguments_stay_consistent(
    attach: Callable[..., Any],
) -> None:
    attach()
    x = torch.arange(6.0, device="cuda")
    alias = x.detach()
    x.unsqueeze_(0)
    assert x.shape == (1, 6) and alias.shape == (6,)
    x.t_()
    assert x.shape == (6, 1) and x.cpu().flatten().tolist() == alias.cpu().tolist()
    out = torch.empty(0, device="cuda")
    torch.add(alias, 1, out=out)
    assert out.shape == (6,) and out.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_errors_of_streamed_ops_surface_at_the_next_read(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.arange(3.0, device="cuda")
    bad = torch.tensor([7], device="cuda")
    y = x[bad] * 2  # the worker fails here; the client does not wait to find out
    z = x + 1
    with pytest.raises((IndexError, RuntimeError), match="index 7 is out of bounds"):
        z.cpu()
    del y
    assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0], "the worker keeps serving after an error"


def test_manual_seed_makes_remote_randomness_repeatable(attach: Callable[..., Any]) -> None:
    attach()
    torch.manual_seed(123)
    a = torch.randn(5, device="cuda")
    d = F.dropout(torch.ones(20, device="cuda"), 0.5)
    torch.manual_seed(123)
    torch.testing.assert_close(torch.randn(5, device="cuda").cpu(), a.cpu())
    torch.testing.assert_close(F.dropout(torch.ones(20, device="cuda"), 0.5).cpu(), d.cpu())


def test_activation_checkpointing_replays_the_same_dropout(attach: Callable[..., Any]) -> None:
    from torch.utils.checkpoint import checkpoint

    attach()
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1)).cuda()
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(7)
        out = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        grads.append(grad.cpu())
    torch.testing.assert_close(grads[0], grads[1])
    state = torch.cuda.get_rng_state()
    first = torch.rand(3, device="cuda").cpu()
    torch.cuda.set_rng_state(state)
    torch.testing.assert_close(torch.rand(3, device="cuda").cpu(), first)


def test_composite_ops_reach_the_worker_whole(attach: Callable[..., Any]) -> None:
    attach()
    stream = runtime.stream(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.2)).cuda()
    model(torch.randn(2, 3, 8, 8, device="cuda")).sum().backward()
    q = torch.randn(1, 2, 8, 16, device="cuda", requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    torch.cuda.synchronize()
    names = stream.op_names()
    for whole in ("aten::convolution", "aten::_batch_norm_with_update", "aten::native_dropout",
                  "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"):  # fmt: skip
        assert whole in names
    assert "aten::_softmax" not in names and "aten::bernoulli_" not in names


@pytest.mark.parametrize("causal", [True, False])
def test_attention_by_the_math_kernel_equals_local_and_trains_with_dropout(
    attach: Callable[..., Any], causal: bool
) -> None:
    """With the fused kernels switched off (or attention dropout on a CPU worker) the math
    kernel runs; its boolean and causal masks once reached the worker on the meta device."""
    attach()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    mask = None if causal else torch.rand(6, 6, generator=g) > 0.3
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        got = F.scaled_dot_product_attention(
            q.cuda(), k.cuda(), v.cuda(),
            attn_mask=None if mask is None else mask.cuda(), is_causal=causal,
        )  # fmt: skip
    torch.testing.assert_close(got.cpu(), expected)
    qr = q.cuda().requires_grad_()
    out = F.scaled_dot_product_attention(qr, qr, qr, dropout_p=0.1, is_causal=causal)
    out.sum().backward()
    assert qr.grad is not None and bool(torch.isfinite(qr.grad).all().cpu())


def test_large_tensors_travel_in_chunks_and_through_shared_memory(
    attach: Callable[..., Any],
) -> None:
    attach(2)  # cuda:1's worker listens on a Unix socket: its payloads use shared memory
    host = torch.randn(3, 1024, 1024)  # 12 MiB: more than one frame
    for device in ("cuda:0", "cuda:1"):
        remote = host.to(device)
        torch.testing.assert_close((remote * 2).cpu(), host * 2)
    assert host.cuda(0).to("cuda:1").sum().item() == pytest.approx(host.sum().item(), rel=1e-4)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_module_copies_and_dataloader_workers(attach: Callable[..., Any]) -> None:
    attach()
    model = nn.Linear(4, 2).cuda()
    twin = copy.deepcopy(model)
    assert twin.weight.device.type == "cuda" and twin.weight is not model.weight
    torch.testing.assert_close(twin.weight.cpu(), model.weight.cpu())
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, pin_memory=True)
    with torch.no_grad():
        total = sum(float(model(batch.cuda(non_blocking=True)).sum()) for (batch,) in loader)
        assert total == pytest.approx(float(model(data.tensors[0].cuda()).sum()), rel=1e-5)


def test_saved_remote_tensors_load_as_cuda_or_where_mapped(attach: Callable[..., Any]) -> None:
    attach(2)
    buffer = io.BytesIO()
    torch.save({"a": torch.arange(4.0, device="cuda:1"), "b": torch.ones(2)}, buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    assert state["a"].device == torch.device("cuda", 1) and state["b"].device.type == "cpu"
    buffer.seek(0)
    assert torch.load(buffer, map_location={"cuda:1": "cuda:0"})["a"].device == torch.device(
        "cuda", 0
    )
    buffer.seek(0)
    assert torch.load(buffer, map_location="cpu")["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_unsupported_things_fail_loudly_naming_what(attach: Callable[..., Any]) -> None:
    attach()
    with pytest.raises(NotImplementedError, match="CUDAGraph"):
        torch.cuda.CUDAGraph()
    with pytest.raises(NotImplementedError, match="Generator"):
        torch.randn(3, device="cuda", generator=torch.Generator())


def test_memory_limit_raises_out_of_memory_naming_the_lease(
    worker_factory: Callable[..., Any],
) -> None:
    from torch_workers import TOKEN

    worker = worker_factory("lease-small", memory_limit_mib=16)
    gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease="lease-small")
    try:
        assert torch.cuda.get_device_properties(0).total_memory == 16 << 20
        small = torch.ones(1024, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError, match=r"lease-small.*16 MiB"):
            torch.empty(8 << 20, device="cuda")  # 32 MiB: refused at the call
        big = torch.empty(3 << 20, device="cuda")  # 12 MiB fit; their sum's 12 more do not
        with pytest.raises(torch.cuda.OutOfMemoryError, match=r"lease-small.*16 MiB"):
            (big + 1).cpu()
        del big
        assert small.sum().item() == 1024.0, "the worker keeps running after refusing"
    finally:
        gpupool.torch.detach()


def test_detach_restores_torch(attach: Callable[..., Any]) -> None:
    attach()
    gpupool.torch.detach()
    assert not torch.cuda.is_available()
    assert torch.ones(2).to("cpu").device.type == "cpu"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_the_background_flusher_sends_what_a_quiet_program_left(
    attach: Callable[..., Any],
) -> None:
    """Ops a program issues and then goes quiet on reach the worker without a read."""
    import time

    attach()
    stream = runtime.stream(0)
    sent = stream._sends
    x = torch.ones(4, device="cuda")
    x.add_(1)
    # Younger than a batch's age, the two are queued; on a loaded machine the flusher may have
    # sent them already. Only the flusher sends them: the program reads nothing until the end.
    deadline = time.monotonic() + scaled(5)
    while stream.records and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not stream.records and stream._sends > sent
    assert x.sum().item() == 8.0


def test_the_flusher_leaves_a_busy_program_alone_and_takes_its_tail_later(
    attach: Callable[..., Any],
) -> None:
    """While the program sends its own batches, the flusher touches neither lock nor socket;
    once the program stops sending, the next look sends the tail."""
    attach()
    stream = runtime.stream(0)
    x = torch.ones(4, device="cuda")
    flusher = runtime._flusher
    assert flusher is not None
    flusher.stop()  # this test plays the flusher
    flusher.join()
    stream.flush()
    x.add_(1)
    now = stream._first_at
    stream._sends_seen = stream._sends - 1  # the program sent since the last look
    assert stream.try_flush(now) is True
    assert stream.records  # busy: left for the program
    now = stream._first_at + 0.0001
    assert stream.try_flush(now) is False  # no send since: it is the tail
    assert not stream.records
    assert x.sum().item() == 8.0
