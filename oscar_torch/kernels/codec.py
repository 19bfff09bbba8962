"""Format v1 INT2 codec as Triton kernels: encode and decode rows of D values (DESIGN.md §2).

The block bodies `encode_block` / `decode_block` are @triton.jit functions on register tiles,
shared by the codec launchers here and the write-path kernels in write.py. They follow
shared_math/codec.py step by step, and oscar_jax/kernels/codec.py line by line (same names,
same order), so the bytes are identical on every backend:

  1. sanitize   NaN → 0, clamp to ±FP16_MAX
  2. clip       τ = the k-th smallest |x| (0-based), found exactly on the int32 bit patterns of
                |x| (monotone for non-negative floats) — no sort; x ← clamp(x, −τ, τ)
  3. metadata   minmax: scale = f16((hi − lo)·f32(1/3)), minimum = f16(lo)
                moments: μ = tree_sum(x)·f32(1/G), mad = tree_sum(|x − μ|)·f32(1/G),
                         scale = f16sat(mad·1.25), minimum = f16sat(μ − 1.5·f32(scale))
  4. codes      code = Σ_j [x ≥ m + (j + 0.5)·s]  (comparisons, no division)
  5. pack       byte[i] = c[i] | c[i+Q]<<2 | c[i+2Q]<<4 | c[i+3Q]<<6, Q = D/4 ("quartered")

Machine behaviours kept away from the bytes (the same measures as the Pallas kernels):
  * signs of zeros: Triton lowers float min/max to minnum/maxnum and negation to 0 − x, so the
    clamp of step 2 and the group min/max run on int32 keys, and −τ flips the sign bit;
  * flushing of subnormals: compares run on int32 keys, and the moments sums run on a copy
    scaled by 2^MOMENTS_SCALE_EXP where every value is normal;
  * the Triton interpreter (TRITON_INTERPRET=1) truncates f32 → bf16 casts and computes bf16
    `tl.dot` wrongly: bfloat16 input is read as its 16-bit pattern and widened with integer ops
    (exact), never cast. f32 → f16 casts are round-to-nearest-even both in the interpreter
    (numpy `astype`) and on the GPU (`cvt.rn.f16.f32`), so `to_f16_saturating` is a plain cast.
Signed zeros in step 3 follow FORMAT.md: −0 orders below +0 (IEEE 754-2019 minimum/maximum), so
a group holding both zeros as its extreme has lo = −0 / hi = +0 — exactly what the ordered keys give.

Format constants come from shared_math (spec.py, codec.py), the IEEE 754 bit-pattern constants
(not format constants) from shared_math.float_bits, the choice of order statistic for τ from
shared_math.tiling; they reach the kernels as tl.constexpr globals or arguments.

Shapes (one vocabulary): R rows in a block, D head dim, G group size, Q = D/4 packed bytes,
NG = D/G groups per row, N rows in total.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from shared_math.codec import MOMENTS_MINIMUM_OFFSET, ONE_THIRD_F32, THRESHOLD_OFFSETS
from shared_math.float_bits import (
    BF16_DROPPED_BITS,
    BF16_LOW_MASK,
    BF16_QUIET_BIT,
    BF16_ROUNDING_BIAS,
    F32_EXPONENT_MASK,
    F32_MAGNITUDE_MASK,
    F32_MANTISSA_MASK,
    F32_SIGN_BIT,
    F32_SIGN_SHIFT,
    FP16_MAX_BITS,
    ORDERED_KEY_ABOVE_ALL,
    ORDERED_KEY_BELOW_ALL,
)
from shared_math.spec import (
    CODE_BITS,
    CODE_MASK,
    CODES_PER_BYTE,
    FP16_MAX,
    MOMENTS_MAD_TO_SIGMA,
    NUM_LEVELS,
)
from shared_math import tiling
from shared_math.tiling import BISECTION_STEPS, ORDER_STATISTICS, select_order_statistic

# Format constants as compile-time constants of the kernels.
CODE_BITS_C = tl.constexpr(CODE_BITS)
CODE_MASK_C = tl.constexpr(CODE_MASK)
CODES_PER_BYTE_C = tl.constexpr(CODES_PER_BYTE)
NUM_THRESHOLDS_C = tl.constexpr(NUM_LEVELS - 1)
FP16_MAX_C = tl.constexpr(float(FP16_MAX))
ONE_THIRD_C = tl.constexpr(float(ONE_THIRD_F32))
MAD_TO_SIGMA_C = tl.constexpr(float(np.float32(MOMENTS_MAD_TO_SIGMA)))
MINIMUM_OFFSET_C = tl.constexpr(float(MOMENTS_MINIMUM_OFFSET))
# Threshold j sits at m + THRESHOLD_OFFSETS[j]·s, the offsets j + 0.5: first offset + j·step.
FIRST_THRESHOLD_C = tl.constexpr(float(THRESHOLD_OFFSETS[0]))
THRESHOLD_STEP_C = tl.constexpr(float(THRESHOLD_OFFSETS[1] - THRESHOLD_OFFSETS[0]))
assert all(float(o) == FIRST_THRESHOLD_C.value + j * THRESHOLD_STEP_C.value for j, o in enumerate(THRESHOLD_OFFSETS))

BELOW_EVERY_MAGNITUDE = -1  # below every |x| bit pattern: what a masked max returns for an exhausted row

# levels="moments" sums in a scaled copy of the values, x·2^MOMENTS_SCALE_EXP (see
# oscar_jax/kernels/codec.py for the derivation): every float32 there is normal and nothing
# overflows, so the sums are exactly 2^E times numpy's sums with gradual underflow.
MOMENTS_SCALE_EXP = 103
_F32 = np.finfo(np.float32)
SCALE_UP = float(np.float32(2.0**MOMENTS_SCALE_EXP))
SCALE_DOWN = float(np.float32(2.0**-MOMENTS_SCALE_EXP))
SUBNORMAL_QUANTUM_SCALED = float(np.float32(float(_F32.smallest_subnormal) * 2.0**MOMENTS_SCALE_EXP))
NORMAL_MIN_SCALED = float(np.float32(float(_F32.smallest_normal) * 2.0**MOMENTS_SCALE_EXP))
assert NORMAL_MIN_SCALED == SUBNORMAL_QUANTUM_SCALED * 2.0 ** int(_F32.nmant)

F32_MAGNITUDE_MASK_C = tl.constexpr(F32_MAGNITUDE_MASK)
F32_SIGN_BIT_C = tl.constexpr(F32_SIGN_BIT)
F32_SIGN_SHIFT_C = tl.constexpr(F32_SIGN_SHIFT)
BF16_LOW_MASK_C = tl.constexpr(BF16_LOW_MASK)
BELOW_EVERY_MAGNITUDE_C = tl.constexpr(BELOW_EVERY_MAGNITUDE)
FP16_MAX_BITS_C = tl.constexpr(FP16_MAX_BITS)
BISECTION_STEPS_C = tl.constexpr(BISECTION_STEPS)
TREE_SUM_MAX_STEPS_C = tl.constexpr(F32_SIGN_SHIFT)  # halvings of any int32-sized axis
BF16_SHIFT_C = tl.constexpr(BF16_DROPPED_BITS)  # bfloat16 = the top half of a float32
BF16_ROUNDING_BIAS_C = tl.constexpr(BF16_ROUNDING_BIAS)
BF16_QUIET_BIT_C = tl.constexpr(BF16_QUIET_BIT)
F32_MANTISSA_MASK_C = tl.constexpr(F32_MANTISSA_MASK)
F32_EXPONENT_MASK_C = tl.constexpr(F32_EXPONENT_MASK)
SCALE_UP_C = tl.constexpr(SCALE_UP)
SCALE_DOWN_C = tl.constexpr(SCALE_DOWN)
SUBNORMAL_QUANTUM_SCALED_C = tl.constexpr(SUBNORMAL_QUANTUM_SCALED)
NORMAL_MIN_SCALED_C = tl.constexpr(NORMAL_MIN_SCALED)

DEFAULT_BLOCK_ROWS = 16  # power of two; also tl.dot's minimum M for the fused key rotation
DEFAULT_NUM_WARPS = 4


# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when this package is imported.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when Triton runs the kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return INTERPRETING


# The interpreter runs a launch's programs one after another and pays per op, not per element
# (a 420-token SmolLM2 INT2 write: 18 s in blocks of 16 rows, 0.9 s in one block of 512), so
# interpreted launches default to big blocks. The compiled defaults are the tuned ones; tests
# that exercise the blocking pass their block sizes explicitly.
INTERPRET_BLOCK_ROWS = 512


def default_block_rows(compiled: int) -> int:
    """The default rows per program: `compiled` on the GPU, INTERPRET_BLOCK_ROWS interpreted."""
    return INTERPRET_BLOCK_ROWS if interpreting() else compiled


def resolve_order_statistic(order_statistic: str | None, head_dim: int, clip_index: int, rows_dtype,
                            rotated: bool = False) -> str:
    """shared_math.tiling.resolve_order_statistic for rows of `rows_dtype` (rotated in the kernel
    or not): tagged_max applies to bfloat16 rows that the kernel does not rotate."""
    return tiling.resolve_order_statistic(
        order_statistic, head_dim, clip_index, rows_bf16=rows_dtype == torch.bfloat16 and not rotated,
        rows=f"{rows_dtype} rows" + (" rotated in the kernel" if rotated else ""),
    )


def block_rows_for(num_rows: int, block_rows: int) -> int:
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"{block_rows=} must be a power of two")
    return min(block_rows, triton.next_power_of_2(max(num_rows, 1)))


# --------------------------------------------------------------------------------- bit helpers


@triton.jit
def widen_bf16_bits(bits):
    """bfloat16 bit patterns (int16) → float32 values, exactly (integer ops only)."""
    return (bits.to(tl.int32) << BF16_SHIFT_C).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits_rne(x):
    """float32 → bfloat16 bit patterns (int16), round-to-nearest-even with integer ops (the
    interpreter's f32 → bf16 cast truncates). NaN → a quiet NaN of the same sign."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> BF16_SHIFT_C) & 1
    rounded = (bits + BF16_ROUNDING_BIAS_C + lsb) >> BF16_SHIFT_C
    nan = (bits >> BF16_SHIFT_C) | BF16_QUIET_BIT_C
    return tl.where(x != x, nan, rounded).to(tl.int16)


@triton.jit
def round_to_bf16(x):
    """float32 → the nearest bfloat16 value (ties to even), kept as float32 (a dot operand)."""
    return widen_bf16_bits(bf16_bits_rne(x))


@triton.jit
def load_rows_f32(ptrs, mask, INPUT_BF16: tl.constexpr):
    """Load a tile and widen it to float32 exactly (bfloat16 arrives as int16 bit patterns)."""
    if INPUT_BF16:
        return widen_bf16_bits(tl.load(ptrs, mask=mask, other=0))
    return tl.load(ptrs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _ieee_key(bits):
    """int32 float bits → int32 key that compares like IEEE floats (−0 == +0), exactly."""
    return tl.where(bits < 0, -(bits & F32_MAGNITUDE_MASK_C), bits)


@triton.jit
def _ordered_key(bits):
    """int32 float bits → int32 key with the float order (−0 < +0); an involution."""
    return bits ^ ((bits >> F32_SIGN_SHIFT_C) & F32_MAGNITUDE_MASK_C)


# --------------------------------------------------------------------------------- block bodies


@triton.jit
def _max_drop_bits(abs_bits, CLIP_INDEX: tl.constexpr):
    """max_drop: take the largest remaining value and drop all its copies, counting ties, until
    the value of rank k is reached; `remaining` = how many of the largest values still to skip."""
    ROWS: tl.constexpr = abs_bits.shape[0]
    D: tl.constexpr = abs_bits.shape[1]
    tau = tl.zeros((ROWS, 1), tl.int32)
    remaining = tl.full((ROWS, 1), D - 1 - CLIP_INDEX, tl.int32)
    ceiling = tl.full((ROWS, 1), F32_MAGNITUDE_MASK_C, tl.int32)  # above every |x| pattern
    for _ in range(D - CLIP_INDEX):  # each round drops ≥ 1 value
        top = tl.max(tl.where(abs_bits < ceiling, abs_bits, BELOW_EVERY_MAGNITUDE_C), axis=1, keep_dims=True)
        count = tl.sum((abs_bits == top).to(tl.int32), axis=1, keep_dims=True)
        found = (remaining >= 0) & (count > remaining)  # only once: remaining < 0 afterwards
        tau = tl.where(found, top, tau)
        remaining = remaining - count
        ceiling = top
    return tau


@triton.jit
def _distinct_max_rounds(values, ROUNDS: tl.constexpr):
    """Round r: the largest of `values` under round r − 1's result, per row ([R, 1])."""
    top = tl.full((values.shape[0], 1), F32_MAGNITUDE_MASK_C, tl.int32)  # above every |x| pattern
    for _ in range(ROUNDS):
        top = tl.max(tl.where(values < top, values, BELOW_EVERY_MAGNITUDE_C), axis=1, keep_dims=True)
    return top


@triton.jit
def clip_threshold_bits(abs_bits, CLIP_INDEX: tl.constexpr, ORDER_STATISTIC: tl.constexpr):
    """The k-th smallest (0-based) value of each row of abs_bits [R, D] (non-negative int32 ≤
    FP16_MAX_BITS, the bit patterns of |x|), exactly, as int32 [R, 1]. The methods are described
    with shared_math.tiling.ORDER_STATISTICS; `tagged_max` needs rows of bfloat16 values."""
    ROWS: tl.constexpr = abs_bits.shape[0]
    D: tl.constexpr = abs_bits.shape[1]
    SKIP: tl.constexpr = D - 1 - CLIP_INDEX  # the value sought has SKIP values above it, ties counted
    if ORDER_STATISTIC == "max_drop":
        return _max_drop_bits(abs_bits, CLIP_INDEX)
    elif ORDER_STATISTIC == "tagged_max":
        # Rows of bfloat16 values leave the low BF16_DROPPED_BITS of |x| free (the sanitize clamp
        # FP16_MAX is the one exception: rounded up, it still orders above every bfloat16 ≤ it):
        # tagged with the column, all keys differ, so round SKIP + 1 lands on rank k, ties included.
        tl.static_assert(D <= BF16_LOW_MASK_C + 1)
        column = tl.arange(0, D)[None, :]
        tagged = ((abs_bits + BF16_LOW_MASK_C) & ~BF16_LOW_MASK_C) | column
        top = _distinct_max_rounds(tagged, SKIP + 1)
        return tl.minimum(top & ~BF16_LOW_MASK_C, FP16_MAX_BITS_C)
    elif ORDER_STATISTIC == "checked_max":
        # Round r gives the r-th largest distinct value t_r (or the sentinel). Always
        # #{|x| > t_{SKIP+1}} ≥ SKIP; where it equals SKIP, t_{SKIP+1} has rank k. A block with a
        # row where ties hid among the largest values redoes τ by max_drop.
        tau = _distinct_max_rounds(abs_bits, SKIP + 1)
        above = tl.sum((abs_bits > tau).to(tl.int32), axis=1, keep_dims=True)
        if tl.max(above) != SKIP:
            tau = _max_drop_bits(abs_bits, CLIP_INDEX)
        return tau
    else:
        # bisect: smallest v with #{|x| ≤ v} ≥ k + 1; invariant: the answer lies in [lo, hi].
        lo = tl.zeros((ROWS, 1), tl.int32)
        hi = tl.full((ROWS, 1), FP16_MAX_BITS_C, tl.int32)
        for _ in range(BISECTION_STEPS_C):
            mid = lo + ((hi - lo) >> 1)
            count = tl.sum((abs_bits <= mid).to(tl.int32), axis=1, keep_dims=True)
            enough = count >= CLIP_INDEX + 1
            lo = tl.where(enough, lo, mid + 1)
            hi = tl.where(enough, mid, hi)
        return lo


@triton.jit
def tree_sum(v):
    """Sum over the last (power-of-two) axis of v [M, N] in the pinned order v[:n/2] + v[n/2:],
    repeated; returns [M, 1]. Explicit halves (tl.split), never a reduction (whose order is
    unspecified)."""
    for _ in tl.static_range(TREE_SUM_MAX_STEPS_C):  # unrolled; steps past N = 1 are no-ops
        if v.shape[1] > 1:
            halves = tl.permute(tl.reshape(v, (v.shape[0], 2, v.shape[1] // 2)), (0, 2, 1))
            first, second = tl.split(halves)
            v = first + second
    return v


@triton.jit
def _scaled_exactly(bits):
    """float32 bits → x·2^E as a normal float32, exactly, without float ops on subnormals."""
    exponent = bits & F32_EXPONENT_MASK_C
    normal = bits.to(tl.float32, bitcast=True) * SCALE_UP_C
    magnitude = (bits & F32_MANTISSA_MASK_C).to(tl.float32) * SUBNORMAL_QUANTUM_SCALED_C
    subnormal = magnitude.to(tl.int32, bitcast=True) | (bits & F32_SIGN_BIT_C)
    return tl.where(exponent == 0, subnormal.to(tl.float32, bitcast=True), normal)


@triton.jit
def _round_to_subnormal_grid(v):
    """Scaled v with |v| below the scaled normal minimum → the nearest (ties to even) multiple of
    the scaled subnormal quantum, keeping the sign: what float32 gradual underflow does."""
    magnitude = tl.abs(v)
    rounded = (magnitude + NORMAL_MIN_SCALED_C) - NORMAL_MIN_SCALED_C
    signed = rounded.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & F32_SIGN_BIT_C)
    return tl.where(magnitude < NORMAL_MIN_SCALED_C, signed.to(tl.float32, bitcast=True), v)


@triton.jit
def to_f16_saturating(v):
    """f16(clip(v, ±FP16_MAX)), round-to-nearest-even; −0 stays −0."""
    v = tl.where(v > FP16_MAX_C, FP16_MAX_C, tl.where(v < -FP16_MAX_C, -FP16_MAX_C, v))
    return v.to(tl.float16)


@triton.jit
def _moments_metadata(groups, GROUP_SIZE: tl.constexpr):
    """levels="moments" metadata of groups [M, G] (sanitized, clipped, M = R·NG): scale and
    minimum float16 [M, 1], as shared_math: μ = tree_sum(x)·f32(1/G), mad = tree_sum(|x − μ|)·
    f32(1/G), scale = f16sat(mad·1.25), minimum = f16sat(μ − 1.5·f32(scale))."""
    inv_g: tl.constexpr = 1.0 / GROUP_SIZE  # exact: G is a power of two
    scaled = _scaled_exactly(groups.to(tl.int32, bitcast=True))
    mu = _round_to_subnormal_grid(tree_sum(scaled) * inv_g)  # 2^E·μ exactly
    mad = tree_sum(tl.abs(scaled - mu)) * inv_g  # 2^E·mad
    scale = to_f16_saturating((mad * MAD_TO_SIGMA_C) * SCALE_DOWN_C)
    minimum = to_f16_saturating(mu * SCALE_DOWN_C - MINIMUM_OFFSET_C * scale.to(tl.float32))
    return scale, minimum


@triton.jit
def encode_block(
    x,  # [R, D] float32
    GROUP_SIZE: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
):
    """Encode a block of rows. Returns packed int32 [R, D/4] (byte values), scale float16
    [R, D/G], minimum float16 [R, D/G]."""
    codes, scale, minimum = code_block(x, GROUP_SIZE, CLIP_INDEX, LEVELS, ORDER_STATISTIC)
    return pack_block(codes), scale, minimum


@triton.jit
def pack_block(codes):
    """Step 5, quartered packing of codes int32 [R, D]: plane p (elements p·Q … p·Q + Q − 1) goes
    to bits CODE_BITS·p. → int32 [R, D/4] byte values."""
    ROWS: tl.constexpr = codes.shape[0]
    QUARTER: tl.constexpr = codes.shape[1] // CODES_PER_BYTE_C
    planes = tl.reshape(codes, (ROWS, CODES_PER_BYTE_C, QUARTER))
    shifts = tl.arange(0, CODES_PER_BYTE_C)[None, :, None] * CODE_BITS_C
    return tl.sum(planes << shifts, axis=1)  # disjoint bit fields: the sum is an exact OR


@triton.jit
def code_block(
    x,  # [R, D] float32
    GROUP_SIZE: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
):
    """Steps 1-4 on a block of rows: codes int32 [R, D], scale and minimum float16 [R, D/G]."""
    ROWS: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    NUM_GROUPS: tl.constexpr = D // GROUP_SIZE
    # 1. sanitize: NaN → +0, clamp to ±FP16_MAX (np.clip keeps −0).
    x = tl.where(x != x, 0.0, x)
    x = tl.where(x > FP16_MAX_C, FP16_MAX_C, tl.where(x < -FP16_MAX_C, -FP16_MAX_C, x))
    # 2. clip to [−τ, τ], τ = the k-th smallest |x|, on bit patterns.
    bits = x.to(tl.int32, bitcast=True)
    tau_bits = clip_threshold_bits(bits & F32_MAGNITUDE_MASK_C, CLIP_INDEX, ORDER_STATISTIC)
    # On keys (key(τ) = τ bits, key(−τ) = −τ bits); numpy's maximum/minimum keep the bound on ties.
    key = _ieee_key(bits)
    above_neg_tau = key > -tau_bits
    bits = tl.where(above_neg_tau, bits, tau_bits | F32_SIGN_BIT_C)  # maximum(x, −τ)
    key = tl.where(above_neg_tau, key, -tau_bits)
    below_tau = key < tau_bits
    bits = tl.where(below_tau, bits, tau_bits)  # minimum(·, τ)
    key = tl.where(below_tau, key, tau_bits)
    # Groups as rows of one 2-D tile: [R·NG, G].
    group_bits = tl.reshape(bits, (ROWS * NUM_GROUPS, GROUP_SIZE))
    groups = group_bits.to(tl.float32, bitcast=True)
    # 3. per-group metadata, [R·NG, 1].
    if LEVELS == "minmax":
        ordered = _ordered_key(group_bits)
        lo = _ordered_key(tl.min(ordered, axis=1, keep_dims=True)).to(tl.float32, bitcast=True)
        hi = _ordered_key(tl.max(ordered, axis=1, keep_dims=True)).to(tl.float32, bitcast=True)
        scale = to_f16_saturating((hi - lo) * ONE_THIRD_C)
        minimum = lo.to(tl.float16)  # |lo| ≤ FP16_MAX: no saturation needed (as the spec)
    else:
        scale, minimum = _moments_metadata(groups, GROUP_SIZE)
    # 4. codes by comparison against t_j = m + (j + 0.5)·s (the product is exact; t_j is a
    #    multiple of 2^-25, never subnormal), compared on keys.
    s = scale.to(tl.float32)
    m = minimum.to(tl.float32)
    group_key = tl.reshape(key, (ROWS * NUM_GROUPS, GROUP_SIZE))
    codes = tl.zeros((ROWS * NUM_GROUPS, GROUP_SIZE), tl.int32)
    for j in tl.static_range(NUM_THRESHOLDS_C):
        threshold = _ieee_key((m + (FIRST_THRESHOLD_C + j * THRESHOLD_STEP_C) * s).to(tl.int32, bitcast=True))
        codes = codes + (group_key >= threshold).to(tl.int32)
    return (
        tl.reshape(codes, (ROWS, D)),
        tl.reshape(scale, (ROWS, NUM_GROUPS)),
        tl.reshape(minimum, (ROWS, NUM_GROUPS)),
    )


# ------------------------------------------------------------------------ encode by planes
#
# encode_block spends ~50 ALU-pipe instructions an element (sm_90 SASS; Nsight Compute found the
# encode bound by that pipe: benchmarks/DECISIONS.md, "What bounds the unmet targets"), most of
# them making rare inputs exact for every element: the sanitize, the clamp, keys for signed zeros,
# and a layout where the four codes of a byte live in four threads. `encode_planes` takes the common case, rows of one group (G = D)
# with levels="minmax", in ~20 an element at 32 rows (DECISIONS.md W3), and says which rows it cannot
# take exactly; a block holding one of those is encoded again by encode_block. It reads each row as its four
# quarter planes (plane p: elements p·Q … p·Q + Q − 1), so the elements a byte packs are in one
# thread, and:
#   * sanitize is the identity on rows whose largest |x| is at most FP16_MAX (no NaN, no ±Inf);
#   * τ by max rounds as tagged_max / checked_max, each round one fused add-and-min: the largest
#     key below `top` is top − 1 − min(top − 1 − key) over the keys read as unsigned (keys ≥ top
#     wrap around to the top of the range);
#   * the clipped group's extremes are the clipped extremes (clipping is monotone): the largest
#     value is the signed max of the bit patterns when the row holds a value with the sign bit
#     clear, the smallest the unsigned max when it holds one with the sign bit set (−0 included,
#     so −0 < +0 as FORMAT.md orders them);
#   * codes compare the unclipped keys against thresholds moved off the clip range: a threshold at
#     or below −τ counts for every value, one above τ for none; between, clip(x) ≥ t ⇔ x ≥ t.
# Rows it declines: a NaN or |x| > FP16_MAX, τ = 0 (clipping to zeros), a row without a sign bit
# set or without one clear, and (float32 rows) ties among the largest values (checked_max's test).

PLANES_C = tl.constexpr(CODES_PER_BYTE)
KEY_BELOW_ALL_C = tl.constexpr(ORDERED_KEY_BELOW_ALL)  # a threshold every key meets
KEY_ABOVE_ALL_C = tl.constexpr(ORDERED_KEY_ABOVE_ALL)  # a threshold no key of |x| ≤ FP16_MAX meets


@triton.jit
def _row_max4(p0, p1, p2, p3):
    """Largest element of each row over its four planes [R, Q] → [R, 1]."""
    return tl.max(tl.maximum(tl.maximum(p0, p1), tl.maximum(p2, p3)), axis=1, keep_dims=True)


@triton.jit
def _gap_below(keys, top):
    """min over the row of top − 1 − key, unsigned ([R, 1] uint32): keys ≥ top wrap high."""
    return tl.min((top - 1 - keys).to(tl.uint32, bitcast=True), axis=1, keep_dims=True)


@triton.jit
def _largest_below_rounds(k0, k1, k2, k3, top, ROUNDS: tl.constexpr):
    """ROUNDS times: top ← the largest key of the row below top (keys non-negative int32)."""
    for _ in tl.static_range(ROUNDS):
        gap = tl.minimum(tl.minimum(_gap_below(k0, top), _gap_below(k1, top)),
                         tl.minimum(_gap_below(k2, top), _gap_below(k3, top)))  # unsigned, as the gaps
        top = top - 1 - gap.to(tl.int32, bitcast=True)
    return top


@triton.jit
def _plane_codes(bits, t0, t1, t2):
    """Σ_j [key(x) ≥ t_j] for one plane (ordered keys; the thresholds [R, 1])."""
    key = _ordered_key(bits)
    return (key >= t0).to(tl.int32) + (key >= t1).to(tl.int32) + (key >= t2).to(tl.int32)


@triton.jit
def _threshold_key(m, s, J: tl.constexpr, tau_bits):
    """Ordered key to compare unclipped keys with for threshold j = m + (j + 0.5)·s ([R, 1])."""
    t_bits = (m + (FIRST_THRESHOLD_C + J * THRESHOLD_STEP_C) * s).to(tl.int32, bitcast=True)
    t_key = tl.where(t_bits == 0, -1, _ordered_key(t_bits))  # x ≥ +0 holds for −0 (key −1) too
    below_clip = t_key <= _ordered_key(tau_bits | F32_SIGN_BIT_C)
    return tl.where(below_clip, KEY_BELOW_ALL_C, tl.where(t_key > tau_bits, KEY_ABOVE_ALL_C, t_key))


@triton.jit
def encode_planes(b0, b1, b2, b3, CLIP_INDEX: tl.constexpr, ROWS_BF16: tl.constexpr):
    """Encode rows of one group (G = D, levels="minmax") given as their four quarter planes of
    float32 bit patterns (int32 [R, Q]). ROWS_BF16: every value is a bfloat16 (low bits zero).
    Returns packed int32 [R, Q] (byte values), scale and minimum float16 [R, 1], and `exact` bool
    [R, 1]: where false the outputs are not the format's and the row needs encode_block."""
    Q: tl.constexpr = b0.shape[1]
    D: tl.constexpr = Q * PLANES_C
    SKIP: tl.constexpr = D - 1 - CLIP_INDEX
    a0 = b0 & F32_MAGNITUDE_MASK_C
    a1 = b1 & F32_MAGNITUDE_MASK_C
    a2 = b2 & F32_MAGNITUDE_MASK_C
    a3 = b3 & F32_MAGNITUDE_MASK_C
    # 1–2. τ, and whether sanitize leaves the row as it is.
    if ROWS_BF16:  # tagged with the column (tagged_max): every key differs
        column = tl.arange(0, Q)[None, :]
        a0 = a0 | column
        a1 = a1 | (column + Q)
        a2 = a2 | (column + 2 * Q)
        a3 = a3 | (column + 3 * Q)
        top = _row_max4(a0, a1, a2, a3)
        sane = (top & ~BF16_LOW_MASK_C) <= FP16_MAX_BITS_C
        tau = _largest_below_rounds(a0, a1, a2, a3, top, SKIP) & ~BF16_LOW_MASK_C
        exact = sane
    else:  # distinct values (checked_max): exact where no tie hid among the largest
        top = _row_max4(a0, a1, a2, a3)
        tau = _largest_below_rounds(a0, a1, a2, a3, top, SKIP)
        above = tl.sum((a0 > tau).to(tl.int32) + (a1 > tau).to(tl.int32) + (a2 > tau).to(tl.int32)
                       + (a3 > tau).to(tl.int32), axis=1, keep_dims=True)
        exact = (top <= FP16_MAX_BITS_C) & (above == SKIP)
    # 3. the clipped extremes (see the section comment).
    hi = _row_max4(b0, b1, b2, b3)
    lo = _row_max4(b0.to(tl.uint32, bitcast=True), b1.to(tl.uint32, bitcast=True),
                   b2.to(tl.uint32, bitcast=True), b3.to(tl.uint32, bitcast=True)).to(tl.int32, bitcast=True)
    exact = exact & (tau != 0) & (hi >= 0) & (lo < 0)
    hi = tl.minimum(hi, tau).to(tl.float32, bitcast=True)
    lo = tl.where((lo & F32_MAGNITUDE_MASK_C) > tau, tau | F32_SIGN_BIT_C, lo).to(tl.float32, bitcast=True)
    scale = to_f16_saturating((hi - lo) * ONE_THIRD_C)
    minimum = to_f16_saturating(lo)  # = f16(lo) where exact; saturating keeps declined rows quiet
    # 4–5. codes against the thresholds moved off the clip range, packed plane by plane.
    s = scale.to(tl.float32)
    m = minimum.to(tl.float32)
    t0 = _threshold_key(m, s, 0, tau)
    t1 = _threshold_key(m, s, 1, tau)
    t2 = _threshold_key(m, s, 2, tau)
    packed = (_plane_codes(b0, t0, t1, t2) + (_plane_codes(b1, t0, t1, t2) << CODE_BITS_C)
              + (_plane_codes(b2, t0, t1, t2) << 2 * CODE_BITS_C) + (_plane_codes(b3, t0, t1, t2) << 3 * CODE_BITS_C))
    return packed, scale, minimum, exact


@triton.jit
def load_plane_bits(ptrs, mask, INPUT_BF16: tl.constexpr):
    """A plane's float32 bit patterns (int32), widened exactly as load_rows_f32."""
    return load_rows_f32(ptrs, mask, INPUT_BF16).to(tl.int32, bitcast=True)


@triton.jit
def encode_loaded_rows(
    row_ptrs,  # [R, 1] pointers to each row's first element (D contiguous values)
    row_ok,  # [R, 1] which rows exist
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    PLANES: tl.constexpr,
):
    """Load and encode a block of rows: with PLANES by encode_planes (the rows read as their four
    quarter planes) unless a row that exists needs encode_block, which then encodes the block
    (the rows read whole, only there). Returns encode_block's (packed, scale, minimum)."""
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    rows = row_ptrs + tl.arange(0, D)[None, :]
    if PLANES:
        plane = row_ptrs + tl.arange(0, QUARTER)[None, :]
        packed, scale, minimum, exact = encode_planes(
            load_plane_bits(plane, row_ok, INPUT_BF16), load_plane_bits(plane + QUARTER, row_ok, INPUT_BF16),
            load_plane_bits(plane + 2 * QUARTER, row_ok, INPUT_BF16),
            load_plane_bits(plane + 3 * QUARTER, row_ok, INPUT_BF16), CLIP_INDEX, INPUT_BF16)
        if tl.min((exact | ~row_ok).to(tl.int32)) == 0:
            packed, scale, minimum = encode_block(load_rows_f32(rows, row_ok, INPUT_BF16), GROUP_SIZE, CLIP_INDEX,
                                                  LEVELS, ORDER_STATISTIC)
    else:
        packed, scale, minimum = encode_block(load_rows_f32(rows, row_ok, INPUT_BF16), GROUP_SIZE, CLIP_INDEX, LEVELS,
                                              ORDER_STATISTIC)
    return packed, scale, minimum


@triton.jit
def unpack_codes(packed):
    """packed int32 [R, D/4] byte values → codes int32 [R, D] (plane p holds elements p·Q …)."""
    ROWS: tl.constexpr = packed.shape[0]
    QUARTER: tl.constexpr = packed.shape[1]
    shifts = tl.arange(0, CODES_PER_BYTE_C)[None, :, None] * CODE_BITS_C
    codes = (packed[:, None, :] >> shifts) & CODE_MASK_C  # [R, 4, Q]
    return tl.reshape(codes, (ROWS, QUARTER * CODES_PER_BYTE_C))


@triton.jit
def decode_block(packed, scale, minimum, GROUP_SIZE: tl.constexpr):
    """packed int32 [R, D/4], scale/minimum float32 [R, D/G] → float32 [R, D], x̂ = m + code·s."""
    ROWS: tl.constexpr = packed.shape[0]
    D: tl.constexpr = packed.shape[1] * CODES_PER_BYTE_C
    NUM_GROUPS: tl.constexpr = D // GROUP_SIZE
    codes = tl.reshape(unpack_codes(packed), (ROWS, NUM_GROUPS, GROUP_SIZE)).to(tl.float32)
    values = minimum[:, :, None] + codes * scale[:, :, None]  # code·s is exact (≤ 13 bits)
    return tl.reshape(values, (ROWS, D))


# ----------------------------------------------------------------------------------- encode


@triton.jit
def _store_encoded(packed_ptr, scale_ptr, minimum_ptr, row, row_ok, packed, scale, minimum):
    QUARTER: tl.constexpr = packed.shape[1]
    NUM_GROUPS: tl.constexpr = scale.shape[1]
    tl.store(packed_ptr + row * QUARTER + tl.arange(0, QUARTER)[None, :], packed.to(tl.uint8), mask=row_ok)
    group = tl.arange(0, NUM_GROUPS)[None, :]
    tl.store(scale_ptr + row * NUM_GROUPS + group, scale, mask=row_ok)
    tl.store(minimum_ptr + row * NUM_GROUPS + group, minimum, mask=row_ok)


@triton.jit
def _encode_kernel(
    x_ptr,  # [N, D] float32 / float16, or bfloat16 as int16 bit patterns
    packed_ptr,  # [N, D/4] uint8
    scale_ptr,  # [N, D/G] float16
    minimum_ptr,  # [N, D/G] float16
    num_rows,
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    PLANES: tl.constexpr = False,
):
    row = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]  # [R, 1]
    row_ok = row < num_rows
    packed, scale, minimum = encode_loaded_rows(x_ptr + row * D, row_ok, D, GROUP_SIZE, CLIP_INDEX, LEVELS,
                                                ORDER_STATISTIC, INPUT_BF16, PLANES)
    _store_encoded(packed_ptr, scale_ptr, minimum_ptr, row, row_ok, packed, scale, minimum)


def kernel_view(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensors travel to the kernels as their int16 bit patterns (see module docstring)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def encode_rows(
    x: torch.Tensor,
    *,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str | None = None,
    block_rows: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    planes: bool | None = None,
):
    """Launch encode over x [N, D] (N ≥ 1, contiguous float32/float16/bfloat16). Arguments are
    validated by oscar_torch.ops.encode. Returns packed u8 [N, D/4], scale, minimum f16 [N, D/G].
    planes: `encode_planes` where it applies (None; G = D, levels="minmax"), insisted on (True: an
    error elsewhere) or never (False); see shared_math.tiling.resolve_encode_planes. block_rows:
    None → ENCODE_PLANES_BLOCK_ROWS by planes, else DEFAULT_BLOCK_ROWS."""
    num_rows, d = x.shape
    planes = tiling.resolve_encode_planes(planes, d, group_size, levels)
    order_statistic = resolve_order_statistic(order_statistic, d, clip_index, x.dtype)
    if block_rows is None:
        block_rows = tiling.ENCODE_PLANES_BLOCK_ROWS if planes else DEFAULT_BLOCK_ROWS
    rows = tiling.planes_block_rows(block_rows_for(num_rows, block_rows), planes)
    packed = torch.empty((num_rows, d // CODES_PER_BYTE), dtype=torch.uint8, device=x.device)
    scale = torch.empty((num_rows, d // group_size), dtype=torch.float16, device=x.device)
    minimum = torch.empty_like(scale)
    _encode_kernel[(triton.cdiv(num_rows, rows),)](
        kernel_view(x), packed, scale, minimum, num_rows,
        D=d, GROUP_SIZE=group_size, CLIP_INDEX=clip_index, LEVELS=levels,
        ORDER_STATISTIC=order_statistic, INPUT_BF16=x.dtype == torch.bfloat16, BLOCK_ROWS=rows,
        PLANES=planes, num_warps=num_warps,
    )
    return packed, scale, minimum


@triton.jit
def _encode_channel_pages_kernel(
    x_ptr,  # [N, L, D] float32 / float16, or bfloat16 as int16 bit patterns
    packed_ptr,  # [N, L, D/4] uint8
    scale_ptr,  # [N, D] float16
    minimum_ptr,  # [N, D] float16
    PAGE: tl.constexpr,
    D: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
    INPUT_BF16: tl.constexpr,
):
    """Format v2 key pages, one page a program: each channel over the page's tokens is one row of
    G = PAGE through `code_block` (the page read transposed), the codes packed per token."""
    page = tl.program_id(0)
    token = tl.arange(0, PAGE)[:, None]
    channel = tl.arange(0, D)[None, :]
    rows = load_rows_f32(x_ptr + page * PAGE * D + token * D + channel, token < PAGE, INPUT_BF16)  # [L, D]
    codes, scale, minimum = code_block(tl.trans(rows), PAGE, CLIP_INDEX, LEVELS, ORDER_STATISTIC)  # [D, L]
    packed = pack_block(tl.trans(codes))  # [L, D/4]
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    tl.store(packed_ptr + page * PAGE * QUARTER + token * QUARTER + tl.arange(0, QUARTER)[None, :],
             packed.to(tl.uint8))
    tl.store(scale_ptr + page * D + tl.arange(0, D), tl.reshape(scale, (D,)))
    tl.store(minimum_ptr + page * D + tl.arange(0, D), tl.reshape(minimum, (D,)))


def encode_channel_pages(x: torch.Tensor, *, clip_index: int, levels: str, num_warps: int = DEFAULT_NUM_WARPS):
    """Launch format v2's per-channel key page encode over x [N, L, D] (contiguous float32 /
    float16 / bfloat16; clip_index over L values) → packed u8 [N, L, D/4], scale, minimum f16
    [N, D], bit-identical to shared_math.encode_channels."""
    num_pages, page, d = x.shape
    order_statistic = resolve_order_statistic(None, page, clip_index, x.dtype)
    packed = torch.empty((num_pages, page, d // CODES_PER_BYTE), dtype=torch.uint8, device=x.device)
    scale = torch.empty((num_pages, d), dtype=torch.float16, device=x.device)
    minimum = torch.empty_like(scale)
    if num_pages:
        _encode_channel_pages_kernel[(num_pages,)](
            kernel_view(x), packed, scale, minimum, PAGE=page, D=d, CLIP_INDEX=clip_index, LEVELS=levels,
            ORDER_STATISTIC=order_statistic, INPUT_BF16=x.dtype == torch.bfloat16, num_warps=num_warps,
        )
    return packed, scale, minimum


# ----------------------------------------------------------------------------------- decode


@triton.jit
def _decode_kernel(
    packed_ptr,  # [N, D/4] uint8
    scale_ptr,  # [N, D/G] float16
    minimum_ptr,  # [N, D/G] float16
    out_ptr,  # [N, D] float32
    num_rows,
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    NUM_GROUPS: tl.constexpr = D // GROUP_SIZE
    row = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]  # [R, 1]
    row_ok = row < num_rows
    packed = tl.load(packed_ptr + row * QUARTER + tl.arange(0, QUARTER)[None, :], mask=row_ok, other=0)
    group = tl.arange(0, NUM_GROUPS)[None, :]
    scale = tl.load(scale_ptr + row * NUM_GROUPS + group, mask=row_ok, other=0).to(tl.float32)
    minimum = tl.load(minimum_ptr + row * NUM_GROUPS + group, mask=row_ok, other=0).to(tl.float32)
    values = decode_block(packed.to(tl.int32), scale, minimum, GROUP_SIZE)
    tl.store(out_ptr + row * D + tl.arange(0, D)[None, :], values, mask=row_ok)


def decode_rows(
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    *,
    group_size: int,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """Launch decode over packed [N, D/4], scale/minimum [N, D/G] → float32 [N, D]."""
    num_rows, quarter = packed.shape
    d = quarter * CODES_PER_BYTE
    rows = block_rows_for(num_rows, block_rows)
    out = torch.empty((num_rows, d), dtype=torch.float32, device=packed.device)
    _decode_kernel[(triton.cdiv(num_rows, rows),)](
        packed, scale, minimum, out, num_rows,
        D=d, GROUP_SIZE=group_size, BLOCK_ROWS=rows, num_warps=num_warps,
    )
    return out
