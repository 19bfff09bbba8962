"""The INT2 tier's fallback for groups narrower than D/4 (a bit plane spans several groups): each
K/V tile dequantized in registers and multiplied as float32. Launched by `int2_tier.int2_tier_partials`."""

from __future__ import annotations

import triton
import triton.language as tl

from oscar_torch.kernels.codec import CODES_PER_BYTE_C, decode_block
from oscar_torch.kernels.decode_attention.common import (
    MASK_VALUE_C, _output_rows, _query_rows, dot_f32, dot_operand, online_softmax_step, store_partial,
)



@triton.jit
def _load_int2_tile(codes_ptr, scale_ptr, minimum_ptr, page, h, offset, valid,
                    NUM_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
                    GROUP_SIZE: tl.constexpr):
    """The dequantized rows [N, D] float32 of tokens (page[n], h, offset[n]); masked tokens → 0."""
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    NUM_GROUPS: tl.constexpr = D // GROUP_SIZE
    row = (page.to(tl.int64) * NUM_HEADS + h) * PAGE_SIZE + offset  # [N]
    codes = tl.load(codes_ptr + row[:, None] * QUARTER + tl.arange(0, QUARTER)[None, :]).to(tl.int32)
    group = row[:, None] * NUM_GROUPS + tl.arange(0, NUM_GROUPS)[None, :]
    # Masked rows may be stale memory (NaN metadata): zero them before use.
    scale = tl.where(valid[:, None], tl.load(scale_ptr + group).to(tl.float32), 0.0)
    minimum = tl.where(valid[:, None], tl.load(minimum_ptr + group).to(tl.float32), 0.0)
    return decode_block(codes, scale, minimum, GROUP_SIZE)


@triton.jit
def _int2_tier_dequantizing_kernel(
    page_table_ptr, history_tokens_ptr, q_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr,
    v_min_ptr, o_ptr, lse_ptr, table_slots,
    NUM_HEADS: tl.constexpr,
    ROWS: tl.constexpr,  # M: rows of the partials, a multiple of BLOCK_M
    Q_ROWS: tl.constexpr,  # rows of q (≤ M): rows beyond are read as zero queries
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
    PAGES_PER_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SCORE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    Q_BF16: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
):
    """Groups narrower than D/4 (a bit plane spans several groups): dequantize each K/V tile in
    registers (x̂ = m + c·s, `decode_block`) and run float32 dots on it. Same arguments as
    `_int2_tier_kernel`."""
    b, h = tl.program_id(0), tl.program_id(1)
    row_block, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    BLOCK_N: tl.constexpr = PAGES_PER_BLOCK * PAGE_SIZE

    n_history = tl.load(history_tokens_ptr + b)
    first_slot = split * PAGES_PER_SPLIT
    last_slot = tl.minimum(first_slot + PAGES_PER_SPLIT, tl.cdiv(n_history, PAGE_SIZE))
    num_blocks = tl.maximum(tl.cdiv(last_slot - first_slot, PAGES_PER_BLOCK), 0)

    token = tl.arange(0, BLOCK_N)
    offset = token % PAGE_SIZE  # [N]
    slot_in_block = token // PAGE_SIZE  # [N]
    q = _query_rows(q_ptr, b, h, row_block, NUM_HEADS, Q_ROWS, D, BLOCK_M, Q_BF16)  # [BLOCK_M, D]

    o = tl.zeros((BLOCK_M, D), tl.float32)
    m = tl.full((BLOCK_M,), MASK_VALUE_C, tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    for i in range(0, PAGES_PER_SPLIT // PAGES_PER_BLOCK):  # static trip count (see bf16_tier.py)
        if i < num_blocks:
            slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
            valid = (slot * PAGE_SIZE + offset < n_history) & (slot < table_slots)  # [N]
            page = tl.load(page_table_ptr + b * table_slots + slot, mask=valid, other=0)
            k = _load_int2_tile(k_codes_ptr, k_scale_ptr, k_min_ptr, page, h, offset, valid,
                                NUM_HEADS, PAGE_SIZE, D, GROUP_SIZE)  # [N, D]
            scores = dot_f32(q, tl.trans(k), False, False) * SCORE_SCALE  # [BLOCK_M, N]
            p, correction, m, l = online_softmax_step(scores, valid[None, :], m, l)
            v = _load_int2_tile(v_codes_ptr, v_scale_ptr, v_min_ptr, page, h, offset, valid,
                                NUM_HEADS, PAGE_SIZE, D, GROUP_SIZE)
            p = dot_operand(p, Q_BF16, False)
            o = o * correction[:, None] + dot_f32(p, v, False, False)

    out_row = _output_rows(b, h, split, row_block, NUM_HEADS, NUM_SPLITS, ROWS, BLOCK_M)
    store_partial(o_ptr, lse_ptr, o, m, l, out_row, D)

