"""Split-K first-stage kernels of attention over OSCAR's paged mixed-precision KV cache (Triton).

Two kernels, one per storage tier, each writing a *normalised* partial output and its
log-sum-exp per (sequence, KV head, query-row block, split); a merge turns all partials into the
exact softmax over the union (decode: `merge_tier_partials`, one kernel reading both tiers'
partials in place; prefill: `oscar_torch.attention_ops.merge_partials` in plain torch). The
same tier kernels, names and tiling as oscar_jax/kernels/decode_attention.py:

* `bf16_tier_partials`: the sink and recent pages (BF16). One page table per sequence: slots
  [0, sink_slots) are the sink pages (`sink_tokens` valid tokens, filling pages in order), the
  following slots the recent pages (`recent_tokens` valid tokens, in order).
* `int2_tier_partials`: the history pages (INT2, format v1), in the folded form of the Pallas
  kernel: one dot per bit plane on the raw 2-bit codes, the K scale and minimum folded into the
  scores (s·(q·c) + m·Σq) and the V scale into the probabilities, so nothing is dequantized and
  bfloat16 queries run on tensor cores. This needs every bit plane inside one group (G ≥ D/4);
  narrower groups take `_int2_tier_dequantizing_kernel`, which dequantizes each tile in
  registers (`decode_block`) and runs float32 dots. (Dequantizing every tile is the slow path: a
  [256, 128] float32 tile per K and V spills registers.)

Both kernels handle all query rows of one KV head together (GQA: the Gq query heads of a KV head,
padded to ≥ 16 rows for `tl.dot`; prefill: T·Gq rows), so each K/V tile is loaded once per row
block. Grid (B, K, row blocks × splits): Triton grids have three axes, so the JAX kernels' row
block and split axes share the last one.

Precision: `BF16_DOTS` (q in bfloat16) rounds the dot operands built in the kernel to bfloat16
(the probabilities before P·V), with float32 accumulation; otherwise every dot is IEEE float32.
On the GPU the BF16 tier's bf16 dots run on tensor cores (`TENSOR_CORES`); the Triton
interpreter computes bf16 `tl.dot` wrongly, so there the operands are rounded to bfloat16 values
with integer round-to-nearest-even and multiplied as float32 (the same products: a product of
two bfloat16 values is exact in float32). The folded INT2 kernel follows the same rules (codes
are exact in bfloat16; the probabilities scaled by the V scale are rounded to bfloat16 before
the dot, as in Pallas); the dequantizing one always uses float32 dots. BF16 pools and bfloat16 queries reach the
kernels as int16 bit patterns and are widened with integer ops (exact everywhere).

Robustness: a page-table entry that does not hold a valid token is never dereferenced (its page
id is replaced by 0 before the gather), V rows and INT2 metadata of masked tokens are zeroed
(stale pool memory may hold NaN), masked scores are a finite large negative value, and a split
with no valid token writes o = 0, lse = −inf so the merge weighs it zero. The INT2 tier with
tokens on M runs the blocks whose every token is valid (whole history pages) without masks, and
masks only the block that may hold a partial page (`_full_blocks`; benchmarks/DECISIONS.md D15).

Dimension vocabulary of the shape comments: B batch, K KV heads, M query rows of one KV head,
D head dim, P pages of a pool, L page size, N tokens of one block, S splits, NB/NH table slots.
"""

from __future__ import annotations


import numpy as np
import torch
import triton
import triton.language as tl

from oscar_torch.kernels.codec import (
    CODE_BITS_C,
    CODE_MASK_C,
    CODES_PER_BYTE_C,
    decode_block,
    interpreting,
    kernel_view,
    load_rows_f32,
    round_to_bf16,
    widen_bf16_bits,
)
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
from shared_math.tiling import (
    CHANNELS_PER_PAIR_ROW,
    LN2,
    MERGE_BLOCK_D,
    MERGE_BLOCK_SPLITS,
    base2_score_scale,
    int2_decode_channels_on_m,
    num_splits,
)

# Scores of masked tokens. Finite (not −inf), so that a block with no valid token keeps the
# running maximum finite and exp(m_old − m_new) never becomes exp(−inf + inf) = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MASK_VALUE_C = tl.constexpr(MASK_VALUE)
BF16_CODE_BIAS_C = tl.constexpr(BF16_CODE_BIAS)
LN2_C = tl.constexpr(LN2)
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
# `tl.dot` needs M, N, K ≥ 16 (mma tile); blocks are sized to respect it.
MIN_DOT_DIM = 16
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


# --------------------------------------------------------------------------------------------
# Shared jit helpers (also used by prefill_attention.py).
# --------------------------------------------------------------------------------------------


@triton.jit
def dot_operand(x, BF16_DOTS: tl.constexpr, TENSOR_CORES: tl.constexpr):
    """A float32 tile as a dot operand: itself, or rounded to bfloat16 (see module docstring)."""
    if BF16_DOTS:
        if TENSOR_CORES:
            return x.to(tl.bfloat16)  # round-to-nearest-even on the GPU
        else:
            return round_to_bf16(x)
    else:
        return x


@triton.jit
def dot_f32(a, b, BF16_DOTS: tl.constexpr, TENSOR_CORES: tl.constexpr):
    """a [M, C] · b [C, N] → float32 [M, N]: bf16 tensor-core dot, or IEEE float32 (no TF32)."""
    if BF16_DOTS and TENSOR_CORES:
        return tl.dot(a, b, out_dtype=tl.float32)
    else:
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def online_softmax_step(scores, valid, m_prev, l_prev, TOKEN_AXIS: tl.constexpr = 1):
    """One online-softmax step on a [M, N] score tile (or [N, M] with TOKEN_AXIS 0: tokens on the
    dots' M) in base-2 units (`shared_math.tiling.base2_score_scale`); `valid` broadcasts to it.

    Returns (p, correction, m_new, l_new). Masked entries get p = 0 exactly, even while a row
    has seen no valid score yet (then m stays MASK_VALUE and exp2(scores − m) would be 1).
    """
    scores = tl.where(valid, scores, MASK_VALUE_C)
    m_new = tl.maximum(m_prev, tl.max(scores, axis=TOKEN_AXIS))
    correction = tl.exp2(m_prev - m_new)
    p = tl.where(valid, tl.exp2(scores - tl.expand_dims(m_new, TOKEN_AXIS)), 0.0)
    l_new = l_prev * correction + tl.sum(p, axis=TOKEN_AXIS)
    return p, correction, m_new, l_new


@triton.jit
def natural_lse(m, l, nonempty):
    """log Σ exp(score) of rows whose running maximum m is in base-2 units; −inf where empty."""
    return tl.where(nonempty, (m + tl.log2(tl.where(nonempty, l, 1.0))) * LN2_C, float("-inf"))


@triton.jit
def store_partial(o_ptr, lse_ptr, o, m, l, out_row, D: tl.constexpr):
    """Normalise and store a finished partial: o [M, D] at rows out_row [M] of a [·, D] output;
    rows that saw no token get o = 0 and lse = −inf (natural log; m in base-2 units)."""
    nonempty = l > 0.0
    inv_l = 1.0 / tl.where(nonempty, l, 1.0)
    lse = natural_lse(m, l, nonempty)
    tl.store(o_ptr + out_row[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :], o * inv_l[:, None])
    tl.store(lse_ptr + out_row, lse)


@triton.jit
def _query_rows(q_ptr, b, h, row_block, NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, Q_BF16: tl.constexpr):
    """Query rows [BLOCK_M, D] float32 of (b, h), block row_block of q [B, K, ROWS, D]; rows ≥ ROWS → 0."""
    row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    start = ((b * NUM_HEADS + h) * ROWS + row).to(tl.int64) * D
    return load_rows_f32(q_ptr + start[:, None] + tl.arange(0, D)[None, :], row[:, None] < ROWS, Q_BF16)


@triton.jit
def _output_rows(b, h, split, row_block, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row indices [BLOCK_M] into the flattened partials o [B, K, S, M] (·D) / lse [B, K, S, M]."""
    return ((b * NUM_HEADS + h) * NUM_SPLITS + split) * ROWS + row_block * BLOCK_M + tl.arange(0, BLOCK_M)


# --------------------------------------------------------------------------------------------
# BF16 tier: sink + recent pages.
# --------------------------------------------------------------------------------------------


@triton.jit
def _bf16_block(i, o, m, l, q, page_table_ptr, k_ptr, v_ptr, table_slots, b, h, first_slot, n_sink, n_recent,
                slot_in_block, offset, column, NUM_HEADS: tl.constexpr, D: tl.constexpr, SINK_SLOTS: tl.constexpr,
                PAGE_SIZE: tl.constexpr, PAGES_PER_BLOCK: tl.constexpr, SCORE_SCALE: tl.constexpr,
                Q_BF16: tl.constexpr, TENSOR_CORES: tl.constexpr):
    """One block of PAGES_PER_BLOCK BF16 pages (sink or recent): scores, online softmax, P·V."""
    slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
    is_sink = slot < SINK_SLOTS
    position = tl.where(is_sink, slot, slot - SINK_SLOTS) * PAGE_SIZE + offset
    valid = (position < tl.where(is_sink, n_sink, n_recent)) & (slot < table_slots)  # [N]
    page = tl.load(page_table_ptr + b * table_slots + slot, mask=valid, other=0)  # never unused slots
    row_start = ((page.to(tl.int64) * NUM_HEADS + h) * PAGE_SIZE + offset) * D  # [N]
    k = widen_bf16_bits(tl.load(k_ptr + row_start[:, None] + column))  # [N, D]
    v = widen_bf16_bits(tl.load(v_ptr + row_start[:, None] + column))
    v = tl.where(valid[:, None], v, 0.0)
    k = dot_operand(k, Q_BF16, TENSOR_CORES)
    v = dot_operand(v, Q_BF16, TENSOR_CORES)
    scores = dot_f32(q, tl.trans(k), Q_BF16, TENSOR_CORES) * SCORE_SCALE  # [BLOCK_M, N]
    p, correction, m, l = online_softmax_step(scores, valid[None, :], m, l)
    p = dot_operand(p, Q_BF16, TENSOR_CORES)
    o = o * correction[:, None] + dot_f32(p, v, Q_BF16, TENSOR_CORES)
    return o, m, l


@triton.jit
def _bf16_tier_kernel(
    page_table_ptr,  # [B, NB] int32: sink slots, then recent slots
    sink_tokens_ptr,  # [B] int32
    recent_tokens_ptr,  # [B] int32
    q_ptr,  # [B, K, M, D] float32, or bfloat16 as int16
    k_ptr,  # [P, K, L, D] bfloat16 as int16
    v_ptr,  # [P, K, L, D] bfloat16 as int16
    o_ptr,  # [B, K, S, M, D] float32: normalised partial outputs
    lse_ptr,  # [B, K, S, M] float32: their log-sum-exp (−inf when a split holds no token)
    table_slots,  # NB
    NUM_HEADS: tl.constexpr,
    ROWS: tl.constexpr,  # M: rows of the partials, a multiple of BLOCK_M
    Q_ROWS: tl.constexpr,  # rows of q (≤ M): rows beyond are read as zero queries
    D: tl.constexpr,
    SINK_SLOTS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
    PAGES_PER_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SCORE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    Q_BF16: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    row_block, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    BLOCK_N: tl.constexpr = PAGES_PER_BLOCK * PAGE_SIZE

    n_sink = tl.load(sink_tokens_ptr + b)
    n_recent = tl.load(recent_tokens_ptr + b)
    recent_pages = tl.cdiv(n_recent, PAGE_SIZE)
    # One past the last slot holding a token: the loop stops there (slots beyond are never read).
    slot_end = tl.where(recent_pages > 0, SINK_SLOTS + recent_pages, tl.cdiv(n_sink, PAGE_SIZE))
    first_slot = split * PAGES_PER_SPLIT
    last_slot = tl.minimum(first_slot + PAGES_PER_SPLIT, slot_end)
    num_blocks = tl.maximum(tl.cdiv(last_slot - first_slot, PAGES_PER_BLOCK), 0)

    token = tl.arange(0, BLOCK_N)
    offset = token % PAGE_SIZE  # [N] position inside its page
    slot_in_block = token // PAGE_SIZE  # [N]
    column = tl.arange(0, D)[None, :]
    q = dot_operand(
        _query_rows(q_ptr, b, h, row_block, NUM_HEADS, Q_ROWS, D, BLOCK_M, Q_BF16), Q_BF16, TENSOR_CORES
    )  # [BLOCK_M, D]

    o = tl.zeros((BLOCK_M, D), tl.float32)
    m = tl.full((BLOCK_M,), MASK_VALUE_C, tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    if TENSOR_CORES:  # compiled: a loop bounded by the loaded length, which Triton software-pipelines
        for i in range(0, num_blocks):
            o, m, l = _bf16_block(i, o, m, l, q, page_table_ptr, k_ptr, v_ptr, table_slots, b, h, first_slot,
                                  n_sink, n_recent, slot_in_block, offset, column, NUM_HEADS, D, SINK_SLOTS,
                                  PAGE_SIZE, PAGES_PER_BLOCK, SCORE_SCALE, Q_BF16, TENSOR_CORES)
    else:
        # The interpreter cannot take a loaded value as a loop bound (numpy 2.5 refuses int() of
        # its 1-element arrays): a static trip count with a dynamic guard. Compiled, the guard
        # kept Triton from pipelining the loop (no async copies), so the compiled kernel takes the
        # loaded trip count.
        for i in range(0, PAGES_PER_SPLIT // PAGES_PER_BLOCK):
            if i < num_blocks:
                o, m, l = _bf16_block(i, o, m, l, q, page_table_ptr, k_ptr, v_ptr, table_slots, b, h, first_slot,
                                      n_sink, n_recent, slot_in_block, offset, column, NUM_HEADS, D, SINK_SLOTS,
                                      PAGE_SIZE, PAGES_PER_BLOCK, SCORE_SCALE, Q_BF16, TENSOR_CORES)

    out_row = _output_rows(b, h, split, row_block, NUM_HEADS, NUM_SPLITS, ROWS, BLOCK_M)
    store_partial(o_ptr, lse_ptr, o, m, l, out_row, D)


def partial_rows(q_rows: int, block_m: int) -> int:
    """Rows M of a tier's partials for q of q_rows rows: padded to whole row blocks. The kernels
    read the missing rows as zero queries, so callers pass q unpadded (no pad or copy kernel a
    call: benchmarks/DECISIONS.md D18)."""
    return -(-q_rows // block_m) * block_m


def bf16_tier_partials(
    q: torch.Tensor,  # [B, K, R, D] float32 or bfloat16 (the partials' M: R padded to block_m)
    k_bf16: torch.Tensor,  # [P, K, L, D] bfloat16
    v_bf16: torch.Tensor,  # [P, K, L, D] bfloat16
    page_table: torch.Tensor,  # [B, NB] int32
    sink_tokens: torch.Tensor,  # [B] int32
    recent_tokens: torch.Tensor,  # [B] int32
    *,
    sink_slots: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int,
    block_m: int,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
):
    """Partials over the BF16 tier: (o float32[B, K, S, M, D], lse float32[B, K, S, M]).

    Inputs are validated by the public op; the asserts guard internal invariants only.
    """
    batch, num_kv_heads, q_rows, head_dim = q.shape
    rows = partial_rows(q_rows, block_m)
    _, _, page_size, _ = k_bf16.shape
    assert pages_per_split % pages_per_block == 0
    splits = num_splits(page_table.shape[1], pages_per_split)
    o = torch.empty((batch, num_kv_heads, splits, rows, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_kv_heads, splits, rows), dtype=torch.float32, device=q.device)
    q_bf16 = q.dtype == torch.bfloat16
    _bf16_tier_kernel[(batch, num_kv_heads, (rows // block_m) * splits)](
        page_table, sink_tokens, recent_tokens, kernel_view(q), k_bf16.view(torch.int16),
        v_bf16.view(torch.int16), o, lse, page_table.shape[1],
        NUM_HEADS=num_kv_heads, ROWS=rows, Q_ROWS=q_rows, D=head_dim, SINK_SLOTS=sink_slots, PAGE_SIZE=page_size,
        PAGES_PER_SPLIT=pages_per_split, PAGES_PER_BLOCK=pages_per_block, NUM_SPLITS=splits,
        SCORE_SCALE=base2_score_scale(softmax_scale), BLOCK_M=block_m, Q_BF16=q_bf16,
        TENSOR_CORES=not interpreting(), num_warps=num_warps, num_stages=num_stages,
    )
    return o, lse


# --------------------------------------------------------------------------------------------
# INT2 tier: history pages.
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_int2_tile(codes_ptr, scale_ptr, minimum_ptr, page, h, offset, valid,
                    NUM_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
                    GROUP_SIZE: tl.constexpr):
    """The dequantized rows [N, D] float32 of tokens (page[n], h, offset[n]); masked tokens → 0."""
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    NUM_GROUPS: tl.constexpr = D // GROUP_SIZE
    row = (page.to(tl.int64) * NUM_HEADS + h) * PAGE_SIZE + offset  # [N]
    codes = tl.load(codes_ptr + row[:, None] * QUARTER + tl.arange(0, QUARTER)[None, :]).to(tl.int32)
    group = row[:, None] * NUM_GROUPS + tl.arange(0, NUM_GROUPS)[None, :]
    # Masked rows may be stale memory (NaN metadata): zero them before use.
    scale = tl.where(valid[:, None], tl.load(scale_ptr + group).to(tl.float32), 0.0)
    minimum = tl.where(valid[:, None], tl.load(minimum_ptr + group).to(tl.float32), 0.0)
    return decode_block(codes, scale, minimum, GROUP_SIZE)


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
def _store_half_plane(o_ptr, o_half, inv_l, out_row, PLANE: tl.constexpr, HIGH: tl.constexpr, D: tl.constexpr,
                      BF16_DOTS: tl.constexpr):
    """The normalised oᵀ half plane [D/8, BLOCK_M] (channels PLANE·D/4 + 2j + HIGH) at rows out_row."""
    QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
    column = PLANE * QUARTER + BYTES_PER_PAIR_C * tl.arange(0, QUARTER // BYTES_PER_PAIR_C)[:, None] + HIGH
    if BF16_DOTS:
        inv_l = inv_l * (1.0 / _plane_factor(PLANE))
    tl.store(o_ptr + out_row[None, :].to(tl.int64) * D + column, o_half * inv_l[None, :])


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


@triton.jit
def _int2_tier_dequantizing_kernel(
    page_table_ptr, history_tokens_ptr, q_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr,
    v_min_ptr, o_ptr, lse_ptr, table_slots,
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
):
    """Groups narrower than D/4 (a bit plane spans several groups): dequantize each K/V tile in
    registers (x̂ = m + c·s, `decode_block`) and run float32 dots on it. Same arguments as
    `_int2_tier_kernel`."""
    b, h = tl.program_id(0), tl.program_id(1)
    row_block, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    BLOCK_N: tl.constexpr = PAGES_PER_BLOCK * PAGE_SIZE

    n_history = tl.load(history_tokens_ptr + b)
    first_slot = split * PAGES_PER_SPLIT
    last_slot = tl.minimum(first_slot + PAGES_PER_SPLIT, tl.cdiv(n_history, PAGE_SIZE))
    num_blocks = tl.maximum(tl.cdiv(last_slot - first_slot, PAGES_PER_BLOCK), 0)

    token = tl.arange(0, BLOCK_N)
    offset = token % PAGE_SIZE  # [N]
    slot_in_block = token // PAGE_SIZE  # [N]
    q = _query_rows(q_ptr, b, h, row_block, NUM_HEADS, Q_ROWS, D, BLOCK_M, Q_BF16)  # [BLOCK_M, D]

    o = tl.zeros((BLOCK_M, D), tl.float32)
    m = tl.full((BLOCK_M,), MASK_VALUE_C, tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    for i in range(0, PAGES_PER_SPLIT // PAGES_PER_BLOCK):  # static trip count (see above)
        if i < num_blocks:
            slot = first_slot + i * PAGES_PER_BLOCK + slot_in_block  # [N]
            valid = (slot * PAGE_SIZE + offset < n_history) & (slot < table_slots)  # [N]
            page = tl.load(page_table_ptr + b * table_slots + slot, mask=valid, other=0)
            k = _load_int2_tile(k_codes_ptr, k_scale_ptr, k_min_ptr, page, h, offset, valid,
                                NUM_HEADS, PAGE_SIZE, D, GROUP_SIZE)  # [N, D]
            scores = dot_f32(q, tl.trans(k), False, False) * SCORE_SCALE  # [BLOCK_M, N]
            p, correction, m, l = online_softmax_step(scores, valid[None, :], m, l)
            v = _load_int2_tile(v_codes_ptr, v_scale_ptr, v_min_ptr, page, h, offset, valid,
                                NUM_HEADS, PAGE_SIZE, D, GROUP_SIZE)
            p = dot_operand(p, Q_BF16, False)
            o = o * correction[:, None] + dot_f32(p, v, False, False)

    out_row = _output_rows(b, h, split, row_block, NUM_HEADS, NUM_SPLITS, ROWS, BLOCK_M)
    store_partial(o_ptr, lse_ptr, o, m, l, out_row, D)


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


# --------------------------------------------------------------------------------------------
# Merge: the exact softmax over both tiers' splits, in one pass per query row.
# --------------------------------------------------------------------------------------------


@triton.jit
def _tier_max_lse(lse_ptr, b, h, row, num_splits: tl.constexpr, m, NUM_HEADS: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """max(m, max_s lse[b, h, s, row]) over one tier's splits."""
    for start in range(0, num_splits, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_ptr + ((b * NUM_HEADS + h) * num_splits + s) * ROWS + row, mask=s < num_splits,
                      other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, axis=0))
    return m


@triton.jit
def _tier_weighted_sum(o_ptr, lse_ptr, b, h, row, column, num_splits: tl.constexpr, lse_max, acc, total,
                       NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """acc + Σ_s exp(lse_s − lse_max)·o_s[column] and total + Σ_s exp(lse_s − lse_max) over one tier."""
    for start in range(0, num_splits, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        inside = s < num_splits
        split_row = (b * NUM_HEADS + h) * num_splits + s  # [BLOCK_S]
        lse = tl.load(lse_ptr + split_row * ROWS + row, mask=inside, other=float("-inf"))
        weight = tl.exp(lse - lse_max)  # 0 for empty splits (lse = −inf)
        o = tl.load(o_ptr + (split_row.to(tl.int64) * ROWS + row)[:, None] * D + column[None, :],
                    mask=inside[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
        acc += tl.sum(tl.where(weight[:, None] > 0.0, weight[:, None] * o, 0.0), axis=0)
        total += tl.sum(weight, axis=0)
    return acc, total


@triton.jit
def _merge_tiers_kernel(
    o_a_ptr, lse_a_ptr,  # [B, K, Sa, M, D], [B, K, Sa, M] float32: one tier's partials
    o_b_ptr, lse_b_ptr,  # [B, K, Sb, M, D], [B, K, Sb, M] float32: the other's
    out_ptr,  # [B, K, R, D] float32
    SPLITS_A: tl.constexpr,  # static like the tier kernels' NUM_SPLITS (and a loop bound the
    SPLITS_B: tl.constexpr,  # interpreter accepts)
    NUM_HEADS: tl.constexpr,
    ROWS_A: tl.constexpr,  # M_a, M_b: the padded rows of each tier's partials
    ROWS_B: tl.constexpr,
    VALID_ROWS: tl.constexpr,  # R ≤ M_a, M_b: the rows kept
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns of one program
):
    """One program per (b, KV head, kept row, column block): `attention_ops.merge_partials` over
    the splits of both tiers, without concatenating them; rows every split left empty get 0."""
    b, h = tl.program_id(0), tl.program_id(1)
    row, column_block = tl.program_id(2) // (D // BLOCK_D), tl.program_id(2) % (D // BLOCK_D)
    column = column_block * BLOCK_D + tl.arange(0, BLOCK_D)
    lse_max = tl.max(tl.full((BLOCK_S,), float("-inf"), tl.float32), axis=0)  # a scalar tensor: loop-carried
    lse_max = _tier_max_lse(lse_a_ptr, b, h, row, SPLITS_A, lse_max, NUM_HEADS, ROWS_A, BLOCK_S)
    lse_max = _tier_max_lse(lse_b_ptr, b, h, row, SPLITS_B, lse_max, NUM_HEADS, ROWS_B, BLOCK_S)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    total = tl.sum(tl.zeros((BLOCK_S,), tl.float32), axis=0)
    acc, total = _tier_weighted_sum(o_a_ptr, lse_a_ptr, b, h, row, column, SPLITS_A, lse_max, acc, total,
                                    NUM_HEADS, ROWS_A, D, BLOCK_S)
    acc, total = _tier_weighted_sum(o_b_ptr, lse_b_ptr, b, h, row, column, SPLITS_B, lse_max, acc, total,
                                    NUM_HEADS, ROWS_B, D, BLOCK_S)
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + ((b * NUM_HEADS + h) * VALID_ROWS + row).to(tl.int64) * D + column, out)


def merge_tier_partials(o_a, lse_a, o_b, lse_b, valid_rows: int, block_splits: int = MERGE_BLOCK_SPLITS,
                        block_d: int | None = None):
    """Merge the partials of two tiers (same B, K, D; any split counts and padded rows M_a, M_b ≥
    valid_rows) into o float32[B, K, valid_rows, D], keeping rows [0, valid_rows). Inputs are
    validated by the public op."""
    batch, num_kv_heads, splits_a, rows, head_dim = o_a.shape
    # None: MERGE_BLOCK_D columns per program on the GPU (parallelism); whole rows under the
    # interpreter, which runs programs one after another.
    block_d = min(block_d or (head_dim if interpreting() else MERGE_BLOCK_D), head_dim)
    assert o_b.shape[:2] == (batch, num_kv_heads) and o_b.shape[4] == head_dim
    assert valid_rows <= min(rows, o_b.shape[3])
    assert head_dim % block_d == 0
    out = torch.empty((batch, num_kv_heads, valid_rows, head_dim), dtype=torch.float32, device=o_a.device)
    _merge_tiers_kernel[(batch, num_kv_heads, valid_rows * (head_dim // block_d))](
        o_a, lse_a, o_b, lse_b, out, SPLITS_A=splits_a, SPLITS_B=o_b.shape[2],
        NUM_HEADS=num_kv_heads, ROWS_A=rows, ROWS_B=o_b.shape[3], VALID_ROWS=valid_rows, D=head_dim, BLOCK_S=block_splits,
        BLOCK_D=block_d, num_warps=DEFAULT_NUM_WARPS,
    )
    return out
