"""Decode-faithful emulation of a quantized KV cache, for a whole window in one teacher-forced pass.

While decoding, the query at position t sees the cache as it is after token t was appended:
some positions are read from BF16 (OSCAR: the sink [0, S0) and the recent window of
`tier_split(t + 1)`; KIVI: its full-precision residual) and the rest ("history") through the
method's quantizer. `EmulatedCache` implements the model's cache contract
(`attend(layer, q, k, v, positions)`) for a window at positions 0..T−1 and gives every query
exactly that view, so `oscar_jax.model.prefill(params, cfg, tokens, cache, all_logits=True)`
returns the logits token-by-token decoding would produce — in one pass.

Per layer, with R_K the method's key rotation (identity when it has none):
  q' = q·R_K, k' = k·R_K (float32); values arrive already rotated (R_V folded into W_v/W_o by
  `prepare_params`, as the runtime folds it)
  k_hi = bf16(k'), v_hi = bf16(v)                   what the BF16 tiers hold
  k_lo = quantize_keys(k_hi), v_lo = quantize_values(v_hi)
                                                    what the history holds: pages demote from
                                                    BF16, so the quantizer sees bf16 values
  score[t, s] = q'_t·(s ∈ K-history(t) ? k_lo_s : k_hi_s) / √D   for s ≤ t
  out_t = Σ_s softmax(score)[t, s] · (s ∈ V-history(t) ? v_lo_s : v_hi_s)
History sets are intervals per query (`KVMethod.history_intervals`). The quantized copy of a row
does not depend on the query (per-token codecs; KIVI's key groups are fixed once flushed), so
one k_lo / v_lo per layer serves every query. Two score matrices and a select: O(T²) work and,
with queries processed in chunks of `query_chunk` (keys up to the chunk's last position), memory
O(query_chunk · T).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from calibration.methods import HistoryIntervals, KVMethod
from oscar_jax.model import ModelConfig, Params, fold_value_rotation, layer_output, lm_head, qkv_projections

_HIGHEST = jax.lax.Precision.HIGHEST
DEFAULT_QUERY_CHUNK = 256


def prepare_params(params: Params, cfg: ModelConfig, method: KVMethod) -> Params:
    """Fold the method's value rotation into W_v / W_o (unchanged params when it has none)."""
    if method.v_rotation is None:
        return params
    return fold_value_rotation(params, cfg, method.v_rotation)


def bf16_round(x: jax.Array) -> jax.Array:
    return x.astype(jnp.bfloat16).astype(jnp.float32)


BAND_ALIGN = 64  # band widths are rounded up to a multiple of this, to bound recompilation


def _band_of(starts: np.ndarray, ends: np.ndarray, q_pos: np.ndarray, num_keys: int):
    """Host-side plan for one query chunk and one of K / V.

    Returns (base_lo bool [S], band_start, band_width): keys every query of the chunk reads
    quantized get `base_lo`; keys read quantized by some queries and BF16 by others lie in
    [band_start, band_start + band_width), where the selection is made per (query, key).
    band_width 0: no mixed keys. Keys after a query are ignored for it (causal).
    """
    keys = np.arange(num_keys)
    hist = (keys >= starts[:, None]) & (keys < ends[:, None])  # [C, S]
    visible = keys <= q_pos[:, None]
    any_hist = (hist & visible).any(axis=0)
    any_bf16 = (~hist & visible).any(axis=0)
    base_lo = any_hist & ~any_bf16
    mixed = np.flatnonzero(any_hist & any_bf16)
    if mixed.size == 0:
        return base_lo, 0, 0
    width = min(num_keys, -(-(mixed[-1] + 1 - mixed[0]) // BAND_ALIGN) * BAND_ALIGN)
    return base_lo, int(min(mixed[0], num_keys - width)), int(width)


@functools.partial(jax.jit, static_argnames=("k_band_width", "v_band_width"))
def _chunk_attention(q, q_pos, k_hi, k_lo, v_hi, v_lo, k_interval, v_interval, k_base_lo, v_base_lo,
                     k_band_start, v_band_start, *, k_band_width, v_band_width):
    """One chunk of queries over keys 0..S−1.

    q [B, Hkv, G, C, D] (rotated), q_pos [C]; k_*, v_* [B, Hkv, S, D] (None when unused);
    *_interval int32 [2, C] (history start, end per query); *_base_lo bool [S]; band starts int32.
    Scores use the base keys (quantized where every query of the chunk reads them quantized),
    then the band's columns are recomputed with the per-(query, key) choice; values likewise,
    with the band's correction added to the base output. Returns [B, Hkv, G, C, D].
    """
    d = q.shape[-1]
    scale = d**-0.5

    def dot_keys(keys):  # [B, Hkv, S', D] → scores [B, Hkv, G, C, S']
        return jnp.einsum("bkgcd,bksd->bkgcs", q, keys, precision=_HIGHEST) * scale

    def in_history(interval, start, width):  # [C, width]: key start + j is history for query c
        cols = start + jnp.arange(width)[None, :]
        return (cols >= interval[0][:, None]) & (cols < interval[1][:, None])

    k_base = k_hi if k_lo is None else jnp.where(k_base_lo[None, None, :, None], k_lo, k_hi)
    scores = dot_keys(k_base)
    if k_band_width:
        band = lambda x: jax.lax.dynamic_slice_in_dim(x, k_band_start, k_band_width, axis=2)  # noqa: E731
        sel = in_history(k_interval, k_band_start, k_band_width)
        band_scores = jnp.where(sel, dot_keys(band(k_lo)), dot_keys(band(k_hi)))
        scores = jax.lax.dynamic_update_slice_in_dim(scores, band_scores, k_band_start, axis=4)
    causal = jnp.arange(k_hi.shape[2])[None, :] <= q_pos[:, None]
    probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
    v_base = v_hi if v_lo is None else jnp.where(v_base_lo[None, None, :, None], v_lo, v_hi)
    out = jnp.einsum("bkgcs,bksd->bkgcd", probs, v_base, precision=_HIGHEST)
    if v_band_width:
        band = lambda x: jax.lax.dynamic_slice_in_dim(x, v_band_start, v_band_width, axis=2)  # noqa: E731
        sel = in_history(v_interval, v_band_start, v_band_width)
        p_band = jax.lax.dynamic_slice_in_dim(probs, v_band_start, v_band_width, axis=4)
        base = band(v_base)
        out = out + jnp.einsum("bkgcs,bksd->bkgcd", jnp.where(sel, p_band, 0.0), band(v_lo) - base, precision=_HIGHEST)
        out = out + jnp.einsum("bkgcs,bksd->bkgcd", jnp.where(sel, 0.0, p_band), band(v_hi) - base, precision=_HIGHEST)
    return out


def mixed_attention(
    q: jax.Array,
    k_hi: jax.Array,
    k_lo: jax.Array | None,
    v_hi: jax.Array,
    v_lo: jax.Array | None,
    intervals: HistoryIntervals,
    *,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    q_start: int = 0,
) -> jax.Array:
    """Causal attention of the queries at positions q_start..q_start+T−1 over keys 0..S−1
    (S = q_start + T) where query t reads key s from the `lo` arrays when s lies in its history
    interval, else from the `hi` arrays.

    q [B, T, Hq, D]; k_*, v_* [B, S, Hkv, D] (lo may be None: no history); intervals hold one
    entry per query. Returns float32 [B, T, Hq, D]. Each chunk of queries attends to keys up to
    its last position; only the band of keys whose tier differs between the chunk's queries is
    computed both ways.
    """
    b, t, hq, d = q.shape
    kv = k_hi.shape[2]
    if k_hi.shape[1] != q_start + t or len(intervals.k_start) != t:
        raise ValueError(f"keys {k_hi.shape} and intervals ({len(intervals.k_start)}) must cover "
                         f"{q_start=} + {t} queries")
    heads_first = lambda x: None if x is None else x.astype(jnp.float32).transpose(0, 2, 1, 3)  # noqa: E731
    qh = q.astype(jnp.float32).reshape(b, t, kv, hq // kv, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    k_hi, k_lo, v_hi, v_lo = (heads_first(x) for x in (k_hi, k_lo, v_hi, v_lo))  # [B, Hkv, T, D]
    k_iv = np.stack([intervals.k_start, intervals.k_end]).astype(np.int32)
    v_iv = np.stack([intervals.v_start, intervals.v_end]).astype(np.int32)
    outs = []
    for start in range(0, t, query_chunk):
        stop = min(start + query_chunk, t)
        q_pos = np.arange(q_start + start, q_start + stop)
        k_plan = _band_of(k_iv[0, start:stop], k_iv[1, start:stop], q_pos, q_start + stop)
        v_plan = _band_of(v_iv[0, start:stop], v_iv[1, start:stop], q_pos, q_start + stop)
        use_k = k_lo is not None and (k_plan[0].any() or k_plan[2] > 0)
        use_v = v_lo is not None and (v_plan[0].any() or v_plan[2] > 0)
        keys = slice(0, q_start + stop)  # causal: no query of this chunk reads a later key
        outs.append(_chunk_attention(
            qh[:, :, :, start:stop], jnp.asarray(q_pos, jnp.int32), k_hi[:, :, keys],
            k_lo[:, :, keys] if use_k else None, v_hi[:, :, keys], v_lo[:, :, keys] if use_v else None,
            jnp.asarray(k_iv[:, start:stop]), jnp.asarray(v_iv[:, start:stop]),
            jnp.asarray(k_plan[0]), jnp.asarray(v_plan[0]), jnp.int32(k_plan[1]), jnp.int32(v_plan[1]),
            k_band_width=k_plan[2] if use_k else 0, v_band_width=v_plan[2] if use_v else 0))
    out = jnp.concatenate(outs, axis=3)  # [B, Hkv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)


def _rotate_heads(x: jax.Array, rotation: jax.Array) -> jax.Array:
    """x [B, T, Hkv·G, D] (G query heads per KV head, G = 1 for keys), rotation [Hkv, D, D]."""
    b, t, h, d = x.shape
    kv = rotation.shape[0]
    xg = x.astype(jnp.float32).reshape(b, t, kv, h // kv, d)
    return jnp.einsum("btkgd,kde->btkge", xg, rotation, precision=_HIGHEST).reshape(b, t, h, d)


class EmulatedCache:
    """A cache satisfying `attend` for one teacher-forced window at positions 0..T−1.

    Eager only (it calls the method's NumPy quantizers on concrete arrays): run
    `oscar_jax.model.prefill` without jit, or `emulated_logits`. Holds no K/V between calls.
    """

    def __init__(self, method: KVMethod, *, query_chunk: int = DEFAULT_QUERY_CHUNK):
        if query_chunk < 1:
            raise ValueError(f"{query_chunk=} must be positive")
        self.method = method
        self.query_chunk = query_chunk
        self.k_rotation = None if method.k_rotation is None else jnp.asarray(method.k_rotation, jnp.float32)
        self._intervals: dict[int, HistoryIntervals] = {}

    def intervals(self, length: int) -> HistoryIntervals:
        if length not in self._intervals:
            self._intervals[length] = self.method.history_intervals(length)
        return self._intervals[length]

    def attend(self, layer, q, k, v, positions):
        try:
            positions = np.asarray(positions)
        except jax.errors.TracerArrayConversionError:
            raise TypeError("EmulatedCache runs eagerly: call prefill without jax.jit") from None
        b, t = positions.shape
        if not np.array_equal(positions, np.broadcast_to(np.arange(t), (b, t))):
            raise ValueError("EmulatedCache emulates one whole window: positions must be 0..T-1 in every row")
        out_dtype = q.dtype
        if self.k_rotation is not None:
            q = _rotate_heads(q, self.k_rotation[layer])
            k = _rotate_heads(k, self.k_rotation[layer])
        k_hi, v_hi = bf16_round(k.astype(jnp.float32)), bf16_round(v.astype(jnp.float32))
        intervals = self.intervals(t)
        k_lo = v_lo = None
        if np.any(intervals.k_end > intervals.k_start):
            k_lo = jnp.asarray(self.method.quantize_keys(layer, np.asarray(k_hi)))
        if np.any(intervals.v_end > intervals.v_start):
            v_lo = jnp.asarray(self.method.quantize_values(layer, np.asarray(v_hi)))
        out = mixed_attention(q.astype(jnp.float32), k_hi, k_lo, v_hi, v_lo, intervals, query_chunk=self.query_chunk)
        return out.astype(out_dtype), self


_embed_jit = jax.jit(lambda table, tokens: jnp.take(table, tokens, axis=0))
_qkv_jit = jax.jit(qkv_projections, static_argnames="cfg")
_layer_output_jit = jax.jit(layer_output, static_argnames="cfg")


@functools.partial(jax.jit, static_argnames="cfg")
def _lm_head_jit(final_norm, head, cfg, x):
    params = {"final_norm": final_norm, ("embed" if cfg.tie_embeddings else "lm_head"): head}
    return lm_head(params, cfg, x)


def forward_with_cache(params: Params, cfg: ModelConfig, tokens, cache, *, start: int = 0, rows=None) -> jax.Array:
    """The model over tokens int [B, T] at positions start..start+T−1 through `cache.attend`
    (prefill's computation with the per-layer pieces jitted); the output projection only for
    `rows` (indices into the T tokens; all when None). Returns float32 [B, T or len(rows), V]."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be int [B, T] with T ≥ 1, got shape {tokens.shape}")
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))
    x = _embed_jit(params["embed"], tokens)
    for index, layer in enumerate(params["layers"]):
        q, k, v = _qkv_jit(layer, cfg, x, positions)
        o, cache = cache.attend(index, q, k, v, positions)
        x = _layer_output_jit(layer, cfg, x, o)
    if rows is not None:
        x = x[:, jnp.asarray(rows)]
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    return _lm_head_jit(params["final_norm"], head, cfg, x)


def emulated_logits(
    params: Params,
    cfg: ModelConfig,
    tokens,
    method: KVMethod,
    *,
    rows=None,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    prepared: bool = False,
) -> jax.Array:
    """Decode-faithful logits of a window: tokens int [B, T] → float32 [B, T, V] (or [B, len(rows), V]).

    The same computation as `prefill(prepare_params(params, cfg, method), cfg, tokens,
    EmulatedCache(method), all_logits=True)`, with the per-layer pieces jitted and the output
    projection applied only to `rows` (so an 8K-token window need not hold [T, V] logits).
    Pass `prepared=True` when params already hold the method's folded value rotation.
    """
    if not prepared:
        params = prepare_params(params, cfg, method)
    return forward_with_cache(params, cfg, tokens, EmulatedCache(method, query_chunk=query_chunk), rows=rows)
