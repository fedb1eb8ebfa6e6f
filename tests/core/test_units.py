"""Sizes and shares as people write them: `20GiB`, `512MiB`, `25%`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.core.errors import InvalidRequest
from gpupool.core.units import (
    MIB,
    describe_memory,
    format_mib,
    format_size,
    parse_compute_pct,
    parse_memory_bytes,
    parse_memory_mib,
    proportional_compute_pct,
)


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("512MiB", 512),
        ("20GiB", 20 * 1024),
        ("1.5GiB", 1536),
        ("1TiB", 1024 * 1024),
        ("512Mi", 512),
        ("2Gi", 2048),
        ("4Gi", 4096),
        ("20GIB", 20 * 1024),
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


# ---- Kubernetes' units: G is 10^9 bytes, Gi is 2^30 ----------------------------------------

DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


@pytest.mark.parametrize(
    ("text", "mib"),
    [("20G", 19074), ("20GB", 19074), ("20gb", 19074), ("20Gi", 20480), ("20gib", 20480)],
)
def test_g_and_gb_are_decimal_and_gi_and_gib_binary(text: str, mib: int) -> None:
    assert parse_memory_mib(text) == mib


@given(
    st.integers(min_value=1, max_value=10**6),
    st.sampled_from(sorted({**DECIMAL, **BINARY})),
    st.booleans(),
    st.booleans(),
)
def test_every_unit_means_its_power_in_any_case_with_or_without_b(
    number: int, unit: str, with_b: bool, upper: bool
) -> None:
    written = unit + ("B" if with_b else "")
    written = written.upper() if upper else written
    if written in ("m", "g", "t"):
        return  # the ambiguous lone letters, refused below
    expected = number * {**DECIMAL, **BINARY}[unit]
    assert parse_memory_bytes(f"{number}{written}") == expected
    if expected >= MIB:
        mib = parse_memory_mib(f"{number}{written}")
        assert (mib - 1) * MIB < expected <= mib * MIB, "rounded up to the next whole MiB"


@pytest.mark.parametrize("text", ["512m", "8g", "1t"])
def test_a_lone_lowercase_m_g_or_t_is_refused_as_ambiguous(text: str) -> None:
    with pytest.raises(InvalidRequest, match="ambiguous"):
        parse_memory_mib(text)


@given(st.integers(min_value=1, max_value=1 << 22))
def test_the_size_understood_is_said_back_in_gib(mib: int) -> None:
    said = describe_memory(f"{mib}Mi")
    assert said.startswith(f"{mib}Mi = ")
    assert said.endswith(" GiB" if mib >= 1024 else " MiB")


def test_twenty_gb_is_said_back_as_eighteen_point_six_gib() -> None:
    assert describe_memory("20GB") == "20GB = 18.6 GiB"
    assert format_size(80 * 1024) == "80 GiB"
    assert format_size(512) == "512 MiB"


def test_a_huge_or_long_size_is_refused_in_a_short_message() -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_memory_mib("9" * 120_000 + "Gi")
    assert len(str(refused.value)) < 200


@given(st.integers(min_value=1, max_value=1 << 21), st.integers(min_value=1024, max_value=1 << 21))
def test_proportional_compute_is_the_same_part_of_the_gpu_rounded_up(
    memory: int, gpu_memory: int
) -> None:
    pct = proportional_compute_pct(memory, gpu_memory)
    assert 1 <= pct <= 100
    if memory <= gpu_memory:
        assert pct * gpu_memory >= memory * 100, "never less than the memory's part"
        assert (pct - 1) * gpu_memory < memory * 100 or pct == 1


def test_one_gib_of_an_80_gib_gpu_takes_2_percent_of_its_compute() -> None:
    assert proportional_compute_pct(1024, 80 * 1024) == 2


def test_a_quota_is_said_in_words_never_as_a_repr() -> None:
    from gpupool.core.model import Quota, quota_text

    assert quota_text(Quota()) == "no limits"
    said = quota_text(Quota(max_gpus=1, max_memory_mib=40 * 1024, max_leases=3))
    assert said == "at most 1 GPU, 40 GiB of memory, 3 leases"
    assert "None" not in quota_text(Quota(max_compute_pct=150, guaranteed_gpus=0.5))
