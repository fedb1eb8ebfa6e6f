"""The worker's executor on its own: handles, ordering, sticky errors, the memory limit."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from gpupool.protocol.v1.dataplane import ErrorKind, Kind, Rec, SharedArena, pack_records
from gpupool.protocol.v1.tensors import DTYPE_EXT, REMOTE_DEVICE_EXT, handle_ext, tensor_from_bytes
from gpupool.worker import executor as executor_module
from gpupool.worker.executor import Executor
from gpupool.worker.memory import HostMemory

MiB = 1 << 20


class Replies:
    client_arena: SharedArena | None = None
    worker_arena: SharedArena | None = None
    pinned_region: SharedArena | None = None
    pinned = False

    def __init__(self) -> None:
        self.heads: list[list[Any]] = []
        self.tails: list[bytes] = []

    def reply(self, head: list[Any], tail: memoryview | None = None) -> None:
        self.heads.append(head)
        self.tails.append(bytes(tail) if tail is not None else b"")

    def read_put(self, handle: int, dest: memoryview, lanes: bool = False) -> None:
        raise AssertionError("no large puts here")


@pytest.fixture(autouse=True, params=["compiled", "python"])
def record_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on the compiled record loop and on the Python one it must match."""
    if request.param == "python":
        monkeypatch.setattr(executor_module, "_runloop", None)
    elif not executor_module.compiled_loop():
        pytest.skip("gpupool.worker._runloop is not built here")
    return str(request.param)


def run(executor: Executor, records: list[list[Any]]) -> Replies:
    replies = Replies()
    executor.run_frame(pack_records([Kind.BATCH], records), replies)
    return replies


def empty(handle: int, numel: int) -> list[Any]:
    return [
        Rec.OP,
        1,
        [[numel]],
        {"dtype": DTYPE_EXT[torch.float32], "device": REMOTE_DEVICE_EXT},
        [handle],
    ]


def make(limit_mib: int | None = None) -> Executor:
    executor = Executor(
        "lease-u", torch.device("cpu"), HostMemory(None if limit_mib is None else limit_mib * MiB)
    )
    run(executor, [[Rec.DEF, 1, "aten::empty.memory_format"], [Rec.DEF, 2, "aten::fill_.Scalar"],
                   [Rec.DEF, 3, "aten::add.Tensor"]])  # fmt: skip
    return executor


def read(executor: Executor, handle: int) -> Any:
    replies = run(executor, [[Rec.READ, 7, handle_ext(handle)]])
    head = replies.heads[-1]
    if head[0] == Kind.ERROR:
        return head[2]
    shape = head[3]
    return tensor_from_bytes(replies.tails[-1], torch.float32, shape).tolist()


def test_records_run_in_order_and_handles_resolve_as_they_come() -> None:
    executor = make()
    replies = run(executor, [
        empty(10, 3), [Rec.OP, 2, [handle_ext(10), 2.0], None, None],
        [Rec.OP, 3, [handle_ext(10), handle_ext(10)], None, [11]],
    ])  # fmt: skip
    assert replies.heads == []
    assert read(executor, 11) == [4.0, 4.0, 4.0]


def test_an_error_is_reported_at_the_next_read_then_cleared() -> None:
    executor = make()
    run(executor, [empty(10, 3), [Rec.OP, 3, [handle_ext(10), handle_ext(99)], None, [11]],
                   [Rec.OP, 2, [handle_ext(10), 1.0], None, None]])  # fmt: skip
    error = read(executor, 10)
    assert error["kind"] == ErrorKind.OP and "tensor 99 is not on the worker" in error["message"]
    run(executor, [[Rec.OP, 2, [handle_ext(10), 5.0], None, None]])
    assert read(executor, 10) == [5.0, 5.0, 5.0]


def test_outputs_beyond_the_memory_limit_are_refused_and_the_worker_goes_on() -> None:
    executor = make(limit_mib=1)
    run(executor, [empty(10, 1024)])
    assert executor.memory.held_bytes() == 4096
    run(executor, [empty(11, 512 * 1024)])  # 2 MiB
    error = read(executor, 10)
    assert error["kind"] == ErrorKind.OUT_OF_MEMORY and error["exc"] == "OutOfMemoryError"
    assert "lease-u" in error["message"] and "1 MiB" in error["message"]
    assert executor.memory.held_bytes() == 4096 and 11 not in executor.tensors
    run(executor, [[Rec.FREE, 10]])
    assert executor.memory.held_bytes() == 0


def test_views_share_their_storage_in_the_memory_count() -> None:
    executor = make()
    run(
        executor,
        [
            [Rec.DEF, 4, "aten::view"],
            empty(10, 1024),
            [Rec.OP, 4, [handle_ext(10), [32, 32]], None, [11]],
        ],
    )
    assert executor.memory.held_bytes() == 4096
    run(executor, [[Rec.FREE, 10]])
    assert executor.memory.held_bytes() == 4096
    run(executor, [[Rec.FREE, 11]])
    assert executor.memory.held_bytes() == 0


def test_ops_unknown_or_touching_files_are_unsupported_naming_the_op() -> None:
    executor = make()
    run(executor, [[Rec.DEF, 8, "aten::no_such_op"], [Rec.OP, 8, [], None, [20]]])
    error = read(executor, 20)
    assert error["kind"] == ErrorKind.UNSUPPORTED and "aten::no_such_op" in error["message"]
    run(executor, [[Rec.DEF, 9, "aten::from_file"], [Rec.OP, 9, ["/etc/passwd"], None, [21]]])
    error = read(executor, 21)
    assert error["kind"] == ErrorKind.UNSUPPORTED and "not allowed" in error["message"]
    run(executor, [[Rec.DEF, 10, "os::system"], [Rec.OP, 10, ["true"], None, None]])
    assert read(executor, 21)["kind"] == ErrorKind.UNSUPPORTED


def test_reset_forgets_the_previous_client() -> None:
    executor = make()
    run(executor, [empty(10, 1024)])
    executor.reset()
    assert executor.tensors == {} and executor.memory.held_bytes() == 0 and executor.ops == {}


def test_literal_host_tensors_are_passed_by_value() -> None:
    from gpupool.protocol.v1.tensors import literal_ext

    executor = make()
    run(executor, [empty(10, 2), [Rec.OP, 2, [handle_ext(10), 1.0], None, None],
                   [Rec.OP, 3, [handle_ext(10), literal_ext(torch.tensor([2.0, 3.0]))], None, [11]]])  # fmt: skip
    assert read(executor, 11) == [3.0, 4.0]
    assert isinstance(msgpack.packb(literal_ext(torch.tensor(1.0))), bytes)


def test_a_put_larger_than_its_shape_or_target_is_refused_before_allocating() -> None:
    import pytest

    from gpupool.protocol.v1.dataplane import ProtocolError

    executor = make()
    run(executor, [empty(10, 4)])
    with pytest.raises(ProtocolError, match="bytes for"):
        run(executor, [[Rec.PUT, 10, "float32", [4], None, 1 << 40, None]])
    with pytest.raises(ProtocolError, match="elements into a tensor of 4"):
        run(executor, [[Rec.PUT, 10, "float32", [1 << 30], None, 4 << 30, None]])


@pytest.mark.parametrize(
    "made",
    [
        lambda: torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.quint8),
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    ],
    ids=["quint8", "nested"],  # complex32 travels (tests/torch/test_tensor_fidelity.py)
)
def test_a_read_the_wire_cannot_carry_is_an_op_error_and_the_session_goes_on(made: Any) -> None:
    """An op output the wire has no form for (what `quantize_per_tensor` or the nested
    constructors make) fails its READ as an ordinary error; it closed the connection."""
    executor = make()
    run(executor, [empty(10, 3), [Rec.OP, 2, [handle_ext(10), 2.0], None, None]])
    executor.tensors[11] = made()
    error = read(executor, 11)
    assert error["kind"] == ErrorKind.UNSUPPORTED and "gpupool cannot" in error["message"]
    assert read(executor, 10) == [2.0, 2.0, 2.0]
