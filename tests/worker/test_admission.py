"""Charging an op before it runs: output sizes from meta kernels over the worker's own tensors,
in-place growth, views free, one meta run per signature, and ops meta cannot tell left to the
count after them."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from gpupool.worker.admission import MIN_RESERVED_BYTES, Admission, signature
from gpupool.worker.memory import HostMemory, LimitExceeded, MiB

aten = torch.ops.aten


class Spy:
    """The op's real callable, noting whether it ran."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


def admitted(memory: HostMemory, op: Any) -> tuple[Any, Spy, Admission]:
    admission = Admission(memory)
    spy = Spy(op)
    return admission.wrap(op, spy), spy, admission


def test_an_op_whose_output_does_not_fit_never_runs() -> None:
    memory = HostMemory(MiB)
    ones, spy, _ = admitted(memory, aten.ones.default)
    with pytest.raises(LimitExceeded, match=r"the op's outputs \(4.0 MiB\)"):
        ones([MiB], dtype=torch.float32, device=torch.device("cpu"))
    assert spy.calls == 0 and memory.held_bytes() == 0
    out = ones([10], dtype=torch.float32, device=torch.device("cpu"))
    assert spy.calls == 1 and out.tolist() == [1.0] * 10
    assert memory.held_bytes() == 0  # the reservation ends with the op; the store charges


def test_in_place_growth_is_refused_before_the_storage_grows() -> None:
    memory = HostMemory(MiB)
    tensor = torch.zeros(4)
    memory.charge([tensor])
    resize, spy, _ = admitted(memory, aten.resize_.default)
    with pytest.raises(LimitExceeded):
        resize(tensor, [MiB])
    assert spy.calls == 0 and tensor.untyped_storage().nbytes() == 16
    resize(tensor, [100])
    assert memory.held_bytes() == 400  # recounted at its new size


def test_set_growing_a_shared_storage_is_predicted() -> None:
    memory = HostMemory(MiB)
    a, b = torch.zeros(1), torch.zeros(1)
    memory.charge([a, b])
    set_, spy, _ = admitted(memory, aten.set_.source_Tensor_storage_offset)
    with pytest.raises(LimitExceeded):
        set_(a, b, 0, [MiB], [1])
    assert spy.calls == 0 and b.untyped_storage().nbytes() == 4


def test_small_outputs_are_left_to_the_store_to_charge() -> None:
    """Under MIN_RESERVED_BYTES an output is not reserved first: it runs, and the store's
    charge (the executor's) refuses it a moment later."""
    memory = HostMemory(1000)
    ones, spy, _ = admitted(memory, aten.ones.default)
    out = ones([1000], dtype=torch.float32, device=torch.device("cpu"))
    assert spy.calls == 1 and out.numel() * 4 < MIN_RESERVED_BYTES
    with pytest.raises(LimitExceeded):
        memory.charge([out])


def test_views_and_in_place_ops_that_do_not_grow_cost_nothing() -> None:
    memory = HostMemory(100)
    tensor = torch.zeros(20)  # 80 of the 100 bytes
    memory.charge([tensor])
    expand, _, _ = admitted(memory, aten.expand.default)
    add_, _, _ = admitted(memory, aten.add_.Tensor)
    view = expand(tensor, [1000, 20])
    add_(tensor, tensor)
    assert view.shape == (1000, 20) and memory.held_bytes() == 80


def test_a_signature_runs_its_meta_kernel_once() -> None:
    memory = HostMemory(1 << 30)
    add, spy, admission = admitted(memory, aten.add.Tensor)
    x, y = torch.zeros(3), torch.zeros(3)
    for _ in range(5):
        add(x, y)
    assert admission.predicted == 1 and spy.calls == 5
    add(torch.zeros(4), torch.zeros(4))
    add(x, y, alpha=2)
    assert admission.predicted == 3


def test_an_op_meta_cannot_tell_runs_and_is_left_to_the_count() -> None:
    memory = HostMemory(1000)
    nonzero, spy, admission = admitted(memory, aten.nonzero.default)
    assert nonzero(torch.tensor([0.0, 1.0, 2.0])).tolist() == [[1], [2]]
    assert nonzero(torch.tensor([0.0, 1.0, 2.0])).tolist() == [[1], [2]]
    assert spy.calls == 2 and admission.predicted == 1  # "cannot tell" is kept too


def test_signatures_tell_storage_layout_only_for_ops_that_write() -> None:
    x = torch.zeros(8)
    assert signature((x,), {}, False) == signature((torch.zeros(8),), {}, False)
    grown = torch.zeros(8)
    grown.resize_(100)
    grown.resize_(8)  # same sizes, a storage of 400 bytes
    assert signature((x,), {}, True) != signature((grown,), {}, True)
    assert signature((x, x), {}, True) != signature((x, torch.zeros(8)), {}, True)
    assert signature((object(),), {}, False) is None


def test_without_a_limit_nothing_is_predicted_but_growth_is_still_counted() -> None:
    memory = HostMemory(None)
    tensor = torch.zeros(4)
    memory.charge([tensor])
    resize, spy, admission = admitted(memory, aten.resize_.default)
    resize(tensor, [100])
    assert admission.predicted == 0 and spy.calls == 1
    assert memory.held_bytes() == 400
    memory.set_limit(200)  # a live resize: from now on, charged first
    with pytest.raises(LimitExceeded):
        resize(tensor, [MiB])
    assert admission.predicted == 1 and spy.calls == 1


def test_an_output_grown_by_an_op_that_then_failed_is_counted() -> None:
    """index_select.out resizes its output, then finds an index out of range: the storage
    has grown all the same, and the count says so."""
    memory = HostMemory(1 << 30)
    out = torch.zeros(4)
    memory.charge([out])
    index_select, _, _ = admitted(memory, aten.index_select.out)
    with pytest.raises(IndexError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch says resizing a non-empty output is deprecated
        index_select(torch.zeros(10, 1000), 0, torch.tensor([0, 1, 2, 50]), out=out)
    assert out.untyped_storage().nbytes() == memory.held_bytes() == 16000
