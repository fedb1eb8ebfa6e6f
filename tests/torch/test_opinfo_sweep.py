"""PyTorch's OpInfo database on a remote CPU worker against local CPU: a sampled third of it.

A deterministic subset (the OpInfos whose name hashes to 0 modulo 3, two samples each) in the
three passes of bench/opinfo_sweep.py, which runs the whole database: fp32 forward, bf16
forward, fp32 backward. A silent mismatch fails the test whatever the rate; errors may not
exceed what the pass-rate target leaves. tests/torch/op_sweep.py says how a sample is judged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from op_sweep import PASSES, Tally, applies, op_db, run_op, sampled

pytestmark = pytest.mark.slow

EVERY = 3
SAMPLES_PER_OP = 2
PASS_PCT_TARGET = 99.5


@pytest.fixture(scope="module")
def subset() -> list[Any]:
    return sampled(op_db(), EVERY)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", PASSES)
def test_sampled_opinfo_ops_match_local_cpu(
    attach: Callable[..., Any], subset: list[Any], which: str
) -> None:
    attach()
    lost: list[str] = []
    tally = Tally()
    for op in subset:
        if applies(op, which):
            run_op(op, which, SAMPLES_PER_OP, tally, on_lost=lambda name=op.name: lost.append(name))
    assert not lost, f"a sample ended the session: {lost}"
    assert tally.tried > 100, f"only {tally.tried} samples ran: the sweep itself is broken"
    mismatches = [
        f"{o.op}[{o.sample}]: {o.cause}" for o in tally.failures() if o.result == "mismatch"
    ]
    assert not mismatches, "silent mismatches:\n" + "\n".join(mismatches)
    errors = [f"{o.op}[{o.sample}]: {o.cause}" for o in tally.failures()]
    assert tally.pass_pct >= PASS_PCT_TARGET, (
        f"{tally.pass_pct:.2f} % of {tally.tried} samples pass; errors:\n" + "\n".join(errors)
    )


REPLAYED = ("add", "index_put", "as_strided", "normal", "nn.functional.dropout", "conj", "sum")
"""Ops a record/replay must carry whole: aliasing views, in-place indexing, random values
(the same seed on both sides), math bits."""


@pytest.mark.timeout(300)
def test_a_recorded_sweep_replays_against_a_local_device_and_catches_a_wrong_value(
    attach: Callable[..., Any], tmp_path: Any
) -> None:
    """bench/opinfo_sweep.py --record / --replay, the way a CUDA worker is judged against the
    local GPU (here a CPU worker against the local CPU): the samples and remote results are
    kept in a file, replayed in another process's sense (loaded back, nothing of the session
    shared), and every sample passes; a recorded value changed by one ulp-sized step is
    named as a mismatch."""
    import torch
    from op_sweep import record_op, replay_op

    attach()
    ops = [op for op in op_db() if op.name in REPLAYED]
    entries = [record_op(op, which, 2) for which in PASSES for op in ops if applies(op, which)]
    path = tmp_path / "recorded.pt"
    torch.save({"entries": entries}, path)
    loaded = torch.load(path, weights_only=False)["entries"]
    by_name = {f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name: op
               for op in ops}  # fmt: skip
    tally = Tally()
    for entry in loaded:
        replay_op(by_name[entry["op"]], entry, tally, "cpu")
    assert tally.tried > 40, tally.summary()
    assert tally.pass_pct == 100.0, tally.failures()

    add = next(e for e in loaded if e["op"] == "add" and e["which"] == "fp32_forward")
    read = add["samples"][0]["actual"]
    read.values = read.values + read.values.abs().max() * 1e-3 + 1e-3
    wrong = Tally()
    replay_op(by_name["add"], add, wrong, "cpu")
    assert wrong.outcomes[0].result == "mismatch", wrong.outcomes
