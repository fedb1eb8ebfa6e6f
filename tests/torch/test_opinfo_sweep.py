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
