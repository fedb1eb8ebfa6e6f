"""PyTorch's OpInfo database run on a remote device against the same samples run locally.

Shared by the sampled CI sweep (tests/torch/test_opinfo_sweep.py) and the whole-database
benchmark (bench/opinfo_sweep.py). Three passes: fp32 forward, bf16 forward, fp32 backward.
Only the dtypes CUDA supports for an op are tried (`OpInfo.supported_dtypes("cuda")`). Every
sample ends as one of:

- `pass`: the remote values (read back with `.cpu()`) equal the local ones, within the dtype's
  default tolerance, with the same shapes, dtypes and conjugate / negative bits;
- `mismatch`: the remote op ran and its result differs: a silent wrong value, the worst case;
- `error`: the remote op raised (the local one did not);
- `skip`: the local op raised, or (backward) the sample has nothing to differentiate;
- `device_semantics`: the remote result has the metadata PyTorch's meta kernels give (the
  contract of CUDA, the device a remote tensor is) where the CPU kernel's differs (batch norm's
  saved statistics), or the op's Python code takes CUDA's branch (CUDA_CODE_PATH): listed
  apart with the difference, counted neither way.

Ops whose values are random or uninitialised (`empty`, `bernoulli`, dropout, ...) are compared
by metadata only: a run of the local op twice tells those apart, plus a list of the ones whose
uninitialised memory happens to repeat.
"""

from __future__ import annotations

import pickle
import re
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

PASSES = ("fp32_forward", "bf16_forward", "fp32_backward")
CUDA_CODE_PATH = frozenset({"nn.functional.linear_cross_entropy"})
"""Ops whose Python implementation branches on `device.type == "cuda"` (accumulation dtypes
in torch/nn/modules/linear_cross_entropy.py): a remote tensor takes CUDA's branch, the local
CPU reference the CPU's, so their values may differ as a real GPU's would. Listed apart."""
UNINITIALISED = frozenset(
    {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
)
UNINITIALISED_OUTPUTS = {"torch.ops.aten._efficient_attention_forward": (2, 3)}
"""Outputs that hold no values of the op: the efficient attention kernel's philox seed and
offset are host scalars it leaves as `at::empty` made them when it draws no dropout (a
worker's are zeros, its host allocations being zero-filled; a local run's are what the
allocator had there), and the generator's state when it does."""


def _without_uninitialised(name: str, value: Any) -> Any:
    positions = UNINITIALISED_OUTPUTS.get(name)
    if not positions or not isinstance(value, list | tuple):
        return value
    return type(value)(None if i in positions else v for i, v in enumerate(value))


@dataclass
class Outcome:
    op: str
    sample: int
    result: str  # pass | mismatch | error | skip | device_semantics
    cause: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, result: str) -> int:
        return sum(1 for o in self.outcomes if o.result == result)

    @property
    def tried(self) -> int:
        return sum(1 for o in self.outcomes if o.result not in ("skip", "device_semantics"))

    @property
    def pass_pct(self) -> float:
        return 100.0 * self.count("pass") / self.tried if self.tried else 100.0

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result in ("mismatch", "error")]

    def causes(self) -> list[tuple[str, int]]:
        """Failures grouped by their message with numbers and names of shapes blotted out."""
        counter = Counter(_normalise(o) for o in self.failures())
        return counter.most_common()

    def summary(self) -> dict[str, Any]:
        return {
            "samples": len(self.outcomes),
            "tried": self.tried,
            "passed": self.count("pass"),
            "mismatches": self.count("mismatch"),
            "errors": self.count("error"),
            "skipped": self.count("skip"),
            "device_semantics": [
                f"{o.op}[{o.sample}]: {o.cause}"
                for o in self.outcomes
                if o.result == "device_semantics"
            ],
            "pass_pct": round(self.pass_pct, 3),
            "causes": [{"cause": c, "samples": n} for c, n in self.causes()],
            "failures": [
                {"op": o.op, "sample": o.sample, "result": o.result, "cause": o.cause}
                for o in self.failures()
            ],
            "skips": sorted(
                {f"{o.op}: {o.cause[:160]}" for o in self.outcomes if o.result == "skip"}
            ),
        }


def _normalise(outcome: Outcome) -> str:
    text = re.sub(r"\d+", "N", outcome.cause)
    return f"{outcome.result}: {text[:160]}"


def op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db as database

    return list(database)


def full_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def sampled(ops: list[Any], every: int) -> list[Any]:
    """A deterministic subset: the ops whose name hashes to 0 modulo `every`."""
    return [op for op in ops if zlib.crc32(full_name(op).encode()) % every == 0]


def applies(op: Any, which: str) -> bool:
    dtype = torch.bfloat16 if which == "bf16_forward" else torch.float32
    if which == "fp32_backward":
        return bool(op.supports_autograd) and dtype in op.supported_backward_dtypes("cuda")
    return dtype in op.supported_dtypes("cuda")


def samples(op: Any, which: str, per_op: int) -> Iterator[Any]:
    """The op's samples made for `cuda`, as PyTorch's CUDA tests make them (the tensors an op
    wants on the host, tensor_split's indices, stay there): the local run gets host copies."""
    dtype = torch.bfloat16 if which == "bf16_forward" else torch.float32
    backward = which == "fp32_backward"
    torch.manual_seed(0)
    for i, sample in enumerate(op.sample_inputs("cuda", dtype, requires_grad=backward)):
        if i >= per_op:
            return
        yield sample


def run_op(
    op: Any, which: str, per_op: int, tally: Tally, on_lost: Callable[[], None] | None = None
) -> None:
    name = full_name(op)
    index = 0
    try:
        for index, sample in enumerate(samples(op, which, per_op)):
            outcome = run_sample(op, sample, which == "fp32_backward")
            outcome.op, outcome.sample = name, index
            tally.outcomes.append(outcome)
            if "WorkerLost" in outcome.cause and on_lost is not None:
                on_lost()
    except Exception as exc:  # making the samples on the remote device failed
        tally.outcomes.append(Outcome(name, index, "error", f"sample_inputs: {_describe(exc)}"))
        if "WorkerLost" in type(exc).__name__ and on_lost is not None:
            on_lost()


def run_sample(op: Any, sample: Any, backward: bool) -> Outcome:
    try:
        expected = _local(op, sample, backward)
    except Exception as exc:
        return Outcome("", 0, "skip", f"local op raised {_describe(exc)}")
    if expected is None:
        return Outcome("", 0, "skip", "nothing to differentiate")
    random = _values_random(op, sample, backward, expected)
    try:
        actual = _remote(op, sample, backward)
    except Exception as exc:
        return Outcome("", 0, "error", _describe(exc))
    problem = _compare(actual, expected, metadata_only=random)
    metadata = (
        problem.split(": ", 1)[0].split("] ")[-1] in ("shape", "dtype")
        or " shape " in problem
        or " dtype " in problem
    )
    if problem and op.name in CUDA_CODE_PATH:
        return Outcome("", 0, "device_semantics", f"CUDA's code path: {problem}")
    if problem and metadata and not backward and _cuda_contract(op, sample, actual):
        return Outcome("", 0, "device_semantics", problem)
    if problem:
        return Outcome("", 0, "mismatch", problem)
    return Outcome("", 0, "pass")


def _cuda_contract(op: Any, sample: Any, actual: Any) -> bool:
    """Whether the remote result has the metadata PyTorch's meta kernels (CUDA's contract)
    give where the local CPU kernel differs: batch and layer norm's saved statistics are float32
    on CUDA and bf16 on the CPU, empty in CPU eval mode. A CPU worker cannot be both."""

    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    try:
        reference = _call(op, sample, meta)[0]
    except Exception:
        return False
    got = [(r.shape, r.dtype) for r in _flat(actual) if isinstance(r, _Read)]
    want = [(tuple(t.shape), t.dtype) for t in _tensors(reference)]
    return bool(got) and got == want


def _flat(value: Any) -> list[Any]:
    if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
        return [x for v in value for x in _flat(v)]
    return [value]


def _describe(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    place = f" [{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]" if where else ""
    return f"{type(exc).__name__}: {(lines[0] if lines else '')[:200]}{place}"


def _values_random(op: Any, sample: Any, backward: bool, expected: Any) -> bool:
    if op.name in UNINITIALISED:
        return True
    try:
        again = _local(op, sample, backward)
    except Exception:
        return True
    return bool(_compare(again, expected, metadata_only=False))


# ---- running a sample -------------------------------------------------------------------------


def _call(op: Any, sample: Any, convert: Callable[[Any], Any]) -> tuple[Any, Any]:
    memo: dict[int, Any] = {}
    inputs = convert_tree(sample.input, convert, memo)
    args = convert_tree(sample.args, convert, memo)
    kwargs = {k: convert_tree(v, convert, memo) for k, v in sample.kwargs.items()}
    out = op(inputs, *args, **kwargs)
    return out, (inputs, args, kwargs)


def convert_tree(value: Any, convert: Callable[[Any], Any], memo: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = convert(value)
        return memo[id(value)]
    if convert is to_local and (isinstance(value, torch.device) or value == "cuda"):
        return _local_device(value)
    if isinstance(value, list):
        return [convert_tree(v, convert, memo) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(convert_tree(v, convert, memo) for v in value)
    if isinstance(value, dict):
        return {k: convert_tree(v, convert, memo) for k, v in value.items()}
    return value


def _local_device(device: Any) -> Any:
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    return torch.device("cpu") if device.type == "cuda" else device


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a sample's tensor (a new leaf with the same requires_grad). A view of a
    contiguous base is copied as that view of a copy of its base: ops such as as_strided read
    the storage around a view."""
    base = tensor._base
    if base is not None and base.is_contiguous() and base.storage_offset() == 0:
        storage = base.detach().cpu().clone()
        copy = storage.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
        copy = copy.detach()
    else:
        copy = tensor.detach().cpu().clone()
    if tensor.requires_grad:
        copy.requires_grad_(True)
    return copy


def to_remote(tensor: torch.Tensor) -> torch.Tensor:
    """The sample's own tensor (remote, or kept on the host on purpose), as a new leaf."""
    fresh = tensor.detach()
    if tensor.device.type != "cuda":
        fresh = fresh.clone()
    if tensor.requires_grad:
        fresh.requires_grad_(True)
    return fresh


def _local(op: Any, sample: Any, backward: bool) -> Any:
    return _run(op, sample, backward, to_local)


def _remote(op: Any, sample: Any, backward: bool) -> Any:
    result = _run(op, sample, backward, to_remote)
    return to_host(result)


def _run(op: Any, sample: Any, backward: bool, convert: Callable[[Any], Any]) -> Any:
    torch.manual_seed(0)
    out, (inputs, args, kwargs) = _call(op, sample, convert)
    if not backward:
        return out
    leaves = [t for t in _tensors((inputs, args, kwargs)) if t.requires_grad and t.is_leaf]
    outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
    if not leaves or not outs:
        return None
    generator = torch.Generator().manual_seed(1)
    grads_out = []
    for t in outs:
        host = torch.randn(t.shape, generator=generator, dtype=torch.float64)
        grads_out.append(_like(host, t, convert))
    return torch.autograd.grad(outs, leaves, grads_out, allow_unused=True)


def _like(host: torch.Tensor, target: torch.Tensor, convert: Callable[[Any], Any]) -> torch.Tensor:
    if target.is_complex():
        host = torch.complex(host, host.flip(-1) if host.dim() else host)
    return host.to(target.dtype).to(target.device)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Read(value)
    if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
        return (
            type(value)(to_host(v) for v in value)
            if isinstance(value, list)
            else tuple(to_host(v) for v in value)
        )
    return value


class _Read:
    """A remote result as the program sees it: its metadata as reported, its values read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.is_conj = tensor.is_conj()
        self.is_neg = tensor.is_neg()
        self.device = tensor.device
        self.values = tensor.detach().cpu()


# ---- comparing ---------------------------------------------------------------------------------


def _compare(actual: Any, expected: Any, metadata_only: bool) -> str:
    if isinstance(expected, torch.Tensor):
        if isinstance(actual, _Read):
            return _compare_tensor(actual, expected, metadata_only)
        if isinstance(actual, torch.Tensor):
            actual = _Read(actual)
            return _compare_tensor(actual, expected, metadata_only)
        return f"expected a tensor, got {type(actual).__name__}"
    if isinstance(expected, list | tuple) and not isinstance(expected, torch.Size):
        if not isinstance(actual, list | tuple) or len(actual) != len(expected):
            return f"expected a sequence of {len(expected)}, got {type(actual).__name__}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            problem = _compare(a, e, metadata_only)
            if problem:
                return f"[{i}] {problem}"
        return ""
    if expected is None:
        return "" if actual is None else f"expected None, got {type(actual).__name__}"
    if isinstance(expected, float) and isinstance(actual, float):
        if expected != expected and actual != actual:
            return ""
        return (
            ""
            if abs(expected - actual) <= 1e-5 + 1e-5 * abs(expected)
            else f"{actual} != {expected}"
        )
    if metadata_only:
        return "" if type(actual) is type(expected) else f"{type(actual)} != {type(expected)}"
    return "" if actual == expected else f"{actual!r:.80} != {expected!r:.80}"


def _compare_tensor(actual: _Read, expected: torch.Tensor, metadata_only: bool) -> str:
    if actual.shape != tuple(expected.shape):
        return f"shape {actual.shape} != {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if actual.is_conj != expected.is_conj():
        return f"is_conj() {actual.is_conj} != {expected.is_conj()}"
    if actual.is_neg != expected.is_neg():
        return f"is_neg() {actual.is_neg} != {expected.is_neg()}"
    if metadata_only:
        return ""
    try:
        torch.testing.assert_close(
            actual.values, expected.detach(), equal_nan=True, check_device=False,
            check_stride=False, check_layout=False,
        )  # fmt: skip
    except AssertionError as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        return f"values differ: {first[:160]}"
    return ""


# ---- against a local GPU: recorded through the pool, replayed on the GPU -----------------------
#
# A pool client has no GPU, so a CUDA worker's results cannot be judged against a local GPU in
# one process. `record_op` runs each sample remotely and keeps, with the result as read back,
# a host copy of the sample made before the op ran; `replay_op`, in a process that has the
# GPU, runs the same sample there and judges the recorded result against it. Both seed the
# RNG the same way before the op (`_run`), so random ops are compared value for value: the
# worker's CUDA generator must give what the local one gives. No CPU-reference exemption
# applies (the reference is CUDA too).


@dataclass
class HostTensor:
    """A sample's tensor copied to the host for a replay, and whether the sample had it on
    the device (the replay puts it on its GPU) or on the host on purpose."""

    value: torch.Tensor
    on_device: bool


def _to_record(tensor: torch.Tensor) -> HostTensor:
    return HostTensor(to_local(tensor), tensor.device.type == "cuda")


def _portable(value: Any) -> Any:
    """A remote result with its device as a string: the replay's process has no pool."""
    if isinstance(value, _Read):
        value.device = str(value.device)  # type: ignore[assignment]
    elif isinstance(value, list | tuple):
        for item in value:
            _portable(item)
    return value


def record_op(op: Any, which: str, per_op: int) -> dict[str, Any]:
    """Every sample of `op` for `which`: its host copy, the remote result read back or the
    remote error. A failure to make the samples is recorded as the op's own error."""
    backward = which == "fp32_backward"
    records: list[dict[str, Any]] = []
    entry: dict[str, Any] = {"op": full_name(op), "which": which, "samples": records}
    try:
        for sample in samples(op, which, per_op):
            memo: dict[int, Any] = {}
            stored = (
                convert_tree(sample.input, _to_record, memo),
                convert_tree(sample.args, _to_record, memo),
                {k: convert_tree(v, _to_record, memo) for k, v in sample.kwargs.items()},
            )
            try:
                actual, error = _portable(_remote(op, sample, backward)), None
            except Exception as exc:
                actual, error = None, _describe(exc)
            records.append({"sample": stored, "actual": actual, "error": error})
    except Exception as exc:
        entry["error"] = f"sample_inputs: {_describe(exc)}"
    try:  # a sample may hold what no file can (a module, a lambda): judged by no replay
        pickle.dumps(entry)
    except Exception as exc:
        return {"op": entry["op"], "which": which, "samples": [],
                "skip": f"the sample cannot be recorded: {_describe(exc)}"}  # fmt: skip
    return entry


def _from_record(value: Any, device: str, memo: dict[int, Any]) -> Any:
    if isinstance(value, HostTensor):
        if id(value) not in memo:
            memo[id(value)] = _on_device(value, device)
        return memo[id(value)]
    if isinstance(value, list):
        return [_from_record(v, device, memo) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(_from_record(v, device, memo) for v in value)
    if isinstance(value, dict):
        return {k: _from_record(v, device, memo) for k, v in value.items()}
    return value


def _on_device(host: HostTensor, device: str) -> torch.Tensor:
    """The recorded tensor where the sample had it; a view of a copied base stays that view."""
    tensor = host.value
    if not host.on_device:
        copy = tensor.detach().clone()
    else:  # the whole storage, which a loaded file keeps while its views forget their base
        elements = tensor.untyped_storage().nbytes() // tensor.element_size()
        flat = torch.empty(0, dtype=tensor.dtype).set_(
            tensor.untyped_storage(), 0, (elements,), (1,)
        )
        copy = flat.to(device, copy=True).as_strided(
            tensor.shape, tensor.stride(), tensor.storage_offset()
        )
    return copy.detach().requires_grad_(tensor.requires_grad)


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A replayed sample's tensor as a new leaf; each run rebuilds the sample, so no copy."""
    fresh = tensor.detach()
    return fresh.requires_grad_(True) if tensor.requires_grad else fresh


def _replayed(stored: Any, device: str) -> Any:
    from types import SimpleNamespace

    memo: dict[int, Any] = {}
    inputs, args, kwargs = (_from_record(part, device, memo) for part in stored)
    return SimpleNamespace(input=inputs, args=args, kwargs=kwargs)


def replay_op(op: Any, entry: dict[str, Any], tally: Tally, device: str = "cuda") -> None:
    """Judge `entry` (record_op's) against the same samples run on `device`."""
    name = entry["op"]
    if "skip" in entry:
        tally.outcomes.append(Outcome(name, 0, "skip", entry["skip"]))
        return
    if "error" in entry and not entry["samples"]:
        tally.outcomes.append(Outcome(name, 0, "error", entry["error"]))
        return
    backward = entry["which"] == "fp32_backward"
    for index, record in enumerate(entry["samples"]):
        outcome = _judge_replay(op, record, backward, device)
        outcome.op, outcome.sample = name, index
        tally.outcomes.append(outcome)
    if "error" in entry:  # the samples stopped coming part of the way
        tally.outcomes.append(Outcome(name, len(entry["samples"]), "error", entry["error"]))


def _judge_replay(op: Any, record: dict[str, Any], backward: bool, device: str) -> Outcome:
    try:
        expected = _run(op, _replayed(record["sample"], device), backward, _leaf)
    except Exception as exc:
        return Outcome("", 0, "skip", f"local op raised {_describe(exc)}")
    if expected is None:
        return Outcome("", 0, "skip", "nothing to differentiate")
    if record["error"] is not None:
        return Outcome("", 0, "error", record["error"])
    random = op.name in UNINITIALISED
    if not random:
        try:
            again = _run(op, _replayed(record["sample"], device), backward, _leaf)
            random = bool(_compare(again, expected, metadata_only=False))
        except Exception:
            random = True
    problem = _compare(
        _without_uninitialised(op.name, record["actual"]),
        _without_uninitialised(op.name, expected),
        metadata_only=random,
    )
    return Outcome("", 0, "mismatch", problem) if problem else Outcome("", 0, "pass")
