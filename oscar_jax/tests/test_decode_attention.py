"""Decode attention of the Pallas kernels over the paged mixed-tier cache: the Pallas-only claims
(page sizes, random lengths, jit, launch policy, compile checks). Decode vs the float64 reference,
every backend over parity_tests.cases.DECODE_CASES, is parity_tests/test_ops_attention.py's.

Caches come from parity_tests.cases.build_paged_cache, the generator both backends' attention tests
share (shared_math's codec.encode for the INT2 pages, tiers.tier_split for the tier boundaries),
with the data drawn from each test's rng; the kernels' output is compared with attention over the *dequantized* cache in
float64 (shared_math.attention.mixed_tier_decode_attention), so quantization error is never mistaken for kernel error. The pools are
poisoned: page 0, spare pages and the unused rows of partially filled pages hold NaN (codes hold
random bytes), and unused page-table entries point at page 0, so any read of a token that is not
valid turns the output into NaN. Page ids are shuffled.
"""

from __future__ import annotations

import dataclasses
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax.attention_ops import decode_attention, merge_partials
from parity_tests import cases
from parity_tests.backends import to_jax
from shared_math import attention as reference
from shared_math.spec import OscarConfig

pytestmark = pytest.mark.kernels("pallas")  # the Pallas kernels (interpret mode on CPU), not the XLA path

# The attention tolerance table (its derivation beside it: parity_tests.cases.ATTENTION_TOLERANCES),
# keyed here by the jnp dtype of q.
TOLERANCES = {jnp.float32: cases.ATTENTION_TOLERANCES["float32"], jnp.bfloat16: cases.ATTENTION_TOLERANCES["bfloat16"]}

PAGE_SIZE = 16
SINK = 64
SINK_SLOTS = SINK // PAGE_SIZE


@dataclasses.dataclass
class MixedCache:
    arrays: tuple  # the 13 cache arguments of decode_attention, in order (jax arrays)
    sequences: list[cases.SequenceTiers]  # each sequence's tiers, as the reference consumes them
    group_size: int


def build_cache(
    rng: np.random.Generator,
    lengths,
    *,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    recent: int = 32,
    spare_pages: int = 2,
    shape_for_lengths=None,
    page_size: int = PAGE_SIZE,
) -> MixedCache:
    """parity_tests.cases.build_paged_cache (the cache generator both backends' tests share: poisoned,
    shuffled pages) with its data drawn from `rng`, as jax arrays."""
    config = OscarConfig(head_dim=head_dim, group_size=group_size, sink=SINK, recent=recent, page_size=page_size)
    paged = cases.build_paged_cache(rng, lengths, config=config, num_kv_heads=num_kv_heads, spare_pages=spare_pages,
                                    shape_for_lengths=shape_for_lengths)
    return MixedCache(tuple(to_jax(a) for a in paged.pools() + paged.tables()), paged.sequences, group_size)


def reference_decode(q, cache: MixedCache, softmax_scale: float) -> np.ndarray:
    """float64 [B, Hq, D]: split-K attention over the dequantized cache."""
    q = np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)
    return np.stack([
        reference.mixed_tier_decode_attention(
            q[b], sink=tiers.sink, history=tiers.history, recent=tiers.recent,
            group_size=cache.group_size, softmax_scale=softmax_scale,
        )
        for b, tiers in enumerate(cache.sequences)
    ])


def assert_close(actual, expected, dtype) -> float:
    """Assert against TOLERANCES[dtype]; returns the max abs error (reported by the tests)."""
    actual = np.asarray(actual, np.float64)
    assert np.all(np.isfinite(actual)), "non-finite output: a masked (poisoned) token was read"
    np.testing.assert_allclose(actual, expected, **TOLERANCES[dtype])
    return float(np.max(np.abs(actual - expected)))


def random_query(rng, batch, q_heads, head_dim, dtype, *, spread=3.0):
    """Rotated queries; `spread` sharpens the softmax so a few tokens dominate (as in real models)."""
    return jnp.asarray(spread * rng.standard_normal((batch, q_heads, head_dim)), dtype)


# Page sizes other than 16: 8 (< the dot tile: the token-gather kernel) and 32 (whole-page kernel).
PAGE_SIZE_CASES = [(8, 2, 64, 32, jnp.float32), (8, 4, 128, 128, jnp.bfloat16), (32, 1, 128, 64, jnp.float32)]


@pytest.mark.parametrize("page_size,pages_per_block,head_dim,group_size,dtype", PAGE_SIZE_CASES)
def test_decode_other_page_sizes(page_size, pages_per_block, head_dim, group_size, dtype):
    rng = np.random.default_rng(page_size * 1000 + pages_per_block)
    lengths = (337, 5, 65, 200)
    cache = build_cache(rng, lengths, num_kv_heads=2, head_dim=head_dim, group_size=group_size, recent=32,
                        page_size=page_size)
    q = random_query(rng, len(lengths), 2 * 3, head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out = decode_attention(q, *cache.arrays, sink_slots=SINK // page_size, group_size=group_size,
                           softmax_scale=scale, pages_per_split=4, pages_per_block=pages_per_block)
    assert_close(out, reference_decode(q, cache, scale), dtype)


@hypothesis.settings(max_examples=15, deadline=None, derandomize=True)
@hypothesis.given(
    lengths=st.lists(st.integers(0, 420), min_size=3, max_size=3).filter(lambda ls: max(ls) > 0),
    seed=st.integers(0, 2**16),
)
def test_decode_random_lengths_fixed_shapes(lengths, seed):
    """Property: any mix of lengths (0 … 420, with a recent window of 48: every tier edge) at one
    set of array shapes (compiled once), with fresh page shuffles, matches the reference."""
    rng = np.random.default_rng(seed)
    cache = build_cache(
        rng, lengths, num_kv_heads=2, head_dim=64, group_size=32, recent=48, shape_for_lengths=(420,) * 3
    )
    q = random_query(rng, 3, 4, 64, jnp.float32)
    out = decode_attention(
        q, *cache.arrays, sink_slots=SINK_SLOTS, group_size=32, softmax_scale=0.125, pages_per_split=4
    )
    expected = reference_decode(q, cache, 0.125) if min(lengths) > 0 else None
    if expected is None:  # an empty sequence gets zeros; the others still match
        empty = np.asarray(lengths) == 0
        assert np.all(np.asarray(out)[empty] == 0)
        keep = [b for b in range(3) if lengths[b] > 0]
        cache.sequences = [cache.sequences[b] for b in keep]
        out, q = np.asarray(out)[keep], q[np.asarray(keep)]
        expected = reference_decode(q, cache, 0.125)
    assert_close(out, expected, jnp.float32)


def test_decode_is_deterministic():
    rng = np.random.default_rng(7)
    cache = build_cache(rng, (337, 65), num_kv_heads=2, head_dim=64, group_size=32)
    q = random_query(rng, 2, 6, 64, jnp.float32)
    kwargs = dict(sink_slots=SINK_SLOTS, group_size=32, softmax_scale=0.125, pages_per_split=4)
    run = lambda: np.asarray(decode_attention(q, *cache.arrays, **kwargs))  # noqa: E731
    first, second = run(), run()
    np.testing.assert_array_equal(first, second)


def test_decode_under_jit_and_unused_table_entries_ignored():
    """Out-of-range junk in every unused table slot changes nothing; the op composes with jit."""
    rng = np.random.default_rng(11)
    cache = build_cache(rng, (40, 321), num_kv_heads=1, head_dim=64, group_size=64)
    q = random_query(rng, 2, 2, 64, jnp.float32)
    kwargs = dict(sink_slots=SINK_SLOTS, group_size=64, softmax_scale=0.125)
    out = jax.jit(lambda q, *c: decode_attention(q, *c, **kwargs))(q, *cache.arrays)
    arrays = [np.array(a) for a in cache.arrays]
    bf16_table, sink_tokens, recent_tokens, history_table, history_tokens = arrays[8:13]
    for b in range(2):
        junk = (10**6, -(10**6))[b]
        bf16_table[b, -(-sink_tokens[b] // PAGE_SIZE) : SINK_SLOTS] = junk
        bf16_table[b, SINK_SLOTS - (-recent_tokens[b] // PAGE_SIZE) :] = junk
        history_table[b, history_tokens[b] // PAGE_SIZE :] = junk
    assert (bf16_table[0, 3] == 10**6) and (bf16_table[0, SINK_SLOTS] == 10**6)  # the sink is short
    with_junk = decode_attention(q, *[jnp.asarray(a) for a in arrays], **kwargs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(with_junk))
    assert_close(out, reference_decode(q, cache, 0.125), jnp.float32)


@pytest.mark.parametrize("tier_splits,block_splits,block_d", [
    ((1, 37), 8, 16), ((3,), 32, 32), ((2, 5), 32, 64), ((1, 64, 3), 16, 32)])
def test_merge_kernel_equals_merge_partials_over_the_tiers(tier_splits, block_splits, block_d):
    """The merge kernel (decode's) is merge_partials over the concatenated splits, kept rows only:
    empty splits (lse = −inf, o = NaN here) weigh zero, a row every split left empty gets 0,
    split counts need not divide the block, programs split the columns. float32, tolerance 1e-6
    (summation order)."""
    from oscar_jax.kernels.decode_attention import merge_tier_partials

    rng = np.random.default_rng(sum(tier_splits) * 100 + block_splits)
    batch, heads, rows, d, kept = 2, 3, 16, 64, 5
    tiers = []
    for splits in tier_splits:
        o = rng.standard_normal((batch, heads, splits, rows, d)).astype(np.float32)
        lse = (rng.standard_normal((batch, heads, splits, rows)) * 4).astype(np.float32)
        lse[rng.random(lse.shape) < 0.3] = -np.inf
        lse[0, 1, :, 2] = -np.inf  # row 2 of (0, 1): every split of every tier empty
        tiers.append((o, lse))
    with_nan = [(np.where(np.isinf(lse)[..., None], np.nan, o), lse) for o, lse in tiers]  # never read
    got = np.asarray(merge_tier_partials([(jnp.asarray(o), jnp.asarray(lse)) for o, lse in with_nan], kept,
                                         interpret=True, block_splits=block_splits, block_d=block_d))
    o_cat = np.concatenate([o for o, _ in tiers], axis=2)
    lse_cat = np.concatenate([lse for _, lse in tiers], axis=2)
    o_cat = np.where(np.isinf(lse_cat)[..., None], 0.0, o_cat)  # the reference multiplies 0·o
    want, _ = merge_partials(jnp.asarray(o_cat[..., :kept, :]), jnp.asarray(lse_cat[..., :kept]))
    assert got.shape == (batch, heads, kept, d)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.all(got[0, 1, 2] == 0.0)


# ---------------------------------------------------------------------------------------------
# Bad inputs → ValueError naming the value.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cache():
    rng = np.random.default_rng(5)
    cache = build_cache(rng, (65, 100), num_kv_heads=2, head_dim=64, group_size=32)
    q = random_query(rng, 2, 4, 64, jnp.float32)
    return q, cache


def _call(q, arrays, **overrides):
    kwargs = dict(sink_slots=SINK_SLOTS, group_size=32, softmax_scale=0.125)
    kwargs.update(overrides)
    return decode_attention(q, *arrays, **kwargs)


# The errors of bad cache arrays, static arguments and queries, every backend:
# parity_tests/test_ops_attention.py.


def test_small_head_dim_is_not_implemented():
    arrays = (
        jnp.zeros((1, 1, 16, 32), jnp.bfloat16), jnp.zeros((1, 1, 16, 32), jnp.bfloat16),
        jnp.zeros((1, 1, 16, 8), jnp.uint8), *(jnp.zeros((1, 1, 16, 1), jnp.float16),) * 2,
        jnp.zeros((1, 1, 16, 8), jnp.uint8), *(jnp.zeros((1, 1, 16, 1), jnp.float16),) * 2,
        jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32),
    )
    with pytest.raises(NotImplementedError, match="head_dim=32"):
        decode_attention(jnp.zeros((1, 1, 32)), *arrays, sink_slots=4, group_size=32, softmax_scale=1.0)


# ---------------------------------------------------------------------------------------------
# GPU lowering on CPU: interpret mode does not apply the Triton lowering's rules, so the kernels
# are also lowered for an H200 (jax's AOT path with an abstract device) and the Triton IR is
# compiled to a cubin by the triton package's own sm_90 pipeline (ptxas ships with it).
# This catches power-of-two violations, unsupported primitives, dot shapes and register
# spills without a GPU; XLA's embedded Triton is a different build, so a GPU smoke run is still
# the final word.
# ---------------------------------------------------------------------------------------------

def compile_triton_kernels_for_h200(fn, *args) -> dict[str, dict]:
    """{kernel name: {"registers", "spills", "shared", …}} of every Triton kernel in jax.jit(fn)(*args)."""
    pytest.importorskip("triton")
    from benchmarks.static_analysis import compile_pallas_for_h200

    return compile_pallas_for_h200(fn, *args)


@pytest.mark.parametrize(
    "head_dim,group_size,heads_per_kv,dtype,unpack_asm",
    [(128, 128, 4, jnp.bfloat16, False), (64, 16, 3, jnp.float32, False),
     (64, 16, 3, jnp.bfloat16, True)],  # the inline-PTX unpacker in the token-gather kernel (pages of 16)
)
def test_decode_kernels_compile_for_h200(head_dim, group_size, heads_per_kv, dtype, unpack_asm, int2_layout):
    rng = np.random.default_rng(0)
    cache = build_cache(rng, (337, 65), num_kv_heads=2, head_dim=head_dim, group_size=group_size)
    q = jnp.zeros((2, 2 * heads_per_kv, head_dim), dtype)
    fn = lambda q, *c: decode_attention(  # noqa: E731
        q, *c, sink_slots=SINK_SLOTS, group_size=group_size, softmax_scale=0.1, interpret=False,
        unpack_asm=unpack_asm,
    )
    kernels = compile_triton_kernels_for_h200(fn, q, *cache.arrays)
    assert sorted(name.split("_tier")[0] for name in kernels) == ["oscar_bf16", "oscar_int2", "oscar_merge"]
    int2_kernel = next(name for name in kernels if name.startswith("oscar_int2"))
    # Compiled, the INT2 tier takes its fmas by PTX by default, and its values' dot with the channels
    # on M (16-bit code pairs) where its scores take tokens on M with one group per row, D ≥ 128; no
    # register cap unless opted in (kernels.register_cap; test_register_cap.py).
    channels_on_m = int2_layout == "tokens_on_m" and group_size >= head_dim >= 128
    assert int2_kernel.endswith("_fma_pairs" if channels_on_m else "_fma"), int2_kernel
    for name, usage in kernels.items():
        assert usage["spills"] == 0, f"{name} spills {usage['spills']} bytes of registers"


@pytest.mark.parametrize("bad", [16, -1, True, 1.5, "168"])
def test_bad_register_caps_are_refused_by_name(small_cache, bad):
    q, cache = small_cache
    with pytest.raises(ValueError, match=f"max_registers={bad!r} must be 0"):
        _call(q, list(cache.arrays), max_registers=bad)


@pytest.mark.parametrize("batch_rows", [1, 8])
def test_default_launch_is_the_tiling_policy(small_cache, monkeypatch, batch_rows):
    """num_warps / num_stages None launch each tier as shared_math.tiling.default_decode_launch says:
    the BF16 tier by its own table and split (2 warps once it has DECODE_TWO_WARPS_MIN_PROGRAMS
    programs, here set between the INT2 tier's batch-1 and batch-8 counts, else 4;
    BF16_TIER_NUM_STAGES), the INT2 tier (pages of 16) with its scores on tokens × rows at
    INT2_DECODE_NUM_WARPS once its grid has as many programs (b8), else rows on M at the BF16 tier's
    rule (b1: 4 warps); DECODE_NUM_STAGES. Explicit values reach both tiers."""
    from oscar_jax import attention_ops
    from shared_math import tiling

    q, cache = small_cache
    seen = []
    monkeypatch.setattr(attention_ops, "_decode_attention",
                        lambda q, cache, launch, **kw: seen.append((
                            (launch.bf16_num_warps, launch.bf16_num_stages),
                            (launch.int2_num_warps, launch.int2_num_stages), launch.tokens_on_m)))
    arrays = list(cache.arrays)
    kv_heads, bf16_slots, slots = arrays[2].shape[1], arrays[8].shape[1], arrays[11].shape[1]
    split, bf16_split, _ = tiling.resolve_splits(None, None, bf16_slots, slots, arrays[0].shape[2])
    threshold = 4 * kv_heads * -(-slots // split)  # INT2 tier: b1 < it ≤ b8
    monkeypatch.setattr(tiling, "DECODE_TWO_WARPS_MIN_PROGRAMS", threshold)
    for i in (8, 9, 10, 11, 12):  # tables and lengths [B, …]: repeat row 0 to the batch
        arrays[i] = jnp.repeat(jnp.asarray(arrays[i])[:1], batch_rows, axis=0)
    qb = jnp.repeat(q[:1], batch_rows, axis=0)
    compiled = dict(interpret=False)  # the GPU's tiling (the kernel is never launched here)
    _call(qb, arrays, **compiled)
    _call(qb, arrays, num_warps=8, num_stages=1, **compiled)
    _call(qb, arrays, num_stages=1, **compiled)
    bf16_warps = 2 if batch_rows * kv_heads * -(-bf16_slots // bf16_split) >= threshold else 4  # its own count
    tokens_on_m = batch_rows == 8
    int2_warps = tiling.INT2_DECODE_NUM_WARPS if tokens_on_m else 4
    assert seen == [((bf16_warps, tiling.BF16_TIER_NUM_STAGES), (int2_warps, tiling.DECODE_NUM_STAGES), tokens_on_m),
                    ((8, 1), (8, 1), tokens_on_m), ((bf16_warps, 1), (int2_warps, 1), tokens_on_m)]


@pytest.mark.parametrize("bf16_slots,history_slots", [(4096, 0), (SINK_SLOTS + 2, 4096), (SINK_SLOTS + 2, 0)])
def test_default_split_follows_the_longer_table(small_cache, monkeypatch, bf16_slots, history_slots):
    """pages_per_split None → shared_math.tiling.default_pages_per_split of the longer page table:
    the history table of an OSCAR cache, the BF16 table of a cache with no INT2 tier (whose split
    was once the floor's, however long its context). The BF16 tier takes that split when it holds
    the context, and beside an INT2 tier one page a program (its few sink + recent pages)."""
    from oscar_jax import attention_ops
    from shared_math import tiling

    q, cache = small_cache
    seen = []
    monkeypatch.setattr(attention_ops, "_decode_attention",
                        lambda q, cache, launch, **kw: seen.append((launch.pages_per_split,
                                                                    launch.bf16_pages_per_split)))
    arrays = list(cache.arrays)
    batch = q.shape[0]
    arrays[8] = jnp.zeros((batch, bf16_slots), jnp.int32)
    arrays[11] = jnp.zeros((batch, history_slots), jnp.int32)
    _call(q, arrays, interpret=False)  # the GPU's tiling (the kernel is never launched here)
    want = tiling.default_pages_per_split(max(bf16_slots, history_slots), 1, PAGE_SIZE)
    assert seen == [(want, want if history_slots == 0 else 1)]
    assert want == (4096 // tiling.TARGET_SPLITS if max(bf16_slots, history_slots) == 4096
                    else tiling.MIN_TOKENS_PER_SPLIT // PAGE_SIZE)


def test_default_split_of_a_decode_call_follows_the_batch(small_cache, monkeypatch):
    """pages_per_split None in a decode call → shared_math.tiling.decode_pages_per_split over B × Hkv:
    longer splits while the INT2 grid stays ≥ INT2_DECODE_MIN_PROGRAMS (set here so that the small
    cache's grid is large), so a larger batch takes a longer split; prefill keeps the split by length."""
    from oscar_jax import attention_ops
    from shared_math import tiling

    q, cache = small_cache
    seen = []
    monkeypatch.setattr(attention_ops, "_decode_attention",
                        lambda q, cache, launch, **kw: seen.append(launch.pages_per_split))
    arrays = list(cache.arrays)
    kv_heads, history_slots = arrays[2].shape[1], 4096
    arrays[11] = jnp.zeros((1, history_slots), jnp.int32)
    monkeypatch.setattr(tiling, "INT2_DECODE_MIN_PROGRAMS", 2 * kv_heads * 64)  # b2 doubles once, b1 not
    for batch in (1, 2):
        rows = [jnp.repeat(jnp.asarray(arrays[i])[:1], batch, axis=0) for i in (8, 9, 10, 11, 12)]
        _call(jnp.repeat(q[:1], batch, axis=0), arrays[:8] + rows, interpret=False)  # the GPU's tiling
    base = tiling.default_pages_per_split(history_slots, 1, PAGE_SIZE)
    want = [tiling.decode_pages_per_split(history_slots, 1, PAGE_SIZE, b * kv_heads) for b in (1, 2)]
    assert seen == want == [base, 2 * base], (seen, base)


@pytest.mark.parametrize("page_size,bf16_slots,history_slots,want", [
    (16, 20, 600, (600, 4)),  # SmolLM2's runtime: blocks of 64 tokens, one split over the history
    (16, 20, 3, (20, 4)),  # a short history: the split spans the longer (BF16) table
    (32, 6, 0, (6, 2)),  # a BF16-only cache, pages of 32: two pages a block
    (4, 5, 1, (8, 8)),  # pages of 4: a block of 16 tokens at least (default_pages_per_block)
])
def test_interpreted_default_tiling_is_one_split_of_blocks(monkeypatch, page_size, bf16_slots, history_slots, want):
    """Interpreted with both tilings left to the default: one split of blocks of up to
    INTERPRET_BLOCK_TOKENS tokens (shared_math.tiling.interpreted_tiling; kernels.codec says why),
    in decode and prefill; an explicit value keeps the GPU's rule for the other."""
    from oscar_jax import attention_ops
    from oscar_jax.attention_ops import prefill_attention
    from oscar_jax.kernels.codec import INTERPRET_BLOCK_TOKENS
    from shared_math import tiling

    assert INTERPRET_BLOCK_TOKENS == 64  # the cases' expectations below assume it
    seen = []
    record = lambda *a, launch, **kw: seen.append((launch.pages_per_split, launch.pages_per_block))  # noqa: E731
    monkeypatch.setattr(attention_ops, "_decode_attention", record)
    monkeypatch.setattr(attention_ops, "_prefill_attention", record)
    rng = np.random.default_rng(3)
    cache = list(build_cache(rng, (40,), num_kv_heads=2, head_dim=64, group_size=32, page_size=page_size).arrays)
    cache[8] = jnp.zeros((1, bf16_slots), jnp.int32)
    cache[11] = jnp.zeros((1, history_slots), jnp.int32)
    q = random_query(rng, 1, 4, 64, jnp.float32)
    common = dict(sink_slots=1, group_size=32, softmax_scale=0.125, interpret=True)
    decode_attention(q, *cache, **common)
    k_new = jnp.zeros((1, 3, 2, 64), jnp.float32)
    prefill_attention(jnp.zeros((1, 3, 4, 64), jnp.float32), k_new, k_new, *cache, **common)
    decode_attention(q, *cache, **common, pages_per_block=tiling.default_pages_per_block(page_size))
    gpu_rule = tiling.resolve_splits(None, tiling.default_pages_per_block(page_size), bf16_slots, history_slots,
                                     page_size, sequence_heads=2)
    assert seen == [want, want, (gpu_rule[0], gpu_rule[2])]


@pytest.mark.slow
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_channels_on_m_int2_tier_matches_tokens_on_m(q_dtype):
    """The values' dot transposed (oᵀ = Vᵀ·p over 16-bit code pairs, DECISIONS.md D5) gives the partials of
    the tokens-on-M form (interpret mode: float32 dots of the same operands, so they differ by
    summation order only): several pages a split, one sequence cut 5 tokens short of whole pages
    with real codes in the cut rows, an odd length; and two pages a block. It needs tokens on M,
    one group per row and D >= 128 (the dot's M is D / 8)."""
    from oscar_jax.kernels.decode_attention import int2_tier_partials

    rng = np.random.default_rng(12)
    cache = build_cache(rng, (395, 203), num_kv_heads=2, head_dim=128, group_size=128)
    pools, (table, history) = cache.arrays[2:8], cache.arrays[11:13]
    history = history.at[0].add(-5)  # the cut rows keep their codes: a masked token must not count
    q = jnp.asarray(rng.standard_normal((2, 2, 8, 128)), q_dtype)
    for pages_per_block in (1, 2):
        common = dict(group_size=128, softmax_scale=128**-0.5, pages_per_split=4, pages_per_block=pages_per_block,
                      interpret=True, block_m=8, tokens_on_m=True)
        o_rows, lse_rows = int2_tier_partials(q, *pools, table, history, **common)
        o_pairs, lse_pairs = int2_tier_partials(q, *pools, table, history, channels_on_m=True, **common)
        nonempty = np.isfinite(np.asarray(lse_rows))
        assert nonempty.sum() > 8 and (np.isfinite(np.asarray(lse_pairs)) == nonempty).all()
        np.testing.assert_allclose(np.asarray(lse_pairs)[nonempty], np.asarray(lse_rows)[nonempty], rtol=1e-5)
        np.testing.assert_allclose(np.asarray(o_pairs), np.asarray(o_rows), rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(o_rows)[nonempty]).max() > 0.1  # the outputs compared are not all zero
    with pytest.raises(ValueError, match="channels_on_m needs tokens_on_m, one group per row"):
        int2_tier_partials(q, *pools, table, history, channels_on_m=True, **dict(common, tokens_on_m=False))
    small = build_cache(rng, (100,), num_kv_heads=1, head_dim=64, group_size=64)
    with pytest.raises(ValueError, match="head_dim >= 128"):
        int2_tier_partials(q[:1, :1, :, :64], *small.arrays[2:8], *small.arrays[11:13], channels_on_m=True,
                           **dict(common, group_size=64))


def test_channels_on_m_decode_attention_is_the_default_where_it_applies(monkeypatch):
    """Once the grid takes tokens on M, the default call is channels_on_m=True, bit for bit, and the
    rows-on-M values' dot (channels_on_m=False) gives the same up to summation order; on test-sized
    grids (no tokens on M) the default is the rows-on-M call and True is refused, naming the call."""
    from oscar_jax.attention_ops import decode_attention
    from shared_math import tiling

    rng = np.random.default_rng(13)
    cache = build_cache(rng, (395, 203), num_kv_heads=2, head_dim=128, group_size=128)
    q = random_query(rng, 2, 8, 128, jnp.bfloat16)
    kwargs = dict(sink_slots=SINK // PAGE_SIZE, group_size=128, softmax_scale=128**-0.5)  # GPU: compiled, PTX
    with pytest.raises(ValueError, match="channels_on_m=True needs the INT2 tier's tokens-on-M layout"):
        decode_attention(q, *cache.arrays, channels_on_m=True, **kwargs)
    with pytest.raises(ValueError, match="channels_on_m=1 must be a bool or None"):
        decode_attention(q, *cache.arrays, channels_on_m=1, **kwargs)
    small_grid = np.asarray(decode_attention(q, *cache.arrays, **kwargs))
    np.testing.assert_array_equal(  # the default on a grid without tokens on M
        small_grid, np.asarray(decode_attention(q, *cache.arrays, channels_on_m=False, **kwargs)))
    monkeypatch.setattr(tiling, "DECODE_TWO_WARPS_MIN_PROGRAMS", 1)  # tokens on M at test sizes (conftest)
    got = np.asarray(decode_attention(q, *cache.arrays, channels_on_m=True, **kwargs))
    np.testing.assert_array_equal(np.asarray(decode_attention(q, *cache.arrays, **kwargs)), got)  # the default
    want = np.asarray(decode_attention(q, *cache.arrays, channels_on_m=False, **kwargs))
    # The code dots carry a bias ~100x the output that cancels within each page (`_int2_output_terms`):
    # another summation order moves the result by ~1e-5 here (spread-3 queries).
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert_close(got, reference_decode(q, cache, 128**-0.5), jnp.bfloat16)


def test_tokens_on_m_int2_tier_matches_rows_on_m_and_needs_whole_pages():
    """The INT2 tier's two score layouts give the same partials (interpret mode: float32 dots, so
    they differ by summation order only), 8 rows with tokens on M as 16 with rows on M; pages of
    fewer than 16 tokens (the gather kernel) have no tokens-on-M form; `rows` reads q's first rows
    in place."""
    from oscar_jax.kernels.decode_attention import int2_tier_partials

    rng = np.random.default_rng(11)
    cache = build_cache(rng, (330, 200), num_kv_heads=2, head_dim=64, group_size=32)
    pools, tables = cache.arrays[2:8], cache.arrays[11:13]
    q = jnp.asarray(rng.standard_normal((2, 2, 16, 64)), jnp.float32)
    common = dict(group_size=32, softmax_scale=0.125, pages_per_split=2, pages_per_block=1, interpret=True)
    o16, lse16 = int2_tier_partials(q, *pools, *tables, block_m=16, **common)
    o8, lse8 = int2_tier_partials(q[:, :, :8], *pools, *tables, block_m=8, tokens_on_m=True, **common)
    nonempty = np.isfinite(np.asarray(lse16[:, :, :, :8]))
    assert nonempty.any() and (np.isfinite(np.asarray(lse8)) == nonempty).all()
    np.testing.assert_allclose(np.asarray(lse8)[nonempty], np.asarray(lse16[:, :, :, :8])[nonempty], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(o8), np.asarray(o16[:, :, :, :8]), rtol=1e-5, atol=1e-6)
    # The first 8 rows read in place (how decode calls it) are the sliced call, bit for bit.
    o8_in_place, lse8_in_place = int2_tier_partials(q, *pools, *tables, block_m=8, tokens_on_m=True, rows=8, **common)
    np.testing.assert_array_equal(np.asarray(o8_in_place), np.asarray(o8))
    np.testing.assert_array_equal(np.asarray(lse8_in_place), np.asarray(lse8))
    for bad in (0, 12, 24):
        with pytest.raises(ValueError, match=f"rows={bad} must be a multiple of block_m=8"):
            int2_tier_partials(q, *pools, *tables, block_m=8, tokens_on_m=True, rows=bad, **common)
    small = build_cache(rng, (100,), num_kv_heads=1, head_dim=64, group_size=32, page_size=8)
    with pytest.raises(ValueError, match="tokens_on_m needs pages of >= 16 tokens"):
        int2_tier_partials(q[:1, :1, :8], *small.arrays[2:8], *small.arrays[11:13], block_m=8, tokens_on_m=True,
                           **common)


# ------------------------------------------------------------- format v2: per-channel key pages
# Decode vs the float64 reference, both score layouts and the XLA path: parity_tests/test_ops_attention.py.


def test_prefill_over_per_channel_key_pages_matches_the_xla_path():
    """A 40-token chunk (rows on M, tier blocks of 64 and 128 rows) over a v2 prefix
    (cases.channel_key_cache): the Pallas prefill equals the XLA path (which the parity suite checks
    against the reference) within float32's tolerance."""
    from oscar_jax.attention_ops import prefill_attention

    case = cases.CHANNEL_KEY_CASES[0]
    pools, tables, _ = cases.channel_key_cache(case)
    rng = np.random.default_rng(6)
    d = case.head_dim
    q = jnp.asarray(3 * rng.standard_normal((2, 40, 6, d)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((2, 40, 2, d)), jnp.float32) for _ in range(2))
    args = (q, k_new, v_new, *(to_jax(a) for a in pools + tables))
    kwargs = dict(sink_slots=1, group_size=case.group_size, softmax_scale=case.softmax_scale, key_layout="channel")
    want = np.asarray(prefill_attention(*args, interpret=None, **kwargs))  # the XLA path on a CPU
    for tier_block_m in (None, 128):
        got = prefill_attention(*args, interpret=True, tier_block_m=tier_block_m, **kwargs)
        cases.assert_close(got, want, "float32")


def test_the_per_channel_key_kernel_compiles_for_h200_without_spills():
    case = cases.CHANNEL_KEY_CASES[1]  # D 128, bfloat16 q
    pools, tables, q = cases.channel_key_cache(case)
    fn = lambda q, *c: decode_attention(  # noqa: E731
        q, *c, sink_slots=1, group_size=case.group_size, softmax_scale=0.1, key_layout="channel", interpret=False)
    kernels = compile_triton_kernels_for_h200(fn, jnp.asarray(q, jnp.bfloat16), *(to_jax(a) for a in pools + tables))
    assert any(name.startswith("oscar_int2") and "_channel_keys" in name for name in kernels), list(kernels)
    for name, usage in kernels.items():
        assert usage["spills"] == 0, f"{name} spills {usage['spills']} bytes of registers"
