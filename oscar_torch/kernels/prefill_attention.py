"""Causal attention of a prefill chunk to itself, in full precision (one partial for the merge).

A chunk of T new tokens attends (a) causally to its own K/V in full precision — this kernel — and
(b) to the already-cached prefix through the tiers, exactly as decode reads them — the first-stage
kernels of `decode_attention` with T·Gq query rows. The public op merges all partials by
log-sum-exp (OSCAR_SPEC §4: "A request's own prefill chunk attends to itself in full precision").
The same kernel, name and tiling as oscar_jax/kernels/prefill_attention.py.

Query rows of one KV head are flattened token-major: row r = t·Gq + g (token t, query head g of
the KV head), so one K/V tile serves all Gq heads; the causal mask compares key j with t = r // Gq.
Keys at or beyond `new_tokens[b]` (a ragged chunk's padding) are masked and their V rows zeroed.

Precision: the chunk's compute dtype is the promotion of q's and k_new's dtypes; bfloat16 rounds
the probabilities to bfloat16 before P·V (`dot_operand`, as in kernels.decode_attention), float32 runs
IEEE float32 dots. bfloat16 tensors arrive as int16 bit patterns and are widened exactly.
Shape vocabulary: B batch, K KV heads, M query rows of one KV head, T chunk tokens, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_torch.kernels.codec import interpreting, kernel_view, load_rows_f32
from oscar_torch.kernels.decode_attention import (
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    MASK_VALUE_C,
    dot_f32,
    dot_operand,
    online_softmax_step,
    store_partial,
)
from shared_math.tiling import base2_score_scale


@triton.jit
def _causal_chunk_kernel(
    new_tokens_ptr,  # [B] int32: valid tokens of each chunk
    q_ptr,  # [B, K, M, D] float32, or bfloat16 as int16: rows r = t·Gq + g of KV head h
    k_ptr,  # [B, K, T_pad, D] same dtype: the chunk's keys
    v_ptr,  # [B, K, T_pad, D] same dtype: the chunk's values
    o_ptr,  # [B, K, 1, M, D] float32: normalised partial output
    lse_ptr,  # [B, K, 1, M] float32: its log-sum-exp (−inf for rows with no visible key)
    NUM_HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    D: tl.constexpr,
    HEADS_PER_KV: tl.constexpr,
    SCORE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
):
    b, h, row_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_new = tl.load(new_tokens_ptr + b)
    row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    query_token = row // HEADS_PER_KV  # [BLOCK_M]
    # Keys up to the last query token of this block (causal), and never past the chunk's tokens.
    last_key = tl.minimum((row_block * BLOCK_M + BLOCK_M - 1) // HEADS_PER_KV, n_new - 1)
    num_blocks = tl.maximum(tl.cdiv(last_key + 1, BLOCK_N), 0)
    column = tl.arange(0, D)[None, :]
    bh = b * NUM_HEADS + h
    q_start = (bh * ROWS + row).to(tl.int64) * D
    q = load_rows_f32(q_ptr + q_start[:, None] + column, row[:, None] < ROWS, INPUT_BF16)
    q = dot_operand(q, INPUT_BF16, TENSOR_CORES)  # [BLOCK_M, D]

    o = tl.zeros((BLOCK_M, D), tl.float32)
    m = tl.full((BLOCK_M,), MASK_VALUE_C, tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    # A static trip count with a dynamic guard (see kernels.decode_attention.bf16_tier).
    for i in range(0, CHUNK // BLOCK_N):
        if i < num_blocks:
            key = i * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
            key_valid = key < n_new
            kv_start = (bh * CHUNK + key).to(tl.int64) * D
            k = load_rows_f32(k_ptr + kv_start[:, None] + column, key_valid[:, None], INPUT_BF16)  # [N, D]
            v = load_rows_f32(v_ptr + kv_start[:, None] + column, key_valid[:, None], INPUT_BF16)
            k = dot_operand(k, INPUT_BF16, TENSOR_CORES)
            v = dot_operand(v, INPUT_BF16, TENSOR_CORES)
            scores = dot_f32(q, tl.trans(k), INPUT_BF16, TENSOR_CORES) * SCORE_SCALE  # [BLOCK_M, N]
            causal = key[None, :] <= query_token[:, None]
            p, correction, m, l = online_softmax_step(scores, causal & key_valid[None, :], m, l)
            p = dot_operand(p, INPUT_BF16, TENSOR_CORES)
            o = o * correction[:, None] + dot_f32(p, v, INPUT_BF16, TENSOR_CORES)

    out_row = bh * ROWS + row
    store_partial(o_ptr, lse_ptr, o, m, l, out_row, D)


def causal_chunk_partials(
    q: torch.Tensor,  # [B, K, M, D] compute dtype, rows r = t·Gq + g, M a multiple of block_m
    k: torch.Tensor,  # [B, K, T_pad, D] compute dtype, T_pad a multiple of block_n
    v: torch.Tensor,  # [B, K, T_pad, D] compute dtype
    new_tokens: torch.Tensor,  # [B] int32
    *,
    heads_per_kv: int,
    softmax_scale: float,
    block_m: int,
    block_n: int,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
):
    """The chunk's causal self-attention partial: (o float32[B, K, 1, M, D], lse float32[B, K, 1, M])."""
    batch, num_kv_heads, rows, head_dim = q.shape
    chunk = k.shape[2]
    assert rows % block_m == 0 and chunk % block_n == 0 and q.dtype == k.dtype == v.dtype
    o = torch.empty((batch, num_kv_heads, 1, rows, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_kv_heads, 1, rows), dtype=torch.float32, device=q.device)
    _causal_chunk_kernel[(batch, num_kv_heads, rows // block_m)](
        new_tokens, kernel_view(q), kernel_view(k), kernel_view(v), o, lse,
        NUM_HEADS=num_kv_heads, ROWS=rows, CHUNK=chunk, D=head_dim, HEADS_PER_KV=heads_per_kv,
        SCORE_SCALE=base2_score_scale(softmax_scale), BLOCK_M=block_m, BLOCK_N=block_n,
        INPUT_BF16=q.dtype == torch.bfloat16, TENSOR_CORES=not interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, lse
