"""Captured steps on real CPU workers: replays give eager's results, and whatever would change
the program falls back or captures again, with a warning, never a wrong result."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conformance_programs import (
    cnn_training,
    mlp_training,
    resnet_bf16,
    transformer_bf16,
    two_device_pipeline,
)
from test_conformance import assert_same
from torch import nn

import gpupool.torch
from gpupool.torch import CapturedStep, CaptureWarning
from gpupool.worker.program import GRAPH_AFTER_RUNS
from tests.torch.conftest import WORKER_DEVICE

pytestmark = pytest.mark.slow

SAME: dict[str, float] = (
    {"rtol": 0.0, "atol": 0.0} if WORKER_DEVICE == "cpu" else {"rtol": 1e-3, "atol": 1e-4}
)
"""Captured against eager on the same worker: bitwise on a CPU worker; on a GPU, CUDA graph
replays may pick other kernels (and atomics make some kernels order-dependent)."""
REPLAY_MODE = "ops" if WORKER_DEVICE == "cpu" else "graph"
AGAINST_LOCAL = WORKER_DEVICE == "cpu"
"""Local runs are CPU runs here: against a CUDA worker that compares CPU and GPU kernels, which
test_conformance_gpu does with a local GPU; captured and eager on one worker is what counts."""


class Capturing:
    """A `wrap` for the conformance programs that keeps the steps it captured."""

    def __init__(self) -> None:
        self.steps: list[CapturedStep] = []

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        step = gpupool.torch.capture(fn)
        self.steps.append(step)
        return step  # type: ignore[no-any-return]


@pytest.fixture
def capturing(attach: Callable[..., Any]) -> Iterator[Capturing]:
    attach()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)  # a silent fallback would hide a bug
        warnings.filterwarnings("ignore", "gpupool.torch.capture: .* now keeps its step count")
        yield Capturing()


CAPTURED_STEPS = 6
"""Calls of a step for a CUDA graph replay: warm-up recordings (an optimizer makes its state on
the first call, so the 2nd and 3rd recordings are the ones that match and define the program),
then GRAPH_AFTER_RUNS RUNs op by op on the worker, then the capture, then a replay."""


def replayed(capturing: Capturing) -> None:
    """Every step is replayed by its worker, and every program that ran past the worker's warm-up
    runs as REPLAY_MODE (a CUDA graph on a GPU worker): a program still op by op after that fell
    back, and the worker's log says at which op and why."""
    assert capturing.steps and all(s.replaying for s in capturing.steps)
    programs = [p for s in capturing.steps for p in s.worker_programs()]
    settled = [mode for mode, runs in programs if runs > GRAPH_AFTER_RUNS]
    assert settled, f"no program ran past the worker's warm-up (mode, runs): {programs}"
    assert all(mode == REPLAY_MODE for mode in settled), f"(mode, runs): {programs}"


# ---- the conformance programs with their training step captured ------------------------------


def test_captured_mlp_step_matches_eager_and_local(capturing: Capturing) -> None:
    local = mlp_training("cpu")
    eager = mlp_training("cuda")
    captured = mlp_training("cuda", capturing)
    replayed(capturing)
    assert_same(eager, captured, rtol=max(SAME["rtol"], 1e-6), atol=max(SAME["atol"], 1e-7))
    if AGAINST_LOCAL:
        assert_same(local, captured, rtol=1e-4, atol=1e-5)


def test_a_step_compiled_by_inductor_on_the_worker_matches_eager(attach: Callable[..., Any]) -> None:
    """capture(compile=True): after one op-by-op RUN the worker compiles the program with
    Inductor (C++ kernels on this CPU worker, Triton on a CUDA one) and the step's losses and
    weights stay those of eager execution, to float rounding (Inductor fuses the arithmetic)."""
    attach()
    steps: list[CapturedStep] = []

    def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
        steps.append(gpupool.torch.capture(fn, compile=True))
        return steps[-1]

    eager = mlp_training("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        got = mlp_training("cuda", compiled)
    programs = [p for s in steps for p in s.worker_programs()]
    settled = [mode for mode, runs in programs if runs > 1]
    assert not [why for s in steps for why in s.not_compiled()]
    assert settled and all(mode.startswith("inductor") for mode in settled), programs
    assert_same(eager, got, rtol=1e-4, atol=1e-5)


def test_captured_cnn_step_with_adam_and_clipping_matches_eager_and_local(
    capturing: Capturing, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = cnn_training("cpu")
    captured = cnn_training("cuda", capturing)
    replayed(capturing)
    # Captured Adam keeps its step count on the GPU (capturable=True): the same arithmetic as
    # an eager capturable Adam, to the bit. Its bias correction is float32 there (float64 from
    # a host step count), which Adam's normalised steps carry into the third decimal.
    adam_init = torch.optim.Adam.__init__

    def capturable_adam(self: torch.optim.Adam, params: Any, **options: Any) -> None:
        adam_init(self, params, **{**options, "capturable": True})

    monkeypatch.setattr(torch.optim.Adam, "__init__", capturable_adam)
    eager = cnn_training("cuda")
    assert_same(eager, captured, **SAME)
    if AGAINST_LOCAL:
        assert_same(local, captured, rtol=1e-3, atol=1e-2)
        torch.testing.assert_close(captured["losses"], local["losses"], rtol=1e-3, atol=1e-4)


def test_captured_transformer_step_under_bf16_autocast_matches_eager(
    capturing: Capturing,
) -> None:
    local = transformer_bf16("cpu", steps=CAPTURED_STEPS)
    eager = transformer_bf16("cuda", steps=CAPTURED_STEPS)
    captured = transformer_bf16("cuda", capturing, steps=CAPTURED_STEPS)
    replayed(capturing)
    assert bool(captured["logits_bf16"])
    assert_same(eager, captured, rtol=max(SAME["rtol"], 1e-6), atol=max(SAME["atol"], 1e-6))
    if AGAINST_LOCAL:
        torch.testing.assert_close(captured["losses"], local["losses"], rtol=2e-2, atol=2e-2)


def test_captured_residual_cnn_step_matches_eager_and_local(capturing: Capturing) -> None:
    local = resnet_bf16("cpu", steps=CAPTURED_STEPS)
    eager = resnet_bf16("cuda", steps=CAPTURED_STEPS)
    captured = resnet_bf16("cuda", capturing, steps=CAPTURED_STEPS)
    replayed(capturing)
    assert_same(eager, captured, rtol=max(SAME["rtol"], 1e-6), atol=max(SAME["atol"], 1e-6))
    if AGAINST_LOCAL:
        assert_same(local, captured, rtol=1e-2, atol=1e-2)


def test_a_step_over_two_gpus_runs_eagerly_with_a_warning(attach: Callable[..., Any]) -> None:
    local = two_device_pipeline(("cpu", "cpu"))
    attach(2)
    steps: list[CapturedStep] = []

    def wrap(fn: Callable[..., Any]) -> Any:
        steps.append(gpupool.torch.capture(fn))
        return steps[-1]

    # Moving a tensor between GPUs reads it back first: either reason stops the capture.
    with pytest.warns(
        CaptureWarning, match="runs eagerly: the step (uses more than one GPU|reads)"
    ):
        remote = two_device_pipeline(("cuda:0", "cuda:1"), wrap)
    assert not steps[0].replaying
    del local["placed"], remote["placed"]
    if AGAINST_LOCAL:
        assert_same(local, remote, rtol=1e-5, atol=1e-6)


# ---- what would change the program ------------------------------------------------------------


def _linear_step(bias_scale: float = 1.0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = (model(x) * bias_scale).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _run_both(
    calls: Callable[[Callable[..., Any]], list[torch.Tensor]], make: Callable[[], Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor], CapturedStep]:
    """The same calls eagerly and through capture, from the same seed: host values of each."""
    _, _, eager_fn = make()
    eager = [t.detach().cpu() for t in calls(eager_fn)]
    _, _, fn = make()
    step = gpupool.torch.capture(fn)
    captured = [t.detach().cpu() for t in calls(step)]
    return eager, captured, step


def test_outputs_of_every_replay_stay_distinct(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.randn(8, 4).cuda()
    eager, captured, step = _run_both(lambda f: [f(x) for _ in range(7)], _linear_step)
    assert step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)
    assert len({float(v) for v in captured}) == 7  # training moved the loss every step


def test_other_shapes_or_dtypes_are_captured_separately(attach: Callable[..., Any]) -> None:
    attach()
    a, b = torch.randn(8, 4).cuda(), torch.randn(3, 4).cuda()
    # float64 for both shapes: CUDA has no integer matrix product (addmm_cuda for 'Long').
    c = torch.randn(8, 4, dtype=torch.float64).cuda()
    d = torch.arange(12, dtype=torch.float64).reshape(3, 4).cuda()

    def make() -> Any:
        total = torch.zeros((), device="cuda")

        def step(x: torch.Tensor) -> torch.Tensor:
            total.add_(x.pow(2).sum().float())  # persistent state, updated in place
            return x.t() @ x + total

        return None, None, step

    def calls(f: Callable[..., Any]) -> list[torch.Tensor]:
        out = []
        for x in (a, b, c, d, a, b, c, d, a, d, b, c, a, b, c, d):
            out.append(f(x).float().sum())
        return out

    with pytest.warns(CaptureWarning, match="captured again for other arguments"):
        eager, captured, step = _run_both(calls, make)
    assert step.replaying and len(step._entries) == 4
    programs = step.worker_programs()
    assert len(programs) == 4
    assert all(mode == REPLAY_MODE for mode, runs in programs if runs > GRAPH_AFTER_RUNS)
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


def test_gradients_after_each_call_are_that_calls_across_signatures(
    attach: Callable[..., Any],
) -> None:
    attach()
    a, b = torch.randn(8, 4).cuda(), torch.randn(3, 4).cuda()
    holder: dict[str, nn.Module] = {}

    def make() -> Any:
        model, opt, step = _linear_step()
        holder["model"] = model
        return model, opt, step

    def calls(f: Callable[..., Any]) -> list[torch.Tensor]:
        out = []
        for x in (a, a, a, a, b, b, b, b, a, b, a, b):
            f(x)
            out.append(holder["model"].weight.grad.clone())
        return out

    with pytest.warns(CaptureWarning, match="captured again for other arguments"):
        eager, captured, step = _run_both(calls, make)
    assert step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


@pytest.mark.parametrize(
    ("read", "reason"),
    [
        (lambda loss: loss.item(), "reads a tensor's values"),
        (lambda loss: print(loss), "reads a tensor's values"),
        (lambda loss: bool(loss > 1.0) and None, "reads a tensor's values"),
        (lambda loss: loss.cpu(), "reads a tensor's values"),
        (lambda loss: torch.nonzero(loss.reshape(1)), "runs aten::nonzero"),
    ],
    ids=["item", "print", "branch", "cpu", "nonzero"],
)
def test_a_read_inside_the_step_runs_it_eagerly_with_a_warning(
    attach: Callable[..., Any], read: Callable[[torch.Tensor], Any], reason: str
) -> None:
    attach()
    x = torch.randn(8, 4).cuda()

    def make() -> Any:
        model, opt, inner = _linear_step()

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = inner(x)
            read(loss)
            return loss

        return model, opt, step

    with pytest.warns(CaptureWarning, match=f"runs eagerly: the step {reason}"):
        eager, captured, step = _run_both(lambda f: [f(x) for _ in range(5)], make)
    assert not step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


def test_a_tensor_rebound_outside_the_step_captures_again(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.randn(8, 4).cuda()

    def make() -> Any:
        torch.manual_seed(0)
        model = nn.Linear(4, 2).cuda()
        shift = torch.ones(2).cuda()

        def step(x: torch.Tensor) -> torch.Tensor:
            return model(x) + shift

        def rebind() -> None:
            nonlocal shift
            shift = torch.full((2,), 5.0).cuda()  # the old one dies

        step.rebind = rebind  # type: ignore[attr-defined]
        return model, None, step

    def calls(f: Callable[..., Any]) -> list[torch.Tensor]:
        out = [f(x) for _ in range(4)]
        (f.fn if isinstance(f, CapturedStep) else f).rebind()
        return out + [f(x) for _ in range(4)]

    with pytest.warns(CaptureWarning, match="captured again: .* closes over was replaced"):
        eager, captured, step = _run_both(calls, make)
    assert step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


def test_a_tensor_it_reads_freed_outside_the_step_captures_again(
    attach: Callable[..., Any],
) -> None:
    attach()
    x = torch.randn(8, 4).cuda()
    state: dict[str, torch.Tensor] = {}

    def make() -> Any:
        torch.manual_seed(0)
        model = nn.Linear(4, 2).cuda()
        state["shift"] = torch.ones(2).cuda()
        return model, None, lambda x: model(x) + state["shift"]

    def calls(f: Callable[..., Any]) -> list[torch.Tensor]:
        out = [f(x) for _ in range(4)]
        state["shift"] = torch.full((2,), 5.0).cuda()  # same dict, the old tensor is gone
        return out + [f(x) for _ in range(4)]

    with pytest.warns(CaptureWarning, match="captured again: a tensor it reads was freed"):
        eager, captured, step = _run_both(calls, make)
    assert step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


def test_a_parameter_replaced_while_the_old_one_lives_captures_again(
    attach: Callable[..., Any],
) -> None:
    attach()
    x = torch.randn(8, 4).cuda()
    kept: list[torch.Tensor] = []
    holder: dict[str, nn.Module] = {}

    def make() -> Any:
        torch.manual_seed(0)
        model = holder["model"] = nn.Linear(4, 2).cuda()
        return model, None, lambda x: model(x).sum()

    def calls(f: Callable[..., Any]) -> list[torch.Tensor]:
        out = [f(x) for _ in range(4)]
        kept.append(holder["model"].weight)
        holder["model"].weight = nn.Parameter(torch.zeros(2, 4).cuda())
        return out + [f(x) for _ in range(4)]

    with pytest.warns(CaptureWarning, match="captured again: .*tensors were replaced"):
        eager, captured, step = _run_both(calls, make)
    assert step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


def test_a_learning_rate_changed_every_call_runs_eagerly(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.randn(8, 4).cuda()

    def make() -> Any:
        model, opt, inner = _linear_step()
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = inner(x)
            schedule.step()  # a host value that changes every call
            return loss

        return model, opt, step

    with pytest.warns(CaptureWarning, match="runs eagerly: its ops change from call to call"):
        eager, captured, step = _run_both(lambda f: [f(x) for _ in range(8)], make)
    assert not step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


def test_a_learning_rate_changed_between_calls_captures_again(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.randn(8, 4).cuda()
    holder: dict[str, torch.optim.Optimizer] = {}

    def make() -> Any:
        model, opt, step = _linear_step()
        holder["opt"] = opt
        return model, opt, step

    def calls(f: Callable[..., Any]) -> list[torch.Tensor]:
        out = [f(x) for _ in range(5)]
        for group in holder["opt"].param_groups:
            group["lr"] = 0.01
        out += [f(x) for _ in range(5)]
        return out

    with pytest.warns(CaptureWarning, match="captured again: an optimizer's hyperparameters"):
        eager, captured, step = _run_both(calls, make)
    assert step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


def test_train_and_eval_switches_capture_again(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.randn(8, 4).cuda()
    holder: dict[str, nn.Module] = {}

    def make() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).cuda()
        holder["model"] = model

        def step(x: torch.Tensor) -> torch.Tensor:
            return model(x).sum()

        return model, None, step

    def calls(f: Callable[..., Any]) -> list[torch.Tensor]:
        out = [f(x) for _ in range(4)]
        holder["model"].eval()
        out += [f(x) for _ in range(4)]
        return out

    with pytest.warns(CaptureWarning, match="captured again: a module switched"):
        eager, captured, _ = _run_both(calls, make)
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)


def test_dropout_under_replay_draws_new_masks_like_eager(attach: Callable[..., Any]) -> None:
    attach()
    x = torch.randn(16, 8).cuda()

    def make() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 1)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        return model, opt, step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)  # AdamW made capturable
        eager, captured, step = _run_both(lambda f: [f(x) for _ in range(8)], make)
    assert step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), rtol=1e-5, atol=1e-6)
    assert len({float(v) for v in captured[4:]}) == 4


def test_host_tensor_arguments_run_eagerly_with_a_warning(attach: Callable[..., Any]) -> None:
    attach()
    torch.manual_seed(0)
    model = nn.Linear(4, 2).cuda()
    step = gpupool.torch.capture(lambda x: model(x.cuda()).sum())
    x = torch.randn(3, 4)
    with pytest.warns(CaptureWarning, match="argument 0 is a cpu tensor"):
        got = [float(step(x)) for _ in range(4)]
    assert got == [float(model(x.cuda()).sum())] * 4 and not step.replaying


def test_a_forward_only_step_replays_the_same_values(attach: Callable[..., Any]) -> None:
    attach()
    torch.manual_seed(0)
    model = nn.Linear(4, 2).cuda()
    step = gpupool.torch.capture(lambda x: F.relu(model(x)))
    x = torch.randn(3, 4).cuda()
    for _ in range(3):
        step(x)
    assert step.replaying
    torch.testing.assert_close(step(x).cpu(), F.relu(model(x)).cpu())


def test_attention_asks_the_worker_for_its_kernel_and_is_still_captured(
    attach: Callable[..., Any],
) -> None:
    from gpupool.torch import kernels

    attach()
    q = torch.randn(2, 4, 8, 16).cuda()

    def make() -> Any:
        kernels._SDP_CHOICES.clear()  # the recording itself asks the worker (a round trip)
        torch.manual_seed(0)
        proj = nn.Linear(16, 16).cuda()

        def step(q: torch.Tensor) -> torch.Tensor:
            x = proj(q)
            return F.scaled_dot_product_attention(x, x, x, is_causal=True).sum()

        return proj, None, step

    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        eager, captured, step = _run_both(lambda f: [f(q) for _ in range(5)], make)
    assert step.replaying
    torch.testing.assert_close(torch.stack(captured), torch.stack(eager), **SAME)
