"""Causal attention of a prefill chunk to itself, in full precision (one partial for the merge).

A chunk of T new tokens attends (a) causally to its own K/V in full precision — this kernel — and
(b) to the already-cached prefix through the tiers, exactly as decode reads them — the first-stage
kernels of `decode_attention` with T·Gq query rows. The public op merges all partials by
log-sum-exp (OSCAR_SPEC §4: "A request's own prefill chunk attends to itself in full precision").

Query rows of one KV head are flattened token-major: row r = t·Gq + g (token t, query head g of
the KV head), so one K/V tile serves all Gq heads; the causal mask compares key j with t = r // Gq.
Keys at or beyond `new_tokens[b]` (a ragged chunk's padding) are masked and their V rows zeroed.

Lowering: `pl.pallas_call` with the Triton lowering, for the reasons in `decode_attention`'s
docstring; same rules (power-of-two blocks, dots with M, N, K ≥ 16, static shapes).
Shape vocabulary: B batch, K KV heads, M query rows of one KV head, T chunk tokens, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from oscar_jax.kernels.decode_attention import (
    MASK_VALUE,
    cdiv,
    dot_nn,
    dot_nt,
    finalize_rows,
    online_softmax_step,
)
from shared_math.tiling import base2_score_scale


def _causal_chunk_kernel(
    new_tokens_ref,  # [B] int32: valid tokens of each chunk
    q_ref,  # [BLOCK_M, D] compute dtype: rows r = t·Gq + g of KV head h
    k_ref,  # [T_pad, D] compute dtype: the chunk's keys of KV head h
    v_ref,  # [T_pad, D] compute dtype: the chunk's values of KV head h
    o_ref,  # [BLOCK_M, D] float32: normalised partial output
    lse_ref,  # [BLOCK_M] float32: its log-sum-exp (−inf for rows with no visible key)
    *,
    HEADS_PER_KV: int,
    BLOCK_N: int,
    SCORE_SCALE: float,
):
    b, row_block = pl.program_id(0), pl.program_id(2)
    block_m, head_dim = q_ref.shape
    n_new = new_tokens_ref[b]
    row = row_block * block_m + lax.iota(jnp.int32, block_m)
    query_token = row // HEADS_PER_KV  # [BLOCK_M]
    # Keys up to the last query token of this block (causal), and never past the chunk's tokens.
    last_key = jnp.minimum((row_block * block_m + block_m - 1) // HEADS_PER_KV, n_new - 1)
    num_blocks = jnp.maximum(cdiv(last_key + 1, BLOCK_N), 0)
    q = q_ref[...]  # [BLOCK_M, D]

    def body(i, carry):
        o, m, l = carry
        key = i * BLOCK_N + lax.iota(jnp.int32, BLOCK_N)  # [N]
        key_valid = key < n_new
        k = k_ref[pl.ds(i * BLOCK_N, BLOCK_N), :]  # [N, D]
        v = v_ref[pl.ds(i * BLOCK_N, BLOCK_N), :]
        v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
        scores = dot_nt(q, k) * SCORE_SCALE  # [BLOCK_M, N]
        causal = key[None, :] <= query_token[:, None]
        p, correction, m, l = online_softmax_step(scores, causal & key_valid[None, :], m, l)
        o = o * correction[:, None] + dot_nn(p.astype(v.dtype), v)
        return o, m, l

    carry = (
        jnp.zeros((block_m, head_dim), jnp.float32),
        jnp.full((block_m,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    o, m, l = lax.fori_loop(0, num_blocks, body, carry)
    inv_l, lse = finalize_rows(l, m)
    o_ref[...] = o * inv_l[:, None]
    lse_ref[...] = lse


def causal_chunk_partials(
    q,  # [B, K, M, D] compute dtype, rows r = t·Gq + g, M a multiple of block_m
    k,  # [B, K, T_pad, D] compute dtype, T_pad a multiple of block_n
    v,  # [B, K, T_pad, D] compute dtype
    new_tokens,  # [B] int32
    *,
    heads_per_kv: int,
    softmax_scale: float,
    block_m: int,
    block_n: int,
    interpret: bool,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """The chunk's causal self-attention partial: (o float32[B, K, 1, M, D], lse float32[B, K, 1, M])."""
    batch, num_kv_heads, rows, head_dim = q.shape
    chunk = k.shape[2]
    assert rows % block_m == 0 and chunk % block_n == 0
    kernel = functools.partial(
        _causal_chunk_kernel,
        HEADS_PER_KV=heads_per_kv,
        BLOCK_N=block_n,
        SCORE_SCALE=base2_score_scale(softmax_scale),
    )
    grid = (batch, num_kv_heads, rows // block_m)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((batch,), lambda b, h, r: (0,)),  # new_tokens (read at b)
            pl.BlockSpec((None, None, block_m, head_dim), lambda b, h, r: (b, h, r, 0)),  # q rows
            pl.BlockSpec((None, None, chunk, head_dim), lambda b, h, r: (b, h, 0, 0)),  # chunk K of head h
            pl.BlockSpec((None, None, chunk, head_dim), lambda b, h, r: (b, h, 0, 0)),  # chunk V of head h
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_m, head_dim), lambda b, h, r: (b, h, 0, r, 0)),  # o
            pl.BlockSpec((None, None, None, block_m), lambda b, h, r: (b, h, 0, r)),  # lse
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, 1, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, 1, rows), jnp.float32),
        ],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"oscar_causal_chunk_attention_{heads_per_kv=}_{block_m=}_{block_n=}",
    )(new_tokens, q, k, v)
