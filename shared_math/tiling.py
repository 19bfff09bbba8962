"""Split-K tiling policy of the decode / prefill attention kernels, shared by both runtimes.

Not part of format v1 (it changes no byte); one module so that the Pallas and Triton kernels run
the same tiling by default and the parity backend is timed like for like.

Measured on the H200 at 128K context, Qwen3-8B shapes, pages of 64 tokens (benchmarks/NOTES.md,
results/decode_sweep_128k_b1_h200.json): 16 pages per split (128 splits) beat 64 pages by 20 %
at batch 1 and 8, and one page per inner iteration beat four by 20 %; more splits add partial
outputs to write and merge ([B, Hkv, S, 16, D] float32).
"""

from __future__ import annotations

import math

TARGET_SPLITS = 128  # splits of the history table, about
MIN_TOKENS_PER_SPLIT = 256  # … but no split shorter than this
MIN_DOT_DIM = 16  # M, N, K of a tensor-core dot tile: a block holds at least this many tokens


def next_power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def default_pages_per_block(page_size: int) -> int:
    """Pages per inner iteration: one whole page when it fills a dot tile, else enough pages
    for MIN_DOT_DIM tokens."""
    return max(1, MIN_DOT_DIM // page_size) if isinstance(page_size, int) and page_size > 0 else 1


def default_pages_per_split(history_slots: int, pages_per_block: int, page_size: int) -> int:
    """≈ history_slots / TARGET_SPLITS and ≥ MIN_TOKENS_PER_SPLIT tokens: a power of two
    ≥ pages_per_block."""
    floor = -(-MIN_TOKENS_PER_SPLIT // max(page_size, 1))
    return max(pages_per_block, next_power_of_two(max(floor, -(-history_slots // TARGET_SPLITS))))
