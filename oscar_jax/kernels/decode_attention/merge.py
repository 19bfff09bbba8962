"""The decode merge: the exact softmax over every tier's splits, in one program per kept query row."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from oscar_jax.kernels.decode_attention.common import cdiv
from shared_math.tiling import MERGE_BLOCK_D, MERGE_BLOCK_SPLITS, next_power_of_two


def _merge_tiers_kernel(*refs, SPLITS, BLOCK_SPLITS):
    """refs = (o_1, lse_1, …, o_T, lse_T, out): o_t [S_t, BLOCK_D], lse_t [S_t] of one (b, KV head,
    kept row, column block); out [BLOCK_D]. `merge_partials` over all tiers' splits without
    concatenating them: two passes (max lse, then the weighted sum), loads of power-of-two chunks
    masked at S_t."""
    *tier_refs, out_ref = refs
    # Splits per load: a power of two (a Triton tensor size), no larger than the tier needs.
    tiers = [(tier_refs[2 * t], tier_refs[2 * t + 1], splits, min(BLOCK_SPLITS, next_power_of_two(splits)))
             for t, splits in enumerate(SPLITS)]

    def chunk(o_ref, lse_ref, splits, block, i, with_o):
        s = i * block + lax.iota(jnp.int32, block)
        inside = s < splits
        lse = pl_triton.load(lse_ref.at[pl.ds(i * block, block)], mask=inside, other=-jnp.inf)
        if not with_o:
            return lse
        o = pl_triton.load(o_ref.at[pl.ds(i * block, block), :], mask=inside[:, None], other=0.0)
        return lse, o

    lse_max = jnp.float32(-jnp.inf)
    for o_ref, lse_ref, splits, block in tiers:
        lse_max = lax.fori_loop(
            0, cdiv(splits, block),
            lambda i, m, o_ref=o_ref, lse_ref=lse_ref, splits=splits, block=block: jnp.maximum(
                m, jnp.max(chunk(o_ref, lse_ref, splits, block, i, with_o=False))),
            lse_max)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)  # every split empty: all weights 0

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    total = jnp.float32(0.0)
    for o_ref, lse_ref, splits, block in tiers:
        def body(i, carry, o_ref=o_ref, lse_ref=lse_ref, splits=splits, block=block):
            acc, total = carry
            lse, o = chunk(o_ref, lse_ref, splits, block, i, with_o=True)
            weight = jnp.exp(lse - lse_max)  # 0 for empty splits (lse = −inf)
            # where, not a product: an empty split's o may hold anything (0 · NaN = NaN).
            acc = acc + jnp.sum(jnp.where(weight[:, None] > 0.0, weight[:, None] * o, 0.0), axis=0)
            return acc, total + jnp.sum(weight)
        acc, total = lax.fori_loop(0, cdiv(splits, block), body, (acc, total))
    out_ref[...] = acc / jnp.where(total > 0.0, total, 1.0)


def merge_tier_partials(
    tiers, valid_rows: int, *, interpret: bool, block_splits: int = MERGE_BLOCK_SPLITS,
    block_d: int | None = None, num_warps: int = 4,
):
    """Merge the partials of several tiers into o float32[B, K, valid_rows, D].

    tiers: (o float32[B, K, S_t, M_t, D], lse float32[B, K, S_t, M_t]) per tier, same B, K, D, any
    S_t ≥ 1 and M_t ≥ valid_rows; rows [0, valid_rows) are kept (GQA padding rows are never read).
    Equals `attention_ops.merge_partials` of the concatenation; rows every split left empty get 0.
    """
    batch, num_kv_heads, _, _, head_dim = tiers[0][0].shape
    # None: MERGE_BLOCK_D columns per program on the GPU (parallelism); whole rows in interpret
    # mode, which runs programs one after another.
    block_d = min(block_d or (head_dim if interpret else MERGE_BLOCK_D), head_dim)
    assert 0 < valid_rows and block_splits & (block_splits - 1) == 0 and head_dim % block_d == 0 and all(
        o.shape[:2] == (batch, num_kv_heads) and o.shape[3] >= valid_rows and o.shape[4] == head_dim
        and o.shape[2] >= 1 for o, _ in tiers)
    in_specs, operands = [], []
    for o, lse in tiers:
        splits = o.shape[2]
        in_specs += [
            pl.BlockSpec((None, None, splits, None, block_d), lambda b, h, r, c: (b, h, 0, r, c)),
            pl.BlockSpec((None, None, splits, None), lambda b, h, r, c: (b, h, 0, r)),
        ]
        operands += [o, lse]
    splits = tuple(o.shape[2] for o, _ in tiers)
    return pl.pallas_call(
        functools.partial(_merge_tiers_kernel, SPLITS=splits, BLOCK_SPLITS=block_splits),
        grid=(batch, num_kv_heads, valid_rows, head_dim // block_d),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, None, block_d), lambda b, h, r, c: (b, h, r, c)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, valid_rows, head_dim), jnp.float32),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="oscar_merge_tiers_" + "_".join(map(str, splits)),
    )(*operands)
