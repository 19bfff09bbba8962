"""Decode and prefill attention over the paged mixed-precision cache in plain XLA.

The cache layout and page-table conventions are `oscar_jax.attention_ops`'s (every tier holds
rotated K/V): BF16 pages k_bf16 / v_bf16 [(Y,) P, K, L, D] read through bf16_page_table [B, NB]
(slots [0, sink_slots) sink pages holding sink_tokens[b] tokens, then recent pages holding
recent_tokens[b]); INT2 pages (format v1) read through history_page_table [B, NH] holding
history_tokens[b]. Each tier gives a normalised partial and its log-sum-exp, merged exactly by
`attention_ops.merge_partials` (prefill adds the chunk's causal partial over its own K/V).

How it differs from the Pallas kernels, and why:
  * each tier's pages are gathered whole and attended with batched dots over all of them: XLA:CPU
    runs large dots well and small loops badly. The INT2 pages are read as the kernels read them,
    x̂ = m + code·s factored out of the dots (`_code_plane_partials`), or dequantized
    (`kernels.codec.decode_block`) when a bit plane spans groups (G < D/4);
  * all dots and the softmax run in float32 whatever q's dtype (XLA:CPU has no fast bfloat16
    dot), which is at least as accurate as the kernels' bfloat16 operands;
  * in prefill, a tier that holds no token in any sequence of the batch is skipped (lax.cond), so
    a first chunk does not pay for the empty prefix tables.
Robustness as the kernels': table entries holding no valid token are replaced by page 0 before the
gather, masked V rows are zeroed (stale pool memory may hold NaN), masked scores are −inf, and a row
with no visible key gets o = 0, lse = −inf.

Shape vocabulary: B batch, K kv heads, G query heads per kv head, M query rows of a kv head,
T chunk tokens, S keys, D head dim, P pages, L page size, NB / NH table slots, Y layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from oscar_jax.attention_ops import merge_partials
from oscar_jax.kernels.codec import decode_block
from shared_math.spec import CODE_BITS, CODE_MASK, CODES_PER_BYTE

_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32


def _gather_pages(pool, page_ids, layer):
    """pool [(Y,) P, K, L, W] at page_ids [B, N] (of layer `layer`) → [B, K, N·L, W]."""
    pages = pool[page_ids] if layer is None else pool[layer, page_ids]  # [B, N, K, L, W]
    batch, slots, heads, page_size, width = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(batch, heads, slots * page_size, width)


def _softmax_partials(q, k, v, key_valid, causal=None, *, softmax_scale: float):
    """q [B, K, M, D] f32 over keys k, v [B, K, S, D] (any float dtype): key s is seen where
    key_valid [B, S] (and causal [M, S], when given) → (o float32 [B, K, M, D] normalised,
    lse float32 [B, K, M])."""
    v = jnp.where(key_valid[:, None, :, None], v.astype(_F32), 0.0)  # p = 0 must not meet a NaN
    scores = jnp.einsum("bkmd,bksd->bkms", q, k.astype(_F32), precision=_HIGHEST) * softmax_scale
    visible = key_valid[:, None, None, :] if causal is None else key_valid[:, None, None, :] & causal
    scores = jnp.where(visible, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    p = jnp.exp(scores - peak[..., None])  # 0 where masked
    total = jnp.sum(p, axis=-1)
    o = jnp.einsum("bkms,bksd->bkmd", p, v, precision=_HIGHEST)
    has_keys = total > 0
    o = o / jnp.where(has_keys, total, 1.0)[..., None]
    lse = jnp.where(has_keys, peak + jnp.log(jnp.where(has_keys, total, 1.0)), -jnp.inf)
    return o, lse


def _empty_partials(q):
    return jnp.zeros(q.shape, _F32), jnp.full(q.shape[:-1], -jnp.inf, _F32)


# Query rows per kv head from which a tier with no valid key is skipped by a branch (prefill chunks):
# on XLA:CPU a conditional costs about as much as a decode step's attention of one tier (measured:
# SmolLM2 at batch 8 and 1K tokens, 1.2 of 3.3 ms a layer), while a prefill chunk over an empty prefix
# saves its whole attention.
SKIP_EMPTY_MIN_ROWS = 64


def _unless_empty(valid, attend, q, *pages):
    """attend(q, *pages), or (prefill-sized q) the empty partials when no key is valid. The pages are
    gathered before the branch and passed as its operands: a branch that closed over the stacked
    pools would make XLA copy them in at every call."""
    if q.shape[2] < SKIP_EMPTY_MIN_ROWS:
        return attend(q, *pages)
    return lax.cond(jnp.any(valid), attend, lambda q, *_: _empty_partials(q), q, *pages)


def _bf16_tier(q, k_bf16, v_bf16, page_table, sink_tokens, recent_tokens, *, sink_slots, softmax_scale, layer):
    """The sink and recent pages' partial of q [B, K, M, D]."""
    page_size = k_bf16.shape[-2]
    slot = jnp.arange(page_table.shape[1])[:, None]  # [NB, 1]
    in_sink = slot < sink_slots
    token = jnp.where(in_sink, slot, slot - sink_slots) * page_size + jnp.arange(page_size)[None, :]  # [NB, L]
    limit = jnp.where(in_sink[None], sink_tokens[:, None, None], recent_tokens[:, None, None])  # [B, NB, 1]
    valid = token[None] < limit  # [B, NB, L]
    page_ids = jnp.where(jnp.any(valid, axis=-1), page_table, 0)  # slots with no valid token: page 0

    k, v = (_gather_pages(pool, page_ids, layer) for pool in (k_bf16, v_bf16))

    def attend(q, k, v):
        return _softmax_partials(q, k, v, valid.reshape(valid.shape[0], -1), softmax_scale=softmax_scale)

    return _unless_empty(valid, attend, q, k, v)


def _code_planes(codes):
    """codes uint8 [..., Q] → the CODES_PER_BYTE bit planes as float32 [..., Q] (plane p holds the
    codes of channels p·Q … p·Q + Q − 1: the quartered packing)."""
    wide = codes.astype(jnp.int32)
    return [((wide >> (CODE_BITS * p)) & CODE_MASK).astype(_F32) for p in range(CODES_PER_BYTE)]


def _code_plane_partials(q, k_pages, v_pages, key_valid, *, group_size: int, softmax_scale: float):
    """The INT2 tier's partial without dequantizing, as the kernels factor it (x̂ = m + c·s per group):
        q·k̂ = Σ_planes s_k·(q_plane · c_plane) + Σ_groups m_k·Σ q_group
        Σ_s p·v̂ = Σ_s (p·s_v)·c_v + Σ_s p·m_v           (per plane, each inside one group: G ≥ D/4)
    so only the codes' bit planes are widened to float32, one dot a plane — about a third less
    time than dequantizing on this CPU (the decode of SmolLM2 at batch 8 and 1K tokens).
    k_pages, v_pages: (codes uint8 [B, K, S, Q], scale, minimum float16 [B, K, S, D/G]); q, key_valid
    as _softmax_partials."""
    quarter = k_pages[0].shape[-1]
    num_groups = q.shape[-1] // group_size
    group_of_plane = [p * quarter // group_size for p in range(CODES_PER_BYTE)]
    mask = key_valid[:, None, :, None]  # stale metadata may hold NaN / Inf: zero it where masked
    k_scale, k_min, v_scale, v_min = (jnp.where(mask, a.astype(_F32), 0.0) for a in (*k_pages[1:], *v_pages[1:]))
    q_groups = jnp.sum(q.reshape(q.shape[:-1] + (num_groups, group_size)), axis=-1)  # [B, K, M, NG]
    dots = [jnp.einsum("bkmq,bksq->bkms", q[..., p * quarter:(p + 1) * quarter], plane, precision=_HIGHEST)
            for p, plane in enumerate(_code_planes(k_pages[0]))]
    scores = 0.0
    for g in range(num_groups):  # elementwise over [B, K, M, S]: XLA fuses them into one pass
        in_group = sum(d for d, pg in zip(dots, group_of_plane) if pg == g)
        scores = scores + k_scale[:, :, None, :, g] * in_group + k_min[:, :, None, :, g] * q_groups[..., g, None]
    scores = jnp.where(key_valid[:, None, None, :], scores * softmax_scale, -jnp.inf)
    peak = jnp.max(scores, axis=-1)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    prob = jnp.exp(scores - peak[..., None])  # 0 where masked
    total = jnp.sum(prob, axis=-1)
    by_min = [jnp.sum(prob * v_min[:, :, None, :, g], axis=-1, keepdims=True) for g in range(num_groups)]
    weighted = [prob * v_scale[:, :, None, :, g] for g in range(num_groups)]
    pieces = []
    for p, plane in enumerate(_code_planes(v_pages[0])):
        g = group_of_plane[p]
        pieces.append(jnp.einsum("bkms,bksq->bkmq", weighted[g], plane, precision=_HIGHEST) + by_min[g])
    o = jnp.concatenate(pieces, axis=-1)
    has_keys = total > 0
    o = o / jnp.where(has_keys, total, 1.0)[..., None]
    lse = jnp.where(has_keys, peak + jnp.log(jnp.where(has_keys, total, 1.0)), -jnp.inf)
    return o, lse


def _int2_tier(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, page_table, history_tokens, *, group_size,
               softmax_scale, layer):
    """The history (INT2) pages' partial of q [B, K, M, D]."""
    batch, slots = page_table.shape
    page_size = k_codes.shape[-2]
    token = jnp.arange(slots * page_size).reshape(slots, page_size)
    valid = token[None] < history_tokens[:, None, None]  # [B, NH, L]
    page_ids = jnp.where(jnp.any(valid, axis=-1), page_table, 0)

    def dequantized(codes, scale, minimum):
        lead = codes.shape[:-1]
        values = decode_block(codes.reshape(-1, codes.shape[-1]), scale.reshape(-1, scale.shape[-1]),
                              minimum.reshape(-1, minimum.shape[-1]), group_size=group_size)
        return values.reshape(lead + values.shape[-1:])  # [B, K, NH·L, D]

    def attend(q, k_pages, v_pages):
        if group_size >= k_pages[0].shape[-1]:  # every bit plane inside one group
            return _code_plane_partials(q, k_pages, v_pages, valid.reshape(batch, -1), group_size=group_size,
                                        softmax_scale=softmax_scale)
        k, v = dequantized(*k_pages), dequantized(*v_pages)
        return _softmax_partials(q, k, v, valid.reshape(batch, -1), softmax_scale=softmax_scale)

    if slots == 0:
        return _empty_partials(q)
    k_pages, v_pages = (tuple(_gather_pages(a, page_ids, layer) for a in arrays)
                        for arrays in ((k_codes, k_scale, k_min), (v_codes, v_scale, v_min)))
    return _unless_empty(valid, attend, q, k_pages, v_pages)


def _cache_partials(q_rows, cache, *, sink_slots, group_size, softmax_scale, layer):
    """Both tiers' partials of q_rows [B, K, M, D]: (o [B, K, 2, M, D], lse [B, K, 2, M])."""
    (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
     bf16_page_table, sink_tokens, recent_tokens, history_page_table, history_tokens) = cache
    tiers = [
        _bf16_tier(q_rows, k_bf16, v_bf16, bf16_page_table, sink_tokens, recent_tokens, sink_slots=sink_slots,
                   softmax_scale=softmax_scale, layer=layer),
        _int2_tier(q_rows, k_codes, k_scale, k_min, v_codes, v_scale, v_min, history_page_table, history_tokens,
                   group_size=group_size, softmax_scale=softmax_scale, layer=layer),
    ]
    return [o for o, _ in tiers], [lse for _, lse in tiers]


def _merge(outputs, lses):
    return merge_partials(jnp.stack(outputs, axis=2), jnp.stack(lses, axis=2))


@functools.partial(jax.jit, static_argnames=("sink_slots", "group_size", "softmax_scale", "layer"))
def decode_attention(q, cache, *, sink_slots: int, group_size: int, softmax_scale: float, layer: int | None = None):
    """q [B, Hq, D] (rotated; head h reads kv head h // G) over `cache` (the 13 cache arguments of
    `attention_ops.decode_attention`, validated there) → float32 [B, Hq, D]."""
    batch, q_heads, head_dim = q.shape
    num_kv_heads = cache[0].shape[-3]
    q_rows = q.astype(_F32).reshape(batch, num_kv_heads, q_heads // num_kv_heads, head_dim)
    outputs, lses = _cache_partials(q_rows, cache, sink_slots=sink_slots, group_size=group_size,
                                    softmax_scale=softmax_scale, layer=layer)
    o, _ = _merge(outputs, lses)
    return o.reshape(batch, q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("sink_slots", "group_size", "softmax_scale", "layer"))
def prefill_attention(q, k_new, v_new, cache, new_tokens, *, sink_slots: int, group_size: int, softmax_scale: float,
                      layer: int | None = None):
    """A chunk q [B, T, Hq, D] attends causally to its own k_new, v_new [B, T, K, D] (keys at or past
    new_tokens[b] masked) and to the whole cached prefix; rows t ≥ new_tokens[b] are 0.
    Returns float32 [B, T, Hq, D]."""
    batch, chunk, q_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[2]
    heads_per_kv = q_heads // num_kv_heads
    rows = chunk * heads_per_kv
    # Rows of kv head h, token-major: r = t·G + g.
    q_rows = q.astype(_F32).reshape(batch, chunk, num_kv_heads, heads_per_kv, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_dim)
    outputs, lses = _cache_partials(q_rows, cache, sink_slots=sink_slots, group_size=group_size,
                                    softmax_scale=softmax_scale, layer=layer)
    key = jnp.arange(chunk)
    causal = key[None, :] <= (jnp.arange(rows) // heads_per_kv)[:, None]  # [M, T]
    k_chunk, v_chunk = (x.transpose(0, 2, 1, 3) for x in (k_new, v_new))  # [B, K, T, D]
    o_self, lse_self = _softmax_partials(q_rows, k_chunk, v_chunk, key[None, :] < new_tokens[:, None], causal,
                                         softmax_scale=softmax_scale)
    o, _ = _merge(outputs + [o_self], lses + [lse_self])
    o = o.reshape(batch, num_kv_heads, chunk, heads_per_kv, head_dim).transpose(0, 2, 1, 3, 4)
    o = o.reshape(batch, chunk, q_heads, head_dim)
    valid_rows = key[None, :] < new_tokens[:, None]  # ragged chunks: padding rows → 0
    return jnp.where(valid_rows[:, :, None, None], o, 0.0)
