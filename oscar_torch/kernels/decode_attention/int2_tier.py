"""The INT2 tier's split-K kernel (the history pages, format v1, folded: the dots on the raw 2-bit
codes) and its launcher. Three layouts of one kernel, by constexpr: the scores with the rows on the
dots' M; with the tokens on M (one-warp decode programs); and with the tokens on M and the values'
dot transposed (the channels on M). Groups narrower than D/4 take `int2_dequantizing`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_torch.kernels.codec import CODES_PER_BYTE_C, interpreting, kernel_view
from oscar_torch.kernels.decode_attention.common import (
    DEFAULT_NUM_STAGES, DEFAULT_NUM_WARPS, MASK_VALUE_C, MIN_DOT_DIM, _output_rows, dot_f32, dot_operand,
    natural_lse, online_softmax_step, partial_rows,
)
from oscar_torch.kernels.decode_attention.int2_dequantizing import _int2_tier_dequantizing_kernel
from oscar_torch.kernels.decode_attention.int2_planes import (
    BITS_PER_BYTE_C, BYTES_PER_PAIR_C, PAIR_UNPACK_CONSTRAINTS_C, PAIR_UNPACK_PACK_C, UNPACK_PAIR_0_HIGH_PTX,
    UNPACK_PAIR_0_LOW_PTX, UNPACK_PAIR_1_HIGH_PTX, UNPACK_PAIR_1_LOW_PTX, UNPACK_PAIR_2_HIGH_PTX,
    UNPACK_PAIR_2_LOW_PTX, UNPACK_PAIR_3_HIGH_PTX, UNPACK_PAIR_3_LOW_PTX, _code_bias, _load_code_pairs,
    _load_packed, _plane_codes, _plane_factor, _plane_metadata, _plane_minimum_terms, _query_plane,
    _store_half_plane, _store_plane, _value_minimum_sums,
)
from shared_math.spec import CODES_PER_BYTE
from shared_math.tiling import CHANNELS_PER_PAIR_ROW, base2_score_scale, int2_decode_channels_on_m, num_splits



@triton.jit
def _plane_scores(q_plane, q_plane_sum, packed, scale_ptr, minimum_ptr, row, valid, PLANE: tl.constexpr,
                  QUARTER: tl.constexpr, GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
                  BF16_DOTS: tl.constexpr, TENSOR_CORES: tl.constexpr, UNPACK_ASM: tl.constexpr):
    """One bit plane's share of q·k̂: s·(q_plane · c_plane) + m·Σ q_plane  → [BLOCK_M, N]; q_plane
    is the query divided by the plane's factor (`_int2_tier_kernel`), q_plane_sum the undivided Σ."""
    codes = _plane_codes(packed, PLANE, BF16_DOTS, TENSOR_CORES, UNPACK_ASM)  # [N, QUARTER]
    scale = _plane_metadata(scale_ptr, row, valid, PLANE, QUARTER, GROUP_SIZE, NUM_GROUPS)
    minimum = _plane_metadata(minimum_ptr, row, valid, PLANE, QUARTER, GROUP_SIZE, NUM_GROUPS)
    dots = dot_f32(q_plane, tl.trans(codes), BF16_DOTS, TENSOR_CORES)
    if BF16_DOTS:  # the planes hold bias + c·factor: the dots carry bias·Σ q_plane
        dots -= (q_plane_sum * (_code_bias(BF16_DOTS) / _plane_factor(PLANE)))[:, None]
    return dots * scale[None, :] + q_plane_sum[:, None] * minimum[None, :]


@triton.jit
def _plane_update(o_plane, correction, p, packed, scale_ptr, minimum_ptr, row, valid, PLANE: tl.constexpr,
                  QUARTER: tl.constexpr, GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
                  BF16_DOTS: tl.constexpr, TENSOR_CORES: tl.constexpr, UNPACK_ASM: tl.constexpr):
    """o_plane [BLOCK_M, D/4] of channels [PLANE·D/4, …), in units of the plane's factor: rescaled,
    plus Σ_n (p·s)·c + Σ_n p·m."""
    codes = _plane_codes(packed, PLANE, BF16_DOTS, TENSOR_CORES, UNPACK_ASM)  # [N, QUARTER]
    scale = _plane_metadata(scale_ptr, row, valid, PLANE, QUARTER, GROUP_SIZE, NUM_GROUPS)
    minimum = _plane_metadata(minimum_ptr, row, valid, PLANE, QUARTER, GROUP_SIZE, NUM_GROUPS)
    p_scaled = dot_operand(p * scale[None, :], BF16_DOTS, TENSOR_CORES)
    p_min, bias = _value_minimum_sums(p, minimum, p_scaled, BF16_DOTS)
    if BF16_DOTS:
        p_min = p_min * _plane_factor(PLANE) - bias  # o_plane in units of the factor
    return (o_plane * correction[:, None] + p_min[:, None]) + dot_f32(p_scaled, codes, BF16_DOTS, TENSOR_CORES)


@triton.jit
def _tokens_on_m_probabilities(packed, k_scale, k_min, v_scale, v_min, valid, q0, q1, q2, q3, q_sum, q_bias, m, l,
                               SCORE_SCALE: tl.constexpr, Q_BF16: tl.constexpr, TENSOR_CORES: tl.constexpr,
                               UNPACK_ASM: tl.constexpr):
    """Tokens on M: a page's scores [N, BLOCK_M] from its key codes `packed` (the codes the dots' A
    operand), one online-softmax step, and what the values' dot takes: the operand p·s_v [N, BLOCK_M],
    Σ p·m_v and the bias (`_value_minimum_sums`). Returns those, the correction, m and l."""
    dots = dot_f32(_plane_codes(packed, 0, Q_BF16, TENSOR_CORES, UNPACK_ASM), tl.trans(q0), Q_BF16, TENSOR_CORES)
    dots += dot_f32(_plane_codes(packed, 1, Q_BF16, TENSOR_CORES, UNPACK_ASM), tl.trans(q1), Q_BF16, TENSOR_CORES)
    dots += dot_f32(_plane_codes(packed, 2, Q_BF16, TENSOR_CORES, UNPACK_ASM), tl.trans(q2), Q_BF16, TENSOR_CORES)
    dots += dot_f32(_plane_codes(packed, 3, Q_BF16, TENSOR_CORES, UNPACK_ASM), tl.trans(q3), Q_BF16, TENSOR_CORES)
    if Q_BF16:
        dots -= q_bias[None, :]
    scores = dots * k_scale[:, None] + k_min[:, None] * q_sum[None, :]  # [N, BLOCK_M]
    p, correction, m, l = online_softmax_step(scores * SCORE_SCALE, valid[:, None], m, l, TOKEN_AXIS=0)
    p_scaled = dot_operand(p * v_scale[:, None], Q_BF16, TENSOR_CORES)
    p_min, bias = _value_minimum_sums(p, v_min, p_scaled, Q_BF16, TOKEN_AXIS=0)
    return p_scaled, p_min, bias, correction, m, l


@triton.jit
def _pair_plane_update(o_half, correction, minimum_term, pairs, p_scaled, PLANE: tl.constexpr, HIGH: tl.constexpr,
                       PAIR_PTX: tl.constexpr, Q_BF16: tl.constexpr, TENSOR_CORES: tl.constexpr,
                       UNPACK_ASM: tl.constexpr):
    """Channels on M: oᵀ [D/8, BLOCK_M] of plane PLANE's channels 2j + HIGH, rescaled, plus
    Σ_n c·(p·s) + the minimum term — the code pairs [D/8, N] (`_load_code_pairs`) the dot's A operand,
    p_scaled [N, BLOCK_M] its B. UNPACK_ASM: the pairs unpacked by PAIR_PTX
    (shared_math.ptx.unpack_pair_plane_ptx(PLANE, HIGH))."""
    if UNPACK_ASM:
        codes = tl.inline_asm_elementwise(PAIR_PTX, PAIR_UNPACK_CONSTRAINTS_C, [pairs], dtype=tl.bfloat16,
                                          is_pure=True, pack=PAIR_UNPACK_PACK_C)
    else:
        byte = (pairs.to(tl.int32) >> (HIGH * BITS_PER_BYTE_C)) & 0xFF
        codes = _plane_codes(byte, PLANE, Q_BF16, TENSOR_CORES)
    return (o_half * correction[None, :] + minimum_term[None, :]) + dot_f32(codes, p_scaled, Q_BF16, TENSOR_CORES)


@triton.jit
def _int2_page_channels_on_m(o0, o1, o2, o3, o4, o5, o6, o7, m, l, k_codes_ptr, k_scale_ptr, k_min_ptr,
                             v_codes_ptr, v_scale_ptr, v_min_ptr, row, valid, columns, q0, q1, q2, q3, q_sum, q_bias,
                             QUARTER: tl.constexpr, SCORE_SCALE: tl.constexpr, Q_BF16: tl.constexpr,
                             TENSOR_CORES: tl.constexpr, UNPACK_ASM: tl.constexpr):
    """`_int2_block_one_group` with tokens on M, the values' dot transposed: oᵀ = Vᵀ·(p·s), the
    channels on M and the 8 query rows on N (instead of the rows padded to M = 16: half the MMAs and
    half the output registers), its codes read as 16-bit pairs, so that ldmatrix.trans can load them
    (one byte a load otherwise). o_{2p + h} [D/8, BLOCK_M] holds plane p's channels 2j + h."""
    packed = _load_packed(k_codes_ptr, row, columns, QUARTER, UNPACK_ASM)  # [N, D/4]
    k_scale = tl.where(valid, tl.load(k_scale_ptr + row).to(tl.float32), 0.0)  # masked rows may be NaN
    k_min = tl.where(valid, tl.load(k_min_ptr + row).to(tl.float32), 0.0)
    v_scale = tl.where(valid, tl.load(v_scale_ptr + row).to(tl.float32), 0.0)
    v_min = tl.where(valid, tl.load(v_min_ptr + row).to(tl.float32), 0.0)
    p_scaled, p_min, bias, correction, m, l = _tokens_on_m_probabilities(
        packed, k_scale, k_min, v_scale, v_min, valid, q0, q1, q2, q3, q_sum, q_bias, m, l, SCORE_SCALE, Q_BF16,
        TENSOR_CORES, UNPACK_ASM)
    min0, min1, min2, min3 = _plane_minimum_terms(p_min, bias, Q_BF16)
    pairs = _load_code_pairs(v_codes_ptr, row, QUARTER)  # [D/8, N]
    o0 = _pair_plane_update(o0, correction, min0, pairs, p_scaled, 0, 0, UNPACK_PAIR_0_LOW_PTX,
                            Q_BF16, TENSOR_CORES, UNPACK_ASM)
    o1 = _pair_plane_update(o1, correction, min0, pairs, p_scaled, 0, 1, UNPACK_PAIR_0_HIGH_PTX,
                            Q_BF16, TENSOR_CORES, UNPACK_ASM)
    o2 = _pair_plane_update(o2, correction, min1, pairs, p_scaled, 1, 0, UNPACK_PAIR_1_LOW_PTX,
                            Q_BF16, TENSOR_CORES, UNPACK_ASM)
    o3 = _pair_plane_update(o3, correction, min1, pairs, p_scaled, 1, 1, UNPACK_PAIR_1_HIGH_PTX,
                            Q_BF16, TENSOR_CORES, UNPACK_ASM)
    o4 = _pair_plane_update(o4, correction, min2, pairs, p_scaled, 2, 0, UNPACK_PAIR_2_LOW_PTX,
                            Q_BF16, TENSOR_CORES, UNPACK_ASM)
    o5 = _pair_plane_update(o5, correction, min2, pairs, p_scaled, 2, 1, UNPACK_PAIR_2_HIGH_PTX,
                            Q_BF16, TENSOR_CORES, UNPACK_ASM)
    o6 = _pair_plane_update(o6, correction, min3, pairs, p_scaled, 3, 0, UNPACK_PAIR_3_LOW_PTX,
                            Q_BF16, TENSOR_CORES, UNPACK_ASM)
    o7 = _pair_plane_update(o7, correction, min3, pairs, p_scaled, 3, 1, UNPACK_PAIR_3_HIGH_PTX,
                            Q_BF16, TENSOR_CORES, UNPACK_ASM)
    return o0, o1, o2, o3, o4, o5, o6, o7, m, l


@triton.jit
def _int2_block_one_group(o0, o1, o2, o3, m, l, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr,
                          v_min_ptr, row, valid, columns, q0, q1, q2, q3, q_sum, q_bias, QUARTER: tl.constexpr,
                          SCORE_SCALE: tl.constexpr, Q_BF16: tl.constexpr, TENSOR_CORES: tl.constexpr,
                          UNPACK_ASM: tl.constexpr, TOKENS_ON_M: tl.constexpr = False):
    """`_int2_block` when G = D: the metadata is loaded, and p·s_v and Σ p·m_v are formed, once per
    token instead of once per plane (the per-plane form cost ~25 % more instructions, sm_90 SASS).
    Each plane is summed as (o·correction + Σ p·m_v) + dot: Triton folds the last add into the dot's
    accumulator, and the code bias the dot carries cancels within the page (as in the Pallas
    kernel's `_accumulate_output`). TOKENS_ON_M: scores and p as [N, BLOCK_M], the codes the dots'
    A operand (one-warp decode programs, 8 query rows: benchmarks/DECISIONS.md D4). The code dots carry
    q_bias (`_int2_block`); the output planes are in units of their factors (`_plane_factor`)."""
    packed = _load_packed(k_codes_ptr, row, columns, QUARTER, UNPACK_ASM)  # [N, D/4]
    k_scale = tl.where(valid, tl.load(k_scale_ptr + row).to(tl.float32), 0.0)  # masked rows may be NaN
    k_min = tl.where(valid, tl.load(k_min_ptr + row).to(tl.float32), 0.0)
    v_scale = tl.where(valid, tl.load(v_scale_ptr + row).to(tl.float32), 0.0)
    v_min = tl.where(valid, tl.load(v_min_ptr + row).to(tl.float32), 0.0)
    if TOKENS_ON_M:
        p_scaled, p_min, bias, correction, m, l = _tokens_on_m_probabilities(
            packed, k_scale, k_min, v_scale, v_min, valid, q0, q1, q2, q3, q_sum, q_bias, m, l, SCORE_SCALE, Q_BF16,
            TENSOR_CORES, UNPACK_ASM)
        p_scaled = tl.trans(p_scaled)  # [BLOCK_M, N]
    else:
        dots = dot_f32(q0, tl.trans(_plane_codes(packed, 0, Q_BF16, TENSOR_CORES, UNPACK_ASM)), Q_BF16, TENSOR_CORES)
        dots += dot_f32(q1, tl.trans(_plane_codes(packed, 1, Q_BF16, TENSOR_CORES, UNPACK_ASM)), Q_BF16, TENSOR_CORES)
        dots += dot_f32(q2, tl.trans(_plane_codes(packed, 2, Q_BF16, TENSOR_CORES, UNPACK_ASM)), Q_BF16, TENSOR_CORES)
        dots += dot_f32(q3, tl.trans(_plane_codes(packed, 3, Q_BF16, TENSOR_CORES, UNPACK_ASM)), Q_BF16, TENSOR_CORES)
        if Q_BF16:
            dots -= q_bias[:, None]
        scores = dots * k_scale[None, :] + q_sum[:, None] * k_min[None, :]
        p, correction, m, l = online_softmax_step(scores * SCORE_SCALE, valid[None, :], m, l)
        p_scaled = dot_operand(p * v_scale[None, :], Q_BF16, TENSOR_CORES)
        p_min, bias = _value_minimum_sums(p, v_min, p_scaled, Q_BF16)
    min0, min1, min2, min3 = _plane_minimum_terms(p_min, bias, Q_BF16)
    packed = _load_packed(v_codes_ptr, row, columns, QUARTER, UNPACK_ASM)
    o0 = (o0 * correction[:, None] + min0[:, None]) + dot_f32(
        p_scaled, _plane_codes(packed, 0, Q_BF16, TENSOR_CORES, UNPACK_ASM), Q_BF16, TENSOR_CORES)
    o1 = (o1 * correction[:, None] + min1[:, None]) + dot_f32(
        p_scaled, _plane_codes(packed, 1, Q_BF16, TENSOR_CORES, UNPACK_ASM), Q_BF16, TENSOR_CORES)
    o2 = (o2 * correction[:, None] + min2[:, None]) + dot_f32(
        p_scaled, _plane_codes(packed, 2, Q_BF16, TENSOR_CORES, UNPACK_ASM), Q_BF16, TENSOR_CORES)
    o3 = (o3 * correction[:, None] + min3[:, None]) + dot_f32(
        p_scaled, _plane_codes(packed, 3, Q_BF16, TENSOR_CORES, UNPACK_ASM), Q_BF16, TENSOR_CORES)
    return o0, o1, o2, o3, m, l


@triton.jit
def _int2_block(i, o0, o1, o2, o3, o4, o5, o6, o7, m, l, page_table_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr,
                v_codes_ptr, v_scale_ptr, v_min_ptr, table_slots, b, h, first_slot, n_history, slot_in_block, offset,
                q0, q1, q2, q3, s0, s1, s2, s3, NUM_HEADS: tl.constexpr, D: tl.constexpr,
                GROUP_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGES_PER_BLOCK: tl.constexpr,
                SCORE_SCALE: tl.constexpr, Q_BF16: tl.constexpr, TENSOR_CORES: tl.constexpr,
                UNPACK_ASM: tl.constexpr, TOKENS_ON_M: tl.constexpr, FULL: tl.constexpr,
                CHANNELS_ON_M: tl.constexpr = False):
    """One block of PAGES_PER_BLOCK history pages: scores, online softmax, the four output planes
    (o0 … o3; o4 … o7 pass through), or with CHANNELS_ON_M the eight half planes of
    `_int2_page_channels_on_m`.
    TOKENS_ON_M: G ≥ D only (`_int2_block_one_group`, the form measured on the H200; the launcher
    refuses it otherwise). FULL: every token of the block is valid (`_full_blocks`): the mask is a
    constant, and its selects fold away."""
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    NUM_GROUPS: tl.constexpr = D // GROUP_SIZE
    if PAGES_PER_BLOCK == 1:  # one whole page through a scalar page id: contiguous, vectorised loads
        page_slot = first_slot + i
        in_page = tl.arange(0, PAGE_SIZE)
        if FULL:
            valid = tl.full((PAGE_SIZE,), 1, tl.int1)
            page = tl.load(page_table_ptr + b * table_slots + page_slot)
        else:
            valid = (page_slot * PAGE_SIZE + in_page < n_history) & (page_slot < table_slots)  # [L]
            page = tl.load(page_table_ptr + b * table_slots + page_slot, mask=page_slot < table_slots, other=0)
        row = (page.to(tl.int64) * NUM_HEADS + h) * PAGE_SIZE + in_page  # [L]
    else:  # a block of several pages, gathered token by token
        slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
        if FULL:
            valid = tl.full((PAGES_PER_BLOCK * PAGE_SIZE,), 1, tl.int1)
            page = tl.load(page_table_ptr + b * table_slots + slot)
        else:
            valid = (slot * PAGE_SIZE + offset < n_history) & (slot < table_slots)  # [N]
            page = tl.load(page_table_ptr + b * table_slots + slot, mask=valid, other=0)
        row = (page.to(tl.int64) * NUM_HEADS + h) * PAGE_SIZE + offset  # [N]
    columns = tl.arange(0, QUARTER)[None, :]
    if GROUP_SIZE >= D:  # one group per row: the four planes share its scale and minimum
        if Q_BF16:  # the bias the code dots carry (q divided by the planes' factors)
            q_bias = (s0 / _plane_factor(0) + s1 / _plane_factor(1)
                      + s2 / _plane_factor(2) + s3 / _plane_factor(3)) * _code_bias(Q_BF16)
        else:
            q_bias = s0  # unused: float32 dots carry no bias
        if CHANNELS_ON_M:
            o0, o1, o2, o3, o4, o5, o6, o7, m, l = _int2_page_channels_on_m(
                o0, o1, o2, o3, o4, o5, o6, o7, m, l, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr,
                v_min_ptr, row, valid, columns, q0, q1, q2, q3, s0 + s1 + s2 + s3, q_bias, QUARTER, SCORE_SCALE,
                Q_BF16, TENSOR_CORES, UNPACK_ASM)
        else:
            o0, o1, o2, o3, m, l = _int2_block_one_group(
                o0, o1, o2, o3, m, l, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr, v_min_ptr,
                row, valid, columns, q0, q1, q2, q3, s0 + s1 + s2 + s3, q_bias, QUARTER, SCORE_SCALE, Q_BF16,
                TENSOR_CORES, UNPACK_ASM, TOKENS_ON_M)
    else:
        packed = _load_packed(k_codes_ptr, row, columns, QUARTER, UNPACK_ASM)  # [N, D/4]
        scores = _plane_scores(q0, s0, packed, k_scale_ptr, k_min_ptr, row, valid, 0,
                               QUARTER, GROUP_SIZE, NUM_GROUPS, Q_BF16, TENSOR_CORES, UNPACK_ASM)
        scores += _plane_scores(q1, s1, packed, k_scale_ptr, k_min_ptr, row, valid, 1,
                                QUARTER, GROUP_SIZE, NUM_GROUPS, Q_BF16, TENSOR_CORES, UNPACK_ASM)
        scores += _plane_scores(q2, s2, packed, k_scale_ptr, k_min_ptr, row, valid, 2,
                                QUARTER, GROUP_SIZE, NUM_GROUPS, Q_BF16, TENSOR_CORES, UNPACK_ASM)
        scores += _plane_scores(q3, s3, packed, k_scale_ptr, k_min_ptr, row, valid, 3,
                                QUARTER, GROUP_SIZE, NUM_GROUPS, Q_BF16, TENSOR_CORES, UNPACK_ASM)
        p, correction, m, l = online_softmax_step(scores * SCORE_SCALE, valid[None, :], m, l)
        packed = _load_packed(v_codes_ptr, row, columns, QUARTER, UNPACK_ASM)
        o0 = _plane_update(o0, correction, p, packed, v_scale_ptr, v_min_ptr, row, valid, 0,
                           QUARTER, GROUP_SIZE, NUM_GROUPS, Q_BF16, TENSOR_CORES, UNPACK_ASM)
        o1 = _plane_update(o1, correction, p, packed, v_scale_ptr, v_min_ptr, row, valid, 1,
                           QUARTER, GROUP_SIZE, NUM_GROUPS, Q_BF16, TENSOR_CORES, UNPACK_ASM)
        o2 = _plane_update(o2, correction, p, packed, v_scale_ptr, v_min_ptr, row, valid, 2,
                           QUARTER, GROUP_SIZE, NUM_GROUPS, Q_BF16, TENSOR_CORES, UNPACK_ASM)
        o3 = _plane_update(o3, correction, p, packed, v_scale_ptr, v_min_ptr, row, valid, 3,
                           QUARTER, GROUP_SIZE, NUM_GROUPS, Q_BF16, TENSOR_CORES, UNPACK_ASM)
    return o0, o1, o2, o3, o4, o5, o6, o7, m, l


@triton.jit
def _full_blocks(n_history, first_slot, last_slot, table_slots, PAGE_SIZE: tl.constexpr,
                 PAGES_PER_BLOCK: tl.constexpr):
    """Blocks of the split [first_slot, last_slot) whose every token is valid: whole pages of the
    history (history_tokens is a multiple of L in a well-formed cache) inside the page table."""
    full_last = tl.minimum(tl.minimum(last_slot, n_history // PAGE_SIZE), table_slots)
    return tl.maximum(full_last - first_slot, 0) // PAGES_PER_BLOCK


@triton.jit
def _int2_tier_kernel(
    page_table_ptr,  # [B, NH] int32: the history pages
    history_tokens_ptr,  # [B] int32 (a multiple of L)
    q_ptr,  # [B, K, M, D] float32, or bfloat16 as int16
    k_codes_ptr,  # [P, K, L, D/4] uint8
    k_scale_ptr,  # [P, K, L, D/G] float16
    k_min_ptr,  # [P, K, L, D/G] float16
    v_codes_ptr,  # [P, K, L, D/4] uint8
    v_scale_ptr,  # [P, K, L, D/G] float16
    v_min_ptr,  # [P, K, L, D/G] float16
    o_ptr,  # [B, K, S, M, D] float32
    lse_ptr,  # [B, K, S, M] float32
    table_slots,  # NH
    NUM_HEADS: tl.constexpr,
    ROWS: tl.constexpr,  # M: rows of the partials, a multiple of BLOCK_M
    Q_ROWS: tl.constexpr,  # rows of q (≤ M): rows beyond are read as zero queries
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
    PAGES_PER_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SCORE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    Q_BF16: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    UNPACK_ASM: tl.constexpr = False,
    TOKENS_ON_M: tl.constexpr = False,
    CHANNELS_ON_M: tl.constexpr = False,
):
    """Folded form (as the Pallas kernel): the dots run on the raw 2-bit codes, one per bit plane
    (quartered packing: plane p of byte j is channel p·D/4 + j, and a plane lies inside one group
    because G ≥ D/4), with the scale and minimum folded into the scores and the probabilities —
    nothing is dequantized, and bfloat16 queries use tensor cores."""
    b, h = tl.program_id(0), tl.program_id(1)
    row_block, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    BLOCK_N: tl.constexpr = PAGES_PER_BLOCK * PAGE_SIZE
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    NUM_GROUPS: tl.constexpr = D // GROUP_SIZE

    n_history = tl.load(history_tokens_ptr + b)
    first_slot = split * PAGES_PER_SPLIT
    last_slot = tl.minimum(first_slot + PAGES_PER_SPLIT, tl.cdiv(n_history, PAGE_SIZE))
    num_blocks = tl.maximum(tl.cdiv(last_slot - first_slot, PAGES_PER_BLOCK), 0)

    token = tl.arange(0, BLOCK_N)
    offset = token % PAGE_SIZE  # [N]
    slot_in_block = token // PAGE_SIZE  # [N]
    q0 = _query_plane(q_ptr, b, h, row_block, 0, NUM_HEADS, Q_ROWS, D, BLOCK_M, Q_BF16)  # [BLOCK_M, D/4]
    q1 = _query_plane(q_ptr, b, h, row_block, 1, NUM_HEADS, Q_ROWS, D, BLOCK_M, Q_BF16)
    q2 = _query_plane(q_ptr, b, h, row_block, 2, NUM_HEADS, Q_ROWS, D, BLOCK_M, Q_BF16)
    q3 = _query_plane(q_ptr, b, h, row_block, 3, NUM_HEADS, Q_ROWS, D, BLOCK_M, Q_BF16)
    s0, s1, s2, s3 = tl.sum(q0, axis=1), tl.sum(q1, axis=1), tl.sum(q2, axis=1), tl.sum(q3, axis=1)
    if Q_BF16:  # divided by the planes' operand factors (powers of two): bf16 queries stay exact
        q0, q1 = q0 * (1.0 / _plane_factor(0)), q1 * (1.0 / _plane_factor(1))
        q2, q3 = q2 * (1.0 / _plane_factor(2)), q3 * (1.0 / _plane_factor(3))
    q0 = dot_operand(q0, Q_BF16, TENSOR_CORES)
    q1 = dot_operand(q1, Q_BF16, TENSOR_CORES)
    q2 = dot_operand(q2, Q_BF16, TENSOR_CORES)
    q3 = dot_operand(q3, Q_BF16, TENSOR_CORES)

    if CHANNELS_ON_M:  # oᵀ by half planes (`_int2_page_channels_on_m`)
        HALF: tl.constexpr = QUARTER // BYTES_PER_PAIR_C
        o0, o1 = tl.zeros((HALF, BLOCK_M), tl.float32), tl.zeros((HALF, BLOCK_M), tl.float32)
        o2, o3 = tl.zeros((HALF, BLOCK_M), tl.float32), tl.zeros((HALF, BLOCK_M), tl.float32)
        o4, o5 = tl.zeros((HALF, BLOCK_M), tl.float32), tl.zeros((HALF, BLOCK_M), tl.float32)
        o6, o7 = tl.zeros((HALF, BLOCK_M), tl.float32), tl.zeros((HALF, BLOCK_M), tl.float32)
    else:  # the four planes; o4 … o7 unused
        o0 = tl.zeros((BLOCK_M, QUARTER), tl.float32)
        o1 = tl.zeros((BLOCK_M, QUARTER), tl.float32)
        o2 = tl.zeros((BLOCK_M, QUARTER), tl.float32)
        o3 = tl.zeros((BLOCK_M, QUARTER), tl.float32)
        o4, o5, o6, o7 = 0.0, 0.0, 0.0, 0.0
    m = tl.full((BLOCK_M,), MASK_VALUE_C, tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    # Tokens on M (the large grids' layout): blocks [0, num_full) hold valid tokens only and run
    # without masks; the one block that may remain (history_tokens not a multiple of
    # PAGES_PER_BLOCK·L; blocks past the table hold no valid token) runs masked first, under a
    # branch (a second loop would be pipelined too). Rows on M (small grids, 4 warps) masks every
    # block: its unmasked form spilled on sm_90 (benchmarks/DECISIONS.md D15).
    # (Triton calls take no *args: constexpr arguments must be passed by name or position.)
    if TOKENS_ON_M:
        num_full = _full_blocks(n_history, first_slot, last_slot, table_slots, PAGE_SIZE, PAGES_PER_BLOCK)
        i = num_full
        if num_full < num_blocks:
            o0, o1, o2, o3, o4, o5, o6, o7, m, l = _int2_block(
                i, o0, o1, o2, o3, o4, o5, o6, o7, m, l, page_table_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr,
                v_codes_ptr, v_scale_ptr, v_min_ptr, table_slots, b, h, first_slot, n_history, slot_in_block,
                offset, q0, q1, q2, q3, s0, s1, s2, s3, NUM_HEADS, D, GROUP_SIZE, PAGE_SIZE, PAGES_PER_BLOCK,
                SCORE_SCALE, Q_BF16, TENSOR_CORES, UNPACK_ASM, TOKENS_ON_M, False, CHANNELS_ON_M)
    else:
        num_full = num_blocks
    if TENSOR_CORES:  # compiled: a loop bounded by the loaded length, which Triton can pipeline
        for i in range(0, num_full):
            o0, o1, o2, o3, o4, o5, o6, o7, m, l = _int2_block(
                i, o0, o1, o2, o3, o4, o5, o6, o7, m, l, page_table_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr,
                v_codes_ptr, v_scale_ptr, v_min_ptr, table_slots, b, h, first_slot, n_history, slot_in_block,
                offset, q0, q1, q2, q3, s0, s1, s2, s3, NUM_HEADS, D, GROUP_SIZE, PAGE_SIZE, PAGES_PER_BLOCK,
                SCORE_SCALE, Q_BF16, TENSOR_CORES, UNPACK_ASM, TOKENS_ON_M, TOKENS_ON_M, CHANNELS_ON_M)
    else:  # interpreter: a static trip count with a guard (see the BF16 kernel)
        for i in range(0, PAGES_PER_SPLIT // PAGES_PER_BLOCK):
            if i < num_full:
                o0, o1, o2, o3, o4, o5, o6, o7, m, l = _int2_block(
                    i, o0, o1, o2, o3, o4, o5, o6, o7, m, l, page_table_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr,
                    v_codes_ptr, v_scale_ptr, v_min_ptr, table_slots, b, h, first_slot, n_history, slot_in_block,
                    offset, q0, q1, q2, q3, s0, s1, s2, s3, NUM_HEADS, D, GROUP_SIZE, PAGE_SIZE, PAGES_PER_BLOCK,
                    SCORE_SCALE, Q_BF16, TENSOR_CORES, UNPACK_ASM, TOKENS_ON_M, TOKENS_ON_M, CHANNELS_ON_M)

    out_row = _output_rows(b, h, split, row_block, NUM_HEADS, NUM_SPLITS, ROWS, BLOCK_M)
    nonempty = l > 0.0
    inv_l = 1.0 / tl.where(nonempty, l, 1.0)
    if CHANNELS_ON_M:
        _store_half_plane(o_ptr, o0, inv_l, out_row, 0, 0, D, Q_BF16)
        _store_half_plane(o_ptr, o1, inv_l, out_row, 0, 1, D, Q_BF16)
        _store_half_plane(o_ptr, o2, inv_l, out_row, 1, 0, D, Q_BF16)
        _store_half_plane(o_ptr, o3, inv_l, out_row, 1, 1, D, Q_BF16)
        _store_half_plane(o_ptr, o4, inv_l, out_row, 2, 0, D, Q_BF16)
        _store_half_plane(o_ptr, o5, inv_l, out_row, 2, 1, D, Q_BF16)
        _store_half_plane(o_ptr, o6, inv_l, out_row, 3, 0, D, Q_BF16)
        _store_half_plane(o_ptr, o7, inv_l, out_row, 3, 1, D, Q_BF16)
    else:
        _store_plane(o_ptr, o0, inv_l, out_row, 0, D, Q_BF16)
        _store_plane(o_ptr, o1, inv_l, out_row, 1, D, Q_BF16)
        _store_plane(o_ptr, o2, inv_l, out_row, 2, D, Q_BF16)
        _store_plane(o_ptr, o3, inv_l, out_row, 3, D, Q_BF16)
    tl.store(lse_ptr + out_row, natural_lse(m, l, nonempty))


def int2_tier_partials(
    q: torch.Tensor,  # [B, K, R, D] float32 or bfloat16 (the partials' M: R padded to block_m)
    k_codes: torch.Tensor,  # [P, K, L, D/4] uint8
    k_scale: torch.Tensor,  # [P, K, L, D/G] float16
    k_min: torch.Tensor,  # [P, K, L, D/G] float16
    v_codes: torch.Tensor,  # [P, K, L, D/4] uint8
    v_scale: torch.Tensor,  # [P, K, L, D/G] float16
    v_min: torch.Tensor,  # [P, K, L, D/G] float16
    page_table: torch.Tensor,  # [B, NH] int32
    history_tokens: torch.Tensor,  # [B] int32
    *,
    group_size: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int,
    block_m: int,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    unpack_asm: bool = False,
    max_registers: int | None = None,
    tokens_on_m: bool = False,
    channels_on_m: bool = False,
):
    """Partials over the INT2 tier: (o float32[B, K, S, M, D], lse float32[B, K, S, M]).
    `channels_on_m` (with tokens_on_m, D ≥ 128): the values' dot as oᵀ = Vᵀ·p, the channels on M
    and the rows on N, its codes read as 16-bit pairs (`_int2_page_channels_on_m`; the decode default
    where it applies: benchmarks/DECISIONS.md D5).
    `tokens_on_m` (G ≥ D: one group per row): scores and probabilities as [N, block_m], the codes the
    dots' A operand, so block_m may be 8; decode runs it at one warp (benchmarks/DECISIONS.md D4).
    `max_registers`: Triton's maxnreg for the compiled kernel (more programs per SM, at the price of
    spills); None → the compiler's choice, and always under the interpreter.
    `unpack_asm`: the folded kernel unpacks codes by inline PTX (bfloat16 q on the GPU; the G < D/4
    dequantizing fallback has no code planes and ignores it)."""
    batch, num_kv_heads, q_rows, head_dim = q.shape
    rows = partial_rows(q_rows, block_m)
    _, _, page_size, packed = k_codes.shape
    assert pages_per_split % pages_per_block == 0
    assert packed * CODES_PER_BYTE == head_dim and k_scale.shape[-1] * group_size == head_dim
    splits = num_splits(page_table.shape[1], pages_per_split)
    o = torch.empty((batch, num_kv_heads, splits, rows, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_kv_heads, splits, rows), dtype=torch.float32, device=q.device)
    folded = group_size >= head_dim // CODES_PER_BYTE
    kernel = _int2_tier_kernel if folded else _int2_tier_dequantizing_kernel
    if tokens_on_m and group_size < head_dim:
        raise ValueError(f"tokens_on_m needs one group per row (group_size >= head_dim = {head_dim}), "
                         f"got group_size={group_size}")
    if channels_on_m and not int2_decode_channels_on_m(tokens_on_m, group_size, head_dim):
        raise ValueError(f"channels_on_m needs tokens_on_m and head_dim >= {MIN_DOT_DIM * CHANNELS_PER_PAIR_ROW} (the "
                         f"dot's M is head_dim / {CHANNELS_PER_PAIR_ROW}); got tokens_on_m={tokens_on_m}, head_dim={head_dim}")
    extra = dict(UNPACK_ASM=bool(unpack_asm)) if folded and unpack_asm else {}
    if tokens_on_m:
        extra["TOKENS_ON_M"] = True
    if channels_on_m:
        extra["CHANNELS_ON_M"] = True
    if max_registers is not None and not interpreting():
        extra["maxnreg"] = int(max_registers)
    kernel[(batch, num_kv_heads, (rows // block_m) * splits)](
        page_table, history_tokens, kernel_view(q), k_codes, k_scale, k_min, v_codes, v_scale, v_min,
        o, lse, page_table.shape[1],
        NUM_HEADS=num_kv_heads, ROWS=rows, Q_ROWS=q_rows, D=head_dim, GROUP_SIZE=group_size, PAGE_SIZE=page_size,
        PAGES_PER_SPLIT=pages_per_split, PAGES_PER_BLOCK=pages_per_block, NUM_SPLITS=splits,
        SCORE_SCALE=base2_score_scale(softmax_scale), BLOCK_M=block_m, Q_BF16=q.dtype == torch.bfloat16,
        TENSOR_CORES=not interpreting(), num_warps=num_warps, num_stages=num_stages, **extra,
    )
    return o, lse

