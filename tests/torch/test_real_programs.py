"""Programs nobody here wrote (tests/torch/real_programs.py: Hugging Face models from configs,
torchvision's models, PyTorch's examples) give a remote CPU worker's run the local CPU run's
numbers: losses, generated tokens, predictions and the trained weights' checksum.

Equal means `==`, except where the two runs cannot use the same kernel (TOLERANCES says
which and why). Programs whose package is not installed skip, naming it: `pip install -e
'.[programs]'` brings them.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import real_programs
import torch
from conformance_programs import recurrent_stacks

from gpupool.torch import runtime

pytestmark = pytest.mark.slow

TOLERANCES: dict[str, float] = {}
"""Relative tolerance per program where the runs cannot be bit-identical; elsewhere `==`."""


def _close(remote: Any, local: Any, rel: float) -> bool:
    if isinstance(local, list):
        return len(remote) == len(local) and all(
            _close(r, v, rel) for r, v in zip(remote, local, strict=True)
        )
    if isinstance(local, float):
        return math.isclose(remote, local, rel_tol=rel)
    return bool(remote == local)


@pytest.mark.parametrize("name", list(real_programs.PROGRAMS))
def test_a_real_program_gives_the_local_numbers_on_a_remote_gpu(
    name: str, attach: Callable[..., Any]
) -> None:
    package, program = real_programs.PROGRAMS[name]
    if package and not real_programs.available(package):
        pytest.skip(f"{package} is not installed (pip install -e '.[programs]')")
    local = program("cpu")  # before attaching: the program as its author runs it
    attach()
    if runtime.stream(0).is_cuda_worker:
        pytest.skip("compares with a local CPU run: bench/real_programs.py compares GPUs")
    remote = program("cuda")
    assert set(remote) == set(local)
    rel = TOLERANCES.get(name)
    if rel is None:
        assert remote == local
    else:
        for key, value in local.items():
            if isinstance(value, list) and value and isinstance(value[0], int | list):
                assert remote[key] == value, key  # tokens and predictions exactly
            assert _close(remote[key], value, rel), (key, remote[key], value)
    assert torch.cuda.is_available()


def _recurrent_run(module: torch.nn.Module, x: torch.Tensor, device: str) -> list[torch.Tensor]:
    module = copy.deepcopy(module).to(device)
    inputs = x.clone().to(device).requires_grad_()
    out = module(inputs)[0]
    out.square().sum().backward()
    assert inputs.grad is not None
    grads = [p.grad.cpu() for p in module.parameters() if p.grad is not None]
    return [out.detach().cpu(), inputs.grad.cpu(), *grads]


def test_recurrent_layers_on_a_worker_give_the_local_cpus_values(
    attach: Callable[..., Any],
) -> None:
    torch.manual_seed(0)
    exact = {
        "gru, 2 layers, dropout": torch.nn.GRU(8, 6, 2, dropout=0.3),
        "gru, bidirectional, batch first": torch.nn.GRU(8, 6, bidirectional=True, batch_first=True),
        "lstm with projections": torch.nn.LSTM(8, 6, 2, proj_size=4),
        # the ones a local CPU runs as oneDNN layers, which a CPU worker runs too
        "lstm, bidirectional": torch.nn.LSTM(8, 6, 2, bidirectional=True),
        "lstm, 3 layers, dropout, batch first": torch.nn.LSTM(
            8, 6, 3, dropout=0.4, batch_first=True
        ),
        "lstm without biases": torch.nn.LSTM(8, 6, bias=False),
    }
    x = torch.randn(5, 3, 8)
    local = {}
    for name, module in exact.items():
        torch.manual_seed(1)  # the dropout between layers draws alike
        local[name] = _recurrent_run(module, x, "cpu")
    lstm = exact["lstm, bidirectional"]
    with torch.no_grad():  # oneDNN's inference kernel, without a workspace
        local_inference = lstm(x)[0]
    attach()
    if runtime.stream(0).is_cuda_worker:
        pytest.skip("compares with a local CPU run: bench/real_programs.py compares GPUs")
    for name, module in exact.items():
        torch.manual_seed(1)
        remote = _recurrent_run(module, x, "cuda")
        for got, want in zip(remote, local[name], strict=True):
            assert torch.equal(got, want), name
    with torch.no_grad():
        remote_inference = copy.deepcopy(lstm).to("cuda")(x.to("cuda"))[0].cpu()
    assert torch.equal(remote_inference, local_inference)


def test_recurrent_stacks_on_a_cpu_worker_give_the_local_cpus_values(
    attach: Callable[..., Any],
) -> None:
    """The stacks a local GPU gives cuDNN (tests/torch/test_conformance_gpu.py runs them so on
    a CUDA worker), nn.RNN's among them, run on a CPU worker as a local CPU runs them."""
    local = recurrent_stacks("cpu")
    attach()
    if runtime.stream(0).is_cuda_worker:
        pytest.skip("compares with a local CPU run: the GPU suite compares with a local GPU")
    remote = recurrent_stacks("cuda")
    assert remote.keys() == local.keys()
    for key, value in local.items():
        assert torch.equal(remote[key], value), key


def _packed_run(module: torch.nn.Module, x: torch.Tensor, lengths: torch.Tensor, device: str,
                sort: bool) -> list[torch.Tensor]:  # fmt: skip
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    module = copy.deepcopy(module).to(device)
    inputs = x.clone().to(device).requires_grad_()
    packed = pack_padded_sequence(inputs, lengths, module.batch_first, enforce_sorted=sort)
    assert packed.batch_sizes.device.type == "cpu"  # as on a local GPU: PackedSequence insists
    torch.manual_seed(3)  # the dropout between layers draws alike
    out, state = module(packed)
    padded, out_lengths = pad_packed_sequence(out, module.batch_first)
    assert out_lengths.device.type == "cpu" and out_lengths.tolist() == lengths.tolist()
    finals = list(state) if isinstance(state, tuple) else [state]
    (padded.square().sum() + sum(f.sin().sum() for f in finals)).backward()
    assert inputs.grad is not None
    grads = [p.grad.cpu() for p in module.parameters() if p.grad is not None]
    return [padded.detach().cpu(), *(f.detach().cpu() for f in finals), inputs.grad.cpu(), *grads]


def test_packed_sequences_on_a_cpu_worker_give_the_local_cpus_values(
    attach: Callable[..., Any],
) -> None:
    """pack_padded_sequence and the layers on a PackedSequence (`lstm.data`, `gru.data`): the
    batch sizes stay on the host, and a CPU worker runs ATen's packed layers' cells op for op
    (they failed at the fused cell, which only CUDA has)."""
    torch.manual_seed(0)
    modules = {
        "lstm, 2 layers, bidirectional": torch.nn.LSTM(4, 5, 2, bidirectional=True),
        "lstm with projections, batch first": torch.nn.LSTM(4, 5, proj_size=3, batch_first=True),
        "gru, 2 layers, dropout": torch.nn.GRU(4, 5, 2, dropout=0.3),
        "gru, bidirectional, no biases": torch.nn.GRU(4, 5, bidirectional=True, bias=False),
    }
    x = torch.randn(6, 3, 4)
    cases = [(torch.tensor([6, 4, 2]), True), (torch.tensor([3, 6, 1]), False)]
    local = {
        (name, i): _packed_run(m, x.transpose(0, 1) if m.batch_first else x, lengths, "cpu", sort)
        for name, m in modules.items()
        for i, (lengths, sort) in enumerate(cases)
    }
    attach()
    if runtime.stream(0).is_cuda_worker:
        pytest.skip("compares with a local CPU run")
    for (name, i), want in local.items():
        m = modules[name]
        lengths, sort = cases[i]
        got = _packed_run(m, x.transpose(0, 1) if m.batch_first else x, lengths, "cuda", sort)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (name, i)


def test_cudnn_rnn_layouts_follow_the_meta_kernel_and_cudnns_batch_first_strides() -> None:
    """The client's layouts of `_cudnn_rnn` (gpupool.torch.rnn) give the meta kernel's shapes,
    and its strides except where cuDNN's differ: a batch-first output is transposed from a
    sequence-major one (the GPU suite checks them against cuDNN itself)."""
    from gpupool.torch import rnn

    aten = torch.ops.aten
    meta = torch.device("meta")
    for mode, proj, bidir, batch_first in itertools.product((0, 2, 3), (0, 3), (False, True),
                                                            (False, True)):  # fmt: skip
        if proj and mode != 2:
            continue
        hidden, features, layers, seq, batch = 5, 4, 2, 7, 3
        d, gates, out = 2 if bidir else 1, rnn.CUDNN_GATES[mode], proj or hidden
        ws = []
        for layer in range(layers):
            inputs = features if layer == 0 else d * out
            for _ in range(d):
                ws += [torch.empty(gates * hidden, inputs, device=meta),
                       torch.empty(gates * hidden, out, device=meta)]  # fmt: skip
                ws += [torch.empty(proj, hidden, device=meta)] if proj else []
        x = torch.empty((batch, seq, features) if batch_first else (seq, batch, features),
                        device=meta)  # fmt: skip
        hx = torch.empty(layers * d, batch, out, device=meta)
        cx = torch.empty(layers * d, batch, hidden, device=meta) if mode == 2 else None
        args = (x, ws, 2 + (1 if proj else 0), None, hx, cx, mode, hidden, proj, layers,
                batch_first, 0.0, True, bidir, [], None)  # fmt: skip
        told = rnn._cudnn_rnn_layout(args, {}).items
        want = aten._cudnn_rnn.default(*args)
        for i in range(3):
            assert told[i].shape == tuple(want[i].shape), (mode, i)
        sequence_major = torch.empty(seq, batch, d * out).transpose(0, 1) if batch_first else want[0]
        assert told[0].stride == sequence_major.stride()
        assert told[1].stride == want[1].stride() and told[2].stride == want[2].stride()
        assert told[3].shape == (0,) and told[3].dtype == torch.uint8
        grads = (torch.empty(*want[0].shape, device=meta), None, None)
        back = rnn._cudnn_rnn_backward_layout(
            (*args[:6], want[0], *grads, *args[6:], torch.empty(0, dtype=torch.uint8),
             [True, True, cx is not None, True]), {},
        ).items  # fmt: skip
        assert back[0].shape == tuple(x.shape) and back[0].stride == (
            x.stride() if not batch_first else torch.empty(seq, batch, features).transpose(0, 1).stride()
        )
        assert back[1].shape == tuple(hx.shape)
        assert [s.shape for s in back[3].items] == [tuple(w.shape) for w in ws]


def test_recurrent_layers_ask_no_cudnn_of_a_remote_tensor(attach: Callable[..., Any]) -> None:
    """nn.LSTM's flatten_parameters asks cuDNN about its weights; a client whose torch is a
    CUDA build without a visible GPU raised there (torch 2.11 on the GPU machine) before any
    op ran. The client never asks cuDNN: a CUDA worker does, for the layers it runs."""
    attach()
    lstm = torch.nn.LSTM(4, 3, 2).to("cuda")
    assert not torch.backends.cudnn.is_acceptable(lstm.weight_ih_l0)
    out, (h, c) = lstm(torch.randn(5, 2, 4).to("cuda"))
    out, (h, c) = lstm(torch.randn(5, 2, 4).to("cuda"), (h.detach(), c.detach()))
    assert (out.shape, h.shape, c.shape) == ((5, 2, 3), (2, 2, 3), (2, 2, 3))
