"""Ordinary PyTorch programs, written for a device, as users write them. Each returns host
tensors to compare between a local CPU run and a run on gpupool remote GPUs."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _data(
    n: int, *shape: int, classes: int = 0, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, classes, (n,), generator=g) if classes else torch.randn(n, 1, generator=g)
    return x, y


def _host(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def eager(step: Callable[..., Any]) -> Callable[..., Any]:
    """The training step as written; `gpupool.torch.capture` is the other `wrap`."""
    return step


# ---- MLP, SGD with momentum (foreach), on a DataLoader -----------------------------------


def mlp_training(device: str, wrap: Wrap = eager) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data(64, 8)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip

    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        return loss

    step = wrap(train_step)
    losses = []
    for _epoch in range(3):
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            losses.append(step(xb, yb).item())
    return {"losses": torch.tensor(losses), **_host(model)}


# ---- small CNN with batch norm, Adam, cross entropy, grad clipping ------------------------


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No biases before batch norm (as ResNets do): their exact gradient is zero, and Adam
        # would turn the rounding noise in it into full-size steps that no two runs share.
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.head(x)


def cnn_training(device: str, wrap: Wrap = eager) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _data(32, 3, 16, 16, classes=5)

    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    step = wrap(train_step)
    losses = []
    for i in range(6):
        xb, yb = x[i % 2 * 16 :][:16].to(device), y[i % 2 * 16 :][:16].to(device)
        losses.append(step(xb, yb).item())
    model.eval()
    with torch.no_grad():
        accuracy = (model(x.to(device)).argmax(1) == y.to(device)).float().mean()
    return {"losses": torch.tensor(losses), "accuracy": accuracy.cpu(), **_host(model)}


# ---- a small causal transformer under bf16 autocast, AdamW ------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, context: int = 16
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def transformer_bf16(device: str, wrap: Wrap = eager, steps: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    # SGD: its steps follow the gradients' size, so bf16-level gradient differences stay small
    # (Adam's sign-like steps would amplify them); Adam runs in the CNN program.
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (8, 17), generator=g)
    losses, dtypes = [], set()
    device_type = torch.device(device).type

    def train_step(idx: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            logits = model(idx)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss, logits

    step = wrap(train_step)
    for _step in range(steps):
        idx, target = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        loss, logits = step(idx, target)
        dtypes.add(logits.dtype)
        losses.append(loss.item())
    return {
        "losses": torch.tensor(losses),
        "logits_bf16": torch.tensor(dtypes == {torch.bfloat16}),
        **_host(model),
    }


def encoder_bf16(device: str, steps: int = 3) -> dict[str, Any]:
    """PyTorch's own nn.TransformerEncoder (nn.MultiheadAttention inside, whose projections
    reach attention in float32) under bf16 autocast, SGD."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)).to(device)
    head = nn.Linear(32, 5).to(device)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(6, 10, 32, generator=g), torch.randint(0, 5, (6,), generator=g)
    x, y = x.to(device), y.to(device)
    losses = []
    for _step in range(steps):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = F.cross_entropy(head(model(x).mean(dim=1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": torch.tensor(losses), **_host(model)}


# ---- checkpoint save and load in the middle of training ------------------------------------


def checkpoint_resume(device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    x, y = _data(16, 8)

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            F.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()

    model, opt = make()
    train(model, opt, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": 3}, buffer)
    checkpoint = buffer.getvalue()
    buffer.seek(0)
    state = torch.load(buffer)
    resumed, resumed_opt = make()
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["opt"])
    train(resumed, resumed_opt, 3)
    on_device = all(str(t.device).startswith(device) for t in state["model"].values())
    return {
        "resumed": _host(resumed),
        "state_on_device": torch.tensor(on_device),
        "checkpoint": checkpoint,
    }


# ---- a lease of two GPUs: a model split across them ----------------------------------------


def two_device_pipeline(devices: tuple[str, str], wrap: Wrap = eager) -> dict[str, Any]:
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(8, 16), nn.ReLU()).to(devices[0])
    second = nn.Sequential(nn.Linear(16, 4)).to(devices[1])
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    x, y = _data(16, 8, classes=4)

    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        hidden = first(xb)
        logits = second(hidden.to(devices[1]))
        loss = F.cross_entropy(logits, yb)
        loss.backward()
        opt.step()
        return loss

    step = wrap(train_step)
    losses = []
    for _ in range(4):
        losses.append(step(x.to(devices[0]), y.to(devices[1])).item())
    placed = (str(next(first.parameters()).device), str(next(second.parameters()).device))
    return {
        "losses": torch.tensor(losses),
        "placed": placed,
        "first": _host(first),
        "second": _host(second),
        "norm": torch.tensor(
            math.sqrt(sum(float(p.detach().pow(2).sum()) for p in first.parameters()))
        ),
    }


# ---- residual CNN (ResNet's bottleneck) under bf16 autocast, SGD with momentum --------------


class Bottleneck(nn.Module):
    def __init__(self, channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1:
            self.down = nn.Sequential(
                nn.Conv2d(channels, channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


def resnet_bf16(device: str, wrap: Wrap = eager, steps: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        Bottleneck(16, 8), Bottleneck(16, 8, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    ).to(device)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    x, y = _data(8, 3, 16, 16, classes=10)
    device_type = torch.device(device).type

    def train_step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    step = wrap(train_step)
    losses = []
    for _ in range(steps):
        losses.append(step(x.to(device), y.to(device)).item())
    return {"losses": torch.tensor(losses), **_host(model)}


# ---- recurrent stacks: LSTM, GRU, RNN, each way cuDNN runs them ----------------------------


RECURRENT_STACKS: dict[str, Callable[[], nn.Module]] = {
    "lstm, 2 layers": lambda: nn.LSTM(8, 6, 2),
    "lstm, 3 layers, dropout": lambda: nn.LSTM(8, 6, 3, dropout=0.3),
    "gru, 2 layers, dropout, batch first": lambda: nn.GRU(8, 6, 2, dropout=0.5,
                                                          batch_first=True),
    "lstm, bidirectional, batch first": lambda: nn.LSTM(8, 6, 2, bidirectional=True,
                                                        batch_first=True),
    "lstm with projections": lambda: nn.LSTM(8, 6, 2, proj_size=4),
    "lstm without biases": lambda: nn.LSTM(8, 6, bias=False),
    "lstm, float64": lambda: nn.LSTM(8, 6).double(),
    "gru, bidirectional": lambda: nn.GRU(8, 6, bidirectional=True),
    "gru, batch first, no biases": lambda: nn.GRU(8, 6, 2, batch_first=True, bias=False),
    "rnn tanh": lambda: nn.RNN(8, 6, 2),
    "rnn relu, bidirectional": lambda: nn.RNN(8, 6, nonlinearity="relu", bidirectional=True),
}  # fmt: skip
"""Stacks a local GPU runs through cuDNN, dropout between layers included."""


RECURRENT_OFF_CUDNN: dict[str, Callable[[], nn.Module]] = {
    "lstm, bfloat16": lambda: nn.LSTM(8, 6, 2, dropout=0.3).bfloat16(),
    "lstm with projections, bfloat16, batch first": lambda: nn.LSTM(
        8, 6, proj_size=4, batch_first=True).bfloat16(),
    "gru, bfloat16, bidirectional": lambda: nn.GRU(8, 6, bidirectional=True).bfloat16(),
    "gru without biases, bfloat16": lambda: nn.GRU(8, 6, bias=False).bfloat16(),
    "rnn tanh, bfloat16": lambda: nn.RNN(8, 6, 2).bfloat16(),
}  # fmt: skip
"""Stacks a local GPU runs without cuDNN (bfloat16): its fused cells, step by step."""


def recurrent_stacks(
    device: str, stacks: dict[str, Callable[[], nn.Module]] | None = None,
    autocast: bool = False, cudnn: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Each stack trained two steps (outputs, final states, the input's and every weight's
    gradients, a retained graph's second backward), then run in evaluation under no_grad, and
    each output's strides (a batch-first output is cuDNN's transposed one). `autocast` runs
    the forwards under torch.autocast (float16), `cudnn=False` with cuDNN off."""
    results: dict[str, Any] = {}
    device_type = torch.device(device).type
    with torch.backends.cudnn.flags(enabled=cudnn):
        for name, make in (RECURRENT_STACKS if stacks is None else stacks).items():
            _recurrent_stack(name, make, device, device_type, autocast, results)
    return results


def recurrent_off_cudnn(device: str) -> dict[str, Any]:
    """The bfloat16 stacks; float32 ones with cuDNN off; float32 ones under autocast."""
    some = dict(list(RECURRENT_STACKS.items())[:4])
    return {
        **recurrent_stacks(device, RECURRENT_OFF_CUDNN),
        **{f"no cudnn: {k}": v for k, v in recurrent_stacks(device, some, cudnn=False).items()},
        **{f"autocast: {k}": v for k, v in recurrent_stacks(device, some, autocast=True).items()},
    }


def _recurrent_stack(
    name: str, make: Callable[[], nn.Module], device: str, device_type: str, autocast: bool,
    results: dict[str, Any],
) -> None:  # fmt: skip
    torch.manual_seed(0)
    module = make().to(device)
    dtype = next(module.parameters()).dtype
    batch_first = module.batch_first
    x = torch.randn(3, 5, 8, dtype=dtype) if batch_first else torch.randn(5, 3, 8, dtype=dtype)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(2):
        inputs = x.clone().to(device).requires_grad_()  # a leaf of its own, locally too
        # The dropout between layers draws alike: a CPU worker's generator is not the
        # client's, which made the weights (a GPU's is neither's, locally and remotely).
        torch.manual_seed(10 + step)
        with torch.autocast(device_type, enabled=autocast):
            out, state = module(inputs)
        finals = list(state) if isinstance(state, tuple) else [state]
        loss = out.float().square().sum() + sum(f.float().sin().sum() for f in finals)
        opt.zero_grad()
        loss.backward(retain_graph=step == 0)
        if step == 0:
            (out.float().sum() * 2).backward()  # the retained graph, a second time
        assert inputs.grad is not None
        results[f"{name} {step} out"] = out.detach().cpu()
        results[f"{name} {step} stride"] = torch.tensor(out.stride())
        for i, f in enumerate(finals):
            results[f"{name} {step} final{i}"] = f.detach().cpu()
        results[f"{name} {step} dx"] = inputs.grad.cpu()
        for p_name, p in module.named_parameters():
            assert p.grad is not None
            results[f"{name} {step} d{p_name}"] = p.grad.cpu()
        opt.step()
    module.eval()
    with torch.no_grad(), torch.autocast(device_type, enabled=autocast):
        results[f"{name} eval"] = module(x.to(device))[0].cpu()
