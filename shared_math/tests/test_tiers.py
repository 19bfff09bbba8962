"""Tier arithmetic: boundaries, page-granular demotion, bytes and bits per element."""

import pytest

from shared_math.spec import OscarConfig
from shared_math.tiers import (
    demotes_on_append,
    ideal_bits_per_element,
    int2_row_bytes,
    kv_bytes_per_layer,
    tier_split,
)

CFG = OscarConfig(head_dim=128)  # G 128, S0 64, W 256, page 16


def test_paper_bits_per_element_at_128k():
    assert round(ideal_bits_per_element(131072, CFG), 4) == 2.2836
    b = kv_bytes_per_layer(131072, CFG, num_kv_heads=8)
    assert round(b.bits_per_element, 4) == 2.2836  # window exactly 256 at this length
    assert b.page_overhead_bytes == 0
    assert int2_row_bytes(CFG) == 36  # 32 code bytes + fp16 scale + fp16 minimum
    assert round(ideal_bits_per_element(32768, CFG), 2) == 2.38
    assert round(ideal_bits_per_element(131072, OscarConfig(head_dim=128, group_size=64)), 2) == 2.53


def test_page_granular_overhead_is_reported_separately():
    length = 131072 + 77  # 13 tokens past a page boundary: recent = 256 + 13, last page 3 slots empty
    b = kv_bytes_per_layer(length, CFG)
    split = b.split
    assert split.recent_tokens == 256 + (77 % 16)
    assert b.bits_per_element > ideal_bits_per_element(length, CFG)
    assert b.page_overhead_bytes == 2 * (16 - 13) * 256  # 3 empty slots of the last recent page, K and V


@pytest.mark.parametrize(
    "length,sink,history,recent",
    [
        (0, 0, 0, 0), (1, 1, 0, 0), (63, 63, 0, 0), (64, 64, 0, 0), (65, 64, 0, 1),
        (319, 64, 0, 255), (320, 64, 0, 256), (321, 64, 0, 257), (335, 64, 0, 271),
        (336, 64, 16, 256), (337, 64, 16, 257), (351, 64, 16, 271), (352, 64, 32, 256),
    ],
)
def test_split_at_the_edges(length, sink, history, recent):
    s = tier_split(length, CFG)
    assert (s.sink_tokens, s.history_tokens, s.recent_tokens) == (sink, history, recent)
    assert s.history_pages == history // 16 and s.sink_pages == -(-sink // 16)
    assert s.recent_pages == -(-recent // 16)


def test_token_by_token_equals_prefill_and_window_stays_in_bounds():
    history = 0
    for length in range(1, 1200):
        if demotes_on_append(length - 1, CFG):
            history += CFG.page_size
        s = tier_split(length, CFG)
        assert s.history_tokens == history
        if length >= CFG.sink + CFG.recent:
            assert CFG.recent <= s.recent_tokens <= CFG.recent + CFG.page_size - 1
        assert [s.tier_of(p) for p in (0, length - 1)][0] == "sink"
    assert demotes_on_append(335, CFG) and not demotes_on_append(334, CFG)


def test_tier_of_positions():
    s = tier_split(400, CFG)
    assert s.tier_of(63) == "sink" and s.tier_of(64) == "history"
    assert s.tier_of(s.recent_start - 1) == "history" and s.tier_of(s.recent_start) == "recent"
    with pytest.raises(ValueError, match="position=400"):
        s.tier_of(400)


def test_no_windows_config():
    cfg = OscarConfig(head_dim=64, sink=0, recent=0)
    s = tier_split(37, cfg)
    assert (s.sink_tokens, s.history_tokens, s.recent_tokens) == (0, 32, 5)


def test_bad_input():
    with pytest.raises(ValueError, match="length=-1"):
        tier_split(-1, CFG)
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        kv_bytes_per_layer(10, CFG, num_kv_heads=0)


def test_per_channel_key_pages_bytes():
    """Format v2 key pages: page·d/4 code bytes + an fp16 scale and minimum per channel."""
    from shared_math.tiers import int2_key_page_bytes, int2_row_bytes

    channel = OscarConfig(head_dim=128, page_size=64, key_layout="channel")  # G = 128 for values
    assert int2_key_page_bytes(channel) == 64 * 32 + 2 * 128 * 2 == 2560  # 2.5 bits a key element
    assert int2_key_page_bytes(OscarConfig(head_dim=128, page_size=64)) == 64 * int2_row_bytes(channel) == 64 * 36
    # 128K: sink + recent 320 tokens BF16, the rest keys 2.5 + values 2.25 bits
    ideal = (320 * 16 + (131072 - 320) * (2.5 + 2.25) / 2) / 131072
    assert ideal_bits_per_element(131072, channel) == pytest.approx(ideal, rel=1e-12)
    stored = kv_bytes_per_layer(131072, channel, num_kv_heads=2)
    history = (131072 - 64 - 256) // 64 * 64  # whole pages of 64 past the windows
    bf16_rows = 131072 - history
    assert stored.stored_bytes == 2 * (2 * bf16_rows * 256 + history // 64 * 2560 + history * 36)
    # at d = G = page = 64 both layouts store the same bytes (2.533 bits, calibration/HISTORY.md run 14)
    same = dict(head_dim=64, group_size=64, page_size=64)
    assert (kv_bytes_per_layer(131072, OscarConfig(**same, key_layout="channel")).stored_bytes
            == kv_bytes_per_layer(131072, OscarConfig(**same)).stored_bytes)
    assert round(kv_bytes_per_layer(131072, OscarConfig(**same, key_layout="channel")).bits_per_element, 3) == 2.533
