"""Sizes and shares as people write them: `20GiB`, `512MiB`, `25%`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.core.errors import InvalidRequest
from gpupool.core.units import format_mib, parse_compute_pct, parse_memory_mib


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("512MiB", 512),
        ("20GiB", 20 * 1024),
        ("1.5GiB", 1536),
        ("1TiB", 1024 * 1024),
        ("512Mi", 512),
        ("2Gi", 2048),
        ("4G", 4096),
        ("  8 GiB  ", 8192),
        ("20gib", 20 * 1024),
        ("1MiB", 1),
    ],
)
def test_memory_sizes_parse_to_whole_mib(text: str, mib: int) -> None:
    assert parse_memory_mib(text) == mib


def test_decimal_units_round_up_to_the_next_whole_mib() -> None:
    # 1 GB = 953.67 MiB: a slice is never smaller than what was asked for.
    assert parse_memory_mib("1GB") == 954
    assert parse_memory_mib("2MB") == 2


def test_fractional_mib_rounds_up() -> None:
    assert parse_memory_mib("1.5MiB") == 2


def test_memory_without_a_unit_is_refused_with_a_hint_about_the_unit() -> None:
    with pytest.raises(InvalidRequest, match="unit"):
        parse_memory_mib("512")


def test_negative_memory_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="positive"):
        parse_memory_mib("-1GiB")


@pytest.mark.parametrize("text", ["0MiB", "0GiB", "0.5MiB", "1MB"])
def test_memory_below_one_mib_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest, match="at least 1MiB"):
        parse_memory_mib(text)


@pytest.mark.parametrize("text", ["", "GiB", "lots", "1.5.GiB", "12 GiB extra", "1e3MiB"])
def test_unreadable_memory_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest, match="cannot read"):
        parse_memory_mib(text)


def test_unknown_memory_unit_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequest, match="unknown memory unit 'furlongs'"):
        parse_memory_mib("3furlongs")


@pytest.mark.parametrize(("text", "pct"), [("25%", 25), (" 100 % ", 100), ("1%", 1), ("50", 50)])
def test_compute_shares_parse_from_text(text: str, pct: int) -> None:
    assert parse_compute_pct(text) == pct


def test_compute_share_accepts_an_int() -> None:
    assert parse_compute_pct(25) == 25


@pytest.mark.parametrize("value", ["0%", "101%", 0, 101, -5])
def test_compute_share_outside_1_to_100_is_refused(value: str | int) -> None:
    with pytest.raises(InvalidRequest, match=r"1\.\.100"):
        parse_compute_pct(value)


@pytest.mark.parametrize("text", ["", "a quarter", "25.5%", "-5%", "%"])
def test_unreadable_compute_share_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest, match="cannot read compute share"):
        parse_compute_pct(text)


@pytest.mark.parametrize(
    ("mib", "text"),
    [
        (0, "0MiB"),
        (512, "512MiB"),
        (1024, "1GiB"),
        (1536, "1536MiB"),
        (20 * 1024, "20GiB"),
        (10 * 1024 + 512, "10.5GiB"),
        (80 * 1024, "80GiB"),
    ],
)
def test_format_mib_prints_whole_gib_where_exact(mib: int, text: str) -> None:
    assert format_mib(mib) == text


@given(st.integers(min_value=1, max_value=10 * 1024 - 1))
def test_small_sizes_survive_format_then_parse(mib: int) -> None:
    assert parse_memory_mib(format_mib(mib)) == mib


@given(st.integers(min_value=1, max_value=4096))
def test_whole_gib_sizes_survive_format_then_parse(gib: int) -> None:
    assert parse_memory_mib(format_mib(gib * 1024)) == gib * 1024
