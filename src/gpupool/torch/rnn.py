"""LSTM and GRU layers on remote tensors: the cells a CPU worker can run, as PyTorch's CPU
path computes them.

`aten::lstm` and `aten::gru` are C++ composites that pick their cell by the input's device: on
CUDA and on a PrivateUse1 device (a remote tensor's C++ device) each step calls the fused
`_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell`, kernels only CUDA has, so on a CPU worker
nn.LSTM failed at its first step. For every remote tensor the layers here
(registered for AutogradPrivateUse1 in gpupool.torch.kernels) run ATen's CPU cells in their
order: the input projection of a whole layer at once, then per step the hidden projection
added to it and the gates; dropout between layers. Autograd records each op, so backward is
the cells' too. A GRU and an LSTM with projections (which a local CPU runs as cells too) are
then bit-identical with a local CPU run. A float32 LSTM without projections is what a local
CPU runs as oneDNN layers (`mkldnn_rnn_layer`); on a CPU worker it runs so too, layer by layer
as ATen's `mkldnn_rnn` does (`_onednn_lstm`), and is bit-identical. The worker runs that kernel
behind a check (gpupool.worker.opchecks: it trusts its weights' shapes, forged ones crashed a
worker, and its backward trusts the workspace's size); the cells had differed from oneDNN in
the last bits, one float32 ulp in a loss four steps on.
torch._decomp's own LSTM decomposition is not used: it drops the dropout between layers.
A CUDA worker runs the same cells: PyTorch's composite there took torch._decomp's LSTM
decomposition on torch 2.11, whose final hidden states came back with an extra dimension (the
word language model's second step failed: "hx and cx should also be 3-D"), and the fused cells
cost a round trip per step (no meta kernel). A local GPU runs cuDNN instead, so a remote LSTM
on a CUDA worker agrees with it to rounding, not bit for bit. For the same reason
`torch.backends.cudnn.is_acceptable` answers False for a remote tensor: nn.LSTM's
`flatten_parameters` asked it, and on a client whose torch is a CUDA build without a visible
GPU it raised ("cuDNN ... not compatible with devices with SM < 7.5") before any op ran.

Packed sequences (`lstm.data`, `gru.data`) keep the composite, so on a CPU worker they fail
at the fused cell, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from gpupool.torch.stream import stream_of
from gpupool.torch.tensor import RemoteTensor

aten = torch.ops.aten

Hidden = Any
"""An LSTM's (h, c) pair of [batch, hidden] tensors, or a GRU's h."""
Cell = Callable[[torch.Tensor, Hidden, Sequence[torch.Tensor]], Hidden]


_IS_ACCEPTABLE: list[Callable[[torch.Tensor], bool]] = []


def install() -> None:
    """cuDNN's weight flattening is not for remote tensors (see above)."""
    if _IS_ACCEPTABLE:
        return
    original = torch.backends.cudnn.is_acceptable
    _IS_ACCEPTABLE.append(original)

    def is_acceptable(tensor: torch.Tensor) -> bool:
        return False if isinstance(tensor, RemoteTensor) else original(tensor)

    torch.backends.cudnn.is_acceptable = is_acceptable


def uninstall() -> None:
    if _IS_ACCEPTABLE:
        torch.backends.cudnn.is_acceptable = _IS_ACCEPTABLE.pop()


# The cells are ATen's (RNN.cpp's LSTMCell and GRUCell) op for op, in-place ops on the gates'
# chunks included: an elementwise kernel on a chunk (a strided view) loops otherwise than on a
# contiguous tensor and rounds otherwise (vectorised exp against scalar).


def _lstm_cell(gates_in: torch.Tensor, hidden: Hidden, params: Sequence[torch.Tensor]) -> Hidden:
    """One step; `gates_in` is the step's input already projected (w_ih x + b_ih)."""
    hx, cx = hidden
    w_hh = params[1]
    b_hh = params[3] if len(params) in (4, 5) else None
    gates = F.linear(hx, w_hh, b_hh).add_(gates_in)
    chunks = gates.unsafe_chunk(4, 1)
    ingate, forgetgate = chunks[0].sigmoid_(), chunks[1].sigmoid_()
    cellgate, outgate = chunks[2].tanh_(), chunks[3].sigmoid_()
    cy = (forgetgate * cx).add_(ingate * cellgate)
    hy = outgate * cy.tanh()
    if len(params) in (3, 5):  # a projection (proj_size): w_hr last
        hy = hy.matmul(params[-1].t())
    return hy, cy


def _gru_cell(gates_in: torch.Tensor, hidden: Hidden, params: Sequence[torch.Tensor]) -> Hidden:
    w_hh = params[1]
    b_hh = params[3] if len(params) == 4 else None
    igates = gates_in.unsafe_chunk(3, 1)
    hgates = F.linear(hidden, w_hh, b_hh).unsafe_chunk(3, 1)
    reset_gate = hgates[0].add_(igates[0]).sigmoid_()
    input_gate = hgates[1].add_(igates[1]).sigmoid_()
    new_gate = igates[2].add(hgates[2].mul_(reset_gate)).tanh_()
    return (hidden - new_gate).mul_(input_gate).add_(new_gate)


def _layer(
    cell: Cell, inputs: torch.Tensor, hidden: Hidden, params: Sequence[torch.Tensor],
    reverse: bool,
) -> tuple[torch.Tensor, Hidden]:  # fmt: skip
    b_ih = params[2] if len(params) >= 4 else None
    projected = F.linear(inputs, params[0], b_ih).unbind(0)
    steps = reversed(projected) if reverse else projected
    outputs = []
    for step in steps:
        hidden = cell(step, hidden, params)
        outputs.append(hidden[0] if isinstance(hidden, tuple) else hidden)
    if reverse:
        outputs.reverse()
    return torch.stack(outputs, 0), hidden


def _stack(
    cell: Cell, input: torch.Tensor, hiddens: list[Hidden], params: list[list[torch.Tensor]],
    num_layers: int, dropout: float, train: bool, bidirectional: bool,
) -> tuple[torch.Tensor, list[Hidden]]:  # fmt: skip
    """The layers one after the other, each direction's output side by side."""
    directions = 2 if bidirectional else 1
    finals: list[Hidden] = []
    layer_input = input
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            out, final = _layer(cell, layer_input, hiddens[index], params[index], direction == 1)
            outputs.append(out)
            finals.append(final)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, outputs[0].dim() - 1)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_input = F.dropout(layer_input, dropout, True)
    return layer_input, finals


def _group(params: Sequence[torch.Tensor], has_biases: bool, projected: bool) -> list[list[Any]]:
    per = (4 if has_biases else 2) + (1 if projected else 0)
    if len(params) % per:
        raise RuntimeError(f"rnn: {len(params)} weights do not divide into layers of {per}")
    return [list(params[i : i + per]) for i in range(0, len(params), per)]


_ONEDNN_LSTM = 2
"""ideep::rnn_kind::LSTM, the mode ATen gives `mkldnn_rnn_layer`."""


def _onednn(input: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, params: Sequence[Any]) -> bool:
    """Whether a local CPU would run this LSTM as oneDNN layers (ATen's `use_mkldnn`: oneDNN
    on and float32; bfloat16 depends on the worker's CPU, so it keeps the cells) and the
    worker is a CPU, where the same kernel then runs."""
    if not isinstance(input, RemoteTensor) or stream_of(input._gp).is_cuda_worker:
        return False
    if not (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()):
        return False
    tensors = [input, h0, c0, *params]
    return (
        all(t.dtype == torch.float32 for t in tensors)
        and input.numel() != 0
        and h0.size(2) == c0.size(2)  # no projections
    )


def _onednn_lstm(
    input: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, grouped: list[list[Any]],
    has_biases: bool, num_layers: int, dropout: float, train: bool, bidirectional: bool,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """ATen's `mkldnn_rnn` op for op: each layer and direction one `mkldnn_rnn_layer` on the
    worker, dropout between layers, the final states stacked. The layer's `train` argument
    carries the client's autograd mode instead of the module's flag: the kernel keeps the
    workspace its backward needs only with the mode on (a worker runs with it off and runs this
    kernel under the mode `train` names, see gpupool.worker.opchecks), and nothing else reads
    `train`."""
    x = (input.transpose(0, 1) if batch_first else input).contiguous()
    hx, cx = h0.contiguous(), c0.contiguous()
    hidden = hx.size(2)
    grad = torch.is_grad_enabled()
    directions = 2 if bidirectional else 1
    layer_input = x
    hys: list[torch.Tensor] = []
    cys: list[torch.Tensor] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w = grouped[index]
            w2 = w[2] if has_biases else torch.zeros_like(w[0])
            w3 = w[3] if has_biases else torch.zeros_like(w[1])
            out, hy, cy, _ = aten.mkldnn_rnn_layer(
                layer_input, w[0], w[1], w2, w3, hx[index], cx[index], direction > 0, [],
                _ONEDNN_LSTM, hidden, num_layers, has_biases, bidirectional, batch_first, grad,
            )  # fmt: skip
            outputs.append(out)
            hys.append(hy)
            cys.append(cy)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_input = F.dropout(layer_input, dropout, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(hys, 0), torch.stack(cys, 0)


def lstm(
    input: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
    has_biases: bool, num_layers: int, dropout: float, train: bool, bidirectional: bool,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    if len(hx) != 2:
        raise RuntimeError(f"lstm expects two hidden states, got {len(hx)}")
    h0, c0 = hx
    projected = h0.size(2) != c0.size(2)
    grouped = _group(params, has_biases, projected)
    if _onednn(input, h0, c0, params):
        return _onednn_lstm(
            input, h0, c0, grouped, has_biases, num_layers, dropout, train, bidirectional,
            batch_first,
        )  # fmt: skip
    x = input.transpose(0, 1) if batch_first else input
    hiddens = list(zip(h0.unbind(0), c0.unbind(0), strict=True))
    out, finals = _stack(_lstm_cell, x, hiddens, grouped, num_layers, dropout, train, bidirectional)
    out = out.transpose(0, 1) if batch_first else out
    return out, torch.stack([h for h, _ in finals], 0), torch.stack([c for _, c in finals], 0)


def gru(
    input: torch.Tensor, hx: torch.Tensor, params: Sequence[torch.Tensor], has_biases: bool,
    num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    grouped = _group(params, has_biases, False)
    x = input.transpose(0, 1) if batch_first else input
    out, finals = _stack(
        _gru_cell, x, list(hx.unbind(0)), grouped, num_layers, dropout, train, bidirectional
    )
    out = out.transpose(0, 1) if batch_first else out
    return out, torch.stack(finals, 0)
