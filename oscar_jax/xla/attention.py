"""Decode and prefill attention over the paged mixed-precision cache in plain XLA.

The cache layout and page-table conventions are `oscar_jax.attention_ops`'s (every tier holds
rotated K/V): BF16 pages k_bf16 / v_bf16 [(Y,) P, K, L, D] read through bf16_page_table [B, NB]
(slots [0, sink_slots) sink pages holding sink_tokens[b] tokens, then recent pages holding
recent_tokens[b]); INT2 pages read through history_page_table [B, NH] holding history_tokens[b]
(format v1; with key_layout "channel", format v2's key pages: scale / minimum f16[(Y,) P, K, D],
one per channel and page). Both tiers' keys form one softmax (the kernels' per-tier partials merged by
log-sum-exp give the same result up to float32 rounding); prefill merges it with the chunk's causal
partial over its own K/V by `attention_ops.merge_partials`.

How it differs from the Pallas kernels, and why:
  * each tier's pages are gathered whole, head-major, and attended with batched dots over all of
    them: XLA:CPU runs large dots well and small loops badly. The INT2 pages are dequantized to
    float32 (x̂ = m + code·s, `kernels.codec.decode_block`'s arithmetic) in the pass that gathers
    them, where the kernels factor m and s out of their dots: on this backend the float32 K/V
    written once and read by one dot costs less than several narrower dots over the bit planes;
  * all dots and the softmax run in float32 whatever q's dtype (XLA:CPU has no fast bfloat16
    dot), which is at least as accurate as the kernels' bfloat16 operands;
  * in prefill, a cache that holds no token in any sequence of the batch is skipped (lax.cond), so
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
from shared_math.spec import CODE_BITS, CODE_MASK, CODES_PER_BYTE

_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32


def _gather_pages(pool, page_ids, layer):
    """pool [(Y,) P, K, L, W] at page_ids [B, N] (of layer `layer`) → [B, K, N·L, W], gathered
    head-major: (page, kv head) blocks are indexed as rows of the pool seen as [(Y,) P·K, L, W], so
    the gather writes the layout the batched dots read and no transpose follows it."""
    heads = pool.shape[-3]
    blocks = pool.reshape(pool.shape[:-4] + (-1,) + pool.shape[-2:])  # [(Y,) P·K, L, W] (a bitcast)
    index = page_ids[:, None, :] * heads + jnp.arange(heads, dtype=page_ids.dtype)[None, :, None]  # [B, K, N]
    pages = blocks[index] if layer is None else blocks[layer, index]  # [B, K, N, L, W]
    batch, _, slots, page_size, width = pages.shape
    return pages.reshape(batch, heads, slots * page_size, width)


def _unpacked(codes):
    """codes uint8 [..., Q] → float32 [..., D] (the quartered packing, every leading axis kept)."""
    quarter = codes.shape[-1]
    shifts = (jnp.arange(CODES_PER_BYTE, dtype=jnp.int32) * CODE_BITS)[:, None]  # [4, 1]
    planes = (codes.astype(jnp.int32)[..., None, :] >> shifts) & CODE_MASK  # [..., 4, Q]
    return planes.reshape(codes.shape[:-1] + (quarter * CODES_PER_BYTE,)).astype(_F32)


def _dequantized(codes, scale, minimum, *, group_size: int):
    """codes uint8 [..., Q], scale / minimum float16 [..., D/G] → float32 [..., D], x̂ = m + code·s in
    float32 (`kernels.codec.decode_block`'s arithmetic, every leading axis kept)."""
    values = _unpacked(codes)
    lead, d = values.shape[:-1], values.shape[-1]
    groups = values.reshape(lead + (d // group_size, group_size))
    values = minimum.astype(_F32)[..., None] + groups * scale.astype(_F32)[..., None]  # code·s is exact
    return values.reshape(lead + (d,))


def _dequantized_channels(codes, scale, minimum):
    """Format v2 key pages gathered as codes uint8 [B, K, N·L, Q] and scale / minimum float16
    [B, K, N, D] → float32 [B, K, N·L, D], x̂ = m[c] + code·s[c] of each row's page."""
    batch, heads, rows, quarter = codes.shape
    slots = scale.shape[2]
    values = _unpacked(codes.reshape(batch, heads, slots, rows // slots, quarter))  # [B, K, N, L, D]
    values = minimum.astype(_F32)[:, :, :, None, :] + values * scale.astype(_F32)[:, :, :, None, :]
    return values.reshape(batch, heads, rows, values.shape[-1])


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


# Query rows per kv head from which a cache with no valid key is skipped by a branch (prefill chunks):
# on XLA:CPU a conditional costs about as much as a decode step's attention of one tier (measured:
# SmolLM2 at batch 8 and 1K tokens, 1.2 of 3.3 ms a layer), while a prefill chunk over an empty prefix
# saves its whole attention.
SKIP_EMPTY_MIN_ROWS = 64


def _bf16_valid(page_table, sink_tokens, recent_tokens, *, sink_slots, page_size):
    """[B, NB, L]: which rows of the sink and recent pages hold a token."""
    slot = jnp.arange(page_table.shape[1])[:, None]  # [NB, 1]
    in_sink = slot < sink_slots
    token = jnp.where(in_sink, slot, slot - sink_slots) * page_size + jnp.arange(page_size)[None, :]  # [NB, L]
    limit = jnp.where(in_sink[None], sink_tokens[:, None, None], recent_tokens[:, None, None])  # [B, NB, 1]
    return token[None] < limit


def _history_valid(page_table, history_tokens, *, page_size):
    """[B, NH, L]: which rows of the history pages hold a token."""
    slots = page_table.shape[1]
    token = jnp.arange(slots * page_size).reshape(slots, page_size)
    return token[None] < history_tokens[:, None, None]


def _cache_partials(q_rows, cache, *, sink_slots, group_size, softmax_scale, layer, key_layout="token"):
    """The partial (o [B, K, M, D], lse [B, K, M]) of q_rows [B, K, M, D] over both tiers at once.

    Each tier's pages are gathered head-major, the INT2 pages dequantized to float32 (x̂ = m + code·s)
    and both tiers' keys concatenated, so one batched dot gives every score and one softmax needs no
    merge. XLA fuses gather, dequantization and concatenation into one pass writing the float32 K
    (and one for V) that the dots read: on XLA:CPU that pass and the two dots are the whole cost of a
    decode step's attention, about 1.7× less than dots over the codes' bit planes gathered page-major
    and transposed (measured: SmolLM2 shapes at batch 8 and 1K tokens)."""
    (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
     bf16_page_table, sink_tokens, recent_tokens, history_page_table, history_tokens) = cache
    batch = q_rows.shape[0]
    page_size = k_bf16.shape[-2]
    valid, tiers = [], []
    if bf16_page_table.shape[1]:
        bf16_valid = _bf16_valid(bf16_page_table, sink_tokens, recent_tokens, sink_slots=sink_slots,
                                 page_size=page_size)
        page_ids = jnp.where(jnp.any(bf16_valid, axis=-1), bf16_page_table, 0)  # slots with no valid token: page 0
        valid.append(bf16_valid.reshape(batch, -1))
        tiers.append(("bf16", tuple(_gather_pages(pool, page_ids, layer) for pool in (k_bf16, v_bf16))))
    if history_page_table.shape[1]:
        history_valid = _history_valid(history_page_table, history_tokens, page_size=page_size)
        page_ids = jnp.where(jnp.any(history_valid, axis=-1), history_page_table, 0)
        valid.append(history_valid.reshape(batch, -1))
        if key_layout == "channel":  # one scale and minimum row per page: gathered as pages of one row
            k_scale, k_min = (pool[..., None, :] for pool in (k_scale, k_min))
        tiers.append(("int2", tuple(_gather_pages(pool, page_ids, layer)
                                    for pool in (k_codes, k_scale, k_min, v_codes, v_scale, v_min))))
    if not tiers:
        return _empty_partials(q_rows)
    key_valid = jnp.concatenate(valid, axis=1)  # [B, S]
    kinds = [kind for kind, _ in tiers]
    pages = [p for _, arrays in tiers for p in arrays]

    def attend(q, key_valid, *pages):
        keys, values, rest = [], [], list(pages)
        for kind in kinds:
            if kind == "bf16":
                k, v, rest = rest[0], rest[1], rest[2:]
            else:
                k = (_dequantized_channels(*rest[:3]) if key_layout == "channel"
                     else _dequantized(*rest[:3], group_size=group_size))
                v = _dequantized(*rest[3:6], group_size=group_size)
                rest = rest[6:]
            keys.append(k.astype(_F32))
            values.append(v.astype(_F32))
        k, v = (x[0] if len(x) == 1 else jnp.concatenate(x, axis=2) for x in (keys, values))
        return _softmax_partials(q, k, v, key_valid, softmax_scale=softmax_scale)

    if q_rows.shape[2] < SKIP_EMPTY_MIN_ROWS:
        return attend(q_rows, key_valid, *pages)
    # Prefill-sized q: a chunk over an empty prefix (a first chunk) skips the cache. The gathered
    # pages are the branch's operands: a branch that closed over the stacked pools would make XLA
    # copy them in at every call.
    return lax.cond(jnp.any(key_valid), attend, lambda q, *_: _empty_partials(q), q_rows, key_valid, *pages)


def _merge(outputs, lses):
    return merge_partials(jnp.stack(outputs, axis=2), jnp.stack(lses, axis=2))


@functools.partial(jax.jit, static_argnames=("sink_slots", "group_size", "softmax_scale", "layer", "key_layout"))
def decode_attention(q, cache, *, sink_slots: int, group_size: int, softmax_scale: float, layer: int | None = None,
                     key_layout: str = "token"):
    """q [B, Hq, D] (rotated; head h reads kv head h // G) over `cache` (the 13 cache arguments of
    `attention_ops.decode_attention`, validated there; key_layout "channel": format v2 key pages)
    → float32 [B, Hq, D]."""
    batch, q_heads, head_dim = q.shape
    num_kv_heads = cache[0].shape[-3]
    q_rows = q.astype(_F32).reshape(batch, num_kv_heads, q_heads // num_kv_heads, head_dim)
    o, _ = _cache_partials(q_rows, cache, sink_slots=sink_slots, group_size=group_size, softmax_scale=softmax_scale,
                           layer=layer, key_layout=key_layout)
    return o.reshape(batch, q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("sink_slots", "group_size", "softmax_scale", "layer", "key_layout"))
def prefill_attention(q, k_new, v_new, cache, new_tokens, *, sink_slots: int, group_size: int, softmax_scale: float,
                      layer: int | None = None, key_layout: str = "token"):
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
    o_cache, lse_cache = _cache_partials(q_rows, cache, sink_slots=sink_slots, group_size=group_size,
                                         softmax_scale=softmax_scale, layer=layer, key_layout=key_layout)
    key = jnp.arange(chunk)
    causal = key[None, :] <= (jnp.arange(rows) // heads_per_kv)[:, None]  # [M, T]
    k_chunk, v_chunk = (x.transpose(0, 2, 1, 3) for x in (k_new, v_new))  # [B, K, T, D]
    o_self, lse_self = _softmax_partials(q_rows, k_chunk, v_chunk, key[None, :] < new_tokens[:, None], causal,
                                         softmax_scale=softmax_scale)
    o, _ = _merge([o_cache, o_self], [lse_cache, lse_self])
    o = o.reshape(batch, num_kv_heads, chunk, heads_per_kv, head_dim).transpose(0, 2, 1, 3, 4)
    o = o.reshape(batch, chunk, q_heads, head_dim)
    valid_rows = key[None, :] < new_tokens[:, None]  # ragged chunks: padding rows → 0
    return jnp.where(valid_rows[:, :, None, None], o, 0.0)
