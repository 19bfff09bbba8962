"""The INT2 codec, step by step (FORMAT.md §Codec is the prose of this file).

encode: float32 rows of d values → (packed uint8[..., d/4], scale f16[..., d/G], minimum f16[..., d/G])
decode: the inverse map to float32 levels, x̂ = minimum + code·scale.
encode_channels / decode_channels (format v2, `key_layout="channel"`): the same steps on each
channel of a page of keys over its tokens, packed per token as encode packs a row.

Every step is chosen so that any backend reproduces the bytes exactly: no division (multiply by
f32(1/3), exact scalings by 1/G), no rounding intrinsics (casts are round-to-nearest-even), codes
by comparison against thresholds whose products are exact, fixed summation order (tree_sum).
"""

from __future__ import annotations

import numpy as np

from shared_math.spec import (
    CODE_BITS,
    CODE_MASK,
    CODES_PER_BYTE,
    FP16_MAX,
    MIN_GROUP_SIZE,
    MOMENTS_MAD_TO_SIGMA,
    NUM_LEVELS,
    clip_index,
    is_power_of_two,
    validate_codec_shape,
    validate_levels,
)

_F32 = np.float32
ONE_THIRD_F32 = _F32(1.0 / (NUM_LEVELS - 1))  # f32(1/3): scale = (hi − lo)·f32(1/3), no division
# Thresholds between level j and j+1 sit at minimum + (j + 0.5)·scale.
THRESHOLD_OFFSETS = tuple(_F32(j + 0.5) for j in range(NUM_LEVELS - 1))
MOMENTS_MINIMUM_OFFSET = _F32((NUM_LEVELS - 1) / 2)  # 1.5: level 0 at μ − 1.5·scale


def sanitize(x: np.ndarray) -> np.ndarray:
    """Step 1: float32, NaN → 0, clamp to ±65504 (so ±Inf and huge values are defined)."""
    x = np.asarray(x, dtype=_F32)
    return np.clip(np.where(np.isnan(x), _F32(0), x), _F32(-FP16_MAX), _F32(FP16_MAX))


def clip_rows(x: np.ndarray, k: int) -> np.ndarray:
    """Step 2: τ = the k-th smallest |x| of each row (0-based, exact); x ← clamp(x, −τ, τ)."""
    tau = np.sort(np.abs(x), axis=-1)[..., k : k + 1]
    return np.minimum(np.maximum(x, -tau), tau)


def tree_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last (power-of-two) axis in the pinned order: v[:n/2] + v[n/2:], repeated."""
    n = v.shape[-1]
    while n > 1:
        n //= 2
        v = v[..., :n] + v[..., n:]
    return v[..., 0]


def _to_f16_saturating(v: np.ndarray) -> np.ndarray:
    return np.clip(v, _F32(-FP16_MAX), _F32(FP16_MAX)).astype(np.float16)


def group_metadata_minmax(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 3 (levels='minmax'): scale = f16(f32(hi − lo)·f32(1/3)), minimum = f16(lo)."""
    lo = groups.min(axis=-1)
    hi = groups.max(axis=-1)
    # Signed zeros: −0 orders below +0 (IEEE 754-2019 minimum/maximum). numpy's reductions leave
    # the sign of a zero result to SIMD lane order when a group holds both, so pin it here.
    zero = groups == 0
    lo = np.where((lo == 0) & np.any(zero & np.signbit(groups), axis=-1), _F32(-0.0), lo)
    hi = np.where((hi == 0) & np.any(zero & ~np.signbit(groups), axis=-1), _F32(0.0), hi)
    return _to_f16_saturating((hi - lo) * ONE_THIRD_F32), lo.astype(np.float16)


def group_metadata_moments(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 3 (levels='moments'): levels at μ ± σ·{0.5, 1.5} with σ = 1.25 × mean |x − μ|."""
    inv_g = _F32(1.0 / groups.shape[-1])  # exact: G is a power of two
    mu = tree_sum(groups) * inv_g
    mad = tree_sum(np.abs(groups - mu[..., None])) * inv_g
    scale = _to_f16_saturating(mad * _F32(MOMENTS_MAD_TO_SIGMA))
    minimum = _to_f16_saturating(mu - MOMENTS_MINIMUM_OFFSET * scale.astype(_F32))
    return scale, minimum


def quantize_codes(groups: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    """Step 4: code = Σ_j [x ≥ m + (j + 0.5)·s] in float32 — comparisons only, no division."""
    s = scale.astype(_F32)[..., None]
    m = minimum.astype(_F32)[..., None]
    codes = np.zeros(groups.shape, np.uint8)
    for offset in THRESHOLD_OFFSETS:
        codes += groups >= m + offset * s
    return codes


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Step 5, quartered packing: byte[i] = c[i] | c[i+Q]<<2 | c[i+2Q]<<4 | c[i+3Q]<<6, Q = d/4."""
    codes = np.asarray(codes, np.uint8)
    quarter = codes.shape[-1] // CODES_PER_BYTE
    packed = np.zeros(codes.shape[:-1] + (quarter,), np.uint8)
    for plane in range(CODES_PER_BYTE):
        packed |= (codes[..., plane * quarter : (plane + 1) * quarter] & CODE_MASK) << (plane * CODE_BITS)
    return packed


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_codes: uint8[..., d/4] → codes uint8[..., d]."""
    packed = np.asarray(packed, np.uint8)
    planes = [(packed >> (plane * CODE_BITS)) & CODE_MASK for plane in range(CODES_PER_BYTE)]
    return np.concatenate(planes, axis=-1)


def _check_rows(x: np.ndarray, group_size: int) -> int:
    if x.ndim < 1:
        raise ValueError(f"x must have at least one axis (rows of head_dim values), got shape {x.shape}")
    d = x.shape[-1]
    validate_codec_shape(d, group_size)
    return d


def encode(x, *, group_size: int, clip_ratio: float, levels: str = "minmax"):
    """Format v1 encode over arbitrary leading dimensions.

    Args:
      x: real array [..., d]; converted to float32 (the codec is defined on float32 input).
      group_size: G, a power of two with 16 ≤ G ≤ d.
      clip_ratio: c in (0, 1]; the clip threshold is the min(floor(c·d), d−1)-th smallest |x|.
      levels: "minmax" (the paper's codec, the reference) or "moments".
    Returns:
      packed uint8[..., d/4], scale float16[..., d/G], minimum float16[..., d/G].
    """
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"x must be a real array, got dtype {x.dtype}")
    d = _check_rows(x, group_size)
    validate_levels(levels)
    codes, scale, minimum = _codes_and_metadata(x, group_size, clip_index(clip_ratio, d), levels)
    return pack_codes(codes), scale, minimum


def _codes_and_metadata(x: np.ndarray, group_size: int, k: int, levels: str):
    """Steps 1-4 on rows [..., n]: codes uint8[..., n], scale and minimum f16[..., n/G]."""
    clipped = clip_rows(sanitize(x), k)
    groups = clipped.reshape(clipped.shape[:-1] + (clipped.shape[-1] // group_size, group_size))
    metadata = group_metadata_minmax if levels == "minmax" else group_metadata_moments
    scale, minimum = metadata(groups)
    return quantize_codes(groups, scale, minimum).reshape(clipped.shape), scale, minimum


def _decode_inputs(packed, scale, minimum):
    """The arrays decode reads, checked: packed uint8, scale and minimum float16."""
    packed, scale, minimum = np.asarray(packed), np.asarray(scale), np.asarray(minimum)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if scale.dtype != np.float16 or minimum.dtype != np.float16:
        raise ValueError(f"scale and minimum must be float16, got {scale.dtype} and {minimum.dtype}")
    return packed, scale, minimum


def decode(packed, scale, minimum, *, group_size: int) -> np.ndarray:
    """Format v1 decode: float32[..., d] with x̂ = f32(minimum) + code·f32(scale) per group."""
    packed, scale, minimum = _decode_inputs(packed, scale, minimum)
    if packed.ndim < 1:
        raise ValueError(f"packed must have at least one axis, got shape {packed.shape}")
    d = packed.shape[-1] * CODES_PER_BYTE
    validate_codec_shape(d, group_size)
    meta_shape = packed.shape[:-1] + (d // group_size,)
    if scale.shape != meta_shape or minimum.shape != meta_shape:
        raise ValueError(
            f"scale {scale.shape} and minimum {minimum.shape} must have shape {meta_shape} "
            f"for packed {packed.shape} and {group_size=}"
        )
    codes = unpack_codes(packed).reshape(meta_shape + (group_size,))
    values = minimum.astype(_F32)[..., None] + codes.astype(_F32) * scale.astype(_F32)[..., None]
    return values.reshape(packed.shape[:-1] + (d,))


def _check_page(x: np.ndarray) -> tuple[int, int]:
    if x.ndim < 2:
        raise ValueError(f"a key page must have shape [..., page, d], got shape {x.shape}")
    page, d = x.shape[-2:]
    validate_codec_shape(d, MIN_GROUP_SIZE)
    if not is_power_of_two(page) or page < MIN_GROUP_SIZE:
        raise ValueError(f"page={page} tokens must be a power of two >= {MIN_GROUP_SIZE} (each channel's group)")
    return page, d


def encode_channels(x, *, clip_ratio: float, levels: str = "minmax"):
    """Format v2 key pages: each channel quantized over the page's tokens (KIVI's key grouping).

    Steps 1-4 of `encode` run on each channel's column of `page` values (clip index
    min(floor(c·page), page−1); one scale and minimum per channel); the codes are then packed per
    token exactly as `encode` packs a row, so a page's code bytes have v1's layout.

    Args:
      x: real array [..., page, d] (page a power of two ≥ 16, d a power of two ≥ 16).
      clip_ratio: c in (0, 1], over each channel's page values.
      levels: "minmax" or "moments", as for `encode`.
    Returns:
      packed uint8[..., page, d/4], scale float16[..., d], minimum float16[..., d].
    """
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"x must be a real array, got dtype {x.dtype}")
    page, _ = _check_page(x)
    validate_levels(levels)
    columns = np.swapaxes(x, -1, -2)  # [..., d, page]: one row per channel
    codes, scale, minimum = _codes_and_metadata(columns, page, clip_index(clip_ratio, page), levels)
    return pack_codes(np.swapaxes(codes, -1, -2)), scale[..., 0], minimum[..., 0]


def decode_channels(packed, scale, minimum) -> np.ndarray:
    """Format v2 key pages: float32[..., page, d] with x̂ = f32(minimum[c]) + code·f32(scale[c])."""
    packed, scale, minimum = _decode_inputs(packed, scale, minimum)
    if packed.ndim < 2:
        raise ValueError(f"packed must have shape [..., page, d/4], got shape {packed.shape}")
    meta_shape = packed.shape[:-2] + (packed.shape[-1] * CODES_PER_BYTE,)
    if scale.shape != meta_shape or minimum.shape != meta_shape:
        raise ValueError(f"scale {scale.shape} and minimum {minimum.shape} must have shape {meta_shape} "
                         f"for packed {packed.shape}")
    codes = unpack_codes(packed).astype(_F32)
    return minimum.astype(_F32)[..., None, :] + codes * scale.astype(_F32)[..., None, :]
