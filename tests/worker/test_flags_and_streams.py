"""FLAGS, STREAM, EVENT and QUERY records on the executor: applied in order, every tenant value
checked, and a new client starting from torch's defaults."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_executor import Replies, empty, make, record_loop, run

from gpupool.protocol.v1.dataplane import Kind, ProtocolError, Rec
from gpupool.protocol.v1.tensors import handle_ext
from gpupool.worker import flags
from gpupool.worker.streams import MAX_STREAMS

__all__ = ["record_loop"]  # every test on the compiled record loop and the Python one


@pytest.fixture(autouse=True)
def torch_defaults() -> Any:
    yield
    flags.reset()


def ask(executor: Any, what: str, a: Any = None, b: Any = None) -> list[Any]:
    replies: Replies = run(executor, [[Rec.QUERY, 9, what, a, b]])
    return replies.heads[-1]


def test_flags_are_applied_and_a_new_client_gets_the_defaults() -> None:
    executor = make()
    run(executor, [[Rec.FLAGS, {"deterministic": True, "cudnn_benchmark": True,
                                "float32_matmul_precision": "medium",
                                "default_dtype": "float64"}]])  # fmt: skip
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark and torch.get_default_dtype() == torch.float64
    assert executor.stats()["flags"]["float32_matmul_precision"] == "medium"
    executor.reset()
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_default_dtype() == torch.float32
    assert executor.stats()["flags"] == flags.current()


@pytest.mark.parametrize(
    "body",
    [
        ["deterministic", True],
        {"deterministic": 1},
        {"default_dtype": "int64"},
        {"default_dtype": b"float32"},
        {"float32_matmul_precision": "fastest"},
        {"os.system": "id"},
        {1: True},
    ],
)
def test_malformed_flags_are_protocol_errors_and_change_nothing(body: Any) -> None:
    executor = make()
    before = flags.current()
    with pytest.raises(ProtocolError):
        run(executor, [[Rec.FLAGS, body]])
    assert flags.current() == before


def test_streams_and_events_answer_in_stream_order_on_a_cpu_worker() -> None:
    executor = make()
    run(executor, [
        [Rec.STREAM, "use", 5, -1],
        [Rec.EVENT, "record", 11, 5, True],
        empty(1, 4),
        [Rec.STREAM, "tensor", 5, handle_ext(1)],
        [Rec.EVENT, "record", 12, 5, True],
        [Rec.EVENT, "wait", 12, 0, False],
        [Rec.STREAM, "use", 0, 0],
        [Rec.STREAM, "free", 5, None],
    ])  # fmt: skip
    head = ask(executor, "elapsed", 11, 12)
    assert head[0] == Kind.RESULT and head[2] >= 0.0
    assert ask(executor, "event_query", 11)[2] is True
    assert ask(executor, "stream_sync", 5)[0] == Kind.RESULT
    never = ask(executor, "event_query", 99)
    assert never[0] == Kind.ERROR and "never recorded" in never[2]["message"]
    run(executor, [[Rec.EVENT, "record", 13, 0, False]])
    untimed = ask(executor, "elapsed", 11, 13)
    assert untimed[0] == Kind.ERROR and "enable_timing" in untimed[2]["message"]
    run(executor, [[Rec.EVENT, "free", 11, 0, False]])
    assert ask(executor, "elapsed", 11, 12)[0] == Kind.ERROR
    assert executor.error is None, "a question the state cannot answer is no sticky error"


@pytest.mark.parametrize(
    "record",
    [
        [Rec.STREAM, "use", -1, 0],
        [Rec.STREAM, "use", (1 << 64) - 1, 0],
        [Rec.STREAM, "use", "1", 0],
        [Rec.STREAM, "use", 1, 5],
        [Rec.STREAM, "use", 1, -(1 << 40)],
        [Rec.STREAM, "jump", 1, 0],
        [Rec.STREAM, "tensor", 1, 3],
        [Rec.EVENT, "record", 1, 0, "yes"],
        [Rec.EVENT, "record", None, 0, True],
        [Rec.EVENT, "explode", 1, 0, True],
        [Rec.QUERY, 9, "elapsed", "a", 2],
        [Rec.QUERY, 9, "shell", None, None],
        [Rec.STREAM, "use"],
    ],
)
def test_hostile_stream_records_are_protocol_errors(record: list[Any]) -> None:
    with pytest.raises(ProtocolError):
        run(make(), [record])


def test_a_client_cannot_make_streams_without_end() -> None:
    executor = make()
    with pytest.raises(ProtocolError, match="at most"):
        run(executor, [[Rec.STREAM, "use", i, 0] for i in range(1, MAX_STREAMS + 2)])


def test_reset_peak_restarts_the_peak_from_what_is_held() -> None:
    executor = make(limit_mib=64)
    run(executor, [empty(1, 1 << 20), [Rec.FREE, 1], empty(2, 16)])
    assert executor.memory.peak_bytes() >= 4 << 20
    assert ask(executor, "reset_peak")[0] == Kind.RESULT
    assert executor.memory.peak_bytes() == executor.memory.held_bytes() < 4 << 20
