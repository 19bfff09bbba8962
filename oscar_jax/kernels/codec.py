"""Format v1 INT2 codec as Pallas kernels: encode and decode rows of D values (DESIGN.md §2).

The block bodies `encode_block` / `decode_block` are pure jnp functions on values, shared by the
codec launchers here and the write-path kernels in write.py. They follow shared_math/codec.py step
by step, with the same float32 operations in the same order, so the bytes are identical:

  1. sanitize   NaN → 0, clamp to ±FP16_MAX
  2. clip       τ = the k-th smallest |x| (0-based), found exactly on the int32 bit patterns of
                |x| (monotone for non-negative floats) — no sort; x ← clamp(x, −τ, τ)
  3. metadata   minmax: scale = f16((hi − lo)·f32(1/3)), minimum = f16(lo)
                moments: μ = tree_sum(x)·f32(1/G), mad = tree_sum(|x − μ|)·f32(1/G),
                         scale = f16sat(mad·1.25), minimum = f16sat(μ − 1.5·f32(scale))
  4. codes      code = Σ_j [x ≥ m + (j + 0.5)·s]  (comparisons, no division)
  5. pack       byte[i] = c[i] | c[i+Q]<<2 | c[i+2Q]<<4 | c[i+3Q]<<6, Q = D/4 ("quartered")

Two machine behaviours must not reach the bytes:
  * signs of zeros: Triton lowers float min/max to minnum/maxnum and negation to 0 − x. So the
    clamp of step 2 is written with comparisons that return the bound on ties (as numpy's
    maximum/minimum on x86 do), group min/max are taken on order-preserving int32 keys (−0 < +0,
    IEEE 754-2019 minimum/maximum), and −τ flips the sign bit;
  * flushing of subnormals: XLA:CPU (interpret mode) treats subnormal floats as zero in compares
    and arithmetic, and a GPU may too. So every compare runs on int32 keys, and the moments sums
    run on a copy scaled by 2^103 where every value is normal (see MOMENTS_SCALE_EXP).
Caveat (a spec question, not a kernel one): for a group whose minimum (maximum) is a zero and
which holds both +0 and −0, numpy's min/max reduction returns a SIMD-lane-dependent zero (and
numpy on ARM would clamp zeros differently from x86); the kernel returns −0 (+0). Every other
input, NaN/±Inf/subnormals included, gives bit-identical bytes.

Shapes (one vocabulary): R rows in a block, D head dim, G group size, Q = D/4 packed bytes,
NG = D/G groups per row, N rows in total.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from shared_math.codec import MOMENTS_MINIMUM_OFFSET, ONE_THIRD_F32, THRESHOLD_OFFSETS
from shared_math.float_bits import (
    BF16_LOW_MASK,
    F32_EXPONENT_MASK,
    F32_MAGNITUDE_MASK,
    F32_MANTISSA_MASK,
    F32_SIGN_BIT,
    F32_SIGN_SHIFT,
    FP16_MAX_BITS,
    ORDERED_KEY_ABOVE_ALL,
    ORDERED_KEY_BELOW_ALL,
)
from shared_math.spec import CODE_BITS, CODE_MASK, CODES_PER_BYTE, FP16_MAX, MOMENTS_MAD_TO_SIGMA
from shared_math import tiling
from shared_math.tiling import BISECTION_STEPS, ORDER_STATISTICS, select_order_statistic

BELOW_EVERY_MAGNITUDE = -1  # below every |x| bit pattern: what a masked max returns for an exhausted row

DEFAULT_BLOCK_ROWS = 16  # power of two; also tl.dot's minimum M for the fused key rotation
DEFAULT_NUM_WARPS = 4


# Interpreted (CPU), an attention call left to the default tiling runs one split of blocks of up to
# this many tokens (shared_math.tiling.interpreted_tiling). JAX's interpreter pays per inner-loop
# iteration and compiles each block's body unrolled, so a longer block trades step time for compile
# time; 64 tokens cost the least over a long decode test and over short ones (benchmarks/DECISIONS.md
# C1).
INTERPRET_BLOCK_TOKENS = 64


def resolve_interpret(interpret: bool | None) -> bool:
    """None → interpret on a CPU backend, compile (Triton) on a GPU backend."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)


def resolve_order_statistic(order_statistic: str | None, head_dim: int, clip_index: int, rows_dtype,
                            rotated: bool = False) -> str:
    """shared_math.tiling.resolve_order_statistic for rows of `rows_dtype` (rotated in the kernel
    or not): tagged_max applies to bfloat16 rows that the kernel does not rotate."""
    return tiling.resolve_order_statistic(
        order_statistic, head_dim, clip_index, rows_bf16=jnp.dtype(rows_dtype) == jnp.bfloat16 and not rotated,
        rows=f"{jnp.dtype(rows_dtype)} rows" + (" rotated in the kernel" if rotated else ""),
    )


# --------------------------------------------------------------------------------- block bodies


def clip_threshold_bits(abs_bits, *, clip_index: int, order_statistic: str):
    """The k-th smallest (0-based) value of each row of abs_bits [R, D] (non-negative int32 ≤
    FP16_MAX_BITS, the bit patterns of |x|), exactly, as int32 [R, 1]. The methods are described
    with shared_math.tiling.ORDER_STATISTICS; `tagged_max` needs rows of bfloat16 values."""
    rows, d = abs_bits.shape
    assert 0 <= clip_index < d, (clip_index, d)
    skip = d - 1 - clip_index  # the value sought has `skip` values above it, counting ties
    above_all = jnp.full((rows, 1), F32_MAGNITUDE_MASK, jnp.int32)  # above every |x| bit pattern

    def next_below(values):
        """One round: the largest of `values` under the previous round's result."""
        return lambda _, ceiling: jnp.max(
            jnp.where(values < ceiling, values, BELOW_EVERY_MAGNITUDE), axis=1, keepdims=True
        )

    if order_statistic == "max_drop":
        # Take the largest remaining value and drop all its copies, counting ties, until the
        # value of rank k is reached; `remaining` = how many of the largest values still to skip.
        def body(_, carry):
            tau, remaining, ceiling = carry
            top = next_below(abs_bits)(_, ceiling)
            count = jnp.sum((abs_bits == top).astype(jnp.int32), axis=1, keepdims=True)
            found = (remaining >= 0) & (count > remaining)  # only once: remaining < 0 afterwards
            return jnp.where(found, top, tau), remaining - count, top

        init = (jnp.zeros((rows, 1), jnp.int32), jnp.full((rows, 1), skip, jnp.int32), above_all)
        tau, _, _ = lax.fori_loop(0, skip + 1, body, init)  # each round drops ≥ 1 value
        return tau
    if order_statistic == "tagged_max":
        # Rows of bfloat16 values leave the low BF16_DROPPED_BITS of |x| free (the sanitize clamp
        # FP16_MAX is the one exception: rounded up, it still orders above every bfloat16 ≤ it):
        # tagged with the column, all keys differ, so round skip + 1 lands on rank k, ties included.
        assert d <= BF16_LOW_MASK + 1, d
        column = lax.broadcasted_iota(jnp.int32, (rows, d), 1)
        tagged = ((abs_bits + BF16_LOW_MASK) & ~BF16_LOW_MASK) | column
        top = lax.fori_loop(0, skip + 1, next_below(tagged), above_all)
        return jnp.minimum(top & ~BF16_LOW_MASK, FP16_MAX_BITS)
    if order_statistic == "checked_max":
        # Round r gives the r-th largest distinct value t_r (or the sentinel). Always
        # #{|x| > t_{skip+1}} ≥ skip; where it equals skip, t_{skip+1} has rank k. A block with a
        # row where ties hid among the largest values redoes τ by max_drop.
        top = lax.fori_loop(0, skip + 1, next_below(abs_bits), above_all)
        above = jnp.sum((abs_bits > top).astype(jnp.int32), axis=1, keepdims=True)
        # One axis per reduction: the Triton lowering's multi-axis reductions fail under an
        # explicit mesh (test_layered_kernels_compile_for_h200).
        worst = jnp.max(jnp.max(above, axis=0), axis=0)
        return lax.cond(
            worst == skip,
            lambda: top,
            lambda: clip_threshold_bits(abs_bits, clip_index=clip_index, order_statistic="max_drop"),
        )
    if order_statistic == "bisect":
        # Smallest v with #{|x| ≤ v} ≥ k + 1; invariant: the answer lies in [lo, hi].
        need = clip_index + 1

        def body(_, carry):
            lo, hi = carry
            mid = lo + ((hi - lo) >> 1)
            count = jnp.sum((abs_bits <= mid).astype(jnp.int32), axis=1, keepdims=True)
            enough = count >= need
            return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

        init = (jnp.zeros((rows, 1), jnp.int32), jnp.full((rows, 1), FP16_MAX_BITS, jnp.int32))
        lo, _ = lax.fori_loop(0, BISECTION_STEPS, body, init)
        return lo
    raise ValueError(f"{order_statistic=} must be one of {ORDER_STATISTICS}")


def _ieee_key(bits):
    """int32 float bits → int32 key that compares like IEEE floats (−0 == +0), exactly: integer
    compares see subnormals, which XLA:CPU (interpret mode) flushes to zero in float compares."""
    return jnp.where(bits < 0, -(bits & F32_MAGNITUDE_MASK), bits)


def _ordered_key(bits):
    """int32 float bits → int32 key with the float order (−0 < +0); an involution."""
    return bits ^ ((bits >> F32_SIGN_SHIFT) & F32_MAGNITUDE_MASK)


def _group_min_max(groups):
    """Exact group min and max [R, NG, 1] of groups [R, NG, G] (no NaN), order-free."""
    key = _ordered_key(lax.bitcast_convert_type(groups, jnp.int32))
    lo = _ordered_key(jnp.min(key, axis=-1, keepdims=True))
    hi = _ordered_key(jnp.max(key, axis=-1, keepdims=True))
    return lax.bitcast_convert_type(lo, jnp.float32), lax.bitcast_convert_type(hi, jnp.float32)


def tree_sum(v):
    """Sum over the last (power-of-two) axis in the pinned order v[:n/2] + v[n/2:], repeated;
    keeps the axis (size 1). Explicit halves, never a reduction (whose order is unspecified)."""
    while v.shape[-1] > 1:
        first, second = jnp.split(v, 2, axis=-1)
        v = first + second
    return v


# levels="moments" sums in a scaled copy of the values, x·2^MOMENTS_SCALE_EXP: every float32 there
# is normal (the smallest subnormal 2^-149 becomes 2^-46) and nothing overflows (|Σ x| and
# Σ|x − μ| ≤ G·FP16_MAX < 2^23 become < 2^126). Adds of float32 values are exact when their result
# is subnormal, so IEEE sums with gradual underflow (numpy) are exactly 2^-E times the scaled sums:
# the bytes do not depend on whether the machine flushes subnormals (XLA:CPU, which runs interpret
# mode, does; a GPU may). Only μ = Σ·f32(1/G) can round in the subnormal range; that rounding (to a
# multiple of 2^-149) is reproduced explicitly.
MOMENTS_SCALE_EXP = 103
_F32 = np.finfo(np.float32)
_SCALE_UP = np.float32(2.0**MOMENTS_SCALE_EXP)
_SCALE_DOWN = np.float32(2.0**-MOMENTS_SCALE_EXP)
_SUBNORMAL_QUANTUM_SCALED = np.float32(float(_F32.smallest_subnormal) * 2.0**MOMENTS_SCALE_EXP)
_NORMAL_MIN_SCALED = np.float32(float(_F32.smallest_normal) * 2.0**MOMENTS_SCALE_EXP)
assert _NORMAL_MIN_SCALED == _SUBNORMAL_QUANTUM_SCALED * np.float32(2.0 ** int(_F32.nmant))


def _scaled_exactly(bits):
    """float32 bits → x·2^E as a normal float32, exactly, without float ops on subnormals."""
    exponent = bits & F32_EXPONENT_MASK
    normal = lax.bitcast_convert_type(bits, jnp.float32) * _SCALE_UP
    magnitude = (bits & F32_MANTISSA_MASK).astype(jnp.float32) * _SUBNORMAL_QUANTUM_SCALED
    subnormal = lax.bitcast_convert_type(magnitude, jnp.int32) | (bits & F32_SIGN_BIT)
    return jnp.where(exponent == 0, lax.bitcast_convert_type(subnormal, jnp.float32), normal)


def _round_to_subnormal_grid(v):
    """Scaled v with |v| below the scaled normal minimum → the nearest (ties to even) multiple of
    the scaled subnormal quantum, keeping the sign: what float32 gradual underflow does.
    |v| + 2^-23 lies in [2^-23, 2^-22), whose spacing is exactly that quantum."""
    magnitude = jnp.abs(v)
    rounded = (magnitude + _NORMAL_MIN_SCALED) - _NORMAL_MIN_SCALED
    v_bits = lax.bitcast_convert_type(v, jnp.int32)
    signed = lax.bitcast_convert_type(rounded, jnp.int32) | (v_bits & F32_SIGN_BIT)
    return jnp.where(magnitude < _NORMAL_MIN_SCALED, lax.bitcast_convert_type(signed, jnp.float32), v)


def _moments_metadata(groups):
    """levels="moments" metadata of groups [R, NG, G] (sanitized, clipped): scale and minimum
    float16 [R, NG, 1], as shared_math: μ = tree_sum(x)·f32(1/G), mad = tree_sum(|x − μ|)·f32(1/G),
    scale = f16sat(mad·1.25), minimum = f16sat(μ − 1.5·f32(scale))."""
    inv_g = np.float32(1.0 / groups.shape[-1])  # exact: G is a power of two
    scaled = _scaled_exactly(lax.bitcast_convert_type(groups, jnp.int32))
    mu = _round_to_subnormal_grid(tree_sum(scaled) * inv_g)  # 2^E·μ exactly
    mad = tree_sum(jnp.abs(scaled - mu)) * inv_g  # 2^E·mad (only tiny mads, scale 0, may differ)
    # mad·1.25 scales exactly; unscaling is exact down to the subnormal range, where the float16
    # cast gives +0 either way.
    scale = _to_f16_saturating((mad * np.float32(MOMENTS_MAD_TO_SIGMA)) * _SCALE_DOWN)
    # μ unscaled: exact, or (subnormal μ on a flushing machine) ±0 with μ's sign; both give the
    # same μ − 1.5·s after rounding (1.5·s ≥ 2^-25 dwarfs a subnormal) and the same float16.
    minimum = _to_f16_saturating(mu * _SCALE_DOWN - MOMENTS_MINIMUM_OFFSET * scale.astype(jnp.float32))
    return scale, minimum


def _to_f16_saturating(v):
    """f16(clip(v, ±FP16_MAX)), round-to-nearest-even; −0 stays −0."""
    v = jnp.where(v > FP16_MAX, FP16_MAX, jnp.where(v < -FP16_MAX, -FP16_MAX, v))
    return v.astype(jnp.float16)


def encode_block(x, *, group_size: int, clip_index: int, levels: str, order_statistic: str):
    """Encode a block of rows x [R, D] (any real dtype; converted to float32 exactly).

    Returns packed uint8 [R, D/4], scale float16 [R, D/G], minimum float16 [R, D/G].
    """
    codes, scale, minimum = code_block(x, group_size=group_size, clip_index=clip_index, levels=levels,
                                       order_statistic=order_statistic)
    return pack_block(codes), scale, minimum


def encode_channels_block(x, *, clip_index: int, levels: str, order_statistic: str):
    """Format v2 key pages x [N, L, D] (L tokens a page): each channel over the page's tokens is one
    row of G = L through `code_block`, and the codes are packed per token as `encode_block` packs a
    row (shared_math.codec.encode_channels). Returns packed uint8 [N, L, D/4], scale and minimum
    float16 [N, D]."""
    pages, page_size, d = x.shape
    columns = jnp.swapaxes(x, 1, 2).reshape(pages * d, page_size)
    codes, scale, minimum = code_block(columns, group_size=page_size, clip_index=clip_index, levels=levels,
                                       order_statistic=order_statistic)
    codes = jnp.swapaxes(codes.reshape(pages, d, page_size), 1, 2).reshape(pages * page_size, d)
    return (pack_block(codes).reshape(pages, page_size, d // CODES_PER_BYTE),
            scale.reshape(pages, d), minimum.reshape(pages, d))


def pack_block(codes):
    """Step 5, quartered packing of codes int32 [R, D]: plane p (elements p·Q … p·Q + Q − 1) goes to
    bits CODE_BITS·p. → uint8 [R, D/4]."""
    rows, d = codes.shape
    planes = codes.reshape(rows, CODES_PER_BYTE, d // CODES_PER_BYTE)
    shifts = lax.broadcasted_iota(jnp.int32, (1, CODES_PER_BYTE, 1), 1) * CODE_BITS
    return jnp.sum(planes << shifts, axis=1).astype(jnp.uint8)  # disjoint bit fields: the sum is an exact OR


def code_block(x, *, group_size: int, clip_index: int, levels: str, order_statistic: str):
    """Steps 1-4 on rows x [R, D]: codes int32 [R, D], scale and minimum float16 [R, D/G]."""
    rows, d = x.shape
    num_groups = d // group_size
    x = x.astype(jnp.float32)
    # 1. sanitize: NaN → +0, clamp to ±FP16_MAX (np.clip keeps −0).
    x = jnp.where(jnp.isnan(x), 0.0, x)
    x = jnp.where(x > FP16_MAX, FP16_MAX, jnp.where(x < -FP16_MAX, -FP16_MAX, x))
    # 2. clip to [−τ, τ], τ = the k-th smallest |x|, on bit patterns.
    bits = lax.bitcast_convert_type(x, jnp.int32)
    tau_bits = clip_threshold_bits(
        bits & F32_MAGNITUDE_MASK, clip_index=clip_index, order_statistic=order_statistic
    )
    # On keys (key(τ) = τ bits, key(−τ) = −τ bits); numpy's maximum/minimum keep the bound on ties.
    key = _ieee_key(bits)
    above_neg_tau = key > -tau_bits
    bits = jnp.where(above_neg_tau, bits, tau_bits | F32_SIGN_BIT)  # maximum(x, −τ)
    key = jnp.where(above_neg_tau, key, -tau_bits)
    below_tau = key < tau_bits
    bits = jnp.where(below_tau, bits, tau_bits)  # minimum(·, τ)
    key = jnp.where(below_tau, key, tau_bits)
    groups = lax.bitcast_convert_type(bits, jnp.float32).reshape(rows, num_groups, group_size)
    # 3. per-group metadata, [R, NG, 1].
    if levels == "minmax":
        lo, hi = _group_min_max(groups)
        scale = _to_f16_saturating((hi - lo) * ONE_THIRD_F32)
        minimum = lo.astype(jnp.float16)  # |lo| ≤ FP16_MAX: no saturation needed (as the spec)
    elif levels == "moments":
        scale, minimum = _moments_metadata(groups)
    else:
        raise ValueError(f"unknown {levels=}")
    # 4. codes by comparison against t_j = m + (j + 0.5)·s (the product is exact; t_j is a
    #    multiple of 2^-25, never subnormal), compared on keys.
    s = scale.astype(jnp.float32)
    m = minimum.astype(jnp.float32)
    key = key.reshape(groups.shape)
    codes = jnp.zeros(groups.shape, jnp.int32)
    for offset in THRESHOLD_OFFSETS:
        threshold = _ieee_key(lax.bitcast_convert_type(m + offset * s, jnp.int32))
        codes = codes + (key >= threshold).astype(jnp.int32)
    return codes.reshape(rows, d), scale.reshape(rows, num_groups), minimum.reshape(rows, num_groups)


# ------------------------------------------------------------------------ encode by planes
#
# encode_block makes every rare input exact for every element (sanitize, the clamp, keys for signed
# zeros) and packs codes that sit in four threads: ~50 ALU-pipe instructions an element in sm_90
# SASS, the pipe that bounds the encode (benchmarks/DECISIONS.md W3). `encode_planes` takes
# the common case — rows of one group (G = D), levels="minmax" — read as their four quarter planes
# (plane p: elements p·Q … p·Q + Q − 1, so the elements a byte packs are in one thread) and says
# which rows it cannot take exactly; a block holding one is encoded again by encode_block. The
# same body as oscar_torch/kernels/codec.py's (see its section comment for the derivation):
#   * sanitize is the identity on rows whose largest |x| is at most FP16_MAX;
#   * τ by max rounds whose step is one add-and-min: the largest key below `top` is
#     top − 1 − min(top − 1 − key), the keys read as unsigned (keys ≥ top wrap high);
#   * the clipped extremes: the signed max of the bit patterns (the row holds a sign bit clear)
#     and the unsigned max (it holds one set, −0 included: −0 < +0 as FORMAT.md orders them);
#   * codes compare unclipped keys with thresholds moved off the clip range.
# Declined rows: a NaN or |x| > FP16_MAX, τ = 0, no sign bit set or none clear, and (float32
# rows) ties among the largest values.


def _row_max4(planes):
    """Largest element of each row over its four planes [R, Q] → [R, 1]."""
    p0, p1, p2, p3 = planes
    return jnp.max(jnp.maximum(jnp.maximum(p0, p1), jnp.maximum(p2, p3)), axis=1, keepdims=True)


def _largest_below_rounds(keys, top, rounds: int):
    """`rounds` times: top ← the largest key of the row below top (keys non-negative int32)."""

    def gap_below(k, top):  # unsigned [R, 1]: keys ≥ top wrap high
        return jnp.min(lax.bitcast_convert_type(top - 1 - k, jnp.uint32), axis=1, keepdims=True)

    k0, k1, k2, k3 = keys
    for _ in range(rounds):  # unrolled, as Triton's static_range: a loop costs more instructions
        gap = jnp.minimum(jnp.minimum(gap_below(k0, top), gap_below(k1, top)),
                          jnp.minimum(gap_below(k2, top), gap_below(k3, top)))  # unsigned, as the gaps
        top = top - 1 - lax.bitcast_convert_type(gap, jnp.int32)
    return top


def _threshold_key(m, s, offset, tau_bits):
    """Ordered key to compare unclipped keys with for threshold m + offset·s ([R, 1])."""
    t_bits = lax.bitcast_convert_type(m + offset * s, jnp.int32)
    t_key = jnp.where(t_bits == 0, -1, _ordered_key(t_bits))  # x ≥ +0 holds for −0 (key −1) too
    below_clip = t_key <= _ordered_key(tau_bits | F32_SIGN_BIT)
    return jnp.where(below_clip, ORDERED_KEY_BELOW_ALL, jnp.where(t_key > tau_bits, ORDERED_KEY_ABOVE_ALL, t_key))


def encode_planes(planes, *, clip_index: int, rows_bf16: bool):
    """Encode rows of one group (G = D, levels="minmax") given as their four quarter planes of
    float32 bit patterns (4 × int32 [R, Q]). rows_bf16: every value is a bfloat16 (low bits zero).
    Returns packed uint8 [R, Q], scale and minimum float16 [R, 1], and `exact` bool [R, 1]: where
    false the outputs are not the format's and the row needs encode_block."""
    rows, quarter = planes[0].shape
    d = quarter * CODES_PER_BYTE
    skip = d - 1 - clip_index
    magnitudes = [p & F32_MAGNITUDE_MASK for p in planes]
    # 1–2. τ, and whether sanitize leaves the row as it is.
    if rows_bf16:  # tagged with the column (tagged_max): every key differs
        column = lax.broadcasted_iota(jnp.int32, (rows, quarter), 1)
        keys = [a | (column + p * quarter) for p, a in enumerate(magnitudes)]
        top = _row_max4(keys)
        exact = (top & ~BF16_LOW_MASK) <= FP16_MAX_BITS
        tau = _largest_below_rounds(keys, top, skip) & ~BF16_LOW_MASK
    else:  # distinct values (checked_max): exact where no tie hid among the largest
        top = _row_max4(magnitudes)
        tau = _largest_below_rounds(magnitudes, top, skip)
        above = sum((a > tau).astype(jnp.int32) for a in magnitudes)
        exact = (top <= FP16_MAX_BITS) & (jnp.sum(above, axis=1, keepdims=True) == skip)
    # 3. the clipped extremes.
    hi = _row_max4(planes)
    lo = lax.bitcast_convert_type(_row_max4([lax.bitcast_convert_type(p, jnp.uint32) for p in planes]), jnp.int32)
    exact = exact & (tau != 0) & (hi >= 0) & (lo < 0)
    hi = lax.bitcast_convert_type(jnp.minimum(hi, tau), jnp.float32)
    lo = lax.bitcast_convert_type(jnp.where((lo & F32_MAGNITUDE_MASK) > tau, tau | F32_SIGN_BIT, lo), jnp.float32)
    scale = _to_f16_saturating((hi - lo) * ONE_THIRD_F32)
    minimum = _to_f16_saturating(lo)  # = f16(lo) where exact; saturating keeps declined rows quiet
    # 4–5. codes against the thresholds moved off the clip range, packed plane by plane.
    s = scale.astype(jnp.float32)
    m = minimum.astype(jnp.float32)
    thresholds = [_threshold_key(m, s, offset, tau) for offset in THRESHOLD_OFFSETS]
    packed = jnp.zeros((rows, quarter), jnp.int32)
    for p, plane in enumerate(planes):
        key = _ordered_key(plane)
        codes = sum((key >= t).astype(jnp.int32) for t in thresholds)
        packed = packed + (codes << (p * CODE_BITS))
    return packed.astype(jnp.uint8), scale, minimum, exact


def encode_planes_or_block(load_planes, load_rows, mask, *, planes: bool, rows_bf16: bool, group_size: int,
                           clip_index: int, levels: str, order_statistic: str):
    """(packed, scale, minimum) of a block: encode_planes of `load_planes()` (four float32 [R, Q])
    when `planes` and every row that exists (`mask` [R, 1] or None) takes it, else encode_block of
    `load_rows()` (float32 [R, D]) — read only in the block that needs it."""

    def by_encode_block():
        return encode_block(load_rows(), group_size=group_size, clip_index=clip_index, levels=levels,
                            order_statistic=order_statistic)

    if not planes:
        return by_encode_block()
    bits = [lax.bitcast_convert_type(p, jnp.int32) for p in load_planes()]
    packed, scale, minimum, exact = encode_planes(bits, clip_index=clip_index, rows_bf16=rows_bf16)
    if mask is not None:
        exact = exact | ~mask
    # One axis per reduction (the Triton lowering's multi-axis reductions fail under a mesh).
    all_exact = jnp.min(jnp.min(exact.astype(jnp.int32), axis=0), axis=0) == 1
    return lax.cond(all_exact, lambda: (packed, scale, minimum), by_encode_block)


def load_planes(ref, mask):
    """The four quarter planes of a block ref [R, D] as float32 [R, Q] (exact widening)."""
    quarter = ref.shape[1] // CODES_PER_BYTE
    return [load_block(ref.at[:, pl.ds(p * quarter, quarter)], mask).astype(jnp.float32)
            for p in range(CODES_PER_BYTE)]


def unpack_block(packed):
    """packed uint8 [R, D/4] → codes int32 [R, D] (quartered: plane p holds elements p·Q …)."""
    rows, quarter = packed.shape
    wide = packed.astype(jnp.int32).reshape(rows, 1, quarter)  # widen before integer ops
    shifts = lax.broadcasted_iota(jnp.int32, (1, CODES_PER_BYTE, 1), 1) * CODE_BITS
    return ((wide >> shifts) & CODE_MASK).reshape(rows, quarter * CODES_PER_BYTE)


def decode_block(packed, scale, minimum, *, group_size: int):
    """packed uint8 [R, D/4], scale/minimum float16 [R, D/G] → float32 [R, D], x̂ = m + code·s."""
    rows, quarter = packed.shape
    d = quarter * CODES_PER_BYTE
    num_groups = d // group_size
    codes = unpack_block(packed).reshape(rows, num_groups, group_size).astype(jnp.float32)
    s = scale.astype(jnp.float32).reshape(rows, num_groups, 1)
    m = minimum.astype(jnp.float32).reshape(rows, num_groups, 1)
    return (m + codes * s).reshape(rows, d)  # code·s is exact (≤ 13 significant bits)


# ------------------------------------------------------------------------------ row masking


def row_mask(block_rows: int, num_rows: int):
    """[R, 1] bool: which rows of this program's block exist, or None when blocks tile exactly."""
    if num_rows % block_rows == 0:
        return None
    row = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    return row < num_rows


def load_block(ref, mask):
    if mask is None:
        return ref[...]
    return plgpu.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


def store_block(ref, value, mask):
    if mask is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=jnp.broadcast_to(mask, ref.shape))


def block_rows_for(num_rows: int, block_rows: int) -> int:
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"{block_rows=} must be a power of two")
    return min(block_rows, pl.next_power_of_2(max(num_rows, 1)))


# ----------------------------------------------------------------------------------- encode


def _encode_kernel(
    x_ref,  # [R, D] float
    packed_ref,  # [R, D/4] uint8
    scale_ref,  # [R, D/G] float16
    minimum_ref,  # [R, D/G] float16
    *,
    num_rows: int,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str,
    planes: bool = False,
):
    mask = row_mask(x_ref.shape[0], num_rows)
    packed, scale, minimum = encode_planes_or_block(
        lambda: load_planes(x_ref, mask), lambda: load_block(x_ref, mask), mask, planes=planes,
        rows_bf16=x_ref.dtype == jnp.bfloat16, group_size=group_size, clip_index=clip_index, levels=levels,
        order_statistic=order_statistic)
    store_block(packed_ref, packed, mask)
    store_block(scale_ref, scale, mask)
    store_block(minimum_ref, minimum, mask)


@functools.partial(
    jax.jit,
    static_argnames=(
        "group_size", "clip_index", "levels", "order_statistic", "block_rows", "num_warps", "interpret", "planes",
    ),
)
def encode_rows(
    x,
    *,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str | None = None,
    block_rows: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool | None = None,
    planes: bool | None = None,
):
    """Launch encode over x [N, D] (N ≥ 1). Arguments are validated by oscar_jax.ops.encode.
    planes: `encode_planes` where it applies (None; G = D, levels="minmax"), insisted on (True: an
    error elsewhere) or never (False); see shared_math.tiling.resolve_encode_planes. block_rows:
    None → ENCODE_PLANES_BLOCK_ROWS by planes, else DEFAULT_BLOCK_ROWS."""
    num_rows, d = x.shape
    quarter, num_groups = d // CODES_PER_BYTE, d // group_size
    planes = tiling.resolve_encode_planes(planes, d, group_size, levels)
    order_statistic = resolve_order_statistic(order_statistic, d, clip_index, x.dtype)
    if block_rows is None:
        block_rows = tiling.ENCODE_PLANES_BLOCK_ROWS if planes else DEFAULT_BLOCK_ROWS
    rows = tiling.planes_block_rows(block_rows_for(num_rows, block_rows), planes)
    kernel = functools.partial(
        _encode_kernel,
        num_rows=num_rows,
        group_size=group_size,
        clip_index=clip_index,
        levels=levels,
        order_statistic=order_statistic,
        planes=planes,
    )
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, rows),),
        in_specs=[pl.BlockSpec((rows, d), lambda i: (i, 0))],  # x: R rows
        out_specs=[
            pl.BlockSpec((rows, quarter), lambda i: (i, 0)),  # packed
            pl.BlockSpec((rows, num_groups), lambda i: (i, 0)),  # scale
            pl.BlockSpec((rows, num_groups), lambda i: (i, 0)),  # minimum
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, quarter), jnp.uint8),
            jax.ShapeDtypeStruct((num_rows, num_groups), jnp.float16),
            jax.ShapeDtypeStruct((num_rows, num_groups), jnp.float16),
        ],
        interpret=resolve_interpret(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"oscar_encode_d{d}_g{group_size}_k{clip_index}_{levels}_{order_statistic}_r{rows}"
             + ("_planes" if planes else ""),
    )(x)


def _encode_channel_pages_kernel(x_ref, packed_ref, scale_ref, minimum_ref, *, clip_index: int, levels: str,
                                 order_statistic: str):
    """One format v2 key page a program: x [1, L, D] → packed [1, L, D/4], scale / minimum [1, D]."""
    packed, scale, minimum = encode_channels_block(x_ref[...], clip_index=clip_index, levels=levels,
                                                   order_statistic=order_statistic)
    packed_ref[...] = packed
    scale_ref[...] = scale
    minimum_ref[...] = minimum


@functools.partial(jax.jit, static_argnames=("clip_index", "levels", "num_warps", "interpret"))
def encode_channel_pages(x, *, clip_index: int, levels: str, num_warps: int = DEFAULT_NUM_WARPS,
                         interpret: bool | None = None):
    """Launch format v2's per-channel key page encode over x [N, L, D] (N ≥ 1; clip_index over L
    values), one page a program → packed u8 [N, L, D/4], scale, minimum f16 [N, D], bit-identical to
    shared_math.encode_channels (the XLA path's `encode_channels_block`, as a kernel body)."""
    num_pages, page, d = x.shape
    order_statistic = resolve_order_statistic(None, page, clip_index, x.dtype)
    kernel = functools.partial(_encode_channel_pages_kernel, clip_index=clip_index, levels=levels,
                               order_statistic=order_statistic)
    return pl.pallas_call(
        kernel,
        grid=(num_pages,),
        in_specs=[pl.BlockSpec((1, page, d), lambda i: (i, 0, 0))],
        out_specs=[
            pl.BlockSpec((1, page, d // CODES_PER_BYTE), lambda i: (i, 0, 0)),
            pl.BlockSpec((1, d), lambda i: (i, 0)),
            pl.BlockSpec((1, d), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_pages, page, d // CODES_PER_BYTE), jnp.uint8),
            jax.ShapeDtypeStruct((num_pages, d), jnp.float16),
            jax.ShapeDtypeStruct((num_pages, d), jnp.float16),
        ],
        interpret=resolve_interpret(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"oscar_encode_channel_pages_l{page}_d{d}_k{clip_index}_{levels}_{order_statistic}",
    )(x)


# ----------------------------------------------------------------------------------- decode


def _decode_kernel(
    packed_ref,  # [R, D/4] uint8
    scale_ref,  # [R, D/G] float16
    minimum_ref,  # [R, D/G] float16
    out_ref,  # [R, D] float32
    *,
    num_rows: int,
    group_size: int,
):
    mask = row_mask(packed_ref.shape[0], num_rows)
    values = decode_block(
        load_block(packed_ref, mask),
        load_block(scale_ref, mask),
        load_block(minimum_ref, mask),
        group_size=group_size,
    )
    store_block(out_ref, values, mask)


@functools.partial(jax.jit, static_argnames=("group_size", "block_rows", "num_warps", "interpret"))
def decode_rows(
    packed,
    scale,
    minimum,
    *,
    group_size: int,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool | None = None,
):
    """Launch decode over packed [N, D/4], scale/minimum [N, D/G] → float32 [N, D]."""
    num_rows, quarter = packed.shape
    d = quarter * CODES_PER_BYTE
    num_groups = d // group_size
    rows = block_rows_for(num_rows, block_rows)
    return pl.pallas_call(
        functools.partial(_decode_kernel, num_rows=num_rows, group_size=group_size),
        grid=(pl.cdiv(num_rows, rows),),
        in_specs=[
            pl.BlockSpec((rows, quarter), lambda i: (i, 0)),  # packed
            pl.BlockSpec((rows, num_groups), lambda i: (i, 0)),  # scale
            pl.BlockSpec((rows, num_groups), lambda i: (i, 0)),  # minimum
        ],
        out_specs=pl.BlockSpec((rows, d), lambda i: (i, 0)),  # values
        out_shape=jax.ShapeDtypeStruct((num_rows, d), jnp.float32),
        interpret=resolve_interpret(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"oscar_decode_d{d}_g{group_size}_r{rows}",
    )(packed, scale, minimum)
