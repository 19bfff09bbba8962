"""Reference decode attention over a mixed-tier cache, in float64.

The kernels split the cached tokens into chunks (split-K), compute a normalised partial output and
a log-sum-exp per chunk, then merge: o = Σ_c exp(lse_c − lse) · o_c with lse = logsumexp(lse_c).
This module is that computation in float64, and the one-pass softmax it must equal.

Shapes (one sequence): q [Hq, D]; k, v [S, Hkv, D]; query head h reads KV head h // (Hq / Hkv).
"""

from __future__ import annotations

import numpy as np

from shared_math.codec import decode, decode_channels


def _gqa_expand(q: np.ndarray, k: np.ndarray) -> int:
    if q.ndim != 2 or k.ndim != 3 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"expected q [Hq, D] and k/v [S, Hkv, D], got {q.shape} and {k.shape}")
    hq, hkv = q.shape[0], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    return hq // hkv


def _scores(q: np.ndarray, k: np.ndarray, softmax_scale: float) -> np.ndarray:
    group = _gqa_expand(q, k)
    k_per_q = np.repeat(np.asarray(k, np.float64), group, axis=1)  # [S, Hq, D]
    return np.einsum("hd,shd->hs", np.asarray(q, np.float64), k_per_q) * softmax_scale


def softmax_attention(q, k, v, *, softmax_scale: float) -> np.ndarray:
    """One-pass softmax attention of one query token over S cached tokens: [Hq, D] float64."""
    s = _scores(q, k, softmax_scale)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    v_per_q = np.repeat(np.asarray(v, np.float64), q.shape[0] // v.shape[1], axis=1)
    return np.einsum("hs,shd->hd", p, v_per_q)


def attention_partial(q, k, v, *, softmax_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's normalised output [Hq, D] and log-sum-exp [Hq] (−inf and zeros if empty)."""
    q = np.asarray(q, np.float64)
    if k.shape[0] == 0:
        return np.zeros(q.shape), np.full(q.shape[0], -np.inf)
    s = _scores(q, k, softmax_scale)
    row_max = s.max(axis=-1, keepdims=True)
    p = np.exp(s - row_max)
    total = p.sum(axis=-1, keepdims=True)
    v_per_q = np.repeat(np.asarray(v, np.float64), q.shape[0] // v.shape[1], axis=1)
    out = np.einsum("hs,shd->hd", p / total, v_per_q)
    return out, (row_max + np.log(total))[:, 0]


def merge_partials(outputs, lses) -> tuple[np.ndarray, np.ndarray]:
    """Merge chunk partials: (output [Hq, D], lse [Hq]). Empty chunks (lse = −inf) weigh 0."""
    outputs, lses = np.asarray(outputs, np.float64), np.asarray(lses, np.float64)
    lse = np.logaddexp.reduce(lses, axis=0)
    weights = np.exp(lses - lse)  # [C, Hq]
    weights = np.where(np.isfinite(lses), weights, 0.0)
    return np.einsum("ch,chd->hd", weights, outputs), lse


def split_attention(q, k, v, *, softmax_scale: float, chunk_size: int) -> np.ndarray:
    """Split-K attention: chunks of `chunk_size` cached tokens, partials merged by log-sum-exp."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{chunk_size=} must be a positive integer")
    parts = [
        attention_partial(q, k[i : i + chunk_size], v[i : i + chunk_size], softmax_scale=softmax_scale)
        for i in range(0, max(k.shape[0], 1), chunk_size)
    ]
    return merge_partials([o for o, _ in parts], [l for _, l in parts])[0]


def mixed_tier_decode_attention(
    q,
    *,
    sink: tuple[np.ndarray, np.ndarray],
    history: tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]],
    recent: tuple[np.ndarray, np.ndarray],
    group_size: int,
    softmax_scale: float,
    chunk_size: int = 64,
    key_layout: str = "token",
) -> np.ndarray:
    """Decode attention over [sink BF16 ‖ history INT2 ‖ recent BF16] in float64.

    sink, recent: (k, v) float arrays [S_tier, Hkv, D] (already rotated, as the cache holds them);
    history: ((k_packed, k_scale, k_min), (v_packed, v_scale, v_min)), each [S_hist, Hkv, ...],
    dequantized with the format v1 decode — except, with key_layout "channel" (format v2), the keys:
    pages (k_packed [P, Hkv, L, D/4], k_scale and k_min [P, Hkv, D]) dequantized with
    decode_channels, token p·L + t of the history being page p's row t. Each tier is split into
    chunks; all partials are merged together, exactly as the two-tier split-K kernels do.
    """
    if key_layout == "channel":
        pages = decode_channels(*history[0])  # [P, Hkv, L, D]
        k_hist = pages.transpose(0, 2, 1, 3).reshape(-1, pages.shape[1], pages.shape[3])
    elif key_layout == "token":
        k_hist = decode(*history[0], group_size=group_size)
    else:
        raise ValueError(f"{key_layout=} must be 'token' or 'channel'")
    v_hist = decode(*history[1], group_size=group_size)
    outputs, lses = [], []
    for k, v in (sink, (k_hist, v_hist), recent):
        for i in range(0, k.shape[0], chunk_size):
            o, l = attention_partial(q, k[i : i + chunk_size], v[i : i + chunk_size], softmax_scale=softmax_scale)
            outputs.append(o)
            lses.append(l)
    if not outputs:
        raise ValueError("the cache is empty: decode attention needs at least one cached token")
    return merge_partials(outputs, lses)[0]
