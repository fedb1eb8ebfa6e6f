"""Training and inference loops written the way users write them, local and through the pool.

Each step of each loop moves a batch from host memory to the device and reads a value back
(`loss.item()`, or the output of an inference batch), as real programs do; the fine-tune also
clips gradients and steps an LR schedule. Loops:

  resnet50       ResNet-50, bf16 autocast, SGD, batch 64 of 224x224 images moved each step
  gpt2_finetune  GPT-2-small, 8x512 tokens, bf16 autocast, AdamW, clip_grad_norm_, LR schedule
  gpt2_generate  GPT-2-small greedy decoding of 32 new tokens at batch 1 (a step is one whole
                 generation; the sequence grows one token at a time)
  bert_infer     BERT-base inference in bf16, batch 32 of 128 tokens, the output read each batch
  vision_loader  a vision fine-tune fed by DataLoader(num_workers=4, pin_memory=True)

Models come from torchvision / transformers where installed (built from their configs: no
weights are downloaded), else from plain-torch definitions of the same shapes in this file.

Every loop runs in a fresh process three ways:
  local  the program with the device (a GPU; in --tiny mode plain CPU PyTorch);
  shm    attached to a worker on the same host over its Unix socket with shared memory;
  tcp    attached over TCP without shared memory: where this process may create network
         namespaces (root, iproute2) the client runs in a namespace of its own joined to the
         worker's by a veth pair (a real interface), else on loopback.
The link's own bandwidth and round trip are measured in the same run, between the same two
namespaces (or on loopback), by a plain socket, so the TCP ratios can be judged against the
wire. Micro-benchmarks per transport: `.item()` round trip, host-to-device and device-to-host
bandwidth through the pool (pinned, non_blocking), how long `x.to("cuda", non_blocking=True)`
takes to return, and the client's time per decoded token with its shape-inference misses.

    python bench/remote_real.py                 # GPU server: writes bench/results/remote_real.json
    python bench/remote_real.py --tiny          # tiny models on CPU workers, about 2 minutes
    python bench/remote_real.py --only gpt2_generate,micro --transports shm

`--tiny` writes bench/results/remote_real_tiny.json (CPU ratios show the client's overhead,
not the GPU targets). `--table` prints the README table of a results file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "remote_real.json"
TINY_RESULTS = ROOT / "bench" / "results" / "remote_real_tiny.json"
TOKEN = "bench-remote-real"
LEASE = "bench-real"
LOOPS = ("resnet50", "gpt2_finetune", "gpt2_generate", "bert_infer", "vision_loader")
TRANSPORTS = ("shm", "tcp")
TARGETS = {
    # (shm, tcp) ratio targets of the issue on the GPU machine
    "resnet50": (1.05, 1.15),
    "gpt2_finetune": (1.05, 1.15),
    "vision_loader": (1.05, 1.15),
    "gpt2_generate": (1.3, 1.5),
    "bert_infer": (1.1, None),
}
NS_ADDRESSES = ("10.231.0.1", "10.231.0.2")
"""The worker's and the client's ends of the veth pair (a private /30 inside two namespaces)."""


# ---- plain-torch models (used where torchvision / transformers are not installed) ----------


def plain_resnet(layers: tuple[int, ...], width: int, classes: int) -> Any:
    """torchvision's ResNet (bottleneck blocks) in plain torch."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, mid: int, stride: int) -> None:
            super().__init__()
            cout = mid * 4
            self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(mid)
            self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(mid)
            self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: Any) -> Any:
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + (x if self.down is None else self.down(x)))

    blocks: list[nn.Module] = [
        nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]  # fmt: skip
    cin = width
    for i, count in enumerate(layers):
        mid = width * (2**i)
        for j in range(count):
            blocks.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
            cin = mid * 4
    blocks += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*blocks)


def vision_model(tiny: bool, small: bool = False) -> Any:
    """ResNet-50 (small: ResNet-18 for the loader fine-tune), torchvision's where present."""
    if tiny:
        return plain_resnet((1, 1, 1, 1), 8, 10)
    try:
        import torchvision
    except ImportError:
        return plain_resnet((2, 2, 2, 2) if small else (3, 4, 6, 3), 64, 1000)
    return (torchvision.models.resnet18 if small else torchvision.models.resnet50)(weights=None)


class PlainGPT2:
    """GPT-2 in plain torch (tied embedding and head, pre-norm blocks, SDPA), with the
    `past` key/value list a hand-written decoding loop keeps."""

    @staticmethod
    def build(vocab: int, positions: int, dim: int, layers: int, heads: int) -> Any:
        import torch
        import torch.nn.functional as F
        from torch import nn

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
                self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
                self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

            def forward(self, x: Any, past: Any) -> tuple[Any, Any]:
                b, t, _ = x.shape
                q, k, v = self.qkv(self.ln1(x)).split(dim, dim=2)
                q, k, v = (z.view(b, t, heads, dim // heads).transpose(1, 2) for z in (q, k, v))
                if past is not None:
                    k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
                x = x + self.proj(a.transpose(1, 2).reshape(b, t, dim))
                x = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
                return x, (k, v)

        class GPT2(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
                self.blocks = nn.ModuleList(Block() for _ in range(layers))
                self.ln_f = nn.LayerNorm(dim)
                self.vocab = vocab

            def forward(self, ids: Any, past: Any = None) -> tuple[Any, Any]:
                start = 0 if past is None else past[0][0].shape[2]
                pos = torch.arange(start, start + ids.shape[1], device=ids.device)
                x = self.wte(ids) + self.wpe(pos)
                presents = []
                for i, block in enumerate(self.blocks):
                    x, kv = block(x, None if past is None else past[i])
                    presents.append(kv)
                return F.linear(self.ln_f(x), self.wte.weight), presents

        return GPT2()


def gpt2_model(tiny: bool) -> tuple[Any, bool]:
    """(model, is_transformers): GPT-2-small from transformers' config where installed."""
    if tiny:
        return PlainGPT2.build(256, 256, 64, 2, 4), False
    try:
        import transformers
    except ImportError:
        return PlainGPT2.build(50257, 1024, 768, 12, 12), False
    config = transformers.GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    config._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(config), True


def bert_model(tiny: bool) -> tuple[Any, bool]:
    """(model, is_transformers): BERT-base, or PyTorch's own transformer encoder of its shape."""
    import torch
    from torch import nn

    if not tiny:
        try:
            import transformers

            config = transformers.BertConfig()
            config._attn_implementation = "sdpa"
            return transformers.BertModel(config, add_pooling_layer=False), True
        except ImportError:
            pass
    dim, layers, heads, vocab = (64, 2, 4, 256) if tiny else (768, 12, 12, 30522)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(512, dim)
            self.norm = nn.LayerNorm(dim)
            layer = nn.TransformerEncoderLayer(
                dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        def forward(self, ids: Any) -> Any:
            pos = torch.arange(ids.shape[1], device=ids.device)
            return self.encoder(self.norm(self.tok(ids) + self.pos(pos)))

    return Encoder(), False


# ---- the loops: each returns step() -> the value it logged ------------------------------


def sizes(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"image": 32, "batch": 8, "classes": 10, "seq": 32, "ft_batch": 4, "vocab": 256,
                "prompt": 8, "new_tokens": 32, "bert_batch": 8, "bert_seq": 32,
                "loader_batch": 8, "loader_images": 64}  # fmt: skip
    return {"image": 224, "batch": 64, "classes": 1000, "seq": 512, "ft_batch": 8,
            "vocab": 50257, "prompt": 16, "new_tokens": 32, "bert_batch": 32, "bert_seq": 128,
            "loader_batch": 64, "loader_images": 512}  # fmt: skip


def pinned(tensor: Any) -> Any:
    """Pinned where there is an accelerator (a GPU, or a remote one); plain CPU runs cannot."""
    import torch

    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def vision_step(model: Any, opt: Any, images: Any, labels: Any, device: str, kind: str) -> float:
    """One step as a user writes it: the batch moved (non-blocking), a bf16 autocast forward,
    backward, the optimizer's step, and the loss read."""
    import torch
    import torch.nn.functional as F

    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    with torch.autocast(kind, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(images), labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.item())


def resnet50_loop(device: str, tiny: bool) -> Callable[[], float]:
    import torch

    s = sizes(tiny)
    model = vision_model(tiny).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    # A few host batches in pinned memory, cycled: each step moves one to the device.
    batches = [
        (
            pinned(torch.randn(s["batch"], 3, s["image"], s["image"])),
            pinned(torch.randint(0, s["classes"], (s["batch"],))),
        )
        for _ in range(4)
    ]
    state = {"i": 0}
    kind = torch.device(device).type

    def step() -> float:
        images, labels = batches[state["i"] % len(batches)]
        state["i"] += 1
        return vision_step(model, opt, images, labels, device, kind)

    return step


def gpt2_finetune_loop(device: str, tiny: bool) -> Callable[[], float]:
    import torch
    import torch.nn.functional as F

    s = sizes(tiny)
    model, is_hf = gpt2_model(tiny)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: min(1.0, (n + 1) / 10))
    vocab = s["vocab"]
    batches = [torch.randint(0, vocab, (s["ft_batch"], s["seq"])) for _ in range(4)]
    state = {"i": 0}
    kind = torch.device(device).type

    def step() -> float:
        tokens = batches[state["i"] % len(batches)].to(device)
        state["i"] += 1
        with torch.autocast(kind, dtype=torch.bfloat16):
            if is_hf:
                loss = model(input_ids=tokens, labels=tokens).loss
            else:
                logits, _ = model(tokens)
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1)
                )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        return loss.item()

    return step


def greedy_generate(model: Any, ids: Any, new_tokens: int, is_hf: bool) -> Any:
    """Greedy decoding as a user writes it: transformers' generate(), else a loop over the
    model with its key/value list, one token appended per step."""
    import torch

    if is_hf:
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    logits, past = model(ids)
    out = ids
    for _ in range(new_tokens):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, token], 1)
        logits, past = model(token, past)
    return out


def gpt2_generate_loop(device: str, tiny: bool) -> Callable[[], float]:
    import torch

    s = sizes(tiny)
    model, is_hf = gpt2_model(tiny)
    model.to(device).eval()
    state = {"i": 0}

    def step() -> float:
        # Every request has a prompt of a length not seen before, as in serving: no shape of
        # one generation repeats one of an earlier generation.
        ids = torch.randint(0, s["vocab"], (1, s["prompt"] + state["i"])).to(device)
        state["i"] += 1
        with torch.no_grad():
            out = greedy_generate(model, ids, s["new_tokens"], is_hf)
        return float(out[0, -1].item())

    return step


def bert_infer_loop(device: str, tiny: bool) -> Callable[[], float]:
    import torch

    s = sizes(tiny)
    model, is_hf = bert_model(tiny)
    model.to(device, dtype=torch.bfloat16).eval()
    vocab = 256 if tiny else 30522
    batches = [torch.randint(0, vocab, (s["bert_batch"], s["bert_seq"])) for _ in range(4)]
    state = {"i": 0}

    def step() -> float:
        ids = batches[state["i"] % len(batches)].to(device)
        state["i"] += 1
        with torch.no_grad():
            out = model(input_ids=ids).last_hidden_state if is_hf else model(ids)
            cls = out[:, 0].float().cpu()  # the embeddings a serving loop hands on
        return float(cls[0, 0])

    return step


class ImageSet:
    """Images held as uint8 in host memory, normalised to float in the loader's workers."""

    def __init__(self, count: int, size: int, classes: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, classes, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.images[i].float().div_(255.0).sub_(0.5), self.labels[i]


def vision_loader_loop(device: str, tiny: bool) -> Callable[[], float]:
    import torch

    s = sizes(tiny)
    model = vision_model(tiny, small=True).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = torch.utils.data.DataLoader(
        ImageSet(s["loader_images"], s["image"], s["classes"]), batch_size=s["loader_batch"],
        shuffle=True, num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True,
    )  # fmt: skip
    batches: Iterator[Any] = iter(())
    kind = torch.device(device).type

    def step() -> float:
        nonlocal batches
        try:
            images, labels = next(batches)
        except StopIteration:
            batches = iter(loader)
            images, labels = next(batches)
        return vision_step(model, opt, images, labels, device, kind)

    return step


BUILDERS: dict[str, Callable[[str, bool], Callable[[], float]]] = {
    "resnet50": resnet50_loop,
    "gpt2_finetune": gpt2_finetune_loop,
    "gpt2_generate": gpt2_generate_loop,
    "bert_infer": bert_infer_loop,
    "vision_loader": vision_loader_loop,
}
STEPS = {"resnet50": 20, "gpt2_finetune": 15, "gpt2_generate": 4, "bert_infer": 30,
         "vision_loader": 20}  # fmt: skip
WARMUP = {"resnet50": 3, "gpt2_finetune": 3, "gpt2_generate": 1, "bert_infer": 3,
          "vision_loader": 3}  # fmt: skip


# ---- measurements inside the child process ---------------------------------------------


_COUNTER_SYNCS = 0
"""The round trips client_counters made itself (not the loop's)."""


def client_counters() -> dict[str, float]:
    """The client's shape-inference and round-trip counters (zeros when not attached), and the
    worker's busy time while attached (read at a sync, so the step's ops are counted)."""
    if "gpupool.torch" not in sys.modules:
        return {"plan_misses": 0, "rule_plans": 0, "round_trips": 0}
    from gpupool.torch import runtime, shapes

    if not runtime.attached():
        return {"plan_misses": 0, "rule_plans": 0, "round_trips": 0}
    # The worker's own time (decoding, ops, launches) and, of it, its CPU time: where the
    # worker's time per step nears the step's, the worker, not the client, bounds the loop.
    # The sync comes first, so its own round trip is not one of the step's.
    global _COUNTER_SYNCS
    stats = runtime.stream(0).sync()
    _COUNTER_SYNCS += 1
    counts = shapes.inference_counts()
    return {
        "plan_misses": counts["meta"],
        "rule_plans": counts["rules"],
        "round_trips": runtime.stream(0).round_trips - _COUNTER_SYNCS,
        "worker_busy_ms": stats.get("busy_s", 0.0) * 1e3,
        "worker_busy_cpu_ms": stats.get("busy_cpu_s", 0.0) * 1e3,
    }


def time_loop(name: str, device: str, tiny: bool, steps: int) -> dict[str, Any]:
    step = BUILDERS[name](device, tiny)
    for _ in range(WARMUP[name]):
        step()
    before = client_counters()
    times, cpu = [], time.thread_time()
    for _ in range(steps):
        start = time.perf_counter()
        step()  # every loop reads a value at its end: the step's time includes the device's
        times.append(time.perf_counter() - start)
    cpu = time.thread_time() - cpu
    after = client_counters()
    per_step = {k: (after[k] - before[k]) / steps for k in after}
    return {
        "ms": statistics.median(times) * 1e3,
        "mean_ms": sum(times) / steps * 1e3,
        "client_cpu_ms": cpu / steps * 1e3,
        "steps": steps,
        **{f"{k}_per_step": v for k, v in per_step.items()},
    }


def micro(device: str, tiny: bool) -> dict[str, Any]:
    """Per transport: .item() round trip, copy bandwidth, non_blocking return time, and the
    client's time and shape-inference misses per decoded token."""
    import torch

    out: dict[str, Any] = {}
    x = torch.zeros((), device=device)
    for _ in range(50):
        x.add_(1).item()
    reads = 200 if tiny else 2000
    start = time.perf_counter()
    for _ in range(reads):
        x.add_(1).item()
    out["item_us"] = (time.perf_counter() - start) / reads * 1e6
    # A read behind a queue of small ops waits for them to run, never for a batching delay.
    y = torch.zeros(64, device=device)
    times = []
    for _ in range(30 if tiny else 200):
        for _ in range(20):
            y = y + 1
        start = time.perf_counter()
        y[0].item()
        times.append(time.perf_counter() - start)
    out["item_after_20_ops_us"] = statistics.median(times) * 1e6

    mib = 32 if tiny else 512
    host = pinned(torch.randn(mib * (1 << 20) // 4))
    dev = host.to(device, non_blocking=True)
    sync(device)
    h2d, d2h, returns = [], [], []
    for _ in range(3):
        start = time.perf_counter()
        dev = host.to(device, non_blocking=True)
        returns.append(time.perf_counter() - start)
        sync(device)
        h2d.append(time.perf_counter() - start)
        start = time.perf_counter()
        back = dev.cpu()
        d2h.append(time.perf_counter() - start)
    assert torch.equal(back, host), "the bytes came back different"
    gb = mib * (1 << 20) / 1e9
    out |= {"copy_mib": mib, "h2d_gb_s": gb / min(h2d), "d2h_gb_s": gb / min(d2h),
            "non_blocking_return_ms": min(returns) * 1e3}  # fmt: skip
    del host, dev, back
    # Decoding: the client's time per token, its meta-kernel misses and round trips, with
    # the shape rules off (every miss a meta-kernel call, attention asking the worker for its
    # kernel at every new shape) and on; each run's prompt length is new, so no exact shape
    # repeats. "kv": a loop with a key/value list; "full": the whole sequence every token.
    model = PlainGPT2.build(256, 1024, 64, 2, 4).to(device).eval()
    tokens = 24 if tiny else 48
    length = 8
    for variant in ("kv", "full"):
        for label, enabled in (("before", False), ("after", True)):
            set_rules(enabled)
            ids = torch.randint(0, 256, (1, length)).to(device)
            length += tokens + 1
            with torch.no_grad():
                before = client_counters()
                start, cpu = time.perf_counter(), time.thread_time()
                decode(model, ids, tokens, variant == "kv").cpu()
                wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
                after = client_counters()
            prefix = f"decode_{variant}_{label}_"
            out |= {
                f"{prefix}ms_per_token": wall / tokens * 1e3,
                f"{prefix}client_cpu_ms_per_token": cpu / tokens * 1e3,
                f"{prefix}meta_misses_per_token": (after["plan_misses"] - before["plan_misses"])
                / tokens,
                f"{prefix}round_trips_per_token": (after["round_trips"] - before["round_trips"])
                / tokens,
            }
    set_rules(True)
    return out


def decode(model: Any, ids: Any, tokens: int, kv: bool) -> Any:
    """Greedy decoding with the key/value list (kv), or the whole sequence every token."""
    import torch

    if kv:
        return greedy_generate(model, ids, tokens, False)
    for _ in range(tokens):
        logits, _ = model(ids)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def set_rules(enabled: bool) -> None:
    if "gpupool.torch" in sys.modules:
        from gpupool.torch import rules

        rules.ENABLED = enabled


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    remote = spec["mode"] != "local"
    if remote:
        import gpupool.torch

        gpupool.torch.attach(workers=[spec["address"]], token=TOKEN, lease=LEASE)
    device = "cpu" if spec["tiny"] and not remote else "cuda"
    if spec["tiny"]:
        torch.set_num_threads(1)  # as the CPU worker: one thread each on a small host
    torch.manual_seed(0)
    if spec["what"] == "micro":
        result = micro(device, spec["tiny"])
    else:
        result = time_loop(spec["what"], device, spec["tiny"], spec["steps"])
    if remote:
        from gpupool.torch import dispatch

        result["fastpath"] = dispatch.fastpath_active()
    return result


# ---- the link's own speed: a plain socket between the same two ends --------------------


def link_server(host: str) -> None:
    """Serves on host: 'B n' → read n bytes and answer one byte; 'P n' → n one-byte echoes."""
    listener = socket.create_server((host, 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = conn.recv(64).decode()
            kind, count = head.split()[:2]
            n = int(count)
            if kind == "B":
                buf = bytearray(8 << 20)
                got = 0
                while got < n:
                    r = conn.recv_into(buf)
                    if not r:
                        break
                    got += r
                conn.sendall(b"k")
            elif kind == "P":
                conn.sendall(b"r")
                for _ in range(n):
                    conn.sendall(conn.recv(1))
            elif kind == "Q":
                return


def link_client(host: str, port: int, mib: int) -> dict[str, float]:
    """The link's bandwidth (GB/s, best of 3) and round trip (median µs of one-byte echoes)."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * mib)
    best = math.inf
    for _ in range(3):
        with socket.create_connection((host, port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = time.perf_counter()
            conn.sendall(f"B {len(payload)} ".ljust(64).encode())
            conn.sendall(payload)
            conn.recv(1)
            best = min(best, time.perf_counter() - start)
    rtts = []
    with socket.create_connection((host, port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        n = 2000
        conn.sendall(f"P {n} ".ljust(64).encode())
        conn.recv(1)
        for _ in range(n):
            start = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            rtts.append(time.perf_counter() - start)
    return {"link_gb_s": len(payload) / best / 1e9, "link_rtt_us": statistics.median(rtts) * 1e6}


# ---- hosts: two network namespaces joined by a veth pair, or loopback -------------------


class Link:
    """Where the TCP worker listens and how a process is started on either end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.kind = "loopback"
        self.worker_host = self.client_host = "127.0.0.1"
        self.namespaces: list[str] = []
        self.why = ""
        try:
            self._veth()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self.close()
            self.kind, self.worker_host, self.client_host = "loopback", "127.0.0.1", "127.0.0.1"
            self.why = str(exc)[:300]

    def _veth(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise RuntimeError("no root or no iproute2: TCP on loopback")
        tag = uuid.uuid4().hex[:6]
        worker_ns, client_ns = f"gprr-{tag}-w", f"gprr-{tag}-c"
        for ns in (worker_ns, client_ns):
            ip("netns", "add", ns)
            self.namespaces.append(ns)
        ip("link", "add", "eth0", "netns", worker_ns, "type", "veth",
           "peer", "name", "eth0", "netns", client_ns)  # fmt: skip
        for ns, address in zip((worker_ns, client_ns), NS_ADDRESSES, strict=True):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{address}/30", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        self.kind = "veth"
        self.worker_host, self.client_host = NS_ADDRESSES
        self.worker_ns, self.client_ns = worker_ns, client_ns

    def prefix(self, end: str) -> list[str]:
        if self.kind != "veth":
            return []
        return ["ip", "netns", "exec", self.worker_ns if end == "worker" else self.client_ns]

    def python(self, end: str) -> str:
        """An executable that starts Python on that end (what worker_argv takes as `python`)."""
        if self.kind != "veth":
            return sys.executable
        path = self.tmp / f"python-{end}"
        path.write_text(f'#!/bin/sh\nexec {" ".join(self.prefix(end))} "{sys.executable}" "$@"\n')
        path.chmod(0o755)
        return str(path)

    def close(self) -> None:
        for ns in self.namespaces:
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            ip("netns", "del", ns, check=False)
        self.namespaces = []


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def measure_link(link: Link, mib: int) -> dict[str, Any]:
    server = subprocess.Popen(
        [*link.prefix("worker"), sys.executable, __file__, "--link-server", link.worker_host],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        done = subprocess.run(
            [*link.prefix("client"), sys.executable, __file__, "--link-client",
             f"{link.worker_host}:{port}:{mib}"],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
        if done.returncode:
            return {"error": done.stderr[-2000:]}
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()


# ---- the parent ------------------------------------------------------------------------


def run_child(
    spec: dict[str, Any], prefix: list[str], gpu_visible: bool, timeout_s: float
) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    if not gpu_visible:
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        done = subprocess.run(
            [*prefix, sys.executable, __file__, "--child", json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode:
        return {"error": (done.stderr or done.stdout)[-3000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def machine(tiny: bool) -> str:
    cpu = f"{platform.machine()}, {os.cpu_count()} cores"
    if tiny:
        return f"CPU workers ({cpu})"
    try:
        name = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.splitlines()[0]  # fmt: skip
    except (OSError, IndexError, subprocess.SubprocessError):
        name = "unknown GPU"
    return f"{name} ({cpu})"


def start_worker(listen: str, device: str, python: str, tiny: bool, log: Path) -> tuple[Any, str]:
    from gpupool.protocol.v1.dataplane import start_worker_process

    env = {**os.environ, "OMP_NUM_THREADS": "1"} if tiny else None
    proc, ready = start_worker_process(
        LEASE, TOKEN, device=device, listen=listen, python=python,
        threads=1 if tiny else None, env=env, log_file=log,
    )  # fmt: skip
    return proc, str(ready.address)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models, CPU workers")
    parser.add_argument("--only", default="", help="loops (and/or 'micro'), comma-separated")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--steps-scale", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="per child, seconds")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--label", default="", help="a name for this run in the results file")
    parser.add_argument("--table", type=Path, help="print the README table of a results file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--link-server", help=argparse.SUPPRESS)
    parser.add_argument("--link-client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        try:
            print(json.dumps(child(json.loads(args.child))), flush=True)
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    if args.link_server:
        link_server(args.link_server)
        return 0
    if args.link_client:
        host, port, mib = args.link_client.rsplit(":", 2)
        print(json.dumps(link_client(host, int(port), int(mib))))
        return 0
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0

    sys.path.insert(0, str(ROOT / "src"))
    # `timeout` and Ctrl-C alike: the workers and namespaces go with the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # micro first: its copy bandwidth and per-token numbers survive a run cut short.
    wanted = [w for w in args.only.split(",") if w] or ["micro", *LOOPS]
    unknown = set(wanted) - {*LOOPS, "micro"}
    if unknown:
        parser.error(f"unknown loops {sorted(unknown)}; known: {', '.join(LOOPS)}, micro")
    transports = [t for t in args.transports.split(",") if t]
    if set(transports) - set(TRANSPORTS):
        parser.error(f"transports are {', '.join(TRANSPORTS)}")
    device = "cpu" if args.tiny else "cuda:0"
    out_path = args.out or (TINY_RESULTS if args.tiny else RESULTS)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpupool-real-") as tmpdir:
        tmp = Path(tmpdir)
        link = Link(tmp) if "tcp" in transports else None
        workers: dict[str, tuple[Any, str]] = {}
        starts: dict[str, Callable[[], tuple[Any, str]]] = {}
        if "shm" in transports:
            starts["shm"] = lambda: start_worker(
                f"unix:{tmp}/w.sock", device, sys.executable, args.tiny, tmp / "shm.log"
            )
        if link is not None:
            python = link.python("worker")
            starts["tcp"] = lambda: start_worker(
                f"tcp://{link.worker_host}:0", device, python, args.tiny, tmp / "tcp.log"
            )
        try:
            for transport, start in starts.items():
                workers[transport] = start()
            wire = measure_link(link, 32 if args.tiny else 512) if link else {}
            print(f"link: {link.kind if link else '-'} {json.dumps(wire)}", flush=True)
            for what in wanted:
                scale = args.steps_scale * (0.5 if args.tiny else 1.0)
                steps = max(2, round(STEPS.get(what, 1) * scale))
                spec = {"what": what, "tiny": args.tiny, "steps": steps}
                row: dict[str, Any] = {"loop": what}
                row["local"] = run_child({**spec, "mode": "local"}, [], not args.tiny, args.timeout)
                for transport in list(workers):
                    proc, address = workers[transport]
                    if proc.poll() is not None:  # it died: say so, and start another
                        log = (tmp / f"{transport}.log").read_text(errors="replace")[-2000:]
                        print(f"{transport} worker exited ({proc.returncode}):\n{log}",
                              file=sys.stderr, flush=True)  # fmt: skip
                        row.setdefault("worker_restarts", []).append(transport)
                        workers[transport] = proc, address = starts[transport]()
                    prefix = link.prefix("client") if transport == "tcp" and link else []
                    row[transport] = run_child(
                        {**spec, "mode": transport, "address": address}, prefix, False,
                        args.timeout,
                    )  # fmt: skip
                local_ms = row.get("local", {}).get("ms")
                for transport in workers if what != "micro" else ():
                    ms = row[transport].get("ms")
                    if local_ms and ms:
                        row[f"{transport}_ratio"] = ms / local_ms
                if what == "micro" and "tcp" in row and "link_gb_s" in wire:
                    row["tcp_h2d_of_link"] = row["tcp"].get("h2d_gb_s", 0) / wire["link_gb_s"]
                    row["tcp_item_over_link_rtt"] = (
                        row["tcp"].get("item_us", 0) / wire["link_rtt_us"]
                    )
                rows.append(row)
                print(summary_line(row), flush=True)
                # Written after every loop: a run cut short keeps what it measured.
                write_results(out_path, args, link, wire, started, rows)
        finally:
            for proc, _ in workers.values():
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                if proc.poll() is None:
                    proc.kill()
            if link is not None:
                link.close()
    result = write_results(out_path, args, link, wire, started, rows)
    print(table(result))
    print(f"wrote {out_path} in {result['seconds']} s")
    return 0


def write_results(
    path: Path, args: Any, link: Link | None, wire: dict[str, Any], started: float,
    rows: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    result = {
        "label": args.label or ("tiny" if args.tiny else "gpu"),
        "machine": machine(args.tiny),
        "tiny": args.tiny,
        "link": {"kind": link.kind if link else None, "why": link.why if link else "", **wire},
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary_line(row: dict[str, Any]) -> str:
    parts = [f"{row['loop']}:"]
    for mode in ("local", *TRANSPORTS):
        cell = row.get(mode)
        if cell is None:
            continue
        if "error" in cell:
            parts.append(f"{mode} ERROR {cell['error'].strip().splitlines()[-1][:160]}")
        elif "ms" in cell:
            parts.append(f"{mode} {cell['ms']:.2f} ms")
        else:
            parts.append(f"{mode} " + " ".join(f"{k}={v:.3g}" for k, v in cell.items()
                                               if isinstance(v, float)))  # fmt: skip
    return " | ".join(parts)


def table(result: dict[str, Any]) -> str:
    """The README's table: local time, each transport's ratio (target in brackets)."""
    wire = result.get("link", {})
    lines = [
        f"{result.get('machine')}; TCP over {wire.get('kind')}: link "
        f"{wire.get('link_gb_s', 0):.2f} GB/s, round trip {wire.get('link_rtt_us', 0):.0f} us",
        "",
        "| loop | local | Unix + shm | TCP |",
        "|---|---|---|---|",
    ]
    micro_row = None
    for row in result["rows"]:
        if row["loop"] == "micro":
            micro_row = row
            continue
        local = row.get("local", {})
        cells = [row["loop"], f"{local['ms']:.1f} ms" if "ms" in local else "error"]
        for i, transport in enumerate(TRANSPORTS):
            ratio = row.get(f"{transport}_ratio")
            target = TARGETS.get(row["loop"], (None, None))[i]
            if ratio is not None:
                cells.append(f"{ratio:.2f}x" + (f" (<= {target})" if target else ""))
            elif transport in row:
                cells.append("error")
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    if micro_row is not None:
        lines += ["", "| micro | local | Unix + shm | TCP |", "|---|---|---|---|"]
        keys = ["item_us", "item_after_20_ops_us", "h2d_gb_s", "d2h_gb_s",
                "non_blocking_return_ms"]  # fmt: skip
        keys += [f"decode_{variant}_{when}_{what}" for variant in ("kv", "full")
                 for what in ("ms_per_token", "client_cpu_ms_per_token",
                              "meta_misses_per_token", "round_trips_per_token")
                 for when in ("before", "after")]  # fmt: skip
        for key in keys:
            cells = [key]
            for transport in ("local", *TRANSPORTS):
                value = micro_row.get(transport, {}).get(key)
                cells.append("-" if value is None else f"{value:.3g}")
            lines.append("| " + " | ".join(cells) + " |")
        if "tcp_h2d_of_link" in micro_row:
            lines.append(
                f"\nH2D through the pool over TCP: {micro_row['tcp_h2d_of_link']:.0%} of the "
                f"link (target >= 80 %); .item() {micro_row['tcp_item_over_link_rtt']:.2f}x "
                "the link's round trip"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
