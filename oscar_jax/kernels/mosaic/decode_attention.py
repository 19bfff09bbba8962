"""Decode attention's tiers on Pallas Mosaic GPU (issue 41): split-K partials over the history
pages of OSCAR's paged cache (INT2, format v1; `int2_tier_partials`) and over its sink and recent
pages (BF16; `bf16_tier_partials`), with the same arguments and outputs as the Triton-lowered
kernels of `oscar_jax.kernels.decode_attention`. The merge stays the Triton-lowered one for now.
The INT2 tier is described below; the BF16 tier (`_bf16_tier_kernel`) is the same program with the
pages fed from the copies straight into wgmma.

One program per (sequence b, KV head h, split s), one warpgroup (128 threads). Per page of L
tokens (L a multiple of 64, wgmma's M):

* TMA copies the page's K and V codes [L, D/4] u8 and its four fp16 metadata rows [L] into a
  ring of STAGES shared-memory slots (one mbarrier a slot; a slot is refilled once the
  warpgroup has read it), the page id read from the page table in global memory.
* Scores with the tokens on wgmma's M and the query rows on N (rows = 8: mma's smallest N):
  the K codes are widened to int32 (Mosaic GPU has no 8-bit arithmetic), each bit plane
  `(byte >> 2·plane) & 3` converted to bfloat16 (exact), the four planes concatenated into the
  quartered channel order (plane p holds channels [p·D/4, (p+1)·D/4)), and fed to wgmma from
  registers as A [L, D] against qᵀ (q [rows, D] in shared memory, B) → q·c [L, rows].
  With x̂ = m + c·s (one group per row, G = D): q·x̂ = s·(q·c) + m·Σq. Σq comes from one
  wgmma of a ones tile against qᵀ before the loop (every row of it is Σq, in the scores'
  layout).
* Online softmax in base-2 units along the tokens (axis 0 of the score tile).
* Values transposed, oᵀ [D, rows] += V̂ᵀ·(p·s_v): the V codes unpacked the same way and stored
  as bfloat16 [L, D] into shared memory, read by wgmma as the transposed A [D, L]; p·s_v is
  stored transposed into shared memory ([rows, L], K-major B). The minimum term Σ_t p·m_v adds
  to every channel of a row.

Supported (else NotImplementedError): bfloat16 q (wgmma operands; the codes are exact in
bfloat16), one group per row (G = D ∈ {64, 128, 256}), L a multiple of 64, rows a multiple of 8.
Robustness as the Triton kernel: tokens past the history are masked (scores to MASK_VALUE, their
V metadata zeroed: stale pool memory may hold NaN), only pages holding a valid token are copied,
a split with no token writes o = 0, lse = −inf.

Interpret mode: `plgpu.InterpretGPUParams` (the GPU interpreter of jax 0.11.2: shared memory,
barriers and TMA simulated on the CPU). It does not apply Mosaic GPU's lowering rules; lowering
for the GPU (`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`) runs on a CPU-only
machine too and does (the tests do both).

Options for what bounds it (`biased_codes`: codes unpacked by integer ops instead of int → bfloat16
conversions; `auto_barriers=False`, `lazy_sums`, `buffers=2`: 3 warpgroup barriers a page instead
of 18). Why it is not the default, measured against the Triton-lowered kernel: benchmarks/DECISIONS.md
M1 (`benchmarks/probe_mosaic_decode.py` times every variant beside it in one call).

Dimension vocabulary of the shape comments: B batch, K KV heads, M query rows of one KV head,
D head dim, P pages of a pool, L page size, S splits, NH table slots, R rows attended.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from shared_math.spec import CODE_BITS, CODE_MASK, CODES_PER_BYTE
from shared_math.tiling import LN2, base2_score_scale, num_splits

# Scores of masked tokens: finite (as the Triton kernel's), so exp2(m_old − m_new) never sees −inf + inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
WGMMA_M = 64  # wgmma's M: the page size must be a multiple
WGMMA_MIN_N = 8  # wgmma's N granule: the rows attended
SWIZZLE_BYTES = 128  # the shared-memory swizzle of every wgmma operand
DEFAULT_STAGES = 4  # pages in flight per program
METADATA_COPIES = 4  # k_scale, k_min, v_scale, v_min
COPIES_PER_PAGE = 2 + METADATA_COPIES  # + K and V codes


def _swizzled(dtype, swizzle: int = SWIZZLE_BYTES):
    """The (tiling, swizzle) transforms of a wgmma operand in shared memory."""
    elements = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elements)), plgpu.SwizzleTransform(swizzle))


# The biased code operand: bfloat16 1.0 is 0x3F80 (exponent 127, mantissa 0); a code c in mantissa
# bits CODE_PLACE … CODE_PLACE + 1 makes it exactly 1 + c·2^(CODE_PLACE − 7) = 1 + c/4: the bias
# (1) is only 4× the code term's largest step, where shared_math's convention (128 + c, the
# Triton kernels') carries a bias 128× it, which the values' float32 accumulation then cancels
# (interpret mode, this kernel: o 8e-4 from the Triton kernel's with 128 + c, 2e-5 with 1 + c/4).
BF16_ONE_BITS = 0x3F80
BF16_MANTISSA_BITS = 7
CODE_PLACE = BF16_MANTISSA_BITS - CODE_BITS  # the code in the mantissa's top bits
OPERAND_BIAS = 1.0
OPERAND_CODE_FACTOR = 2.0 ** (CODE_PLACE - BF16_MANTISSA_BITS)  # 1/4: operand = 1 + c·factor


def _unpack_planes(codes_smem, biased: bool):
    """Packed codes [L, D/4] u8 in shared memory → bfloat16 [L, D] in channel order (quartered
    packing: plane p of byte j is channel p·D/4 + j), each value exact.

    biased=False: the code c (an int → float conversion per code: sm_90 issues conversions at a
    quarter of the integer rate). biased=True: OPERAND_BIAS + c·OPERAND_CODE_FACTOR from integer
    ops only (a shift, a mask and an or, then a truncation to 16 bits and a bitcast); the callers
    take the bias and factor out again."""
    codes = codes_smem[...].astype(jnp.int32)  # widened before any arithmetic (no 8-bit ops)
    planes = []
    for plane in range(CODES_PER_BYTE):
        if not biased:
            shifted = lax.shift_right_logical(codes, plane * CODE_BITS) if plane else codes
            planes.append((shifted & CODE_MASK).astype(jnp.bfloat16))
            continue
        shift = CODE_PLACE - plane * CODE_BITS  # bring the plane's two bits to CODE_PLACE
        shifted = (lax.shift_left(codes, shift) if shift > 0 else
                   lax.shift_right_logical(codes, -shift) if shift < 0 else codes)
        bits = (shifted & (CODE_MASK << CODE_PLACE)) | BF16_ONE_BITS
        planes.append(lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16))
    return jnp.concatenate(planes, axis=1)


def _int2_tier_kernel(
    page_table_ref,  # [B, NH] int32 (GMEM)
    history_tokens_ref,  # [B] int32 (GMEM)
    q_ref,  # [B, K, M, D] bfloat16 (GMEM)
    k_codes_ref,  # [(Y,) P, K, L, D/4] uint8 (GMEM)
    k_scale_ref,  # [(Y,) P, K, L] float16 (GMEM; one group per row)
    k_min_ref,  # [(Y,) P, K, L] float16
    v_codes_ref,  # [(Y,) P, K, L, D/4] uint8
    v_scale_ref,  # [(Y,) P, K, L] float16
    v_min_ref,  # [(Y,) P, K, L] float16
    o_ref,  # [B, K, S, D, R] float32 (GMEM): normalised partial outputs, transposed
    lse_ref,  # [B, K, S, R] float32 (GMEM): their log-sum-exp
    q_smem,  # [R, D] bfloat16, swizzled
    codes_smem,  # 2 × [STAGES, L, D/4] uint8: K, V codes
    meta_smem,  # 4 × [STAGES, L] float16: k_scale, k_min, v_scale, v_min
    values_smem,  # [BUFFERS, L, D] bfloat16, swizzled: a page's unpacked V codes
    probs_smem,  # [BUFFERS, R, L] bfloat16, swizzled: p·s_v transposed
    out_smem,  # [D, R] float32: oᵀ (a transposed float32 store does not lower: layout inference fails)
    lse_smem,  # [R] float32
    q_barrier,
    page_barriers,  # STAGES barriers of COPIES_PER_PAGE arrivals
    *,
    PAGE_SIZE: int,
    PAGES_PER_SPLIT: int,
    SCORE_SCALE: float,
    STAGES: int,
    LAYER: int | None,
    A_IN_REGISTERS: bool,
    BIASED_CODES: bool,
    BUFFERS: int,
    LAZY_SUMS: bool,
):
    b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    # With biased codes the dots run on u = OPERAND_BIAS + c·OPERAND_CODE_FACTOR: c = (u − bias)/factor.
    inv_factor = 1.0 / OPERAND_CODE_FACTOR if BIASED_CODES else 1.0
    rows, head_dim = q_smem.shape
    n_history = history_tokens_ref[b]
    first_slot = split * PAGES_PER_SPLIT
    last_slot = jnp.minimum(first_slot + PAGES_PER_SPLIT, (n_history + PAGE_SIZE - 1) // PAGE_SIZE)
    num_pages = jnp.maximum(last_slot - first_slot, 0)  # pages holding a valid token
    layer = () if LAYER is None else (LAYER,)
    k_codes_smem, v_codes_smem = codes_smem
    sources = (k_codes_ref, v_codes_ref, k_scale_ref, k_min_ref, v_scale_ref, v_min_ref)
    destinations = (k_codes_smem, v_codes_smem, *meta_smem)

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(0, rows)], q_smem, q_barrier)

    def fetch(page_index, stage):
        page = page_table_ref[b, first_slot + page_index]
        for src, dst in zip(sources, destinations):
            plgpu.copy_gmem_to_smem(src.at[(*layer, page, h)], dst.at[stage], page_barriers.at[stage])

    for stage in range(STAGES):
        pl.when(stage < num_pages)(functools.partial(fetch, stage, stage))
    plgpu.barrier_wait(q_barrier)

    # The ones tile in the last buffer: with two buffers, page 0 writes the other one before any
    # barrier has shown every warp past this wgmma.
    ones_smem = values_smem.at[BUFFERS - 1]
    ones_smem[...] = jnp.ones((PAGE_SIZE, head_dim), jnp.bfloat16)
    plgpu.commit_smem()

    def q_sums(acc_ref):  # every row: Σ_c q[r, c], in the score tile's layout
        plgpu.wgmma(acc_ref, ones_smem, q_smem.T)
        return acc_ref[...]

    q_sum = pl.run_scoped(q_sums, plgpu.ACC((PAGE_SIZE, rows), jnp.float32)) * SCORE_SCALE  # [L, R]

    def body(i, carry):
        # oᵀ [D, R], running max [R], running sum [R] and the minimum term (LAZY_SUMS: both as
        # [L, R] tiles, summed over the tokens once after the loop; else the sum [R], no tile).
        out_t, m, l, minimum = carry
        stage = lax.rem(i, STAGES)
        buffer = lax.rem(i, BUFFERS) if BUFFERS > 1 else 0
        values, probs = values_smem.at[buffer], probs_smem.at[buffer]
        plgpu.barrier_wait(page_barriers.at[stage])
        k_hat = _unpack_planes(k_codes_smem.at[stage], BIASED_CODES)  # [L, D]
        if BUFFERS == 1:  # every warp is past the last page's wgmma before its operands are overwritten
            plgpu.commit_smem()  # (two buffers: page i − 2's wgmma, which the last barrier was past)
        if not A_IN_REGISTERS:  # the GPU interpreter's wgmma takes A from shared memory only
            values[...] = k_hat
            plgpu.commit_smem()

        def code_dots(acc_ref):  # q·c [L, R]
            plgpu.wgmma(acc_ref, k_hat if A_IN_REGISTERS else values, q_smem.T)
            return acc_ref[...]

        dots = pl.run_scoped(code_dots, plgpu.ACC((PAGE_SIZE, rows), jnp.float32))
        k_scale, k_min, v_scale, v_min = (ref.at[stage][...].astype(jnp.float32) for ref in meta_smem)
        token = lax.broadcasted_iota(jnp.int32, (PAGE_SIZE, rows), 0)
        valid = (first_slot + i) * PAGE_SIZE + token < n_history  # [L, R]
        # q·x̂ = s·q·c + m·Σq with q·c = (dots − bias·Σq)/factor: s/factor on the dots, the bias
        # with the minimum (m − bias·s/factor per token).
        k_scale = k_scale * inv_factor
        k_min = k_min - OPERAND_BIAS * k_scale if BIASED_CODES else k_min
        scores = (k_scale * SCORE_SCALE)[:, None] * dots + k_min[:, None] * q_sum
        scores = jnp.where(valid, scores, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(scores, axis=0))
        correction = jnp.exp2(m - m_new)
        p = jnp.where(valid, jnp.exp2(scores - m_new[None, :]), 0.0)  # [L, R]
        p_scaled = p * jnp.where(valid, (v_scale * inv_factor)[:, None], 0.0)  # stale metadata may be NaN
        min_terms = p * jnp.where(valid, v_min[:, None], 0.0)  # [L, R]
        p_scaled = p_scaled.astype(jnp.bfloat16)  # the values' dot operand
        if BIASED_CODES:  # its dot carries bias·Σ_t (p·s_v/factor), rounded as used
            min_terms = min_terms - OPERAND_BIAS * p_scaled.astype(jnp.float32)
        if LAZY_SUMS:  # no reduction over the tokens (across the warps) but the max, each page
            l = l * correction[None, :] + p
            minimum = minimum * correction[None, :] + min_terms
        else:
            l = l * correction + jnp.sum(p, axis=0)
            p_min = jnp.sum(min_terms, axis=0)  # [R]
        v_hat = _unpack_planes(v_codes_smem.at[stage], BIASED_CODES)  # [L, D]
        if not A_IN_REGISTERS:
            plgpu.commit_smem()  # every warp is past the scores' wgmma before V̂ overwrites K̂
        values[...] = v_hat
        probs.T[...] = p_scaled
        plgpu.commit_smem()  # the stores visible to wgmma; every warp has read this stage's slot

        @pl.when(i + STAGES < num_pages)
        def _refill():
            fetch(i + STAGES, stage)

        def values_dot(acc_ref):  # V̂ᵀ·(p·s_v) [D, R]
            plgpu.wgmma(acc_ref, values.T, probs.T)
            return acc_ref[...]

        # A fresh accumulator added to oᵀ (not an accumulator initialised with oᵀ: `pl.run_state`
        # discharges to a primitive the GPU interpreter does not run).
        values = pl.run_scoped(values_dot, plgpu.ACC((head_dim, rows), jnp.float32))
        if LAZY_SUMS:
            return out_t * correction[None, :] + values, m_new, l, minimum
        return out_t * correction[None, :] + p_min[None, :] + values, m_new, l, minimum

    tile = jnp.zeros((PAGE_SIZE, rows), jnp.float32)
    carry = (
        jnp.zeros((head_dim, rows), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        tile if LAZY_SUMS else jnp.zeros((rows,), jnp.float32),
        tile if LAZY_SUMS else jnp.zeros((rows,), jnp.float32),
    )
    out_t, m, l, minimum = lax.fori_loop(0, num_pages, body, carry)
    if LAZY_SUMS:  # one group per row: the minimum term is the same for every channel of a row
        l = jnp.sum(l, axis=0)
        out_t = out_t + jnp.sum(minimum, axis=0)[None, :]
    _write_partial(out_t, m, l, out_smem, lse_smem, o_ref.at[b, h, split], lse_ref.at[b, h, split])


def _write_partial(out_t, m, l, out_smem, lse_smem, o_ref, lse_ref):
    """Normalise oᵀ [D, R] by the running sum, the natural log-sum-exp of the running max (base-2
    units) and sum (rows with no token: o = 0, lse = −inf), and copy both to global memory."""
    nonempty = l > 0.0
    inv_l = 1.0 / jnp.where(nonempty, l, 1.0)
    lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * LN2, -jnp.inf)
    out_smem[...] = out_t * inv_l[None, :]
    lse_smem[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, o_ref)
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref)
    plgpu.wait_smem_to_gmem(0)


def _bf16_tier_kernel(
    page_table_ref,  # [B, NB] int32 (GMEM): sink slots, then recent slots
    sink_tokens_ref,  # [B] int32 (GMEM)
    recent_tokens_ref,  # [B] int32 (GMEM)
    q_ref,  # [B, K, M, D] bfloat16 (GMEM)
    k_ref,  # [(Y,) P, K, L, D] bfloat16 (GMEM)
    v_ref,  # [(Y,) P, K, L, D] bfloat16 (GMEM)
    o_ref,  # [B, K, S, D, R] float32 (GMEM): normalised partial outputs, transposed
    lse_ref,  # [B, K, S, R] float32 (GMEM)
    q_smem,  # [R, D] bfloat16, swizzled
    kv_smem,  # 2 × [STAGES, L, D] bfloat16, swizzled: K, V pages
    probs_smem,  # [BUFFERS, R, L] bfloat16, swizzled: pᵀ
    out_smem,  # [D, R] float32
    lse_smem,  # [R] float32
    q_barrier,
    page_barriers,  # STAGES barriers of 2 arrivals
    *,
    SINK_SLOTS: int,
    PAGE_SIZE: int,
    PAGES_PER_SPLIT: int,
    SCORE_SCALE: float,
    STAGES: int,
    LAYER: int | None,
    BUFFERS: int,
):
    """The BF16 tier (sink + recent pages) as the INT2 tier's kernel, the pages straight from the
    copies into wgmma: scores [L, R] = K [L, D] (A, shared memory) · qᵀ; oᵀ [D, R] += Vᵀ (the page
    read transposed as A) · p (pᵀ stored [R, L], K-major B). A page's slot is refilled one page
    later (the values' wgmma reads it), so STAGES − 1 pages are in flight during a page's work.
    Rows of a partly filled page may hold NaN (stale pool memory): they are zeroed in shared memory
    before the values' wgmma (0·NaN is NaN inside the MMA)."""
    b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    rows, head_dim = q_smem.shape
    n_sink, n_recent = sink_tokens_ref[b], recent_tokens_ref[b]
    recent_pages = (n_recent + PAGE_SIZE - 1) // PAGE_SIZE
    slot_end = jnp.where(recent_pages > 0, SINK_SLOTS + recent_pages, (n_sink + PAGE_SIZE - 1) // PAGE_SIZE)
    first_slot = split * PAGES_PER_SPLIT
    num_pages = jnp.maximum(jnp.minimum(first_slot + PAGES_PER_SPLIT, slot_end) - first_slot, 0)
    layer = () if LAYER is None else (LAYER,)
    k_smem, v_smem = kv_smem

    def tokens_in(slot):  # valid tokens of a table slot (0 … L)
        is_sink = slot < SINK_SLOTS
        start = jnp.where(is_sink, slot, slot - SINK_SLOTS) * PAGE_SIZE
        return jnp.clip(jnp.where(is_sink, n_sink, n_recent) - start, 0, PAGE_SIZE)

    def fetch(page_index, stage):
        slot = first_slot + page_index
        page = jnp.where(tokens_in(slot) > 0, page_table_ref[b, slot], 0)  # never an unused slot's id
        for src, dst in ((k_ref, k_smem), (v_ref, v_smem)):
            plgpu.copy_gmem_to_smem(src.at[(*layer, page, h)], dst.at[stage], page_barriers.at[stage])

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(0, rows)], q_smem, q_barrier)
    for stage in range(STAGES):
        pl.when(stage < num_pages)(functools.partial(fetch, stage, stage))
    plgpu.barrier_wait(q_barrier)

    def body(i, carry):
        out_t, m, l = carry
        stage = lax.rem(i, STAGES)
        probs = probs_smem.at[lax.rem(i, BUFFERS) if BUFFERS > 1 else 0]
        plgpu.barrier_wait(page_barriers.at[stage])

        def key_dots(acc_ref):  # q·k [L, R]
            plgpu.wgmma(acc_ref, k_smem.at[stage], q_smem.T)
            return acc_ref[...]

        scores = pl.run_scoped(key_dots, plgpu.ACC((PAGE_SIZE, rows), jnp.float32)) * SCORE_SCALE
        count = tokens_in(first_slot + i)
        valid = lax.broadcasted_iota(jnp.int32, (PAGE_SIZE, rows), 0) < count
        scores = jnp.where(valid, scores, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(scores, axis=0))
        correction = jnp.exp2(m - m_new)
        p = jnp.where(valid, jnp.exp2(scores - m_new[None, :]), 0.0)
        l = l * correction + jnp.sum(p, axis=0)
        if BUFFERS == 1:
            plgpu.commit_smem()  # every warp is past the last page's values wgmma

        @pl.when(count < PAGE_SIZE)
        def _zero_stale_rows():
            v = v_smem.at[stage][...]
            row = lax.broadcasted_iota(jnp.int32, (PAGE_SIZE, head_dim), 0)
            v_smem.at[stage][...] = jnp.where(row < count, v, jnp.zeros_like(v))

        probs.T[...] = p.astype(jnp.bfloat16)
        plgpu.commit_smem()  # the stores visible to wgmma; every warp past page i − 1's values wgmma

        @pl.when(jnp.logical_and(i >= 1, i - 1 + STAGES < num_pages))
        def _refill():  # page i − 1's slot, free now
            fetch(i - 1 + STAGES, lax.rem(i - 1 + STAGES, STAGES))

        def values_dot(acc_ref):  # Vᵀ·p [D, R]
            plgpu.wgmma(acc_ref, v_smem.at[stage].T, probs.T)
            return acc_ref[...]

        values = pl.run_scoped(values_dot, plgpu.ACC((head_dim, rows), jnp.float32))
        return out_t * correction[None, :] + values, m_new, l

    carry = (
        jnp.zeros((head_dim, rows), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    out_t, m, l = lax.fori_loop(0, num_pages, body, carry)
    _write_partial(out_t, m, l, out_smem, lse_smem, o_ref.at[b, h, split], lse_ref.at[b, h, split])


def _compiler_params(auto_barriers: bool):
    """Mosaic GPU's compiler parameters. auto_barriers=False: no warpgroup barrier before and after
    every shared-memory store and before every copy issue (Mosaic's conservative default: 13 of
    the INT2 loop's 18 barriers a page in its lowered form at 65b5ddd — 2 per store of V̂ and pᵀ, 1 per
    each of the six copies of a refill). The kernels order their shared memory themselves:
    `plgpu.commit_smem` (a fence and a warpgroup barrier) after the reads of a slot and before its
    refill, after the stores of wgmma operands and before the wgmma, and before operands are
    overwritten (one buffer) — the cross-warp reductions keep their own barriers."""
    return plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=not auto_barriers)


def check_supported(q_dtype, head_dim: int, group_size: int, page_size: int, rows: int) -> None:
    """NotImplementedError naming what this kernel does not cover (yet)."""
    if jnp.dtype(q_dtype) != jnp.dtype(jnp.bfloat16):
        raise NotImplementedError(f"the Mosaic GPU INT2 tier takes bfloat16 q (wgmma operands), got {q_dtype}")
    if group_size != head_dim or head_dim not in (64, 128, 256):
        raise NotImplementedError(f"the Mosaic GPU INT2 tier needs one group per row (group_size == head_dim in "
                                  f"(64, 128, 256)), got group_size={group_size}, head_dim={head_dim}")
    if page_size % WGMMA_M:
        raise NotImplementedError(f"page_size={page_size} must be a multiple of {WGMMA_M} (wgmma's M)")
    if rows % WGMMA_MIN_N or rows > 256:
        raise NotImplementedError(f"rows={rows} must be a multiple of {WGMMA_MIN_N} and <= 256 (wgmma's N)")


def int2_tier_partials(
    q,  # [B, K, M, D] bfloat16
    k_codes,  # [(Y,) P, K, L, D/4] uint8
    k_scale,  # [(Y,) P, K, L, D/G] float16
    k_min,  # [(Y,) P, K, L, D/G] float16
    v_codes,  # [(Y,) P, K, L, D/4] uint8
    v_scale,  # [(Y,) P, K, L, D/G] float16
    v_min,  # [(Y,) P, K, L, D/G] float16
    page_table,  # [B, NH] int32
    history_tokens,  # [B] int32
    *,
    group_size: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int = 1,
    block_m: int = WGMMA_MIN_N,
    interpret: bool = False,
    layer: int | None = None,
    rows: int | None = None,
    stages: int = DEFAULT_STAGES,
    transposed: bool = False,
    a_in_registers: bool | None = None,
    biased_codes: bool = False,
    buffers: int = 1,
    lazy_sums: bool = False,
    auto_barriers: bool = True,
    **triton_launch,
):
    """Partials over the INT2 tier: (o float32[B, K, S, R, D], lse float32[B, K, S, R]), S =
    num_splits(NH, pages_per_split), R = `rows` (default block_m): q's first R rows of each KV head.

    Same arguments as `oscar_jax.kernels.decode_attention.int2_tier_partials`; the Triton lowering's
    launch knobs (num_warps, num_stages, unpack_asm, fma_asm, tokens_on_m, channels_on_m,
    max_registers) are accepted and ignored: this kernel always takes the tokens on M, the channels
    on M for the values, one warpgroup. `pages_per_block` must be 1 (one page of ≥ 64 tokens is
    one wgmma tile). `stages`: pages in flight per program. `transposed`: return o as the kernel
    writes it, oᵀ float32[B, K, S, D, R] (no XLA transpose after the kernel). `a_in_registers`: the
    scores' wgmma takes the unpacked K codes from registers (None → compiled only: the GPU
    interpreter's wgmma reads A from shared memory, so interpret mode stores them there first).
    `biased_codes`: unpack the codes to OPERAND_BIAS + c·OPERAND_CODE_FACTOR with integer ops (True)
    or convert them (False; `_unpack_planes`). `buffers`: shared-memory buffers of the values' wgmma
    operands (2: a page's stores need no barrier before them, only the one after). `lazy_sums`: the
    running sum and the values' minimum term kept as [L, R] tiles and summed over the tokens once
    after the loop, so that a page reduces across the warps for its max only (each reduction
    over the tokens, axis 0 of the tile, goes through shared memory and two barriers).
    `auto_barriers`: False passes Mosaic GPU's `unsafe_no_auto_barriers` (`_compiler_params`). The
    defaults (False, 1, False, True) are the form compiled and checked on the GPU (benchmarks/results/
    probe_mosaic_decode_h100.json); the others pass the interpreter and the lowering, not yet run on
    a GPU. `interpret`: True runs the Mosaic GPU
    interpreter on the CPU (`plgpu.InterpretGPUParams()`; an InterpretGPUParams is passed through).
    """
    unknown = set(triton_launch) - {"num_warps", "num_stages", "unpack_asm", "fma_asm", "tokens_on_m",
                                    "channels_on_m", "max_registers"}
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    batch, num_kv_heads, q_rows, head_dim = q.shape
    rows = block_m if rows is None else rows
    if not 0 < rows <= q_rows:
        raise ValueError(f"rows={rows} must lie in (0, {q_rows}] (q's rows)")
    pool_shape = tuple(k_codes.shape) if layer is None else tuple(k_codes.shape[1:])
    _, _, page_size, packed = pool_shape
    check_supported(q.dtype, head_dim, group_size, page_size, rows)
    if pages_per_block != 1:
        raise NotImplementedError(f"pages_per_block={pages_per_block}: the Mosaic GPU kernel reads one page a step")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages={stages!r} must be a positive int")
    if buffers not in (1, 2):
        raise ValueError(f"buffers={buffers!r} must be 1 or 2")
    assert packed * CODES_PER_BYTE == head_dim and k_scale.shape[-1] == 1
    splits = num_splits(page_table.shape[1], pages_per_split)
    table_len = splits * pages_per_split
    page_table = jnp.pad(page_table, ((0, 0), (0, table_len - page_table.shape[1])))
    # One group per row: the metadata of a (page, head) is one contiguous [L] row (a free reshape).
    k_scale, k_min, v_scale, v_min = (x.reshape(x.shape[:-1]) for x in (k_scale, k_min, v_scale, v_min))
    stages = max(1, min(stages, pages_per_split))
    kernel = functools.partial(
        _int2_tier_kernel, PAGE_SIZE=page_size, PAGES_PER_SPLIT=pages_per_split,
        SCORE_SCALE=base2_score_scale(softmax_scale), STAGES=stages, LAYER=layer,
        A_IN_REGISTERS=(not interpret) if a_in_registers is None else bool(a_in_registers),
        BIASED_CODES=bool(biased_codes), BUFFERS=buffers, LAZY_SUMS=bool(lazy_sums))
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    elif interpret is False:
        interpret = None
    scratch = (
        plgpu.SMEM((rows, head_dim), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16)),  # q
        [plgpu.SMEM((stages, page_size, packed), jnp.uint8) for _ in range(2)],  # K, V codes
        [plgpu.SMEM((stages, page_size), jnp.float16) for _ in range(METADATA_COPIES)],
        plgpu.SMEM((buffers, page_size, head_dim), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16)),  # V̂
        plgpu.SMEM((buffers, rows, page_size), jnp.bfloat16, transforms=_swizzled(jnp.bfloat16)),  # (p·s_v)ᵀ
        plgpu.SMEM((head_dim, rows), jnp.float32),  # oᵀ
        plgpu.SMEM((rows,), jnp.float32),  # lse
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=COPIES_PER_PAGE, num_barriers=stages),
    )
    out_t, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, head_dim, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(batch, num_kv_heads, splits),
        grid_names=("b", "h", "s"),
        compiler_params=_compiler_params(auto_barriers),
        interpret=interpret,
        kernel_name=(f"oscar_int2_tier_mosaic_L{page_size}_R{rows}_split{pages_per_split}_stages{stages}"
                     + ("_a_regs" if kernel.keywords["A_IN_REGISTERS"] else "_a_smem")
                     + ("_biased" if biased_codes else "_converted") + f"_buffers{buffers}"
                     + ("_lazy" if lazy_sums else "") + ("" if auto_barriers else "_own_barriers")),
    )(page_table, history_tokens, q, k_codes, k_scale, k_min, v_codes, v_scale, v_min)
    return (out_t if transposed else jnp.swapaxes(out_t, -1, -2)), lse


def bf16_tier_partials(
    q,  # [B, K, M, D] bfloat16
    k_bf16,  # [(Y,) P, K, L, D] bfloat16
    v_bf16,  # [(Y,) P, K, L, D] bfloat16
    page_table,  # [B, NB] int32
    sink_tokens,  # [B] int32
    recent_tokens,  # [B] int32
    *,
    sink_slots: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int = 1,
    block_m: int = WGMMA_MIN_N,
    interpret: bool = False,
    layer: int | None = None,
    rows: int | None = None,
    stages: int = DEFAULT_STAGES,
    transposed: bool = False,
    buffers: int = 1,
    auto_barriers: bool = True,
    **triton_launch,
):
    """Partials over the BF16 tier (sink + recent pages): (o float32[B, K, S, R, D], lse
    float32[B, K, S, R]), S = num_splits(NB, pages_per_split), R = `rows` (default block_m).

    Same arguments as `oscar_jax.kernels.decode_attention.bf16_tier_partials` (its Triton launch
    knobs num_warps, num_stages accepted and ignored), plus `rows`, `stages` (≥ 2: a slot is
    refilled one page after it was read), `transposed`, `buffers` and `auto_barriers` as the INT2
    tier's. Not yet
    run on a GPU (interpreter and lowering only)."""
    unknown = set(triton_launch) - {"num_warps", "num_stages"}
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    batch, num_kv_heads, q_rows, head_dim = q.shape
    rows = block_m if rows is None else rows
    if not 0 < rows <= q_rows:
        raise ValueError(f"rows={rows} must lie in (0, {q_rows}] (q's rows)")
    pool_shape = tuple(k_bf16.shape) if layer is None else tuple(k_bf16.shape[1:])
    _, _, page_size, _ = pool_shape
    check_supported(q.dtype, head_dim, head_dim, page_size, rows)
    if pages_per_block != 1:
        raise NotImplementedError(f"pages_per_block={pages_per_block}: the Mosaic GPU kernel reads one page a step")
    if not isinstance(stages, int) or stages < 2:
        raise ValueError(f"stages={stages!r} must be an int >= 2 (a slot is refilled one page after its read)")
    if buffers not in (1, 2):
        raise ValueError(f"buffers={buffers!r} must be 1 or 2")
    splits = num_splits(page_table.shape[1], pages_per_split)
    table_len = splits * pages_per_split
    page_table = jnp.pad(page_table, ((0, 0), (0, table_len - page_table.shape[1])))
    stages = max(2, min(stages, pages_per_split + 1))
    kernel = functools.partial(
        _bf16_tier_kernel, SINK_SLOTS=sink_slots, PAGE_SIZE=page_size, PAGES_PER_SPLIT=pages_per_split,
        SCORE_SCALE=base2_score_scale(softmax_scale), STAGES=stages, LAYER=layer, BUFFERS=buffers)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    elif interpret is False:
        interpret = None
    swizzled = _swizzled(jnp.bfloat16)
    scratch = (
        plgpu.SMEM((rows, head_dim), jnp.bfloat16, transforms=swizzled),  # q
        [plgpu.SMEM((stages, page_size, head_dim), jnp.bfloat16, transforms=swizzled) for _ in range(2)],  # K, V
        plgpu.SMEM((buffers, rows, page_size), jnp.bfloat16, transforms=swizzled),  # pᵀ
        plgpu.SMEM((head_dim, rows), jnp.float32),  # oᵀ
        plgpu.SMEM((rows,), jnp.float32),  # lse
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    )
    out_t, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, head_dim, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(batch, num_kv_heads, splits),
        grid_names=("b", "h", "s"),
        compiler_params=_compiler_params(auto_barriers),
        interpret=interpret,
        kernel_name=(f"oscar_bf16_tier_mosaic_L{page_size}_R{rows}_split{pages_per_split}_stages{stages}"
                     f"_buffers{buffers}" + ("" if auto_barriers else "_own_barriers")),
    )(page_table, sink_tokens, recent_tokens, q, k_bf16, v_bf16)
    return (out_t if transposed else jnp.swapaxes(out_t, -1, -2)), lse


def decode_attention(
    q,  # [B, Hq, D] bfloat16, rotated
    k_bf16, v_bf16,  # [(Y,) P, K, L, D] bfloat16
    k_codes, k_scale, k_min, v_codes, v_scale, v_min,  # [(Y,) P, K, L, ·] the INT2 pools
    bf16_page_table,  # [B, NB] int32
    sink_tokens, recent_tokens,  # [B] int32
    history_page_table,  # [B, NH] int32
    history_tokens,  # [B] int32
    *,
    sink_slots: int,
    group_size: int,
    softmax_scale: float,
    pages_per_split: int | None = None,
    interpret: bool = False,
    layer: int | None = None,
    int2_options: tuple = (),
    bf16_options: tuple = (),
):
    """Decode attention over the mixed-tier cache with both tiers on Mosaic GPU: float32 [B, Hq, D].

    The arguments of `oscar_jax.attention_ops.decode_attention` (the cache of one layer, or a
    static `layer` of stacked pools; the Triton launch knobs left out). The splits are the default
    decode splits (`shared_math.tiling.resolve_splits`); each tier attends the GQA group's rows
    padded to `shared_math.tiling.int2_decode_rows`; the merge is the Triton-lowered
    `merge_tier_partials` (interpreted with `interpret`). `int2_options` / `bf16_options`: extra
    keyword arguments of the tiers (pairs, e.g. (("biased_codes", True),)). Not the default path:
    validation is the caller's (the public op validates).
    """
    from oscar_jax.kernels.decode_attention import merge_tier_partials
    from shared_math.tiling import int2_decode_rows, resolve_splits

    batch, q_heads, head_dim = q.shape
    pool_shape = tuple(k_bf16.shape) if layer is None else tuple(k_bf16.shape[1:])
    _, num_kv_heads, page_size, _ = pool_shape
    heads_per_kv = q_heads // num_kv_heads
    history_slots, bf16_slots = history_page_table.shape[1], bf16_page_table.shape[1]
    pages_per_split, bf16_pages_per_split, _ = resolve_splits(
        pages_per_split, 1, bf16_slots, history_slots, page_size, sequence_heads=batch * num_kv_heads)
    rows = int2_decode_rows(heads_per_kv)
    q_rows = q.reshape(batch, num_kv_heads, heads_per_kv, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - heads_per_kv), (0, 0)))
    common = dict(softmax_scale=softmax_scale, block_m=rows, rows=rows, interpret=interpret, layer=layer)
    tiers = [bf16_tier_partials(q_rows, k_bf16, v_bf16, bf16_page_table, sink_tokens, recent_tokens,
                                sink_slots=sink_slots, pages_per_split=bf16_pages_per_split, **common,
                                **dict(bf16_options))]
    if history_slots > 0:
        tiers.append(int2_tier_partials(q_rows, k_codes, k_scale, k_min, v_codes, v_scale, v_min, history_page_table,
                                        history_tokens, group_size=group_size, pages_per_split=pages_per_split,
                                        **common, **dict(int2_options)))
    o = merge_tier_partials(tiers, heads_per_kv, interpret=bool(interpret))
    return o.reshape(batch, q_heads, head_dim)
