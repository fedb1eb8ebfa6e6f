"""Parsing and printing of sizes and shares as people write them (`20GiB`, `512MiB`, `25%`)."""

from __future__ import annotations

import re

from gpupool.core.errors import InvalidRequest

_MIB_PER_UNIT: dict[str, float] = {
    "mib": 1,
    "mi": 1,
    "m": 1,
    "mb": 1_000_000 / 1_048_576,
    "gib": 1024,
    "gi": 1024,
    "g": 1024,
    "gb": 1_000_000_000 / 1_048_576,
    "tib": 1024 * 1024,
    "ti": 1024 * 1024,
    "t": 1024 * 1024,
    "tb": 1_000_000_000_000 / 1_048_576,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*$")
_PCT = re.compile(r"^\s*([0-9]+)\s*%?\s*$")


def parse_memory_mib(text: str) -> int:
    """Return a memory size in whole MiB; a unit is required because a bare number is ambiguous."""
    match = _SIZE.match(text)
    if match is None:
        if re.match(r"^\s*-", text):
            raise InvalidRequest(f"memory must be positive, got {text!r}")
        if re.match(r"^\s*[0-9.]+\s*$", text):
            raise InvalidRequest(
                f"memory {text!r} has no unit: write it as e.g. '512MiB' or '20GiB'"
            )
        raise InvalidRequest(f"cannot read memory size {text!r}: write it as e.g. '512MiB'")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _MIB_PER_UNIT:
        raise InvalidRequest(f"unknown memory unit {match.group(2)!r} in {text!r} (use MiB, GiB)")
    mib = number * _MIB_PER_UNIT[unit]
    if mib < 1:
        raise InvalidRequest(f"memory must be at least 1MiB, got {text!r}")
    if abs(mib - round(mib)) > 1e-6:
        # Slices are granted in 1 MiB steps; rounding up never gives less than asked for.
        return int(mib) + 1
    return round(mib)


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


def format_mib(mib: int) -> str:
    """Print MiB the way people read them: whole GiB where exact, else MiB."""
    if mib >= 1024 and mib % 1024 == 0:
        return f"{mib // 1024}GiB"
    if mib >= 10 * 1024:
        return f"{mib / 1024:.1f}GiB"
    return f"{mib}MiB"
