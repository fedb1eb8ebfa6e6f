"""Bytes and reads that move as a local GPU's do: non-blocking copies from pinned memory
return before their bytes are sent, large tensors cross TCP in chunks both ways, `.item()`
costs one round trip; and bench/remote_real.py's tiny mode runs against real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpupool.protocol.v1.dataplane import CHUNK_BYTES, LANE_CHUNK_BYTES
from gpupool.torch import runtime
from tests.timing import scaled

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _busy_worker(stream: Any) -> torch.Tensor:
    """Ops that keep the (single-threaded CPU) worker busy for a while, sent now: while it
    runs them it reads nothing, so more than its socket buffers cannot be sent meanwhile."""
    a = torch.randn(768, 768, device="cuda")
    for _ in range(12):
        a = (a @ a).tanh()
    stream.flush()
    return a


def test_a_non_blocking_copy_of_pinned_memory_returns_before_its_bytes_are_sent(
    attach: Callable[..., Any],
) -> None:
    attach()
    stream = runtime.stream(0)
    assert stream.address.scheme == "tcp"  # cuda:0 of the fixture: no shared memory
    host = torch.randn(24 * (1 << 20) // 4).pin_memory()  # 24 MiB, three chunks
    busy = _busy_worker(stream)
    moved = host.to("cuda", non_blocking=True)
    # Returned while the bytes are still on their way (the worker has not read them yet).
    assert stream.sending
    doubled = moved * 2  # queued behind the bytes, in order
    assert torch.equal(doubled.cpu(), host * 2)
    assert not stream.sending
    assert torch.isfinite(busy.sum()).item()
    # A pageable source copies at once, as on a local GPU.
    pageable = torch.arange(300_000, dtype=torch.float32)
    _busy_worker(stream)
    copied = pageable.to("cuda", non_blocking=True)
    assert not stream.sending
    assert torch.equal(copied.cpu(), pageable)


def test_batches_sent_behind_a_non_blocking_copy_keep_their_order(
    attach: Callable[..., Any],
) -> None:
    attach()
    stream = runtime.stream(0)
    batches = [torch.full((3 * (1 << 20),), float(i)).pin_memory() for i in range(4)]
    _busy_worker(stream)
    total = torch.zeros((), device="cuda")
    for batch in batches:  # each copy, and the ops after it, queue behind the one before
        total = total + batch.to("cuda", non_blocking=True).mean()
        for _ in range(600):  # more than a batch of records: flushes while bytes are queued
            total = total * 1.0
    assert total.item() == pytest.approx(sum(range(4)))


def test_a_large_tensor_crosses_tcp_in_chunks_both_ways(attach: Callable[..., Any]) -> None:
    attach()
    assert runtime.stream(0).address.scheme == "tcp"
    nbytes = 4 * CHUNK_BYTES + 12_344  # four whole chunks and a short one
    host = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32)
    for source in (host, host.pin_memory()):
        moved = source.to("cuda", non_blocking=True)
        assert torch.equal(moved.cpu(), host)
        assert torch.equal(moved[-5:].cpu(), host[-5:])  # a view reads its own part
    strided = host.view(-1, 2)[:, 1]  # not contiguous: made so in the client, then sent
    assert torch.equal(strided.cuda().cpu(), strided)


def test_large_puts_over_tcp_go_side_by_side_over_lanes_and_keep_their_order(
    attach: Callable[..., Any],
) -> None:
    attach(2)
    stream = runtime.stream(0)
    assert stream.address.scheme == "tcp"
    sizes = [LANE_CHUNK_BYTES * 5 + 4, LANE_CHUNK_BYTES * 2, LANE_CHUNK_BYTES * 9 - 12]
    hosts = [torch.randint(-1000, 1000, (n // 4,), dtype=torch.int32) for n in sizes]
    pinned_hosts = [h.pin_memory() for h in hosts]
    _busy_worker(stream)
    total = torch.zeros((), dtype=torch.int64, device="cuda")
    moved = []
    for host, pinned_host in zip(hosts, pinned_hosts, strict=True):
        moved.append(pinned_host.to("cuda", non_blocking=True))  # returns at once
        moved.append(host.to("cuda"))  # blocking: its own chunks sent when it returns
        total = total + moved[-1].sum() + moved[-2].sum()
    assert stream.lanes == 4, "a TCP stream's large puts go over the worker's four lanes"
    assert total.item() == sum(int(h.sum()) * 2 for h in hosts)
    assert not stream.sending
    for host, back in zip([h for h in hosts for _ in (0, 1)], moved, strict=True):
        assert torch.equal(back.cpu(), host)
    # Over the Unix socket there are none: same-host copies need no lanes.
    on_unix = hosts[0].to("cuda:1")
    assert torch.equal(on_unix.cpu(), hosts[0]) and runtime.stream(1).lanes == 0


def test_each_item_in_a_loop_is_one_round_trip_and_the_right_value(
    attach: Callable[..., Any],
) -> None:
    attach(2)
    for index in (0, 1):  # over TCP and over the Unix socket with shared memory
        stream = runtime.stream(index)
        x = torch.zeros((), device=f"cuda:{index}")
        y = torch.arange(10.0, device=f"cuda:{index}")
        trips = stream.round_trips
        for i in range(25):
            x.add_(1)
            y = y + 1
            assert x.item() == i + 1
            assert y[3].item() == 4 + i
        assert stream.round_trips - trips == 50


@pytest.mark.timeout(600)  # five loops, three of them models: minutes on a loaded 2-core machine
def test_the_tiny_benchmark_runs_every_loop_against_cpu_workers(tmp_path: Path) -> None:
    out = tmp_path / "real.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "remote_real.py"), "--tiny", "--steps-scale",
         "0.1", "--transports", "tcp", "--out", str(out)],
        capture_output=True, text=True, timeout=scaled(600), env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    loops = {row["loop"]: row for row in result["rows"]}
    assert set(loops) == {"resnet50", "gpt2_finetune", "gpt2_generate", "bert_infer",
                          "vision_loader", "micro"}  # fmt: skip
    for name, row in loops.items():
        for mode in ("local", "tcp"):
            assert "error" not in row[mode], (name, mode, row[mode].get("error"))
        if name != "micro":
            assert row["tcp_ratio"] > 0
    assert result["link"]["link_gb_s"] > 0 and result["link"]["link_rtt_us"] > 0
    assert loops["micro"]["tcp"]["h2d_gb_s"] > 0
    assert "| gpt2_generate |" in done.stdout


def test_a_non_blocking_copy_into_shared_memory_keeps_its_place_in_the_stream(
    attach: Callable[..., Any],
) -> None:
    attach(2)
    stream = runtime.stream(1)
    assert stream.address.scheme == "unix"  # cuda:1 of the fixture: shared memory
    hosts = [torch.full((2 * (1 << 20),), float(i)).pin_memory() for i in range(3)]
    on_device = [h.to("cuda:1", non_blocking=True) for h in hosts]
    pageable = torch.arange(70_000.0).to("cuda:1")  # a blocking one between and after
    assert [t.mean().item() for t in on_device] == [0.0, 1.0, 2.0]
    assert torch.equal(pageable.cpu(), torch.arange(70_000.0))
    assert not stream.sending
