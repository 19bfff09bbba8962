"""The INT2 codes as dot operands: a packed row's (byte chunk, bit plane) pieces, the query split
like them, and each plane unpacked into its operand (integer ops, or inline PTX on the GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from shared_math.ptx import (
    BITS_PER_BYTE, PAIR_UNPACK_CONSTRAINTS, PAIR_UNPACK_PACK, UNPACK_CONSTRAINTS, UNPACK_PACK, plane_factor,
    plane_mask, plane_shift, unpack_pair_plane_ptx, unpack_plane_ptx,
)
from shared_math.spec import BF16_CODE_BIAS, BF16_CODE_BIAS_BITS, CODE_BITS, CODE_MASK, CODES_PER_BYTE


def int2_pieces(head_dim: int, group_size: int):
    """The (byte chunk, bit plane) pieces of a packed row: (byte_start, width, plane, channel_start, group).

    Piece (j, plane) reads bytes [j·W, j·W + W) and covers channels [plane·D/4 + j·W, … + W), all
    inside group (plane·D/4 + j·W) // group_size; W = min(group_size, D/4) keeps that true.
    """
    quarter = head_dim // CODES_PER_BYTE
    width = min(group_size, quarter)
    pieces = []
    for plane in range(CODES_PER_BYTE):
        for byte_start in range(0, quarter, width):
            channel_start = plane * quarter + byte_start
            pieces.append((byte_start, width, plane, channel_start, channel_start // group_size))
    return tuple(pieces)


def code_offset(compute_dtype) -> float:
    """What `_code_planes` adds to every code: 128 for bfloat16 operands (see there), else 0."""
    return BF16_CODE_BIAS if jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16) else 0.0


def operand_factors(pieces, compute_dtype):
    """Each piece's code multiplier in its `_code_planes` operand: shared_math.ptx.plane_factor
    for bfloat16 operands (the codes left in place in the mantissa), else 1."""
    bf16 = code_offset(compute_dtype) != 0.0
    return tuple(plane_factor(plane) if bf16 else 1.0 for (_, _, plane, _, _) in pieces)


def _int2_query_terms(q_ref, pieces, num_groups):
    """The query split like the code planes ([BLOCK_M, W] per piece, divided by the piece's operand
    factor: exact, a power of two), Σ q per group, and per group the bias its code dots carry,
    code_bias·Σ_pieces Σ q / factor (None for float32 operands: no bias)."""
    block_m = q_ref.shape[0]
    code_bias = code_offset(q_ref.dtype)
    factors = operand_factors(pieces, q_ref.dtype)
    q_pieces, q_group_sums = [], [jnp.zeros((block_m,), jnp.float32) for _ in range(num_groups)]
    q_bias_sums = [jnp.zeros((block_m,), jnp.float32) for _ in range(num_groups)] if code_bias else None
    for factor, (_, width, _, c0, group) in zip(factors, pieces):
        q_piece = q_ref[:, pl.ds(c0, width)]
        q_pieces.append(q_piece * (1.0 / factor) if factor != 1.0 else q_piece)
        piece_sum = jnp.sum(q_piece.astype(jnp.float32), axis=1)
        q_group_sums[group] = q_group_sums[group] + piece_sum
        if code_bias:
            q_bias_sums[group] = q_bias_sums[group] + piece_sum * (code_bias / factor)
    return q_pieces, q_group_sums, q_bias_sums


def _unpack_plane_asm(chunk, plane):
    """uint8 [N, W] → bit plane `plane` as bfloat16 [N, W] operands (shared_math.ptx), by inline
    PTX (GPU only; shared_math.ptx). One asm per plane: jax's lowering of a multi-result inline asm
    returns one value; ptxas merges the PRMTs the planes of one chunk repeat."""
    return pl_triton.elementwise_inline_asm(
        unpack_plane_ptx(plane), args=[chunk], constraints=UNPACK_CONSTRAINTS, pack=UNPACK_PACK,
        result_shape_dtypes=[jax.ShapeDtypeStruct(chunk.shape, jnp.bfloat16)])[0]


def _code_planes(load_chunk, pieces, compute_dtype, unpack_asm=False):
    """Each piece's codes as a zero-argument function giving its [N, W] dot operand; the caller
    calls it right before that piece's dot. `load_chunk(byte_start, width)` gives the uint8 bytes
    [N, W] (loaded once per chunk, here; widened to int32 before the shift: the Triton lowering's
    rule). Unpacking a plane next to its dot, instead of all four planes before the first dot, keeps
    one plane live at a time, so the kernel holds fewer registers (sm_90).

    bfloat16: the operand is built as bits `0x4300 | c << place`, i.e. the exact value
    128 + c·factor (shared_math.ptx: the codes masked where the byte holds them, plane 3 shifted by
    one), with one integer op per code instead of an int→bf16 conversion: conversions issue at
    16/clk/SM on sm_90 (a quarter of integer ops), and at 128 per thread per page they bounded the
    kernel (benchmarks/DECISIONS.md D11). The 128 is folded back into the minimum terms (`code_offset`),
    the factor into the query pieces and the output planes (`operand_factors`).
    float32: the exact codes. `unpack_asm` (bfloat16, GPU only): the same bits through
    `_unpack_plane_asm`."""
    bf16 = code_offset(compute_dtype) != 0.0
    asm = bf16 and unpack_asm
    chunks = {}
    for byte_start, width, _, _, _ in pieces:
        if byte_start not in chunks:
            chunk = load_chunk(byte_start, width)
            chunks[byte_start] = chunk if asm else chunk.astype(jnp.int32)

    def plane_operand(chunk, plane):
        if asm:
            return _unpack_plane_asm(chunk, plane)
        return _byte_plane_operand(chunk, plane, compute_dtype)

    return [functools.partial(plane_operand, chunks[byte_start], plane) for byte_start, _, plane, _, _ in pieces]


def _byte_plane_operand(byte, plane, compute_dtype):
    """Code bytes as int32 → bit plane `plane` as the dot operand (`_code_planes`: bits
    0x4300 | c << place for bfloat16, the code itself for float32)."""
    if code_offset(compute_dtype) != 0.0:
        shifted = lax.shift_right_logical(byte, plane_shift(plane)) if plane_shift(plane) else byte
        bits = (shifted & plane_mask(plane)) | BF16_CODE_BIAS_BITS
        return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)
    return (lax.shift_right_logical(byte, plane * CODE_BITS) & CODE_MASK).astype(compute_dtype)


def _code_pairs(pairs_ref, page, page_size):
    """Page `page` of a pool of 16-bit code pairs [P, L, D/8] (bytes 2j, 2j + 1 of each row), read
    transposed: uint16 [D/8, L]. Read in this shape by its addresses (not transposed after the
    load), the tile can be staged in shared memory and read by ldmatrix.trans as the A operand of
    the channels-on-M values' dot (a transpose after the load round-trips the unpacked operand
    through shared memory)."""
    half = pairs_ref.shape[-1]
    token = lax.broadcasted_iota(jnp.int32, (half, page_size), 1)
    column = lax.broadcasted_iota(jnp.int32, (half, page_size), 0)
    return pairs_ref[page, token, column]


def _pair_plane_operand(pairs, plane, high, compute_dtype, unpack_asm):
    """Bit plane `plane` of byte `high` (0: 2j, 1: 2j + 1) of uint16 code pairs, as dot operands of
    `compute_dtype` (shared_math.ptx's convention; `unpack_asm`: by inline PTX, bfloat16 only)."""
    if unpack_asm and code_offset(compute_dtype) != 0.0:
        return pl_triton.elementwise_inline_asm(
            unpack_pair_plane_ptx(plane, high), args=[pairs], constraints=PAIR_UNPACK_CONSTRAINTS,
            pack=PAIR_UNPACK_PACK, result_shape_dtypes=[jax.ShapeDtypeStruct(pairs.shape, jnp.bfloat16)])[0]
    byte = lax.shift_right_logical(pairs.astype(jnp.int32), high * BITS_PER_BYTE) & 0xFF
    return _byte_plane_operand(byte, plane, compute_dtype)

