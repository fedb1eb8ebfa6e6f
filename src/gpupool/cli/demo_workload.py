"""The demo's training job: fit a small MLP to synthetic data for a few seconds on its lease.

Uses PyTorch (on the leased GPU when CUDA sees it) if installed, else numpy on the CPU, else
plain Python. Exits 0 only if the loss went down. Run it under `gpupool run`, or alone.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

REPORT_EVERY_S = 0.5
Step = Callable[[], float]


def _say(text: str) -> None:
    print(text, flush=True)


def _optional(module: str) -> Any:
    """Import an optional library (untyped here: the job runs with whichever is installed)."""
    try:
        with warnings.catch_warnings():
            # torch without numpy warns about it on import; the job does not need numpy.
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError:
        return None


def _torch_trainer(seed: int) -> tuple[str, Step] | None:
    torch = _optional("torch")
    if torch is None:
        return None
    use_cuda = bool(torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    name = f"cuda ({torch.cuda.get_device_name(0)})" if use_cuda else "cpu"
    # A GPU takes a real load; on a CPU (simulated GPUs) keep each step to milliseconds.
    samples, features, hidden = (16384, 64, 1024) if use_cuda else (2048, 32, 128)
    if not use_cuda:
        # Two demo jobs share the CPU: more threads each only fight over the cores.
        torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    teacher = torch.randn(features, 1, generator=generator) / math.sqrt(features)
    targets = torch.sin(2 * inputs @ teacher)
    inputs, targets = inputs.to(device), targets.to(device)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    ).to(device)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step() -> float:
        optimiser.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimiser.step()
        return float(loss.item())

    return f"torch {torch.__version__} on {name}", step


def _numpy_trainer(seed: int) -> tuple[str, Step] | None:
    np = _optional("numpy")
    if np is None:
        return None
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((2048, 32))
    teacher = rng.standard_normal((32, 1)) / 6
    targets = np.sin(inputs @ teacher * 4)
    w1 = rng.standard_normal((32, 128)) * math.sqrt(2 / 32)
    b1 = np.zeros(128)
    w2 = rng.standard_normal((128, 1)) * math.sqrt(1 / 128)
    b2 = np.zeros(1)
    params: list[Any] = [w1, b1, w2, b2]
    learning_rate = 0.05

    def step() -> float:
        hidden_in = inputs @ params[0] + params[1]
        hidden = np.maximum(hidden_in, 0)
        out = hidden @ params[2] + params[3]
        error = out - targets
        loss = float(np.mean(error**2))
        grad_out = 2 * error / len(inputs)
        grad_w2 = hidden.T @ grad_out
        grad_b2 = grad_out.sum(axis=0)
        grad_hidden = (grad_out @ params[2].T) * (hidden_in > 0)
        grad_w1 = inputs.T @ grad_hidden
        grad_b1 = grad_hidden.sum(axis=0)
        for param, grad in zip(params, (grad_w1, grad_b1, grad_w2, grad_b2), strict=True):
            param -= learning_rate * grad
        return loss

    return f"numpy {np.__version__} on cpu", step


def _python_trainer(seed: int) -> tuple[str, Step]:
    """The same MLP in plain Python, small enough to take a few hundred steps in seconds."""
    rng = random.Random(seed)
    n_in, n_hidden, n_samples = 6, 16, 96
    inputs = [[rng.gauss(0, 1) for _ in range(n_in)] for _ in range(n_samples)]
    teacher = [rng.gauss(0, 1) / 3 for _ in range(n_in)]
    targets = [
        math.sin(4 * sum(x * t for x, t in zip(row, teacher, strict=True))) for row in inputs
    ]
    w1 = [[rng.gauss(0, math.sqrt(2 / n_in)) for _ in range(n_hidden)] for _ in range(n_in)]
    b1 = [0.0] * n_hidden
    w2 = [rng.gauss(0, math.sqrt(1 / n_hidden)) for _ in range(n_hidden)]
    b2 = [0.0]
    learning_rate = 0.05

    def step() -> float:
        grad_w1 = [[0.0] * n_hidden for _ in range(n_in)]
        grad_b1 = [0.0] * n_hidden
        grad_w2 = [0.0] * n_hidden
        grad_b2 = 0.0
        total = 0.0
        for row, target in zip(inputs, targets, strict=True):
            pre = [b1[j] + sum(row[i] * w1[i][j] for i in range(n_in)) for j in range(n_hidden)]
            hidden = [max(p, 0.0) for p in pre]
            out = b2[0] + sum(h * w for h, w in zip(hidden, w2, strict=True))
            error = out - target
            total += error * error
            grad_out = 2 * error / n_samples
            grad_b2 += grad_out
            for j in range(n_hidden):
                grad_w2[j] += hidden[j] * grad_out
                if pre[j] > 0:
                    back = grad_out * w2[j]
                    grad_b1[j] += back
                    for i in range(n_in):
                        grad_w1[i][j] += row[i] * back
        for j in range(n_hidden):
            w2[j] -= learning_rate * grad_w2[j]
            b1[j] -= learning_rate * grad_b1[j]
            for i in range(n_in):
                w1[i][j] -= learning_rate * grad_w1[i][j]
        b2[0] -= learning_rate * grad_b2
        return total / n_samples

    return "plain Python on cpu", step


def choose_trainer(backend: str, seed: int) -> tuple[str, Step]:
    makers: dict[str, Callable[[int], tuple[str, Step] | None]] = {
        "torch": _torch_trainer,
        "numpy": _numpy_trainer,
        "python": _python_trainer,
    }
    order = ["torch", "numpy", "python"] if backend == "auto" else [backend]
    for name in order:
        made = makers[name](seed)
        if made is not None:
            return made
    raise SystemExit(f"backend {backend!r} is not installed")


def train(step: Step, seconds: float) -> tuple[int, float, float]:
    """Run steps for `seconds`, printing the loss; return (steps, first loss, last loss)."""
    started = time.monotonic()
    first = last = step()
    steps = 1
    next_report = started + REPORT_EVERY_S
    _say(f"step {steps:>6}  loss {first:.5g}")
    while time.monotonic() - started < seconds:
        last = step()
        steps += 1
        if time.monotonic() >= next_report:
            next_report += REPORT_EVERY_S
            _say(f"step {steps:>6}  loss {last:.5g}")
    return steps, first, last


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to train")
    parser.add_argument("--backend", choices=("auto", "torch", "numpy", "python"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    _say(f"lease                 {os.environ.get('GPUPOOL_LEASE_ID', '(none: not under gpupool)')}")
    _say(f"CUDA_VISIBLE_DEVICES  {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if share is not None:
        memory = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "-")
        _say(f"MPS limits            {share}% compute, memory {memory}")
    if os.environ.get("GPUPOOL_SIMULATED") == "1":
        _say("GPU                   SIMULATED (gpupool fake backend): training runs on the CPU")
    description, step = choose_trainer(args.backend, args.seed)
    _say(f"device                {description}")
    steps, first, last = train(step, args.seconds)
    decreased = last < first
    _say(
        f"result steps={steps} first_loss={first:.6g} final_loss={last:.6g} "
        f"{'ok: loss decreased' if decreased else 'FAILED: loss did not decrease'}"
    )
    return 0 if decreased else 1


if __name__ == "__main__":
    sys.exit(main())
