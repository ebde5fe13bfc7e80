"""bench/tune_moe.py's candidate space (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from bench.tune_moe import _next_pow2, block_m_choices


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 63, 64, 65, 1000])
def test_next_pow2_matches_the_definition(n: int) -> None:
    p = _next_pow2(n)
    assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


def test_decode_sizes_keep_only_short_tiles() -> None:
    # Mixtral T=8: 2 pairs per expert; a 128-row tile would be almost all padding
    assert block_m_choices(8 * 2 / 8, quick=True) == [16]
    assert block_m_choices(8 * 2 / 8, quick=False) == [16]


def test_quick_drops_tiles_far_shorter_than_an_experts_rows() -> None:
    assert block_m_choices(64, quick=False) == [16, 32, 64, 128]  # Mixtral T=256
    assert block_m_choices(64, quick=True) == [16, 32, 64, 128]
    assert block_m_choices(128, quick=True) == [32, 64, 128]  # T=512
    assert block_m_choices(256, quick=True) == [64, 128]  # T=1024
    assert block_m_choices(2048, quick=True) == [128]  # T=8192: nothing within 4 blocks, the tallest tile
