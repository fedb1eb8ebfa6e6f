"""Programs nobody here wrote (tests/torch/real_programs.py: Hugging Face models from configs,
torchvision's models, PyTorch's examples) give a remote CPU worker's run the local CPU run's
numbers: losses, generated tokens, predictions and the trained weights' checksum.

Equal means `==`, except where the two runs cannot use the same kernel (TOLERANCES says
which and why). Programs whose package is not installed skip, naming it: `pip install -e
'.[programs]'` brings them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import real_programs
import torch

from gpupool.torch import runtime

pytestmark = pytest.mark.slow

TOLERANCES: dict[str, float] = {
    # A local CPU runs a float32 LSTM as oneDNN layers; a worker refuses that kernel (it
    # trusts its weights' shapes), so a CPU worker's LSTM runs ATen's cells: the gradients
    # differ in the last bits (about 1e-9).
    "word_language_model": 1e-7,
}
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
