"""What the Triton tier kernels (and the prefill kernel) share: the mask value, the dots, the
online-softmax steps, the query rows read and the partials stored."""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from oscar_torch.kernels.codec import load_rows_f32, round_to_bf16
from shared_math.tiling import LN2

# Scores of masked tokens. Finite (not −inf), so that a block with no valid token keeps the
# running maximum finite and exp(m_old − m_new) never becomes exp(−inf + inf) = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MASK_VALUE_C = tl.constexpr(MASK_VALUE)
LN2_C = tl.constexpr(LN2)
# `tl.dot` needs M, N, K ≥ 16 (mma tile); blocks are sized to respect it.
MIN_DOT_DIM = 16
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


@triton.jit
def dot_operand(x, BF16_DOTS: tl.constexpr, TENSOR_CORES: tl.constexpr):
    """A float32 tile as a dot operand: itself, or rounded to bfloat16 (the package docstring, Precision)."""
    if BF16_DOTS:
        if TENSOR_CORES:
            return x.to(tl.bfloat16)  # round-to-nearest-even on the GPU
        else:
            return round_to_bf16(x)
    else:
        return x


@triton.jit
def dot_f32(a, b, BF16_DOTS: tl.constexpr, TENSOR_CORES: tl.constexpr):
    """a [M, C] · b [C, N] → float32 [M, N]: bf16 tensor-core dot, or IEEE float32 (no TF32)."""
    if BF16_DOTS and TENSOR_CORES:
        return tl.dot(a, b, out_dtype=tl.float32)
    else:
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def online_softmax_step(scores, valid, m_prev, l_prev, TOKEN_AXIS: tl.constexpr = 1):
    """One online-softmax step on a [M, N] score tile (or [N, M] with TOKEN_AXIS 0: tokens on the
    dots' M) in base-2 units (`shared_math.tiling.base2_score_scale`); `valid` broadcasts to it.

    Returns (p, correction, m_new, l_new). Masked entries get p = 0 exactly, even while a row
    has seen no valid score yet (then m stays MASK_VALUE and exp2(scores − m) would be 1).
    """
    scores = tl.where(valid, scores, MASK_VALUE_C)
    m_new = tl.maximum(m_prev, tl.max(scores, axis=TOKEN_AXIS))
    correction = tl.exp2(m_prev - m_new)
    p = tl.where(valid, tl.exp2(scores - tl.expand_dims(m_new, TOKEN_AXIS)), 0.0)
    l_new = l_prev * correction + tl.sum(p, axis=TOKEN_AXIS)
    return p, correction, m_new, l_new


@triton.jit
def natural_lse(m, l, nonempty):
    """log Σ exp(score) of rows whose running maximum m is in base-2 units; −inf where empty."""
    return tl.where(nonempty, (m + tl.log2(tl.where(nonempty, l, 1.0))) * LN2_C, float("-inf"))


@triton.jit
def store_partial(o_ptr, lse_ptr, o, m, l, out_row, D: tl.constexpr):
    """Normalise and store a finished partial: o [M, D] at rows out_row [M] of a [·, D] output;
    rows that saw no token get o = 0 and lse = −inf (natural log; m in base-2 units)."""
    nonempty = l > 0.0
    inv_l = 1.0 / tl.where(nonempty, l, 1.0)
    lse = natural_lse(m, l, nonempty)
    tl.store(o_ptr + out_row[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :], o * inv_l[:, None])
    tl.store(lse_ptr + out_row, lse)


@triton.jit
def _query_rows(q_ptr, b, h, row_block, NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, Q_BF16: tl.constexpr):
    """Query rows [BLOCK_M, D] float32 of (b, h), block row_block of q [B, K, ROWS, D]; rows ≥ ROWS → 0."""
    row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    start = ((b * NUM_HEADS + h) * ROWS + row).to(tl.int64) * D
    return load_rows_f32(q_ptr + start[:, None] + tl.arange(0, D)[None, :], row[:, None] < ROWS, Q_BF16)


@triton.jit
def _output_rows(b, h, split, row_block, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row indices [BLOCK_M] into the flattened partials o [B, K, S, M] (·D) / lse [B, K, S, M]."""
    return ((b * NUM_HEADS + h) * NUM_SPLITS + split) * ROWS + row_block * BLOCK_M + tl.arange(0, BLOCK_M)


def partial_rows(q_rows: int, block_m: int) -> int:
    """Rows M of a tier's partials for q of q_rows rows: padded to whole row blocks. The kernels
    read the missing rows as zero queries, so callers pass q unpadded (no pad or copy kernel a
    call: benchmarks/DECISIONS.md D18)."""
    return -(-q_rows // block_m) * block_m

