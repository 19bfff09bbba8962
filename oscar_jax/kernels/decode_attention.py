"""Split-K first-stage kernels of attention over OSCAR's paged mixed-precision KV cache.

Two kernels, one per storage tier (OSCAR_SPEC §5 "Read"), each writing a *normalised* partial
output and its log-sum-exp per (sequence, KV head, query-row block, split); a third kernel
(`merge_tier_partials`, decode) or the plain-jnp `oscar_jax.attention_ops.merge_partials`
(prefill) turns all partials into the exact softmax over the union.

* `bf16_tier_partials`: the sink and recent pages (BF16). One page table per sequence: slots
  [0, sink_slots) are the sink pages (`sink_tokens` valid tokens, filling pages in order), the
  following slots the recent pages (`recent_tokens` valid tokens, in order).
* `int2_tier_partials`: the history pages (INT2, format v1). Nothing is dequantized into a tile:
  with x̂ = m + c·s per group of `group_size` channels (m, s the fp16 minimum and scale of the group),
      q·x̂     = Σ_groups  s·(q_group · c_group) + m·Σ q_group    (K scale and min into the scores)
      Σ_n p·v̂ = Σ_n (p·s_v)·c_v + (Σ_n p·m_v)                    (V scale into the probabilities)
  so the inner products run on the raw 2-bit codes (exact in bf16 and f32), one `dot` per
  (byte chunk, bit plane): quartered packing puts channels [plane·D/4 + j, …) in bits
  2·plane … 2·plane + 1 of bytes j …, so each bit plane of a byte chunk is a contiguous run of
  channels and lies inside one group.

Both kernels handle all query rows of one KV head together (GQA: the Gq query heads of a KV head,
padded to ≥ 16 rows for `dot`; prefill: T·Gq rows), so each K/V tile is loaded once per row block.

Lowering choice: `pl.pallas_call` with the Triton lowering (`jax.experimental.pallas.triton`),
as the codec kernels. It is deprecated since jax 0.11 but compiles on the H200, has `jnp.dot`
(tensor cores for bf16, IEEE fp32 otherwise) and accepts 8-bit loads widened to int32; Mosaic
GPU has no `jnp.dot` and rejects 8-bit arithmetic (DESIGN.md §4). The kernels keep to the Triton
lowering's rules even though interpret mode would not enforce them: power-of-two value shapes,
dots with M, N, K ≥ 16, uint8 widened to int32 before shifts, static shapes with dynamic loop
trip counts, scalar reads of lengths from refs, page gathers as integer-array indexing of refs.
(The decode INT2 tier's scores with tokens on M have N = 8: XLA's Triton pads it to mma's n8 —
compiled and checked on the H200.)

Robustness: a page-table entry that does not hold a valid token is never dereferenced (its page
id is replaced by 0 before the gather), V rows and INT2 metadata of masked tokens are zeroed
(stale pool memory may hold NaN), masked scores are a finite large negative value, and a split
with no valid token writes o = 0, lse = −inf so the merge weighs it zero.

Dimension vocabulary of the shape comments: B batch, K KV heads, M query rows of one KV head,
D head dim, P pages of a pool, L page size, N tokens of one block, S splits, NB/NH table slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from oscar_jax.kernels import register_cap
from oscar_jax.kernels.layered import layer_block_spec, per_layer_shape
from shared_math.ptx import (
    BITS_PER_BYTE, BYTES_PER_PAIR, PAIR_UNPACK_CONSTRAINTS, PAIR_UNPACK_PACK, UNPACK_CONSTRAINTS, UNPACK_PACK,
    plane_factor, plane_mask, plane_shift, unpack_pair_plane_ptx, unpack_plane_ptx,
)
from shared_math.spec import BF16_CODE_BIAS, BF16_CODE_BIAS_BITS, CODE_BITS, CODE_MASK, CODES_PER_BYTE
from shared_math.tiling import (
    CHANNELS_PER_PAIR_ROW, LN2, MERGE_BLOCK_D, MERGE_BLOCK_SPLITS, base2_score_scale, check_max_registers,
    int2_decode_channels_on_m, next_power_of_two, num_splits,
)

# Scores of masked tokens. Finite (not −inf), so that a block with no valid token keeps the
# running maximum finite and exp(m_old − m_new) never becomes exp(−inf + inf) = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# `dot` in the Triton lowering needs M, N, K ≥ 16 (mma tile); blocks are sized to respect it.
MIN_DOT_DIM = 16


def cdiv(a, b):
    return (a + b - 1) // b


def _precision(a, b):
    # float32 operands: IEEE float32 on the GPU. Precision.DEFAULT lowers to TF32 in the Triton
    # lowering, which the H200 parity run measured at 2.4e-4 … 3.7e-3 error (f32 tolerance 2e-5).
    f32 = jnp.dtype(jnp.float32)
    return lax.Precision.HIGHEST if f32 in (jnp.dtype(a.dtype), jnp.dtype(b.dtype)) else lax.Precision.DEFAULT


def dot_nt(a, b):
    """a [M, C] · b [N, C]ᵀ → [M, N] float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, C] · b [C, N] → [M, N] float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a [C, M]ᵀ · b [C, N] → [M, N] float32 accumulation."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


# XLA compiles a Pallas kernel's Triton IR without contracting a·b + c into one FFMA (Triton's
# own compile does: the INT2 decode loop's SASS under ncu held separate FMULs and FADDs where
# Triton's held FFMAs), so the kernels spell the hot multiply-adds as one fma by inline PTX when
# they run compiled (benchmarks/DECISIONS.md D14).
FMA_PTX = "fma.rn.f32 $0, $1, $2, $3;"
FMA_CONSTRAINTS = "=f,f,f,f"


def multiply_add(a, b, c, fused: bool):
    """a·b + c of float32 arrays (broadcast together): one rounding by inline PTX with `fused`
    (compiled kernels only: interpret mode cannot run PTX), else the two-rounding a·b + c."""
    if not fused:
        return a * b + c
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b), jnp.shape(c))
    args = [jnp.broadcast_to(x, shape) for x in (a, b, c)]
    return pl_triton.elementwise_inline_asm(
        FMA_PTX, args=args, constraints=FMA_CONSTRAINTS, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])[0]


def online_softmax_step(scores, valid, m_prev, l_prev):
    """One online-softmax step on a [M, N] score tile in base-2 units (`shared_math.tiling.base2_score_scale`); `valid`
    broadcasts to [M, N].

    Returns (p, correction, m_new, l_new). Masked entries get p = 0 exactly, even while a row
    has seen no valid score yet (then m stays MASK_VALUE and exp2(scores − m) would be 1).
    """
    scores = jnp.where(valid, scores, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1))
    correction = jnp.exp2(m_prev - m_new)
    p = jnp.where(valid, jnp.exp2(scores - m_new[:, None]), 0.0)
    l_new = l_prev * correction + jnp.sum(p, axis=1)
    return p, correction, m_new, l_new


def finalize_rows(l, m):
    """Normaliser and natural log-sum-exp of the finished rows (m in base-2 units); empty rows
    get lse = −inf."""
    nonempty = l > 0.0
    inv_l = 1.0 / jnp.where(nonempty, l, 1.0)
    lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * LN2, -jnp.inf)
    return inv_l, lse


# --------------------------------------------------------------------------------------------
# BF16 tier: sink + recent pages.
# --------------------------------------------------------------------------------------------


def _bf16_tier_kernel(
    page_table_ref,  # [S·PAGES_PER_SPLIT] int32: the BF16 slots of sequence b (padded)
    sink_tokens_ref,  # [B] int32
    recent_tokens_ref,  # [B] int32
    q_ref,  # [BLOCK_M, D] compute dtype: query rows of KV head h
    k_ref,  # [P, L, D] bf16: the K pool of KV head h
    v_ref,  # [P, L, D] bf16: the V pool of KV head h
    o_ref,  # [BLOCK_M, D] float32: normalised partial output of this split
    lse_ref,  # [BLOCK_M] float32: its log-sum-exp (−inf when the split holds no token)
    *,
    SINK_SLOTS: int,
    PAGE_SIZE: int,
    PAGES_PER_SPLIT: int,
    PAGES_PER_BLOCK: int,
    SCORE_SCALE: float,
):
    b, split = pl.program_id(0), pl.program_id(3)
    block_m, head_dim = q_ref.shape
    block_n = PAGES_PER_BLOCK * PAGE_SIZE
    compute_dtype = q_ref.dtype

    n_sink = sink_tokens_ref[b]
    n_recent = recent_tokens_ref[b]
    recent_pages = cdiv(n_recent, PAGE_SIZE)
    # One past the last slot holding a token: the loop stops there (slots beyond are never read).
    slot_end = jnp.where(recent_pages > 0, SINK_SLOTS + recent_pages, cdiv(n_sink, PAGE_SIZE))
    first_slot = split * PAGES_PER_SPLIT
    last_slot = jnp.minimum(first_slot + PAGES_PER_SPLIT, slot_end)
    num_blocks = jnp.maximum(cdiv(last_slot - first_slot, PAGES_PER_BLOCK), 0)

    token = lax.iota(jnp.int32, block_n)
    offset = token % PAGE_SIZE  # [N] position inside its page
    slot_in_block = token // PAGE_SIZE  # [N]
    q = q_ref[...]  # [BLOCK_M, D]

    def body(i, carry):
        o, m, l = carry
        slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
        is_sink = slot < SINK_SLOTS
        position = jnp.where(is_sink, slot, slot - SINK_SLOTS) * PAGE_SIZE + offset
        valid = position < jnp.where(is_sink, n_sink, n_recent)  # [N]
        page = jnp.where(valid, page_table_ref[slot], 0)  # [N] never dereference unused slots
        k = k_ref[page, offset, :].astype(compute_dtype)  # [N, D]
        v = v_ref[page, offset, :]  # [N, D]
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v)).astype(compute_dtype)
        scores = dot_nt(q, k) * SCORE_SCALE  # [BLOCK_M, N]
        p, correction, m, l = online_softmax_step(scores, valid[None, :], m, l)
        o = o * correction[:, None] + dot_nn(p.astype(compute_dtype), v)
        return o, m, l

    carry = (
        jnp.zeros((block_m, head_dim), jnp.float32),
        jnp.full((block_m,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    o, m, l = lax.fori_loop(0, num_blocks, body, carry)
    inv_l, lse = finalize_rows(l, m)
    o_ref[...] = o * inv_l[:, None]
    lse_ref[...] = lse


def bf16_tier_partials(
    q,  # [B, K, M, D] compute dtype (float32 or bfloat16), M a multiple of block_m
    k_bf16,  # [P, K, L, D] bfloat16
    v_bf16,  # [P, K, L, D] bfloat16
    page_table,  # [B, NB] int32
    sink_tokens,  # [B] int32
    recent_tokens,  # [B] int32
    *,
    sink_slots: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int,
    block_m: int,
    interpret: bool,
    num_warps: int = 4,
    num_stages: int = 2,
    layer: int | None = None,
):
    """Partials over the BF16 tier: (o float32[B, K, S, M, D], lse float32[B, K, S, M]).

    With `layer`, the pools are stacked [Y, P, K, L, D] and layer `layer` is read (kernels.layered).
    Inputs are validated by the public op; the asserts guard internal invariants only.
    """
    batch, num_kv_heads, rows, head_dim = q.shape
    num_pages, _, page_size, _ = per_layer_shape(k_bf16.shape, layer)
    assert rows % block_m == 0 and pages_per_split % pages_per_block == 0
    splits = num_splits(page_table.shape[1], pages_per_split)
    table_len = splits * pages_per_split
    page_table = jnp.pad(page_table, ((0, 0), (0, table_len - page_table.shape[1])))
    kernel = functools.partial(
        _bf16_tier_kernel,
        SINK_SLOTS=sink_slots,
        PAGE_SIZE=page_size,
        PAGES_PER_SPLIT=pages_per_split,
        PAGES_PER_BLOCK=pages_per_block,
        SCORE_SCALE=base2_score_scale(softmax_scale),
    )
    pool_spec = layer_block_spec((num_pages, None, page_size, head_dim), lambda b, h, r, s: (0, h, 0, 0), layer)
    grid = (batch, num_kv_heads, rows // block_m, splits)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, table_len), lambda b, h, r, s: (b, 0)),  # page table of b
            pl.BlockSpec((batch,), lambda b, h, r, s: (0,)),  # sink_tokens (read at b)
            pl.BlockSpec((batch,), lambda b, h, r, s: (0,)),  # recent_tokens (read at b)
            pl.BlockSpec((None, None, block_m, head_dim), lambda b, h, r, s: (b, h, r, 0)),  # q
            pool_spec,  # K pool of KV head h
            pool_spec,  # V pool
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_m, head_dim), lambda b, h, r, s: (b, h, s, r, 0)),  # o
            pl.BlockSpec((None, None, None, block_m), lambda b, h, r, s: (b, h, s, r)),  # lse
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32),
        ],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"oscar_bf16_tier_attention_{block_m=}_{pages_per_split=}_{pages_per_block=}",
    )(page_table, sink_tokens, recent_tokens, q, k_bf16, v_bf16)


# --------------------------------------------------------------------------------------------
# INT2 tier: history pages.
# --------------------------------------------------------------------------------------------


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


def _int2_output_pairs(o_halves, p, pairs, v_scale, v_min, correction, compute_dtype, unpack_asm, fused):
    """Channels on M (one group per row, tokens on M): each of the eight half planes oᵀ [D/8, BLOCK_M]
    (plane p's channels p·D/4 + 2j + h at o_halves[2p + h], in units of the plane's operand factor)
    rescaled by `correction` (None: not rescaled), plus its minimum term, plus Σ_n c·(p·s_v) — the
    codes [D/8, L] the dot's A operand, p·s_v [L, BLOCK_M] its B (the rows on N instead of padded to
    M = 16: half the MMAs and output registers; benchmarks/DECISIONS.md D5). p [L, BLOCK_M]
    unnormalised."""
    code_bias = code_offset(compute_dtype)
    (scale,), (minimum,) = v_scale, v_min
    p_scaled = (p * scale[:, None]).astype(compute_dtype)
    p_min = jnp.sum(p * minimum[:, None], axis=0)
    bias = code_bias * jnp.sum(p_scaled.astype(jnp.float32), axis=0) if code_bias else None
    factors = [plane_factor(plane) if code_bias else 1.0 for plane in range(CODES_PER_BYTE)]  # operand_factors
    out = []
    for index, o_half in enumerate(o_halves):
        plane, high = divmod(index, BYTES_PER_PAIR)
        term = p_min * factors[plane] if factors[plane] != 1.0 else p_min
        term = (term - bias if code_bias else term)[None, :]
        d = dot_nn(_pair_plane_operand(pairs, plane, high, compute_dtype, unpack_asm), p_scaled)
        out.append((o_half + term if correction is None else multiply_add(o_half, correction[None, :], term, fused))
                   + d)
    return out


def _int2_scores(q_pieces, q_group_sums, q_bias_sums, k_planes, k_scale, k_min, pieces, score_scale, fused,
                 tokens_on_m=False):
    """score_scale·(Σ_g s_g·(q_g · c_g) + m_g·Σ q_g) → [BLOCK_M, N] ([N, BLOCK_M] with `tokens_on_m`:
    the codes are the dot's A operand and the query rows its N); k_scale / k_min per group, each [N].
    The code dots carry the bias q_bias_sums (`_int2_query_terms`), subtracted before the scale.
    The score scale goes into the per-token scales and per-row sums (vectors, not the [N, M] tile);
    each group's term is one multiply-add onto the minimum terms (`multiply_add`, `fused`)."""
    code_dots = [None] * len(k_scale)
    for q_piece, plane, (_, _, _, _, group) in zip(q_pieces, k_planes, pieces):
        d = dot_nt(plane(), q_piece) if tokens_on_m else dot_nt(q_piece, plane())
        code_dots[group] = d if code_dots[group] is None else code_dots[group] + d
    row = (lambda x: x[None, :]) if tokens_on_m else (lambda x: x[:, None])  # [BLOCK_M] → the scores' rows
    token = (lambda x: x[:, None]) if tokens_on_m else (lambda x: x[None, :])  # [N] → the scores' tokens
    scores = None
    for group, minimum in enumerate(k_min):  # Σ_g m_g·Σ q_g, scaled
        q_sum = row(q_group_sums[group] * score_scale)
        scores = q_sum * token(minimum) if scores is None else multiply_add(q_sum, token(minimum), scores, fused)
    for group, scale in enumerate(k_scale):
        dots = code_dots[group] - row(q_bias_sums[group]) if q_bias_sums is not None else code_dots[group]
        scores = multiply_add(dots, token(scale * score_scale), scores, fused)
    return scores


def _int2_output_terms(p, v_planes, v_scale, v_min, pieces, compute_dtype, token_axis=1):
    """(Σ_n (p·s_v)·c_v per piece [BLOCK_M, W], Σ_n p·m_v per piece [BLOCK_M]), both in units of
    the piece's operand factor f (`operand_factors`: the output planes are carried as f·o);
    p [BLOCK_M, N] unnormalised (pᵀ [N, BLOCK_M] with token_axis 0: scores with tokens on M).
    The planes hold code_bias + f·c: the minimum term f·Σ_n p·m_v subtracts code_bias·Σ_n (p·s_v)
    of the *rounded* operand, so the bias cancels exactly up to float32 accumulation. Callers add
    the minimum term to the rescaled output *before* the dot (`_accumulate_output`)."""
    code_bias = code_offset(compute_dtype)
    per_token = functools.partial(jnp.expand_dims, axis=1 - token_axis)  # [N] → p's layout
    p_scaled = [(p * per_token(scale)).astype(compute_dtype) for scale in v_scale]
    p_min = [jnp.sum(p * per_token(minimum), axis=token_axis) for minimum in v_min]
    bias = [code_bias * jnp.sum(ps.astype(jnp.float32), axis=token_axis) for ps in p_scaled] if code_bias else None
    p_min_pieces = {}  # (group, factor) → its minimum term, formed once
    for factor, (_, _, _, _, group) in zip(operand_factors(pieces, compute_dtype), pieces):
        if (group, factor) not in p_min_pieces:
            term = p_min[group] * factor if factor != 1.0 else p_min[group]
            p_min_pieces[group, factor] = term - bias[group] if code_bias else term
    dot = dot_tn if token_axis == 0 else dot_nn
    return ([dot(p_scaled[group], plane()) for plane, (_, _, _, _, group) in zip(v_planes, pieces)],
            [p_min_pieces[group, factor]
             for factor, (_, _, _, _, group) in zip(operand_factors(pieces, compute_dtype), pieces)])


def _accumulate_output(o_pieces, dots, p_min, correction, fused):
    """o·correction + Σ p·m_v + dot per piece, summed as (o·correction + Σ p·m_v) + dot: the first
    sum one multiply-add (`multiply_add`; correction None: o + Σ p·m_v), the last add folded by
    Triton into the dot's accumulator (no separate add per element). The bias the dot carries
    (code_bias·Σ p·s_v, ~100× the output when values centre on 0) cancels inside this page's sum.
    Adding Σ p·m_v once at the end instead let the bias grow over a split's pages, and float32
    rounding of the biased sum showed (benchmarks/DECISIONS.md D13)."""
    if correction is None:
        return [(o_piece + piece_min[:, None]) + d for o_piece, d, piece_min in zip(o_pieces, dots, p_min)]
    return [multiply_add(o_piece, correction[:, None], piece_min[:, None], fused) + d
            for o_piece, d, piece_min in zip(o_pieces, dots, p_min)]


def _history_split(n_history, split, page_size, pages_per_split, pages_per_block):
    """(n_history, first_slot, last_slot, num_blocks) of this split of the history table."""
    first_slot = split * pages_per_split
    last_slot = jnp.minimum(first_slot + pages_per_split, cdiv(n_history, page_size))
    return n_history, first_slot, last_slot, jnp.maximum(cdiv(last_slot - first_slot, pages_per_block), 0)


def _int2_metadata(ref, index, valid, num_groups):
    """fp16 scale or minimum per group as float32 [N], zero where invalid (stale memory may be NaN)."""
    return [jnp.where(valid, ref[index + (group,)].astype(jnp.float32), 0.0) for group in range(num_groups)]


def _int2_tier_kernel(
    page_table_ref,  # [S·PAGES_PER_SPLIT] int32: the history slots of sequence b (padded)
    history_tokens_ref,  # [B] int32
    q_ref,  # [BLOCK_M, D] compute dtype: query rows of KV head h
    k_codes_ref,  # [P, L, D/4] uint8: K codes pool of KV head h
    k_scale_ref,  # [P, L, D/GROUP] float16
    k_min_ref,  # [P, L, D/GROUP] float16
    v_codes_ref,  # [P, L, D/4] uint8
    v_scale_ref,  # [P, L, D/GROUP] float16
    v_min_ref,  # [P, L, D/GROUP] float16
    o_ref,  # [BLOCK_M, D] float32: normalised partial output of this split
    lse_ref,  # [BLOCK_M] float32
    *,
    GROUP_SIZE: int,
    PAGE_SIZE: int,
    PAGES_PER_SPLIT: int,
    PAGES_PER_BLOCK: int,
    SCORE_SCALE: float,
    UNPACK_ASM: bool = False,
    FMA_ASM: bool = False,
    TOKENS_ON_M: bool = False,
    CHANNELS_ON_M: bool = False,
):
    """One iteration = PAGES_PER_BLOCK pages, each read as a whole page through a scalar page id
    (contiguous [L, D/4] codes, no per-token addresses), one online-softmax update for all of them.
    Needs L ≥ 16 (dot tile); `_int2_tier_gather_kernel` serves smaller pages. TOKENS_ON_M: the
    scores as [L, BLOCK_M] (codes as the dot's A operand), the softmax along axis 0. CHANNELS_ON_M
    (with TOKENS_ON_M, one group per row): v_codes_ref holds the V codes as 16-bit pairs
    [P, L, D/8] and the output is carried as eight half planes oᵀ (`_int2_output_pairs`)."""
    b, split = pl.program_id(0), pl.program_id(3)
    block_m, head_dim = q_ref.shape
    compute_dtype = q_ref.dtype
    num_groups = head_dim // GROUP_SIZE
    pieces = int2_pieces(head_dim, GROUP_SIZE)

    n_history, first_slot, last_slot, num_blocks = _history_split(
        history_tokens_ref[b], split, PAGE_SIZE, PAGES_PER_SPLIT, PAGES_PER_BLOCK)
    offset = lax.iota(jnp.int32, PAGE_SIZE)  # [L]
    q_pieces, q_group_sums, q_bias_sums = _int2_query_terms(q_ref, pieces, num_groups)

    def body(i, carry):
        o_pieces, m, l = carry
        pages = []
        for j in range(PAGES_PER_BLOCK):  # static: the pages' loads are independent
            slot = first_slot + i * PAGES_PER_BLOCK + j
            valid = slot * PAGE_SIZE + offset < n_history  # [L]
            page = jnp.where(slot < last_slot, page_table_ref[slot], 0)  # never dereference unused slots
            k_planes = _code_planes(lambda c0, w: k_codes_ref[page, :, pl.ds(c0, w)], pieces, compute_dtype,
                                     UNPACK_ASM)
            k_scale = _int2_metadata(k_scale_ref, (page, slice(None)), valid, num_groups)
            k_min = _int2_metadata(k_min_ref, (page, slice(None)), valid, num_groups)
            scores = _int2_scores(q_pieces, q_group_sums, q_bias_sums, k_planes, k_scale, k_min, pieces,
                                  SCORE_SCALE, FMA_ASM, TOKENS_ON_M)
            mask = valid[:, None] if TOKENS_ON_M else valid[None, :]
            pages.append((page, valid, mask, jnp.where(mask, scores, MASK_VALUE)))
        token_axis = 0 if TOKENS_ON_M else 1
        m_new = m
        for _, _, _, scores in pages:
            m_new = jnp.maximum(m_new, jnp.max(scores, axis=token_axis))
        correction = jnp.exp2(m - m_new)
        l = l * correction
        for page_index, (page, valid, mask, scores) in enumerate(pages):  # the first page rescales o
            row_max = m_new[None, :] if TOKENS_ON_M else m_new[:, None]
            p = jnp.where(mask, jnp.exp2(scores - row_max), 0.0)  # [BLOCK_M, L] ([L, BLOCK_M])
            l = l + jnp.sum(p, axis=token_axis)
            if CHANNELS_ON_M:
                pairs = _code_pairs(v_codes_ref, page, PAGE_SIZE)
            else:
                v_planes = _code_planes(lambda c0, w: v_codes_ref[page, :, pl.ds(c0, w)], pieces, compute_dtype,
                                         UNPACK_ASM)
            v_scale = _int2_metadata(v_scale_ref, (page, slice(None)), valid, num_groups)
            v_min = _int2_metadata(v_min_ref, (page, slice(None)), valid, num_groups)
            if CHANNELS_ON_M:
                o_pieces = _int2_output_pairs(o_pieces, p, pairs, v_scale, v_min,
                                              correction if page_index == 0 else None, compute_dtype, UNPACK_ASM,
                                              FMA_ASM)
                continue
            dots, p_min = _int2_output_terms(p, v_planes, v_scale, v_min, pieces, compute_dtype, token_axis)
            o_pieces = _accumulate_output(o_pieces, dots, p_min, correction if page_index == 0 else None, FMA_ASM)
        return tuple(o_pieces), m_new, l

    _int2_finish(body, num_blocks, pieces, operand_factors(pieces, compute_dtype), o_ref, lse_ref, CHANNELS_ON_M)


def _int2_tier_gather_kernel(
    page_table_ref, history_tokens_ref, q_ref, k_codes_ref, k_scale_ref, k_min_ref, v_codes_ref, v_scale_ref,
    v_min_ref, o_ref, lse_ref, *, GROUP_SIZE: int, PAGE_SIZE: int, PAGES_PER_SPLIT: int, PAGES_PER_BLOCK: int,
    SCORE_SCALE: float, UNPACK_ASM: bool = False, FMA_ASM: bool = False,
):
    """As `_int2_tier_kernel` (same refs), for any page size: one block of PAGES_PER_BLOCK·L ≥ 16
    tokens gathered token by token (a page id per token)."""
    b, split = pl.program_id(0), pl.program_id(3)
    block_m, head_dim = q_ref.shape
    block_n = PAGES_PER_BLOCK * PAGE_SIZE
    compute_dtype = q_ref.dtype
    num_groups = head_dim // GROUP_SIZE
    pieces = int2_pieces(head_dim, GROUP_SIZE)

    n_history, first_slot, last_slot, num_blocks = _history_split(
        history_tokens_ref[b], split, PAGE_SIZE, PAGES_PER_SPLIT, PAGES_PER_BLOCK)
    token = lax.iota(jnp.int32, block_n)
    offset = token % PAGE_SIZE  # [N]
    slot_in_block = token // PAGE_SIZE  # [N]
    q_pieces, q_group_sums, q_bias_sums = _int2_query_terms(q_ref, pieces, num_groups)

    def body(i, carry):
        o_pieces, m, l = carry
        slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
        valid = slot * PAGE_SIZE + offset < n_history  # [N]
        page = jnp.where(valid, page_table_ref[slot], 0)  # [N] never dereference unused slots
        k_planes = _code_planes(lambda c0, w: k_codes_ref[page, offset, pl.ds(c0, w)], pieces, compute_dtype,
                                 UNPACK_ASM)
        k_scale = _int2_metadata(k_scale_ref, (page, offset), valid, num_groups)
        k_min = _int2_metadata(k_min_ref, (page, offset), valid, num_groups)
        scores = _int2_scores(q_pieces, q_group_sums, q_bias_sums, k_planes, k_scale, k_min, pieces, SCORE_SCALE,
                              FMA_ASM)
        p, correction, m, l = online_softmax_step(scores, valid[None, :], m, l)
        v_planes = _code_planes(lambda c0, w: v_codes_ref[page, offset, pl.ds(c0, w)], pieces, compute_dtype,
                                 UNPACK_ASM)
        v_scale = _int2_metadata(v_scale_ref, (page, offset), valid, num_groups)
        v_min = _int2_metadata(v_min_ref, (page, offset), valid, num_groups)
        dots, p_min = _int2_output_terms(p, v_planes, v_scale, v_min, pieces, compute_dtype)
        return tuple(_accumulate_output(o_pieces, dots, p_min, correction, FMA_ASM)), m, l

    _int2_finish(body, num_blocks, pieces, operand_factors(pieces, compute_dtype), o_ref, lse_ref)


def _int2_finish(body, num_blocks, pieces, factors, o_ref, lse_ref, channels_on_m=False):
    """Run the online-softmax loop from an empty state and write the normalised partial (the
    output pieces, carried in units of their operand factor, divided by it here). channels_on_m:
    the pieces (one a plane) are carried as two half planes oᵀ each (`_int2_output_pairs`) and
    stored to every other channel."""
    block_m = o_ref.shape[0]
    shapes = ([(width // BYTES_PER_PAIR, block_m)] * BYTES_PER_PAIR if channels_on_m else [(block_m, width)]
              for (_, width, _, _, _) in pieces)
    carry = (
        tuple(jnp.zeros(shape, jnp.float32) for piece_shapes in shapes for shape in piece_shapes),
        jnp.full((block_m,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    o_pieces, m, l = lax.fori_loop(0, num_blocks, body, carry)
    inv_l, lse = finalize_rows(l, m)
    for index, (factor, (_, width, _, c0, _)) in enumerate(zip(factors, pieces)):
        scale = (inv_l * (1.0 / factor) if factor != 1.0 else inv_l)[:, None]
        if channels_on_m:
            for high in range(BYTES_PER_PAIR):
                o_ref[:, pl.ds(c0 + high, width // BYTES_PER_PAIR, stride=BYTES_PER_PAIR)] = (
                    o_pieces[BYTES_PER_PAIR * index + high].T * scale)
        else:
            o_ref[:, pl.ds(c0, width)] = o_pieces[index] * scale
    lse_ref[...] = lse


def int2_tier_partials(
    q,  # [B, K, M, D] compute dtype (float32 or bfloat16), M a multiple of block_m
    k_codes,  # [P, K, L, D/4] uint8
    k_scale,  # [P, K, L, D/G] float16
    k_min,  # [P, K, L, D/G] float16
    v_codes,  # [P, K, L, D/4] uint8
    v_scale,  # [P, K, L, D/G] float16
    v_min,  # [P, K, L, D/G] float16
    page_table,  # [B, NH] int32
    history_tokens,  # [B] int32
    *,
    group_size: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int,
    block_m: int,
    interpret: bool,
    num_warps: int = 4,
    num_stages: int = 2,
    layer: int | None = None,
    unpack_asm: bool = False,
    fma_asm: bool = False,
    tokens_on_m: bool = False,
    rows: int | None = None,
    channels_on_m: bool = False,
    max_registers: int = 0,
):
    """Partials over the INT2 tier: (o float32[B, K, S, rows, D], lse float32[B, K, S, rows]).
    `max_registers` (> 0): the compiled kernel's registers per thread at most (the Triton module's
    `ttg.maxnreg`, `kernels.register_cap`); 0 → the compiler's choice; no effect when interpreted.
    `channels_on_m` (with tokens_on_m, one group per row, D ≥ 128): the values' dot as oᵀ = Vᵀ·p, the
    channels on M and the rows on N, over the V codes read as 16-bit pairs (`_int2_output_pairs`;
    benchmarks/DECISIONS.md D5).
    `rows` (default M, a multiple of block_m): the tier attends q's first `rows` rows, read in place
    by the q block (no slice of q: a slice is a kernel of its own; benchmarks/DECISIONS.md D16).
    With `layer`, the pools are stacked [Y, P, K, L, ·] and layer `layer` is read.
    `tokens_on_m` (pages of ≥ 16 tokens): each page's scores as [L, block_m], the codes the dot's A
    operand, so block_m may be 8 (mma's N) instead of 16; decode runs it at one warp
    (benchmarks/DECISIONS.md D4).
    `unpack_asm`: codes unpacked by inline PTX (bfloat16 q, GPU only; `_unpack_plane_asm`).
    `fma_asm`: the loop's multiply-adds as one fma each by inline PTX (GPU only; `multiply_add`)."""
    batch, num_kv_heads, q_rows, head_dim = q.shape
    rows = q_rows if rows is None else rows
    if not 0 < rows <= q_rows or rows % block_m:
        raise ValueError(f"rows={rows} must be a multiple of block_m={block_m} in (0, {q_rows}] (q's rows)")
    num_pages, _, page_size, packed = per_layer_shape(k_codes.shape, layer)
    num_groups = k_scale.shape[-1]
    assert pages_per_split % pages_per_block == 0
    assert packed * CODES_PER_BYTE == head_dim and num_groups * group_size == head_dim
    splits = num_splits(page_table.shape[1], pages_per_split)
    table_len = splits * pages_per_split
    page_table = jnp.pad(page_table, ((0, 0), (0, table_len - page_table.shape[1])))
    # Whole pages per dot when a page fills a dot tile; otherwise gather tokens into a block.
    whole_pages = page_size >= MIN_DOT_DIM
    if tokens_on_m and not whole_pages:
        raise ValueError(f"tokens_on_m needs pages of >= {MIN_DOT_DIM} tokens (whole-page kernel), got {page_size}")
    pair_rows = packed // BYTES_PER_PAIR  # the values' dot's M with channels_on_m
    if channels_on_m and not int2_decode_channels_on_m(tokens_on_m, group_size, head_dim):
        raise ValueError(f"channels_on_m needs tokens_on_m, one group per row and head_dim >= "
                         f"{MIN_DOT_DIM * CHANNELS_PER_PAIR_ROW} (the dot's M is head_dim / "
                         f"{CHANNELS_PER_PAIR_ROW}); got tokens_on_m={tokens_on_m}, "
                         f"group_size={group_size}, head_dim={head_dim}")
    max_registers = check_max_registers(max_registers)
    if interpret:
        max_registers = 0
    elif max_registers:
        register_cap.install()
    kernel = functools.partial(
        _int2_tier_kernel if whole_pages else _int2_tier_gather_kernel,
        GROUP_SIZE=group_size,
        PAGE_SIZE=page_size,
        PAGES_PER_SPLIT=pages_per_split,
        PAGES_PER_BLOCK=pages_per_block,
        SCORE_SCALE=base2_score_scale(softmax_scale),
        UNPACK_ASM=bool(unpack_asm),
        FMA_ASM=bool(fma_asm),
        **({"TOKENS_ON_M": bool(tokens_on_m)} if whole_pages else {}),
        **({"CHANNELS_ON_M": True} if channels_on_m else {}),
    )
    codes_spec = layer_block_spec((num_pages, None, page_size, packed), lambda b, h, r, s: (0, h, 0, 0), layer)
    v_spec = codes_spec
    if channels_on_m:  # the V pool as 16-bit pairs of its bytes: a bitcast, not a copy
        v_codes = lax.bitcast_convert_type(v_codes.reshape(*v_codes.shape[:-1], pair_rows, BYTES_PER_PAIR), jnp.uint16)
        v_spec = layer_block_spec((num_pages, None, page_size, pair_rows), lambda b, h, r, s: (0, h, 0, 0), layer)
    meta_spec = layer_block_spec((num_pages, None, page_size, num_groups), lambda b, h, r, s: (0, h, 0, 0), layer)
    grid = (batch, num_kv_heads, rows // block_m, splits)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, table_len), lambda b, h, r, s: (b, 0)),  # page table of b
            pl.BlockSpec((batch,), lambda b, h, r, s: (0,)),  # history_tokens (read at b)
            pl.BlockSpec((None, None, block_m, head_dim), lambda b, h, r, s: (b, h, r, 0)),  # q
            codes_spec,  # K codes pool of KV head h
            meta_spec,  # K scale
            meta_spec,  # K minimum
            v_spec,  # V codes (16-bit pairs with channels_on_m)
            meta_spec,  # V scale
            meta_spec,  # V minimum
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_m, head_dim), lambda b, h, r, s: (b, h, s, r, 0)),  # o
            pl.BlockSpec((None, None, None, block_m), lambda b, h, r, s: (b, h, s, r)),  # lse
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32),
        ],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=register_cap.capped_name(
            f"oscar_int2_tier_attention_{group_size=}_{block_m=}_{pages_per_split=}_{pages_per_block=}"
            + ("_asm" if unpack_asm else "") + ("_fma" if fma_asm else "") + ("_pairs" if channels_on_m else ""),
            max_registers),
    )(page_table, history_tokens, q, k_codes, k_scale, k_min, v_codes, v_scale, v_min)


# --------------------------------------------------------------------------------------------
# Merge: the exact softmax over every tier's splits, in one program per kept query row.
# --------------------------------------------------------------------------------------------


def _merge_tiers_kernel(*refs, SPLITS, BLOCK_SPLITS):
    """refs = (o_1, lse_1, …, o_T, lse_T, out): o_t [S_t, BLOCK_D], lse_t [S_t] of one (b, KV head,
    kept row, column block); out [BLOCK_D]. `merge_partials` over all tiers' splits without
    concatenating them: two passes (max lse, then the weighted sum), loads of power-of-two chunks
    masked at S_t."""
    *tier_refs, out_ref = refs
    # Splits per load: a power of two (a Triton tensor size), no larger than the tier needs.
    tiers = [(tier_refs[2 * t], tier_refs[2 * t + 1], splits, min(BLOCK_SPLITS, next_power_of_two(splits)))
             for t, splits in enumerate(SPLITS)]

    def chunk(o_ref, lse_ref, splits, block, i, with_o):
        s = i * block + lax.iota(jnp.int32, block)
        inside = s < splits
        lse = pl_triton.load(lse_ref.at[pl.ds(i * block, block)], mask=inside, other=-jnp.inf)
        if not with_o:
            return lse
        o = pl_triton.load(o_ref.at[pl.ds(i * block, block), :], mask=inside[:, None], other=0.0)
        return lse, o

    lse_max = jnp.float32(-jnp.inf)
    for o_ref, lse_ref, splits, block in tiers:
        lse_max = lax.fori_loop(
            0, cdiv(splits, block),
            lambda i, m, o_ref=o_ref, lse_ref=lse_ref, splits=splits, block=block: jnp.maximum(
                m, jnp.max(chunk(o_ref, lse_ref, splits, block, i, with_o=False))),
            lse_max)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)  # every split empty: all weights 0

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    total = jnp.float32(0.0)
    for o_ref, lse_ref, splits, block in tiers:
        def body(i, carry, o_ref=o_ref, lse_ref=lse_ref, splits=splits, block=block):
            acc, total = carry
            lse, o = chunk(o_ref, lse_ref, splits, block, i, with_o=True)
            weight = jnp.exp(lse - lse_max)  # 0 for empty splits (lse = −inf)
            # where, not a product: an empty split's o may hold anything (0 · NaN = NaN).
            acc = acc + jnp.sum(jnp.where(weight[:, None] > 0.0, weight[:, None] * o, 0.0), axis=0)
            return acc, total + jnp.sum(weight)
        acc, total = lax.fori_loop(0, cdiv(splits, block), body, (acc, total))
    out_ref[...] = acc / jnp.where(total > 0.0, total, 1.0)


def merge_tier_partials(
    tiers, valid_rows: int, *, interpret: bool, block_splits: int = MERGE_BLOCK_SPLITS,
    block_d: int | None = None, num_warps: int = 4,
):
    """Merge the partials of several tiers into o float32[B, K, valid_rows, D].

    tiers: (o float32[B, K, S_t, M_t, D], lse float32[B, K, S_t, M_t]) per tier, same B, K, D, any
    S_t ≥ 1 and M_t ≥ valid_rows; rows [0, valid_rows) are kept (GQA padding rows are never read).
    Equals `attention_ops.merge_partials` of the concatenation; rows every split left empty get 0.
    """
    batch, num_kv_heads, _, _, head_dim = tiers[0][0].shape
    # None: MERGE_BLOCK_D columns per program on the GPU (parallelism); whole rows in interpret
    # mode, which runs programs one after another.
    block_d = min(block_d or (head_dim if interpret else MERGE_BLOCK_D), head_dim)
    assert 0 < valid_rows and block_splits & (block_splits - 1) == 0 and head_dim % block_d == 0 and all(
        o.shape[:2] == (batch, num_kv_heads) and o.shape[3] >= valid_rows and o.shape[4] == head_dim
        and o.shape[2] >= 1 for o, _ in tiers)
    in_specs, operands = [], []
    for o, lse in tiers:
        splits = o.shape[2]
        in_specs += [
            pl.BlockSpec((None, None, splits, None, block_d), lambda b, h, r, c: (b, h, 0, r, c)),
            pl.BlockSpec((None, None, splits, None), lambda b, h, r, c: (b, h, 0, r)),
        ]
        operands += [o, lse]
    splits = tuple(o.shape[2] for o, _ in tiers)
    return pl.pallas_call(
        functools.partial(_merge_tiers_kernel, SPLITS=splits, BLOCK_SPLITS=block_splits),
        grid=(batch, num_kv_heads, valid_rows, head_dim // block_d),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, None, block_d), lambda b, h, r, c: (b, h, r, c)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, valid_rows, head_dim), jnp.float32),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="oscar_merge_tiers_" + "_".join(map(str, splits)),
    )(*operands)
