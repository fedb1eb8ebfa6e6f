"""Ops that reached outside their tensors, sent as raw data-plane frames to a real worker.

Each attack was seen working before the op policy (issue 20): `segment_reduce(unsafe=True)`
read the worker's memory (the agent's token came out of its environment), an `add_` into a
sparse tensor with out-of-range indices wrote 21 kB away, `_print` filled the worker's unread
stdout until it hung, and `_reshape_alias` / `_segment_reduce_backward` reached past their
storage. Now each must be refused with an error that says why, the worker must stay up and
answer, the lease's other tensors must be as they were, and the secret planted in the worker's
environment must never come back.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from gpupool.protocol.v1.dataplane import (
    PROGRAM_VERSION,
    ErrorKind,
    Ext,
    Kind,
    Rec,
    pack,
)
from tests.worker.raw_frames import (
    Raw,
    Worker,
    authenticate,
    ext,
    literal,
    longs,
    refused,
    slot,
    start_worker,
    tensor,
)

pytestmark = pytest.mark.slow

TOKEN = "op-attack-lease-token"
SECRET = "planted-secret-7f3a9c0e1d2b4a68"
INTACT = list(range(16))
"""Handle 1 of every session: arange(16), which no attack may change."""


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker as an agent starts it, a secret in its environment and its stdout a pipe that
    nobody reads (as the agent's is, after the ready line)."""
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    worker = start_worker("lease-attack", TOKEN, log, env={"GPUPOOL_PLANTED_SECRET": SECRET})
    yield worker
    worker.stop()


@pytest.fixture
def raw(worker: Worker) -> Iterator[Raw]:
    client = Raw(authenticate(worker))
    client.run("aten::arange.start_step", [0, 16, 1], {"dtype": ext(Ext.DTYPE, "float32")}, [1])
    assert client.sync()[0] == Kind.RESULT
    yield client
    try:
        assert_unharmed(worker, client)
    finally:
        client.close()


def assert_unharmed(worker: Worker, client: Raw) -> None:
    assert worker.proc.poll() is None, "the worker died"
    assert client.read_floats(1) == INTACT, "another tensor of the lease changed"
    assert SECRET.encode() not in client.received, "the worker's environment leaked"
    assert not worker.errors_logged(), worker.errors_logged()[-3000:]


def test_segment_reduce_unsafe_cannot_read_past_its_data(raw: Raw) -> None:
    """With unsafe=True the lengths went unchecked: a segment 2**40 elements long read the
    worker's heap. The worker runs the checked path, which refuses the lengths."""
    raw.run("aten::segment_reduce", [tensor(1), "sum"],
            {"lengths": longs([1 << 40, 1]), "unsafe": True}, [2])  # fmt: skip
    refused(raw, "aten::segment_reduce")


def test_segment_reduce_unsafe_with_valid_lengths_still_runs(raw: Raw) -> None:
    """Forcing the checked path changes nothing for valid input: same sums."""
    raw.run("aten::segment_reduce", [tensor(1), "sum"],
            {"lengths": longs([4, 12]), "unsafe": True}, [2])  # fmt: skip
    assert raw.read_floats(2) == [6.0, sum(range(4, 16))]


def sparse_program(raw: Raw, program_id: int, steps: list[list[Any]], slots: int) -> None:
    """Sparse tensors live in a captured program's slots (the handle table holds dense ones):
    slot 0 is the program's input, a dense float32 [4] that the steps add into."""
    program = {
        "v": PROGRAM_VERSION, "inputs": [["float32", [4], [1]]], "slots": slots,
        "externals": [], "steps": steps, "outputs": [slots - 1], "escapes": [], "graph": False,
    }  # fmt: skip
    raw.send([[Rec.PROGRAM, program_id, pack(program)]])


def sparse_coo(raw: Raw, index: int, value: float, out: int) -> list[Any]:
    dims = raw.op("aten::_sparse_coo_tensor_with_dims_and_tensors")
    kwargs = {"dtype": ext(Ext.DTYPE, "float32"), "layout": ext(Ext.LAYOUT, "sparse_coo")}
    values = literal("float32", [1], "<f", [value])
    return ["op", dims, [1, 0, [4], longs([index], [1, 1]), values], kwargs, [out]]


def test_sparse_tensor_with_out_of_range_indices_is_refused_before_any_write(raw: Raw) -> None:
    """`_sparse_coo_tensor_with_dims_and_tensors` never checks its indices: index 5000 of a
    4-element tensor, then `add_` into a dense tensor, wrote 20 kB past it."""
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float32")}, [3])
    add = raw.op("aten::add_.Tensor")
    sparse_program(
        raw, 1, [sparse_coo(raw, 5000, 1.0, 1), ["op", add, [slot(0), slot(1)], None, [2]]], 3
    )
    raw.send([[Rec.RUN, 1, [tensor(3)], [8]]])
    refused(raw, "_sparse_coo_tensor_with_dims_and_tensors refused", "invalid sparse tensor")
    assert raw.read_floats(3) == [0.0] * 4


def test_sparse_tensor_with_valid_indices_still_adds(raw: Raw) -> None:
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float32")}, [3])
    add = raw.op("aten::add_.Tensor")
    sparse_program(
        raw, 2, [sparse_coo(raw, 2, 5.0, 1), ["op", add, [slot(0), slot(1)], None, [2]]], 3
    )
    raw.send([[Rec.RUN, 2, [tensor(3)], [8]]])
    assert raw.read_floats(8) == [0.0, 0.0, 5.0, 0.0]


def test_writing_into_a_sparse_tensors_indices_cannot_move_them(raw: Raw) -> None:
    """`_indices()` aliased the sparse tensor's own indices: an in-place add moved them out of
    range before the next op used them. The worker hands out a copy."""
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float32")}, [3])
    add, add_scalar = raw.op("aten::add_.Tensor"), raw.op("aten::add_.Scalar")
    indices = raw.op("aten::_indices")
    steps = [
        sparse_coo(raw, 1, 2.0, 1),
        ["op", indices, [slot(1)], None, [2]],
        ["op", add_scalar, [slot(2), 1 << 20], None, [3]],
        ["op", add, [slot(0), slot(1)], None, [4]],
    ]
    sparse_program(raw, 3, steps, 5)
    raw.send([[Rec.RUN, 3, [tensor(3)], [8]]])
    assert raw.read_floats(8) == [0.0, 2.0, 0.0, 0.0]


def test_print_is_refused_and_the_worker_keeps_answering(raw: Raw) -> None:
    """`_print` wrote to a stdout nobody reads: 200 prints of 64 KiB filled the pipe and the
    worker hung. Refused at once: every later sync is answered."""
    for _ in range(200):
        raw.run("aten::_print", ["x" * 65536])
    message = refused(raw, "aten::_print is not allowed", "stdout")
    assert "x" * 100 not in message
    assert raw.sync()[0] == Kind.RESULT


def test_as_strided_past_its_storage_is_refused(raw: Raw) -> None:
    raw.run("aten::as_strided", [tensor(1), [1 << 20], [1], 0], {}, [2])
    refused(raw, "as_strided refused", "storage of 64 bytes")
    raw.run("aten::as_strided", [tensor(1), [4], [1], 1 << 40], {}, [2])
    refused(raw, "as_strided refused", "storage of 64 bytes")
    raw.run("aten::as_strided_", [tensor(1), [4], [-1], 8], {}, [1])
    refused(raw, "as_strided_ refused", "negative")


def test_set_past_its_source_storage_is_refused(raw: Raw) -> None:
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float32")}, [3])
    raw.run("aten::set_.source_Tensor_storage_offset", [tensor(3), tensor(1), 1 << 30, [4], [1]],
            {}, [3])  # fmt: skip
    refused(raw, "out of bounds")


def test_reshape_alias_past_its_storage_is_refused(raw: Raw) -> None:
    """`_reshape_alias` takes sizes and strides as given and checks nothing (torch 2.11 and
    2.13): a 1 MiB view of a 64-byte tensor read whatever followed it."""
    raw.run("aten::_reshape_alias", [tensor(1), [1 << 18], [1]], {}, [2])
    message = refused(raw, "_reshape_alias refused", "storage of 64 bytes")
    raw.run("aten::_reshape_alias", [tensor(1), [4], [4]], {}, [2])
    assert raw.read_floats(2) == [0.0, 4.0, 8.0, 12.0], message


def test_segment_reduce_backward_with_forged_lengths_is_refused(raw: Raw) -> None:
    """The backward trusted lengths it did not make: two segments of 1000 over 16 elements
    corrupted the worker's heap (it aborted)."""
    raw.run("aten::ones", [[2]], {"dtype": ext(Ext.DTYPE, "float32")}, [6])
    raw.run("aten::_segment_reduce_backward", [tensor(6), tensor(6), tensor(1), "sum"],
            {"lengths": longs([1000, 1000])}, [7])  # fmt: skip
    refused(raw, "_segment_reduce_backward")


def test_sparse_index_conversion_that_crashed_the_worker_is_refused(raw: Raw) -> None:
    """`_convert_indices_from_csr_to_coo` with a row pointer past its columns segfaulted."""
    raw.run("aten::_convert_indices_from_csr_to_coo", [longs([0, 100_000]), longs([0])], {}, [2])
    refused(raw, "is not allowed on a gpupool worker", "crashed the worker")


def test_an_op_of_another_namespace_or_a_scripting_op_is_refused(raw: Raw) -> None:
    raw.run("aten::Int.str", ["12"], {}, [None])
    refused(raw, "TorchScript interpreter op")
    raw.run("prim::device", [tensor(1)], {}, [None])
    refused(raw, "not allowed")


# ---- what the op fuzzer crashed workers with (bench/worker_fuzz.py), one test per cause -------


def float32() -> msgpack.ExtType:
    return ext(Ext.DTYPE, "float32")


def test_a_bare_int_where_a_dtype_goes_is_refused(raw: Raw) -> None:
    """PyTorch's binding casts an int given for a ScalarType unchecked: dtype -1 segfaulted
    `new_full`, `_to_copy`, `randn`, `log_softmax` (positional) and a dozen more."""
    raw.run("aten::new_full", [tensor(1), [4], 2.0], {"dtype": -1}, [2])
    refused(raw, "aten::new_full refused", "dtype must be a torch.dtype, not int")
    raw.run("aten::_to_copy", [tensor(1)], {"dtype": -1}, [2])
    refused(raw, "aten::_to_copy refused", "dtype")
    raw.run("aten::log_softmax.int", [tensor(1), 0, -1], {}, [2])
    refused(raw, "aten::log_softmax.int refused", "dtype")
    raw.run("aten::empty.memory_format", [[4]], {"memory_format": 99}, [2])
    refused(raw, "memory_format must be a torch.memory_format")
    raw.run("aten::new_full", [tensor(1), [2], 2.0], {"dtype": float32()}, [2])
    assert raw.read_floats(2) == [2.0, 2.0]


def test_fft_dims_out_of_range_or_repeated_are_refused(raw: Raw) -> None:
    """`_fft_r2c` (what `torch.fft.rfft` runs) took dim -2 of a 1-d tensor as an index before
    its sizes and [0, 0] freed its plan twice: both crashed the worker."""
    raw.run("aten::_fft_r2c", [tensor(1), [-2], 0, True], {}, [2])
    refused(raw, "aten::_fft_r2c refused", "out of range")
    raw.run("aten::_fft_r2c", [tensor(1), [0, 0], 0, False], {}, [2])
    refused(raw, "aten::_fft_r2c refused", "twice")
    raw.run("aten::_fft_r2c", [tensor(1), [-1], 0, True], {}, [2])  # wrapped, as rfft does
    raw.run("aten::_fft_c2r", [tensor(2), [0], 2, 16], {}, [3])
    assert [round(v, 4) for v in raw.read_floats(3)] == INTACT


def test_a_count_of_batch_dims_past_the_tensors_dims_is_refused(raw: Raw) -> None:
    """`_new_zeros_with_same_feature_meta` copied 255 sizes of a 1-d tensor (a crash)."""
    raw.run("aten::_new_zeros_with_same_feature_meta", [tensor(1), tensor(1)],
            {"self_num_batch_dims": 255}, [2])  # fmt: skip
    refused(raw, "_new_zeros_with_same_feature_meta refused", "outside [0, 1]")


def test_sizes_a_kernel_takes_from_its_public_op_unchecked_are_refused(raw: Raw) -> None:
    """Each crashed a worker: `_pad_packed_sequence` with batch sizes that grow wrote before a
    buffer, `repeat_interleave` wrote int32 repeats summing to 6 (by wrapping) into 6 slots,
    `_chunk_cat` read the size of a 0-d tensor's dimension -1."""
    raw.run("aten::_pad_packed_sequence", [tensor(1), longs([2, 14]), True, 0.0, 4], {}, [2, 3])
    refused(raw, "_pad_packed_sequence refused", "must not grow")
    wrapped = literal("int32", [3], "<3i", [2**31 - 1, -(2**31), 7])
    raw.run("aten::repeat_interleave.Tensor", [wrapped], {"output_size": 6}, [2])
    refused(raw, "repeat_interleave.Tensor refused", "negative")
    raw.run("aten::select.int", [tensor(1), 0, 0], {}, [4])
    raw.run("aten::_chunk_cat", [[tensor(4)], -1, 1 << 31], {}, [2])
    refused(raw, "_chunk_cat refused", "0 dimensions")
    raw.run("aten::repeat_interleave.Tensor", [longs([1, 2])], {"output_size": 3}, [2])
    raw.run("aten::_to_copy", [tensor(2)], {"dtype": float32()}, [3])
    assert raw.read_floats(3) == [0.0, 1.0, 1.0]


def test_a_view_whose_reach_overflows_int64_is_refused(raw: Raw) -> None:
    """`as_strided_` with a stride of 2**63 - 1 passed torch's bounds check (the product
    overflowed) and a READ of the view crashed the worker."""
    raw.run("aten::as_strided_", [tensor(1), [5], [(1 << 63) - 1], None], {}, [2])
    refused(raw, "aten::as_strided_ refused", "storage of 64 bytes")
    raw.run("aten::as_strided", [tensor(1), [2], [4], 1], {}, [2])
    assert raw.read_floats(2) == [1.0, 5.0]


def test_round_to_decimals_no_float_has_is_refused(raw: Raw) -> None:
    """`round.decimals_out` with decimals -2**62: the Python reference that charges it
    computed 10**(2**62) exactly, and the worker never answered again."""
    raw.run("aten::round.decimals_out", [tensor(1)], {"decimals": -(1 << 62), "out": tensor(1)},
            [2])  # fmt: skip
    refused(raw, "aten::round.decimals_out refused", "decimals")
    raw.run("aten::round.decimals", [tensor(1)], {"decimals": 2}, [2])
    assert raw.read_floats(2) == INTACT


def test_integer_overflow_in_a_truncating_division_is_refused(raw: Raw) -> None:
    """int32 -2**31 // -1 with rounding_mode="trunc": the divide instruction raised SIGFPE."""
    smallest = literal("int32", [2], "<2i", [-(2**31), 7])
    raw.run("aten::div.Scalar_mode", [smallest, -1], {"rounding_mode": "trunc"}, [2])
    refused(raw, "div.Scalar_mode refused", "overflows")


def test_unfold_backward_of_a_forged_gradient_is_refused(raw: Raw) -> None:
    """`unfold_backward` read a gradient of the wrong shape past its end: heap addresses came
    back in the reply."""
    raw.run("aten::unfold_backward", [tensor(1), [64], 0, 8, 1], {}, [2])
    refused(raw, "unfold_backward refused", "grad_in has shape")


def test_weight_norm_of_an_empty_weight_is_refused(raw: Raw) -> None:
    """`_weight_norm_interface` divided by v.size(dim): an empty v raised SIGFPE."""
    raw.run("aten::zeros", [[0, 4]], {"dtype": float32()}, [2])
    raw.run("aten::zeros", [[0, 1]], {"dtype": float32()}, [3])
    raw.run("aten::_weight_norm_interface", [tensor(2), tensor(3), 0], {}, [4, 5])
    refused(raw, "aten::_weight_norm_interface refused", "no slices")
    raw.run("aten::_weight_norm_interface", [tensor(1), longs([1])], {}, [4, 5])
    refused(raw, "aten::_weight_norm_interface refused")
    raw.run("aten::_weight_norm", [tensor(2), tensor(3), 0], {}, [4])  # the composite calls it
    refused(raw, "aten::_weight_norm refused", "no slices")


def test_stack_internals_are_refused_and_stack_runs(raw: Raw) -> None:
    """`_stack` trusts that its inputs already have stack's size-1 dimension: a transposed
    4x4 input at dim 1 corrupted the worker's heap (it aborted in free)."""
    raw.run("aten::view", [tensor(1), [4, 4]], {}, [2])
    raw.run("aten::t", [tensor(2)], {}, [3])
    raw.run("aten::_stack", [[tensor(3)], 1], {}, [4])
    refused(raw, "aten::_stack is not allowed", "stack runs")
    raw.run("aten::stack", [[tensor(3)], 1], {}, [4])
    assert raw.read_floats(4) == [float(4 * j + i) for i in range(4) for j in range(4)]


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("aten::_nnpack_spatial_convolution", [tensor(1), tensor(1), None, [4096], [5, 6]]),
        ("aten::_remove_batch_dim", [tensor(1), 1 << 24, -1, 256]),
        ("aten::_add_batch_dim", [tensor(1), 0, 1 << 24]),
        ("aten::_compute_linear_combination", [tensor(1), longs([1] * 64, [2, 32])]),
        ("aten::_sobol_engine_ff_", [longs([0, 0, 0]), 5, longs([0] * 6, [2, 3]), 1 << 20, -2]),
    ],
)
def test_internal_kernels_that_trust_their_caller_are_refused(
    raw: Raw, name: str, args: list[Any]
) -> None:
    """Kernels that only their public op calls, with arguments it prepared: a forged padding
    (`_nnpack_spatial_convolution`) or batch level (`_remove_batch_dim`) crashed the worker;
    `_compute_linear_combination` (matrix_exp's) read its input past its storage with the
    coefficients' dtype and sizes, and a reply held an address of the worker's heap;
    `_sobol_engine_ff_` walked its state and output for a `dimension` it never compared with
    them (the heap it wrote past aborted the worker later)."""
    raw.run(name, args, {}, [2])
    refused(raw, f"{name} is not allowed on a gpupool worker")


def test_onednn_lstm_layers_with_forged_shapes_are_refused(raw: Raw) -> None:
    """`mkldnn_rnn_layer` views its tensors' data pointers with the layer its other arguments
    describe: these forged layers crashed the worker when it ran the kernel bare. It runs
    behind a check now (tests/worker/test_opchecks.py has the genuine calls)."""
    forged = [tensor(1)] * 7 + [False, [3, 6, 1 << 20], 3, 2, 63] + [True] * 4
    raw.run("aten::mkldnn_rnn_layer", forged, {}, [2, 3, 4, 5])
    refused(raw, "aten::mkldnn_rnn_layer refused", "mode 3 is not LSTM")
    raw.run("aten::mkldnn_rnn_layer", [*forged[:8], [], 2, 1 << 20, 1] + [True] * 4, {},
            [2, 3, 4, 5])  # fmt: skip
    refused(raw, "aten::mkldnn_rnn_layer refused", "input must be")
    raw.run("aten::mkldnn_rnn_layer.out", forged, {}, [2])
    refused(raw, "is not allowed on a gpupool worker")


def test_a_call_returning_a_nested_tensor_fails_cleanly_and_the_stream_goes_on(raw: Raw) -> None:
    """A CALL's outputs are described to the client: a nested tensor has no sizes to describe,
    and the exception ended the whole stream with a PROTOCOL error. Now the op fails alone."""
    raw.req += 1
    nested = raw.op("aten::_nested_tensor_from_tensor_list")
    head, _ = raw.answer([Rec.CALL, raw.req, nested, [[tensor(1), tensor(1)]], {}, 100])
    assert head[0] == Kind.ERROR and head[2]["kind"] == ErrorKind.UNSUPPORTED, head
    assert "nested tensor" in head[2]["message"], head
    assert raw.sync()[0] == Kind.RESULT


def test_a_qparams_search_the_arguments_make_endless_is_refused(raw: Raw) -> None:
    """`choose_qparams_optimized` with n_bins 2**24 and ratio 1e308 searched bins for good
    (the fuzzer's hang, seed 10): bins and ratio are bounded, and it answers at once."""
    raw.run("aten::choose_qparams_optimized", [tensor(1), 7, 1 << 24, 1e308, 2], {}, [2, 3])
    refused(raw, "choose_qparams_optimized refused", "n_bins")
    raw.run("aten::choose_qparams_optimized", [tensor(1), 1 << 20, 200, 0.16, 8], {}, [2, 3])
    refused(raw, "choose_qparams_optimized refused", "numel")
    raw.run("aten::choose_qparams_optimized", [tensor(1), 16, 200, 0.16, 8], {}, [2, 3])
    assert len(raw.read_floats(2)) == 1 and raw.sync()[0] == Kind.RESULT


def test_a_functional_copy_of_none_is_refused(raw: Raw) -> None:
    """`copy(None, src)` and `copy.out(None, src, out=...)` cloned an undefined tensor: a null
    read crashed the worker (the fuzzer's seed-12 crashes). A real copy still runs."""
    raw.run("aten::copy", [None, tensor(1), True], {}, [2])
    refused(raw, "aten::copy refused", "self must be a tensor")
    raw.run("aten::zeros", [[16]], {"dtype": float32()}, [3])
    raw.run("aten::copy.out", [None, tensor(1), True], {"out": tensor(3)}, [3])
    refused(raw, "aten::copy.out refused", "self must be a tensor")
    raw.run("aten::copy", [tensor(3), tensor(1), False], {}, [2])
    assert raw.read_floats(2) == INTACT


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker with a memory limit: it charges every op before it runs, from the op's meta
    kernel (`gpupool.worker.admission`)."""
    log = tmp_path_factory.mktemp("logs") / "limited.log"
    worker = start_worker("lease-attack", TOKEN, log, memory_limit_mib=64)
    yield worker
    worker.stop()


@pytest.fixture
def limited_raw(limited: Worker) -> Iterator[Raw]:
    client = Raw(authenticate(limited))
    client.run("aten::arange.start_step", [0, 16, 1], {"dtype": float32()}, [1])
    yield client
    try:
        assert_unharmed(limited, client)
    finally:
        client.close()


def test_an_ops_check_runs_before_the_meta_kernel_that_charges_it(limited_raw: Raw) -> None:
    """`_foreach_copy.out` with lists of one, two and three tensors segfaulted in its meta
    kernel, which the admission ran before the op's own check (lists of one length) could
    refuse it. The check comes first now; the valid call is charged and runs."""
    raw = limited_raw
    call = raw.op("aten::_foreach_copy.out")
    lists = [[tensor(1)], [tensor(1), tensor(1)]]
    raw.send([[Rec.CALL, 99, call, [*lists, True], {"out": [tensor(1)] * 3}, 100]])
    head = raw.conn.recv().head()
    assert head[0] == Kind.ERROR and "_foreach_copy.out refused" in head[2]["message"], head
    raw.run("aten::zeros", [[16]], {"dtype": float32()}, [2])
    raw.send([[Rec.CALL, 98, call, [[tensor(1)], [tensor(1)], True], {"out": [tensor(2)]}, 100]])
    assert raw.conn.recv().head()[:2] == [Kind.RESULT, 98]
    assert raw.read_floats(2) == INTACT
    raw.run("aten::new_full", [tensor(1), [4], 2.0], {"dtype": -1}, [3])  # the meta kernel too
    refused(raw, "dtype must be a torch.dtype")


def test_an_out_tensor_a_failed_op_left_half_resized_gets_its_geometry_back(raw: Raw) -> None:
    """`randn.out` with sizes [2, 3, 2**63 - 1] set them on `out` before their product
    overflowed: the tensor claimed 2**64 elements over 32 bytes, and `count_nonzero` of such a
    tensor crashed the worker. The failed op's written tensors get their geometry back."""
    raw.run("aten::zeros", [[4]], {"dtype": ext(Ext.DTYPE, "float64")}, [2])
    raw.run("aten::randn.out", [[2, 3, (1 << 63) - 1]], {"out": tensor(2)}, [2])
    refused(raw, "overflow")
    raw.send([[Rec.CALL, 97, raw.op("aten::count_nonzero"), [tensor(2)], {}, 100]])
    head = raw.conn.recv().head()
    assert head[:2] == [Kind.RESULT, 97] and head[2][3] == [], head
    raw.req += 1
    assert raw.answer([Rec.READ, raw.req, tensor(100)])[1] == (0).to_bytes(8, "little")
    raw.req += 1
    head, data = raw.answer([Rec.READ, raw.req, tensor(2)])
    assert head[0] == Kind.DATA and list(head[3]) == [4] and data == bytes(32), head


def test_a_negative_size_next_to_a_zero_is_refused(raw: Raw) -> None:
    """`rand.generator_out` with sizes [-2, 0, 6, 2**62, 3] into a view: ATen took the negative
    size (the product has a 0) and left the view with sizes whose strides it never computed;
    the worker crashed on the next look at them. No list of sizes holds a negative size now;
    -1 only where it infers one (view, reshape) or keeps one (expand)."""
    raw.run("aten::slice.Tensor", [tensor(1), 0, 2, 10], {}, [2])
    raw.run("aten::rand.generator_out", [[-2, 0, 6, 1 << 62, 3]], {"generator": None,
            "out": tensor(2)}, [3])  # fmt: skip
    refused(raw, "rand.generator_out refused", "size holds -2")
    assert raw.read_floats(2) == INTACT[2:10]
    raw.run("aten::new_zeros", [tensor(1), [-1, 0]], {}, [3])
    refused(raw, "new_zeros refused", "a size is not negative")
    raw.run("aten::view", [tensor(1), [-1, 4]], {}, [3])
    raw.run("aten::expand", [tensor(3), [2, -1, -1]], {}, [4])
    assert raw.read_floats(4) == INTACT * 2


def test_batch_norm_without_the_statistics_its_mode_reads_is_refused(raw: Raw) -> None:
    """Three crashes: `_native_batch_norm_legit.no_stats` in eval mode read running statistics
    it was not given, `_batch_norm_impl_index_backward` of an empty 1-d input wrote into an
    empty list of sizes, `native_batch_norm_backward` of an empty batch divided by 0."""
    torch = pytest.importorskip("torch")
    raw.run("aten::view", [tensor(1), [4, 4]], {}, [2])
    raw.run("aten::_native_batch_norm_legit.no_stats", [tensor(2), None, None, False, 2.0, -1.0],
            {}, [3, 4, 5])  # fmt: skip
    refused(raw, "_native_batch_norm_legit.no_stats refused", "running_mean is needed")
    raw.run("aten::zeros", [[0]], {"dtype": float32()}, [6])
    raw.run("aten::_batch_norm_impl_index_backward",
            [4096, tensor(6), tensor(6), longs([0, 1, 2, 3]), None, None, tensor(2), tensor(2),
             False, 3.0, [False, True, False], longs([0, 1, 2])], {}, [7, 8, 9])  # fmt: skip
    refused(raw, "_batch_norm_impl_index_backward refused", "1 dimensions")
    raw.run("aten::zeros", [[0, 4]], {"dtype": float32()}, [6])
    raw.run("aten::native_batch_norm_backward",
            [tensor(6), tensor(6), None, None, None, tensor(1), tensor(1), True, 1e-5,
             [True, True, True]], {}, [7, 8, 9])  # fmt: skip
    refused(raw, "native_batch_norm_backward refused")
    raw.run("aten::_native_batch_norm_legit.no_stats", [tensor(2), None, None, True, 0.1, 1e-5],
            {}, [3, 4, 5])  # fmt: skip
    expected = torch.nn.functional.batch_norm(
        torch.arange(16.0).view(4, 4), None, None, training=True
    )
    assert raw.read_floats(3) == pytest.approx(expected.flatten().tolist(), abs=1e-5)


def test_cummax_helper_of_an_unwrapped_dim_runs_wrapped(raw: Raw) -> None:
    """`_cummax_helper` (cummax's kernel) took dim -1 of a [4, 4] input unwrapped and corrupted
    the worker's heap: it aborted when the session's tensors were freed. The dim is wrapped as
    cummax wraps it; an empty input, which cummax never hands it, is refused."""
    raw.run("aten::view", [tensor(1), [4, 4]], {}, [2])
    raw.run("aten::zeros", [[4, 4]], {"dtype": float32()}, [3])
    raw.run("aten::zeros", [[4, 4]], {"dtype": ext(Ext.DTYPE, "int64")}, [4])
    raw.run("aten::_cummax_helper", [tensor(2), tensor(3), tensor(4), -1], {}, [])
    assert raw.read_floats(3) == INTACT  # increasing rows: each running max is the value
    raw.req += 1
    head, data = raw.answer([Rec.READ, raw.req, tensor(4)])
    assert struct.unpack("<16q", data) == tuple(list(range(4)) * 4), head
    raw.run("aten::zeros", [[2, 0]], {"dtype": float32()}, [5])
    raw.run("aten::_cummax_helper", [tensor(5), tensor(5), tensor(4), 0], {}, [])
    refused(raw, "_cummax_helper refused")


def test_matrix_power_of_an_exponent_int64_cannot_negate_is_refused(raw: Raw) -> None:
    """`linalg_matrix_power(x, -2**63)` negated the exponent into itself and its loop never
    ended: the worker answered nothing again (the fuzzer's hang). Refused; other exponents,
    however large, cost at most 63 squarings."""
    raw.run("aten::eye", [4], {"dtype": float32()}, [2])
    raw.run("aten::linalg_matrix_power", [tensor(2), -(1 << 63)], {}, [3])
    refused(raw, "linalg_matrix_power refused", "no negation")
    raw.run("aten::linalg_matrix_power", [tensor(2), -(1 << 63) + 1], {}, [3])
    assert raw.read_floats(3) == [1.0 if i % 5 == 0 else 0.0 for i in range(16)]


def test_the_ops_real_programs_run_through_these_checks_still_match_local(limited: Worker) -> None:
    """The client keeps working where the checks sit: `torch.fft`, `weight_norm` (forward and
    backward), `stack` of a transposed tensor, factories and casts with a dtype, `out=` ops, on
    a worker that charges every op first."""
    torch = pytest.importorskip("torch")
    import gpupool.torch

    def program(device: str) -> dict[str, Any]:
        torch.manual_seed(0)  # the Linear's initial weights, made on the host
        x = torch.randn(6, 8).to(device)
        layer = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(8, 4)).to(device)
        out = layer(x)
        out.sum().backward()
        spectrum = torch.fft.rfft(x, dim=-1)
        grid = torch.fft.fftn(x.to(torch.complex64), dim=(0, 1))
        buf = torch.empty(0, device=device)
        torch.add(x, 1, out=buf)
        return {
            "weight_norm": out, "grad": layer.parametrizations.weight.original1.grad,
            "rfft": torch.view_as_real(spectrum), "irfft": torch.fft.irfft(spectrum, n=8),
            "fftn": torch.view_as_real(grid), "stack": torch.stack([x.t(), x.t()], dim=1),
            "log_softmax": torch.log_softmax(x, -1, dtype=torch.float64),
            "ones": torch.ones(3, dtype=torch.int32, device=device), "out": buf,
        }  # fmt: skip

    local = program("cpu")
    gpupool.torch.attach(workers=[limited.address], token=limited.token, lease=limited.lease)
    try:
        remote = {k: v.cpu() for k, v in program("cuda").items()}
    finally:
        gpupool.torch.detach()
    for key, expected in local.items():
        torch.testing.assert_close(remote[key], expected, msg=lambda m, k=key: f"{k}: {m}")
