"""Which aten ops a worker runs: a decision for every overload of its torch, made by rules.

A tenant names ops by string; before this policy the worker ran any `aten::` overload, and
some of them read or write the worker's memory wherever the caller points (`segment_reduce`
with `unsafe=True`, a sparse tensor with out-of-range indices, `_reshape_alias` past its
storage, backward ops fed saved tensors of the wrong size), print to the worker's stdout, or
touch files. Every overload is now decided once, in a table generated from the op registry by
the rules below and committed (`oppolicy.json`):

- allow: the kernel checks its own arguments (or has nothing to check);
- check: the op runs behind a check in `opchecks` that refuses what the kernel trusts;
- refuse: never runs on a worker, with the reason the client is told.

An overload the table does not name is refused at run time ("undecided"), and a test fails
while the running torch has one: a torch upgrade that adds ops fails CI until someone decides
them. Regenerate with `python -m gpupool.worker.oppolicy --write` (see `main`), after adding
registries of the other torch versions the workers run (`--dump` on that machine).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("oppolicy.json")
REGISTRIES_DIR = Path(__file__).resolve().parents[3] / "scripts" / "op_registries"
"""Registries of other torch versions (`--dump` output), read by `--write` (a source checkout)."""


class Decision(Enum):
    ALLOW = "allow"
    CHECK = "check"
    REFUSE = "refuse"


@dataclass(frozen=True)
class Ruling:
    """The table's word on one overload: `detail` is the check's name or the refusal's reason."""

    decision: Decision
    detail: str = ""

    def encode(self) -> str:
        return self.decision.value if not self.detail else f"{self.decision.value}:{self.detail}"

    @classmethod
    def decode(cls, text: str) -> Ruling:
        word, _, detail = text.partition(":")
        return cls(Decision(word), detail)


@dataclass(frozen=True)
class OpInfo:
    """One overload of a registry: its schema text and whether the dispatcher knows it (the
    others are TorchScript interpreter ops that `torch.ops.aten` also resolves)."""

    name: str
    schema: str | None
    dispatcher: bool


# ---- the rules ---------------------------------------------------------------------------------

CHECKED: dict[str, str] = {
    # views that take sizes and strides as given
    "_reshape_alias": "within_storage",
    "_reshape_alias_copy": "within_storage",
    "as_strided": "within_storage",
    "as_strided_": "within_storage",
    "as_strided_copy": "within_storage",
    # lists of views whose length the arguments choose
    **{
        name: "few_views"
        for name in (
            "split",
            "split_copy",
            "unsafe_split",
            "split_with_sizes",
            "split_with_sizes_copy",
            "unsafe_split_with_sizes",
            "tensor_split",
            "chunk",
            "unsafe_chunk",
            "unbind",
            "unbind_copy",
            "hsplit",
            "vsplit",
            "dsplit",
        )
    },
    # bounds checks switched off by an argument
    "segment_reduce": "segments",
    "_unsafe_index": "unchecked_indices",
    "_unsafe_index_put": "unchecked_indices",
    "_index_put_impl": "force_safe",
    "repeat_interleave": "repeats",
    "_index_put_impl_": "force_safe",
    # index tensors a sparse or nested tensor keeps inside (a write would move them)
    "_indices": "copy_outputs",
    "indices": "copy_outputs",
    "crow_indices": "copy_outputs",
    "col_indices": "copy_outputs",
    "ccol_indices": "copy_outputs",
    "row_indices": "copy_outputs",
    "_nested_tensor_size": "copy_outputs",
    "_nested_tensor_strides": "copy_outputs",
    "_nested_tensor_storage_offsets": "copy_outputs",
    "_nested_get_offsets": "copy_outputs",
    "_nested_get_lengths": "copy_outputs",
    # sparse constructors: indices are not checked unless asked (or never, for the internal ones)
    "sparse_coo_tensor": "valid_sparse",
    "_sparse_coo_tensor_unsafe": "valid_sparse",
    "_sparse_coo_tensor_with_dims_and_tensors": "valid_sparse",
    "sparse_compressed_tensor": "valid_sparse",
    "_sparse_compressed_tensor_unsafe": "valid_sparse",
    "sparse_csr_tensor": "valid_sparse",
    "sparse_csc_tensor": "valid_sparse",
    "sparse_bsr_tensor": "valid_sparse",
    "sparse_bsc_tensor": "valid_sparse",
    "_sparse_csr_tensor_unsafe": "valid_sparse",
    "_sparse_csc_tensor_unsafe": "valid_sparse",
    "_sparse_bsr_tensor_unsafe": "valid_sparse",
    "_sparse_bsc_tensor_unsafe": "valid_sparse",
    "_spdiags": "valid_sparse",
    "_gather_sparse_backward": "valid_sparse",
    # backward ops that trust the saved tensors of their forward
    "_segment_reduce_backward": "segment_backward",
    "_softmax_backward_data": "softmax_backward",
    "_log_softmax_backward_data": "softmax_backward",
    "native_layer_norm_backward": "layer_norm_backward",
    "native_batch_norm_backward": "batch_norm",
    "batch_norm_backward": "batch_norm",
    "cudnn_batch_norm_backward": "batch_norm",
    "batch_norm_backward_reduce": "batch_norm",
    "batch_norm_backward_elemt": "batch_norm",
    "native_batch_norm": "batch_norm",
    "_batch_norm_impl_index": "batch_norm",
    "_batch_norm_impl_index_backward": "batch_norm",
    "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm",
    "_batch_norm_with_update": "batch_norm",
    "_batch_norm_with_update_functional": "batch_norm",
    "_batch_norm_no_update": "batch_norm",
    "cudnn_batch_norm": "batch_norm",
    "batch_norm_elemt": "batch_norm",
    "native_group_norm_backward": "group_norm_backward",
    "embedding_dense_backward": "embedding_backward",
    "embedding_backward": "embedding_backward",
    "embedding_sparse_backward": "embedding_backward",
    "_embedding_bag": "embedding_bag",
    "_embedding_bag_forward_only": "embedding_bag",
    "embedding_bag": "embedding_bag",
    "_embedding_bag_backward": "embedding_bag_backward",
    "_embedding_bag_dense_backward": "embedding_bag_backward",
    "_embedding_bag_sparse_backward": "embedding_bag_backward",
    "_embedding_bag_per_sample_weights_backward": "embedding_bag_backward",
    "max_pool2d_with_indices_backward": "pool2d_backward",
    "adaptive_max_pool2d_backward": "pool2d_backward",
    "fractional_max_pool2d_backward": "pool2d_backward",
    "max_pool3d_with_indices_backward": "pool3d_backward",
    "adaptive_max_pool3d_backward": "pool3d_backward",
    "fractional_max_pool3d_backward": "pool3d_backward",
    "_ctc_loss_backward": "ctc_backward",
    "_pdist_backward": "pdist_backward",
    "_cdist_backward": "cdist_backward",
    "_weight_norm_interface": "weight_norm",
    "_weight_norm": "weight_norm_composite",
    "round": "round_decimals",
    "special_round": "round_decimals",
    "unfold_backward": "unfold_backward",
    "_weight_norm_interface_backward": "weight_norm_backward",
    "_weight_norm_differentiable_backward": "weight_norm_backward",
    "_slow_conv2d_backward": "slow_conv2d_backward",
    "reflection_pad1d_backward": "reflection_pad1d_backward",
    "reflection_pad2d_backward": "reflection_pad2d_backward",
    "reflection_pad3d_backward": "reflection_pad3d_backward",
    "replication_pad1d_backward": "replication_pad1d_backward",
    "replication_pad2d_backward": "replication_pad2d_backward",
    "replication_pad3d_backward": "replication_pad3d_backward",
    # internal kernels that take their arguments as their public op prepared them
    "_fft_r2c": "fft_dims",
    "_fft_c2r": "fft_dims",
    "_fft_c2c": "fft_dims",
    "_new_zeros_with_same_feature_meta": "batch_dims",
    "_pad_packed_sequence": "packed_batch_sizes",
    "_chunk_cat": "chunk_cat",
    "_cummax_helper": "cum_helper",
    "_cummin_helper": "cum_helper",
    # work that one argument chooses
    "linalg_matrix_power": "matrix_power",
    "matrix_power": "matrix_power",
    "choose_qparams_optimized": "qparams_search",
    "copy": "copy_defined",
    "_fused_adam": "fused_optimizer",
    "_fused_adam_": "fused_optimizer",
    "_fused_adamw": "fused_optimizer",
    "_fused_adamw_": "fused_optimizer",
    "_fused_sgd": "fused_optimizer",
    "_fused_sgd_": "fused_optimizer",
    "_fused_adagrad": "fused_optimizer",
    "_fused_adagrad_": "fused_optimizer",
    # attention kernels: no packed variable-length batches; backward reads out and logsumexp
    "_flash_attention_forward": "no_varlen",
    "_flash_attention_forward_no_dropout_inplace": "no_varlen",
    "_efficient_attention_forward": "no_varlen",
    "_cudnn_attention_forward": "no_varlen",
    "_flash_attention_backward": "attention_backward",
    "_efficient_attention_backward": "attention_backward",
    "_cudnn_attention_backward": "attention_backward",
    "_scaled_dot_product_flash_attention_backward": "attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "attention_backward",
    "_scaled_dot_product_efficient_attention_backward": "attention_backward",
    "_scaled_dot_product_cudnn_attention_backward": "attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward": "attention_backward",
}
"""Ops (all overloads of a base name) that run behind a check of `opchecks.CHECKS`."""

CHECKED_OVERLOADS: dict[str, str] = {
    f"aten::{op}.{overload}": "truncated_division"
    for op in ("div", "div_", "divide", "divide_")
    for overload in ("Tensor_mode", "Scalar_mode", "out_mode", "Tensor_mode_out", "Scalar_mode_out")
}
CHECKED_OVERLOADS.update(
    {
        "aten::mkldnn_rnn_layer": "mkldnn_rnn_layer",
        "aten::mkldnn_rnn_layer_backward": "mkldnn_rnn_layer_backward",
        "aten::_cudnn_rnn": "cudnn_rnn",
        "aten::_cudnn_rnn_backward": "cudnn_rnn_backward",
    }
)
"""Single overloads behind a check, before `CHECKED` (the rest of their op is hot and needs
none: `div` with a rounding mode only; oneDNN's and cuDNN's RNNs, whose `.out` forms stay
refused)."""

CHECKED_PREFIXES: tuple[tuple[str, str], ...] = (
    ("_foreach_", "same_lengths"),
    ("special_chebyshev_polynomial_", "polynomial_degree"),
    ("special_shifted_chebyshev_polynomial_", "polynomial_degree"),
    ("special_hermite_polynomial_", "polynomial_degree"),
    ("special_laguerre_polynomial_", "polynomial_degree"),
    ("special_legendre_polynomial_", "polynomial_degree"),
)
"""Op families (by base-name prefix) that run behind a check, after `CHECKED`."""

CHECKED_EXCEPT_OUT = frozenset({"copy_outputs"})
"""Checks that do not apply to `.out` overloads (their result is the caller's own tensor)."""

_PACKED = "trusts an opaque packed-weight or metadata tensor whose layout it cannot check"
_RAW_OFFSETS = "builds a tensor from raw offsets, sizes or strides that nothing checks"

REFUSED: dict[str, str] = {
    "_print": "prints to the worker's stdout",
    "from_file": "reads the worker's files",
    "record_stream": "acts on the worker's CUDA streams (the client keeps streams itself)",
    "_cufft_set_plan_cache_max_size": "changes the worker's process-wide cuFFT plan cache",
    "_cufft_clear_plan_cache": "changes the worker's process-wide cuFFT plan cache",
    "_coalesced": "marks a sparse tensor coalesced without checking it",
    "_coalesced_": "marks a sparse tensor coalesced without checking it",
    "sparse_resize": "changes a sparse tensor's size under its indices",
    "sparse_resize_": "changes a sparse tensor's size under its indices",
    "resize_as_sparse": "changes a sparse tensor's size under its indices",
    "resize_as_sparse_": "changes a sparse tensor's size under its indices",
    "_sparse_compressed_tensor_with_dims": "makes a sparse tensor whose indices are never set",
    "_convert_indices_from_coo_to_csr": "converts sparse indices it trusts (out of range, it "
    "corrupted the worker's heap)",
    "_convert_indices_from_csr_to_coo": "converts sparse indices it trusts (out of range, it "
    "crashed the worker)",
    "_efficientzerotensor": "makes a ZeroTensor, whose arithmetic hung the worker (torch 2.13)",
    "_nested_view_from_buffer": _RAW_OFFSETS,
    "_nested_view_from_buffer_copy": _RAW_OFFSETS,
    "_nested_view_from_jagged": _RAW_OFFSETS,
    "_nested_view_from_jagged_copy": _RAW_OFFSETS,
    "_nested_from_padded": _RAW_OFFSETS,
    "_nested_from_padded_and_nested_example": _RAW_OFFSETS,
    "_nested_from_padded_tensor": _RAW_OFFSETS,
    "_jagged_to_padded_dense_forward": _RAW_OFFSETS,
    "_padded_dense_to_jagged_forward": _RAW_OFFSETS,
    "_grouped_mm": "multiplies groups at raw offsets (offs) that nothing checks",
    "_scaled_grouped_mm": "multiplies groups at raw offsets (offs) that nothing checks",
    "_scaled_grouped_mm_v2": "multiplies groups at raw offsets (offs) that nothing checks",
    "_mixed_dtypes_linear": _PACKED,
    "_weight_int8pack_mm": _PACKED,
    "_to_sparse_semi_structured": _PACKED,
    "_stack": "the kernel behind stack, which trusts that its inputs already have a size-1 "
    "dimension at dim (a transposed input corrupted the worker's heap); stack runs",
    "_nnpack_spatial_convolution": "an NNPACK kernel that convolution picks itself; it trusts "
    "its weight, padding and stride (a forged padding crashed the worker); convolution runs",
    "_compute_linear_combination": "a matrix_exp internal that reads its input with the "
    "coefficients' dtype and sizes unchecked (past the input's storage: heap bytes came back); "
    "linalg_matrix_exp runs",
    "_thnn_differentiable_lstm_cell_backward": "a double-backward internal of the fused RNN "
    "cells that trusts its gates' shapes (forged ones crashed the worker)",
    "_thnn_differentiable_gru_cell_backward": "a double-backward internal of the fused RNN "
    "cells that trusts its gates' shapes (forged ones crashed the worker)",
    "_cholesky_solve_helper": "the kernel behind cholesky_solve, which checks its arguments "
    "for it (forged ones crashed the worker); cholesky_solve runs",
    "_logcumsumexp": "the kernel behind logcumsumexp, which wraps dim for it (the raw one "
    "aborted the worker); logcumsumexp runs",
    "mkldnn_rnn_layer": "the .out form of oneDNN's LSTM layer, which trusts its weights' "
    "shapes (forged ones crashed the worker); mkldnn_rnn_layer itself runs behind a check",
    "mkldnn_rnn_layer_backward": "the .out form of oneDNN's LSTM layer backward, which trusts "
    "its weights' shapes and workspace; mkldnn_rnn_layer_backward runs behind a check",
    "_cudnn_rnn": "the .out form of cuDNN's RNN, which trusts its weight buffer; _cudnn_rnn "
    "itself runs behind a check",
    "_cudnn_rnn_backward": "the .out form of cuDNN's RNN backward, which trusts its weight "
    "buffer, reserve and gradients' sizes; _cudnn_rnn_backward runs behind a check",
    "_add_batch_dim": "a vmap internal: batch levels of torch.func transforms, which run in "
    "the client",
    "_remove_batch_dim": "a vmap internal: batch levels of torch.func transforms, which run in "
    "the client (an unknown level crashed the worker)",
    "_propagate_xla_data": "an XLA-only op",
    "_foobar": "a test-only op",
}
"""Ops (all overloads of a base name) that never run on a worker, with the reason."""

REFUSED_PREFIXES: tuple[tuple[str, str], ...] = (
    ("fbgemm_", _PACKED),
    ("_weight_int4pack_mm", _PACKED),
    ("_convert_weight_to_int4pack", _PACKED),
    ("_dyn_quant_", _PACKED),
    ("_cslt_", _PACKED),
    ("_sparse_semi_structured_", _PACKED),
    ("_wrapped_", _PACKED),
    ("quantized_lstm", _PACKED),
    ("quantized_gru", _PACKED),
    ("quantized_rnn_", _PACKED),
    ("_test_", "a test-only op"),
    (
        "_sobol_engine_",
        "a SobolEngine kernel: it walks its state and output for `dimension` "
        "entries it never compares with them (an out-of-range one wrote past them and corrupted "
        "the worker's heap); torch.quasirandom keeps its engine on the host",
    ),
    ("miopen_", "a ROCm-only kernel (workers run CUDA or CPU)"),
    ("_mps_", "an MPS-only kernel (workers run CUDA or CPU)"),
    ("_lstm_mps", "an MPS-only kernel (workers run CUDA or CPU)"),
    ("lstm_mps_", "an MPS-only kernel (workers run CUDA or CPU)"),
    ("_scaled_dot_product_attention_math_for_mps", "an MPS-only kernel (workers run CUDA or CPU)"),
)

_FILE_ARGUMENTS = frozenset({"filename", "file", "path", "filepath"})
_STORAGE_TYPE = re.compile(r"\bStorage\b")
_STREAM_TYPE = re.compile(r"\bStream\b")


def base_name(name: str) -> str:
    """`aten::add.Tensor` → `add`."""
    return name.partition("::")[2].partition(".")[0]


def decide(op: OpInfo) -> Ruling:
    """The rules, in order; the first that matches decides."""
    base = base_name(op.name)
    overload = op.name.partition("::")[2].partition(".")[2]
    if not op.dispatcher:  # before the checks: `round.int` is a scalar op, not `round`
        return Ruling(
            Decision.REFUSE, "a TorchScript interpreter op (lists, strings, dicts), not a tensor op"
        )
    overload_check = CHECKED_OVERLOADS.get(op.name)
    if overload_check is not None:
        return Ruling(Decision.CHECK, overload_check)
    check = CHECKED.get(base)
    if check is not None and not (check in CHECKED_EXCEPT_OUT and overload.startswith("out")):
        return Ruling(Decision.CHECK, check)
    for prefix, name in CHECKED_PREFIXES:
        if base.startswith(prefix):
            return Ruling(Decision.CHECK, name)
    reason = REFUSED.get(base)
    if reason is not None:
        return Ruling(Decision.REFUSE, reason)
    for prefix, why in REFUSED_PREFIXES:
        if base.startswith(prefix):
            return Ruling(Decision.REFUSE, why)
    schema = op.schema or ""
    if _argument_names(schema) & _FILE_ARGUMENTS:
        return Ruling(Decision.REFUSE, "takes a file name")
    if _STORAGE_TYPE.search(schema):
        return Ruling(Decision.REFUSE, "takes a raw Storage (the client sends tensors only)")
    if _STREAM_TYPE.search(schema):
        return Ruling(Decision.REFUSE, "acts on the worker's CUDA streams")
    return Ruling(Decision.ALLOW)


def _argument_names(schema: str) -> set[str]:
    inside = schema.partition("(")[2].rpartition(") ->")[0]
    return {part.strip().split(" ")[-1].split("=")[0] for part in inside.split(",") if part.strip()}


# ---- registries and the table -----------------------------------------------------------------


def registry() -> dict[str, OpInfo]:
    """Every aten overload the running torch resolves: the dispatcher's and TorchScript's."""
    import torch

    dispatcher = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    ops: dict[str, OpInfo] = {}
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
        ops[name] = OpInfo(name, str(schema), name in dispatcher)
    for name in dispatcher - ops.keys():
        ops[name] = OpInfo(name, None, True)
    return ops


def dump(path: Path) -> None:
    """Write the running torch's registry (to generate the table on another machine)."""
    import torch

    body = {
        "torch": torch.__version__,
        "ops": {
            op.name: {"schema": op.schema, "dispatcher": op.dispatcher}
            for op in sorted(registry().values(), key=lambda o: o.name)
        },
    }
    path.write_text(json.dumps(body, indent=0, sort_keys=True) + "\n")


def load_registry(path: Path) -> tuple[str, dict[str, OpInfo]]:
    body = json.loads(path.read_text())
    ops = {
        name: OpInfo(name, entry.get("schema"), bool(entry.get("dispatcher")))
        for name, entry in body["ops"].items()
    }
    return str(body["torch"]), ops


def generate(registries: Iterable[tuple[str, dict[str, OpInfo]]]) -> dict[str, Any]:
    """The table for the union of registries: an op is a dispatcher op if any version says so."""
    versions: list[str] = []
    merged: dict[str, OpInfo] = {}
    for version, ops in registries:
        if version in versions:  # the running torch and its own stored registry: one version
            continue
        versions.append(version)
        for name, op in ops.items():
            seen = merged.get(name)
            if seen is None or (op.dispatcher and not seen.dispatcher):
                merged[name] = op
    return {
        "about": "Generated by `python -m gpupool.worker.oppolicy --write`; do not edit by hand.",
        "torch": sorted(versions),
        "ops": {name: decide(merged[name]).encode() for name in sorted(merged)},
    }


@cache
def table() -> dict[str, Ruling]:
    """The committed table (package data), read once per process."""
    body = json.loads(TABLE_PATH.read_text())
    return {name: Ruling.decode(text) for name, text in body["ops"].items()}


def table_versions() -> list[str]:
    return list(json.loads(TABLE_PATH.read_text())["torch"])


def ruling(name: str) -> Ruling:
    """What the worker does with an op a client DEFs; an undecided one is refused."""
    found = table().get(name)
    if found is not None:
        return found
    import torch

    return Ruling(
        Decision.REFUSE,
        f"undecided: gpupool's op policy has no decision for {name} (torch {torch.__version__});"
        " an operator adds one with `python -m gpupool.worker.oppolicy --write`",
    )


def undecided(ops: Iterable[str]) -> list[str]:
    """The overloads of `ops` the committed table does not decide."""
    decided = table()
    return sorted(name for name in ops if name not in decided)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpupool.worker.oppolicy", description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dump", type=Path, help="write the running torch's aten registry here")
    mode.add_argument("--write", action="store_true", help="regenerate oppolicy.json")
    mode.add_argument("--check", action="store_true", help="list overloads the table lacks")
    parser.add_argument(
        "--registry", type=Path, action="append", default=[],
        help="another torch's registry (--dump output); default: all in scripts/op_registries",
    )  # fmt: skip
    options = parser.parse_args(argv)
    if options.dump is not None:
        dump(options.dump)
        return 0
    if options.check:
        missing = undecided(registry())
        for name in missing:
            print(name)
        return 1 if missing else 0
    import torch

    paths = options.registry or sorted(REGISTRIES_DIR.glob("*.json"))
    registries = [(torch.__version__, registry()), *(load_registry(p) for p in paths)]
    body = generate(registries)
    TABLE_PATH.write_text(json.dumps(body, indent=0, sort_keys=True) + "\n")
    counts = {d.value: 0 for d in Decision}
    for text in body["ops"].values():
        counts[Ruling.decode(text).decision.value] += 1
    print(f"{TABLE_PATH.name}: {len(body['ops'])} overloads of torch {', '.join(body['torch'])}:")
    print(", ".join(f"{n} {word}" for word, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
