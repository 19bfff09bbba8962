"""The decode merge: the exact softmax over both tiers' splits, in one pass per kept query row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_torch.kernels.codec import interpreting
from oscar_torch.kernels.decode_attention.common import DEFAULT_NUM_WARPS
from shared_math.tiling import MERGE_BLOCK_D, MERGE_BLOCK_SPLITS



@triton.jit
def _tier_max_lse(lse_ptr, b, h, row, num_splits: tl.constexpr, m, NUM_HEADS: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """max(m, max_s lse[b, h, s, row]) over one tier's splits."""
    for start in range(0, num_splits, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_ptr + ((b * NUM_HEADS + h) * num_splits + s) * ROWS + row, mask=s < num_splits,
                      other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, axis=0))
    return m


@triton.jit
def _tier_weighted_sum(o_ptr, lse_ptr, b, h, row, column, num_splits: tl.constexpr, lse_max, acc, total,
                       NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """acc + Σ_s exp(lse_s − lse_max)·o_s[column] and total + Σ_s exp(lse_s − lse_max) over one tier."""
    for start in range(0, num_splits, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        inside = s < num_splits
        split_row = (b * NUM_HEADS + h) * num_splits + s  # [BLOCK_S]
        lse = tl.load(lse_ptr + split_row * ROWS + row, mask=inside, other=float("-inf"))
        weight = tl.exp(lse - lse_max)  # 0 for empty splits (lse = −inf)
        o = tl.load(o_ptr + (split_row.to(tl.int64) * ROWS + row)[:, None] * D + column[None, :],
                    mask=inside[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
        acc += tl.sum(tl.where(weight[:, None] > 0.0, weight[:, None] * o, 0.0), axis=0)
        total += tl.sum(weight, axis=0)
    return acc, total


@triton.jit
def _merge_tiers_kernel(
    o_a_ptr, lse_a_ptr,  # [B, K, Sa, M, D], [B, K, Sa, M] float32: one tier's partials
    o_b_ptr, lse_b_ptr,  # [B, K, Sb, M, D], [B, K, Sb, M] float32: the other's
    out_ptr,  # [B, K, R, D] float32
    SPLITS_A: tl.constexpr,  # static like the tier kernels' NUM_SPLITS (and a loop bound the
    SPLITS_B: tl.constexpr,  # interpreter accepts)
    NUM_HEADS: tl.constexpr,
    ROWS_A: tl.constexpr,  # M_a, M_b: the padded rows of each tier's partials
    ROWS_B: tl.constexpr,
    VALID_ROWS: tl.constexpr,  # R ≤ M_a, M_b: the rows kept
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns of one program
):
    """One program per (b, KV head, kept row, column block): `attention_ops.merge_partials` over
    the splits of both tiers, without concatenating them; rows every split left empty get 0."""
    b, h = tl.program_id(0), tl.program_id(1)
    row, column_block = tl.program_id(2) // (D // BLOCK_D), tl.program_id(2) % (D // BLOCK_D)
    column = column_block * BLOCK_D + tl.arange(0, BLOCK_D)
    lse_max = tl.max(tl.full((BLOCK_S,), float("-inf"), tl.float32), axis=0)  # a scalar tensor: loop-carried
    lse_max = _tier_max_lse(lse_a_ptr, b, h, row, SPLITS_A, lse_max, NUM_HEADS, ROWS_A, BLOCK_S)
    lse_max = _tier_max_lse(lse_b_ptr, b, h, row, SPLITS_B, lse_max, NUM_HEADS, ROWS_B, BLOCK_S)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    total = tl.sum(tl.zeros((BLOCK_S,), tl.float32), axis=0)
    acc, total = _tier_weighted_sum(o_a_ptr, lse_a_ptr, b, h, row, column, SPLITS_A, lse_max, acc, total,
                                    NUM_HEADS, ROWS_A, D, BLOCK_S)
    acc, total = _tier_weighted_sum(o_b_ptr, lse_b_ptr, b, h, row, column, SPLITS_B, lse_max, acc, total,
                                    NUM_HEADS, ROWS_B, D, BLOCK_S)
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + ((b * NUM_HEADS + h) * VALID_ROWS + row).to(tl.int64) * D + column, out)


def merge_tier_partials(o_a, lse_a, o_b, lse_b, valid_rows: int, block_splits: int = MERGE_BLOCK_SPLITS,
                        block_d: int | None = None):
    """Merge the partials of two tiers (same B, K, D; any split counts and padded rows M_a, M_b ≥
    valid_rows) into o float32[B, K, valid_rows, D], keeping rows [0, valid_rows). Inputs are
    validated by the public op."""
    batch, num_kv_heads, splits_a, rows, head_dim = o_a.shape
    # None: MERGE_BLOCK_D columns per program on the GPU (parallelism); whole rows under the
    # interpreter, which runs programs one after another.
    block_d = min(block_d or (head_dim if interpreting() else MERGE_BLOCK_D), head_dim)
    assert o_b.shape[:2] == (batch, num_kv_heads) and o_b.shape[4] == head_dim
    assert valid_rows <= min(rows, o_b.shape[3])
    assert head_dim % block_d == 0
    out = torch.empty((batch, num_kv_heads, valid_rows, head_dim), dtype=torch.float32, device=o_a.device)
    _merge_tiers_kernel[(batch, num_kv_heads, valid_rows * (head_dim // block_d))](
        o_a, lse_a, o_b, lse_b, out, SPLITS_A=splits_a, SPLITS_B=o_b.shape[2],
        NUM_HEADS=num_kv_heads, ROWS_A=rows, ROWS_B=o_b.shape[3], VALID_ROWS=valid_rows, D=head_dim, BLOCK_S=block_splits,
        BLOCK_D=block_d, num_warps=DEFAULT_NUM_WARPS,
    )
    return out

