"""cuDNN's RNN on a CUDA worker, with the dropout between layers a local GPU draws.

A client calls `aten::_cudnn_rnn` for a whole recurrent stack (gpupool.torch.rnn), as ATen's
`_cudnn_impl` does on a local GPU, but without the dropout state: on a local GPU that is a
buffer ATen keeps per device (`get_dropout_state` in ATen's cudnn/RNN.cpp), made by
`_cudnn_init_dropout_state` from a seed drawn off the device's generator the first time a stack
trains with dropout, and again at the first such call after the generator was seeded
(`manual_seed`, `set_rng_state`: its `reset_rnn_state` flag). Nothing in Python reaches that
buffer or that flag, and a state made otherwise would draw other masks; a seed drawn at
another moment would move every later random op of the program.

So the worker keeps the same state the same way (`DropoutState`): per device, made with the
same seed draw (`random_` of a long scalar on the device) at the same moments, the flag raised
by the executor where it seeds the generator for the client. The state goes to `_cudnn_rnn`,
and stays with the forward's weight buffer (`DROPOUT_STATES`) for the backward, which needs the
same one (opchecks fills it in: the client's autograd saved none). Without dropout the op runs
as the client named it.

(ATen's own composite, run under a dispatch mode that records the `_cudnn_rnn` it calls, would
give the same state; entering a dispatch mode imports Dynamo, four seconds at a worker's first
RNN.)
"""

from __future__ import annotations

import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

DROPOUT_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Weight buffer of a forward that trained with dropout → the dropout state it used."""


class DropoutState:
    """ATen's per-device cuDNN dropout state, kept as ATen keeps it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[int, torch.Tensor] = {}
        self._lowered: set[int] = set()
        """Devices whose generator's flag (ATen's `reset_rnn_state`) a dropout call has taken
        down since the generator was last seeded; a new generator's flag is up."""

    def generator_seeded(self, device: torch.device) -> None:
        with self._lock:
            self._lowered.discard(_index(device))

    def state(self, dropout: float, device: torch.device) -> torch.Tensor:
        index = _index(device)
        with self._lock:
            reset = index not in self._lowered
            self._lowered.add(index)
            buffer = self._buffers.get(index)
            if buffer is None or reset:
                with torch.cuda.device(device):
                    seed = int(torch.empty((), dtype=torch.long, device=device).random_().item())
                    buffer = torch._cudnn_init_dropout_state(
                        dropout, True, seed, dtype=torch.uint8, device=device
                    )
                self._buffers[index] = buffer
            return buffer


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


DROPOUT = DropoutState()


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
        drawn = train and dropout > 0 and dropout_state is None
        if drawn:
            dropout_state = DROPOUT.state(dropout, input.device)
        result = tuple(self._kernel(
            input, weight, weight_stride0, weight_buf, hx, cx, mode, hidden_size, proj_size,
            num_layers, batch_first, dropout, train, bidirectional, batch_sizes, dropout_state,
        ))  # fmt: skip
        if drawn:
            DROPOUT_STATES[result[4]] = dropout_state
        return result
