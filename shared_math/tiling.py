"""Tiling policy of the decode / prefill attention kernels (split-K) and the fused write, and the
encode kernels' choice of order statistic for the clip threshold, shared by both runtimes.

Not part of format v1 (it changes no byte); one module so that the Pallas and Triton kernels run
the same tiling by default and the parity backend is timed like for like.

The split-K defaults (about TARGET_SPLITS splits, one page per inner iteration) trade parallel
programs against partial outputs to write and merge ([B, Hkv, S, 16, D] float32). Every default
here names its measurement in benchmarks/DECISIONS.md (rows D1–D18, W1–W5, C1).
"""

from __future__ import annotations

import math
import numbers

from shared_math.float_bits import FP16_MAX_BITS
from shared_math.ptx import BYTES_PER_PAIR
from shared_math.spec import CODES_PER_BYTE

CHANNELS_PER_PAIR_ROW = CODES_PER_BYTE * BYTES_PER_PAIR  # channels a row of 16-bit code pairs holds

TARGET_SPLITS = 128  # splits of the longer page table (INT2 history, or BF16 in a BF16-only cache), about
MIN_TOKENS_PER_SPLIT = 256  # … but no split shorter than this
MIN_DOT_DIM = 16  # M, N, K of a tensor-core dot tile: a block holds at least this many tokens
MERGE_BLOCK_SPLITS = 32  # splits per load of the decode merge kernels …
MERGE_BLOCK_D = 32  # … and columns per merge program: [32, 32] float32 = 4 KB per load; D / 32
#                     programs per kept row, so a batch-1 merge fills more than 32 SMs

# The attention kernels keep scores in base-2 units (softmax scale × log2 e), so that every
# exponential of the online softmax is an exp2: on the GPU one MUFU.EX2, where Pallas's jnp.exp
# lowers to libdevice's accurate __nv_expf, several instructions per element (DECISIONS.md D12).
# The partials' log-sum-exp stays a natural log: lse = (m + log2 l)·ln 2.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def base2_score_scale(softmax_scale: float) -> float:
    """The factor the attention kernels multiply raw q·k by: the softmax scale in base-2 units."""
    return float(softmax_scale) * LOG2E


def next_power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def default_pages_per_block(page_size: int) -> int:
    """Pages per inner iteration: one whole page when it fills a dot tile, else enough pages
    for MIN_DOT_DIM tokens."""
    return max(1, MIN_DOT_DIM // page_size) if isinstance(page_size, int) and page_size > 0 else 1


def default_pages_per_split(table_slots: int, pages_per_block: int, page_size: int) -> int:
    """≈ table_slots / TARGET_SPLITS and ≥ MIN_TOKENS_PER_SPLIT tokens: a power of two
    ≥ pages_per_block. `table_slots` is the longer of a sequence's two page tables: the history
    table in an OSCAR cache, the BF16 table in a cache with no INT2 tier (the BF16 baseline,
    DECISIONS.md D3)."""
    floor = -(-MIN_TOKENS_PER_SPLIT // max(page_size, 1))
    return max(pages_per_block, next_power_of_two(max(floor, -(-table_slots // TARGET_SPLITS))))


# A decode call's INT2 tier with many sequences takes fewer, longer splits: each split costs a
# program's prologue and a partial row to write and merge, worth paying only while the grid needs
# the programs to fill the SMs. The split doubles from default_pages_per_split's while B × Hkv ×
# splits stays ≥ INT2_DECODE_MIN_PROGRAMS (≈ one wave of one-warp programs at 8 per SM on the H200's
# 132) and the split ≤ INT2_DECODE_MAX_SPLIT_TOKENS. Longer splits win at batch 8 and 32; at batch 1
# they leave the grid too few programs (DECISIONS.md D2).
INT2_DECODE_MIN_PROGRAMS = 1024
INT2_DECODE_MAX_SPLIT_TOKENS = 2048


def decode_pages_per_split(history_slots: int, pages_per_block: int, page_size: int, sequence_heads: int) -> int:
    """The INT2 tier's split of a decode call over `sequence_heads` = B × Hkv (sequence, KV head)
    pairs: default_pages_per_split's, doubled while the grid keeps ≥ INT2_DECODE_MIN_PROGRAMS
    programs and a split ≤ INT2_DECODE_MAX_SPLIT_TOKENS tokens."""
    split = default_pages_per_split(history_slots, pages_per_block, page_size)
    while (split < history_slots and 2 * split * page_size <= INT2_DECODE_MAX_SPLIT_TOKENS
           and sequence_heads * num_splits(history_slots, 2 * split) >= INT2_DECODE_MIN_PROGRAMS):
        split *= 2
    return split


def interpreted_tiling(table_slots: int, page_size: int, block_tokens: int) -> tuple[int, int]:
    """(pages_per_split, pages_per_block) of an interpreted (CPU) call whose tiling is left to the
    default: one split of blocks of up to `block_tokens` tokens (never smaller than
    default_pages_per_block, never more pages than the table's next power of two). An interpreter
    pays per program and per inner iteration, not per byte, so the GPU's many small programs are
    its slowest tiling; each runtime picks `block_tokens` against its interpreter's compile cost
    (oscar_jax.kernels.codec.INTERPRET_BLOCK_TOKENS, oscar_torch.kernels.codec.INTERPRET_BLOCK_ROWS)."""
    slots = max(table_slots, 1)
    pages_per_block = max(default_pages_per_block(page_size),
                          min(next_power_of_two(slots), max(1, block_tokens // page_size)))
    return pages_per_block * -(-slots // pages_per_block), pages_per_block


def bf16_tier_pages_per_split(bf16_slots: int, history_slots: int, pages_per_split: int, pages_per_block: int) -> int:
    """Pages per program of the BF16 tier. Without an INT2 tier it holds the context and takes the
    cache's split (`pages_per_split`). Beside an INT2 tier its table holds only the sink and recent
    pages (5 at the defaults with pages of 64): ≈ bf16_slots / TARGET_SPLITS with no token floor, so
    those few pages are read by parallel programs instead of one serial chain of them
    (DECISIONS.md D3)."""
    if history_slots == 0:
        return pages_per_split
    return max(pages_per_block, next_power_of_two(-(-bf16_slots // TARGET_SPLITS)))


def resolve_splits(pages_per_split, pages_per_block, bf16_slots: int, history_slots: int,
                   page_size: int, sequence_heads: int | None = None) -> tuple:
    """(pages_per_split, bf16_pages_per_split, pages_per_block) of a decode / prefill call, the
    defaults filled in for None: the block from the page size, the split from the longer page
    table — for a decode call with an INT2 tier (`sequence_heads` = B × Hkv given) by
    decode_pages_per_split — the BF16 tier's split by bf16_tier_pages_per_split. Values that are
    not positive integers are passed through untouched for the backend's validation to name."""
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(page_size)
    given = (pages_per_block,) if pages_per_split is None else (pages_per_block, pages_per_split)
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1 for x in given):
        return pages_per_split, pages_per_split, pages_per_block
    if pages_per_split is None and sequence_heads and history_slots and history_slots >= bf16_slots:
        pages_per_split = decode_pages_per_split(history_slots, pages_per_block, page_size, sequence_heads)
    elif pages_per_split is None:
        pages_per_split = default_pages_per_split(max(bf16_slots, history_slots), pages_per_block, page_size)
    return (pages_per_split, bf16_tier_pages_per_split(bf16_slots, history_slots, pages_per_split, pages_per_block),
            pages_per_block)


# Tokens per program of the fused write when it rotates bfloat16 rows (three bf16 products per
# block, the parts read once per program): enough tokens to amortise splitting R, few enough to keep
# the program's registers (DECISIONS.md W1).
SPLIT_ROTATION_BLOCK_TOKENS = 64

# Launch of the decode tier kernels, both backends, with rows on the dots' M (the BF16 tier; the INT2
# tier where it cannot take tokens on M): 3 pipeline stages, and 2 warps per program once the tier
# has enough programs (B × Hkv × splits) to fill the SMs with them, else 4. The batched kernel is
# latency-bound: 2-warp programs, more of them per SM, keep more loads in flight; a grid under ~2
# programs an SM needs wider ones (DECISIONS.md D7).
DECODE_NUM_WARPS = 2
DECODE_FEW_PROGRAMS_NUM_WARPS = 4
DECODE_TWO_WARPS_MIN_PROGRAMS = 512  # ≈ 4 per SM on the H200's 132
DECODE_NUM_STAGES = 3


# The INT2 tier's decode scores with the tokens on the dot's M ([L, rows], the codes as its A
# operand) and the GQA rows on its N, padded to INT2_DECODE_MIN_ROWS (mma's n8) instead of 16, in
# one-warp programs: fewer instructions per (token, KV head) — no cross-warp reductions, q's
# fragments reused over a page's tokens. Only on a grid of at least DECODE_TWO_WARPS_MIN_PROGRAMS
# INT2 programs, though: one-warp programs leave a smaller grid's SMs short of warps
# (DECISIONS.md D4).
INT2_DECODE_MIN_ROWS = 8
INT2_DECODE_NUM_WARPS = 1


def int2_decode_tokens_on_m(batch: int, num_kv_heads: int, history_slots: int, pages_per_split: int,
                            page_size: int) -> bool:
    """Whether a decode call's INT2 tier takes its scores with tokens on M in one-warp programs:
    whole pages of ≥ MIN_DOT_DIM tokens and a grid of ≥ DECODE_TWO_WARPS_MIN_PROGRAMS programs;
    otherwise rows on M at default_decode_num_warps."""
    programs = batch * num_kv_heads * num_splits(history_slots, pages_per_split)
    return page_size >= MIN_DOT_DIM and programs >= DECODE_TWO_WARPS_MIN_PROGRAMS


# The INT2 tier's values dot transposed, oᵀ = Vᵀ·(p·s_v): the channels on the dot's M (head_dim /
# (CODES_PER_BYTE · BYTES_PER_PAIR) rows of 16-bit code pairs, read by ldmatrix.trans) and the query
# rows on N, where the scores run with tokens on M: fewer instructions a page and fewer registers
# than the rows on M (DECISIONS.md D5).
def int2_decode_channels_on_m(tokens_on_m: bool, group_size: int, head_dim: int) -> bool:
    """Whether the INT2 tier's values dot can run with the channels on M (`channels_on_m`): its
    scores with tokens on M, one group per row (G ≥ D) and a dot M of head_dim / 8 ≥ MIN_DOT_DIM."""
    return bool(tokens_on_m) and group_size >= head_dim and head_dim // CHANNELS_PER_PAIR_ROW >= MIN_DOT_DIM


def int2_decode_rows(heads_per_kv: int) -> int:
    """Query rows of the INT2 tier's decode programs: the GQA group padded to a power of two ≥
    INT2_DECODE_MIN_ROWS (the rows of the other kernels pad to MIN_DOT_DIM)."""
    return max(INT2_DECODE_MIN_ROWS, next_power_of_two(heads_per_kv))


# The BF16 tier's kernel streams bf16 pages near copy bandwidth and is slower at 3 stages than at 2
# (DECISIONS.md D9).
BF16_TIER_NUM_STAGES = 2


def num_splits(table_slots: int, pages_per_split: int) -> int:
    """Splits a tier's page table is cut into (at least one, so every tier writes a partial)."""
    return max(1, math.ceil(table_slots / pages_per_split))


def default_decode_num_warps(batch: int, num_kv_heads: int, table_slots: int, pages_per_split: int) -> int:
    """Warps per decode program of a tier with `table_slots` page slots per sequence: DECODE_NUM_WARPS
    from DECODE_TWO_WARPS_MIN_PROGRAMS programs, else DECODE_FEW_PROGRAMS_NUM_WARPS (a small grid
    needs wider programs to fill the SMs)."""
    programs = batch * num_kv_heads * num_splits(table_slots, pages_per_split)
    return DECODE_NUM_WARPS if programs >= DECODE_TWO_WARPS_MIN_PROGRAMS else DECODE_FEW_PROGRAMS_NUM_WARPS


def default_decode_launch(batch: int, num_kv_heads: int, bf16_slots: int, history_slots: int,
                          bf16_pages_per_split: int, pages_per_split: int, *,
                          int2_tokens_on_m: bool = True) -> tuple[tuple[int, int], tuple[int, int]]:
    """(num_warps, num_stages) of the BF16 tier's kernel and of the INT2 tier's: the BF16 tier's
    warps from its program count (its slots over its split) and BF16_TIER_NUM_STAGES; the INT2
    tier's DECODE_NUM_STAGES and, with its scores on tokens × rows (`int2_tokens_on_m`),
    INT2_DECODE_NUM_WARPS, else warps from its own program count."""
    int2_warps = (INT2_DECODE_NUM_WARPS if int2_tokens_on_m
                  else default_decode_num_warps(batch, num_kv_heads, history_slots, pages_per_split))
    return ((default_decode_num_warps(batch, num_kv_heads, bf16_slots, bf16_pages_per_split), BF16_TIER_NUM_STAGES),
            (int2_warps, DECODE_NUM_STAGES))


# Triton's maxnreg for its rows-on-M INT2 tier kernel: 128 registers fit 8 two-warp programs an SM
# instead of 6, at the price of a few spilled bytes (DECISIONS.md D8). The Pallas kernel is not
# capped in that layout (not measured capped); its register use came down from the source instead
# (each plane unpacked next to its MMA).
TRITON_INT2_MAX_REGISTERS = 128
# The INT2 tier kernel with its scores and values' dot transposed (tokens and channels on M), both
# backends: XLA's compile of the Pallas kernel holds more registers uncapped than the Triton
# backend's kernel, so fewer one-warp programs fit an SM; capped at 160 both fit 12 (Pallas through
# `oscar_jax.kernels.register_cap`; outputs bit-identical), and both run faster for it
# (DECISIONS.md D6).
INT2_CHANNELS_ON_M_MAX_REGISTERS = 160
MIN_MAX_REGISTERS = 32  # a cap below it leaves a kernel little but spills


def int2_decode_max_registers(tokens_on_m: bool, channels_on_m: bool, rows_on_m: int) -> int:
    """The INT2 tier kernel's default register cap (0: the compiler's choice): with the tokens and
    channels on M INT2_CHANNELS_ON_M_MAX_REGISTERS, with the tokens on M only the compiler's choice,
    with the rows on M the backend's `rows_on_m` (Triton: TRITON_INT2_MAX_REGISTERS; Pallas: 0, not
    measured capped)."""
    if tokens_on_m:
        return INT2_CHANNELS_ON_M_MAX_REGISTERS if channels_on_m else 0
    return rows_on_m


def check_max_registers(max_registers) -> int:
    """A register cap as both backends take it: 0 (the compiler's choice) or an integer ≥ 32."""
    if isinstance(max_registers, bool) or not isinstance(max_registers, int) or not (
            max_registers == 0 or max_registers >= MIN_MAX_REGISTERS):
        raise ValueError(f"max_registers={max_registers!r} must be 0 (the compiler's choice) or an integer "
                         f">= {MIN_MAX_REGISTERS}")
    return int(max_registers)


# The clip threshold τ (the k-th smallest |x| of a row, exact; shared_math.codec.clip_rows) is found
# in the encode kernels without a sort, on the int32 bit patterns of |x|, by one of:
#   max_drop     d − k rounds of a row max and a count of its copies (any rows);
#   bisect       BISECTION_STEPS counts over the candidate patterns (any rows);
#   tagged_max   d − k rounds of a row max over keys |x| bits | column, unique, so no count is
#                needed: for rows that hold bfloat16 values, whose low BF16_DROPPED_BITS are free;
#   checked_max  d − k rounds of a row max over distinct values and one count that proves no tie
#                hid among the largest; a block where one did redoes τ by max_drop (for float32
#                rows, e.g. rotated keys, where ties are rare; bfloat16 rows tie often).
ORDER_STATISTICS = ("max_drop", "bisect", "tagged_max", "checked_max")
# Bisection over the candidates 0 … FP16_MAX_BITS halves the interval each step: ceil(log2(
# FP16_MAX_BITS + 1)) steps leave one candidate.
BISECTION_STEPS = FP16_MAX_BITS.bit_length()


def order_statistic_reductions(method: str, head_dim: int, clip_index: int) -> int:
    """Row reductions a method spends on τ (checked_max: without its rare fallback)."""
    rounds = head_dim - clip_index
    costs = {"max_drop": 2 * rounds, "bisect": BISECTION_STEPS, "tagged_max": rounds, "checked_max": rounds + 1}
    if method not in costs:
        raise ValueError(f"order_statistic={method!r} must be one of {ORDER_STATISTICS}")
    return costs[method]


def select_order_statistic(head_dim: int, clip_index: int, rows_bf16: bool) -> str:
    """The exact method for τ with the fewest row reductions. `rows_bf16`: the encoded rows hold
    bfloat16 values (bfloat16 input, not rotated in the kernel), so tagged_max applies."""
    candidates = ("tagged_max", "bisect") if rows_bf16 else ("checked_max", "bisect")
    return min(candidates, key=lambda m: order_statistic_reductions(m, head_dim, clip_index))


def encode_planes_applies(head_dim: int, group_size: int, levels: str) -> bool:
    """Whether the kernels' `encode_planes` (the encode's common case, rows read as their four
    quarter planes; DECISIONS.md W3) can encode these rows: one group a row, min/max levels."""
    return levels == "minmax" and group_size == head_dim


# Rows (tokens) per program of the encode by planes: the codec's encode_rows and the unrotated
# write; the fastest of 16 / 32 / 64 rows in both backends (DECISIONS.md W4).
ENCODE_PLANES_BLOCK_ROWS = 32
# ... and at least 4: at 2 rows a program the Triton lowering's layout of the [2, Q] planes spills
# (sm_90; 1 row and 4 to 64 rows do not). Extra rows are masked.
ENCODE_PLANES_MIN_BLOCK_ROWS = 4


def planes_block_rows(rows: int, planes: bool) -> int:
    """A launch's rows a program (a power of two) as encode_planes takes them."""
    return max(rows, ENCODE_PLANES_MIN_BLOCK_ROWS) if planes else rows


def resolve_encode_planes(planes: bool | None, head_dim: int, group_size: int, levels: str,
                          rotated: bool = False, rows_bf16: bool = False) -> bool:
    """The launchers' `planes`: None (the default) takes encode_planes wherever it applies to rows
    the kernel does not rotate — faster than encode_block and the same bytes (DECISIONS.md W3) —;
    True insists (check_encode_planes' ValueError where it does not apply), and also takes it for
    bfloat16 rows the kernel rotates (the split rotation by columns: the same bytes, faster in one
    backend and slower in the other, so not the default: DECISIONS.md W5); False never takes it."""
    if planes is None:
        return encode_planes_applies(head_dim, group_size, levels) and not rotated
    if not isinstance(planes, bool):
        raise ValueError(f"planes={planes!r} must be None (where it applies), True or False")
    if planes:
        check_encode_planes(head_dim, group_size, levels, rotated, rows_bf16)
    return planes


def check_encode_planes(head_dim: int, group_size: int, levels: str, rotated: bool = False,
                        rows_bf16: bool = False) -> None:
    """The launchers' check of `planes=True`: a ValueError naming what does not apply. Rows the
    kernel rotates take planes only as bfloat16 rows: their split rotation's products are computed
    plane by plane (four column blocks of R_K); float32 rows' IEEE product is one [R, D] product."""
    if not encode_planes_applies(head_dim, group_size, levels):
        raise ValueError(f"planes=True needs group_size == head_dim and levels='minmax', got "
                         f"{group_size=}, {head_dim=}, {levels=}")
    if rotated and not rows_bf16:
        raise ValueError("planes=True with a rotation needs bfloat16 rows (the split rotation, computed "
                         "plane by plane); got float32 rows: pass rotation=None or bfloat16 rows")


def resolve_order_statistic(order_statistic: str | None, head_dim: int, clip_index: int, *, rows_bf16: bool,
                            rows: str) -> str:
    """The encode launchers' order statistic: `None` picks select_order_statistic's; an explicit
    one is validated. `rows` describes the encoded rows for the error message."""
    if order_statistic is None:
        return select_order_statistic(head_dim, clip_index, rows_bf16)
    if order_statistic not in ORDER_STATISTICS:
        raise ValueError(f"{order_statistic=} must be one of {ORDER_STATISTICS}")
    if order_statistic == "tagged_max" and not rows_bf16:
        raise ValueError(f"order_statistic='tagged_max' needs rows of bfloat16 values, got {rows}")
    return order_statistic
