"""The BF16 tier's split-K kernel (the sink and recent pages) and its launcher."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from oscar_jax.kernels.decode_attention.common import (
    MASK_VALUE, cdiv, dot_nn, dot_nt, finalize_rows, online_softmax_step, partials_outputs,
)
from oscar_jax.kernels.layered import flat_pool, layer_page_base, layer_page_base_spec, per_layer_shape
from shared_math.tiling import base2_score_scale, num_splits


def _bf16_tier_kernel(
    page_table_ref,  # [S·PAGES_PER_SPLIT] int32: the BF16 slots of sequence b (padded)
    sink_tokens_ref,  # [B] int32
    recent_tokens_ref,  # [B] int32
    page_base_ref,  # [1] int32: the layer's first page in the pools (kernels.layered)
    q_ref,  # [BLOCK_M, D] compute dtype: query rows of KV head h
    k_ref,  # [Y·P, L, D] bf16: the K pool of KV head h
    v_ref,  # [Y·P, L, D] bf16: the V pool of KV head h
    o_ref,  # [BLOCK_M, D] float32: normalised partial output of this split
    lse_ref,  # [BLOCK_M] float32: its log-sum-exp (−inf when the split holds no token)
    *,
    SINK_SLOTS: int,
    PAGE_SIZE: int,
    PAGES_PER_SPLIT: int,
    PAGES_PER_BLOCK: int,
    SCORE_SCALE: float,
):
    b, split = pl.program_id(0), pl.program_id(3)
    block_m, head_dim = q_ref.shape
    block_n = PAGES_PER_BLOCK * PAGE_SIZE
    compute_dtype = q_ref.dtype

    n_sink = sink_tokens_ref[b]
    n_recent = recent_tokens_ref[b]
    page_base = page_base_ref[0]
    recent_pages = cdiv(n_recent, PAGE_SIZE)
    # One past the last slot holding a token: the loop stops there (slots beyond are never read).
    slot_end = jnp.where(recent_pages > 0, SINK_SLOTS + recent_pages, cdiv(n_sink, PAGE_SIZE))
    first_slot = split * PAGES_PER_SPLIT
    last_slot = jnp.minimum(first_slot + PAGES_PER_SPLIT, slot_end)
    num_blocks = jnp.maximum(cdiv(last_slot - first_slot, PAGES_PER_BLOCK), 0)

    token = lax.iota(jnp.int32, block_n)
    offset = token % PAGE_SIZE  # [N] position inside its page
    slot_in_block = token // PAGE_SIZE  # [N]
    q = q_ref[...]  # [BLOCK_M, D]

    def body(i, carry):
        o, m, l = carry
        slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
        is_sink = slot < SINK_SLOTS
        position = jnp.where(is_sink, slot, slot - SINK_SLOTS) * PAGE_SIZE + offset
        valid = position < jnp.where(is_sink, n_sink, n_recent)  # [N]
        page = jnp.where(valid, page_table_ref[slot], 0) + page_base  # [N] never dereference unused slots
        k = k_ref[page, offset, :].astype(compute_dtype)  # [N, D]
        v = v_ref[page, offset, :]  # [N, D]
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v)).astype(compute_dtype)
        scores = dot_nt(q, k) * SCORE_SCALE  # [BLOCK_M, N]
        p, correction, m, l = online_softmax_step(scores, valid[None, :], m, l)
        o = o * correction[:, None] + dot_nn(p.astype(compute_dtype), v)
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


def bf16_tier_partials(
    q,  # [B, K, M, D] compute dtype (float32 or bfloat16), M a multiple of block_m
    k_bf16,  # [P, K, L, D] bfloat16
    v_bf16,  # [P, K, L, D] bfloat16
    page_table,  # [B, NB] int32
    sink_tokens,  # [B] int32
    recent_tokens,  # [B] int32
    *,
    sink_slots: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int,
    block_m: int,
    interpret: bool,
    num_warps: int = 4,
    num_stages: int = 2,
    layer: int | None = None,
):
    """Partials over the BF16 tier: (o float32[B, K, S, M, D], lse float32[B, K, S, M]).

    With `layer`, the pools are stacked [Y, P, K, L, D] and layer `layer` is read (kernels.layered).
    Inputs are validated by the public op; the asserts guard internal invariants only.
    """
    batch, num_kv_heads, rows, head_dim = q.shape
    _, _, page_size, _ = per_layer_shape(k_bf16.shape, layer)
    assert rows % block_m == 0 and pages_per_split % pages_per_block == 0
    splits = num_splits(page_table.shape[1], pages_per_split)
    table_len = splits * pages_per_split
    page_table = jnp.pad(page_table, ((0, 0), (0, table_len - page_table.shape[1])))
    kernel = functools.partial(
        _bf16_tier_kernel,
        SINK_SLOTS=sink_slots,
        PAGE_SIZE=page_size,
        PAGES_PER_SPLIT=pages_per_split,
        PAGES_PER_BLOCK=pages_per_block,
        SCORE_SCALE=base2_score_scale(softmax_scale),
    )
    k_pool, v_pool = flat_pool(k_bf16, layer), flat_pool(v_bf16, layer)
    pool_spec = pl.BlockSpec((k_pool.shape[0], None, page_size, head_dim), lambda b, h, r, s: (0, h, 0, 0))
    grid = (batch, num_kv_heads, rows // block_m, splits)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, table_len), lambda b, h, r, s: (b, 0)),  # page table of b
            pl.BlockSpec((batch,), lambda b, h, r, s: (0,)),  # sink_tokens (read at b)
            pl.BlockSpec((batch,), lambda b, h, r, s: (0,)),  # recent_tokens (read at b)
            layer_page_base_spec(),
            pl.BlockSpec((None, None, block_m, head_dim), lambda b, h, r, s: (b, h, r, 0)),  # q
            pool_spec,  # K pool of KV head h
            pool_spec,  # V pool
        ],
        **partials_outputs(batch, num_kv_heads, splits, rows, head_dim, block_m),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"oscar_bf16_tier_attention_{block_m=}_{pages_per_split=}_{pages_per_block=}",
    )(page_table, sink_tokens, recent_tokens, layer_page_base(k_bf16.shape, layer), q, k_pool, v_pool)
