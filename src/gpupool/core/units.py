"""Parsing and printing of sizes and shares as people write them (`20Gi`, `20GB`, `25%`)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from gpupool.core.errors import InvalidRequest, quoted

MIB = 1 << 20
_BYTES_PER_PREFIX: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}
SIZE_RULES = (
    "a unit with an i is binary (Ki, Mi, Gi, Ti: 2^10..2^40 bytes), one without is decimal "
    "(k, M, G, T: 10^3..10^12 bytes), as Kubernetes writes them; a trailing B is allowed "
    "(GiB, GB) and letters are read in any case, except a lone m, g or t"
)
"""The size rules, as `--help` and error messages state them."""
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*$")
_PCT = re.compile(r"^\s*([0-9]+)\s*%?\s*$")
_AMBIGUOUS = {"m": "Mi or M", "g": "Gi or G", "t": "Ti or T"}
"""Lone lowercase m, g, t: Kubernetes reads `512m` as millibytes, Docker as MiB."""


def _bytes_per_unit(unit: str, text: str) -> int:
    if unit in _AMBIGUOUS:
        raise InvalidRequest(
            f"memory {text!r}: a lone {unit!r} is ambiguous (Docker reads it as binary, "
            f"Kubernetes not at all): write {_AMBIGUOUS[unit]}"
        )
    folded = unit.lower()
    prefix = folded[:-1] if folded.endswith("b") else folded
    if prefix not in _BYTES_PER_PREFIX:
        raise InvalidRequest(
            f"unknown memory unit {quoted(unit)} in {quoted(text)}: use Mi/MiB, Gi/GiB "
            "(binary) or M/MB, G/GB (decimal)"
        )
    return _BYTES_PER_PREFIX[prefix]


def parse_memory_bytes(text: str) -> Fraction:
    """A memory size in bytes, exactly (`1.5Gi` is 3/2 * 2^30); a unit is required because a
    bare number is ambiguous (bytes to Kubernetes, MiB to people)."""
    match = _SIZE.match(text)
    if match is None:
        if re.match(r"^\s*-", text):
            raise InvalidRequest(f"memory must be positive, got {quoted(text)}")
        if re.match(r"^\s*[0-9.]+\s*$", text):
            raise InvalidRequest(
                f"memory {quoted(text)} has no unit: write it as e.g. '512Mi' or '20Gi'"
            )
        raise InvalidRequest(f"cannot read memory size {quoted(text)}: write it as e.g. '512Mi'")
    if len(match.group(1)) > 24:
        raise InvalidRequest(f"memory {quoted(text)} is more than any pool holds")
    number, unit = Fraction(match.group(1)), match.group(2)
    return number * _bytes_per_unit(unit, text)


def parse_memory_mib(text: str) -> int:
    """A memory size in whole MiB, rounded up: slices are granted in 1 MiB steps, and rounding
    up never gives less than was asked for (`1G` = 953.67 MiB gives 954 MiB)."""
    size = parse_memory_bytes(text)
    if size < MIB:
        raise InvalidRequest(f"memory must be at least 1MiB, got {quoted(text)}")
    return math.ceil(size / MIB)


def describe_memory(text: str) -> str:
    """The size understood, said back: `20G` → '20G = 18.6 GiB'."""
    return f"{text.strip()} = {format_size(parse_memory_mib(text))}"


def proportional_compute_pct(memory_mib: int, gpu_memory_mib: int) -> int:
    """The compute share that goes with a memory-only slice: the same part of the GPU, rounded
    up to a whole percent (1 GiB of an 80 GiB GPU: 2 %), so that a small slice no longer takes
    the whole GPU's compute and leaves it to nobody else."""
    if gpu_memory_mib <= 0:
        return 100
    return max(1, min(100, math.ceil(memory_mib * 100 / gpu_memory_mib)))


def parse_compute_pct(text: str | int) -> int:
    """Return a compute share in whole percent of one GPU (1..100)."""
    if isinstance(text, int):
        value = text
    else:
        match = _PCT.match(text)
        if match is None:
            raise InvalidRequest(f"cannot read compute share {text!r}: write it as e.g. '25%'")
        value = int(match.group(1))
    if not 1 <= value <= 100:
        raise InvalidRequest(f"compute share must be 1..100 %, got {value}")
    return value


def parse_cpu_milli(text: str) -> int:
    """Return CPU in thousandths of a core: `4` and `0.5` are cores, `500m` millicores."""
    cleaned = text.strip().lower()
    try:
        value = int(cleaned[:-1]) if cleaned.endswith("m") else round(float(cleaned) * 1000)
    except (ValueError, OverflowError):
        raise InvalidRequest(
            f"cannot read CPU {text!r}: write cores (4, 0.5) or millicores (500m)"
        ) from None
    if value <= 0 or value > 100_000_000:
        raise InvalidRequest(f"CPU must be more than 0 and at most 100000 cores, got {text!r}")
    return value


def format_size(mib: int) -> str:
    """A size for people: GiB with one decimal from 1 GiB on ('18.6 GiB', '80 GiB'), else MiB."""
    if mib >= 1024:
        gib = mib / 1024
        return f"{gib:.0f} GiB" if mib % 1024 == 0 else f"{gib:.1f} GiB"
    return f"{mib} MiB"


def format_mib(mib: int) -> str:
    """Print MiB the way people read them: whole GiB where exact, else MiB."""
    if mib >= 1024 and mib % 1024 == 0:
        return f"{mib // 1024}GiB"
    if mib >= 10 * 1024:
        return f"{mib / 1024:.1f}GiB"
    return f"{mib}MiB"


def compute_for_memory(memory_mib: int, gpu_memory_mibs: list[int]) -> int:
    """The stated compute default of a memory-only slice in a pool whose candidate GPUs have
    these memories: proportional on the smallest GPU that holds the memory (so on whichever
    it lands the share is never below the memory's part); 100 when none is known."""
    holding = [m for m in gpu_memory_mibs if m >= memory_mib] or gpu_memory_mibs
    if not holding:
        return 100
    return proportional_compute_pct(memory_mib, min(holding))
