"""Each argument check: the genuine call (saved tensors from the real forward) runs as before,
the forged one (what a hostile client sends instead) is refused before the kernel runs.

Most forged calls here were seen to read or write outside their tensors without the check
(`_embedding_bag_dense_backward` segfaulted, `_cummax_helper` and `_segment_reduce_backward`
corrupted the heap); they run only behind the check, in this process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpupool.protocol.v1.tensors import op_overload
from gpupool.worker.geometry import keeping_geometry, sound
from gpupool.worker.opchecks import CHECKS, OpRefused, argument_guard, guard, reach_bytes
from gpupool.worker.oppolicy import Decision, ruling

aten = torch.ops.aten


def checked(name: str) -> Any:
    """The op as a worker runs it."""
    decided = ruling(name)
    assert decided.decision is Decision.CHECK, name
    fn = op_overload(name)
    return guard(name, CHECKS[decided.detail], fn, fn._op)


def refuses(name: str, *args: Any, match: str = "refused", **kwargs: Any) -> None:
    with pytest.raises(OpRefused, match=match):
        checked(name)(*args, **kwargs)


def test_reach_bytes_counts_the_last_element_a_view_reads() -> None:
    assert reach_bytes([4], [1], 0, 4) == 16
    assert reach_bytes([2, 3], [3, 1], 2, 4) == (2 + 3 + 2 + 1) * 4
    assert reach_bytes([0, 3], [3, 1], 100, 4) == 0


def test_reshape_alias_stays_in_its_storage() -> None:
    base = torch.arange(16.0)
    assert checked("aten::_reshape_alias")(base, [4, 4], [4, 1]).equal(base.view(4, 4))
    assert checked("aten::_reshape_alias")(base[8:], [2, 4], [4, 1]).equal(base[8:].view(2, 4))
    refuses("aten::_reshape_alias", base, [100], [1], match="storage of 64 bytes")
    refuses("aten::_reshape_alias", base[8:], [3, 4], [4, 1], match="reach byte")
    refuses("aten::_reshape_alias", base, [4], [-1], match="negative")
    refuses("aten::_reshape_alias_copy", base, [100], [1], match="storage")


def test_segment_reduce_always_runs_its_checked_path() -> None:
    data = torch.arange(6.0)
    out = checked("aten::segment_reduce")(data, "sum", lengths=torch.tensor([2, 4]), unsafe=True)
    assert out.tolist() == [1.0, 14.0]
    with pytest.raises(RuntimeError, match="sum"):
        checked("aten::segment_reduce")(data, "sum", lengths=torch.tensor([1 << 40]), unsafe=True)


def test_index_put_impl_always_checks_its_indices() -> None:
    target = torch.zeros(4)
    checked("aten::_index_put_impl_")(target, [torch.tensor([1])], torch.ones(1), True, True)
    assert target.tolist() == [0.0, 1.0, 0.0, 0.0]
    with pytest.raises(IndexError):
        checked("aten::_index_put_impl_")(target, [torch.tensor([99])], torch.ones(1), True, True)


def test_sparse_constructors_validate_their_indices() -> None:
    indices, values = torch.tensor([[1, 3]]), torch.ones(2)
    made = checked("aten::sparse_coo_tensor.indices_size")(indices, values, [4])
    assert made.to_dense().tolist() == [0.0, 1.0, 0.0, 1.0]
    refuses("aten::sparse_coo_tensor.indices_size", torch.tensor([[9]]), torch.ones(1), [4])
    refuses("aten::_sparse_coo_tensor_unsafe", torch.tensor([[-1]]), torch.ones(1), [4])
    refuses(
        "aten::_sparse_coo_tensor_with_dims_and_tensors",
        1, 0, [4], torch.tensor([[5000]]), torch.ones(1),
        dtype=torch.float32, layout=torch.sparse_coo,
    )  # fmt: skip
    crow, col = torch.tensor([0, 1]), torch.tensor([1000])
    refuses("aten::sparse_csr_tensor.crow_col_value_size", crow, col, torch.ones(1), [1, 4])
    good = checked("aten::sparse_csr_tensor.crow_col_value_size")(
        crow, torch.tensor([2]), torch.ones(1), [1, 4]
    )
    assert good.to_dense().tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_a_claimed_coalesced_flag_is_dropped() -> None:
    """is_coalesced=True on duplicate indices is a lie kernels would act on."""
    made = checked("aten::_sparse_coo_tensor_with_dims_and_tensors")(
        1, 0, [4], torch.tensor([[1, 1]]), torch.ones(2),
        dtype=torch.float32, layout=torch.sparse_coo, is_coalesced=True,
    )  # fmt: skip
    assert not made.is_coalesced()
    assert made.to_dense().tolist() == [0.0, 2.0, 0.0, 0.0]


def test_a_sparse_tensors_indices_come_out_as_a_copy() -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1), [4]).coalesce()
    indices = checked("aten::_indices")(sparse)
    indices.add_(1 << 20)
    assert sparse._indices().tolist() == [[1]]
    csr = sparse.unsqueeze(0).to_sparse_csr()
    crow = checked("aten::crow_indices")(csr)
    crow.add_(1 << 20)
    assert csr.crow_indices().tolist() == [0, 1]


def test_segment_reduce_backward_needs_the_forwards_lengths() -> None:
    data, lengths = torch.arange(6.0), torch.tensor([2, 4])
    out = aten.segment_reduce.default(data, "sum", lengths=lengths)
    grad = checked("aten::_segment_reduce_backward")(
        torch.ones_like(out), out, data, "sum", lengths=lengths
    )
    assert grad.tolist() == [1.0] * 6
    with pytest.raises(RuntimeError):
        checked("aten::_segment_reduce_backward")(
            torch.ones(2), torch.ones(2), data, "sum", lengths=torch.tensor([1000, 1000])
        )
    refuses(
        "aten::_segment_reduce_backward", torch.ones(3), torch.ones(3), data, "sum",
        lengths=lengths, match="output has shape",
    )  # fmt: skip


def test_log_softmax_backward_needs_matching_shapes() -> None:
    out = aten._log_softmax.default(torch.randn(4), 0, False)
    checked("aten::_log_softmax_backward_data")(torch.ones(4), out, 0, torch.float32)
    refuses("aten::_log_softmax_backward_data", torch.ones(4), torch.ones(2), 0, torch.float32)


def test_layer_norm_backward_needs_a_mean_per_row() -> None:
    x = torch.randn(4, 8)
    _, mean, rstd = aten.native_layer_norm.default(x, [8], None, None, 1e-5)
    mask = [True, False, False]
    checked("aten::native_layer_norm_backward")(
        torch.ones(4, 8), x, [8], mean, rstd, None, None, mask
    )
    refuses(
        "aten::native_layer_norm_backward",
        torch.ones(4, 8), x, [8], torch.zeros(1), torch.ones(1), None, None, mask,
        match="mean holds 1 elements, needs 4",
    )  # fmt: skip
    refuses(
        "aten::native_layer_norm_backward",
        torch.ones(4, 8), x, [8], torch.zeros(8)[7:].expand(4, 1), rstd, None, None, mask,
        match="mean holds 1 elements",
    )  # fmt: skip


def test_batch_norm_needs_a_statistic_per_channel() -> None:
    x = torch.randn(4, 8)
    running_mean, running_var = torch.zeros(8), torch.ones(8)
    _, save_mean, save_invstd = checked("aten::native_batch_norm")(
        x, None, None, running_mean, running_var, True, 0.1, 1e-5
    )
    checked("aten::native_batch_norm_backward")(
        torch.ones(4, 8), x, None, running_mean, running_var, save_mean, save_invstd, True, 1e-5,
        [True, True, True],
    )  # fmt: skip
    refuses(
        "aten::native_batch_norm_backward",
        torch.ones(4, 8), x, None, None, None, torch.zeros(1), torch.ones(1), True, 1e-5,
        [True, True, True], match="save_mean",
    )  # fmt: skip
    refuses(
        "aten::native_batch_norm", x, None, None, torch.zeros(2), torch.ones(2), True, 0.1, 1e-5,
        match="running_mean",
    )  # fmt: skip
    # An empty weight or bias is read once per channel too (the fuzzer crashed workers with
    # it); empty saved statistics, what eval mode saves, stay allowed in backward.
    refuses(
        "aten::native_batch_norm", x, torch.empty(0), None, running_mean, running_var, True, 0.1,
        1e-5, match="weight holds 0 elements, needs 8",
    )  # fmt: skip
    refuses(
        "aten::_batch_norm_impl_index_backward", 0, x, torch.ones(4, 8), torch.empty(0),
        running_mean, running_var, save_mean, save_invstd, True, 1e-5, [True, True, True],
        torch.empty(0), match="weight holds 0",
    )  # fmt: skip
    checked("aten::native_batch_norm_backward")(
        torch.ones(4, 8), x, torch.ones(8), running_mean, running_var, torch.empty(0),
        torch.empty(0), False, 1e-5, [True, True, True],
    )  # fmt: skip


def test_group_norm_backward_needs_its_sizes_to_describe_the_input() -> None:
    x = torch.randn(2, 4, 3)
    _, mean, rstd = aten.native_group_norm.default(x, None, None, 2, 4, 3, 2, 1e-5)
    mask = [True, False, False]
    args = (torch.ones(2, 4, 3), x, mean, rstd, None)
    checked("aten::native_group_norm_backward")(*args, 2, 4, 3, 2, mask)
    refuses("aten::native_group_norm_backward", *args, 2000, 4, 3, 2, mask, match="N=2000")
    refuses(
        "aten::native_group_norm_backward",
        torch.ones(2, 4, 3), x, torch.zeros(1), torch.ones(1), None, 2, 4, 3, 2, mask,
        match="mean",
    )  # fmt: skip


def test_embedding_backward_keeps_indices_below_num_weights() -> None:
    grad, indices = torch.ones(2, 3), torch.tensor([0, 3])
    out = checked("aten::embedding_dense_backward")(grad, indices, 4, -1, False)
    assert out.shape == (4, 3)
    refuses(
        "aten::embedding_dense_backward", grad, torch.tensor([0, 100_000]), 4, -1, False,
        match="outside",
    )  # fmt: skip
    refuses("aten::embedding_dense_backward", torch.ones(5, 3), indices, 4, -1, False, match="rows")


def test_embedding_bag_and_its_backward_check_offsets_and_saved_bags() -> None:
    weight, indices, offsets = torch.randn(4, 3), torch.tensor([0, 1, 3]), torch.tensor([0, 2])
    checked("aten::_embedding_bag")(weight, indices, offsets)
    # What autograd saves from the forward: offset2bag, bag_size and maximum_indices.
    saved = torch.nn.functional.embedding_bag(indices, weight.requires_grad_(), offsets).grad_fn
    assert saved is not None
    offset2bag, bag_size = saved._saved_result1, saved._saved_result2  # type: ignore[attr-defined]
    max_indices = saved._saved_result3  # type: ignore[attr-defined]
    weight, out = weight.detach(), torch.zeros(2, 3)
    refuses("aten::_embedding_bag", weight, indices, torch.tensor([0, 100]), match="offsets")
    refuses("aten::_embedding_bag", weight, indices, torch.tensor([0, 2, 1]), match="decrease")
    refuses("aten::_embedding_bag", weight, torch.tensor([0, 9, 3]), offsets, match="indices")
    grad = torch.ones_like(out)
    genuine = checked("aten::_embedding_bag_backward")(
        grad, indices, offsets, offset2bag, bag_size, max_indices, 4, False, 0, False, None
    )
    assert genuine.shape == (4, 3)
    dense = checked("aten::_embedding_bag_dense_backward")(
        grad, indices, offset2bag, bag_size, max_indices, 4, False, 0, None
    )
    assert dense.equal(genuine)
    refuses(
        "aten::_embedding_bag_dense_backward",
        grad, torch.tensor([0, 100_000, 1]), offset2bag, bag_size, max_indices, 4, False, 0, None,
    )  # fmt: skip
    refuses(
        "aten::_embedding_bag_dense_backward",
        grad, indices, torch.tensor([0, 100_000, 1]), bag_size, max_indices, 4, False, 0, None,
        match="offset2bag",
    )  # fmt: skip
    refuses(
        "aten::_embedding_bag_per_sample_weights_backward",
        grad, weight, indices, offsets, torch.tensor([0, 100_000, 1]), 0, -1, match="offset2bag",
    )  # fmt: skip


def test_max_pool_backward_scatters_only_inside_the_input() -> None:
    x = torch.randn(1, 1, 4, 4)
    out, indices = aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    args = ([2, 2], [2, 2], [0, 0], [1, 1], False)
    grad = checked("aten::max_pool2d_with_indices_backward")(
        torch.ones_like(out), x, *args, indices
    )
    assert grad.sum() == 4
    forged = torch.full_like(indices, 100_000)
    refuses("aten::max_pool2d_with_indices_backward", torch.ones_like(out), x, *args, forged)
    refuses("aten::adaptive_max_pool2d_backward", torch.ones_like(out), x, forged)
    refuses(
        "aten::max_pool2d_with_indices_backward",
        torch.ones_like(out), x, *args, indices[..., :1], match="indices has shape",
    )  # fmt: skip
    x3 = torch.randn(1, 1, 2, 4, 4)
    out3, indices3 = aten.max_pool3d_with_indices.default(x3, [2, 2, 2], [2, 2, 2])
    args3 = ([2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False)
    checked("aten::max_pool3d_with_indices_backward")(torch.ones_like(out3), x3, *args3, indices3)
    refuses(
        "aten::max_pool3d_with_indices_backward",
        torch.ones_like(out3), x3, *args3, torch.full_like(indices3, 100_000),
    )  # fmt: skip


def test_ctc_backward_needs_the_forwards_log_alpha() -> None:
    log_probs = torch.randn(5, 1, 3).log_softmax(2)
    targets = torch.tensor([[1, 2]])
    nll, alpha = aten._ctc_loss.default(log_probs, targets, [5], [2], 0, False)
    backward = checked("aten::_ctc_loss_backward")
    assert backward(torch.ones(1), log_probs, targets, [5], [2], nll, alpha, 0).shape == (5, 1, 3)
    refuses(
        "aten::_ctc_loss_backward",
        torch.ones(1), log_probs, targets, [5], [2], nll, torch.zeros(1, 1, 1), 0,
        match="log_alpha",
    )  # fmt: skip
    with pytest.raises(RuntimeError):
        backward(torch.ones(1), log_probs, targets, [5], [1000], nll, alpha, 0)


def test_distance_and_weight_norm_backward_need_the_forwards_outputs() -> None:
    x = torch.randn(4, 3)
    pdist = aten._pdist_forward.default(x, 2.0)
    checked("aten::_pdist_backward")(torch.ones_like(pdist), x, 2.0, pdist)
    refuses("aten::_pdist_backward", torch.ones(1), x, 2.0, torch.ones(1), match="pdist")
    y = torch.randn(5, 3)
    cdist = aten._cdist_forward.default(x, y, 2.0, None)
    checked("aten::_cdist_backward")(torch.ones_like(cdist), x, y, 2.0, cdist)
    refuses("aten::_cdist_backward", torch.ones(1, 1), x, y, 2.0, torch.ones(1, 1), match="cdist")
    v, g = torch.randn(4, 3), torch.randn(4, 1)
    w, norms = aten._weight_norm_interface.default(v, g, 0)
    checked("aten::_weight_norm_interface_backward")(torch.ones_like(w), v, g, norms, 0)
    refuses(
        "aten::_weight_norm_interface_backward",
        torch.ones(4, 3), v, torch.ones(1, 1), torch.ones(1, 1), 0, match="saved_norms",
    )  # fmt: skip


def test_cumulative_helpers_write_only_outputs_of_the_inputs_shape() -> None:
    x = torch.randn(4)
    values, indices = torch.empty(4), torch.empty(4, dtype=torch.long)
    checked("aten::_cummax_helper")(x, values, indices, 0)
    assert values.equal(torch.cummax(x, 0).values)
    refuses("aten::_cummax_helper", x, torch.empty(4), torch.empty(2, dtype=torch.long), 0)
    refuses("aten::_cummin_helper", x, torch.empty(2), torch.empty(4, dtype=torch.long), 0)
    # cummax wraps dim and never calls its helper with an empty input: dim -1 of a [2, 3]
    # input corrupted the heap, an empty [2, 0] one crashed or hung the kernel.
    grid = torch.randn(2, 3)
    values, indices = torch.empty(2, 3), torch.empty(2, 3, dtype=torch.long)
    checked("aten::_cummax_helper")(grid, values, indices, -1)
    assert values.equal(torch.cummax(grid, -1).values)
    assert indices.equal(torch.cummax(grid, -1).indices)
    refuses("aten::_cummax_helper", grid, values, indices, 2, match="dim 2 out of range")
    refuses("aten::_cummin_helper", grid, values, indices, -(1 << 40), match="out of range")
    empty = torch.empty(2, 0)
    refuses("aten::_cummax_helper", empty, empty, empty.long(), 0, match="empty")


def test_matrix_power_refuses_the_exponent_it_cannot_negate() -> None:
    """-2**63 stays negative when negated: the square-and-multiply loop never ended."""
    m = torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    power = checked("aten::linalg_matrix_power")
    assert power(m, -2).allclose(torch.linalg.matrix_power(m, -2))
    assert power(torch.eye(2), -(1 << 62)).equal(torch.eye(2))
    refuses("aten::linalg_matrix_power", m, -(1 << 63), match="no negation")
    refuses("aten::matrix_power", m, -(1 << 63), match="no negation")


def test_fused_optimizers_need_every_state_the_size_of_its_param() -> None:
    params = [torch.ones(4)]
    state = dict(lr=0.1, beta1=0.9, beta2=0.9, weight_decay=0.0, eps=1e-8, amsgrad=False,
                 maximize=False)  # fmt: skip
    step = [torch.tensor(1.0)]
    adam = checked("aten::_fused_adam_")
    adam(params, [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)], [], step, **state)
    assert params[0].lt(1).all()
    refuses(
        "aten::_fused_adam_", params, [torch.ones(2)], [torch.zeros(4)], [torch.zeros(4)], [],
        step, **state, match="grads",
    )  # fmt: skip
    refuses(
        "aten::_fused_adamw_", params, [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)], [],
        step * 2, **state, match="state_steps has 2",
    )  # fmt: skip
    refuses(
        "aten::_fused_sgd_", params, [torch.ones(4)], [torch.zeros(1)], weight_decay=0.0,
        momentum=0.9, lr=0.1, dampening=0.0, nesterov=False, maximize=False, is_first_step=False,
        match="momentum_buffer_list",
    )  # fmt: skip


def test_attention_backward_needs_out_and_logsumexp_of_the_query() -> None:
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    backward = checked("aten::_scaled_dot_product_flash_attention_for_cpu_backward")
    grads = backward(torch.ones_like(out), q, k, v, out, logsumexp, 0.0, False)
    assert [g.shape for g in grads] == [q.shape] * 3
    refuses(
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        torch.ones_like(out), q, k, v, out, torch.zeros(1), 0.0, False, match="logsumexp",
    )  # fmt: skip
    refuses(
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        torch.ones(1, 2, 8, 4), q, k, v, out[:, :, :2], logsumexp, 0.0, False,
    )  # fmt: skip


def test_variable_length_attention_is_refused() -> None:
    q = torch.randn(8, 2, 4)
    cu = torch.tensor([0, 100_000], dtype=torch.int32)
    refuses(
        "aten::_flash_attention_forward", q, q, q, cu, cu, 8, 8, 0.0, False, False,
        match="variable-length",
    )  # fmt: skip


def test_batch_norm_reads_only_the_statistics_its_mode_was_given() -> None:
    """Each was a crash: eval mode without running statistics (a null tensor read:
    `_native_batch_norm_legit.no_stats` with training=False, `_batch_norm_no_update` without
    them), a training backward without saved ones, the backward of an empty batch (SIGFPE),
    `_batch_norm_impl_index_backward` of an empty 1-d input (it wrote into an empty list)."""
    x = torch.randn(4, 3)
    grad = torch.ones(4, 3)
    stats = torch.zeros(3), torch.ones(3)
    refuses("aten::_native_batch_norm_legit.no_stats", x, None, None, False, 0.1, 1e-5,
            match="running_mean is needed in eval mode")  # fmt: skip
    out, save_mean, save_invstd = checked("aten::_native_batch_norm_legit.no_stats")(
        x, None, None, True, 0.1, 1e-5
    )
    torch.testing.assert_close(out, torch.nn.functional.batch_norm(x, None, None, training=True))
    refuses("aten::native_batch_norm", x, None, None, stats[0], None, False, 0.1, 1e-5,
            match="running_var")  # fmt: skip
    refuses("aten::_batch_norm_no_update", x, None, None, None, None, 0.1, 1e-5,
            match="running_mean")  # fmt: skip
    checked("aten::_batch_norm_no_update")(x, None, None, *stats, 0.1, 1e-5)
    refuses("aten::native_batch_norm_backward", grad, x, None, None, None, None, None, True, 1e-5,
            [True, True, True], match="save_mean")  # fmt: skip
    refuses("aten::native_batch_norm_backward", grad, x, None, None, None, save_mean, None, True,
            1e-5, [True, True, True], match="save_invstd")  # fmt: skip
    refuses("aten::batch_norm_backward", grad, x, torch.ones(3), None, None, None, None, False,
            1e-5, [True, True, True], torch.empty(0), match="running_mean")  # fmt: skip
    checked("aten::native_batch_norm_backward")(
        grad, x, None, None, None, save_mean, save_invstd, True, 1e-5, [True, True, True]
    )
    nothing = torch.zeros(0, 3)
    refuses("aten::native_batch_norm_backward", nothing, nothing, None, *stats, *stats, True,
            1e-5, [True, True, True], match="empty batch")  # fmt: skip
    empty_grads = checked("aten::_batch_norm_impl_index_backward")(
        0, nothing, nothing, torch.ones(3), *stats, *stats, True, 1e-5, [True, True, True],
        torch.empty(0),
    )  # fmt: skip
    assert empty_grads[0].shape == (0, 3)
    refuses("aten::_batch_norm_impl_index_backward", 4096, torch.zeros(0), torch.zeros(0),
            torch.ones(4), None, None, torch.zeros(4), torch.zeros(4), False, 3.0,
            [False, True, False], torch.empty(0), match="not \\[batch, channels")  # fmt: skip


def test_batch_norm_impl_index_backward_needs_a_statistic_per_channel() -> None:
    x = torch.randn(4, 8)
    refuses(
        "aten::_batch_norm_impl_index_backward",
        0, x, torch.ones(4, 8), None, None, None, torch.zeros(1), torch.ones(1), True, 1e-5,
        [True, True, True], torch.empty(0), match="save_mean",
    )  # fmt: skip


def test_sparse_gather_backward_makes_only_valid_sparse_tensors() -> None:
    grad = checked("aten::_gather_sparse_backward")(
        torch.ones(4), 0, torch.tensor([1]), torch.ones(1)
    )
    assert grad.to_dense().tolist() == [0.0, 1.0, 0.0, 0.0]
    refuses(
        "aten::_gather_sparse_backward", torch.ones(4), 0, torch.tensor([100_000]), torch.ones(1),
        match="invalid sparse tensor",
    )  # fmt: skip


def test_segment_reduce_offsets_must_start_at_0_end_at_the_size_and_not_decrease() -> None:
    data = torch.arange(6.0)
    forward = checked("aten::segment_reduce")
    assert forward(data, "sum", offsets=torch.tensor([0, 2, 6])).tolist() == [1.0, 14.0]
    two = torch.arange(12.0).view(2, 6)
    rows = torch.tensor([[0, 3, 6], [0, 1, 6]])
    assert forward(two, "max", offsets=rows, axis=1).tolist() == [[2.0, 5.0], [6.0, 11.0]]
    # The fuzzer's read outside the data (seed 20, session 7), and its relatives.
    refuses("aten::segment_reduce", data, "max", offsets=torch.arange(-8, -4), unsafe=False)
    refuses("aten::segment_reduce", data, "max", offsets=torch.tensor([0, 9]), match="end at")
    refuses("aten::segment_reduce", data, "max", offsets=torch.tensor([0, 4, 2, 6]),
            match="decrease")  # fmt: skip
    refuses("aten::segment_reduce", data, "max", offsets=torch.tensor([0.0, 6.0]),
            match="integers")  # fmt: skip
    refuses("aten::segment_reduce", two, "max", offsets=torch.tensor([0, 6]), axis=1,
            match="shape")  # fmt: skip
    refuses("aten::segment_reduce", data, "sum", lengths=torch.tensor([-2, 8]), match="negative")
    refuses("aten::segment_reduce", data, "sum", match="exactly one")
    refuses("aten::segment_reduce.out", data, "max", offsets=torch.arange(-8, -4),
            out=torch.empty(3))  # fmt: skip
    grad, output = torch.ones(3), torch.zeros(3)
    refuses("aten::_segment_reduce_backward", grad, output, data, "max",
            offsets=torch.arange(-8, -4))  # fmt: skip


def test_unsafe_index_and_index_put_check_their_indices() -> None:
    base = torch.arange(12.0).view(3, 4)
    index = checked("aten::_unsafe_index.Tensor")
    assert index(base, [torch.tensor([2, -1])]).equal(base[[2, -1]])
    assert index(base, [None, torch.tensor([3])]).equal(base[:, [3]])
    refuses("aten::_unsafe_index.Tensor", base, [torch.tensor([3])], match=r"outside \[-3, 3\)")
    refuses("aten::_unsafe_index.Tensor", base, [None, torch.tensor([-1 << 40])], match="outside")
    refuses("aten::_unsafe_index.Tensor", base, [None, None, torch.tensor([0])], match="too many")
    put = checked("aten::_unsafe_index_put")
    assert put(base, [torch.tensor([0])], torch.tensor(7.0))[0].tolist() == [7.0] * 4
    refuses("aten::_unsafe_index_put", base, [torch.tensor([1 << 20])], torch.tensor(7.0))
    assert base[0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_fft_kernels_take_only_distinct_dims_in_range() -> None:
    """`_fft_r2c`/`_fft_c2r`/`_fft_c2c` never wrap nor compare their dims: -2 of a 2-d tensor
    read before its sizes, 4 after them, [1, 1] freed a plan twice (each crashed a worker)."""
    x = torch.arange(12.0).reshape(3, 4)
    r2c = checked("aten::_fft_r2c")
    assert r2c(x, [1], 0, True).equal(aten._fft_r2c.default(x, [1], 0, True))
    assert r2c(x, [-1], 2, True).equal(aten._fft_r2c.default(x, [1], 2, True))  # wrapped
    refuses("aten::_fft_r2c", x, [-3], 0, True, match="out of range")
    refuses("aten::_fft_r2c", x, [2], 0, True, match="out of range")
    refuses("aten::_fft_r2c", x, [1, 1], 0, False, match="twice")
    refuses("aten::_fft_r2c", x, [1, -1], 0, False, match="twice")
    refuses("aten::_fft_r2c", x, [], 0, False, match="at least one")
    refuses("aten::_fft_r2c", x, [1], 255, False, match="normalization")
    refuses("aten::_fft_r2c.out", x, [3], 0, False, out=torch.empty(0, dtype=torch.complex64),
            match="out of range")  # fmt: skip
    c = torch.fft.rfft(x)
    assert checked("aten::_fft_c2r")(c, [1], 2, 4).allclose(x)
    refuses("aten::_fft_c2r", c[0], [-2], 1, 2, match="out of range")
    refuses("aten::_fft_c2r", c, [1], 2, 0, match="last_dim_size")
    z = torch.tensor([1 + 2j, -3j])
    assert checked("aten::_fft_c2c")(z, [0], 0, True).equal(aten._fft_c2c.default(z, [0], 0, True))
    refuses("aten::_fft_c2c", z, [1], 0, True, match="out of range")


def test_forward_ad_tangents_take_at_most_the_batch_dims_self_has() -> None:
    x, other = torch.ones(2, 3), torch.arange(4.0)
    make = checked("aten::_new_zeros_with_same_feature_meta")
    assert make(x, other, self_num_batch_dims=1).shape == (2, 4)
    assert make(x, other).shape == (4,)
    refuses("aten::_new_zeros_with_same_feature_meta", x, other, self_num_batch_dims=255,
            match=r"outside \[0, 2\]")  # fmt: skip
    refuses("aten::_new_zeros_with_same_feature_meta", x, other, self_num_batch_dims=-1)


def test_packed_sequences_repeats_and_chunk_cat_take_what_their_public_ops_make() -> None:
    data, sizes = torch.arange(15.0).reshape(5, 3), torch.tensor([3, 2])
    pad = checked("aten::_pad_packed_sequence")
    padded, lengths = pad(data, sizes, True, 0.0, 4)
    assert padded.shape == (3, 4, 3) and lengths.tolist() == [2, 2, 1]
    refuses("aten::_pad_packed_sequence", data, torch.tensor([2, 3]), True, 0.0, 4, match="grow")
    refuses("aten::_pad_packed_sequence", data, torch.tensor([3, 3]), True, 0.0, 4, match="sum")
    refuses("aten::_pad_packed_sequence", data, torch.tensor([5, 0]), True, 0.0, 4,
            match="positive")  # fmt: skip
    repeat = checked("aten::repeat_interleave.Tensor")
    assert repeat(torch.tensor([1, 2]), output_size=3).tolist() == [0, 1, 1]
    wrapped = torch.tensor([2**31 - 1, -(2**31), 7], dtype=torch.int32)  # sums to 6
    refuses("aten::repeat_interleave.Tensor", wrapped, output_size=6, match="negative")
    refuses("aten::repeat_interleave.Tensor", torch.tensor([1, 2]), output_size=2, match="sum|make")
    x = torch.arange(4.0)
    assert checked("aten::repeat_interleave.self_int")(x, 2, output_size=8).shape == (8,)
    refuses("aten::repeat_interleave.self_int", x, 2, output_size=9, match="make")
    chunk_cat = checked("aten::_chunk_cat")
    assert chunk_cat([torch.ones(4, 2)], 0, 2).shape == (2, 4)
    refuses("aten::_chunk_cat", [torch.tensor(1.0)], -1, 1 << 31, match="0 dimensions")
    refuses("aten::_chunk_cat", [torch.ones(2)], 0, 0, match="num_chunks")


def test_as_strided_views_stay_in_their_storage_counted_without_overflow() -> None:
    base = torch.arange(16.0)
    assert checked("aten::as_strided")(base, [2, 2], [4, 1], 1).tolist() == [[1, 2], [5, 6]]
    refuses("aten::as_strided_", base.clone(), [5], [(1 << 63) - 1], match="reach byte")
    refuses("aten::as_strided", base, [4], [1], 13, match="storage of 64 bytes")
    refuses("aten::as_strided_copy", base, [4], [1], -1, match="negative")


def test_round_takes_at_most_the_decimals_a_float_has() -> None:
    x = torch.tensor([1.2345])
    assert checked("aten::round.decimals")(x, decimals=2).tolist() == [pytest.approx(1.23)]
    refuses("aten::round.decimals_out", x, decimals=-(1 << 62), out=x.clone(), match="decimals")
    assert checked("aten::round")(x).tolist() == [1.0]


def test_truncated_integer_division_of_the_smallest_value_by_minus_one_is_refused() -> None:
    x = torch.tensor([-(2**31), 7], dtype=torch.int32)
    refuses("aten::div.Scalar_mode", x, -1, rounding_mode="trunc", match="overflows")
    refuses("aten::div.Tensor_mode", x, torch.tensor(-1), rounding_mode="trunc", match="overflows")
    assert checked("aten::div.Scalar_mode")(x, -1, rounding_mode="floor").dtype == torch.int32
    assert checked("aten::div.Scalar_mode")(x, 2, rounding_mode="trunc").tolist() == [-(2**30), 3]


def test_unfold_backward_needs_grad_in_of_the_unfolded_shape() -> None:
    x = torch.arange(10.0)
    grad = torch.ones_like(x.unfold(0, 4, 2))
    back = checked("aten::unfold_backward")
    assert back(grad, [10], 0, 4, 2).equal(aten.unfold_backward.default(grad, [10], 0, 4, 2))
    refuses("aten::unfold_backward", torch.ones(2, 4), [10], 0, 4, 2, match="grad_in has shape")
    refuses("aten::unfold_backward", grad, [10], 3, 4, 2, match="invalid unfold")


def test_weight_norm_needs_a_magnitude_per_slice_of_v() -> None:
    """`_weight_norm_interface` divided by an empty v's size along dim (SIGFPE), read g at
    v.size(dim) elements whatever g held, and took dim -1 unwrapped."""
    v, g = torch.arange(1.0, 13.0).reshape(3, 4), torch.ones(3, 1)
    fused = checked("aten::_weight_norm_interface")
    assert fused(v, g, 0)[0].allclose(aten._weight_norm_interface.default(v, g, 0)[0])
    last = torch.ones(1, 4)
    assert fused(v, last, -1)[0].allclose(aten._weight_norm_interface.default(v, last, 1)[0])
    refuses(
        "aten::_weight_norm_interface", torch.ones(0, 4), torch.ones(0, 1), 0, match="no slices"
    )
    refuses("aten::_weight_norm_interface", torch.empty(0), torch.empty(0), match="no slices")
    refuses("aten::_weight_norm_interface", v, torch.ones(2), 0, match="g has 2 elements")
    refuses("aten::_weight_norm_interface", v, g, 2, match="out of range")
    refuses("aten::_weight_norm_interface", torch.ones(2, 3, 4), g, 1, match="first or last")
    refuses("aten::_weight_norm_interface", torch.tensor(1.0), g, 0, match="out of range")
    composite = checked("aten::_weight_norm")
    assert composite(v, g, 0).allclose(aten._weight_norm.default(v, g, 0))
    assert composite(v, torch.tensor(2.0), -1).allclose(
        aten._weight_norm.default(v, torch.tensor(2.0), -1)
    )
    refuses("aten::_weight_norm", torch.ones(0, 4), torch.ones(0, 1), 0, match="no slices")


def test_enum_arguments_must_have_their_torch_type() -> None:
    """PyTorch's binding casts a bare int where a dtype goes (dtype -1 segfaulted `new_full`,
    `_to_copy`, `log_softmax` ...): every op with a dtype, layout, memory format or device
    argument runs behind a type check, whether the policy allows or checks it."""
    base = torch.ones(2)
    new_full = argument_guard("aten::new_full", aten.new_full.default, aten.new_full.default._op)
    assert new_full(base, [2], 3.0, dtype=torch.float64).dtype == torch.float64
    assert new_full(base, [2], 3.0).dtype == torch.float32
    with pytest.raises(OpRefused, match=r"dtype must be a torch\.dtype, not int"):
        new_full(base, [2], 3.0, dtype=-1)
    log_softmax = aten.log_softmax.int
    typed = argument_guard("aten::log_softmax.int", log_softmax, log_softmax._op)
    with pytest.raises(OpRefused, match=r"dtype must be a torch\.dtype"):
        typed(base, 0, -1)  # positional
    assert typed(base, 0, torch.float64).dtype == torch.float64
    empty = aten.empty.memory_format
    typed = argument_guard("aten::empty.memory_format", empty, empty._op)
    for bad in ({"layout": 0}, {"memory_format": 99}, {"device": "cpu"}, {"dtype": 1 << 40}):
        with pytest.raises(OpRefused, match="must be a torch"):
            typed([2], **bad)
    for name in ("aten::add.Tensor", "aten::add_.Tensor", "aten::copy_"):
        fn = op_overload(name)
        assert argument_guard(name, fn, fn._op) is fn._op  # nothing to check: no wrapper


def test_a_tensor_an_op_left_unsound_gets_its_geometry_back() -> None:
    """`randn.out` set impossible sizes on its `out` before their product overflowed; `rand.out`
    returned with a negative size ATen took next to a 0. Behind the geometry guard (no argument
    guard here, so the kernel sees both) the tensor gets its sizes, strides and offset back:
    the op that raised still raises, the one that returned is refused."""
    randn = aten.randn.out
    kept = keeping_geometry(randn, randn._op)
    base = torch.zeros(16, dtype=torch.float64)
    out = base[2:6]
    with pytest.raises(RuntimeError, match="overflow"):
        kept([2, 3, (1 << 63) - 1], out=out)
    assert (out.shape, out.stride(), out.storage_offset()) == ((4,), (1,), 2) and sound(out)
    bare = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="overflow"):
        randn([1 << 62, 4], out=bare)
    assert not sound(bare)  # what torch leaves without the guard
    rand = aten.rand.out
    with pytest.raises(OpRefused, match=r"left a tensor it writes with sizes \[-2, 0, 6\]"):
        keeping_geometry(rand, rand._op)([-2, 0, 6], out=out)
    assert out.shape == (4,) and sound(out)
    assert kept([3], out=out).shape == (3,)  # a resize that fits is the op's to make
    assert sound(base[2:5]) and sound(base.as_strided([2, 2], [0, 4], 1))


def test_size_lists_hold_no_negative_size_but_an_inferred_one() -> None:
    """ATen takes a negative size next to a 0 (`rand.out` with [-2, 0, 6, 2**62, 3] left sizes
    whose strides it never computed, and reading them crashed the worker): every list of a
    tensor's sizes is checked, -1 allowed only where it infers or keeps a size."""

    def guarded(name: str) -> Any:
        fn = op_overload(name)
        return argument_guard(name, fn, fn._op)

    out = torch.zeros(8)
    with pytest.raises(OpRefused, match="size holds -2: a size is not negative"):
        guarded("aten::rand.generator_out")([-2, 0, 6, 1 << 62, 3], generator=None, out=out)
    assert out.shape == (8,)
    with pytest.raises(OpRefused, match="size holds -1"):
        guarded("aten::zeros")([-1, 0])
    with pytest.raises(OpRefused, match="output_size"):
        guarded("aten::adaptive_avg_pool2d")(torch.ones(1, 4, 4), [-3, 0])
    with pytest.raises(OpRefused, match=r"-1 \(infer\) is the only negative size"):
        guarded("aten::view")(out, [-2, 0])
    assert guarded("aten::view")(out, [-1, 4]).shape == (2, 4)
    assert guarded("aten::expand")(torch.ones(2), [3, -1]).shape == (3, 2)
    assert guarded("aten::unflatten.int")(out, 0, [2, -1]).shape == (2, 4)
    assert guarded("aten::zeros")([0, 3]).shape == (0, 3)
    assert guarded("aten::upsample_nearest2d.vec")(torch.ones(1, 1, 2, 2), None, [2.0, 2.0]).shape == (
        1, 1, 4, 4,
    )  # fmt: skip


def test_foreach_ops_need_lists_of_the_same_length() -> None:
    dst = [torch.zeros(2), torch.zeros(2)]
    refuses("aten::_foreach_copy_", dst, [torch.ones(2)], match="src has 1 entries for 2")
    refuses("aten::_foreach_add.List", dst, [torch.ones(2)] * 3, match="other")
    checked("aten::_foreach_copy_")(dst, [torch.ones(2), torch.full((2,), 2.0)])
    assert [t.tolist() for t in dst] == [[1.0, 1.0], [2.0, 2.0]]


def test_special_polynomials_refuse_a_degree_no_float_needs() -> None:
    x = torch.linspace(-1, 1, 5)
    p2 = checked("aten::special_legendre_polynomial_p.n_scalar")(x, 2)
    assert torch.allclose(p2, (3 * x * x - 1) / 2)
    refuses("aten::special_legendre_polynomial_p.n_scalar", x, 1 << 62, match="degree")
    refuses("aten::special_legendre_polynomial_p.out", x, torch.tensor([float(1 << 62)]),
            out=torch.empty(5), match="degree")  # fmt: skip
    refuses("aten::special_hermite_polynomial_h", x, torch.tensor([float("nan")]), match="nan")
    assert ruling("aten::special_chebyshev_polynomial_t.x_scalar").detail == "polynomial_degree"


def test_cpu_memory_no_kernel_wrote_comes_back_zeroed() -> None:
    """What `empty`, `resize_`, `set_` growth and resizing `.out` ops hand back (the executor
    switches the allocator's zero fill on for its whole process)."""
    from gpupool.worker.opchecks import zero_fill_cpu_allocations

    zero_fill_cpu_allocations()
    marker = 0x5A
    for _ in range(50):
        dirty = torch.full((1 << 12,), marker, dtype=torch.uint8)
        del dirty
        assert int(torch.empty(1 << 12, dtype=torch.uint8).max()) == 0
        grown = torch.ones(4, dtype=torch.uint8).resize_(1 << 12)
        assert int(grown[4:].max()) == 0
        assert int(torch.ones(2).new_empty_strided((64,), (1,)).abs().max()) == 0
        out = torch.empty(0)
        torch.ops.aten._logcumsumexp.out(torch.zeros(0, 3), 0, out=torch.empty(0))
        torch.max(torch.ones(3, 5), 1, out=(out, torch.empty(0, dtype=torch.long)))
        assert out.tolist() == [1.0] * 3


def test_padding_backward_needs_grad_output_of_the_padded_shape() -> None:
    x = torch.randn(2, 3, 5, requires_grad=True)
    y = torch.nn.functional.pad(x, (2, 1), mode="reflect")
    grad = torch.randn_like(y)
    (expected,) = torch.autograd.grad(y, x, grad)
    op = checked("aten::reflection_pad1d_backward")
    assert op(grad, x.detach(), [2, 1]).allclose(expected)
    refuses(
        "aten::reflection_pad1d_backward", torch.randn(2, 3, 4), x.detach(), [], match="padding"
    )
    refuses("aten::reflection_pad1d_backward", torch.randn(2, 3, 4), x.detach(), [2, 1],
            match="grad_output has shape")  # fmt: skip
    refuses("aten::reflection_pad1d_backward.grad_input", torch.randn(2, 3, 2), x.detach(), [0, 0],
            grad_input=torch.empty(0), match="grad_output")  # fmt: skip
    image = torch.randn(1, 2, 4, 4)
    refuses("aten::reflection_pad2d_backward", torch.randn(1, 2, 3, 3), image, [1, 1, 1, 1],
            match="grad_output")  # fmt: skip
    assert (
        checked("aten::reflection_pad2d_backward")(
            torch.ones(1, 2, 6, 6), image, [1, 1, 1, 1]
        ).shape
        == image.shape
    )
    refuses("aten::replication_pad2d_backward", torch.randn(1, 2, 3, 3), image, [1, 1, 1, 1],
            match="grad_output")  # fmt: skip


def test_slow_conv2d_backward_needs_the_forwards_weight_and_grad_output() -> None:
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    y = torch.nn.functional.conv2d(x, w, stride=2, padding=1)
    grad = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    op = checked("aten::_slow_conv2d_backward.output_mask")
    got = op(grad, x.detach(), w.detach(), [3, 3], [2, 2], [1, 1], [True, True, False])
    assert got[0].allclose(gx, atol=1e-5) and got[1].allclose(gw, atol=1e-4)
    name = "aten::_slow_conv2d_backward.output_mask"
    mask = [True, True, True]
    refuses(name, grad, x, w, [-1], [], [], mask, match="two values")
    refuses(name, grad, x, w, [3, 3], [0, 2], [1, 1], mask, match="out of range")
    refuses(name, grad, x, w, [5, 5], [2, 2], [1, 1], mask, match="does not hold")
    refuses(name, torch.randn(1, 4, 3, 3), x, w, [3, 3], [2, 2], [1, 1], mask, match="grad_output")
    refuses(name, grad, torch.randn(8), w, [3, 3], [2, 2], [1, 1], mask, match="dimensions")
    refuses("aten::_slow_conv2d_backward.grad_input", grad, x, w, [3, 3], [2, 2], [0, 0],
            grad_input=torch.empty(0), grad_weight=torch.empty(0), grad_bias=torch.empty(0),
            match="grad_output")  # fmt: skip


def test_a_split_returns_a_bounded_number_of_tensors() -> None:
    """`tensor_split(x, 2**40)` held a worker for ever building views (the fuzzer's hang)."""
    x = torch.ones(10)
    assert len(checked("aten::tensor_split.sections")(x, 3)) == 3
    assert len(checked("aten::split.Tensor")(x, 3)) == 4
    assert len(checked("aten::unbind.int")(x, 0)) == 10
    refuses("aten::tensor_split.sections", x, 1 << 40, match="past 65536")
    refuses("aten::split.Tensor", torch.ones(1).expand(1 << 20), 1, match="1048576 tensors")
    refuses("aten::unbind.int", torch.ones(1).expand(1 << 20), 0, match="past 65536")


def test_onednn_lstm_layers_run_on_layers_that_fit_and_a_workspace_of_their_own() -> None:
    """The kernel views every tensor's data pointer with the layer's descriptor, and its
    backward reads as much workspace as the layer's primitive says: forged shapes crashed the
    worker. Each forged call below is refused before oneDNN sees it."""
    seq, batch, features, hidden = 5, 3, 4, 6
    x = torch.randn(seq, batch, features)
    w0, w1 = torch.randn(4 * hidden, features), torch.randn(4 * hidden, hidden)
    b0, b1 = torch.randn(4 * hidden), torch.randn(4 * hidden)
    hx, cx = torch.randn(batch, hidden), torch.randn(batch, hidden)
    forward = checked("aten::mkldnn_rnn_layer")

    def layer(*tensors: Any, train: bool = True, mode: int = 2, size: int = hidden) -> Any:
        return forward(*tensors, False, [], mode, size, 1, True, False, False, train)

    out, hy, cy, workspace = layer(x, w0, w1, b0, b1, hx, cx)  # the worker's autograd is off
    assert out.shape == (seq, batch, hidden) and workspace.numel() > 0
    with torch.enable_grad():  # what a local CPU computes
        want = aten.mkldnn_rnn_layer.default(
            x, w0, w1, b0, b1, hx, cx, False, [], 2, hidden, 1, True, False, False, True
        )
    assert torch.equal(out, want[0]) and workspace.numel() == want[3].numel()
    assert layer(x, w0, w1, b0, b1, hx, cx, train=False)[3] is None  # inference: none
    for forged, match in (
        ((x, w0[:-1], w1, b0, b1, hx, cx), "weight0"),
        ((x, w0, w1[:, :2], b0, b1, hx, cx), "weight1"),
        ((x, w0, w1, b0[:3], b1, hx, cx), "weight2"),
        ((x, w0, w1, b0, b1, hx[:1], cx), "hx_"),
        ((x, w0, w1, b0, b1, hx, cx.t().contiguous().t()), "cx_ must be contiguous"),
        ((x.transpose(0, 1), w0, w1, b0, b1, hx, cx), "input"),
        ((x.double(), w0, w1, b0, b1, hx, cx), "float32"),
    ):
        with pytest.raises(OpRefused, match=match):
            layer(*forged)
    with pytest.raises(OpRefused, match="mode 3"):
        layer(x, w0, w1, b0, b1, hx, cx, mode=3)
    with pytest.raises(OpRefused, match="hidden_size"):
        layer(x, w0, w1, b0, b1, hx, cx, size=0)

    backward = checked("aten::mkldnn_rnn_layer_backward")
    grad_out = torch.randn(seq, batch, hidden)

    def grads(ws: Any, output: Any = out, g: Any = grad_out) -> Any:
        return backward(
            x, w0, w1, b0, b1, hx, cx, output, hy, cy, g, None, None, False, 2, hidden, 1,
            True, True, False, [], False, ws,
        )  # fmt: skip

    got = grads(workspace)
    want_grads = aten.mkldnn_rnn_layer_backward.default(
        x, w0, w1, b0, b1, hx, cx, want[0], want[1], want[2], grad_out, None, None, False, 2,
        hidden, 1, True, True, False, [], False, want[3],
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(got, want_grads, strict=True))
    for forged_ws, match in (
        (torch.zeros(8, dtype=torch.uint8), "not made by this worker"),
        (workspace.clone(), "not made by this worker"),  # another tensor, however like it
        (workspace[:8], "not made by this worker"),
    ):
        with pytest.raises(OpRefused, match=match):
            grads(forged_ws)
    other = layer(torch.randn(2, batch, features), w0, w1, b0, b1, hx, cx)[3]
    with pytest.raises(OpRefused, match="same layer"):
        grads(other)  # made for a layer of 2 steps, read as one of 5
    with pytest.raises(OpRefused, match="output"):
        grads(workspace, output=out[:2])
    with pytest.raises(OpRefused, match="grad_output"):
        grads(workspace, g=grad_out[:, :1])
    workspace.resize_(8)  # the tenant shrank it in place
    with pytest.raises(OpRefused, match="workspace"):
        grads(workspace)


def test_cudnn_rnn_runs_on_stacks_that_fit_and_a_weight_buffer_and_reserve_of_its_own() -> None:
    """cuDNN's RNN views its weights, hidden states, gradients, weight buffer and reserve by
    data pointer with the stack's descriptors. Each forged call is refused before cuDNN sees
    it (meta tensors stand for a GPU's here: the checks read only metadata; the GPU machine's
    test runs the real kernels)."""
    meta = torch.device("meta")
    seq, batch, features, hidden, layers = 5, 3, 4, 6, 2

    def weights(proj: int = 0, biases: bool = True) -> list[torch.Tensor]:
        out = proj or hidden
        ws: list[torch.Tensor] = []
        for layer in range(layers):
            inputs = features if layer == 0 else out
            ws += [torch.empty(4 * hidden, inputs, device=meta)]
            ws += [torch.empty(4 * hidden, out, device=meta)]
            ws += [torch.empty(4 * hidden, device=meta)] * 2 if biases else []
            ws += [torch.empty(proj, hidden, device=meta)] if proj else []
        return ws

    x = torch.empty(seq, batch, features, device=meta)
    hx = torch.empty(layers, batch, hidden, device=meta)
    cx = torch.empty(layers, batch, hidden, device=meta)
    ws = weights()
    made: dict[str, Any] = {}

    def cudnn(*args: Any) -> Any:
        """The kernel's outputs (a GPU's reserve and weight buffer sizes stand in)."""
        output, hy, cy, _, _ = aten._cudnn_rnn.default(*args)
        made["reserve"] = torch.empty(1000, dtype=torch.uint8, device=meta)
        made["buffer"] = torch.empty(sum(w.numel() for w in ws), device=meta)
        return output, hy, cy, made["reserve"], made["buffer"]

    forward = guard(
        "aten::_cudnn_rnn", CHECKS["cudnn_rnn"], aten._cudnn_rnn.default, cudnn
    )

    def stack(*tensors: Any, w: Any = ws, mode: int = 2, proj: int = 0, train: bool = True,
              dropout: float = 0.0, stride0: int = 4, buf: Any = None, state: Any = None) -> Any:
        inp, h, c = tensors
        return forward(inp, w, stride0, buf, h, c, mode, hidden, proj, layers, False, dropout,
                       train, False, [], state)  # fmt: skip

    output = stack(x, hx, cx)[0]
    assert output.shape == (seq, batch, hidden)
    cpu = torch.empty(seq, batch, features)
    for forged, match in (
        (dict(w=ws[:-1]), "list of 8"),
        (dict(w=[ws[0][:-1], *ws[1:]]), r"weight\[0\]"),
        (dict(w=[*ws[:5], ws[5][:, :2], *ws[6:]]), r"weight\[5\]"),
        (dict(w=[*ws[:2], ws[2].double(), *ws[3:]]), "float64, expected torch.float32"),
        (dict(mode=4), "mode 4"),
        (dict(mode=3), "cx is for an LSTM only"),
        (dict(proj=6), "proj_size"),
        (dict(stride0=3), "weight_stride0"),
        (dict(buf=torch.empty(4, device=meta)), "makes the weight buffer"),
        (dict(state=torch.empty(8, dtype=torch.uint8, device=meta)), "keeps cuDNN's dropout"),
        (dict(dropout=2.0, train=False), "probability"),
    ):
        with pytest.raises(OpRefused, match=match):
            stack(x, hx, cx, **forged)
    for tensors, match in (
        ((cpu, hx, cx), "CUDA worker"),
        ((x.double(), hx, cx), "float64"),
        ((x, hx[:1], cx), "hx has shape"),
        ((x, hx, cx.transpose(1, 2).contiguous().transpose(1, 2)), "cx must be contiguous"),
        ((x, hx, None), "cx must be a tensor"),
        ((torch.empty(0, batch, features, device=meta), hx, cx), "non-empty"),
    ):
        with pytest.raises(OpRefused, match=match):
            stack(*tensors)
    # projections: another count per layer and an hx of the projected size
    proj_ws = weights(proj=4)
    proj_hx = torch.empty(layers, batch, 4, device=meta)
    assert stack(x, proj_hx, cx, w=proj_ws, proj=4, stride0=5)[1].shape == (layers, batch, 4)

    stack(x, hx, cx)  # the forward whose buffers the backward below gets
    reserve, buffer = made["reserve"], made["buffer"]
    calls: list[int] = []

    def cudnn_backward(*args: Any) -> Any:
        calls.append(1)
        dw = [torch.empty_like(w).as_strided(w.shape, w.stride(), 7) for w in args[1]]
        return torch.empty_like(x), torch.empty_like(hx), torch.empty_like(cx), dw

    backward = guard(
        "aten::_cudnn_rnn_backward", CHECKS["cudnn_rnn_backward"],
        aten._cudnn_rnn_backward.default, cudnn_backward,
    )  # fmt: skip
    grad = torch.empty(seq, batch, hidden, device=meta)

    def grads(buf: Any = buffer, res: Any = reserve, out: Any = output, g: Any = grad,
              train: bool = True, inp: Any = x) -> Any:
        return backward(inp, ws, 4, buf, hx, cx, out, g, None, None, 2, hidden, 0, layers,
                        False, 0.0, train, False, [], None, res, [True, True, True, True])

    dw = grads()[3]
    assert len(calls) == 1 and all(g.storage_offset() == 0 for g in dw)  # copied out
    assert grads(res=torch.empty(1000, dtype=torch.uint8, device=meta))  # a retained copy
    for forged, match in (
        (dict(buf=torch.empty(buffer.numel(), device=meta)), "not made by this worker"),
        (dict(buf=buffer[:-1]), "not made by this worker"),
        (dict(res=reserve[:999]), "reserve has 999 elements"),
        (dict(res=torch.empty(1000, device=meta)), "reserve is torch.float32"),
        (dict(g=torch.empty(seq, batch, hidden + 1, device=meta)), "grad_output has shape"),
        (dict(out=torch.empty(seq, batch, 2, device=meta)), "output has shape"),
        (dict(out=output.transpose(0, 1).contiguous().transpose(0, 1)), "sequence-major"),
        (dict(train=False), "training mode"),
        (dict(inp=torch.empty(seq + 1, batch, features, device=meta)), "not made by this"),
    ):
        with pytest.raises(OpRefused, match=match):
            grads(**forged)
    buffer.resize_(10)
    with pytest.raises(OpRefused, match="weight_buf has 10 elements"):
        grads()
    assert len(calls) == 2
