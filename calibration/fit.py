"""Rotations from covariances, and the attention-aware errors used to fit clip ratios and report.

Errors are measured on held-out calibration tokens, one layer at a time, in rotated coordinates
(R is orthogonal, so the error norms equal those in the original space):
  key logit error    ‖Q(K − K̂)ᵀ‖² / ‖QKᵀ‖² over causal (query, key) pairs; K̂ per token (format v1)
                     or, key_layout "channel" (format v2), per channel over groups of `key_group`
                     consecutive tokens from the window's start (a trailing partial group unquantized)
  value output error ‖S(V − V̂)‖² / ‖SV‖², S the full-precision causal softmax
"""

from __future__ import annotations

import numpy as np

from shared_math.codec import decode, decode_channels, encode, encode_channels
from shared_math.rotation import rotation_from_covariance

CLIP_GRID = (0.80, 0.84, 0.88, 0.92, 0.96, 1.0)


def rotations(cov: np.ndarray, kind: str, per_layer: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(R [L, Hkv, D, D] float64, eigenvalues [L, Hkv, D]) from covariances [L, Hkv, D, D].

    per_layer: one rotation per layer from the head-averaged covariance, shared by its heads.
    """
    num_layers, num_heads, d, _ = cov.shape
    rot = np.empty_like(cov)
    eig = np.empty(cov.shape[:3])
    for layer in range(num_layers):
        for head in range(num_heads):
            target = cov[layer].mean(axis=0) if per_layer else cov[layer, head]
            rot[layer, head], eig[layer, head] = rotation_from_covariance(target, kind)
    return rot, eig


def _quantize(x: np.ndarray, group_size: int, clip_ratio: float, levels: str) -> np.ndarray:
    return decode(*encode(x, group_size=group_size, clip_ratio=clip_ratio, levels=levels), group_size=group_size)


def _quantize_channels(x: np.ndarray, key_group: int, clip_ratio: float, levels: str) -> np.ndarray:
    """x [H, T, D] → per channel over consecutive groups of `key_group` tokens from token 0
    (shared_math.codec.encode_channels, clip index over a group's values); a trailing partial group
    is returned unchanged (its error is 0: it stays BF16 in the cache until its page is whole)."""
    h, t, d = x.shape
    full = (t // key_group) * key_group
    out = x.copy()
    if full:
        pages = x[:, :full].reshape(h, full // key_group, key_group, d)
        out[:, :full] = decode_channels(*encode_channels(pages, clip_ratio=clip_ratio, levels=levels)).reshape(h, full, d)
    return out


def _causal_mask(t: int) -> np.ndarray:
    return np.tril(np.ones((t, t), bool))


def _by_kv_head(x: np.ndarray, hkv: int) -> np.ndarray:
    """[T, H, D] → [Hkv, T·(H/Hkv), D] with row t·G + g for query head h = kv·G + g."""
    t, h, d = x.shape
    return x.reshape(t, hkv, h // hkv, d).transpose(1, 0, 2, 3).reshape(hkv, t * (h // hkv), d)


def key_logit_error(q, k, rotation, *, group_size, clip_ratio, levels, key_layout="token", key_group=None) -> float:
    """q [T, Hq, D], k [T, Hkv, D], rotation [Hkv, D, D] → relative causal logit error.

    key_layout "channel" (format v2): keys quantized per channel over groups of `key_group` tokens
    (clip ratio over a group's values); group_size is then unused."""
    t, hq, _ = q.shape
    hkv = k.shape[1]
    kr = np.einsum("thd,hde->hte", k, rotation)  # [Hkv, T, D]
    if key_layout == "channel":
        err = kr - _quantize_channels(kr.astype(np.float32), key_group, clip_ratio, levels)
    elif key_layout == "token":
        err = kr - _quantize(kr.astype(np.float32), group_size, clip_ratio, levels)
    else:
        raise ValueError(f"{key_layout=} must be 'token' or 'channel'")
    qr = _by_kv_head(q, hkv) @ rotation  # [Hkv, T·G, D]
    mask = np.repeat(_causal_mask(t), hq // hkv, axis=0)  # row t·G + g sees keys ≤ t
    num = np.where(mask, qr @ np.swapaxes(err, 1, 2), 0)
    den = np.where(mask, qr @ np.swapaxes(kr, 1, 2), 0)
    return float(np.sum(num**2) / np.sum(den**2))


def causal_probabilities(q, k) -> np.ndarray:
    """Full-precision causal softmax S [Hkv, T·G, T] of one sequence (q [T, Hq, D], k [T, Hkv, D])."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    s = (_by_kv_head(q, hkv) @ np.swapaxes(k.transpose(1, 0, 2), 1, 2)) / np.sqrt(d)
    s = np.where(np.repeat(_causal_mask(t), hq // hkv, axis=0), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def value_output_error(probs, v, rotation, *, group_size, clip_ratio, levels) -> float:
    """probs [Hkv, T·G, T] (causal_probabilities), v [T, Hkv, D], rotation [Hkv, D, D] → relative output error."""
    vr = np.einsum("thd,hde->hte", v, rotation)  # [Hkv, T, D]
    err = vr - _quantize(vr.astype(np.float32), group_size, clip_ratio, levels)
    return float(np.sum((probs @ err) ** 2) / np.sum((probs @ vr) ** 2))
