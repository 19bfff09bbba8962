"""The Mosaic GPU decode tiers (oscar_jax.kernels.mosaic.decode_attention, issue 41) against the
Triton-lowered tiers (oscar_jax.kernels.decode_attention) and the float64 reference.

On the CPU the Mosaic kernel runs in the Mosaic GPU interpreter (plgpu.InterpretGPUParams), the
Triton-lowered one in Pallas interpret mode. The caches are test_decode_attention's: poisoned
(page 0, spare pages and the unused rows of the last page hold NaN metadata and random codes),
page ids shuffled, so a read of a token that is not valid turns the output into NaN. The
interpreter does not apply Mosaic GPU's lowering rules, so each configuration is also lowered for
the GPU (`lower(lowering_platforms=("cuda",))` runs on a CPU-only jaxlib): layout inference and the
wgmma shape checks run there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax.kernels.decode_attention import bf16_tier_partials as triton_bf16_tier_partials
from oscar_jax.kernels.decode_attention import int2_tier_partials as triton_int2_tier_partials
from oscar_jax.kernels.mosaic.decode_attention import bf16_tier_partials, int2_tier_partials
from oscar_jax.tests.test_decode_attention import TOLERANCES, build_cache, merge_partials, reference_decode

PAGE = 64  # wgmma's M: the Mosaic kernel's page size
HEAD_DIM = 128
SCALE = HEAD_DIM**-0.5


def _gqa_query(rng, batch, num_kv_heads, heads_per_kv, rows=16):
    """q [B, K, rows, D] bfloat16: the GQA group's heads_per_kv query heads, then zero padding rows."""
    q = np.zeros((batch, num_kv_heads, rows, HEAD_DIM), np.float32)
    q[:, :, :heads_per_kv] = rng.standard_normal((batch, num_kv_heads, heads_per_kv, HEAD_DIM))
    return jnp.asarray(q, jnp.bfloat16)


@pytest.fixture(scope="module")
def gqa_case():
    """GQA 4:1, two KV heads, three sequences of odd lengths (several INT2 pages, the last page
    partly filled; one sequence cut 5 tokens short with real codes in the cut rows), pages_per_split
    2 so that splits are full, partial and empty."""
    rng = np.random.default_rng(41)
    cache = build_cache(rng, (395, 203, 519), num_kv_heads=2, head_dim=HEAD_DIM, group_size=HEAD_DIM,
                        page_size=PAGE, recent=64)
    pools, (table, history) = cache.arrays[2:8], cache.arrays[11:13]
    history = history.at[0].add(-5)
    q = _gqa_query(rng, 3, 2, 4)
    common = dict(group_size=HEAD_DIM, softmax_scale=SCALE, pages_per_split=2, pages_per_block=1, block_m=8, rows=8)
    want = triton_int2_tier_partials(q, *pools, table, history, interpret=True, tokens_on_m=True, **common)
    got = int2_tier_partials(q, *pools, table, history, interpret=True, **common)
    return dict(cache=cache, q=q, pools=pools, table=table, history=history, common=common,
                want=tuple(map(np.asarray, want)), got=tuple(map(np.asarray, got)))


def test_partials_match_the_triton_lowered_int2_tier(gqa_case):
    """Same splits empty (lse = −inf, o = 0), lse and o within the bfloat16 attention tolerance of the
    Triton-lowered kernel's (both round p·s_v to bfloat16 before the values' dot; the Mosaic kernel
    takes exact codes where the Triton kernel takes 128 + code and cancels the bias)."""
    (o_want, lse_want), (o_got, lse_got) = gqa_case["want"], gqa_case["got"]
    assert o_got.shape == o_want.shape and lse_got.shape == lse_want.shape
    nonempty = np.isfinite(lse_want)
    assert nonempty.sum() > 8 and (~nonempty).sum() > 0  # full, partial and empty splits
    np.testing.assert_array_equal(np.isfinite(lse_got), nonempty)
    assert np.all(np.isfinite(o_got)), "non-finite output: a masked (poisoned) token was read"
    np.testing.assert_array_equal(o_got[~nonempty], 0.0)
    np.testing.assert_allclose(lse_got[nonempty], lse_want[nonempty], atol=1e-3, rtol=1e-4)
    np.testing.assert_allclose(o_got, o_want, **TOLERANCES[jnp.bfloat16])
    assert np.abs(o_want[nonempty]).max() > 0.1  # the outputs compared are not all zero


def test_partials_merge_to_the_float64_reference(gqa_case):
    """The INT2 tier's partials merged with the BF16 tier's (reference math on the sink and recent
    tokens, done here in float64) equal attention over the dequantized cache: the Mosaic partials
    are the INT2 tier's exact share, not merely close to the Triton kernel's."""
    cache, q = gqa_case["cache"], gqa_case["q"]
    o_int2, lse_int2 = gqa_case["got"]
    want = reference_decode(q[:, :, :4].reshape(3, 8, HEAD_DIM), cache, SCALE)  # [B, Hq, D]
    # The BF16 tier in float64 as partials of one split: per (b, kv head, row) its softmax over the
    # sink and recent tokens.
    qf = np.asarray(q.astype(jnp.float32), np.float64)
    o_bf16 = np.zeros((3, 2, 1, 8, HEAD_DIM))
    lse_bf16 = np.full((3, 2, 1, 8), -np.inf)
    for b, tiers in enumerate(cache.sequences):
        keys = np.concatenate([tiers.sink[0], tiers.recent[0]]).astype(np.float64)  # [S, K, D]
        values = np.concatenate([tiers.sink[1], tiers.recent[1]]).astype(np.float64)
        for h in range(2):
            scores = qf[b, h, :8] @ keys[:, h].T * SCALE  # [8, S]
            top = scores.max(axis=1, keepdims=True)
            weights = np.exp(scores - top)
            o_bf16[b, h, 0] = weights @ values[:, h] / weights.sum(axis=1, keepdims=True)
            lse_bf16[b, h, 0] = (top[:, 0] + np.log(weights.sum(axis=1)))
    merged, _ = merge_partials(jnp.concatenate([jnp.asarray(o_bf16, jnp.float32), jnp.asarray(o_int2)], axis=2),
                               jnp.concatenate([jnp.asarray(lse_bf16, jnp.float32), jnp.asarray(lse_int2)], axis=2))
    got = np.asarray(merged)[:, :, :4].reshape(3, 8, HEAD_DIM)
    # The reference drops the 5 cut tokens of sequence 0 only if the cache does; compare the rest.
    np.testing.assert_allclose(got[1:], want[1:], **TOLERANCES[jnp.bfloat16])


def test_transposed_output_and_layered_pools(gqa_case):
    """`transposed=True` returns oᵀ as written (the default's swapaxes of it), and stacked pools read
    at a static `layer` give the per-layer call's partials bit for bit."""
    q, pools, table, history, common = (gqa_case[k] for k in ("q", "pools", "table", "history", "common"))
    o_t, lse = int2_tier_partials(q[:1], *pools, table[:1], history[:1], interpret=True, transposed=True, **common)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(o_t), -1, -2), gqa_case["got"][0][:1])
    stacked = [jnp.stack([jnp.zeros_like(p), p]) for p in pools]
    o_layer, lse_layer = int2_tier_partials(q[:1], *stacked, table[:1], history[:1], interpret=True, layer=1,
                                            **common)
    np.testing.assert_array_equal(np.asarray(o_layer), gqa_case["got"][0][:1])
    np.testing.assert_array_equal(np.asarray(lse_layer), np.asarray(lse))


def test_biased_codes_double_buffers_and_lazy_sums_give_the_same_partials(gqa_case):
    """The codes unpacked as 1 + c/4 by integer ops (`biased_codes`), the values' operands in two
    buffers and the sums kept as tiles (`lazy_sums`) give the default's partials up to float32
    rounding (the bias is taken out exactly in real arithmetic; the float32 sums differ in order)."""
    q, pools, table, history, common = (gqa_case[k] for k in ("q", "pools", "table", "history", "common"))
    o_want, lse_want = gqa_case["got"]
    nonempty = np.isfinite(lse_want)
    for biased_codes, buffers, lazy_sums in ((True, 2, True), (False, 2, False), (False, 1, True)):
        o, lse = map(np.asarray, int2_tier_partials(q, *pools, table, history, interpret=True,
                                                    biased_codes=biased_codes, buffers=buffers, lazy_sums=lazy_sums,
                                                    **common))
        np.testing.assert_array_equal(np.isfinite(lse), nonempty)
        np.testing.assert_allclose(lse[nonempty], lse_want[nonempty], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(o, o_want, rtol=1e-4, atol=1e-4)


def test_no_race_between_the_copies_and_the_warpgroup():
    """The interpreter's race detector (copy engine vs the warpgroup's reads and writes) finds none
    with one stage (every page's slot refilled right after it is read) and with two buffers."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    rng = np.random.default_rng(7)
    cache = build_cache(rng, (330,), num_kv_heads=1, head_dim=HEAD_DIM, group_size=HEAD_DIM, page_size=PAGE,
                        recent=64)
    q = _gqa_query(rng, 1, 1, 4, rows=8)
    for stages, buffers in ((1, 1), (2, 2)):
        o, _ = int2_tier_partials(q, *cache.arrays[2:8], *cache.arrays[11:13], group_size=HEAD_DIM,
                                  softmax_scale=SCALE, pages_per_split=4, stages=stages, buffers=buffers,
                                  biased_codes=True, interpret=plgpu.InterpretGPUParams(detect_races=True))
        jax.block_until_ready(o)
        assert not gpu_callbacks.get_races().races_found, (stages, buffers)


@pytest.mark.parametrize("a_in_registers,biased_codes,buffers,lazy_sums,auto_barriers",
                         [(True, False, 1, False, True), (False, False, 1, False, True),
                          (True, True, 2, True, False), (True, True, 1, True, False)],
                         ids=["a_regs", "a_smem", "a_regs_biased_2buf_lazy_own", "a_regs_biased_1buf_lazy_own"])
def test_lowers_for_the_gpu(a_in_registers, biased_codes, buffers, lazy_sums, auto_barriers):
    """Both forms of the scores' wgmma (A from registers: the compiled default; from shared memory:
    what the interpreter runs), with converted or biased codes and one or two buffers, pass Mosaic
    GPU's layout inference and lowering, at Qwen3-8B's shapes (8 KV heads, d 128, G 128, pages of
    64, 8 rows) with two stages."""
    q = jax.ShapeDtypeStruct((2, 8, 16, HEAD_DIM), jnp.bfloat16)
    codes = jax.ShapeDtypeStruct((40, 8, PAGE, HEAD_DIM // 4), jnp.uint8)
    meta = jax.ShapeDtypeStruct((40, 8, PAGE, 1), jnp.float16)
    table = jax.ShapeDtypeStruct((2, 7), jnp.int32)
    history = jax.ShapeDtypeStruct((2,), jnp.int32)

    def call(*args):
        return int2_tier_partials(*args, group_size=HEAD_DIM, softmax_scale=SCALE, pages_per_split=4, rows=8,
                                  stages=2, a_in_registers=a_in_registers, biased_codes=biased_codes,
                                  buffers=buffers, lazy_sums=lazy_sums, auto_barriers=auto_barriers)

    text = jax.jit(call).trace(q, codes, meta, meta, codes, meta, meta, table, history).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_unsupported_configurations_are_named():
    """float32 q, several groups per row, pages that are not a multiple of 64, and blocks of pages
    raise NotImplementedError naming the value; unknown keywords a TypeError."""
    q = jnp.zeros((1, 1, 8, HEAD_DIM), jnp.bfloat16)
    codes = jnp.zeros((2, 1, PAGE, HEAD_DIM // 4), jnp.uint8)
    meta = jnp.zeros((2, 1, PAGE, 1), jnp.float16)
    table, history = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32)
    common = dict(group_size=HEAD_DIM, softmax_scale=SCALE, pages_per_split=1)
    with pytest.raises(NotImplementedError, match="bfloat16 q"):
        int2_tier_partials(q.astype(jnp.float32), codes, meta, meta, codes, meta, meta, table, history, **common)
    meta2 = jnp.zeros((2, 1, PAGE, 2), jnp.float16)
    with pytest.raises(NotImplementedError, match="group_size=64"):
        int2_tier_partials(q, codes, meta2, meta2, codes, meta2, meta2, table, history, **dict(common, group_size=64))
    small = jnp.zeros((2, 1, 32, HEAD_DIM // 4), jnp.uint8)
    small_meta = jnp.zeros((2, 1, 32, 1), jnp.float16)
    with pytest.raises(NotImplementedError, match="page_size=32"):
        int2_tier_partials(q, small, small_meta, small_meta, small, small_meta, small_meta, table, history, **common)
    with pytest.raises(NotImplementedError, match="pages_per_block=2"):
        int2_tier_partials(q, codes, meta, meta, codes, meta, meta, table, history, **dict(common, pages_per_block=2,
                                                                                          pages_per_split=2))
    with pytest.raises(ValueError, match="buffers=3 must be 1 or 2"):
        int2_tier_partials(q, codes, meta, meta, codes, meta, meta, table, history, buffers=3, **common)
    with pytest.raises(TypeError, match="bogus"):
        int2_tier_partials(q, codes, meta, meta, codes, meta, meta, table, history, bogus=1, **common)


def test_bf16_tier_partials_match_the_triton_lowered_bf16_tier():
    """The BF16 tier (sink + recent pages) on a poisoned cache: a sequence with sink and three
    recent pages (the last partly filled, its stale rows NaN), one whose recent window is empty and
    one shorter than the sink; GQA 4:1 rows; one or two probability buffers. Same empty splits, lse
    and o within the bfloat16 tolerance of the Triton-lowered kernel's, every output finite."""
    rng = np.random.default_rng(36)
    cache = build_cache(rng, (395, 203, 40), num_kv_heads=2, head_dim=HEAD_DIM, group_size=HEAD_DIM,
                        page_size=PAGE, recent=128)
    k, v, table, sink, recent = cache.arrays[:2] + cache.arrays[8:11]
    assert int(np.asarray(recent).min()) == 0 and int(np.asarray(sink).min()) < PAGE  # the edges above
    q = _gqa_query(rng, 3, 2, 4, rows=8)
    common = dict(sink_slots=1, softmax_scale=SCALE, pages_per_split=2, pages_per_block=1, block_m=8)
    o_want, lse_want = map(np.asarray, triton_bf16_tier_partials(q, k, v, table, sink, recent, interpret=True,
                                                                 **common))
    nonempty = np.isfinite(lse_want)
    assert nonempty.sum() > 8 and (~nonempty).sum() > 0
    for buffers in (1, 2):
        o, lse = map(np.asarray, bf16_tier_partials(q, k, v, table, sink, recent, interpret=True, buffers=buffers,
                                                    **common))
        np.testing.assert_array_equal(np.isfinite(lse), nonempty)
        assert np.all(np.isfinite(o)), "non-finite output: a stale (NaN) row reached the values' wgmma"
        np.testing.assert_allclose(lse[nonempty], lse_want[nonempty], atol=1e-3, rtol=1e-4)
        np.testing.assert_allclose(o, o_want, **TOLERANCES[jnp.bfloat16])


@pytest.mark.parametrize("buffers,auto_barriers", [(1, True), (2, False)])
def test_bf16_tier_lowers_for_the_gpu(buffers, auto_barriers):
    """The BF16 tier passes layout inference and lowering at Qwen3-8B's shapes."""
    q = jax.ShapeDtypeStruct((2, 8, 16, HEAD_DIM), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((40, 8, PAGE, HEAD_DIM), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

    def call(*args):
        return bf16_tier_partials(*args, sink_slots=1, softmax_scale=SCALE, pages_per_split=1, rows=8, stages=2,
                                  buffers=buffers, auto_barriers=auto_barriers)

    text = jax.jit(call).trace(q, pool, pool, table, lengths, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_bf16_tier_refuses_one_stage():
    q = jnp.zeros((1, 1, 8, HEAD_DIM), jnp.bfloat16)
    pool = jnp.zeros((2, 1, PAGE, HEAD_DIM), jnp.bfloat16)
    table, lengths = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="stages=1 must be an int >= 2"):
        bf16_tier_partials(q, pool, pool, table, lengths, lengths, sink_slots=1, softmax_scale=SCALE,
                           pages_per_split=1, stages=1)


@pytest.mark.parametrize("options", [(), (("biased_codes", True), ("buffers", 2), ("lazy_sums", True))],
                         ids=["default", "biased_2buf_lazy"])
def test_decode_attention_with_both_mosaic_tiers_matches_the_float64_reference(options):
    """Both Mosaic tiers and the merge, as one decode call, against attention over the dequantized
    cache in float64 (GQA 4:1, odd lengths, a sequence shorter than the sink, poisoned pools)."""
    from oscar_jax.kernels.mosaic.decode_attention import decode_attention

    rng = np.random.default_rng(1)
    cache = build_cache(rng, (395, 203, 40), num_kv_heads=2, head_dim=HEAD_DIM, group_size=HEAD_DIM,
                        page_size=PAGE, recent=128)
    q = jnp.asarray(rng.standard_normal((3, 8, HEAD_DIM)), jnp.bfloat16)
    got = decode_attention(q, *cache.arrays, sink_slots=1, group_size=HEAD_DIM, softmax_scale=SCALE,
                           pages_per_split=2, interpret=True, int2_options=options,
                           bf16_options=tuple((k, v) for k, v in options if k == "buffers"))
    assert got.shape == (3, 8, HEAD_DIM) and np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got, np.float64), reference_decode(q, cache, SCALE),
                               **TOLERANCES[jnp.bfloat16])
