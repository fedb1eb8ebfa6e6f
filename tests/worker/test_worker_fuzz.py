"""The op fuzzer (tests/worker/worker_fuzzing.py): its checks find what they look for, its runs
replay by seed, and a short fixed-seed run against real workers finds nothing.

The long run is bench/worker_fuzz.py; this is the bounded one CI runs.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker.worker_fuzzing import (
    DICTIONARY,
    ENV_SECRET_VAR,
    Fuzzer,
    Guard,
    Secrets,
    addresses_in,
    describe_records,
    find_secret,
    op_table,
)

SEED = 20
CI_OPS = 300
"""A few hundred ops: seconds on a CPU worker, the same ops every run."""


@pytest.fixture(scope="module")
def table() -> list[object]:
    return op_table()  # type: ignore[return-value]


# ---- the checks find what they look for ---------------------------------------------------------


def embedded(rng: random.Random, payload: bytes) -> bytes:
    return rng.randbytes(rng.randint(0, 64)) + payload + rng.randbytes(rng.randint(0, 64))


def test_a_secret_is_found_in_a_reply_raw_as_text_and_through_dtype_views() -> None:
    secrets = Secrets.from_seed(7)
    needles = secrets.needles()
    rng = random.Random(1)
    heap = np.frombuffer(secrets.heap * 4, dtype=np.uint8)
    seen = {
        "raw": secrets.heap[5:25],
        "env token raw": secrets.env_token.encode()[20:40],
        "uint8 as float32": heap[3:40].astype(np.float32).tobytes(),
        "int8 as int64": heap[3:40].view(np.int8).astype(np.int64).tobytes(),
        "uint8 as bfloat16": torch.from_numpy(heap[:40].astype(np.float32))
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .tobytes(),
        "int32 words as float64 (shifted by 1)": np.frombuffer(secrets.other[1:29], dtype=np.int32)
        .astype(np.float64)
        .tobytes(),
        "hex": secrets.other.hex().encode(),
        "decimal text": ", ".join(str(b) for b in secrets.heap[:16]).encode(),
        "torch repr": ("tensor([" + ", ".join(f"{b}." for b in secrets.heap[:16]) + "])").encode(),
    }
    for what, payload in seen.items():
        assert find_secret(embedded(rng, payload), needles) is not None, what
    # Random data, the client's own values and other secrets' bytes are not mistaken for it.
    for _ in range(200):
        assert find_secret(rng.randbytes(4096), needles) is None
    assert find_secret(np.arange(4096, dtype=np.float32).tobytes(), needles) is None
    assert find_secret(Secrets.from_seed(8).heap * 8, needles) is None


def test_an_address_of_the_workers_memory_in_a_reply_is_seen() -> None:
    ranges = np.array(
        [
            [0x5500_0000_0000, 0x5500_0100_0000],
            [0x7F00_0000_0000, 0x7F00_0000_1000],
            [0x7F01_0000_0000, 0x7F80_0000_0000],
        ],
        dtype=np.uint64,
    )
    pointer = np.array([1.5, 0.0], dtype=np.float64).tobytes() + (0x5500_0012_3456).to_bytes(
        8, "little"
    )
    assert [int(a) for a in addresses_in(pointer, ranges)] == [0x5500_0012_3456]
    assert len(addresses_in((0x7F00_0000_1000).to_bytes(8, "little"), ranges)) == 0  # end is open
    assert len(addresses_in(np.arange(512, dtype=np.float64).tobytes(), ranges)) == 0
    assert len(addresses_in(np.arange(512, dtype=np.int64).tobytes(), ranges)) == 0
    # An int32 arange over 0x7f00 holds words 0x7f01_00007f00 ...: values, not addresses.
    assert len(addresses_in(np.arange(0x7E00, 0x8100, dtype=np.int32).tobytes(), ranges)) == 0


# ---- what the fuzzer draws ----------------------------------------------------------------------


def test_the_op_table_holds_the_registrys_overloads_but_none_that_name_files(
    table: list[object],
) -> None:
    names = {spec.name for spec in table}  # type: ignore[attr-defined]
    aten = [s for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")]
    assert len(names) > 0.85 * len(aten), f"{len(names)} of {len(aten)} aten overloads"
    assert {"aten::segment_reduce", "aten::as_strided", "aten::index_put_", "aten::_print"} <= names
    assert not {"aten::from_file", "aten::save"} & names
    assert all(name in names for name, _ in DICTIONARY)
    by_name = {spec.name: spec for spec in table}  # type: ignore[attr-defined]
    # Ops taking indices and offsets are drawn more often than plain arithmetic.
    assert by_name["aten::segment_reduce"].weight > by_name["aten::add.Tensor"].weight  # type: ignore[attr-defined]


def test_a_session_is_drawn_from_the_seed_alone(table: list[object], tmp_path: Path) -> None:
    def draw(seed: int, session: int) -> list[str]:
        fuzzer = Fuzzer(seed, tmp_path)
        fuzzer.use_table(table, refused=set())  # type: ignore[arg-type]
        return [describe_records(case.records) for case, _ in fuzzer.session_cases(session)]

    first = draw(SEED, 3)
    assert first == draw(SEED, 3)
    assert first != draw(SEED, 4) and first != draw(SEED + 1, 3)
    assert len(first) == 1 + 25  # the pool, then the session's ops
    # Adversarial values reach the arguments.
    text = "\n".join(draw(SEED, 0) + draw(SEED, 1) + draw(SEED, 2))
    assert re.search(r"-?(9223372036854775807|4611686018427387904|1099511627776)", text), text[
        :2000
    ]


# ---- real workers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzer() -> Iterator[Fuzzer]:
    """One fuzzer (a fuzzed worker and the other lease's worker) for the module's tests: a
    worker's start is mostly torch's import, seconds on a busy CI machine."""
    root = Path(f"/tmp/gp-opfuzz-{os.getpid()}")  # Unix socket paths must stay short
    root.mkdir(exist_ok=True)
    try:
        with Fuzzer(SEED, root) as running:
            yield running
    finally:
        for path in sorted(root.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        root.rmdir()


def process_memory_holds(pid: int, needle: bytes) -> bool:
    """Whether the process's writable memory holds `needle` (we are its parent, and root)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            if fields[1].startswith("rw") and not line.rstrip().endswith("(deleted)"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                try:
                    mem.seek(low)
                    if needle in mem.read(high - low):
                        return True
                except (OSError, ValueError, OverflowError):
                    continue
    return False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_fuzzed_worker_holds_the_planted_secrets_and_runs_under_its_guards(
    fuzzer: Fuzzer,
) -> None:
    """The secrets the fuzz looks for are really there to be found, and the guards are on."""
    assert fuzzer.fuzzed is not None and fuzzer.victim is not None
    pid = fuzzer.fuzzed.proc.pid
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"{ENV_SECRET_VAR}={fuzzer.secrets.env_token}".encode() in environ
    assert process_memory_holds(pid, fuzzer.secrets.heap * 8)
    assert process_memory_holds(fuzzer.victim.worker.proc.pid, fuzzer.secrets.other * 8)
    limits = Path(f"/proc/{pid}/limits").read_text()
    address_space = re.search(r"Max address space\s+(\d+)", limits)
    assert address_space is not None
    assert int(address_space.group(1)) == Guard().address_space_mib << 20
    assert re.search(rf"Max file size\s+{Guard().file_size_mib << 20}", limits)
    assert os.getpriority(os.PRIO_PROCESS, pid) >= Guard().nice
    assert fuzzer.table and fuzzer.victim.expected == fuzzer.secrets.other * 128


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fuzzed_ops_return_no_secret_nor_address_and_harm_neither_worker(fuzzer: Fuzzer) -> None:
    """A few hundred random ops with adversarial arguments (seed 20, sessions 0-11): no reply
    holds a secret or an address of the worker, the worker never crashes, hangs or logs a
    traceback, and the other lease's worker keeps its tensor and answers."""
    lines: list[str] = []
    fuzzer.log = lines.append
    tally = fuzzer.run(max_ops=CI_OPS, max_seconds=240)
    assert tally.ops_tried == CI_OPS, tally.summary()
    assert len(tally.overloads) > CI_OPS // 2, "the run tried few distinct overloads"
    report = "\n".join(lines[:40])
    replay = f"replay one: python bench/worker_fuzz.py --replay {SEED}:SESSION"
    assert not tally.findings, f"{len(tally.findings)} findings ({replay}):\n{report}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_that_dies_or_stops_answering_is_a_finding_and_is_replaced(
    fuzzer: Fuzzer,
) -> None:
    """The crash and hang checks see what they exist for (here caused from outside: a SIGKILL
    and a SIGSTOP), name the session, and the fuzz goes on with a fresh worker.

    Only the stopped worker's session gets the short reply timeout: a fresh worker's first
    answers take longer than 3 s on a loaded machine, and that is no hang of the fuzzer's."""
    assert fuzzer.fuzzed is not None
    tally, guard, per_session = fuzzer.tally, fuzzer.guard, fuzzer.ops_per_session
    seen, starts = len(tally.findings), tally.worker_starts
    fuzzer.ops_per_session = 1
    try:
        fuzzer.fuzzed.proc.send_signal(signal.SIGKILL)
        ops = tally.ops_tried
        fuzzer.run_session(10_001)
        assert tally.ops_tried == ops + 1, "the session after the crash ran its op"
        stopped = fuzzer.fuzzed.proc
        stopped.send_signal(signal.SIGSTOP)
        fuzzer.guard = dataclasses.replace(guard, reply_timeout_s=3.0)
        fuzzer.run_session(10_002)
        fuzzer.guard = guard
        ops = tally.ops_tried
        fuzzer.run_session(10_003)
        assert tally.ops_tried == ops + 1, "the session after the hang ran its op"
    finally:
        fuzzer.guard, fuzzer.ops_per_session = guard, per_session
    found = [(f.kind, f.session) for f in tally.findings[seen:]]
    assert found[:2] == [("crash", 10_000), ("hang", 10_001)], tally.findings[seen:]
    assert stopped.poll() is not None, "the hung worker was killed"
    assert tally.worker_starts >= starts + 2 and fuzzer.fuzzed.alive()
