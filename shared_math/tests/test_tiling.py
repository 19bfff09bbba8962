"""The split-K tiling policy both runtimes use by default (shared_math.tiling)."""

import pytest

from shared_math.tiling import default_pages_per_block, default_pages_per_split


@pytest.mark.parametrize("page_size,expected", [(64, 1), (16, 1), (8, 2), (4, 4), (1, 16)])
def test_pages_per_block_fills_a_dot_tile(page_size, expected):
    assert default_pages_per_block(page_size) == expected
    assert default_pages_per_block(page_size) * page_size >= 16


@pytest.mark.parametrize(
    "history_slots,pages_per_block,page_size,expected",
    [
        (2043, 1, 64, 16),  # 128K context, pages of 64: 128 splits of 16 pages (the H200 sweep's best)
        (507, 1, 64, 4),  # 32K: the 256-token floor
        (123, 1, 64, 4),  # 8K: the floor again
        (6250, 1, 16, 64),  # 100K with pages of 16: ≈ 98 splits of 1024 tokens
        (3, 4, 16, 16),  # a short table: never below the floor, never below pages_per_block
        (0, 2, 8, 32),
    ],
)
def test_pages_per_split(history_slots, pages_per_block, page_size, expected):
    got = default_pages_per_split(history_slots, pages_per_block, page_size)
    assert got == expected
    assert got & (got - 1) == 0 and got >= pages_per_block


@pytest.mark.parametrize("batch,expected", [(1, 4), (2, 4), (7, 4), (8, 2), (32, 2)])
def test_num_warps_drops_to_two_from_batch_eight(batch, expected):
    from shared_math.tiling import default_num_warps

    assert default_num_warps(batch) == expected
