"""The op policy: every aten overload decided, the table what the rules make, undecided refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpupool.worker import oppolicy
from gpupool.worker.executor import Executor
from gpupool.worker.memory import HostMemory
from gpupool.worker.opchecks import CHECKS
from gpupool.worker.oppolicy import Decision, OpInfo, Ruling, decide, ruling

REGISTRIES = sorted(oppolicy.REGISTRIES_DIR.glob("*.json"))


def executor() -> Executor:
    return Executor("lease-policy", torch.device("cpu"), HostMemory(None))


def test_every_aten_overload_of_the_running_torch_is_decided() -> None:
    """A torch upgrade that adds an overload fails here until someone decides it (regenerate
    the table: `python -m gpupool.worker.oppolicy --write`, and review its diff)."""
    assert oppolicy.undecided(oppolicy.registry()) == []


@pytest.mark.parametrize("path", REGISTRIES, ids=[p.stem for p in REGISTRIES])
def test_every_overload_of_the_other_workers_torch_is_decided(path: Path) -> None:
    """The GPU machine's torch (2.11) differs from CI's: its registry, dumped there with
    `--dump`, is decided too."""
    version, ops = oppolicy.load_registry(path)
    assert version in oppolicy.table_versions()
    assert oppolicy.undecided(ops) == []


def test_the_committed_table_is_what_the_rules_generate() -> None:
    """Nobody edits the table by hand, and a rule change ships with its regenerated table."""
    if torch.__version__ not in oppolicy.table_versions():
        pytest.skip(f"the table was not generated with torch {torch.__version__}")
    registries = [(torch.__version__, oppolicy.registry())]
    registries += [oppolicy.load_registry(p) for p in REGISTRIES]
    committed = json.loads(oppolicy.TABLE_PATH.read_text())
    assert oppolicy.generate(registries)["ops"] == committed["ops"]


def test_every_check_the_table_names_exists() -> None:
    named = {r.detail for r in oppolicy.table().values() if r.decision is Decision.CHECK}
    assert named <= CHECKS.keys()
    assert named == CHECKS.keys(), "a check no op uses"


def test_every_refusal_says_why() -> None:
    for name, decided in oppolicy.table().items():
        if decided.decision is Decision.REFUSE:
            assert len(decided.detail) > 10, name


def test_an_undecided_op_is_refused_with_a_reason_that_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = dict(oppolicy.table())
    del table["aten::add.Tensor"]
    monkeypatch.setattr(oppolicy, "table", lambda: table)
    op = executor()._resolve_op("aten::add.Tensor")
    assert op.call is None and op.problem is not None
    assert "undecided" in op.problem and "aten::add.Tensor" in op.problem


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("aten::_print", "stdout"),
        ("aten::from_file", "files"),
        ("aten::set_.source_Storage", "Storage"),
        ("aten::record_stream", "streams"),
        ("aten::_nested_view_from_buffer", "raw offsets"),
        ("aten::fbgemm_linear_fp16_weight", "packed"),
        ("aten::Int.str", "TorchScript"),
        ("aten::sparse_resize_", "size under its indices"),
    ],
)
def test_refused_ops_never_run_and_say_why(name: str, words: str) -> None:
    op = executor()._resolve_op(name)
    assert op.call is None and op.problem is not None
    assert f"{name} is not allowed on a gpupool worker" in op.problem and words in op.problem


def test_allowed_ops_keep_the_bare_cpp_callable() -> None:
    """No wrapper on the hot path: an allowed op's call is the OpOverload's own `_op`."""
    op = executor()._resolve_op("aten::add.Tensor")
    assert op.call is torch.ops.aten.add.Tensor._op
    assert ruling("aten::add.Tensor") == Ruling(Decision.ALLOW)


def test_checked_ops_run_behind_their_check() -> None:
    op = executor()._resolve_op("aten::_reshape_alias")
    assert op.fn is torch.ops.aten._reshape_alias.default
    assert op.call is not None and op.call is not op.fn._op
    with pytest.raises(RuntimeError, match="_reshape_alias refused"):
        op.call(torch.zeros(4), [100], [1])


def test_the_rules_judge_by_what_an_op_does_not_its_name() -> None:
    assert ruling("aten::_unsafe_view").decision is Decision.ALLOW  # a view that checks numel
    assert ruling("aten::unsafe_split.Tensor").detail == "few_views"  # "unsafe": no version counter
    assert ruling("aten::segment_reduce").decision is Decision.CHECK  # unsafe= skips checks
    assert ruling("aten::_segment_reduce_backward").decision is Decision.CHECK  # no unsafe=
    assert ruling("aten::Int.str").decision is Decision.REFUSE  # not a dispatcher op
    file_op = OpInfo("aten::load_x", "aten::load_x(str filename) -> Tensor", True)
    assert decide(file_op).decision is Decision.REFUSE
    storage_op = OpInfo("aten::y", "aten::y(Tensor self, Storage source) -> Tensor", True)
    assert decide(storage_op).decision is Decision.REFUSE


# ---- what the table trusts PyTorch to check (pinned: a torch that stops checking fails here) --


def _raises(fn: object, *args: object) -> None:
    with pytest.raises(RuntimeError):
        fn(*args)  # type: ignore[operator]


def test_torch_keeps_views_and_set_inside_their_storage() -> None:
    """as_strided and set_ are allowed unchecked because PyTorch checks them itself."""
    aten, t = torch.ops.aten, torch.zeros(16)
    _raises(aten.as_strided.default, t, [100], [1], 0)
    _raises(aten.as_strided.default, t, [4], [1], 100)
    _raises(aten.as_strided.default, t, [4], [1], -5)
    _raises(aten.as_strided.default, t, [4], [-1], 8)
    _raises(aten.as_strided_.default, t.clone(), [100], [1], 0)
    _raises(aten.as_strided_copy.default, t, [100], [1], 0)
    _raises(aten.as_strided_scatter.default, t, torch.ones(100), [100], [1], 0)
    _raises(aten.as_strided_scatter.default, t, torch.ones(4), [4], [1], 1000)
    _raises(aten.set_.source_Tensor_storage_offset, torch.zeros(4), t, 100, [4], [1])
    _raises(aten._unsafe_view.default, t, [100])
    _raises(aten.empty_strided.default, [4], [-1])


def test_torch_keeps_the_unsafe_named_index_ops_in_bounds() -> None:
    """`_unsafe_index*` reach the checked index kernels; the masked ones clamp."""
    aten, t, far = torch.ops.aten, torch.arange(16.0), torch.tensor([100_000])
    with pytest.raises(IndexError):
        aten._unsafe_index.Tensor(t, [far])
    with pytest.raises(IndexError):
        aten._unsafe_index_put.default(t.clone(), [far], torch.ones(1))
    masked = aten._unsafe_masked_index.default(t, torch.tensor([True]), [far], 0.0)
    assert masked.tolist() == [15.0]
    target = torch.zeros(16)
    aten._unsafe_masked_index_put_accumulate.default(
        target, torch.tensor([False]), [far], torch.ones(1)
    )
    assert target.tolist() == [0.0] * 16


ONE_OF = {
    "attention_backward": {"grad_out", "grad_out_"},
    "embedding_backward": {"grad", "grad_output"},
    "embedding_bag_backward": {"num_weights", "weight"},
}
"""Arguments a check reads under one of two names."""


@pytest.mark.parametrize("path", REGISTRIES, ids=[p.stem for p in REGISTRIES])
def test_every_checked_op_has_the_arguments_its_check_reads(path: Path) -> None:
    """A check reads arguments by name; the GPU machine's torch names them in its own schemas.
    A name the schema lacks would refuse every call of the op there (safe, but it would break
    the client): compared here for the running torch and every stored registry."""
    registries = [oppolicy.load_registry(path)[1], oppolicy.registry()]
    for ops in registries:
        for name, op in ops.items():
            decided = oppolicy.table().get(name)
            if decided is None or decided.decision is not Decision.CHECK or op.schema is None:
                continue
            arguments = {a.name for a in torch._C.parse_schema(op.schema).arguments}
            missing = CHECKS[decided.detail].needs - arguments
            assert not missing, f"{name} lacks {sorted(missing)} ({op.schema})"
            either = ONE_OF.get(decided.detail)
            assert either is None or arguments & either, f"{name} lacks one of {sorted(either)}"
