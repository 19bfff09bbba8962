"""The INT2 tier's split-K kernels (the history pages) and their launcher: one kernel reading whole
pages (rows or tokens on the scores' M; the values' dot with the rows or the channels on M; keys per
token, format v1, or per channel and page, format v2) and one gathering tokens for pages smaller
than a dot tile (format v1)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from oscar_jax.kernels import register_cap
from oscar_jax.kernels.decode_attention.common import (
    MASK_VALUE, MIN_DOT_DIM, cdiv, dot_nn, dot_nt, dot_tn, finalize_rows, multiply_add, online_softmax_step,
    partials_outputs,
)
from oscar_jax.kernels.decode_attention.int2_planes import (
    _code_pairs, _code_planes, _int2_query_terms, _pair_plane_operand, code_offset, int2_pieces, operand_factors,
)
from oscar_jax.kernels.layered import flat_pool, layer_page_base, layer_page_base_spec, per_layer_shape
from shared_math.ptx import BYTES_PER_PAIR, plane_factor
from shared_math.spec import CODES_PER_BYTE
from shared_math.tiling import (
    CHANNELS_PER_PAIR_ROW, base2_score_scale, check_max_registers, int2_decode_channels_on_m, num_splits,
)


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


def _channel_key_scores(q_ref, k_planes, k_scale_ref, k_min_ref, page, pieces, score_scale, tokens_on_m):
    """Format v2 (FORMAT.md § Format v2): a page's keys per channel, k̂_tc = m_c + c_tc·s_c, so a
    score is (q ⊙ s)·c_t + q·m — the query scaled by the page's channel scales against the codes,
    plus one bias per row. The scaled query is float32 where v1's query is exact in the operand
    dtype: with bfloat16 operands it goes in as two (a rounded part and the rounded rest, 2⁻¹⁶
    relative error instead of 2⁻⁸'s, which would exceed the bfloat16 tolerance on keys of a large
    spread), each divided by the piece's operand factor (`operand_factors`); the code bias each
    dot carries is taken off with the sum of that rounded operand, so it cancels up to float32
    accumulation. → [BLOCK_M, L] ([L, BLOCK_M] with tokens_on_m), times score_scale."""
    compute_dtype = q_ref.dtype
    code_bias = code_offset(compute_dtype)
    scores, bias = None, None
    for factor, plane, (_, width, _, c0, _) in zip(operand_factors(pieces, compute_dtype), k_planes, pieces):
        q = q_ref[:, pl.ds(c0, width)].astype(jnp.float32)  # [BLOCK_M, W] (loaded by piece: no slices of values)
        term = jnp.sum(q * k_min_ref[page, pl.ds(c0, width)].astype(jnp.float32)[None, :], axis=1)  # q·m
        bias = term if bias is None else bias + term
        scaled = q * k_scale_ref[page, pl.ds(c0, width)].astype(jnp.float32)[None, :]
        scaled = scaled * (1.0 / factor) if factor != 1.0 else scaled
        high = scaled.astype(compute_dtype)
        operands = [high] if jnp.dtype(compute_dtype) == jnp.dtype(jnp.float32) else [
            high, (scaled - high.astype(jnp.float32)).astype(compute_dtype)]
        codes = plane()
        for operand in operands:
            d = dot_nt(codes, operand) if tokens_on_m else dot_nt(operand, codes)
            if code_bias:
                offset = code_bias * jnp.sum(operand.astype(jnp.float32), axis=1)  # [BLOCK_M]
                d = d - (offset[None, :] if tokens_on_m else offset[:, None])
            scores = d if scores is None else scores + d
    row_bias = bias[None, :] if tokens_on_m else bias[:, None]
    return (scores + row_bias) * score_scale


def _int2_metadata(ref, index, valid, num_groups):
    """fp16 scale or minimum per group as float32 [N], zero where invalid (stale memory may be NaN)."""
    return [jnp.where(valid, ref[index + (group,)].astype(jnp.float32), 0.0) for group in range(num_groups)]


def _int2_tier_kernel(
    page_table_ref,  # [S·PAGES_PER_SPLIT] int32: the history slots of sequence b (padded)
    history_tokens_ref,  # [B] int32
    page_base_ref,  # [1] int32: the layer's first page in the pools (kernels.layered)
    q_ref,  # [BLOCK_M, D] compute dtype: query rows of KV head h
    k_codes_ref,  # [Y·P, L, D/4] uint8: K codes pool of KV head h
    k_scale_ref,  # [Y·P, L, D/GROUP] float16
    k_min_ref,  # [Y·P, L, D/GROUP] float16
    v_codes_ref,  # [Y·P, L, D/4] uint8
    v_scale_ref,  # [Y·P, L, D/GROUP] float16
    v_min_ref,  # [Y·P, L, D/GROUP] float16
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
    CHANNEL_KEYS: bool = False,
):
    """One iteration = PAGES_PER_BLOCK pages, each read as a whole page through a scalar page id
    (contiguous [L, D/4] codes, no per-token addresses), one online-softmax update for all of them.
    Needs L ≥ 16 (dot tile); `_int2_tier_gather_kernel` serves smaller pages. TOKENS_ON_M: the
    scores as [L, BLOCK_M] (codes as the dot's A operand), the softmax along axis 0. CHANNELS_ON_M
    (with TOKENS_ON_M, one group per row): v_codes_ref holds the V codes as 16-bit pairs
    [P, L, D/8] and the output is carried as eight half planes oᵀ (`_int2_output_pairs`).
    CHANNEL_KEYS (format v2): k_scale_ref / k_min_ref are [Y·P, D], one row per page
    (`_channel_key_scores`); the values as format v1."""
    b, split = pl.program_id(0), pl.program_id(3)
    block_m, head_dim = q_ref.shape
    compute_dtype = q_ref.dtype
    num_groups = head_dim // GROUP_SIZE
    pieces = int2_pieces(head_dim, GROUP_SIZE)

    n_history, first_slot, last_slot, num_blocks = _history_split(
        history_tokens_ref[b], split, PAGE_SIZE, PAGES_PER_SPLIT, PAGES_PER_BLOCK)
    offset = lax.iota(jnp.int32, PAGE_SIZE)  # [L]
    page_base = page_base_ref[0]
    q_pieces, q_group_sums, q_bias_sums = _int2_query_terms(q_ref, pieces, num_groups)

    def body(i, carry):
        o_pieces, m, l = carry
        pages = []
        for j in range(PAGES_PER_BLOCK):  # static: the pages' loads are independent
            slot = first_slot + i * PAGES_PER_BLOCK + j
            valid = slot * PAGE_SIZE + offset < n_history  # [L]
            page = jnp.where(slot < last_slot, page_table_ref[slot], 0) + page_base  # never dereference unused slots
            k_planes = _code_planes(lambda c0, w: k_codes_ref[page, :, pl.ds(c0, w)], pieces, compute_dtype,
                                     UNPACK_ASM)
            if CHANNEL_KEYS:
                scores = _channel_key_scores(q_ref, k_planes, k_scale_ref, k_min_ref, page, pieces, SCORE_SCALE,
                                             TOKENS_ON_M)
            else:
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
    page_table_ref, history_tokens_ref, page_base_ref, q_ref, k_codes_ref, k_scale_ref, k_min_ref, v_codes_ref, v_scale_ref,
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
    page_base = page_base_ref[0]
    q_pieces, q_group_sums, q_bias_sums = _int2_query_terms(q_ref, pieces, num_groups)

    def body(i, carry):
        o_pieces, m, l = carry
        slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
        valid = slot * PAGE_SIZE + offset < n_history  # [N]
        page = jnp.where(valid, page_table_ref[slot], 0) + page_base  # [N] never dereference unused slots
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
    key_layout: str = "token",
):
    """Partials over the INT2 tier: (o float32[B, K, S, rows, D], lse float32[B, K, S, rows]).
    `key_layout` "channel" (format v2): k_scale / k_min are [P, K, D], a scale and minimum per
    channel and page (pages of ≥ 16 tokens: the whole-page kernel).
    `max_registers` (> 0): the compiled kernel's registers per thread at most (the Triton module's
    `ttg.maxnreg`, through the opt-in `kernels.register_cap`: a ValueError unless opted in); 0 → the
    compiler's choice; no effect when interpreted.
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
    _, _, page_size, packed = per_layer_shape(k_codes.shape, layer)
    channel_keys = key_layout == "channel"
    num_groups = v_scale.shape[-1]
    assert pages_per_split % pages_per_block == 0
    assert packed * CODES_PER_BYTE == head_dim and num_groups * group_size == head_dim
    splits = num_splits(page_table.shape[1], pages_per_split)
    table_len = splits * pages_per_split
    page_table = jnp.pad(page_table, ((0, 0), (0, table_len - page_table.shape[1])))
    # Whole pages per dot when a page fills a dot tile; otherwise gather tokens into a block.
    whole_pages = page_size >= MIN_DOT_DIM
    if tokens_on_m and not whole_pages:
        raise ValueError(f"tokens_on_m needs pages of >= {MIN_DOT_DIM} tokens (whole-page kernel), got {page_size}")
    if channel_keys and not whole_pages:
        raise ValueError(f"key_layout='channel' needs pages of >= {MIN_DOT_DIM} tokens (whole-page kernel), "
                         f"got {page_size}")
    pair_rows = packed // BYTES_PER_PAIR  # the values' dot's M with channels_on_m
    if channels_on_m and not int2_decode_channels_on_m(tokens_on_m, group_size, head_dim):
        raise ValueError(f"channels_on_m needs tokens_on_m, one group per row and head_dim >= "
                         f"{MIN_DOT_DIM * CHANNELS_PER_PAIR_ROW} (the dot's M is head_dim / "
                         f"{CHANNELS_PER_PAIR_ROW}); got tokens_on_m={tokens_on_m}, "
                         f"group_size={group_size}, head_dim={head_dim}")
    max_registers = check_max_registers(max_registers)
    if interpret:  # no effect when interpreted
        max_registers = 0
    register_cap.require(max_registers)  # a compiled cap needs the opt-in hook: ValueError without it
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
        **({"CHANNEL_KEYS": True} if channel_keys else {}),
    )
    page_base = layer_page_base(k_codes.shape, layer)
    k_codes, k_scale, k_min, v_codes, v_scale, v_min = (
        flat_pool(pool, layer) for pool in (k_codes, k_scale, k_min, v_codes, v_scale, v_min))
    num_pages = k_codes.shape[0]  # of every layer
    codes_spec = pl.BlockSpec((num_pages, None, page_size, packed), lambda b, h, r, s: (0, h, 0, 0))
    v_spec = codes_spec
    if channels_on_m:  # the V pool as 16-bit pairs of its bytes: a bitcast, not a copy
        v_codes = lax.bitcast_convert_type(v_codes.reshape(*v_codes.shape[:-1], pair_rows, BYTES_PER_PAIR), jnp.uint16)
        v_spec = pl.BlockSpec((num_pages, None, page_size, pair_rows), lambda b, h, r, s: (0, h, 0, 0))
    meta_spec = pl.BlockSpec((num_pages, None, page_size, num_groups), lambda b, h, r, s: (0, h, 0, 0))
    # format v2: one key scale and minimum row per (page, KV head)
    k_meta_spec = (pl.BlockSpec((num_pages, None, head_dim), lambda b, h, r, s: (0, h, 0)) if channel_keys
                   else meta_spec)
    grid = (batch, num_kv_heads, rows // block_m, splits)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, table_len), lambda b, h, r, s: (b, 0)),  # page table of b
            pl.BlockSpec((batch,), lambda b, h, r, s: (0,)),  # history_tokens (read at b)
            layer_page_base_spec(),
            pl.BlockSpec((None, None, block_m, head_dim), lambda b, h, r, s: (b, h, r, 0)),  # q
            codes_spec,  # K codes pool of KV head h
            k_meta_spec,  # K scale
            k_meta_spec,  # K minimum
            v_spec,  # V codes (16-bit pairs with channels_on_m)
            meta_spec,  # V scale
            meta_spec,  # V minimum
        ],
        **partials_outputs(batch, num_kv_heads, splits, rows, head_dim, block_m),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=register_cap.capped_name(
            f"oscar_int2_tier_attention_{group_size=}_{block_m=}_{pages_per_split=}_{pages_per_block=}"
            + ("_asm" if unpack_asm else "") + ("_fma" if fma_asm else "") + ("_pairs" if channels_on_m else "")
            + ("_channel_keys" if channel_keys else ""),
            max_registers),
    )(page_table, history_tokens, page_base, q, k_codes, k_scale, k_min, v_codes, v_scale, v_min)

