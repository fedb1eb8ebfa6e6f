"""The compiled hot path (gpupool.torch._fastpath) streams what the Python path streams.

The C module is an accelerator for dispatch.dispatch/run: for every op of a training step it
must append the very records the Python path appends (same ops, arguments, kwargs and outputs,
handles aside, which are fresh numbers each time), and every case it does not handle must
reach the Python path unchanged.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpupool.protocol.v1.dataplane import Ext, Rec
from gpupool.torch import dispatch, runtime
from gpupool.torch.tensor import Handle, RemoteTensor

pytestmark = pytest.mark.slow

if not dispatch.use_fastpath(True):
    pytest.skip(
        "gpupool.torch._fastpath is not built here (no C compiler at install?)",
        allow_module_level=True,
    )


class _Log(deque[list[Any]]):
    """The stream's record queue, remembering every record appended (the flusher pops)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[Any]] = []

    def append(self, record: list[Any]) -> None:
        self.seen.append(record)
        super().append(record)


@pytest.fixture
def fast() -> Iterator[None]:
    yield
    dispatch.use_fastpath(True)


def _normalized(records: list[list[Any]]) -> list[Any]:
    """OP and DEF records with handle numbers replaced by their order of first appearance
    (FREE records left out: when a temporary dies within an op may differ by a reference;
    requests such as SYNC carry request numbers)."""
    names: dict[int, int] = {}

    def name(handle: int) -> str:
        return f"h{names.setdefault(handle, len(names))}"

    def walk(value: Any, outputs: bool = False) -> Any:
        if isinstance(value, msgpack.ExtType) and value.code == Ext.TENSOR:
            return name(int.from_bytes(value.data, "big"))
        if isinstance(value, list | tuple):
            return [walk(v, outputs) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if outputs and isinstance(value, int):
            return name(value)
        return value

    out = []
    for record in records:
        if record[0] not in (Rec.OP, Rec.DEF):
            continue
        if record[0] == Rec.OP:
            _, op_id, args, kwargs, outs = record
            out.append(["OP", op_id, walk(args), walk(kwargs), walk(outs, outputs=True)])
        else:
            out.append(walk(record))
    return out


def _training_step() -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(4, 3, 6, 6, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")

    def loss() -> torch.Tensor:
        logits = model(x)
        extra = torch.cat([logits, logits.detach() * 0.5], dim=1).float().sum(dim=1)
        return nn.functional.cross_entropy(logits, y) + extra.mean() * 0.0

    return _autocast_step(opt, loss)


def _autocast_step(
    opt: torch.optim.Optimizer, loss: Callable[[], torch.Tensor]
) -> Callable[[], torch.Tensor]:
    """A training step: the loss under bf16 autocast, backward, the optimizer's step."""

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = loss()
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        return value.detach()

    return step


def _records_of_one_step(stream: Any, step: Callable[[], Any], compiled: bool) -> list[Any]:
    """Every record one step appends, on the compiled path or the Python one."""
    assert dispatch.use_fastpath(compiled) == compiled
    log = _Log()
    torch.cuda.synchronize()
    stream.records = log
    step()
    torch.cuda.synchronize()
    stream.records = deque(log)
    return log.seen


def test_the_compiled_path_streams_the_records_of_the_python_path(
    attach: Callable[..., Any], fast: None
) -> None:
    attach()
    stream = runtime.stream(0)
    step = _training_step()
    step()  # op ids defined and plans cached on both paths alike
    step()
    torch.cuda.synchronize()
    recorded: dict[bool, list[Any]] = {}
    frees: dict[bool, int] = {}
    for compiled in (True, False, True):
        seen = _records_of_one_step(stream, step, compiled)
        recorded[compiled] = _normalized(seen)
        frees[compiled] = sum(1 for record in seen if record[0] == Rec.FREE)
    assert len(recorded[True]) > 40
    assert recorded[True] == recorded[False]
    assert frees[True] == frees[False] > 20  # Handle.__del__'s C version frees as many


def test_training_through_the_compiled_path_equals_the_python_path(
    attach: Callable[..., Any], fast: None
) -> None:
    attach()
    losses = {}
    for compiled in (True, False):
        dispatch.use_fastpath(compiled)
        step = _training_step()
        losses[compiled] = [step().item() for _ in range(4)]
    assert losses[True] == losses[False]
    assert losses[True][-1] < losses[True][0]


@pytest.fixture
def adjust_asked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Reconfigure the C module with an autocast.adjust that logs the ops it is asked about
    (the C module calls the Python adjust only for cases it leaves to Python); the real one is
    configured again afterwards."""
    from gpupool.torch import autocast

    asked: list[str] = []
    original = autocast.adjust

    def adjust(info: Any, args: Any, kwargs: Any) -> Any:
        asked.append(info.short_name)
        return original(info, args, kwargs)

    monkeypatch.setattr(autocast, "adjust", adjust)
    dispatch._configure(dispatch._fastpath, dispatch._torch_find_rule)
    yield asked
    monkeypatch.undo()
    dispatch._configure(dispatch._fastpath, dispatch._torch_find_rule)


def _transformer_step() -> Callable[[], torch.Tensor]:
    """Linear layers (addmm, mm in backward), layer norm (float32 list), GELU and a residual
    under bf16 autocast: the op mix of a GPT-2 block's MLP half."""
    torch.manual_seed(3)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    model = nn.Sequential(Block(), Block()).cuda()
    head = nn.Linear(16, 5).cuda()
    # SGD: its records do not change from step to step (Adam's bias correction does).
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
    x = torch.randn(3, 4, 16, device="cuda")
    y = torch.randint(0, 5, (3,), device="cuda")
    return _autocast_step(opt, lambda: nn.functional.cross_entropy(head(model(x).mean(dim=1)), y))


def test_autocast_decisions_in_c_stream_what_python_streams(
    attach: Callable[..., Any], fast: None, adjust_asked: list[str]
) -> None:
    attach()
    stream = runtime.stream(0)
    step = _transformer_step()
    step()
    step()
    torch.cuda.synchronize()
    recorded: dict[bool, list[Any]] = {}
    for compiled in (True, False):
        adjust_asked.clear()
        recorded[compiled] = _normalized(_records_of_one_step(stream, step, compiled))
        if compiled:
            # Matmuls and layer norm, forward and backward, were decided in C; only
            # the softmax-backward rule (cross entropy's) reaches the Python adjust.
            assert set(adjust_asked) <= {"_log_softmax_backward_data", "_softmax_backward_data"}
        else:
            assert {"addmm", "mm", "native_layer_norm"} <= set(adjust_asked)
    casts = [
        r for r in recorded[True] if r[0] == "OP" and isinstance(r[3], dict) and "dtype" in r[3]
    ]
    assert casts, "the step casts under autocast"
    assert recorded[True] == recorded[False]
    losses = {}
    for compiled in (True, False):  # fresh models: training equal on both paths
        dispatch.use_fastpath(compiled)
        step = _transformer_step()
        losses[compiled] = [step().item() for _ in range(3)]
    assert losses[True] == losses[False]
    assert losses[True][-1] < losses[True][0]


def test_cat_under_autocast_promotes_mixed_inputs_only(
    attach: Callable[..., Any], fast: None, adjust_asked: list[str]
) -> None:
    attach()
    a = torch.ones(2, 3, device="cuda")
    b = torch.full((2, 3), 2.0, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.cat([b, b])  # the first one fills the plan cache through the Python path
        adjust_asked.clear()
        same = torch.cat([b, b])  # one dtype: decided in C
        assert adjust_asked == []
        mixed = torch.cat([a, b], dim=1)  # float32 and bfloat16: the Python adjust
        assert adjust_asked == ["cat"]
    assert same.dtype == torch.bfloat16 and mixed.dtype == torch.float32
    assert mixed.cpu().tolist() == [[1.0] * 3 + [2.0] * 3] * 2


def test_a_weight_changed_in_place_is_cast_again(attach: Callable[..., Any], fast: None) -> None:
    attach()
    results = {}
    for compiled in (True, False):
        dispatch.use_fastpath(compiled)
        torch.manual_seed(0)
        layer = nn.Linear(4, 4, bias=False).cuda()
        x = torch.ones(2, 4, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            first = layer(x)
            with torch.no_grad():
                layer.weight.mul_(2)  # a new version: last cast is stale
            second = layer(x)
            again = layer(x)  # the new version's cast, cached
        assert first.dtype == second.dtype == torch.bfloat16
        results[compiled] = (first.float().cpu(), second.float().cpu(), again.float().cpu())
        assert torch.equal(results[compiled][1], 2 * results[compiled][0])
        assert torch.equal(results[compiled][2], results[compiled][1])
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False], strict=True))


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=300)
    | st.binary(max_size=300)
    | st.builds(
        msgpack.ExtType,
        st.integers(min_value=0, max_value=127),
        st.binary(min_size=0, max_size=20),
    )
)
_records = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=20)
        | st.lists(inner, max_size=20).map(tuple)
        | st.dictionaries(st.text(max_size=8), inner, max_size=20)
    ),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(
    head=st.lists(st.integers(min_value=0, max_value=300), max_size=3), records=st.lists(_records)
)
def test_records_pack_to_the_bytes_msgpack_makes(head: list[int], records: list[Any]) -> None:
    assert dispatch._fastpath is not None
    expected = msgpack.Packer(use_bin_type=True, autoreset=False)
    for item in (head, *records):
        expected.pack(item)
    assert dispatch._fastpath.pack_records(head, records) == expected.bytes()


def test_kinds_it_does_not_pack_go_to_msgpack() -> None:
    assert dispatch._fastpath is not None
    pack = dispatch._fastpath.pack_records
    for odd in (2**64, -(2**63) - 1, memoryview(b"x"), 1j, "\ud800", object()):
        assert pack([0], [[1, [odd]]]) is None
    # The stream falls back to msgpack, which raises its own error for what cannot be packed.
    from gpupool.torch import stream as stream_module

    assert stream_module.pack_batch([[1, memoryview(b"ab")]]) == msgpack.packb(
        [int(stream_module.Kind.BATCH)]
    ) + msgpack.packb([1, b"ab"])
    with pytest.raises((OverflowError, ValueError, TypeError)):
        stream_module.pack_batch([[1, 2**64]])


def test_the_compiled_path_holds_no_reference_it_should_not(
    attach: Callable[..., Any], fast: None
) -> None:
    attach()
    x = torch.ones(256, device="cuda")
    w = torch.ones(256, device="cuda", requires_grad=True)
    scale = 0.5

    def ops() -> None:
        y = (x * scale + 1).sum(dim=0)  # cached plans: new wrappers, keyed scalars
        z = torch.cat([x, y.detach().expand(4)])  # a tensor list, an alias of a handle
        x.add_(0.0)  # in place: returns its input
        (w * z[:256]).to(torch.bfloat16).float().sum().backward()  # casts, autograd

    for _ in range(3):
        ops()  # plans cached, op ids defined
    torch.cuda.synchronize()
    gc.collect()
    memory = torch.cuda.memory_allocated()
    refs = sys.getrefcount(x), sys.getrefcount(x._gp), sys.getrefcount(scale)
    tracked = len(gc.get_objects())
    for _ in range(300):
        ops()
    w.grad = None
    torch.cuda.synchronize()
    gc.collect()
    assert (sys.getrefcount(x), sys.getrefcount(x._gp), sys.getrefcount(scale)) == refs
    assert len(gc.get_objects()) - tracked < 100, "objects pile up"
    assert torch.cuda.memory_allocated() <= memory, "handles the worker still holds"


def test_cases_it_does_not_handle_reach_the_python_path(
    attach: Callable[..., Any], fast: None
) -> None:
    devices = attach(2)
    assert dispatch.fastpath_active()
    a = torch.arange(6.0, device="cuda").reshape(2, 3)
    # A host tensor argument, a device argument, a plan-cache miss, a values-only op, an
    # in-place op returning its input, a metadata-changing op, a copy to another device.
    assert (a + torch.ones(3)).cpu().tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert torch.zeros(2, device=devices[0]).add(a[0, :2]).cpu().tolist() == [0.0, 1.0]
    assert a.new_full((5, 1), 2.0).sum().item() == 10.0
    assert a.nonzero().shape == (5, 2)
    b = a.clone()
    assert b.mul_(2) is b and b[1, 2].item() == 10.0
    b.unsqueeze_(0)
    assert b.shape == (1, 2, 3)
    on_other = a.to(devices[1])
    assert on_other.device == devices[1] and on_other.cpu().tolist() == a.cpu().tolist()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.add(a, on_other)
    assert a.to(torch.float16).dtype == torch.float16 and a.half().sum().item() == 15.0
    assert a.cpu().dtype == torch.float32
    assert isinstance(a.detach(), RemoteTensor) and a.detach()._gp is a._gp


def test_errors_of_the_worker_still_surface_at_the_next_read(
    attach: Callable[..., Any], fast: None
) -> None:
    attach()
    x = torch.ones(4, device="cuda")
    bad = torch.ones(3, 3, device="cuda")
    # Shapes that meta inference rejects fail at once, as on CUDA.
    with pytest.raises(RuntimeError):
        torch.mm(x.reshape(2, 2), bad)
    assert (x * 2).sum().item() == 8.0


def test_the_dispatch_rule_lookup_answers_for_remote_tensors_only() -> None:
    from torch._library import simple_registry

    module = dispatch._fastpath
    assert module is not None
    assert module.find_rule(torch.ops.aten.add.Tensor, RemoteTensor) is None

    @torch.library.custom_op("gpupool_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    class Other(torch.Tensor):
        pass

    def rule(*args: Any) -> Any:
        return None

    twice.register_torch_dispatch(Other, rule)
    op = torch.ops.gpupool_test.twice.default
    # Every other class still gets its registered rule, through the original lookup.
    registered = simple_registry.singleton.find(op.__qualname__).torch_dispatch_rules
    expected = registered.find(Other)
    assert expected is not None
    assert module.find_rule(op, Other) is expected
    assert simple_registry.find_torch_dispatch_rule(op, Other) is expected
    assert module.find_rule(op, RemoteTensor) is None


def test_configure_refuses_what_it_cannot_use() -> None:
    module = dispatch._fastpath
    assert module is not None
    try:
        with pytest.raises(KeyError, match="remote_type"):
            module.configure({})
        with pytest.raises(RuntimeError, match="not configured"):
            module.torch_dispatch(RemoteTensor, torch.ops.aten.add.Tensor, (), (), {})
        # A handle dropped meanwhile still gets its FREE, through the Python release.
        released: list[int] = []
        handle = object.__new__(Handle)
        stream = SimpleNamespace(release=released.append, recorder=None, watched={7}, open=True)
        handle.id, handle.ext, handle.stream = 7, None, stream
        module.handle_del(handle)
        assert released == [7]
    finally:
        dispatch._fastpath = None
        assert dispatch.use_fastpath(True)
    # Loaded again, its rule lookup still asks torch's for other classes (not itself).
    assert module.find_rule(torch.ops.aten.add.Tensor, torch.Tensor) is None


def test_gpupool_fastpath_0_keeps_the_python_path() -> None:
    env = {**os.environ, "GPUPOOL_FASTPATH": "0"}
    code = "from gpupool.torch import dispatch; print(dispatch.fastpath_active())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
    env["GPUPOOL_FASTPATH"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"
