"""The INT2 codes as dot operands of the Triton INT2 tier kernels: a packed row's bit planes (integer
ops, or inline PTX on the GPU; shared_math.ptx's operand convention), their factors and code bias,
the query planes and the stores of the output planes."""

from __future__ import annotations

import triton
import triton.language as tl

from oscar_torch.kernels.codec import CODE_BITS_C, CODE_MASK_C, CODES_PER_BYTE_C, load_rows_f32
from shared_math.ptx import (
    BITS_PER_BYTE,
    BYTES_PER_PAIR,
    PAIR_UNPACK_CONSTRAINTS,
    PAIR_UNPACK_PACK,
    UNPACK_CONSTRAINTS,
    UNPACK_PACK,
    plane_factor,
    plane_mask,
    plane_shift,
    unpack_pair_plane_ptx,
    unpack_plane_ptx,
)
from shared_math.spec import BF16_CODE_BIAS, BF16_CODE_BIAS_BITS, CODES_PER_BYTE

BF16_CODE_BIAS_C = tl.constexpr(BF16_CODE_BIAS)
BF16_CODE_BIAS_BITS_C = tl.constexpr(BF16_CODE_BIAS_BITS)
UNPACK_PLANE_0_PTX = tl.constexpr(unpack_plane_ptx(0))
UNPACK_PLANE_1_PTX = tl.constexpr(unpack_plane_ptx(1))
UNPACK_PLANE_2_PTX = tl.constexpr(unpack_plane_ptx(2))
UNPACK_PLANE_3_PTX = tl.constexpr(unpack_plane_ptx(3))
# shared_math.ptx's operand convention per bit plane: the code's right shift, mask and factor.
_PLANES = range(CODES_PER_BYTE)
PLANE_0_SHIFT_C, PLANE_1_SHIFT_C, PLANE_2_SHIFT_C, PLANE_3_SHIFT_C = (tl.constexpr(plane_shift(p)) for p in _PLANES)
PLANE_0_MASK_C, PLANE_1_MASK_C, PLANE_2_MASK_C, PLANE_3_MASK_C = (tl.constexpr(plane_mask(p)) for p in _PLANES)
PLANE_0_FACTOR_C, PLANE_1_FACTOR_C, PLANE_2_FACTOR_C, PLANE_3_FACTOR_C = (
    tl.constexpr(plane_factor(p)) for p in _PLANES)
UNPACK_CONSTRAINTS_C = tl.constexpr(UNPACK_CONSTRAINTS)
UNPACK_PACK_C = tl.constexpr(UNPACK_PACK)
# The values' code pairs (CHANNELS_ON_M): plane p of the low / high byte of a 16-bit pair.
(UNPACK_PAIR_0_LOW_PTX, UNPACK_PAIR_1_LOW_PTX, UNPACK_PAIR_2_LOW_PTX, UNPACK_PAIR_3_LOW_PTX) = (
    tl.constexpr(unpack_pair_plane_ptx(p, 0)) for p in _PLANES)
(UNPACK_PAIR_0_HIGH_PTX, UNPACK_PAIR_1_HIGH_PTX, UNPACK_PAIR_2_HIGH_PTX, UNPACK_PAIR_3_HIGH_PTX) = (
    tl.constexpr(unpack_pair_plane_ptx(p, 1)) for p in _PLANES)
PAIR_UNPACK_CONSTRAINTS_C = tl.constexpr(PAIR_UNPACK_CONSTRAINTS)
PAIR_UNPACK_PACK_C = tl.constexpr(PAIR_UNPACK_PACK)
BITS_PER_BYTE_C = tl.constexpr(BITS_PER_BYTE)
BYTES_PER_PAIR_C = tl.constexpr(BYTES_PER_PAIR)


@triton.jit
def _load_packed(codes_ptr, row, columns, QUARTER: tl.constexpr, UNPACK_ASM: tl.constexpr):
    """The code bytes [N, D/4] of rows `row`: uint8 for the PTX unpacker, else widened to int32
    (the shifts of `_plane_codes` run on 32-bit integers)."""
    packed = tl.load(codes_ptr + row[:, None] * QUARTER + columns)
    if UNPACK_ASM:
        return packed
    else:
        return packed.to(tl.int32)


@triton.jit
def _unpack_plane_asm(packed, PLANE: tl.constexpr):
    """Bit plane PLANE of uint8 [N, D/4] as bfloat16 operands, by inline PTX (shared_math.ptx)."""
    if PLANE == 0:
        asm: tl.constexpr = UNPACK_PLANE_0_PTX
    elif PLANE == 1:
        asm: tl.constexpr = UNPACK_PLANE_1_PTX
    elif PLANE == 2:
        asm: tl.constexpr = UNPACK_PLANE_2_PTX
    else:
        asm: tl.constexpr = UNPACK_PLANE_3_PTX
    return tl.inline_asm_elementwise(asm, UNPACK_CONSTRAINTS_C, [packed], dtype=tl.bfloat16, is_pure=True,
                                     pack=UNPACK_PACK_C)


@triton.jit
def _plane_factor(PLANE: tl.constexpr):
    """The code multiplier of plane PLANE's bfloat16 operand (shared_math.ptx.plane_factor): the query
    plane is divided by it, the output plane carried in its units. float32 dots have none."""
    if PLANE == 0:
        return PLANE_0_FACTOR_C
    elif PLANE == 1:
        return PLANE_1_FACTOR_C
    elif PLANE == 2:
        return PLANE_2_FACTOR_C
    else:
        return PLANE_3_FACTOR_C


@triton.jit
def _plane_in_place(packed, PLANE: tl.constexpr):
    """c << place of bit plane PLANE (shared_math.ptx: masked where the byte holds it; plane 3 shifted)."""
    if PLANE == 0:
        return (packed >> PLANE_0_SHIFT_C) & PLANE_0_MASK_C
    elif PLANE == 1:
        return (packed >> PLANE_1_SHIFT_C) & PLANE_1_MASK_C
    elif PLANE == 2:
        return (packed >> PLANE_2_SHIFT_C) & PLANE_2_MASK_C
    else:
        return (packed >> PLANE_3_SHIFT_C) & PLANE_3_MASK_C


@triton.jit
def _plane_codes(packed, PLANE: tl.constexpr, BF16_DOTS: tl.constexpr, TENSOR_CORES: tl.constexpr,
                 UNPACK_ASM: tl.constexpr = False):
    """Bit plane PLANE of packed int32 [N, D/4]: the codes of channels [PLANE·D/4, …) as a dot
    operand, exact: c in float32; 128 + c·factor for bfloat16 dots (shared_math.ptx: one integer op,
    no int→float conversion, which issues at a quarter of the integer rate on sm_90; `_code_bias`,
    `_plane_factor`; benchmarks/DECISIONS.md D11).
    UNPACK_ASM (bfloat16 dots on the GPU; `packed` uint8): the same bits through inline PTX."""
    if UNPACK_ASM:  # (if/else: Triton compiles the code after a constexpr-guarded return too)
        return _unpack_plane_asm(packed, PLANE)
    else:
        if BF16_DOTS:  # nested constexpr ifs: `a and b` of constexprs is not folded at compile time
            if TENSOR_CORES:  # bits 0x4300 | c << place
                bits = _plane_in_place(packed, PLANE) | BF16_CODE_BIAS_BITS_C
                return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
            else:  # the interpreter's dots are float32: the same values
                return _plane_in_place(packed, PLANE).to(tl.float32) + BF16_CODE_BIAS_C
        else:
            return ((packed >> (PLANE * CODE_BITS_C)) & CODE_MASK_C).to(tl.float32)


@triton.jit
def _code_bias(BF16_DOTS: tl.constexpr):
    """What `_plane_codes` adds to every code (128 for bfloat16 dots, else 0)."""
    if BF16_DOTS:
        return BF16_CODE_BIAS_C
    else:
        return 0.0


@triton.jit
def _value_minimum_sums(p, minimum, p_scaled, BF16_DOTS: tl.constexpr, TOKEN_AXIS: tl.constexpr = 1):
    """(Σ_n p·m_v, bias·Σ_n of the *rounded* p·s_v operand), each [BLOCK_M] (p [BLOCK_M, N], or
    [N, BLOCK_M] with TOKEN_AXIS 0). Plane p's minimum term is factor_p·Σ p·m_v − that bias (its
    output carried in units of the factor), so that the bias the planes carry cancels exactly up
    to float32 accumulation."""
    term = tl.sum(p * tl.expand_dims(minimum, 1 - TOKEN_AXIS), axis=TOKEN_AXIS)
    if BF16_DOTS:
        bias = BF16_CODE_BIAS_C * tl.sum(p_scaled.to(tl.float32), axis=TOKEN_AXIS)
    else:
        bias = term  # unused: float32 dots carry no bias (no op in the interpreter)
    return term, bias


@triton.jit
def _plane_metadata(ptr, row, valid, PLANE: tl.constexpr, QUARTER: tl.constexpr, GROUP_SIZE: tl.constexpr,
                    NUM_GROUPS: tl.constexpr):
    """The fp16 scale or minimum [N] (float32) of the group holding bit plane PLANE; masked → 0."""
    value = tl.load(ptr + row * NUM_GROUPS + (PLANE * QUARTER) // GROUP_SIZE).to(tl.float32)
    return tl.where(valid, value, 0.0)  # masked rows may be stale memory (NaN metadata)


@triton.jit
def _query_plane(q_ptr, b, h, row_block, PLANE: tl.constexpr, NUM_HEADS: tl.constexpr, ROWS: tl.constexpr,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, Q_BF16: tl.constexpr):
    """Query columns [PLANE·D/4, …) of the rows of (b, h) as float32 [BLOCK_M, D/4]."""
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    start = ((b * NUM_HEADS + h) * ROWS + row).to(tl.int64) * D + PLANE * QUARTER
    return load_rows_f32(q_ptr + start[:, None] + tl.arange(0, QUARTER)[None, :], row[:, None] < ROWS, Q_BF16)


@triton.jit
def _store_plane(o_ptr, o_plane, inv_l, out_row, PLANE: tl.constexpr, D: tl.constexpr, BF16_DOTS: tl.constexpr):
    """The normalised output plane (carried in units of the plane's factor: divided here)."""
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    column = PLANE * QUARTER + tl.arange(0, QUARTER)[None, :]
    if BF16_DOTS:
        inv_l = inv_l * (1.0 / _plane_factor(PLANE))
    tl.store(o_ptr + out_row[:, None].to(tl.int64) * D + column, o_plane * inv_l[:, None])


@triton.jit
def _plane_minimum_terms(p_min, bias, Q_BF16: tl.constexpr):
    """Each output plane's minimum term Σ p·m_v, in units of the plane's factor less the bias its
    codes carry (bfloat16 dots); float32 dots: Σ p·m_v itself."""
    if Q_BF16:
        min0, min1 = p_min * _plane_factor(0) - bias, p_min * _plane_factor(1) - bias
        min2, min3 = p_min * _plane_factor(2) - bias, p_min * _plane_factor(3) - bias
    else:  # (no factors, no bias; the interpreter pays for every op of the tests' float32 models)
        min0, min1, min2, min3 = p_min, p_min, p_min, p_min
    return min0, min1, min2, min3


@triton.jit
def _load_code_pairs(codes_ptr, row, QUARTER: tl.constexpr):
    """The code bytes of rows `row` as 16-bit pairs, transposed: int16 [D/8, N] (bytes 2j, 2j + 1 of
    token n: channels 2j and 2j + 1 of every plane). Read in this shape (not transposed after the
    load), the tile is the values' channels-on-M A operand straight from the load, which the
    compiler can stage in shared memory and read by ldmatrix.trans."""
    PAIRS: tl.constexpr = QUARTER // BYTES_PER_PAIR_C
    pairs_ptr = codes_ptr.to(tl.pointer_type(tl.int16))
    return tl.load(pairs_ptr + tl.arange(0, PAIRS)[:, None] + row[None, :] * PAIRS)


@triton.jit
def _store_half_plane(o_ptr, o_half, inv_l, out_row, PLANE: tl.constexpr, HIGH: tl.constexpr, D: tl.constexpr,
                      BF16_DOTS: tl.constexpr):
    """The normalised oᵀ half plane [D/8, BLOCK_M] (channels PLANE·D/4 + 2j + HIGH) at rows out_row."""
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    column = PLANE * QUARTER + BYTES_PER_PAIR_C * tl.arange(0, QUARTER // BYTES_PER_PAIR_C)[:, None] + HIGH
    if BF16_DOTS:
        inv_l = inv_l * (1.0 / _plane_factor(PLANE))
    tl.store(o_ptr + out_row[None, :].to(tl.int64) * D + column, o_half * inv_l[None, :])

