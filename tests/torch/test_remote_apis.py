"""The torch APIs programs use, on remote GPUs: pinned memory and loaders, torch.accelerator,
streams and events, global switches, RNG and memory counters, allocation failures, GradScaler,
torch.compile and DLPack. Real CPU workers on loopback (see conftest.py)."""

from __future__ import annotations

import copy
import gc
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpupool.torch
from gpupool.torch import pinned, runtime

pytestmark = pytest.mark.slow


# ---- 1. pinned memory ------------------------------------------------------------------------


def test_pin_memory_gives_a_pinned_copy_that_moves_to_the_device(
    attach: Callable[..., Any],
) -> None:
    attach()
    host = torch.arange(12.0).reshape(3, 4)
    blocks = pinned.pinned_blocks()
    pinned_host = host.pin_memory()
    assert pinned_host.is_pinned() and not host.is_pinned()
    assert pinned_host[1:].is_pinned(), "a view of pinned memory is pinned"
    assert pinned_host.pin_memory() is pinned_host
    assert pinned_host.data_ptr() != host.data_ptr() and torch.equal(pinned_host, host)
    remote = pinned_host.to("cuda", non_blocking=True)
    assert remote.device == torch.device("cuda", 0) and not remote.is_pinned()
    assert torch.equal(remote.cpu(), host)
    transposed = host.t().pin_memory()
    assert torch.equal(transposed, host.t()) and transposed.is_pinned()
    with pytest.raises(RuntimeError, match="cannot pin"):
        remote.pin_memory()
    del pinned_host, transposed
    gc.collect()
    assert pinned.pinned_blocks() == blocks, "pinned memory goes with its last tensor"


def test_large_pinned_tensors_reach_a_same_host_worker_from_their_own_memory(
    attach: Callable[..., Any],
) -> None:
    attach(2)  # cuda:1 is the worker on this host's Unix socket
    stream = runtime.stream(1)
    region = pinned.shared_region()
    assert region is not None
    before = stream.pinned_puts
    first = torch.full((512, 1024), 1.0).pin_memory()  # 2 MiB: a block of the shared region
    assert first.is_pinned() and region.offset_of(first, 1) is not None
    moved = first.to("cuda:1", non_blocking=True)
    assert stream.pinned_puts == before + 1, "the worker copies out of the pinned tensor itself"
    # Freed before the stream synchronised, its block may still be read: not handed out again.
    used = {first.data_ptr()}
    del first
    gc.collect()
    second = torch.full((512, 1024), 2.0).pin_memory()
    assert second.data_ptr() not in used
    assert moved.sum().item() == 512 * 1024, "the first put's bytes were not overwritten"
    used.add(second.data_ptr())
    moved_second = second[128:].to("cuda:1", non_blocking=True)  # a view: its own offset
    assert torch.equal(moved_second.cpu(), torch.full((384, 1024), 2.0))
    # Synchronised since, both blocks are free again and the next pin reuses one.
    del second
    gc.collect()
    third = torch.zeros(512, 1024).pin_memory()
    assert third.data_ptr() in used
    # A blocking copy may not leave the source in use after it returns: it is copied.
    puts = stream.pinned_puts
    assert torch.equal(third.to("cuda:1").cpu(), third) and stream.pinned_puts == puts
    # Over TCP (cuda:0, another host as far as the client knows) the bytes go by socket.
    assert torch.equal(third.to("cuda:0", non_blocking=True).cpu(), third)
    assert runtime.stream(0).pinned_puts == 0


def test_pinned_tensors_across_the_workers_registration_granules_arrive_whole(
    attach: Callable[..., Any],
) -> None:
    # A CUDA worker registers the region in 64 MiB granules, and CUDA copies out of registered
    # memory only within one registration: a put across a boundary failed with "invalid
    # argument" (a ResNet-50 batch of 38.5 MB, every few steps). On a CPU worker this checks
    # the values only; on a CUDA worker (GPUPOOL_TEST_WORKER_DEVICE) the piecewise copies.
    from gpupool.worker.staging import REGISTER_GRANULE_BYTES

    attach(2)
    region = pinned.shared_region()
    assert region is not None
    nbytes = 40 << 20
    kept, crossing = [], None
    for i in range(4):  # two 40 MiB blocks in a row always have one across a boundary
        host = torch.arange(nbytes // 4, dtype=torch.float32).add_(i).pin_memory()
        kept.append(host)
        start = region.offset_of(host, nbytes)
        assert start is not None
        if start // REGISTER_GRANULE_BYTES != (start + nbytes - 1) // REGISTER_GRANULE_BYTES:
            crossing = host
            break
    assert crossing is not None, "no block across a granule boundary"
    moved = crossing.to("cuda:1", non_blocking=True)
    assert torch.equal(moved.cpu(), crossing)
    # Into a tensor that already exists and into one of another layout (a column slice).
    target = torch.zeros(nbytes // 4, device="cuda:1")
    target.copy_(crossing, non_blocking=True)
    assert torch.equal(target.cpu(), crossing)
    wide = torch.zeros(nbytes // 4 // 1024, 2048, device="cuda:1")
    wide[:, ::2].copy_(crossing.view(-1, 1024), non_blocking=True)
    assert torch.equal(wide[:, ::2].cpu(), crossing.view(-1, 1024))
    assert wide[:, 1::2].abs().sum().item() == 0


def test_the_shared_pinned_region_is_sealed_and_never_shared_by_a_forked_child() -> None:
    import fcntl

    region = pinned.shared_region()
    assert region is not None
    seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # a loader worker that pins: memory of its own, never the parent's blocks
        try:
            block = pinned.pin(torch.ones(1 << 20))
            ok = pinned.is_pinned(block) and region.offset_of(block, 1) is None
            os.write(write_end, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write_end)
    assert os.read(read_end, 1) == b"1"
    os.close(read_end)
    os.waitpid(child, 0)


def test_a_freed_blocks_late_finalizer_leaves_the_next_block_at_its_address_pinned() -> None:
    # A freed mmap unmaps before its finalizer runs, GIL released: the loader's pin thread can
    # map the next batch at that address in between (CI saw an unpinned batch this way).
    held = pinned.pin(torch.ones(4))
    address = held.untyped_storage().data_ptr()
    number = pinned._PINNED[address][1]
    pinned._forget(address, number - 1)  # the finalizer of an earlier block at this address
    assert pinned.is_pinned(held)
    pinned._forget(address, number)
    assert not pinned.is_pinned(held)


def test_pinning_a_tensor_that_needs_gradients_keeps_it_in_the_graph(
    attach: Callable[..., Any],
) -> None:
    attach()
    leaf = torch.ones(3, requires_grad=True)
    (leaf.pin_memory().cuda() * 2).sum().backward()
    assert leaf.grad is not None and leaf.grad.tolist() == [2.0, 2.0, 2.0]


# ---- 2. DataLoader workers ---------------------------------------------------------------------


def _loader_training(loader: Any, model: nn.Module, opt: Any) -> float:
    total = 0.0
    for x, y in loader:
        assert x.is_pinned(), "pin_memory=True loaders hand out pinned batches"
        loss = nn.functional.mse_loss(model(x.cuda(non_blocking=True)), y.cuda(non_blocking=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    return total


def _dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator)
    )


def test_forked_loader_workers_pass_20_of_20_runs_whatever_the_parent_has_queued(
    attach: Callable[..., Any],
) -> None:
    attach()
    torch.manual_seed(0)
    model = nn.Linear(8, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stream = runtime.stream(0)
    losses = []
    for _ in range(20):
        loader = torch.utils.data.DataLoader(
            _dataset(), batch_size=8, num_workers=2, pin_memory=True,
            multiprocessing_context="fork",
        )  # fmt: skip
        with stream.lock:  # as if another thread were sending: the flusher keeps off
            stream.flush()  # what was queued goes; the next op then waits for the batch's age
            model.weight.data.mul_(1.0)
            if not stream.records:  # a batch age set by another thread flushed it: again
                model.weight.data.mul_(1.0)
            assert stream.records, "the fork must happen with records pending"
            batches = iter(loader)  # the workers fork now
        losses.append(_loader_training(batches, model, opt))
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]


_INHERITED: list[torch.Tensor] = []
"""A remote tensor a forked child inherits (an argument would be pickled as its host copy)."""


def _touch_inherited(answers: Any) -> None:
    try:
        (_INHERITED[0] + 1).cpu()
        answers.put("no error")
    except gpupool.torch.WorkerLost as exc:
        answers.put(str(exc))


def test_a_forked_child_that_touches_a_remote_tensor_is_told_and_the_parent_goes_on(
    attach: Callable[..., Any],
) -> None:
    attach()
    remote = torch.ones(4, device="cuda")
    _INHERITED[:] = [remote]
    context = multiprocessing.get_context("fork")
    answers = context.SimpleQueue()
    child = context.Process(target=_touch_inherited, args=(answers,))
    pending = remote * 3  # queued in the parent at the fork
    child.start()
    message = answers.get()
    child.join()
    _INHERITED.clear()
    assert "forked subprocess cannot use it" in message
    assert torch.cuda.is_available()
    assert pending.sum().item() == 12.0


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_persistent_loader_workers_serve_several_epochs(
    attach: Callable[..., Any], start_method: str
) -> None:
    attach()
    torch.manual_seed(0)
    model = nn.Linear(8, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(
        _dataset(), batch_size=8, num_workers=2, pin_memory=True, persistent_workers=True,
        multiprocessing_context=start_method,
    )  # fmt: skip
    first = _loader_training(loader, model, opt)
    model.bias.data.add_(0.0)  # pending while the workers live on
    second = _loader_training(loader, model, opt)
    assert second < first
    del loader


# ---- 3. torch.accelerator -----------------------------------------------------------------------


def test_torch_accelerator_reports_the_remote_devices(attach: Callable[..., Any]) -> None:
    attach(2)
    accelerator = torch.accelerator
    assert accelerator.is_available() and accelerator.device_count() == 2
    assert accelerator.current_accelerator() == torch.device("cuda")
    assert accelerator.current_accelerator(check_available=True) == torch.device("cuda")
    assert torch._C._get_accelerator() == torch.device("cuda")  # what torch.distributed asks
    assert accelerator.current_device_index() == 0
    accelerator.set_device_index(1)
    try:
        assert torch.cuda.current_device() == 1
        assert torch.zeros(2, device="cuda").device == torch.device("cuda", 1)
    finally:
        accelerator.set_device_index(0)
    with accelerator.device_index(1):
        assert accelerator.current_device_index() == 1
    assert accelerator.current_device_index() == 0
    device = torch.accelerator.current_accelerator()
    x = torch.ones(3, device=device)
    accelerator.synchronize()
    assert x.device == torch.device("cuda", 0) and x.sum().item() == 3.0
    assert accelerator.current_stream() == torch.cuda.default_stream()
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        accelerator.set_device_index(5)


def test_detach_gives_torch_accelerator_back(attach: Callable[..., Any]) -> None:
    before = torch.accelerator.current_accelerator()
    attach()
    gpupool.torch.detach()
    assert torch.accelerator.current_accelerator() == before


# ---- 4. streams and events -----------------------------------------------------------------------


def test_ops_run_on_the_current_stream_and_streams_order_through_events(
    attach: Callable[..., Any],
) -> None:
    attach()
    side = torch.cuda.Stream()
    assert isinstance(side, torch.cuda.Stream) and side != torch.cuda.default_stream()
    a = torch.arange(6.0, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() == side
        b = a * 2
        b.record_stream(side)
        done = side.record_event()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.cuda.current_stream().wait_event(done)
    assert (b + 1).tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert done.query() and side.query()
    side.synchronize()
    done.synchronize()
    with side:
        c = b.sum()
    assert c.item() == 30.0
    stats = runtime.stream(0).stats()
    assert stats["tensors"] >= 2


def test_event_elapsed_time_is_the_workers_time(attach: Callable[..., Any]) -> None:
    attach()
    m = torch.randn(384, 384, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    quick = torch.cuda.Event(enable_timing=True)
    start.record()
    quick.record()
    for _ in range(24):
        m = (m @ m).tanh()
    end.record()  # the client queued all of it without waiting for any
    end.synchronize()
    worked, idle = start.elapsed_time(end), start.elapsed_time(quick)
    assert worked > 0 and idle >= 0
    assert worked > idle, "the time spans the worker's matmuls, not the client's calls"
    untimed = torch.cuda.Event()
    untimed.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        start.elapsed_time(untimed)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(torch.cuda.Event(enable_timing=True))
    assert torch.cuda.Event().query(), "an event never recorded counts as done"
    assert m.sum().item() == m.sum().item()  # the session goes on after the errors


# ---- 5. global switches, RNG and memory counters -------------------------------------------------


def _worker_flags() -> dict[str, Any]:
    flags: dict[str, Any] = runtime.stream(0).stats()["flags"]
    return flags


@pytest.fixture
def restore_switches() -> Any:
    # torch.testing._internal (the OpInfo sweep, in the same pytest process) freezes the
    # cuDNN switches at import; a user program's process never has, so thaw them here.
    thawed = getattr(torch.backends, "__allow_nonbracketed_mutation")()
    thawed.__enter__()
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cuda.matmul.allow_tf32,
        torch.get_default_dtype(),
    )
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[1], saved[2]
    torch.backends.cuda.matmul.allow_tf32 = saved[3]
    torch.set_float32_matmul_precision("highest")
    torch.set_default_dtype(saved[4])
    thawed.__exit__(None, None, None)


def test_global_switches_are_applied_on_the_worker(
    attach: Callable[..., Any], restore_switches: Any
) -> None:
    attach()
    assert _worker_flags()["deterministic"] is False
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.set_float32_matmul_precision("high")
    torch.set_default_dtype(torch.float64)
    flags = _worker_flags()
    assert flags["deterministic"] and flags["cudnn_benchmark"] and flags["cudnn_deterministic"]
    assert flags["float32_matmul_precision"] == "high" and flags["matmul_allow_tf32"]
    assert flags["default_dtype"] == "float64"
    with torch.backends.cudnn.flags(enabled=False, benchmark=False):
        assert _worker_flags()["cudnn_enabled"] is False
    assert _worker_flags()["cudnn_enabled"] is True
    torch.backends.cuda.matmul.allow_tf32 = False
    assert _worker_flags()["matmul_allow_tf32"] is False


def test_a_switch_set_behind_the_followed_setters_reaches_the_worker_by_the_next_batch(
    attach: Callable[..., Any], restore_switches: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpupool.torch import flags
    from gpupool.torch import stream as stream_module

    monkeypatch.setattr(stream_module, "FLAGS_CATCH_UP_S", 0.0)  # compare at every batch
    attach()
    assert _worker_flags()["cudnn_benchmark"] is False
    flags._ORIGINALS["_set_cudnn_benchmark"](True)  # as a reference taken before attach
    assert _worker_flags()["cudnn_benchmark"] is True


def test_switches_take_effect_in_stream_order(
    attach: Callable[..., Any], restore_switches: Any
) -> None:
    attach()
    before = torch.empty(4, device="cuda")  # queued before the switch: zero-filled memory
    torch.use_deterministic_algorithms(True)
    after = torch.empty(4, device="cuda")  # deterministic mode fills new memory with NaN
    if not runtime.stream(0).is_cuda_worker:  # a GPU's fresh memory may hold anything
        assert not before.isnan().any().item()
    assert after.isnan().all().item()


class _SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(nn.functional.relu(self.norm(self.conv(x))), 2)
        return self.head(nn.functional.dropout(x.flatten(1), 0.2, self.training))


def _seeded_cnn_run(device: str) -> list[float]:
    torch.manual_seed(7)
    model = _SmallCnn().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randn(16, 3, 16, 16).to(device)
    labels = torch.randint(0, 10, (16,)).to(device)
    torch.manual_seed(11)  # dropout draws from the device's generator: seeded alike
    losses = []
    for _ in range(4):
        loss = nn.functional.cross_entropy(model(data), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    losses.append(model.head.weight.sum().item())
    return losses


def test_two_seeded_deterministic_cnn_runs_are_bit_identical(
    attach: Callable[..., Any], restore_switches: Any
) -> None:
    attach()
    torch.use_deterministic_algorithms(True)
    first, second = _seeded_cnn_run("cuda"), _seeded_cnn_run("cuda")
    assert first == second
    on_cpu = not runtime.stream(0).is_cuda_worker
    gpupool.torch.detach()
    if on_cpu:  # a GPU's convolutions (TF32) round otherwise than the host's
        torch.testing.assert_close(first, _seeded_cnn_run("cpu"), rtol=1e-4, atol=1e-5)


def test_rng_state_of_the_remote_device_saves_and_restores(attach: Callable[..., Any]) -> None:
    attach()
    torch.cuda.manual_seed_all(3)
    state = torch.cuda.get_rng_state()
    first = torch.rand(5, device="cuda").tolist()
    torch.cuda.set_rng_state(state)
    assert torch.rand(5, device="cuda").tolist() == first
    with torch.random.fork_rng(devices=[0], device_type="cuda"):
        torch.rand(100, device="cuda")
    after_fork = torch.rand(5, device="cuda").tolist()
    torch.cuda.set_rng_state(state)
    torch.rand(5, device="cuda")
    assert torch.rand(5, device="cuda").tolist() == after_fork


def test_memory_counters_are_the_leases(attach: Callable[..., Any]) -> None:
    attach()
    base = torch.cuda.memory_allocated()
    x = torch.empty(256, 1024, device="cuda")  # 1 MiB
    assert torch.cuda.memory_allocated() == base + (1 << 20)
    assert torch.cuda.memory_reserved() == torch.cuda.memory_allocated()
    assert torch.accelerator.memory_allocated() == base + (1 << 20)
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == base + (1 << 20)
    del x
    assert torch.cuda.max_memory_allocated() >= base + (1 << 20)
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == base
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total
    assert torch.accelerator.get_memory_info() == (free, total)


# ---- 6. allocation failures at the allocating call ------------------------------------------------


def test_allocations_the_lease_cannot_hold_raise_at_the_call(
    worker_factory: Callable[..., Any],
) -> None:
    from torch_workers import TOKEN

    worker = worker_factory("lease-oom", memory_limit_mib=64)
    gpupool.torch.attach(workers=[worker.address], token=TOKEN, lease="lease-oom")
    try:
        stream = runtime.stream(0)
        with pytest.raises(torch.OutOfMemoryError, match=r"lease-oom.*64 MiB.*1024.0 MiB"):
            torch.empty(1 << 28, device="cuda")  # 1 GiB, nothing sent
        held = torch.ones(10 << 20, device="cuda")  # 40 MiB: fits
        with pytest.raises(torch.OutOfMemoryError, match=r"40.0 MiB held"):
            torch.zeros(10 << 20, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(20 << 20).to("cuda")  # 80 MiB from the host
        assert held.sum().item() == 10 << 20, "no error is left behind for a later read"
        assert stream.open
        del held
        assert torch.ones(10 << 20, device="cuda").sum().item() == 10 << 20
    finally:
        gpupool.torch.detach()


# ---- 7. GradScaler --------------------------------------------------------------------------------


def _scaled_training(device: str, scaler: Any) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4).to(device)
    scales = []
    for step in range(4):
        loss = model(x).square().mean()
        if step == 1:
            loss = loss * float("inf")  # an overflow: the step is skipped, the scale halves
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return scales, model.weight.detach().cpu().flatten().tolist()


def test_grad_scaler_skips_overflowing_steps_as_locally(attach: Callable[..., Any]) -> None:
    attach()
    remote = _scaled_training("cuda", torch.amp.GradScaler("cuda", init_scale=1024.0))
    local = _scaled_training("cpu", torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert remote[0] == local[0] == [1024.0, 512.0, 512.0, 512.0]
    torch.testing.assert_close(remote[1], local[1])
    with pytest.warns(FutureWarning):
        legacy = torch.cuda.amp.GradScaler(init_scale=256.0)
    assert _scaled_training("cuda", legacy)[0][:2] == [256.0, 128.0]


# ---- 9. torch.compile -----------------------------------------------------------------------------


def test_compiled_functions_and_modules_give_the_eager_results_on_the_pool(
    attach: Callable[..., Any],
) -> None:
    from torch._dynamo.utils import counters

    attach()
    torch._dynamo.reset()

    @torch.compile
    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sin().sum(dim=0) + b.cos()

    a, b = torch.randn(4, 3, device="cuda"), torch.randn(3, device="cuda")
    out = step(a, b)
    assert out.device == torch.device("cuda", 0)
    torch.testing.assert_close(out.cpu(), (a.cpu() * b.cpu()).sin().sum(dim=0) + b.cpu().cos())
    model = nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 1)).cuda()
    compiled = torch.compile(model)
    x = torch.randn(6, 3, device="cuda")
    torch.testing.assert_close(compiled(x).cpu(), model(x).cpu())
    compiled(x).sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.device.type == "cuda"
    counters.clear()
    host = torch.compile(lambda t: (t * 2).relu(), backend="eager")
    assert host(torch.tensor([-1.0, 3.0])).tolist() == [0.0, 6.0]
    assert counters["stats"]["unique_graphs"] == 1, "host graphs go to the backend asked for"


def test_compiled_inference_is_compiled_by_inductor_on_the_worker(
    attach: Callable[..., Any],
) -> None:
    """Inference calls of a compiled model become one program the worker compiles with
    Inductor (C++ kernels on this CPU worker): same values as eager to float rounding, and its
    train/eval, parameters and gradients-needing calls stay the model's own."""
    attach()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).cuda()
    compiled = torch.compile(model)
    x = torch.randn(8, 16, device="cuda")
    with torch.no_grad():
        expected = model(x).cpu()
        got = [compiled(x).cpu() for _ in range(5)]
    route = compiled.forward
    assert [m[:8] for m, runs in route.step.worker_programs() if runs > 1] == ["inductor"], (
        route.step.worker_programs(),
        route.step.not_compiled(),
    )
    for value in got:
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    scaled = torch.compile(lambda t: model[0](t).sin() * 2)
    with torch.no_grad():
        values = [scaled(x).cpu() for _ in range(5)]
    assert [m[:8] for m, runs in scaled.step.worker_programs() if runs > 1] == ["inductor"]
    torch.testing.assert_close(values[-1], (model[0](x).sin() * 2).cpu(), rtol=1e-5, atol=1e-6)
    # A forward hook runs Python at every call: such a model stays on Dynamo's path.
    seen: list[int] = []
    handle = model[0].register_forward_hook(lambda *_: seen.append(1))
    with torch.no_grad():
        for _ in range(4):
            compiled(x)
    handle.remove()
    assert len(seen) == 4
    assert compiled(x).requires_grad  # with gradients: eager ops, autograd history kept


def test_compiled_calls_that_change_python_state_keep_doing_so(
    attach: Callable[..., Any],
) -> None:
    """A replay runs no Python: a compiled model that counts its calls, or a function that
    fills a cache, must keep running its Python at every call, as under a local torch.compile;
    and a function's captured calls follow the module it names when it changes."""
    attach()
    torch._dynamo.reset()

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.linear(x).relu()

    model = Counting().cuda()
    compiled = torch.compile(model)
    x = torch.randn(2, 4, device="cuda")
    seen: list[int] = []

    @torch.compile
    def logged(t: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return model.linear(t) * 2

    with torch.no_grad():
        for _ in range(6):
            compiled(x)
            logged(x)
        assert model.calls == 6 and len(seen) == 6
        model.linear = nn.Linear(4, 4).cuda()  # what the function names, replaced
        torch.testing.assert_close(logged(x).cpu(), (model.linear(x) * 2).cpu())


def _compiled_training(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int
) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _norm_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.BatchNorm1d(32), nn.LayerNorm(32), nn.Linear(32, 4)
    ).cuda()


def _assert_both_graphs_compiled(graphs: Any) -> None:
    """Nothing declined, and the forward and the backward graph each an Inductor program."""
    assert graphs.declined() == []
    modes = [[m[:8] for m, runs in step.worker_programs() if runs > 1] for step in graphs.steps()]
    assert modes == [["inductor"], ["inductor"]], (
        modes,
        [s.not_compiled() for s in graphs.steps()],
    )


def test_compiled_training_runs_forward_and_backward_graphs_compiled_on_the_worker(
    attach: Callable[..., Any],
) -> None:
    """A compiled module's training calls (the loss differentiated outside the call) become
    AOTAutograd's forward and backward graphs, each a program the worker compiles with
    Inductor: losses, batch-norm statistics and weights follow eager training to float
    rounding, and the outputs carry autograd history."""
    attach()
    torch._dynamo.reset()
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    eager = _norm_mlp()
    expected = _compiled_training(eager, x, y, 10)
    model = _norm_mlp()
    compiled = torch.compile(model)
    got = _compiled_training(compiled, x, y, 10)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    graphs = compiled.forward.training
    _assert_both_graphs_compiled(graphs)
    torch.testing.assert_close(model[2].running_mean.cpu(), eager[2].running_mean.cpu())
    torch.testing.assert_close(model[4].weight.cpu(), eager[4].weight.cpu(), rtol=1e-5, atol=1e-6)
    out = compiled(x)
    assert out.requires_grad and out.grad_fn is not None
    eager(x)  # the same batch-statistics update on both
    # eval() is another signature, traced for itself: no batch statistics, running ones used.
    model.eval()
    eager.eval()
    torch.testing.assert_close(compiled(x).cpu(), eager(x).cpu(), rtol=1e-5, atol=1e-6)


def test_compiled_training_of_a_cnn_with_max_pooling_compiles_its_backward_too(
    attach: Callable[..., Any],
) -> None:
    """Max pooling's backward scatters into the input at the indices its forward saved, behind
    a check of their range: the backward graph takes those indices in, so the worker checks
    them before each compiled call and compiles the graph (a ResNet's backward has one)."""
    attach()
    torch._dynamo.reset()

    def cnn() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(8 * 4 * 4, 4),
        ).cuda()  # fmt: skip

    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, device="cuda"), torch.randn(4, 4, device="cuda")
    expected = _compiled_training(cnn(), x, y, 6)
    compiled = torch.compile(cnn())
    torch.testing.assert_close(
        _compiled_training(compiled, x, y, 6), expected, rtol=1e-5, atol=1e-6
    )
    _assert_both_graphs_compiled(compiled.forward.training)


def _autocast_training(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, dtypes = [], set()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            loss = (out.float() - y).square().mean()
        dtypes.add(out.dtype)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, dtypes


def test_compiled_training_under_autocast_has_the_casts_in_its_graphs(
    attach: Callable[..., Any],
) -> None:
    """Under bf16 autocast the trace holds autocast's casts, above autograd as a local
    torch.compile puts them: both graphs are compiled on the worker, the outputs are bf16 as
    eagerly, float32 weights get float32 gradients, and the losses follow eager autocast
    training to bf16 rounding. The signature holds the autocast dtype: a call without
    autocast is traced as its own."""
    attach()
    torch._dynamo.reset()
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    eager = _norm_mlp()
    expected, eager_dtypes = _autocast_training(eager, x, y, 8)
    model = _norm_mlp()
    compiled = torch.compile(model)
    got, dtypes = _autocast_training(compiled, x, y, 8)
    assert dtypes == eager_dtypes == {torch.bfloat16}
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-3)
    graphs = compiled.forward.training
    _assert_both_graphs_compiled(graphs)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(model[4].weight.cpu(), eager[4].weight.cpu(), rtol=3e-2, atol=3e-3)
    twin = copy.deepcopy(model)
    plain = _compiled_training(compiled, x, y, 3)  # no autocast: another signature
    assert len(graphs.steps()) == 4 and graphs.declined() == []
    torch.testing.assert_close(plain, _compiled_training(twin, x, y, 3), rtol=1e-5, atol=1e-6)
    assert compiled(x).dtype == torch.float32


def test_a_backward_graph_the_trace_cannot_stand_for_declines_before_any_backward(
    attach: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backward graph is made a captured step when the signature is traced, not at the
    first backward: one it cannot stand for (a tensor constant) declines the signature, and
    the caller's loss.backward() never sees the refusal."""
    from gpupool.torch import joint

    made = joint._graph_compiler

    def refusing_backwards(steps: list[Any]) -> Any:
        compile_graph = made(steps)

        def compile_or_refuse(gm: Any, example_inputs: list[Any]) -> Any:
            if steps:  # the forward graph is in: this is the backward
                raise joint.Declined("the backward makes a tensor constant")
            return compile_graph(gm, example_inputs)

        return compile_or_refuse

    monkeypatch.setattr(joint, "_graph_compiler", refusing_backwards)
    attach()
    torch._dynamo.reset()
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    compiled = torch.compile(_norm_mlp())
    torch.testing.assert_close(
        _compiled_training(compiled, x, y, 4),
        _compiled_training(_norm_mlp(), x, y, 4),
        rtol=1e-5,
        atol=1e-6,
    )
    declined = compiled.forward.training.declined()
    assert declined == ["Declined: the backward makes a tensor constant"], declined


def test_compiled_training_follows_the_module_where_its_graphs_cannot(
    attach: Callable[..., Any],
) -> None:
    """What the traced graphs cannot stand for runs the module itself: a replaced layer is
    traced again, a forward that reads a value runs eagerly (the reason kept), and a forward
    that counts its calls counts every one."""
    attach()
    torch._dynamo.reset()
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    model = _norm_mlp()
    compiled = torch.compile(model)
    _compiled_training(compiled, x, y, 3)
    model[4] = nn.Linear(32, 4).cuda()
    eager = copy.deepcopy(model)
    torch.testing.assert_close(
        _compiled_training(compiled, x, y, 3),
        _compiled_training(eager, x, y, 3),
        rtol=1e-5,
        atol=1e-6,
    )

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 4)
            self.calls = 0

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            out = self.linear(t)
            return out * 2 if out.sum() > 0 else out  # a value read: no graph stands for it

    torch.manual_seed(2)
    branchy = Branchy().cuda()
    twin = copy.deepcopy(branchy)
    compiled_branchy = torch.compile(branchy)
    losses = _compiled_training(compiled_branchy, x, y, 4)
    assert losses == _compiled_training(twin, x, y, 4)
    assert branchy.calls == 4

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            out = self.linear(t)
            return out * 2 if out.sum() > 0 else out

    plain = Plain().cuda()
    compiled_plain = torch.compile(plain)
    _compiled_training(compiled_plain, x, y, 3)
    assert any("DataDependent" in why for why in compiled_plain.forward.training.declined())


def test_a_compiled_function_trains_with_its_graphs_compiled_on_the_worker(
    attach: Callable[..., Any],
) -> None:
    """A compiled loss function that names its model (a closure here; a global or a bound
    method's self alike) is traced as a module whose children are the modules it names: the
    model's parameters are the graphs' inputs, the backward graph fills their gradients, and
    both graphs are Inductor programs on the worker. Rebinding the name to another model traces
    that one (its own signature), and the losses stay eager's."""
    attach()
    torch._dynamo.reset()
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    model = _norm_mlp()

    @torch.compile
    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (model(inputs) - targets).square().mean()

    def train(loss: Callable[..., torch.Tensor], params: Any, steps: int) -> list[float]:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        losses = []
        for _ in range(steps):
            value = loss(x, y)
            opt.zero_grad()
            value.backward()
            opt.step()
            losses.append(value.item())
        return losses

    eager = _norm_mlp()
    expected = train(lambda a, b: (eager(a) - b).square().mean(), eager.parameters(), 8)
    got = train(loss_of, model.parameters(), 8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    _assert_both_graphs_compiled(loss_of.training)
    torch.testing.assert_close(model[4].weight.cpu(), eager[4].weight.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[2].running_var.cpu(), eager[2].running_var.cpu())

    model = _norm_mlp()  # the name the function reads, rebound
    again = _norm_mlp()
    torch.testing.assert_close(
        train(loss_of, model.parameters(), 3),
        train(lambda a, b: (again(a) - b).square().mean(), again.parameters(), 3),
        rtol=1e-5,
        atol=1e-6,
    )


def test_a_compiled_whole_training_step_runs_eagerly_with_the_reason_kept(
    attach: Callable[..., Any],
) -> None:
    """A compiled function that runs backward() and the optimizer inside the call, or closes
    over a tensor that needs a gradient, has no pair of graphs that stands for it (their effects
    on .grad and on the weights would be left out): it runs eagerly, as eager training does,
    and the reason is kept."""
    attach()
    torch._dynamo.reset()
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")

    def stepper(model: nn.Module) -> Callable[..., torch.Tensor]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = (model(inputs) - targets).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    eager_step = stepper(_norm_mlp())
    expected = [eager_step(x, y).item() for _ in range(5)]
    compiled_step = torch.compile(stepper(_norm_mlp()))
    assert [compiled_step(x, y).item() for _ in range(5)] == expected
    assert compiled_step.training.declined() == ["Declined: the call runs backward() inside it"]

    model = _norm_mlp()

    @torch.compile
    def penalized(inputs: torch.Tensor) -> torch.Tensor:
        inputs = inputs.detach().requires_grad_()
        out = model(inputs).square().sum()
        (grad,) = torch.autograd.grad(out, inputs, create_graph=True)
        return out + grad.square().sum()

    for _ in range(3):
        penalized(x).backward()
    twin = _norm_mlp()
    for _ in range(3):
        inputs = x.detach().requires_grad_()
        out = twin(inputs).square().sum()
        (grad,) = torch.autograd.grad(out, inputs, create_graph=True)
        (out + grad.square().sum()).backward()
    torch.testing.assert_close(model[0].weight.grad.cpu(), twin[0].weight.grad.cpu())
    assert penalized.training.declined() == [
        "Declined: the call runs torch.autograd.grad inside it"
    ]

    torch.manual_seed(2)
    w = torch.randn(16, 4, device="cuda", requires_grad=True)
    w_eager = w.detach().clone().requires_grad_()

    @torch.compile
    def scaled(inputs: torch.Tensor) -> torch.Tensor:
        return (inputs @ w).square().mean()

    for _ in range(3):
        scaled(x).backward()
        (x @ w_eager).square().mean().backward()
    assert w.grad is not None and w_eager.grad is not None
    assert torch.equal(w.grad.cpu(), w_eager.grad.cpu())
    assert scaled.training.declined() == [
        "the function closes over a tensor (the graphs would hold it as a constant)"
    ]


@pytest.mark.timeout(600)  # the worker compiles two GPT-2 graphs with Inductor: 40 s idle
@pytest.mark.parametrize("amp", [False, True], ids=["float32", "bf16-autocast"])
def test_a_compiled_transformers_model_trains_with_its_forward_compiled_on_the_worker(
    attach: Callable[..., Any], amp: bool
) -> None:
    """Hugging Face GPT-2 (built from a config) under torch.compile, trained as a script would:
    labels passed as the same tensor as the inputs, tied embeddings, transformers' masks, in
    float32 and under bf16 autocast. Its forward and backward graphs are compiled on the
    worker (the embedding backward's index check runs on the token ids before each compiled
    call), and the losses are eager's (to float rounding, or bf16 rounding under autocast)."""
    from tests.torch.real_programs import transformers_module

    transformers = transformers_module()
    if transformers is None:
        pytest.skip("transformers is not installed")
    attach()
    torch._dynamo.reset()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, 100, (2, 16)).cuda()

    def train(model: Any) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(6):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    expected = train(transformers.GPT2LMHeadModel(config).cuda().train())
    torch.manual_seed(0)
    compiled = torch.compile(transformers.GPT2LMHeadModel(config).cuda().train())
    tolerance = {"rtol": 2e-2, "atol": 1e-2} if amp else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(train(compiled), expected, **tolerance)
    _assert_both_graphs_compiled(compiled.forward.training)


# ---- 10. DLPack -----------------------------------------------------------------------------------


def test_dlpack_of_a_remote_tensor_fails_naming_it(attach: Callable[..., Any]) -> None:
    attach()
    remote = torch.ones(3, device="cuda")
    with pytest.raises(BufferError, match="gpupool remote tensor"):
        torch.utils.dlpack.to_dlpack(remote)
    with pytest.raises(BufferError, match="gpupool remote tensor"):
        torch.from_dlpack(remote)
    host = torch.arange(3.0)
    assert torch.equal(torch.from_dlpack(host), host)
    assert remote.sum().item() == 3.0


def test_a_jiterator_kernel_fails_at_its_call_naming_it(attach: Callable[..., Any]) -> None:
    """CUDA source from the program is never compiled on a worker (see cuda_api._jiterator)."""
    attach()
    remote = torch.ones(3, device="cuda")
    code = "template <typename T> T twice(T x) { return x + x; }"
    twice = torch.cuda.jiterator._create_jit_fn(code)
    with pytest.raises(NotImplementedError, match=r"torch\.cuda\.jiterator is not supported"):
        twice(remote)
    assert remote.add(1).sum().item() == 6.0  # the session goes on


# ---- 8. quiet stderr ------------------------------------------------------------------------------

_PROGRAM = """
import torch, gpupool.torch
from torch import nn
gpupool.torch.attach(workers=[{address!r}], token={token!r}, lease="lease-t")
device = torch.accelerator.current_accelerator()
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
model = nn.Linear(8, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cuda")
data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, pin_memory=True)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x.to(device, non_blocking=True)), y.to(device))
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
end.record()
torch.accelerator.synchronize()
print(round(start.elapsed_time(end) >= 0), torch.compile(lambda t: t * 2)(loss).item() > 0)
"""


def test_a_remote_program_prints_nothing_on_stderr(workers: list[Any], tmp_path: Path) -> None:
    from torch_workers import TOKEN

    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(_PROGRAM.format(address=workers[0].address, token=TOKEN)))
    src = str(Path(gpupool.torch.__file__).parents[2])
    # src first, then whatever this process was given (the GPU machine's wheels in /tmp/site)
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "True"]
    assert done.stderr == "", f"stderr after {time.monotonic() - started:.0f} s: {done.stderr}"
