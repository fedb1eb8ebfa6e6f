"""The pieces a put from a client's pinned region is copied in: CUDA copies out of registered
host memory only within one registration, so no piece may cross a granule boundary."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpupool.worker.staging import REGISTER_GRANULE_BYTES, granule_pieces

G = REGISTER_GRANULE_BYTES


@given(st.integers(0, 8 * G), st.integers(0, 3 * G))
def test_pieces_cover_the_range_in_order_and_never_cross_a_granule(offset: int, n: int) -> None:
    pieces = granule_pieces(offset, n)
    assert sum(length for _, length in pieces) == n
    at = 0
    for start, length in pieces:
        assert start == at and length > 0
        first, last = (offset + start) // G, (offset + start + length - 1) // G
        assert first == last, "a piece within one granule"
        at += length
    # As few pieces as the granules the range touches.
    touched = 0 if n == 0 else (offset + n - 1) // G - offset // G + 1
    assert len(pieces) == touched


def test_a_range_across_one_boundary_is_two_pieces() -> None:
    assert granule_pieces(G - 10, 30) == [(0, 10), (10, 20)]
    assert granule_pieces(G, 30) == [(0, 30)]
