"""Cache-tier arithmetic: which positions are sink / history / recent, when pages demote, and bytes.

Tiers of a sequence of length L (DESIGN.md §2 "Tiers"):
  sink    [0, min(L, S0))              BF16, never demoted
  history [S0, S0 + H)                 INT2, H a multiple of the page size
  recent  [S0 + H, L)                  BF16
Demotion is page-granular: when the recent window reaches W + page tokens, its oldest page is
quantized into one INT2 page, so after any step the window holds W … W + page − 1 tokens (fewer
only while the sequence is short). The split is a function of L alone, so a prompt prefilled at
once lands exactly where token-by-token decoding would have put it.
"""

from __future__ import annotations

import dataclasses

from shared_math.spec import BF16_BYTES, CODES_PER_BYTE, METADATA_BYTES, OscarConfig


def _check_length(length: int) -> None:
    if not isinstance(length, int) or length < 0:
        raise ValueError(f"sequence {length=} must be a non-negative integer")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class TierSplit:
    """Token counts and page counts of each tier for one sequence."""

    length: int
    sink_tokens: int
    history_tokens: int
    recent_tokens: int
    page_size: int

    @property
    def history_start(self) -> int:
        return self.sink_tokens

    @property
    def recent_start(self) -> int:
        return self.sink_tokens + self.history_tokens

    @property
    def sink_pages(self) -> int:
        return _ceil_div(self.sink_tokens, self.page_size)

    @property
    def history_pages(self) -> int:
        return self.history_tokens // self.page_size

    @property
    def recent_pages(self) -> int:
        return _ceil_div(self.recent_tokens, self.page_size)

    @property
    def bf16_pages(self) -> int:
        return self.sink_pages + self.recent_pages

    def tier_of(self, position: int) -> str:
        if not 0 <= position < self.length:
            raise ValueError(f"{position=} outside the sequence of length {self.length}")
        if position < self.history_start:
            return "sink"
        return "history" if position < self.recent_start else "recent"


def tier_split(length: int, config: OscarConfig) -> TierSplit:
    """Tier boundaries for a sequence of `length` tokens."""
    _check_length(length)
    sink = min(length, config.sink)
    demotions = max(0, (length - config.sink - config.recent) // config.page_size)
    history = demotions * config.page_size
    return TierSplit(length, sink, history, length - sink - history, config.page_size)


def demotes_on_append(length: int, config: OscarConfig) -> bool:
    """True when appending token number `length` (0-based) makes the oldest recent page demote.

    That is exactly when the split after the append holds one more history page than before.
    """
    _check_length(length)
    return tier_split(length + 1, config).history_pages > tier_split(length, config).history_pages


def int2_row_bytes(config: OscarConfig) -> int:
    """Bytes of one INT2 token-head row: d/4 code bytes + (d/G) fp16 scales and minimums."""
    return config.head_dim // CODES_PER_BYTE + 2 * config.groups_per_row * METADATA_BYTES


def int2_key_page_bytes(config: OscarConfig) -> int:
    """Bytes of one INT2 key page of one head: rows as values are stored (key_layout "token"), or
    (format v2, "channel") page·d/4 code bytes + an fp16 scale and minimum per channel."""
    if config.key_layout == "token":
        return config.page_size * int2_row_bytes(config)
    return config.page_size * config.packed_row_bytes + 2 * config.head_dim * METADATA_BYTES


def bf16_row_bytes(config: OscarConfig) -> int:
    return config.head_dim * BF16_BYTES


@dataclasses.dataclass(frozen=True)
class KVBytes:
    """Bytes of K and V for one layer (all KV heads) of one sequence."""

    split: TierSplit
    num_kv_heads: int
    head_dim: int
    stored_bytes: int  # rows actually holding tokens
    allocated_bytes: int  # whole pages, as the page pools hold them

    @property
    def elements(self) -> int:
        return 2 * self.split.length * self.num_kv_heads * self.head_dim  # K and V

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.stored_bytes / self.elements if self.elements else 0.0

    @property
    def allocated_bits_per_element(self) -> float:
        return 8.0 * self.allocated_bytes / self.elements if self.elements else 0.0

    @property
    def page_overhead_bytes(self) -> int:
        return self.allocated_bytes - self.stored_bytes


def kv_bytes_per_layer(length: int, config: OscarConfig, num_kv_heads: int = 1) -> KVBytes:
    """Exact OSCAR KV bytes of one layer: stored rows, and whole allocated pages."""
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"{num_kv_heads=} must be a positive integer")
    split = tier_split(length, config)
    bf16 = bf16_row_bytes(config)
    # history is whole pages, so its stored and allocated bytes agree
    history = split.history_pages * (int2_key_page_bytes(config) + config.page_size * int2_row_bytes(config))
    stored = 2 * (split.sink_tokens + split.recent_tokens) * bf16 + history  # K and V
    allocated = 2 * split.bf16_pages * config.page_size * bf16 + history
    return KVBytes(split, num_kv_heads, config.head_dim, num_kv_heads * stored, num_kv_heads * allocated)


def bf16_kv_bytes_per_layer(length: int, head_dim: int, num_kv_heads: int = 1) -> int:
    """Bytes of the same K and V held entirely in BF16 (the comparison the runtime prints)."""
    _check_length(length)
    return 2 * num_kv_heads * length * head_dim * BF16_BYTES


def ideal_bits_per_element(length: int, config: OscarConfig) -> float:
    """Token-exact figure of the paper: exactly sink + recent BF16 tokens, the rest INT2.

    (S0 + W)·16 + (L − S0 − W)·bits_int2, over L. Reproduces 2.2836 at d = G = 128, L = 131072.
    """
    _check_length(length)
    if length == 0:
        return 0.0
    bf16_tokens = min(length, config.sink + config.recent)
    key_bits = 8.0 * int2_key_page_bytes(config) / (config.page_size * config.head_dim)
    int2_bits = (key_bits + 8.0 * int2_row_bytes(config) / config.head_dim) / 2  # K and V
    return (bf16_tokens * 8.0 * BF16_BYTES + (length - bf16_tokens) * int2_bits) / length
