"""The BF16 tier's split-K kernel (the sink and recent pages) and its launcher."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_torch.kernels.codec import interpreting, kernel_view, widen_bf16_bits
from oscar_torch.kernels.decode_attention.common import (
    DEFAULT_NUM_STAGES, DEFAULT_NUM_WARPS, MASK_VALUE_C, _output_rows, _query_rows, dot_f32, dot_operand,
    online_softmax_step, partial_rows, store_partial,
)
from shared_math.tiling import base2_score_scale, num_splits



@triton.jit
def _bf16_block(i, o, m, l, q, page_table_ptr, k_ptr, v_ptr, table_slots, b, h, first_slot, n_sink, n_recent,
                slot_in_block, offset, column, NUM_HEADS: tl.constexpr, D: tl.constexpr, SINK_SLOTS: tl.constexpr,
                PAGE_SIZE: tl.constexpr, PAGES_PER_BLOCK: tl.constexpr, SCORE_SCALE: tl.constexpr,
                Q_BF16: tl.constexpr, TENSOR_CORES: tl.constexpr):
    """One block of PAGES_PER_BLOCK BF16 pages (sink or recent): scores, online softmax, P·V."""
    slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
    is_sink = slot < SINK_SLOTS
    position = tl.where(is_sink, slot, slot - SINK_SLOTS) * PAGE_SIZE + offset
    valid = (position < tl.where(is_sink, n_sink, n_recent)) & (slot < table_slots)  # [N]
    page = tl.load(page_table_ptr + b * table_slots + slot, mask=valid, other=0)  # never unused slots
    row_start = ((page.to(tl.int64) * NUM_HEADS + h) * PAGE_SIZE + offset) * D  # [N]
    k = widen_bf16_bits(tl.load(k_ptr + row_start[:, None] + column))  # [N, D]
    v = widen_bf16_bits(tl.load(v_ptr + row_start[:, None] + column))
    v = tl.where(valid[:, None], v, 0.0)
    k = dot_operand(k, Q_BF16, TENSOR_CORES)
    v = dot_operand(v, Q_BF16, TENSOR_CORES)
    scores = dot_f32(q, tl.trans(k), Q_BF16, TENSOR_CORES) * SCORE_SCALE  # [BLOCK_M, N]
    p, correction, m, l = online_softmax_step(scores, valid[None, :], m, l)
    p = dot_operand(p, Q_BF16, TENSOR_CORES)
    o = o * correction[:, None] + dot_f32(p, v, Q_BF16, TENSOR_CORES)
    return o, m, l


@triton.jit
def _bf16_tier_kernel(
    page_table_ptr,  # [B, NB] int32: sink slots, then recent slots
    sink_tokens_ptr,  # [B] int32
    recent_tokens_ptr,  # [B] int32
    q_ptr,  # [B, K, M, D] float32, or bfloat16 as int16
    k_ptr,  # [P, K, L, D] bfloat16 as int16
    v_ptr,  # [P, K, L, D] bfloat16 as int16
    o_ptr,  # [B, K, S, M, D] float32: normalised partial outputs
    lse_ptr,  # [B, K, S, M] float32: their log-sum-exp (−inf when a split holds no token)
    table_slots,  # NB
    NUM_HEADS: tl.constexpr,
    ROWS: tl.constexpr,  # M: rows of the partials, a multiple of BLOCK_M
    Q_ROWS: tl.constexpr,  # rows of q (≤ M): rows beyond are read as zero queries
    D: tl.constexpr,
    SINK_SLOTS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
    PAGES_PER_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SCORE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    Q_BF16: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    row_block, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    BLOCK_N: tl.constexpr = PAGES_PER_BLOCK * PAGE_SIZE

    n_sink = tl.load(sink_tokens_ptr + b)
    n_recent = tl.load(recent_tokens_ptr + b)
    recent_pages = tl.cdiv(n_recent, PAGE_SIZE)
    # One past the last slot holding a token: the loop stops there (slots beyond are never read).
    slot_end = tl.where(recent_pages > 0, SINK_SLOTS + recent_pages, tl.cdiv(n_sink, PAGE_SIZE))
    first_slot = split * PAGES_PER_SPLIT
    last_slot = tl.minimum(first_slot + PAGES_PER_SPLIT, slot_end)
    num_blocks = tl.maximum(tl.cdiv(last_slot - first_slot, PAGES_PER_BLOCK), 0)

    token = tl.arange(0, BLOCK_N)
    offset = token % PAGE_SIZE  # [N] position inside its page
    slot_in_block = token // PAGE_SIZE  # [N]
    column = tl.arange(0, D)[None, :]
    q = dot_operand(
        _query_rows(q_ptr, b, h, row_block, NUM_HEADS, Q_ROWS, D, BLOCK_M, Q_BF16), Q_BF16, TENSOR_CORES
    )  # [BLOCK_M, D]

    o = tl.zeros((BLOCK_M, D), tl.float32)
    m = tl.full((BLOCK_M,), MASK_VALUE_C, tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    if TENSOR_CORES:  # compiled: a loop bounded by the loaded length, which Triton software-pipelines
        for i in range(0, num_blocks):
            o, m, l = _bf16_block(i, o, m, l, q, page_table_ptr, k_ptr, v_ptr, table_slots, b, h, first_slot,
                                  n_sink, n_recent, slot_in_block, offset, column, NUM_HEADS, D, SINK_SLOTS,
                                  PAGE_SIZE, PAGES_PER_BLOCK, SCORE_SCALE, Q_BF16, TENSOR_CORES)
    else:
        # The interpreter cannot take a loaded value as a loop bound (numpy 2.5 refuses int() of
        # its 1-element arrays): a static trip count with a dynamic guard. Compiled, the guard
        # kept Triton from pipelining the loop (no async copies), so the compiled kernel takes the
        # loaded trip count.
        for i in range(0, PAGES_PER_SPLIT // PAGES_PER_BLOCK):
            if i < num_blocks:
                o, m, l = _bf16_block(i, o, m, l, q, page_table_ptr, k_ptr, v_ptr, table_slots, b, h, first_slot,
                                      n_sink, n_recent, slot_in_block, offset, column, NUM_HEADS, D, SINK_SLOTS,
                                      PAGE_SIZE, PAGES_PER_BLOCK, SCORE_SCALE, Q_BF16, TENSOR_CORES)

    out_row = _output_rows(b, h, split, row_block, NUM_HEADS, NUM_SPLITS, ROWS, BLOCK_M)
    store_partial(o_ptr, lse_ptr, o, m, l, out_row, D)


def bf16_tier_partials(
    q: torch.Tensor,  # [B, K, R, D] float32 or bfloat16 (the partials' M: R padded to block_m)
    k_bf16: torch.Tensor,  # [P, K, L, D] bfloat16
    v_bf16: torch.Tensor,  # [P, K, L, D] bfloat16
    page_table: torch.Tensor,  # [B, NB] int32
    sink_tokens: torch.Tensor,  # [B] int32
    recent_tokens: torch.Tensor,  # [B] int32
    *,
    sink_slots: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int,
    block_m: int,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
):
    """Partials over the BF16 tier: (o float32[B, K, S, M, D], lse float32[B, K, S, M]).

    Inputs are validated by the public op; the asserts guard internal invariants only.
    """
    batch, num_kv_heads, q_rows, head_dim = q.shape
    rows = partial_rows(q_rows, block_m)
    _, _, page_size, _ = k_bf16.shape
    assert pages_per_split % pages_per_block == 0
    splits = num_splits(page_table.shape[1], pages_per_split)
    o = torch.empty((batch, num_kv_heads, splits, rows, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_kv_heads, splits, rows), dtype=torch.float32, device=q.device)
    q_bf16 = q.dtype == torch.bfloat16
    _bf16_tier_kernel[(batch, num_kv_heads, (rows // block_m) * splits)](
        page_table, sink_tokens, recent_tokens, kernel_view(q), k_bf16.view(torch.int16),
        v_bf16.view(torch.int16), o, lse, page_table.shape[1],
        NUM_HEADS=num_kv_heads, ROWS=rows, Q_ROWS=q_rows, D=head_dim, SINK_SLOTS=sink_slots, PAGE_SIZE=page_size,
        PAGES_PER_SPLIT=pages_per_split, PAGES_PER_BLOCK=pages_per_block, NUM_SPLITS=splits,
        SCORE_SCALE=base2_score_scale(softmax_scale), BLOCK_M=block_m, Q_BF16=q_bf16,
        TENSOR_CORES=not interpreting(), num_warps=num_warps, num_stages=num_stages,
    )
    return o, lse

