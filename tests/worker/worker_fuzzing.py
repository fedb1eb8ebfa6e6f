"""An op fuzzer for the worker: random aten overloads with adversarial arguments, sent as raw
data-plane frames by a hostile client, against real worker processes that hold planted secrets.

Used by tests/worker/test_worker_fuzz.py (a short, fixed-seed run in CI) and by
bench/worker_fuzz.py (minutes of it, with the numbers written to bench/results/).

What it sets up, on loopback:
- the *fuzzed* worker (lease A), started as an agent starts one, but through a launcher that
  plants secrets first: `GPUPOOL_TOKEN=<secret>` in its environment (the agent's controller
  token, which is what leaked before) and a second secret in its heap, in torch tensors and a
  Python object no handle points to, sprinkled between holes the client's small tensors later
  fill (with one malloc arena for all threads), so that a read a little past a client's tensor
  meets it;
- a *victim* worker of another lease (B) on the same host, whose own client (the harness)
  holds a tensor filled with a third secret.

What it drives: sessions of ops chosen from every aten overload of the worker's torch
(weighted to those taking indices, offsets, sizes and strides, and to unchecked and sparse
variants), with arguments built from their schemas: huge and negative ints, extreme strides,
out-of-range index tensors, wrong dtypes, empty and giant shapes, the same tensor for several
arguments, views of views. Each op's outputs are READ back.

What it checks after every op: no reply of the fuzzed worker holds any secret's bytes (raw,
hex, decimal text, and as int8/uint8/float views of them, at every alignment), nor a word that
is an address inside the fuzzed worker's own memory map; the fuzzed worker is alive and
answers a SYNC; the victim's tensor still holds its values and its worker answers.

Everything is decided by the seed (a session's ops depend on the seed and the session's number
only, never on replies), so a finding names the seed and session that replay it, and carries
the records sent. The fuzzed worker runs under an address-space cap, a file-size cap, in an
empty scratch directory, nice'd, with a timeout on every reply: it cannot fill this machine's
memory or disk, and a hang ends in a kill and a finding.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import random
import re
import resource
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from gpupool.protocol.v1.dataplane import (
    BATCH_MAX_RECORDS,
    TOKEN_ENV,
    VERSION,
    ErrorKind,
    Ext,
    Kind,
    Rec,
    connect,
    pack,
    pack_records,
    parse_address,
    parse_ready,
    worker_argv,
)
from gpupool.protocol.v1.tensors import DTYPES, op_overload
from tests.timing import scaled
from tests.worker.raw_frames import HEADER, framed
from tests.worker.raw_frames import tensor as tensor_ext

ENV_SECRET_VAR = "GPUPOOL_TOKEN"
"""The variable whose value (the agent's controller token) a worker once leaked."""
HEAP_SECRET_VAR = "GPUPOOL_FUZZ_HEAP_SECRET"
"""How the launcher learns the secret it plants in the worker's heap (hex)."""
MiB = 1 << 20

LAUNCHER = r"""
import faulthandler, os, sys
faulthandler.enable()  # a crash writes the dying thread's Python stack to the log
secret = bytes.fromhex(os.environ.pop("GPUPOOL_FUZZ_HEAP_SECRET"))
import torch
# The heap secret, where no handle points: small tensors (malloc's heap, next to the client's
# small tensors), a large one (its own mapping, next to large tensors), and a Python object.
PLANTED = [
    torch.frombuffer(bytearray(secret * (size // len(secret))), dtype=torch.uint8).clone()
    for size in (256, 4096, 65536, 1 << 20)
]
PLANTED.append(bytes(secret * 64))
# Sprinkled through the heap, between holes that the client's small tensors will fill: a read
# a little past a client's tensor meets the secret (the heap layout a patient attacker grooms).
holes = []
for i in range(2048):
    PLANTED.append(torch.frombuffer(bytearray(secret * 8), dtype=torch.uint8).clone())
    holes.append(torch.empty(64 + (i % 8) * 64, dtype=torch.uint8))
del holes
from gpupool.worker.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


# ---- the secrets and what they look like on the wire ------------------------------------------


@dataclass(frozen=True)
class Secrets:
    env_token: str
    """In the fuzzed worker's environment as GPUPOOL_TOKEN (an API token's format)."""
    heap: bytes
    """In the fuzzed worker's heap, in tensors and an object no handle reaches."""
    other: bytes
    """In a tensor of the other lease's worker."""

    @classmethod
    def from_seed(cls, seed: int) -> Secrets:
        """Per seed, so a replay plants the same bytes (and a leak reproduces byte for byte)."""
        rng = random.Random(f"secrets-{seed}")
        alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"
        token = "gpp_" + "".join(rng.choice("0123456789abcdef") for _ in range(12)) + "_"
        token += "".join(rng.choice(alphabet) for _ in range(43))
        return cls(token, rng.randbytes(32), rng.randbytes(32))

    def needles(self) -> list[tuple[str, bytes]]:
        return [
            *needles_of("env token", self.env_token.encode()),
            *needles_of("heap secret", self.heap),
            *needles_of("other lease's secret", self.other),
        ]


WINDOW = 12
"""Bytes of a secret a needle covers: long enough that random data never matches (2^-96)."""


def needles_of(label: str, secret: bytes) -> list[tuple[str, bytes]]:
    """What `secret` looks like in a reply: its raw bytes, as hex and decimal text, each byte
    as a number of a wider dtype (an op that read it as uint8 or int8 and cast), and its words
    read as int16/32/64 or float32/64 (at every alignment) cast to another dtype. Windows of
    WINDOW bytes, so a reply that holds only part of a secret is still caught."""
    out: list[tuple[str, bytes]] = []
    starts = range(0, max(1, len(secret) - WINDOW + 1), WINDOW // 2)
    for start in starts:
        window = secret[start : start + WINDOW]
        out.append((f"{label} (raw bytes)", window))
        out.append((f"{label} (hex)", window.hex().encode()))
        for src in (np.uint8, np.int8):
            values = np.frombuffer(window, dtype=src)
            for dst in (np.int16, np.int32, np.int64, np.float16, np.float32, np.float64):
                out.append(
                    (f"{label} ({src.__name__} as {dst.__name__})", values.astype(dst).tobytes())
                )
            as_bf16 = torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
            out.append(
                (
                    f"{label} ({src.__name__} as bfloat16)",
                    as_bf16.view(torch.int16).numpy().tobytes(),
                )
            )
            head = [int(v) for v in values[:8]]
            out.append((f"{label} ({src.__name__} as text)", ", ".join(map(str, head)).encode()))
            out.append(
                (
                    f"{label} ({src.__name__} as float text)",
                    ", ".join(f"{v}." for v in head).encode(),
                )
            )
    for word, targets in (
        (np.int16, (np.int32, np.int64, np.float32, np.float64)),
        (np.int32, (np.int64, np.float32, np.float64)),
        (np.int64, (np.float64,)),
        (np.float32, (np.float64,)),
    ):
        size = np.dtype(word).itemsize
        for shift in range(size):
            usable = (len(secret) - shift) // size * size
            words = np.frombuffer(secret[shift : shift + usable], dtype=word)[
                : max(2, WINDOW // size)
            ]
            if len(words) < 2 or not np.all(np.isfinite(words.astype(np.float64))):
                continue
            for dst in targets:
                converted = words.astype(dst)
                if np.all(np.isfinite(converted.astype(np.float64))) and np.count_nonzero(
                    converted
                ) == len(converted):
                    out.append(
                        (f"{label} ({word.__name__} words as {dst.__name__})", converted.tobytes())
                    )
    return out


def addresses_in(data: bytes, ranges: np.ndarray) -> np.ndarray:
    """The aligned 64-bit words of `data` that point into one of `ranges` ([start, end) rows):
    a heap, stack or library address of the worker, which a tensor's values never are (user
    space ends at 2^47; random data hits a mapping with odds of about 2^-32 a word). A word
    whose low half is below 2^16 as well is two small int32 values side by side (an int32
    `range` over 32,660 made 0x7f95_00007f94, inside a mapping): not counted, which misses a
    real address with odds of 2^-16 a word (a leak of pointers leaks many)."""
    words = np.frombuffer(data[: len(data) // 8 * 8], dtype=np.uint64)
    words = words[(words > 0x10000) & (words < np.uint64(1 << 47))]
    words = words[(words & np.uint64(0xFFFFFFFF)) >= 0x10000]
    if not len(words) or not len(ranges):
        return words[:0]
    slot = np.searchsorted(ranges[:, 0], words, side="right") - 1
    inside = (slot >= 0) & (words < ranges[np.maximum(slot, 0), 1])
    return words[inside]


def find_secret(data: bytes, needles: list[tuple[str, bytes]]) -> str | None:
    for label, needle in needles:
        if needle and needle in data:
            return label
    return None


# ---- worker processes -------------------------------------------------------------------------


@dataclass
class FuzzWorker:
    lease: str
    token: str
    proc: subprocess.Popen[str]
    address: str
    log: Path
    scratch: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def crash_log(self) -> str:
        """What the log says of the worker's death: from just before faulthandler's last report
        (the C library's abort message comes first) to the dying thread's stack."""
        text = self.log_tail(200_000)
        at = text.rfind("Fatal Python error")
        return text[-1500:] if at < 0 else text[max(0, at - 300) : at + 1200]

    def tracebacks(self) -> str:
        text = self.log_tail(200_000)
        return text if ("Traceback" in text or "Exception in thread" in text) else ""

    def address_ranges(self) -> np.ndarray:
        """[start, end) of every mapping of the worker's address space that holds anything
        (its /proc maps). Reservations without access (`---p`) are left out: a CUDA build
        reserves gigabytes of them low in the address space, where two float32 values side by
        side (24.0 and 0.0 make 0x41c00000) landed on the H200 machine; nothing is readable
        there, so a word pointing in is no pointer the worker holds."""
        ranges: list[tuple[int, int]] = []
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/maps").read_text().splitlines():
                span, _, rest = line.partition(" ")
                if rest.startswith("---"):
                    continue
                low, _, high = span.partition("-")
                ranges.append((int(low, 16), int(high, 16)))
        return np.array(sorted(ranges), dtype=np.uint64).reshape(-1, 2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=scaled(10))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass(frozen=True)
class Guard:
    """What keeps a fuzzed worker from harming the machine it runs on."""

    address_space_mib: int = 2048 if torch.version.cuda is None else 16384
    """RLIMIT_AS: an allocation past it fails inside the op. A CPU build's worker maps ~600 MiB
    idle; a CUDA build maps its CUDA libraries too, whatever device the worker uses (2 GiB
    failed with "libtorch_cpu.so: failed to map segment" on the GPU machine's torch)."""
    file_size_mib: int = 16
    """RLIMIT_FSIZE: its log may grow, nothing may write a large file."""
    nice: int = 10
    memory_limit_mib: int = 64
    """The lease's own limit (--memory-limit-mib)."""
    reply_timeout_s: float = 20.0
    """How long one case may take before the worker counts as hung (and is killed)."""


def _limits(guard: Guard) -> Callable[[], None]:
    def apply() -> None:
        as_bytes = guard.address_space_mib * MiB
        resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
        fsize = guard.file_size_mib * MiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def launch_worker(
    lease: str, token: str, heap_secret: bytes, env_secret: str, root: Path, guard: Guard
) -> Launched:
    """A worker as its agent starts one (stdout a pipe nobody reads after the ready line, the
    lease token in TOKEN_ENV), through LAUNCHER, with the secrets planted and the guards on."""
    scratch = root / f"{lease}-cwd"
    scratch.mkdir(parents=True, exist_ok=True)
    log = root / f"{lease}.log"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        # One malloc arena for all threads: the client's tensors (made on the connection's
        # thread) then live in the heap that holds the planted secret, within reach of a read
        # past them. The worst layout for the worker; the checks must hold for any layout.
        "MALLOC_ARENA_MAX": "1",
        ENV_SECRET_VAR: env_secret,
        HEAP_SECRET_VAR: heap_secret.hex(),
        TOKEN_ENV: token,
    }
    argv = worker_argv(lease, memory_limit_mib=guard.memory_limit_mib, threads=1)
    assert argv[1:3] == ["-m", "gpupool.worker"]
    argv = [argv[0], "-c", LAUNCHER, *argv[3:]]
    with log.open("a") as err:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=scratch,
            preexec_fn=_limits(guard),
        )  # fmt: skip
    return Launched(lease, token, proc, log, scratch, guard.nice)


@dataclass
class Launched:
    """A worker started but not yet ready: several start at once (each imports torch)."""

    lease: str
    token: str
    proc: subprocess.Popen[str]
    log: Path
    scratch: Path
    nice: int

    def ready(self) -> FuzzWorker:
        """Once it serves, the worker yields the CPU to everything else on the machine (it
        starts at full priority: importing torch is most of a start, on a busy host)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(
                f"worker {self.lease} exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
            )
        ready = parse_ready(line)
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(
                os.PRIO_PROCESS, self.proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + self.nice
            )
        return FuzzWorker(
            self.lease, self.token, self.proc, str(ready.address), self.log, self.scratch
        )


# ---- a hostile client: raw frames, every byte of every reply kept -----------------------------


class Closed(Exception):
    """The worker closed the connection."""


@dataclass
class Reply:
    head: list[Any]
    tail: bytes
    raw: bytes


class Wire:
    """One client connection, spoken frame by frame as a hostile client would."""

    def __init__(self, worker: FuzzWorker, timeout_s: float) -> None:
        deadline = time.monotonic() + scaled(10)
        while True:
            self.sock = connect(parse_address(worker.address))
            self.sock.settimeout(timeout_s)
            hello = {"v": VERSION, "lease": worker.lease, "token": worker.token, "shm": False}
            self.sock.sendall(framed(pack([Kind.HELLO, hello])))
            head = self.recv().head
            if head[0] == Kind.WELCOME:
                return
            self.sock.close()
            busy = head[0] == Kind.ERROR and head[2]["kind"] == ErrorKind.BUSY
            if not busy or time.monotonic() > deadline:  # BUSY: the last session still ends
                raise RuntimeError(f"the worker refused the harness's client: {head!r:.300}")

    def send(self, records: list[Any]) -> None:
        self.sock.sendall(framed(pack_records([Kind.BATCH], records)))

    def _exact(self, n: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            try:
                data = self.sock.recv(min(n - len(chunks), 8 * MiB))
            except ConnectionResetError:
                data = b""
            if not data:
                raise Closed
            chunks += data
        return bytes(chunks)

    def recv(self) -> Reply:
        header = self._exact(HEADER.size)
        body_len, tail_len = HEADER.unpack(header)
        body = self._exact(body_len)
        tail = self._exact(tail_len) if tail_len else b""
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(body)
        return Reply(unpacker.unpack(), tail, header + body + tail)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def dtype_ext(name: str) -> msgpack.ExtType:
    return msgpack.ExtType(Ext.DTYPE, name.encode())


DEVICE = msgpack.ExtType(Ext.DEVICE, b"")
HOST = msgpack.ExtType(Ext.DEVICE, b"cpu")
SPARSE_COO = msgpack.ExtType(Ext.LAYOUT, b"sparse_coo")


def literal(values: torch.Tensor) -> msgpack.ExtType:
    name = next(n for n, d in DTYPES.items() if d == values.dtype)
    raw = (
        values.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if values.numel()
        else b""
    )
    return msgpack.ExtType(Ext.LITERAL, pack([name, list(values.shape), raw]))


# ---- the op table -----------------------------------------------------------------------------

ARG_TYPES_WE_BUILD = re.compile(
    r"^(Optional\[)?(Tensor|int|SymInt|float|bool|str|number|complex|ScalarType|Layout|MemoryFormat|"
    r"Device|Generator|Dimname|List\[(Optional\[Tensor\]|Tensor|int|SymInt|float|bool|number|Dimname)\])\]?$"
)
RISKY_ARG_NAMES = frozenset(
    [
        "index",
        "indices",
        "offsets",
        "offset",
        "storage_offset",
        "stride",
        "strides",
        "size",
        "sizes",
        "lengths",
        "indptr",
        "crow_indices",
        "col_indices",
        "ccol_indices",
        "row_indices",
        "compressed_indices",
        "plain_indices",
        "start",
        "end",
        "step",
        "dim",
        "dims",
        "source",
        "src",
        "idx",
        "padding_idx",
        "output_size",
        "num_classes",
        "minlength",
        "batch_sizes",
        "unsafe",
        "segment_ids",
        "splits",
        "split_size",
        "split_sizes",
        "repeats",
        "chunks",
        "shifts",
        "length",
        "pos",
        "seq_lens",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
    ]
)
RISKY_NAME_PARTS = (
    "unsafe", "sparse", "strided", "set_", "resize", "index", "gather", "scatter", "embedding",
    "segment", "take", "put", "narrow", "select", "slice", "unfold", "view", "nested", "coo",
    "csr", "csc", "bsr", "compressed", "bincount", "histc", "unique", "repeat_interleave",
    "_copy", "storage", "offset", "split", "masked", "roll", "pad", "unpool", "ctc",
)  # fmt: skip
FILE_ARG_NAMES = frozenset({"filename", "path", "file", "f"})


@dataclass(frozen=True)
class OpSpec:
    name: str
    schema: Any
    weight: float
    tensor_outs: tuple[bool, ...] | None
    """Which returns are tensors, for the handles an OP record names (None where a return is a
    list: the op goes as a CALL, which numbers its outputs itself)."""


def _returns(schema: Any) -> tuple[bool, ...] | None:
    kinds = [str(ret.type) for ret in schema.returns]
    if any("List" in kind for kind in kinds):
        return None
    return tuple(kind.endswith("Tensor") for kind in kinds)


def op_table() -> list[OpSpec]:
    """Every aten overload of this torch whose arguments the fuzzer can build, with its weight.
    Ops that name files are left out: the fuzzer never points anything at paths."""
    table: list[OpSpec] = []
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        if schema.name == "aten::from_file" or any(
            a.name in FILE_ARG_NAMES for a in schema.arguments
        ):
            continue
        if not all(ARG_TYPES_WE_BUILD.match(str(a.real_type)) for a in schema.arguments):
            continue
        try:
            if not isinstance(op_overload(name), torch._ops.OpOverload):
                continue
        except (AttributeError, RuntimeError):
            continue
        weight = 1.0
        if any(a.name in RISKY_ARG_NAMES for a in schema.arguments):
            weight += 4.0
        if any(part in schema.name for part in RISKY_NAME_PARTS):
            weight += 4.0
        if not any(
            str(a.real_type).endswith("Tensor") or "Tensor" in str(a.real_type)
            for a in schema.arguments
        ):
            weight *= 0.3  # factories: a few suffice to try giant and negative sizes
        if any("Dimname" in str(a.real_type) for a in schema.arguments):
            weight *= 0.1
        table.append(OpSpec(name, schema, weight, _returns(schema)))
    table.sort(key=lambda spec: spec.name)
    return table


# ---- tensors a session starts with ------------------------------------------------------------


@dataclass(frozen=True)
class PoolTensor:
    handle: int
    dtype: torch.dtype
    shape: tuple[int, ...]


POOL_VALUES: list[torch.Tensor] = [
    torch.arange(16, dtype=torch.float32).reshape(4, 4) / 4,
    torch.arange(16, dtype=torch.float64),
    torch.tensor([0, 1, 2, 3], dtype=torch.int64),
    torch.tensor([-(2**62), 2**40, -1, 2**31], dtype=torch.int64),
    torch.tensor([2**31 - 1, -(2**31), 7], dtype=torch.int32),
    torch.tensor([True, False, True, True]),
    torch.arange(16, dtype=torch.uint8),
    torch.tensor(1.5, dtype=torch.float32),
    torch.empty(0, dtype=torch.float32),
    torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
    torch.arange(6, dtype=torch.float16).reshape(2, 3),
    torch.tensor([1.0, -2.0, 3.0], dtype=torch.bfloat16),
    torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
    torch.tensor([[0, 1, 2], [0, 1, 0]], dtype=torch.int64),
    torch.tensor([-128, -1, 0, 1, 127, 5, 6, 7], dtype=torch.int8),
    torch.arange(25, dtype=torch.float32).reshape(1, 1, 5, 5),
    torch.tensor([3, -5, 1000000], dtype=torch.int64),
]
"""What every session PUTs first: every common dtype, 0-d, empty, 1-4 dims, index tensors in and
far out of range. None of it is secret: the client's own values."""


def pool_records(first_handle: int, op_ids: dict[str, int]) -> tuple[list[Any], list[PoolTensor]]:
    """Records that make the pool (values, then views of them: a transpose, a stride-0 expand,
    a strided window, a slice), and what each handle holds."""
    records: list[Any] = []
    pool: list[PoolTensor] = []

    def define(name: str) -> int:
        if name not in op_ids:
            op_ids[name] = len(op_ids) + 1
            records.append([Rec.DEF, op_ids[name], name])
        return op_ids[name]

    to_copy = define("aten::_to_copy")
    handle = first_handle
    for values in POOL_VALUES:
        records.append([Rec.OP, to_copy, [literal(values)], {"device": DEVICE}, [handle]])
        pool.append(PoolTensor(handle, values.dtype, tuple(values.shape)))
        handle += 1
    views = [
        ("aten::t", [tensor_ext(first_handle)], torch.float32, (4, 4)),
        ("aten::expand", [tensor_ext(first_handle + 6), [4, 16]], torch.uint8, (4, 16)),
        ("aten::as_strided", [tensor_ext(first_handle + 1), [4], [3], 1], torch.float64, (4,)),
        ("aten::slice.Tensor", [tensor_ext(first_handle), 1, 1, 3], torch.float32, (4, 2)),
    ]
    for name, args, dtype, shape in views:
        records.append([Rec.OP, define(name), args, {}, [handle]])
        pool.append(PoolTensor(handle, dtype, shape))
        handle += 1
    return records, pool


# ---- arguments --------------------------------------------------------------------------------

EDGE_INTS = [
    0, 1, -1, 2, 3, -2, 4, 5, 7, 8, 16, 63, 64, 255, 256, 1023, 4096, 65535, 2**20, 2**24,
    2**31 - 1, 2**31, -(2**31), 2**32, 2**40, -(2**40), 2**53, 2**62, -(2**62), 2**63 - 1, -(2**63),
]  # fmt: skip
EDGE_FLOATS = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    2.0,
    3.0,
    1e-300,
    1e308,
    -1e308,
    math.inf,
    -math.inf,
    math.nan,
]
STRINGS = {
    "reduce": ["sum", "mean", "max", "min", "prod", "amax", "amin", "none", "add", "multiply"],
    "reduction": ["sum", "mean", "none"],
    "approximate": ["none", "tanh"],
    "equation": ["ij,jk->ik", "i,i->", "ii->i", "...i,...i->...", "ijk"],
    "mode": [
        "reflect",
        "replicate",
        "circular",
        "constant",
        "zeros",
        "bilinear",
        "nearest",
        "border",
    ],
    "padding_mode": ["zeros", "reflect", "border"],
    "rounding_mode": ["trunc", "floor"],
    "side": ["left", "right"],
    "padding": ["same", "valid"],
    "indexing": ["ij", "xy"],
}
PLAIN_STRINGS = ["", "a", "sum", "none", "mean", "x" * 300, "\x00", "ij", "reflect", "fro", "nuc"]
"""Strings never look like paths (no '/' nor '.'): no op is pointed at a real file."""
DTYPE_NAMES = sorted(DTYPES)


class Args:
    """Arguments of one op, from its schema, drawn from `rng`."""

    def __init__(self, rng: random.Random, pool: list[PoolTensor], recent: list[int]) -> None:
        self.rng = rng
        self.pool = pool
        self.recent = recent
        self.chosen: list[int] = []

    def int_value(self, name: str) -> int:
        rng = self.rng
        if (
            name in ("dim", "dims", "axis", "dim0", "dim1", "start_dim", "end_dim")
            and rng.random() < 0.75
        ):
            return rng.randint(-2, 3)
        if rng.random() < 0.5:
            return rng.randint(-3, 6)
        if name in ("size", "sizes", "output_size") and rng.random() < 0.3:
            return rng.choice([2**20, 2**30, 2**40, 2**62])
        return rng.choice(EDGE_INTS)

    def int_list(self, name: str) -> list[int]:
        rng = self.rng
        length = rng.choice([0, 1, 1, 2, 2, 3, 4, 5])
        if rng.random() < 0.5:
            return [rng.randint(-2, 5) for _ in range(length)]
        return [self.int_value(name) for _ in range(length)]

    def tensor(self, name: str) -> Any:
        rng = self.rng
        if self.chosen and rng.random() < 0.15:
            return tensor_ext(rng.choice(self.chosen))  # aliasing: the same tensor twice
        roll = rng.random()
        if roll < 0.02:
            return tensor_ext(rng.choice([0, 999_999, 2**63, 2**64 - 1]))  # a handle never made
        if roll < 0.04:
            return rng.choice([None, 3, 1.5, "t", [1, 2], b"\x00" * 8])  # not a tensor at all
        if self.recent and roll < 0.35:
            handle = rng.choice(self.recent)
        elif name in RISKY_ARG_NAMES and roll < 0.80:
            ints = [
                p
                for p in self.pool
                if not p.dtype.is_floating_point and p.dtype not in (torch.bool, torch.complex64)
            ]
            handle = rng.choice(ints).handle
        else:
            handle = rng.choice(self.pool).handle
        self.chosen.append(handle)
        return tensor_ext(handle)

    def scalar(self) -> Any:
        rng = self.rng
        return rng.choice([
            rng.choice(EDGE_INTS), rng.choice(EDGE_FLOATS), rng.random() < 0.5,
            msgpack.ExtType(Ext.COMPLEX, pack([rng.choice(EDGE_FLOATS), 1.0])),
        ])  # fmt: skip

    def value(self, kind: str, name: str) -> Any:
        rng = self.rng
        if kind.startswith("Optional["):
            if rng.random() < 0.3:
                return None
            kind = kind[len("Optional[") : -1]
        if kind == "Tensor":
            return self.tensor(name)
        if kind == "List[Tensor]":
            return [self.tensor(name) for _ in range(rng.choice([0, 1, 2, 2, 3]))]
        if kind == "List[Optional[Tensor]]":
            return [
                None if rng.random() < 0.3 else self.tensor("indices")
                for _ in range(rng.choice([0, 1, 1, 2, 3]))
            ]
        if kind in ("int", "SymInt"):
            return self.int_value(name)
        if kind in ("List[int]", "List[SymInt]"):
            if rng.random() < 0.05:
                return self.int_value(name)  # a bare int where a list goes: torch broadcasts it
            return self.int_list(name)
        if kind == "float":
            return rng.choice(EDGE_FLOATS) if rng.random() < 0.7 else rng.randint(-3, 3)
        if kind == "List[float]":
            return [rng.choice(EDGE_FLOATS) for _ in range(rng.choice([0, 1, 2, 3]))]
        if kind == "bool":
            return rng.random() < (0.8 if "unsafe" in name else 0.5)
        if kind == "List[bool]":
            return [rng.random() < 0.5 for _ in range(rng.choice([0, 1, 2, 3]))]
        if kind in ("number", "complex"):
            return self.scalar()
        if kind == "List[number]":
            return [self.scalar() for _ in range(rng.choice([0, 1, 2]))]
        if kind == "str":
            return rng.choice(STRINGS.get(name, PLAIN_STRINGS))
        if kind == "ScalarType":
            if rng.random() < 0.05:
                return rng.choice([-1, 99, 2**40])  # a dtype as a raw enum value
            return dtype_ext(rng.choice(DTYPE_NAMES))
        if kind == "Layout":
            return msgpack.ExtType(Ext.LAYOUT, rng.choice([b"strided", b"sparse_coo"]))
        if kind == "MemoryFormat":
            names = [
                b"contiguous_format",
                b"channels_last",
                b"channels_last_3d",
                b"preserve_format",
            ]
            return msgpack.ExtType(Ext.MEMORY_FORMAT, rng.choice(names))
        if kind == "Device":
            return DEVICE if rng.random() < 0.8 else HOST
        if kind in ("Dimname", "List[Dimname]"):
            names = ["N", "C", "a"]
            return rng.choice(names) if kind == "Dimname" else rng.sample(names, rng.randint(0, 2))
        if kind == "Generator":
            return None
        raise AssertionError(f"the table holds only buildable arguments, not {kind}")


def _ints(values: list[int]) -> msgpack.ExtType:
    return literal(torch.tensor(values, dtype=torch.int64))


def _float_pool(rng: random.Random, pool: list[PoolTensor]) -> msgpack.ExtType:
    return tensor_ext(rng.choice([p for p in pool if p.dtype.is_floating_point and p.shape]).handle)


def _reach(rng: random.Random) -> int:
    return rng.choice([16, 256, 4096, 16384, 65536])


def _segment_read(rng: random.Random, pool: list[PoolTensor]) -> tuple[list[Any], dict[str, Any]]:
    """Unchecked segments: one element per segment, from `start` on (negative: before the
    tensor), read raw."""
    count, start = _reach(rng), rng.choice([0, -1, -64, -4096, -65536, 4096])
    by_offsets = rng.random() < 0.5
    kwargs: dict[str, Any] = {"unsafe": rng.random() < 0.9, "axis": 0}
    if by_offsets:
        kwargs["offsets"] = _ints(list(range(start, start + count + 1)))
    else:
        kwargs["lengths"] = _ints([1] * count)
    return [_float_pool(rng, pool), rng.choice(["max", "sum", "min"])], kwargs


def _strided_read(rng: random.Random, pool: list[PoolTensor]) -> tuple[list[Any], dict[str, Any]]:
    size = _reach(rng)
    return [
        _float_pool(rng, pool),
        [size],
        [rng.choice([1, -1, 0, 2**40])],
        rng.choice([0, -size, 2**31, size]),
    ], {}


def _sparse_out_of_range(
    rng: random.Random, pool: list[PoolTensor]
) -> tuple[list[Any], dict[str, Any]]:
    """A sparse tensor whose index points outside its size; what the next ops do with it."""
    reach = _reach(rng) * rng.choice([1, -1])
    indices = literal(torch.tensor([[rng.choice([0, 1, reach])]], dtype=torch.int64))
    kwargs: dict[str, Any] = {"dtype": dtype_ext("float32"), "layout": SPARSE_COO, "device": DEVICE}
    if rng.random() < 0.5:
        kwargs["is_coalesced"] = True
    return [1, 1, [2, 3], indices, literal(torch.ones(1, 3))], kwargs


def _unsafe_index(rng: random.Random, pool: list[PoolTensor]) -> tuple[list[Any], dict[str, Any]]:
    reach = _reach(rng) * rng.choice([1, -1])
    return [_float_pool(rng, pool), [_ints([0, reach, -reach, 3])]], {}


def _unsafe_index_put(
    rng: random.Random, pool: list[PoolTensor]
) -> tuple[list[Any], dict[str, Any]]:
    reach = _reach(rng) * rng.choice([1, -1])
    return [
        _float_pool(rng, pool),
        [_ints([reach])],
        literal(torch.ones(1)),
        rng.random() < 0.5,
    ], {}


def _set_storage(rng: random.Random, pool: list[PoolTensor]) -> tuple[list[Any], dict[str, Any]]:
    size = _reach(rng)
    target, source = _float_pool(rng, pool), _float_pool(rng, pool)
    return [target, source, rng.choice([0, size, -size, 2**40]), [size], [1]], {}


DICTIONARY: list[
    tuple[str, Callable[[random.Random, list[PoolTensor]], tuple[list[Any], dict[str, Any]]]]
] = [
    ("aten::segment_reduce", _segment_read),
    ("aten::as_strided", _strided_read),
    ("aten::_sparse_coo_tensor_with_dims_and_tensors", _sparse_out_of_range),
    ("aten::_unsafe_index.Tensor", _unsafe_index),
    ("aten::_unsafe_index_put", _unsafe_index_put),
    ("aten::set_.source_Tensor_storage_offset", _set_storage),
]
"""Call shapes that reached memory outside a tensor on a worker of old (issue 20), with random
reach: drawn now and then, so the secret checks meet the reads they exist for. Every other op
is drawn from the whole table with schema-built arguments."""
DICTIONARY_SHARE = 0.08


@dataclass
class Case:
    """One op as sent: the records, and the handles it stores its outputs under."""

    op: str
    records: list[Any]
    outs: list[int | None]
    call_req: int | None
    made: list[int] = field(default_factory=list)
    """The handles that hold a tensor once the case ran (set by the fuzzer)."""


def build_case(rng: random.Random, spec: OpSpec, op_id: int, defined: bool, pool: list[PoolTensor],
               recent: list[int], next_handle: int, req: int,
               template: tuple[list[Any], dict[str, Any]] | None = None) -> Case:  # fmt: skip
    """One op's records: its arguments from its schema, or from a dictionary `template`."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if template is not None:
        args, kwargs = template
    else:
        args_of = Args(rng, pool, recent)
        arguments = list(spec.schema.arguments)
        # Sometimes leave trailing defaulted arguments out, as the client runtime does.
        keep = len(arguments)
        while keep and arguments[keep - 1].default_value is not None and rng.random() < 0.3:
            keep -= 1
        for arg in arguments[:keep]:
            value = args_of.value(str(arg.real_type), arg.name)
            if arg.kwarg_only:
                kwargs[arg.name] = value
            else:
                args.append(value)
    records: list[Any] = [] if defined else [[Rec.DEF, op_id, spec.name]]
    as_call = spec.tensor_outs is None or rng.random() < 0.2
    if as_call:
        records.append([Rec.CALL, req, op_id, args, kwargs, next_handle])
        return Case(spec.name, records, [], req)
    assert spec.tensor_outs is not None
    outs = [next_handle + i if tensor else None for i, tensor in enumerate(spec.tensor_outs)]
    records.append([Rec.OP, op_id, args, kwargs, outs])
    return Case(spec.name, records, outs, None)


# ---- findings and counts ----------------------------------------------------------------------


@dataclass
class Finding:
    kind: str
    """leak | address | crash | hang | closed | traceback | victim | file"""
    op: str
    seed: int
    session: int
    case: int
    detail: str
    records: str
    log: str = ""
    """For a crash: the end of the worker's log (faulthandler's stack, the C library's abort
    message), which names the op that died and how."""
    follows: str | None = None
    """An earlier leak of the same session, whose values this op may only have passed on
    (`real` of a tensor that segment_reduce read out of the heap): the root cause is that one."""

    def line(self) -> str:
        after = f" (after {self.follows})" if self.follows else ""
        return (f"{self.kind}: {self.op} (seed {self.seed}, session {self.session}, case "
                f"{self.case}): {self.detail}{after}")  # fmt: skip


@dataclass
class Tally:
    ops_tried: int = 0
    sessions: int = 0
    overloads: set[str] = field(default_factory=set)
    outcomes: Counter[str] = field(default_factory=Counter)
    """ok | refused | error | protocol | crash | hang | closed"""
    refusals: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    reply_bytes: int = 0
    worker_starts: int = 0
    findings: list[Finding] = field(default_factory=list)
    policy_refused: int = 0
    other_lease_checks: int = 0
    """Times the other lease's worker was checked (after every op): alive, answering, its
    tensor unchanged."""

    def summary(self, top: int = 40) -> dict[str, Any]:
        kinds = Counter(f.kind for f in self.findings)
        return {
            "ops_tried": self.ops_tried,
            "sessions": self.sessions,
            "distinct_overloads_tried": len(self.overloads),
            "overloads_the_policy_refused_at_start": self.policy_refused,
            "outcomes": dict(self.outcomes),
            "refusals_by_reason": dict(self.refusals.most_common(top)),
            "refusal_reasons_total": len(self.refusals),
            "errors_by_reason": dict(self.errors.most_common(top)),
            "error_reasons_total": len(self.errors),
            "reply_bytes_searched": self.reply_bytes,
            "worker_starts": self.worker_starts,
            "crashes": kinds["crash"],
            "hangs": kinds["hang"],
            "leaks": kinds["leak"],
            "address_leaks": kinds["address"],
            "other_lease_checks": self.other_lease_checks,
            "other_lease_harmed": kinds["victim"],
            "findings_by_kind": dict(kinds),
        }


def reason(body: Any) -> str:
    """An error's reason with its numbers blanked: the same refusal counts once."""
    if not isinstance(body, dict):
        return f"malformed error body {body!r:.80}"
    try:
        kind = ErrorKind(body.get("kind")).name
    except ValueError:
        kind = str(body.get("kind"))
    message = str(body.get("message", ""))
    op = body.get("op")
    if isinstance(op, str) and message.startswith(f"{op}: "):
        message = message[len(op) + 2 :]
    message = re.sub(
        r"0x[0-9a-fA-F]+|-?\d+(\.\d+)?(e[-+]?\d+)?", "#", message.splitlines()[0] if message else ""
    )
    return f"{kind}: {message[:110]}"


def describe_records(records: list[Any]) -> str:
    """The records in a form to read and to paste into a replay."""

    def show(value: Any) -> Any:
        if isinstance(value, msgpack.ExtType):
            if value.code == Ext.TENSOR:
                return f"T{int.from_bytes(value.data, 'big')}"
            if value.code == Ext.LITERAL:
                dtype, shape, _ = msgpack.unpackb(value.data)
                return f"literal({dtype}{shape})"
            try:
                code = Ext(value.code).name
            except ValueError:
                code = str(value.code)
            data = (
                value.data.decode(errors="replace")
                if value.code != Ext.COMPLEX
                else msgpack.unpackb(value.data)
            )
            return f"{code}({data})"
        if isinstance(value, list):
            return [show(v) for v in value]
        if isinstance(value, dict):
            return {k: show(v) for k, v in value.items()}
        if isinstance(value, bytes):
            return f"bytes({len(value)})"
        return value

    lines = []
    for record in records:
        try:
            kind = Rec(record[0]).name
        except ValueError:
            kind = str(record[0])
        lines.append(f"{kind} {show(record[1:])}")
    return "\n".join(lines)


# ---- the fuzzer -------------------------------------------------------------------------------

VICTIM_HANDLE = 1
VICTIM_GUARD = Guard(nice=0)
LEAKS = ("leak", "address")
REFUSED_WEIGHT = 0.02
"""Ops the worker's policy refuses stay in the draw, rarely: their refusals go on being counted."""
FIRST_POOL_HANDLE = 10
FIRST_OUT_HANDLE = 1000
RECENT = 12
SYNC_REQ = 1 << 30


@dataclass
class Victim:
    worker: FuzzWorker
    wire: Wire
    expected: bytes


class Fuzzer:
    def __init__(self, seed: int, root: Path, guard: Guard = Guard(), ops_per_session: int = 25,
                 log: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.seed = seed
        self.root = root
        self.guard = guard
        self.ops_per_session = ops_per_session
        self.log = log or (lambda _line: None)
        self.secrets = Secrets.from_seed(seed)
        self.needles = self.secrets.needles()
        self.tally = Tally()
        self.table: list[OpSpec] = []
        self.cumulative: list[float] = []
        self.by_name: dict[str, OpSpec] = {}
        self.last_sent: list[str] = []
        self.fuzzed: FuzzWorker | None = None
        self.victim: Victim | None = None

    # -- lifecycle --

    def __enter__(self) -> Fuzzer:
        try:
            victim = self._launch_victim()
            fuzzed = self._launch_fuzzed()
            self.victim = self._victim_ready(victim)
            self.fuzzed = fuzzed.ready()
            base = op_table()
            refused = self._probe_policy([spec.name for spec in base])
        except BaseException:
            self.__exit__()
            raise
        self.use_table(base, refused)
        return self

    def use_table(self, base: list[OpSpec], refused: set[str]) -> None:
        """Draw from `base`; what the worker's policy refuses, rarely."""
        self.tally.policy_refused = len(refused)
        self.table = [
            OpSpec(s.name, s.schema, s.weight * (REFUSED_WEIGHT if s.name in refused else 1.0),
                   s.tensor_outs)
            for s in base
        ]  # fmt: skip
        self.cumulative = list(itertools.accumulate(spec.weight for spec in self.table))
        self.by_name = {spec.name: spec for spec in self.table}

    def __exit__(self, *exc: object) -> None:
        if self.victim is not None:
            self.victim.wire.close()
            self.victim.worker.stop()
        if self.fuzzed is not None:
            self.fuzzed.stop()

    def _launch_fuzzed(self) -> Launched:
        self.tally.worker_starts += 1
        return launch_worker("lease-fuzzed", secrets.token_urlsafe(16), self.secrets.heap,
                             self.secrets.env_token, self.root, self.guard)  # fmt: skip

    def _launch_victim(self) -> Launched:
        other_env = "gpp_000000000000_" + secrets.token_urlsafe(32)
        return launch_worker("lease-victim", secrets.token_urlsafe(16), self.secrets.other,
                             other_env, self.root, VICTIM_GUARD)  # fmt: skip

    def _victim_ready(self, launched: Launched) -> Victim:
        """The other lease's worker, its client (the harness) holding a tensor of its secret."""
        worker = launched.ready()
        wire = Wire(worker, VICTIM_GUARD.reply_timeout_s)
        values = torch.frombuffer(bytearray(self.secrets.other * 128), dtype=torch.uint8)
        wire.send([
            [Rec.DEF, 1, "aten::_to_copy"],
            [Rec.OP, 1, [literal(values)], {"device": DEVICE}, [VICTIM_HANDLE]],
        ])  # fmt: skip
        victim = Victim(worker, wire, self.secrets.other * 128)
        problem = self._victim_problem(victim)
        if problem is not None:
            raise RuntimeError(f"the other lease's worker did not start as expected: {problem}")
        return victim

    def _victim_problem(self, victim: Victim) -> str | None:
        """The other lease's worker is alive, answers, and its tensor holds its values."""
        if not victim.worker.alive():
            return f"the other lease's worker died ({victim.worker.proc.returncode})"
        try:
            victim.wire.send([[Rec.READ, 1, tensor_ext(VICTIM_HANDLE)], [Rec.SYNC, 2]])
            data = victim.wire.recv()
            sync = victim.wire.recv()
        except (Closed, TimeoutError, OSError) as exc:
            return f"the other lease's worker stopped answering: {exc!r}"
        if data.head[0] != Kind.DATA or data.tail != victim.expected:
            return f"the other lease's tensor changed: {data.head!r:.200}"
        if sync.head[:2] != [Kind.RESULT, 2]:
            return f"the other lease's worker answered {sync.head!r:.200}"
        stats = sync.head[2]
        if stats.get("tensors") != 1 or stats.get("memory_held_bytes") != len(victim.expected):
            return f"the other lease's worker holds something else now: {stats!r:.300}"
        return None

    def _probe_policy(self, names: list[str]) -> set[str]:
        """Ops the worker's policy refuses outright (ErrorKind.UNSUPPORTED for a call whose
        arguments cannot even bind): asked once, so the fuzz spends its time on allowed ops."""
        assert self.fuzzed is not None
        refused: set[str] = set()
        wire: Wire | None = None
        try:
            for start in range(0, len(names), BATCH_MAX_RECORDS // 2):
                chunk = names[start : start + BATCH_MAX_RECORDS // 2]
                records: list[Any] = []
                for i, name in enumerate(chunk, start=1):
                    records.append([Rec.DEF, start + i, name])
                    records.append(
                        [Rec.CALL, start + i, start + i, [{"not": "an argument"}], {}, 0]
                    )
                wire = wire or Wire(self.fuzzed, self.guard.reply_timeout_s)
                try:
                    wire.send(records)
                    for _ in chunk:
                        head = wire.recv().head
                        if head[0] == Kind.ERROR and head[1] is None:
                            raise Closed  # a protocol error (a policy refusing at DEF): it closes
                        if head[0] == Kind.ERROR and head[2].get("kind") == ErrorKind.UNSUPPORTED:
                            refused.add(chunk[head[1] - start - 1])
                except (Closed, OSError):
                    wire.close()
                    wire = None  # the rest of this chunk stays undecided: drawn as allowed
        finally:
            if wire is not None:
                wire.close()
        return refused

    # -- running --

    def pick(self, rng: random.Random) -> OpSpec:
        from bisect import bisect_right

        return self.table[bisect_right(self.cumulative, rng.random() * self.cumulative[-1])]

    def session_cases(self, session: int) -> Iterator[tuple[Case, list[PoolTensor]]]:
        """The cases of one session, from the seed, the session's number and what the worker
        answered in that session (which handles hold tensors) alone."""
        rng = random.Random(f"{self.seed}-{session}")
        op_ids: dict[str, int] = {}
        setup, pool = pool_records(FIRST_POOL_HANDLE, op_ids)
        yield Case("(pool)", setup, [], None), pool
        recent: list[int] = []
        next_handle = FIRST_OUT_HANDLE
        for index in range(self.ops_per_session):
            template = None
            if rng.random() < DICTIONARY_SHARE:
                name, make = rng.choice(DICTIONARY)
                spec, template = self.by_name[name], make(rng, pool)
            else:
                spec = self.pick(rng)
            defined = spec.name in op_ids
            op_id = op_ids.setdefault(spec.name, len(op_ids) + 1)
            case = build_case(
                rng, spec, op_id, defined, pool, recent, next_handle, index + 1, template
            )
            next_handle += 64
            yield case, pool
            # What the op made, if it ran: later ops take it (views of views, outputs aliased
            # with inputs). A replay of the session gets the same answers, so the same ops.
            recent.extend(case.made)
            del recent[:-RECENT]

    def run(self, max_ops: int, max_seconds: float, first_session: int = 0) -> Tally:
        deadline = time.monotonic() + max_seconds
        session = first_session
        while self.tally.ops_tried < max_ops and time.monotonic() < deadline:
            self.run_session(session, max_ops, deadline)
            session += 1
        return self.tally

    def _connect(self, session: int) -> Wire:
        """A session's connection. A worker that died meanwhile (freeing the last session's
        tensors, say, on a heap an op corrupted) is a crash of that session, one that does not
        answer is a hang; either is restarted."""
        assert self.fuzzed is not None
        try:
            return Wire(self.fuzzed, self.guard.reply_timeout_s)
        except (Closed, OSError) as exc:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.fuzzed.proc.wait(timeout=scaled(5))
            code = self.fuzzed.proc.poll()
            after = "(after the session, as its tensors were freed)"
            if code is None:
                self._find("hang", after, session - 1, -1,
                           f"the worker does not take a new client: {exc!r}", self.last_sent)  # fmt: skip
            else:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                self._find("crash", after, session - 1, -1, f"the worker died ({how})",
                           self.last_sent, log=self.fuzzed.crash_log())  # fmt: skip
            self.fuzzed.kill()
            self.fuzzed = self._launch_fuzzed().ready()
            return Wire(self.fuzzed, self.guard.reply_timeout_s)

    def run_session(self, session: int, max_ops: int = 1 << 62, deadline: float = math.inf) -> None:
        assert self.fuzzed is not None
        self.tally.sessions += 1
        wire = self._connect(session)
        sent: list[str] = []
        self.last_sent = sent
        try:
            for index, (case, _pool) in enumerate(self.session_cases(session)):
                if index and (self.tally.ops_tried >= max_ops or time.monotonic() > deadline):
                    break
                sent.append(describe_records(case.records))
                if index:
                    self.tally.ops_tried += 1
                    self.tally.overloads.add(case.op)
                outcome = self._run_case(wire, case, session, index, sent)
                if index:
                    self.tally.outcomes[outcome] += 1
                if outcome in ("protocol", "crash", "hang", "closed"):
                    break
        finally:
            wire.close()
        self._after_session(session, sent)

    def _after_session(self, session: int, sent: list[str]) -> None:
        assert self.fuzzed is not None and self.victim is not None
        text = self.fuzzed.tracebacks()
        if text:
            self._find("traceback", "(session)", session, -1, text[-1500:], sent)
            self.fuzzed.log.write_text("")
        leftovers = sorted(p.name for p in self.fuzzed.scratch.iterdir())
        if leftovers:
            self._find(
                "file", "(session)", session, -1, f"the worker wrote files: {leftovers[:10]}", sent
            )
            for path in self.fuzzed.scratch.iterdir():
                with contextlib.suppress(OSError):
                    path.unlink()
        if not self.fuzzed.alive():
            self.fuzzed.kill()
            self.fuzzed = self._launch_fuzzed().ready()

    def _run_case(self, wire: Wire, case: Case, session: int, index: int, sent: list[str]) -> str:
        """Send one op (and READs of what it made, then a SYNC); check everything that came."""
        assert self.fuzzed is not None and self.victim is not None
        records = list(case.records)
        outs = [h for h in case.outs if h is not None]
        reads = [[Rec.READ, 100_000 + i, tensor_ext(h)] for i, h in enumerate(outs)]
        outcome = "ok"
        try:
            if case.call_req is None:
                wire.send([*records, *reads, [Rec.SYNC, SYNC_REQ]])
                outcome = self._collect(wire, case, session, index, sent, wait_for=SYNC_REQ)
                if outcome == "ok":
                    case.made = outs
            else:
                wire.send(records)
                outcome, described = self._collect_call(wire, case, session, index, sent)
                if outcome in ("protocol", "closed"):
                    return outcome
                handles = [h for h in described if isinstance(h, int)][:4]
                reads = [[Rec.READ, 100_000 + i, tensor_ext(h)] for i, h in enumerate(handles)]
                wire.send([*reads, [Rec.SYNC, SYNC_REQ]])
                after = self._collect(wire, case, session, index, sent, wait_for=SYNC_REQ)
                outcome = after if after != "ok" else outcome
                if outcome == "ok":
                    case.made = handles
        except TimeoutError:
            alive = self.fuzzed.alive()
            self._find("hang", case.op, session, index,
                       f"no answer within {self.guard.reply_timeout_s:.0f} s (worker alive: {alive})", sent)  # fmt: skip
            self.fuzzed.kill()
            return "hang"
        except Closed:
            return self._closed(case, session, index, sent)
        problem = self._victim_problem(self.victim)
        self.tally.other_lease_checks += 1
        if problem is not None:
            self._find("victim", case.op, session, index, problem, sent)
            self.victim.wire.close()
            self.victim.worker.kill()
            self.victim = self._victim_ready(self._launch_victim())
        return outcome

    def _closed(self, case: Case, session: int, index: int, sent: list[str]) -> str:
        assert self.fuzzed is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.fuzzed.proc.wait(timeout=scaled(5))
        code = self.fuzzed.proc.poll()
        if code is None:
            self._find(
                "closed",
                case.op,
                session,
                index,
                "the worker closed the connection without an error",
                sent,
            )
            return "closed"
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        self._find("crash", case.op, session, index, f"the worker died ({how})", sent,
                   log=self.fuzzed.crash_log())  # fmt: skip
        return "crash"

    def _collect_call(self, wire: Wire, case: Case, session: int, index: int,
                      sent: list[str]) -> tuple[str, list[Any]]:  # fmt: skip
        reply = wire.recv()
        self._check(reply, case, session, index, sent)
        head = reply.head
        if head[0] == Kind.ERROR:
            return self._error_outcome(head), []
        handles: list[Any] = []

        def walk(value: Any) -> None:
            if isinstance(value, list) and value and value[0] == "T":
                handles.append(value[1])
            elif isinstance(value, list) and value and value[0] == "L":
                for item in value[1]:
                    walk(item)

        walk(head[2] if len(head) > 2 else None)
        return "ok", handles

    def _collect(self, wire: Wire, case: Case, session: int, index: int, sent: list[str],
                 wait_for: int) -> str:  # fmt: skip
        outcome = "ok"
        while True:
            reply = wire.recv()
            self._check(reply, case, session, index, sent)
            head = reply.head
            if head[0] == Kind.ERROR:
                outcome = self._error_outcome(head) if outcome == "ok" else outcome
                if head[1] is None:
                    return "protocol"
            if head[1] == wait_for and head[0] in (Kind.RESULT, Kind.ERROR):
                return outcome

    def _error_outcome(self, head: list[Any]) -> str:
        body = head[2] if len(head) > 2 else None
        text = reason(body)
        if head[1] is None:
            self.tally.refusals[text] += 1
            return "protocol"
        if isinstance(body, dict) and body.get("kind") in (
            ErrorKind.UNSUPPORTED,
            ErrorKind.OUT_OF_MEMORY,
        ):
            self.tally.refusals[text] += 1
            return "refused"
        self.tally.errors[text] += 1
        return "error"

    def _check(self, reply: Reply, case: Case, session: int, index: int, sent: list[str]) -> None:
        """No secret in any byte of the reply; no address of the worker's own memory in it."""
        assert self.fuzzed is not None
        self.tally.reply_bytes += len(reply.raw)
        found = find_secret(reply.raw, self.needles)
        if found is not None:
            self._find("leak", case.op, session, index, f"a reply holds the {found}", sent)
        if len(reply.tail) >= 8:
            addresses = addresses_in(reply.tail, self.fuzzed.address_ranges())
            if len(addresses):
                self._find("address", case.op, session, index,
                           f"a reply holds {len(addresses)} words that are addresses in the "
                           f"worker's memory, e.g. {int(addresses[0]):#x}", sent)  # fmt: skip

    def _find(self, kind: str, op: str, session: int, index: int, detail: str, sent: list[str],
              log: str = "") -> None:  # fmt: skip
        finding = Finding(
            kind, op, self.seed, session, index, detail, "\n".join(sent)[-6000:], log=log
        )
        if kind in LEAKS:
            earlier = [f for f in self.tally.findings
                       if f.kind in LEAKS and f.session == session and f.case < index]  # fmt: skip
            if earlier:
                finding.follows = f"a leak of {earlier[0].op} at case {earlier[0].case}"
        self.tally.findings.append(finding)
        self.log(finding.line())


def secret_digest(value: bytes | str) -> str:
    """What a report may say of a secret: enough to tell two apart, nothing to reuse."""
    data = value.encode() if isinstance(value, str) else value
    return hashlib.sha256(data).hexdigest()[:12]


def machine() -> dict[str, Any]:
    import platform

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
