"""LSTM, GRU and plain RNN layers on remote tensors: the kernels a local device would run.

`aten::lstm`, `aten::gru`, `aten::rnn_tanh` and `aten::rnn_relu` are C++ composites that pick
their kernel by the input's device, and a remote tensor's C++ device is PrivateUse1, neither
CUDA nor CPU. The layers here (registered for AutogradPrivateUse1 in gpupool.torch.kernels)
choose as a local device of the worker's kind would:

- **A CUDA worker runs cuDNN** where a local GPU does (ATen's `cudnn_is_acceptable`, which the
  worker answers: cuDNN on, not empty, a dtype cuDNN takes): one `_cudnn_rnn` op for the whole
  stack, recorded by autograd with its own backward (`_cudnn_rnn_backward`), as ATen's
  `_cudnn_impl` calls it; under autocast cast to float16 first, as ATen's autocast kernel for
  it does. The worker runs the same cuDNN kernels as a local GPU and its values are the local
  GPU's bit for bit. Two differences, neither in the values: the weights go unflattened (the
  worker copies them into cuDNN's layout for each call, as cuDNN does for a local module that
  was never flattened), and cuDNN's workspace (`reserve`) stays on the worker, where the
  client sees it as an empty tensor (its size is cuDNN's to say). The worker checks both ops
  (opchecks: cuDNN trusts the weight buffer, the reserve and the gradients' sizes). Dropout
  between layers is cuDNN's too, drawn from a dropout state the worker keeps and seeds as
  ATen does for a local GPU (gpupool.worker.cudnn_rnn): the same masks.
- **Stacks cuDNN does not take on a CUDA worker** (cuDNN off, a dtype it does not take) run as
  ATen runs them on a local GPU: per step the input and hidden products and the fused cell
  kernel (`_thnn_fused_lstm_cell`, `_thnn_fused_gru_cell`), which adds the biases.
- **A CPU worker** runs ATen's CPU cells in their order: the input projection of a whole layer
  at once, then per step the hidden projection added to it and the gates; dropout between
  layers. Autograd records each op. A GRU and an LSTM with projections (which a local CPU
  runs as cells too) are then bit-identical with a local CPU run. A float32 LSTM without
  projections is what a local CPU runs as oneDNN layers (`mkldnn_rnn_layer`); on a CPU worker
  it runs so too, layer by layer as ATen's `mkldnn_rnn` does (`_onednn_lstm`), and is
  bit-identical. The worker runs that kernel behind a check (it trusts its weights' shapes,
  forged ones crashed a worker, and its backward trusts the workspace's size).
  torch._decomp's own LSTM decomposition is not used: it drops the dropout between layers.
- **Plain RNNs** off cuDNN keep ATen's composite: its cells are linear and tanh or relu,
  which every worker has, step by step as on a local GPU.

`torch.backends.cudnn.is_acceptable` answers False for a remote tensor: nn.LSTM's
`flatten_parameters` asked it, and on a client whose torch is a CUDA build without a visible
GPU it raised ("cuDNN ... not compatible with devices with SM < 7.5") before any op ran; the
client never asks cuDNN anything (the worker does).

Packed sequences (`lstm.data`, `gru.data`: nn.LSTM and nn.GRU on a PackedSequence): a CPU
worker runs ATen's packed layers with the CPU cells op for op, bit-identical with a local CPU;
a CUDA worker runs ATen's composite, whose fused cells it has (a local GPU runs cuDNN on them,
so those agree to rounding). `pack_padded_sequence`'s batch sizes stay on the host
(gpupool.torch.dispatch runs that op's kernel in the client). Plain RNNs on a PackedSequence
keep ATen's composite everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F

from gpupool.torch import autocast, shapes
from gpupool.torch.shapes import Seq, TensorSpec, Value
from gpupool.torch.stream import stream_of
from gpupool.torch.tensor import RemoteTensor, contiguous_strides

aten = torch.ops.aten

Hidden = Any
"""An LSTM's (h, c) pair of [batch, hidden] tensors, or a GRU's h."""
Cell = Callable[[torch.Tensor, Hidden, Sequence[torch.Tensor]], Hidden]


_IS_ACCEPTABLE: list[Callable[[torch.Tensor], bool]] = []


def install(cudnn_accepts: Callable[[torch.Tensor], bool]) -> None:
    """cuDNN's weight flattening is not for remote tensors (see above); cuDNN's RNN ops get
    their outputs' layouts here (their meta kernel has none for the weight buffer and gives
    batch-first outputs other strides than cuDNN's). `cudnn_accepts` asks the worker's ATen
    whether cuDNN takes a tensor (gpupool.torch.kernels: a round trip)."""
    _ASK[:] = [cudnn_accepts]
    shapes.EXACT[aten._cudnn_rnn.default] = _cudnn_rnn_layout
    shapes.EXACT[aten._cudnn_rnn_backward.default] = _cudnn_rnn_backward_layout
    shapes.EXACT[aten._thnn_fused_gru_cell.default] = _fused_gru_cell_layout
    shapes.EXACT[aten._thnn_fused_gru_cell_backward.default] = _fused_gru_cell_backward_layout
    if _IS_ACCEPTABLE:
        return
    original = torch.backends.cudnn.is_acceptable
    _IS_ACCEPTABLE.append(original)

    def is_acceptable(tensor: torch.Tensor) -> bool:
        return False if isinstance(tensor, RemoteTensor) else original(tensor)

    torch.backends.cudnn.is_acceptable = is_acceptable


def uninstall() -> None:
    _ACCEPTS.clear()
    _ASK.clear()
    shapes.EXACT.pop(aten._cudnn_rnn.default, None)
    shapes.EXACT.pop(aten._cudnn_rnn_backward.default, None)
    shapes.EXACT.pop(aten._thnn_fused_gru_cell.default, None)
    shapes.EXACT.pop(aten._thnn_fused_gru_cell_backward.default, None)
    if _IS_ACCEPTABLE:
        torch.backends.cudnn.is_acceptable = _IS_ACCEPTABLE.pop()


# ---- cuDNN on a CUDA worker ----------------------------------------------------------------

CUDNN_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
"""cudnnRNNMode_t, the `mode` argument of `_cudnn_rnn`."""
CUDNN_GATES = {0: 1, 1: 1, 2: 4, 3: 3}
"""Gates per mode: the rows of a layer's weights are gates x hidden_size."""
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ACCEPTS: dict[tuple[int, torch.dtype], bool] = {}
"""(stream, dtype) → the worker's ATen's `cudnn_is_acceptable` for a tensor of that dtype."""
_ASK: list[Callable[[torch.Tensor], bool]] = []
"""How `_cudnn` asks the worker (install()'s argument: a round trip, gpupool.torch.kernels)."""


def _cudnn(input: torch.Tensor) -> bool:
    """Whether a local GPU would run this stack through cuDNN: ATen's `cudnn_is_acceptable` of
    the input (before autocast), asked of the worker's ATen once per dtype (which dtypes it
    takes depends on the torch version: torch 2.11's takes bfloat16), on a CUDA worker."""
    if not (
        _on_cuda_worker(input)
        and torch.backends.cudnn.enabled
        and input.dtype in _FLOATING
        and input.dim() == 3
        and input.numel() != 0
    ):
        return False
    key = (id(input._gp.stream), input.dtype)
    accepts = _ACCEPTS.get(key)
    if accepts is None:
        accepts = _ACCEPTS[key] = bool(_ASK and _ASK[0](input))
    return accepts


def _autocast_half(tensor: torch.Tensor) -> torch.Tensor:
    """autocast's `cached_cast(kHalf, ...)`: floating tensors other than double and half."""
    cast = tensor.is_floating_point() and tensor.dtype not in (torch.float64, torch.float16)
    return tensor.half() if cast else tensor


def _cudnn_stack(
    kind: str, input: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None,
    params: Sequence[torch.Tensor], has_biases: bool, num_layers: int, dropout: float,
    train: bool, bidirectional: bool, batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """ATen's `_cudnn_impl`: the whole stack as one `_cudnn_rnn`, without a weight buffer or a
    dropout state (the worker has both)."""
    hidden, proj = hx.size(2), 0
    if cx is not None and cx.size(2) != hx.size(2):  # an LSTM with projections
        hidden, proj = cx.size(2), hx.size(2)
    stride0 = (4 if has_biases else 2) + (1 if proj else 0)
    weights = list(params)
    if autocast._enabled()[0]:
        # A local GPU's autocast kernel for _cudnn_rnn (ATen's AutocastRNN.cpp): float16
        # whatever autocast's dtype, the weights cast (autograd sees the casts) into a flat
        # float16 buffer, which the worker makes here from the cast weights alike.
        input, hx = _autocast_half(input), _autocast_half(hx)
        cx = _autocast_half(cx) if cx is not None else None
        if weights and weights[0].dtype not in (torch.float16, torch.float64):
            weights = [w.half() for w in weights]
    output, hy, cy, _, _ = aten._cudnn_rnn.default(
        input, weights, stride0, None, hx, cx, CUDNN_MODES[kind], hidden, proj, num_layers,
        batch_first, dropout, train, bidirectional, [], None,
    )  # fmt: skip
    return output, hy, cy


def _contiguous(shape: Sequence[int], dtype: torch.dtype) -> TensorSpec:
    return TensorSpec(tuple(shape), contiguous_strides(shape), 0, dtype)


def _sequence_major(shape: Sequence[int], batch_first: bool, dtype: torch.dtype) -> TensorSpec:
    """What cuDNN's kernels make of a [seq, batch, features] result: contiguous in that order,
    and for a batch-first call transposed to [batch, seq, features] in place (so not
    contiguous, which the meta kernel's result is)."""
    if not batch_first:
        return _contiguous(shape, dtype)
    batch, seq, features = shape
    return TensorSpec((batch, seq, features), (features, batch * features, 1), 0, dtype)


def _cudnn_weight_count(
    mode: int, features: int, hidden: int, proj: int, num_layers: int, directions: int
) -> int:
    """Elements of cuDNN's weight buffer: per layer and direction the input and hidden
    matrices, two biases per gate row (cuDNN keeps them without biases too, as zeros) and the
    projection."""
    rows = CUDNN_GATES[mode] * hidden
    out = proj or hidden
    total = 0
    for layer in range(num_layers):
        inputs = features if layer == 0 else directions * out
        per = rows * (inputs + out) + 2 * rows + (out * hidden if proj else 0)
        total += directions * per
    return total


def _cudnn_rnn_layout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`_cudnn_rnn`'s five outputs as the worker's cuDNN makes them: the output sequence-major
    (transposed back for batch first), hy and cy contiguous (cy empty without a cell state),
    the reserve as an empty byte tensor (its size is cuDNN's; it stays on the worker) and the
    weight buffer the worker made."""
    if kwargs or len(args) != 16:
        return None
    input, weight, _, weight_buf, hx, cx, mode, hidden, proj, layers = args[:10]
    batch_first, bidirectional, batch_sizes = args[10], args[13], args[14]
    if batch_sizes or weight_buf is not None or input.dim() != 3 or mode not in CUDNN_GATES:
        return None
    if batch_first:
        batch, seq, features = input.shape
    else:
        seq, batch, features = input.shape
    directions = 2 if bidirectional else 1
    out = proj or hidden
    output = _sequence_major(
        (batch, seq, directions * out) if batch_first else (seq, batch, directions * out),
        batch_first, input.dtype,
    )  # fmt: skip
    hy = _contiguous((layers * directions, batch, out), hx.dtype)
    if cx is not None:
        cy = _contiguous((layers * directions, batch, hidden), cx.dtype)
    else:
        cy = _contiguous((0,), hx.dtype)
    reserve = _contiguous((0,), torch.uint8)
    count = _cudnn_weight_count(mode, features, hidden, proj, layers, directions)
    buffer = _contiguous((count,), weight[0].dtype if weight else input.dtype)
    return Seq(tuple, (output, hy, cy, reserve, buffer))


def _cudnn_rnn_backward_layout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`_cudnn_rnn_backward`'s gradients as the worker returns them: the input's sequence-major
    (as the forward's output), hx's and cx's contiguous, the weights' contiguous, one per
    weight (the worker copies them out of cuDNN's gradient buffer: as views into it they
    would have offsets the client does not know)."""
    if kwargs or len(args) != 22:
        return None
    input, weight, hx, cx = args[0], args[1], args[4], args[5]
    grads, batch_first, mask = args[7:10], args[14], args[21]
    if input.dim() != 3 or len(mask) != 4:
        return None
    if all(g is None for g in grads):
        return Seq(tuple, (Value(None),) * 3 + (Seq(list, (Value(None),) * len(weight)),))
    dx = _sequence_major(tuple(input.shape), batch_first, input.dtype)
    dhx = _contiguous(tuple(hx.shape), hx.dtype)
    dcx = _contiguous(tuple(cx.shape), cx.dtype) if cx is not None else Value(None)
    dw = tuple(_contiguous(tuple(w.shape), w.dtype) for w in weight) if mask[3] else ()
    return Seq(tuple, (dx, dhx, dcx, Seq(list, dw)))


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


# A CUDA worker's cells for the stacks cuDNN does not take (bfloat16, cuDNN off): ATen's
# LSTMCell and GRUCell on a CUDA input, each step's input and hidden products (no bias) and the
# fused cell kernel, which adds the biases.


def _fused_lstm_cell(step: torch.Tensor, hidden: Hidden, params: Sequence[torch.Tensor]) -> Hidden:
    hx, cx = hidden
    biases = len(params) in (4, 5)
    igates = torch.matmul(step, params[0].t())
    hgates = torch.matmul(hx, params[1].t())
    hy, cy, _ = aten._thnn_fused_lstm_cell.default(
        igates, hgates, cx, params[2] if biases else None, params[3] if biases else None
    )
    if len(params) in (3, 5):  # a projection (proj_size): w_hr last
        hy = torch.matmul(hy, params[-1].t())
    return hy, cy


def _fused_gru_cell(step: torch.Tensor, hidden: Hidden, params: Sequence[torch.Tensor]) -> Hidden:
    biases = len(params) == 4
    igates = torch.matmul(step, params[0].t())
    hgates = torch.matmul(hidden, params[1].t())
    return aten._thnn_fused_gru_cell.default(
        igates, hgates, hidden, params[2] if biases else None, params[3] if biases else None
    )[0]


def _fused_gru_cell_layout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`_thnn_fused_gru_cell` (no meta kernel): hy as hx, and a [batch, 5 x hidden] workspace."""
    if kwargs or len(args) < 3 or args[2].dim() != 2:
        return None
    hx = args[2]
    batch, hidden = hx.shape
    return Seq(tuple, (_contiguous((batch, hidden), hx.dtype),
                       _contiguous((batch, 5 * hidden), hx.dtype)))  # fmt: skip


def _fused_gru_cell_backward_layout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`_thnn_fused_gru_cell_backward`: both gates' gradients [batch, 3 x hidden], hx's as
    grad_hy, the biases' (sums over the batch) only with biases."""
    if kwargs or len(args) != 3 or args[1].dim() != 2:
        return None
    grad_hy, workspace, has_bias = args
    batch, hidden = workspace.shape[0], workspace.shape[1] // 5
    gates = _contiguous((batch, 3 * hidden), workspace.dtype)
    bias: Any = _contiguous((3 * hidden,), workspace.dtype) if has_bias else Value(None)
    return Seq(tuple, (gates, gates, _contiguous(tuple(grad_hy.shape), grad_hy.dtype), bias, bias))


def _stepwise(
    cell: Cell, inputs: torch.Tensor, hidden: Hidden, params: Sequence[torch.Tensor],
    reverse: bool,
) -> tuple[torch.Tensor, Hidden]:  # fmt: skip
    """ATen's FullLayer on a CUDA input: no projection ahead, the cell takes each step."""
    return _steps(cell, inputs.unbind(0), hidden, params, reverse)


def _steps(
    cell: Cell, steps: Sequence[torch.Tensor], hidden: Hidden, params: Sequence[torch.Tensor],
    reverse: bool,
) -> tuple[torch.Tensor, Hidden]:  # fmt: skip
    """The cell over a layer's steps (backwards for the reverse direction), the outputs
    stacked in time order."""
    outputs = []
    for step in reversed(steps) if reverse else steps:
        hidden = cell(step, hidden, params)
        outputs.append(_output(hidden))
    if reverse:
        outputs.reverse()
    return torch.stack(outputs, 0), hidden


def _on_cuda_worker(input: torch.Tensor) -> TypeGuard[RemoteTensor]:
    return type(input) is RemoteTensor and stream_of(input._gp).is_cuda_worker


def _layer(
    cell: Cell, inputs: torch.Tensor, hidden: Hidden, params: Sequence[torch.Tensor],
    reverse: bool,
) -> tuple[torch.Tensor, Hidden]:  # fmt: skip
    """ATen's FullLayer on a CPU input: the whole layer's input projection first."""
    b_ih = params[2] if len(params) >= 4 else None
    return _steps(cell, F.linear(inputs, params[0], b_ih).unbind(0), hidden, params, reverse)


Layer = Callable[
    [Cell, torch.Tensor, Hidden, Sequence[torch.Tensor], bool], tuple[torch.Tensor, Hidden]
]
"""One layer in one direction: (cell, input, initial hidden state, weights, reverse)."""


def _stack(
    cell: Cell, input: torch.Tensor, hiddens: list[Hidden], params: list[list[torch.Tensor]],
    num_layers: int, dropout: float, train: bool, bidirectional: bool,
    layer_of: Layer | None = None,
) -> tuple[torch.Tensor, list[Hidden]]:  # fmt: skip
    """The layers one after the other, each direction's output side by side."""
    if layer_of is None:
        layer_of = _stepwise if cell in (_fused_lstm_cell, _fused_gru_cell) else _layer
    directions = 2 if bidirectional else 1
    finals: list[Hidden] = []
    layer_input = input
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            out, final = layer_of(cell, layer_input, hiddens[index], params[index], direction == 1)
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
    if _cudnn(input):
        return _cudnn_stack(
            "lstm", input, h0, c0, params, has_biases, num_layers, dropout, train,
            bidirectional, batch_first,
        )  # fmt: skip
    projected = h0.size(2) != c0.size(2)
    grouped = _group(params, has_biases, projected)
    if _onednn(input, h0, c0, params):
        return _onednn_lstm(
            input, h0, c0, grouped, has_biases, num_layers, dropout, train, bidirectional,
            batch_first,
        )  # fmt: skip
    x = input.transpose(0, 1) if batch_first else input
    hiddens = list(zip(h0.unbind(0), c0.unbind(0), strict=True))
    cell = _fused_lstm_cell if _on_cuda_worker(input) else _lstm_cell
    out, finals = _stack(cell, x, hiddens, grouped, num_layers, dropout, train, bidirectional)
    out = out.transpose(0, 1) if batch_first else out
    return out, torch.stack([h for h, _ in finals], 0), torch.stack([c for _, c in finals], 0)


def gru(
    input: torch.Tensor, hx: torch.Tensor, params: Sequence[torch.Tensor], has_biases: bool,
    num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if _cudnn(input):
        out, hy, _ = _cudnn_stack(
            "gru", input, hx, None, params, has_biases, num_layers, dropout, train,
            bidirectional, batch_first,
        )  # fmt: skip
        return out, hy
    grouped = _group(params, has_biases, False)
    x = input.transpose(0, 1) if batch_first else input
    cell = _fused_gru_cell if _on_cuda_worker(input) else _gru_cell
    out, finals = _stack(
        cell, x, list(hx.unbind(0)), grouped, num_layers, dropout, train, bidirectional
    )
    out = out.transpose(0, 1) if batch_first else out
    return out, torch.stack(finals, 0)


def _plain(kind: str, composite: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """nn.RNN's layers (`rnn_tanh`, `rnn_relu`): cuDNN where a local GPU takes it, else ATen's
    composite, whose cells every worker runs."""

    def layer(
        input: torch.Tensor, hx: torch.Tensor, params: Sequence[torch.Tensor],
        has_biases: bool, num_layers: int, dropout: float, train: bool, bidirectional: bool,
        batch_first: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if _cudnn(input):
            out, hy, _ = _cudnn_stack(
                kind, input, hx, None, params, has_biases, num_layers, dropout, train,
                bidirectional, batch_first,
            )  # fmt: skip
            return out, hy
        result = composite.decompose(
            input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first,
        )  # fmt: skip
        return result[0], result[1]

    layer.__name__ = kind
    return layer


rnn_tanh = _plain("rnn_tanh", aten.rnn_tanh.input)
rnn_relu = _plain("rnn_relu", aten.rnn_relu.input)


# ---- packed sequences (`lstm.data`, `gru.data`) ------------------------------------------------
# On a CPU worker: ATen's PackedLayer and ReversedPackedLayer with the CPU cells above, op for
# op (the whole input projected first, the hidden states narrowed as sequences end and
# regrown backwards). On a CUDA worker: ATen's composite, whose fused cells the worker has.


def _narrow(hidden: Hidden, start: int, end: int) -> Hidden:
    if isinstance(hidden, tuple):
        return tuple(h.narrow(0, start, end - start) for h in hidden)
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: Sequence[Hidden]) -> Hidden:
    if isinstance(hiddens[0], tuple):
        return tuple(torch.cat(parts, 0) for parts in zip(*hiddens, strict=True))
    return torch.cat(list(hiddens), 0)


def _output(hidden: Hidden) -> torch.Tensor:
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _packed_layer(
    cell: Cell, data: torch.Tensor, sizes: list[int], hidden: Hidden,
    params: Sequence[torch.Tensor], reverse: bool,
) -> tuple[torch.Tensor, Hidden]:  # fmt: skip
    projected = F.linear(data, params[0], params[2] if len(params) >= 4 else None)
    outputs: list[torch.Tensor] = []
    if not reverse:
        finals: list[Hidden] = []
        offset, last = 0, sizes[0]
        for size in sizes:
            step = projected.narrow(0, offset, size)
            offset += size
            if last > size:  # sequences ended: their final states are kept as they are
                finals.append(_narrow(hidden, size, last))
                hidden = _narrow(hidden, 0, size)
            last = size
            hidden = cell(step, hidden, params)
            outputs.append(_output(hidden))
        finals.append(hidden)
        finals.reverse()
        return torch.cat(outputs, 0), _concat(finals)
    initial = hidden
    offset, last = data.size(0), sizes[-1]
    hidden = _narrow(initial, 0, last)
    for size in reversed(sizes):
        if size > last:  # sequences begin (backwards): their initial states join
            hidden = _concat([hidden, _narrow(initial, last, size)])
        step = projected.narrow(0, offset - size, size)
        offset -= size
        last = size
        hidden = cell(step, hidden, params)
        outputs.append(_output(hidden))
    outputs.reverse()
    return torch.cat(outputs, 0), hidden


def _packed_stack(
    cell: Cell, data: torch.Tensor, sizes: list[int], hiddens: list[Hidden],
    params: list[list[torch.Tensor]], num_layers: int, dropout: float, train: bool,
    bidirectional: bool,
) -> tuple[torch.Tensor, list[Hidden]]:  # fmt: skip
    def layer_of(
        cell: Cell, x: torch.Tensor, hidden: Hidden, weights: Sequence[torch.Tensor],
        reverse: bool,
    ) -> tuple[torch.Tensor, Hidden]:  # fmt: skip
        return _packed_layer(cell, x, sizes, hidden, weights, reverse)

    return _stack(
        cell, data, hiddens, params, num_layers, dropout, train, bidirectional, layer_of
    )


def _batch_sizes(batch_sizes: torch.Tensor, data: torch.Tensor) -> list[int]:
    """A PackedSequence's batch sizes, as ATen checks them before reading the data by them."""
    if batch_sizes.device.type != "cpu" or batch_sizes.dim() != 1:
        raise RuntimeError("batch_sizes tensor should be a 1D CPU int64 tensor")
    sizes = [int(s) for s in batch_sizes.tolist()]
    if not sizes or any(s < 1 for s in sizes) or sizes != sorted(sizes, reverse=True):
        raise RuntimeError("batch_sizes must be positive and non-increasing")
    if sum(sizes) != data.size(0):
        raise RuntimeError(f"batch_sizes sum to {sum(sizes)}, the data has {data.size(0)} rows")
    return sizes


def _cpu_worker(data: torch.Tensor) -> bool:
    return type(data) is RemoteTensor and not stream_of(data._gp).is_cuda_worker


def lstm_packed(
    data: torch.Tensor, batch_sizes: torch.Tensor, hx: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor], has_biases: bool, num_layers: int, dropout: float,
    train: bool, bidirectional: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    if not _cpu_worker(data):
        out = aten.lstm.data.decompose(
            data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional
        )
        return out[0], out[1], out[2]
    if len(hx) != 2:
        raise RuntimeError(f"lstm expects two hidden states, got {len(hx)}")
    h0, c0 = hx
    sizes = _batch_sizes(batch_sizes, data)
    grouped = _group(params, has_biases, h0.size(2) != c0.size(2))
    hiddens = list(zip(h0.unbind(0), c0.unbind(0), strict=True))
    out, finals = _packed_stack(
        _lstm_cell, data, sizes, hiddens, grouped, num_layers, dropout, train, bidirectional
    )
    return out, torch.stack([h for h, _ in finals], 0), torch.stack([c for _, c in finals], 0)


def gru_packed(
    data: torch.Tensor, batch_sizes: torch.Tensor, hx: torch.Tensor,
    params: Sequence[torch.Tensor], has_biases: bool, num_layers: int, dropout: float,
    train: bool, bidirectional: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if not _cpu_worker(data):
        out = aten.gru.data.decompose(
            data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional
        )
        return out[0], out[1]
    sizes = _batch_sizes(batch_sizes, data)
    grouped = _group(params, has_biases, False)
    out, finals = _packed_stack(
        _gru_cell, data, sizes, list(hx.unbind(0)), grouped, num_layers, dropout, train,
        bidirectional,
    )  # fmt: skip
    return out, torch.stack(finals, 0)
