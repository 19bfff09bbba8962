"""Decode-faithful emulation of a quantized KV cache, for a whole window in one teacher-forced pass.

While decoding, the query at position t sees the cache as it is after token t was appended and
before any demotion that append makes due (the runtime demotes after the step's attention):
some positions are read from BF16 (OSCAR: the sink [0, S0), the recent window of `tier_split(t)`
and token t itself; KIVI: its full-precision residual) and the rest ("history") through the
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
one k_lo / v_lo per layer serves every query.

Sliding-window (local) layers (Gemma 3, ModelConfig.layer_types): the model hands their window to
`attend(..., window=w)`. They keep the newest w positions in BF16 for every method — no rotation,
no quantization (`prepare_params` folds no value rotation into them) — and attend exactly as the
model does (q_pos − k_pos < w, `windowed_attention`). Methods apply to the global layers only.

Cost: queries run in chunks of `query_chunk`, each over the keys up to its last position
(memory O(query_chunk · T)). Within a chunk most keys have the same tier for every query (old
history, sink); they are read once from a "base" K/V that already holds the right copy. Only the
band of keys whose tier differs between the chunk's queries (about one chunk plus one page wide
for OSCAR-style tiers) gets both score matrices and the per-(query, key) select, so a pass costs
about one ordinary causal attention plus O(query_chunk · T) — a test checks it against dense
per-(query, key) selection.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from calibration.methods import HistoryIntervals, KVMethod
from oscar_jax.cache_api import reference_attention
from oscar_jax.model import (
    ModelConfig,
    Params,
    fold_value_rotation,
    input_embeddings,
    layer_output,
    lm_head,
    qkv_projections,
)

_HIGHEST = jax.lax.Precision.HIGHEST
DEFAULT_QUERY_CHUNK = 256


def prepare_params(params: Params, cfg: ModelConfig, method: KVMethod) -> Params:
    """Fold the method's value rotation into W_v / W_o of the global layers (unchanged params
    when it has none; sliding-window layers keep theirs: they store plain BF16)."""
    if method.v_rotation is None:
        return params
    rotation = method.v_rotation
    if cfg.local_layers:
        rotation = np.array(rotation, np.float32)
        rotation[list(cfg.local_layers)] = np.eye(cfg.head_dim, dtype=np.float32)
    return fold_value_rotation(params, cfg, rotation)


@functools.partial(jax.jit, static_argnames="window")
def _window_chunk(q, k, v, q_pos, k_pos, *, window):
    return reference_attention(q, k, v, q_pos, k_pos, window=window)


def windowed_attention(q, k, v, window: int, *, q_start: int = 0, query_chunk: int = DEFAULT_QUERY_CHUNK):
    """Sliding-window causal attention, float32, as the model's local layers compute it: the
    query at position p sees keys p − window < s ≤ p. q [B, T, Hq, D] at positions
    q_start..q_start+T−1; k, v [B, q_start + T, Hkv, D]. Queries run in chunks, each over the
    window + chunk keys it can see (memory O(query_chunk · (window + query_chunk)))."""
    b, t = q.shape[:2]
    if k.shape[1] != q_start + t:
        raise ValueError(f"keys {k.shape} must cover {q_start=} + {t} queries")
    outs = []
    for start in range(0, t, query_chunk):
        stop = min(start + query_chunk, t)
        first = max(0, q_start + start - window + 1)
        q_pos = jnp.broadcast_to(jnp.arange(q_start + start, q_start + stop, dtype=jnp.int32), (b, stop - start))
        k_pos = jnp.broadcast_to(jnp.arange(first, q_start + stop, dtype=jnp.int32), (b, q_start + stop - first))
        outs.append(_window_chunk(q[:, start:stop].astype(jnp.float32), k[:, first:q_start + stop].astype(jnp.float32),
                                  v[:, first:q_start + stop].astype(jnp.float32), q_pos, k_pos, window=window))
    return jnp.concatenate(outs, axis=1)


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


NO_RAW = np.iinfo(np.int32).max  # raw_start of a query without an unrounded region


def _chunk_plans(intervals: HistoryIntervals, t: int, q_start: int, query_chunk: int) -> list:
    """Per query chunk: (start, stop, raw start, K intervals, V intervals, K band plan, V band plan),
    device-ready. Chunks are cut where raw_start changes, so it is one scalar per chunk."""
    k_iv = np.stack([intervals.k_start, intervals.k_end]).astype(np.int32)
    v_iv = np.stack([intervals.v_start, intervals.v_end]).astype(np.int32)
    raw = np.full(t, NO_RAW, np.int64) if intervals.raw_start is None else np.asarray(intervals.raw_start, np.int64)
    plans = []
    start = 0
    while start < t:
        stop = min(start + query_chunk, t)
        changes = np.flatnonzero(raw[start:stop] != raw[start])
        if changes.size:
            stop = start + int(changes[0])
        q_pos = np.arange(q_start + start, q_start + stop)
        chunk_plans = []
        for iv in (k_iv, v_iv):
            base_lo, band_start, width = _band_of(iv[0, start:stop], iv[1, start:stop], q_pos, q_start + stop)
            if raw[start] != NO_RAW and (base_lo[raw[start]:].any() or (width and band_start + width > raw[start])):
                raise ValueError("the unrounded region (raw_start) overlaps the history of a query")
            chunk_plans.append((jnp.asarray(base_lo), jnp.int32(band_start), width, bool(base_lo.any())))
        raw_start = min(int(raw[start]), q_start + stop)
        plans.append((start, stop, raw_start, jnp.asarray(k_iv[:, start:stop]), jnp.asarray(v_iv[:, start:stop]),
                      *chunk_plans))
        start = stop
    return plans


@functools.partial(jax.jit, static_argnames=("k_band_width", "v_band_width"))
def _chunk_attention(q, q_pos, k_hi, k_lo, k_raw, v_hi, v_lo, v_raw, raw_start, k_interval, v_interval,
                     k_base_lo, v_base_lo, k_band_start, v_band_start, *, k_band_width, v_band_width):
    """One chunk of queries over keys 0..S−1.

    q [B, Hkv, G, C, D] (rotated), q_pos [C]; k_*, v_* [B, Hkv, S, D] (None when unused);
    keys ≥ raw_start (int32, the same for every query of the chunk) come from the raw arrays;
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

    is_raw = (jnp.arange(k_hi.shape[2]) >= raw_start)[None, None, :, None]
    k_base = k_hi if k_lo is None else jnp.where(k_base_lo[None, None, :, None], k_lo, k_hi)
    if k_raw is not None:
        k_base = jnp.where(is_raw, k_raw, k_base)
    scores = dot_keys(k_base)
    if k_band_width:
        band = lambda x: jax.lax.dynamic_slice_in_dim(x, k_band_start, k_band_width, axis=2)  # noqa: E731
        sel = in_history(k_interval, k_band_start, k_band_width)
        band_scores = jnp.where(sel, dot_keys(band(k_lo)), dot_keys(band(k_hi)))
        scores = jax.lax.dynamic_update_slice_in_dim(scores, band_scores, k_band_start, axis=4)
    causal = jnp.arange(k_hi.shape[2])[None, :] <= q_pos[:, None]
    probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
    v_base = v_hi if v_lo is None else jnp.where(v_base_lo[None, None, :, None], v_lo, v_hi)
    if v_raw is not None:
        v_base = jnp.where(is_raw, v_raw, v_base)
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
    plan_cache: dict | None = None,
    k_raw: jax.Array | None = None,
    v_raw: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of the queries at positions q_start..q_start+T−1 over keys 0..S−1
    (S = q_start + T) where query t reads key s from the `lo` arrays when s lies in its history
    interval, else from the `hi` arrays.

    q [B, T, Hq, D]; k_*, v_* [B, S, Hkv, D] (lo may be None: no history); intervals hold one
    entry per query. Returns float32 [B, T, Hq, D]. Each chunk of queries attends to keys up to
    its last position; only the band of keys whose tier differs between the chunk's queries is
    computed both ways. `plan_cache`: a dict the caller keeps for one `intervals` value (e.g.
    across layers), so the host-side chunk plans are built once. k_raw, v_raw [B, S, Hkv, D]:
    the unrounded copies read at positions ≥ intervals.raw_start (required when it is given).
    """
    b, t, hq, d = q.shape
    kv = k_hi.shape[2]
    if k_hi.shape[1] != q_start + t or len(intervals.k_start) != t:
        raise ValueError(f"keys {k_hi.shape} and intervals ({len(intervals.k_start)}) must cover "
                         f"{q_start=} + {t} queries")
    heads_first = lambda x: None if x is None else x.astype(jnp.float32).transpose(0, 2, 1, 3)  # noqa: E731
    qh = q.astype(jnp.float32).reshape(b, t, kv, hq // kv, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    if intervals.raw_start is not None and (k_raw is None or v_raw is None):
        raise ValueError("intervals.raw_start needs k_raw and v_raw")
    k_hi, k_lo, v_hi, v_lo, k_raw, v_raw = (heads_first(x) for x in (k_hi, k_lo, v_hi, v_lo, k_raw, v_raw))
    key = (q_start, t, query_chunk)
    plans = None if plan_cache is None else plan_cache.get(key)
    if plans is None:
        plans = _chunk_plans(intervals, t, q_start, query_chunk)
        if plan_cache is not None:
            plan_cache[key] = plans
    outs = []
    for start, stop, raw_start, k_iv, v_iv, k_plan, v_plan in plans:
        use_k = k_lo is not None and (k_plan[3] or k_plan[2] > 0)
        use_v = v_lo is not None and (v_plan[3] or v_plan[2] > 0)
        use_raw = k_raw is not None and raw_start < q_start + stop
        keys = slice(0, q_start + stop)  # causal: no query of this chunk reads a later key
        outs.append(_chunk_attention(
            qh[:, :, :, start:stop], jnp.arange(q_start + start, q_start + stop, dtype=jnp.int32),
            k_hi[:, :, keys], k_lo[:, :, keys] if use_k else None, k_raw[:, :, keys] if use_raw else None,
            v_hi[:, :, keys], v_lo[:, :, keys] if use_v else None, v_raw[:, :, keys] if use_raw else None,
            jnp.int32(raw_start), k_iv, v_iv, k_plan[0], v_plan[0], k_plan[1], v_plan[1],
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
        if getattr(method, "salient", 0):
            raise ValueError(f"{method.name}: salient tokens are chosen at the end of a prompt; a teacher-forced "
                             "window has none (calibration.passkey emulates them, with --prefill-chunk 0)")
        self.method = method
        self.query_chunk = query_chunk
        self.k_rotation = None if method.k_rotation is None else jnp.asarray(method.k_rotation, jnp.float32)
        self._intervals: dict[int, HistoryIntervals] = {}
        self._plans: dict = {}  # chunk plans, shared by all layers (intervals depend on T only)

    def intervals(self, length: int) -> HistoryIntervals:
        if length not in self._intervals:
            self._intervals[length] = self.method.history_intervals(length)
        return self._intervals[length]

    def attend(self, layer, q, k, v, positions, window: int | None = None):
        try:
            positions = np.asarray(positions)
        except jax.errors.TracerArrayConversionError:
            raise TypeError("EmulatedCache runs eagerly: call prefill without jax.jit") from None
        b, t = positions.shape
        if not np.array_equal(positions, np.broadcast_to(np.arange(t), (b, t))):
            raise ValueError("EmulatedCache emulates one whole window: positions must be 0..T-1 in every row")
        out_dtype = q.dtype
        if window is not None:  # a sliding-window layer: its BF16 window, whatever the method
            out = windowed_attention(q, bf16_round(k.astype(jnp.float32)), bf16_round(v.astype(jnp.float32)),
                                     window, query_chunk=self.query_chunk)
            return out.astype(out_dtype), self
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
        raw = {} if intervals.raw_start is None else {"k_raw": k, "v_raw": v}
        out = mixed_attention(q.astype(jnp.float32), k_hi, k_lo, v_hi, v_lo, intervals, query_chunk=self.query_chunk,
                              plan_cache=self._plans, **raw)
        return out.astype(out_dtype), self


_embed_jit = jax.jit(lambda table, tokens, cfg: input_embeddings({"embed": table}, cfg, tokens), static_argnames="cfg")
_qkv_jit = jax.jit(qkv_projections, static_argnames=("cfg", "local"))
_layer_output_jit = jax.jit(layer_output, static_argnames="cfg")


@functools.partial(jax.jit, static_argnames="cfg")
def _lm_head_jit(final_norm, head, cfg, x):
    params = {"final_norm": final_norm, ("embed" if cfg.tie_embeddings else "lm_head"): head}
    return lm_head(params, cfg, x)


def forward_with_cache(params: Params, cfg: ModelConfig, tokens, cache, *, start: int = 0, rows=None) -> jax.Array:
    """The model over tokens int [B, T] at positions start..start+T−1 through `cache.attend`
    (prefill's computation with the per-layer pieces jitted); the output projection only for
    `rows` (indices into the T tokens; all when None). Returns float32 [B, T or len(rows), V]."""
    x = hidden_states(params, cfg, tokens, cache, start=start)
    if rows is not None:
        x = x[:, jnp.asarray(rows)]
    return head_logits(params, cfg, x)


def head_logits(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm + output projection of hidden states [B, N, H] → float32 logits [B, N, V]."""
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    return _lm_head_jit(params["final_norm"], head, cfg, x)


def hidden_states(params: Params, cfg: ModelConfig, tokens, cache, *, start: int = 0) -> jax.Array:
    """`forward_with_cache` before the final norm: [B, T, H] (so a large vocabulary's logits can
    be computed a block of rows at a time)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be int [B, T] with T ≥ 1, got shape {tokens.shape}")
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))
    x = _embed_jit(params["embed"], tokens, cfg)
    for index, layer in enumerate(params["layers"]):
        window = cfg.layer_window(index)
        if window is None:
            q, k, v = _qkv_jit(layer, cfg, x, positions, local=False if cfg.local_layers else None)
            o, cache = cache.attend(index, q, k, v, positions)
        else:  # a sliding-window layer: the cache applies the window (as model._run_with_cache)
            q, k, v = _qkv_jit(layer, cfg, x, positions, local=True)
            o, cache = cache.attend(index, q, k, v, positions, window=window)
        x = _layer_output_jit(layer, cfg, x, o)
    return x


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
