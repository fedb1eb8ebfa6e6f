"""cuDNN's RNN on a CUDA worker, with the dropout between layers a local GPU draws.

A client calls `aten::_cudnn_rnn` for a whole recurrent stack (gpupool.torch.rnn), as ATen's
`_cudnn_impl` does on a local GPU, but without the dropout state: on a local GPU that is a
buffer ATen keeps per device (`get_dropout_state`), seeded from the device's generator the
first time a stack trains with dropout and again after each `manual_seed`, and nothing in
Python reaches it. A state made otherwise would draw other masks, and a seed drawn at another
moment would move every later random op of the program.

So where the stack trains with dropout, the worker runs ATen's own composite (`torch.lstm`,
`torch.gru`, `torch.rnn_tanh`, `torch.rnn_relu`) on the client's tensors: it takes the cached
state, or seeds a new one, exactly where a local GPU would, and calls `_cudnn_rnn` with it,
which a dispatch mode lets run and records: its five outputs are this op's, and the state is
kept with the weight buffer (`DROPOUT_STATES`) for the backward, which needs the same one
(opchecks fills it in: the client's autograd saved none). Without dropout the op runs as the
client named it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

DROPOUT_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Weight buffer of a forward that trained with dropout → the dropout state it used."""

_COMPOSITES: dict[int, Any] = {0: torch.rnn_relu, 1: torch.rnn_tanh, 2: torch.lstm, 3: torch.gru}
"""cudnnRNNMode_t → ATen's composite for that kind of stack."""


class _Recorder(TorchDispatchMode):
    """Lets every op of the composite run, and keeps `_cudnn_rnn`'s outputs and state."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self.state: torch.Tensor | None = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:  # fmt: skip
        result = func(*args, **(kwargs or {}))
        if func is aten._cudnn_rnn.default:
            self.outputs = tuple(result)
            self.state = args[15] if len(args) > 15 else (kwargs or {}).get("dropout_state")
        return result


class CudnnRnn:
    """`aten::_cudnn_rnn` as a worker runs it (behind opchecks' `cudnn_rnn` check)."""

    def __init__(self) -> None:
        self._schema = aten._cudnn_rnn.default._schema
        self._kernel = aten._cudnn_rnn.default  # not `_op`: the executor would call that

    def __call__(
        self, input: torch.Tensor, weight: list[torch.Tensor], weight_stride0: int,
        weight_buf: torch.Tensor | None, hx: torch.Tensor, cx: torch.Tensor | None, mode: int,
        hidden_size: int, proj_size: int, num_layers: int, batch_first: bool, dropout: float,
        train: bool, bidirectional: bool, batch_sizes: list[int],
        dropout_state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        if not (train and dropout > 0) or dropout_state is not None:
            return tuple(self._kernel(
                input, weight, weight_stride0, weight_buf, hx, cx, mode, hidden_size, proj_size,
                num_layers, batch_first, dropout, train, bidirectional, batch_sizes,
                dropout_state,
            ))  # fmt: skip
        has_biases = weight_stride0 - (1 if proj_size else 0) == 4
        hidden: Any = (hx, cx) if cx is not None else hx
        recorder = _Recorder()
        with recorder:
            _COMPOSITES[mode](
                input, hidden, weight, has_biases, num_layers, dropout, train, bidirectional,
                batch_first,
            )  # fmt: skip
        if recorder.outputs is None or len(recorder.outputs) != 5:
            raise RuntimeError("_cudnn_rnn: ATen's composite did not call cuDNN for this stack")
        if recorder.state is not None:
            DROPOUT_STATES[recorder.outputs[4]] = recorder.state
        return recorder.outputs
