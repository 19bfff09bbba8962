"""Decode attention of the Triton kernels over the paged mixed-tier cache: the Triton-only claims
(launched kernels, tiling defaults, merge kernel, layouts, compile checks). Decode vs the float64
reference, every backend over parity_tests.cases.DECODE_CASES, is parity_tests/test_ops_attention.py's.

Caches come from parity_tests.cases.build_cache (poisoned pools: page 0, spare pages and unused
rows hold NaN; unused table entries point at page 0; shuffled page ids), so any read of a token
that is not valid turns the output into NaN. The kernels' output is compared with attention over
the *dequantized* cache in float64 (shared_math.attention.mixed_tier_decode_attention) with THE
tolerance table parity_tests.cases.ATTENTION_TOLERANCES (shared with oscar_jax and the parity
suite), so quantization error is never mistaken for kernel error.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oscar_torch import ops
from oscar_torch.attention_ops import merge_partials
from oscar_torch.tests.util import DEVICE, attention_kwargs, cache_arrays, query, to_torch
from parity_tests.cases import (
    ATTENTION_CASES,
    AttentionCase,
    assert_close,
    build_cache,
    dequantized_cache,
    reference_decode,
)
from shared_math.attention import softmax_attention


class _RecordOps(TorchDispatchMode):
    """The torch ops a call dispatches at its own level (a custom op's inner ops are not seen)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", [c for c in ATTENTION_CASES if c.name in ("qwen3_8b", "edges_bf16")], ids=str)
def test_decode_launches_its_three_kernels_and_nothing_else(case):
    """No pad, copy or fill of q around the tier kernels: they read rows ≥ Gq as zero queries. At
    128K b1 on the H200 those three small kernels cost ~5 µs of a ~68 µs call (DECISIONS.md D18)."""
    cache = build_cache(case)
    q, arrays = query(case), cache_arrays(cache)
    with _RecordOps() as recorded:
        ops.decode_attention(q, *arrays, **attention_kwargs(case))
    kernels = [op for op in recorded.ops if not op.startswith("aten.view")]
    assert kernels == ["oscar.bf16_tier_partials.default", "oscar.int2_tier_partials.default",
                       "oscar.merge_tier_partials.default"], recorded.ops


def test_decode_equals_one_pass_softmax_and_handles_an_empty_sequence():
    """Split-K over pages and tiers is the one-pass softmax over the concatenated cache; a
    sequence with no cached token gets a zero row."""
    case = AttentionCase("one_pass", 64, 32, 2, 2, (0, 150, 17), pages_per_split=2, pages_per_block=1)
    cache = build_cache(case)
    q = case.query()
    out = ops.decode_attention(query(case), *cache_arrays(cache), **attention_kwargs(case)).cpu().numpy()
    assert np.all(out[0] == 0.0)
    for b in (1, 2):
        k, v = dequantized_cache(case, cache.sequences[b])
        want = softmax_attention(q[b].astype(np.float64), k, v, softmax_scale=case.softmax_scale)
        assert_close(out[b], want, case.q_dtype)


def test_decode_default_split_is_deterministic():
    case = dataclasses.replace(ATTENTION_CASES[1], name="default_split")
    cache = build_cache(case)
    kwargs = attention_kwargs(case)
    kwargs["pages_per_split"] = None
    arrays = cache_arrays(cache)
    first = ops.decode_attention(query(case), *arrays, **kwargs)
    assert torch.equal(first, ops.decode_attention(query(case), *arrays, **kwargs))
    assert_close(first.cpu().numpy(), reference_decode(case, cache, case.query()), case.q_dtype)


@pytest.mark.parametrize("case", ATTENTION_CASES[1:3], ids=lambda c: c.name)
def test_decode_with_the_whole_tiling_left_to_the_default(case):
    """pages_per_split and pages_per_block both None: the tuned tiling on the GPU; interpreted,
    each tier in one split of whole-table blocks (attention_ops._resolve_tiling). Either way the
    reference."""
    cache = build_cache(case)
    kwargs = {**attention_kwargs(case), "pages_per_split": None, "pages_per_block": None}
    out = ops.decode_attention(query(case), *cache_arrays(cache), **kwargs)
    assert_close(out.cpu().numpy(), reference_decode(case, cache, case.query()), case.q_dtype)


@pytest.mark.parametrize("splits_a,splits_b,block_splits,block_d", [(1, 37, 8, 16), (3, 0, 32, 32), (2, 5, 32, 64)])
def test_merge_kernel_equals_merge_partials_over_both_tiers(splits_a, splits_b, block_splits, block_d):
    """The merge kernel (decode's) is merge_partials over the concatenated splits, kept rows only:
    empty splits (lse = −inf, o = NaN here) weigh zero, a row every split left empty gets 0, split
    counts need not divide the block, programs split the columns. float32, tolerance 1e-6
    (summation order)."""
    from oscar_torch.kernels.decode_attention import merge_tier_partials

    gen = torch.Generator().manual_seed(splits_a * 100 + splits_b)
    batch, heads, rows, d, kept = 2, 3, 16, 64, 5

    def tier(splits):
        o = torch.randn(batch, heads, splits, rows, d, generator=gen)
        lse = torch.randn(batch, heads, splits, rows, generator=gen) * 4
        empty = torch.rand(batch, heads, splits, rows, generator=gen) < 0.3
        lse[empty] = -math.inf
        o[empty.unsqueeze(-1).expand_as(o)] = math.nan  # never read through a zero weight
        return o.to(DEVICE), lse.to(DEVICE)

    (o_a, lse_a), (o_b, lse_b) = tier(splits_a), tier(splits_b)
    lse_a[0, 1, :, 2] = -math.inf  # row 2 of (0, 1): every split of both tiers empty
    lse_b[0, 1, :, 2] = -math.inf
    got = merge_tier_partials(o_a, lse_a, o_b, lse_b, kept, block_splits=block_splits,
                              block_d=block_d).cpu().numpy()
    o_cat, lse_cat = torch.cat([o_a, o_b], dim=2), torch.cat([lse_a, lse_b], dim=2)
    o_cat = torch.where(torch.isinf(lse_cat).unsqueeze(-1), 0.0, o_cat)  # the reference multiplies 0·NaN
    want, _ = merge_partials(o_cat[..., :kept, :], lse_cat[..., :kept])
    assert got.shape == (batch, heads, kept, d)
    np.testing.assert_allclose(got, want.cpu().numpy(), rtol=1e-6, atol=1e-6)
    assert np.all(got[0, 1, 2] == 0.0)


# ------------------------------------------------------------------------------- bad inputs

SMALL = AttentionCase("small", 64, 32, 2, 2, (70, 5), pages_per_split=2, pages_per_block=1)


@pytest.fixture(scope="module")
def small():
    cache = build_cache(SMALL)
    return query(SMALL), list(cache_arrays(cache))


NAMES = ["k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min",
         "bf16_page_table", "sink_tokens", "recent_tokens", "history_page_table", "history_tokens"]


# The errors numpy inputs can make (dtypes, shapes, static arguments), every backend:
# parity_tests/test_ops_attention.py. Here: strides, devices, int64 tables and the register cap.


@pytest.mark.parametrize(
    "name,transform,message",
    [
        ("k_bf16", lambda a: a.transpose(0, 1).contiguous().transpose(0, 1), "k_bf16 must be contiguous"),
        ("k_bf16", lambda a: a.to("meta"), "k_bf16 is on device meta"),
        ("v_scale", lambda a: a.to("meta"), "v_scale is on device meta"),
        ("v_min", lambda a: a.transpose(1, 2).contiguous().transpose(1, 2), "v_min must be contiguous"),
        ("bf16_page_table", lambda a: a.long(), "bf16_page_table must have dtype int32"),
        ("history_page_table", lambda a: torch.zeros((3, 5), dtype=torch.int32, device=a.device)[:2, :4],
         "history_page_table must be contiguous"),
        ("history_tokens", lambda a: a.to("meta"), "history_tokens is on device meta"),
    ],
)
def test_bad_torch_cache_arrays_raise(small, name, transform, message):
    q, arrays = small
    arrays = list(arrays)
    i = NAMES.index(name)
    arrays[i] = transform(arrays[i])
    with pytest.raises(ValueError, match=message):
        ops.decode_attention(q, *arrays, **attention_kwargs(SMALL))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(max_registers=16), r"max_registers=16 must be 0 \(the compiler's choice\) or an integer >= 32"),
        (dict(max_registers=False), "max_registers=False must be 0"),
        (dict(max_registers=-1), "max_registers=-1 must be 0"),
    ],
)
def test_bad_register_caps_raise(small, overrides, message):
    q, arrays = small
    with pytest.raises(ValueError, match=message):
        ops.decode_attention(q, *arrays, **{**attention_kwargs(SMALL), **overrides})


@pytest.mark.parametrize("batch", [1, 8])
def test_launch_parameters_reach_both_tier_kernels(monkeypatch, batch):
    """None launches each tier kernel as shared_math.tiling.default_decode_launch says: the BF16 tier
    by its own program count (2 warps once it has DECODE_TWO_WARPS_MIN_PROGRAMS, here set between the
    INT2 tier's batch-1 and batch-8 counts, else 4; BF16_TIER_NUM_STAGES), the INT2 tier (G = D,
    pages of 16) with its scores on tokens × rows at INT2_DECODE_NUM_WARPS and no register cap once
    its grid has as many programs (b8), else rows on M at 4 warps and TRITON_INT2_MAX_REGISTERS (b1);
    DECODE_NUM_STAGES; explicit num_warps and num_stages reach both, max_registers the INT2 one."""
    from oscar_torch.kernels import decode_attention as kdecode
    from shared_math import tiling
    from shared_math.tiling import (
        BF16_TIER_NUM_STAGES, DECODE_NUM_STAGES, INT2_DECODE_NUM_WARPS, TRITON_INT2_MAX_REGISTERS,
    )

    case = dataclasses.replace(SMALL, name="small_one_group", group_size=SMALL.head_dim)  # G = D
    q, arrays = query(case), list(cache_arrays(build_cache(case)))
    kv_heads, slots = arrays[2].shape[1], arrays[11].shape[1]
    splits = -(-slots // case.pages_per_split)
    monkeypatch.setattr(tiling, "DECODE_TWO_WARPS_MIN_PROGRAMS", 4 * kv_heads * splits)  # INT2 tier: b1 < it ≤ b8
    _, bf16_split, _ = tiling.resolve_splits(case.pages_per_split, case.pages_per_block, arrays[8].shape[1], slots,
                                             arrays[0].shape[2])
    (bf16_warps, bf16_stages), _ = tiling.default_decode_launch(batch, kv_heads, arrays[8].shape[1], slots,
                                                                bf16_split, case.pages_per_split)
    for i in (8, 9, 10, 11, 12):  # tables and lengths [B, …]: repeat row 0 to the batch
        arrays[i] = arrays[i][:1].repeat_interleave(batch, dim=0).contiguous()
    qb = q[:1].repeat_interleave(batch, dim=0).contiguous()
    seen = []
    for tier in ("bf16_tier_partials", "int2_tier_partials"):
        real = getattr(kdecode, tier)
        monkeypatch.setattr(kdecode, tier, lambda *a, real=real, tier=tier, **kw: (
            seen.append((tier, kw["num_warps"], kw["num_stages"], kw.get("max_registers"), kw.get("tokens_on_m"))),
            real(*a, **kw))[1])
    ops.decode_attention(qb, *arrays, **attention_kwargs(case))
    ops.decode_attention(qb, *arrays, **attention_kwargs(case), num_warps=8, num_stages=1, max_registers=96)
    ops.decode_attention(qb, *arrays, **attention_kwargs(case), max_registers=0)
    assert bf16_stages == BF16_TIER_NUM_STAGES
    bf16 = ("bf16_tier_partials", bf16_warps, BF16_TIER_NUM_STAGES, None, None)  # its own table's program count
    on_m = batch == 8
    int2 = ("int2_tier_partials", *((INT2_DECODE_NUM_WARPS, DECODE_NUM_STAGES, None, True) if on_m
                                    else (4, DECODE_NUM_STAGES, TRITON_INT2_MAX_REGISTERS, False)))
    assert seen == [bf16, int2, ("bf16_tier_partials", 8, 1, None, None), ("int2_tier_partials", 8, 1, 96, on_m),
                    bf16, int2[:3] + (None, on_m)]


def test_rows_on_m_int2_tier_keeps_its_launch_policy_and_register_cap(monkeypatch):
    """G < D (here the dequantizing kernel, G < D/4) keeps the INT2 tier's rows-on-M layout, its
    warps from its program count and the TRITON_INT2_MAX_REGISTERS cap."""
    from oscar_torch.kernels import decode_attention as kdecode
    from shared_math.tiling import DECODE_NUM_STAGES, TRITON_INT2_MAX_REGISTERS, default_decode_num_warps

    case = AttentionCase("g16", 128, 16, 2, 2, (70, 5), pages_per_split=2, pages_per_block=1)  # G 16 < D/4 = 32
    q, arrays = query(case), list(cache_arrays(build_cache(case)))
    seen = []
    real = kdecode.int2_tier_partials
    monkeypatch.setattr(kdecode, "int2_tier_partials", lambda *a, **kw: (
        seen.append((kw["num_warps"], kw["num_stages"], kw.get("max_registers"), kw.get("tokens_on_m"))),
        real(*a, **kw))[1])
    ops.decode_attention(q, *arrays, **attention_kwargs(case))
    warps = default_decode_num_warps(q.shape[0], arrays[2].shape[1], arrays[11].shape[1], case.pages_per_split)
    assert seen == [(warps, DECODE_NUM_STAGES, TRITON_INT2_MAX_REGISTERS, False)]


@pytest.mark.parametrize("bf16_slots,history_slots", [(4096, 0), (SMALL.sink_slots + 2, 4096), (SMALL.sink_slots + 2, 0)])
def test_default_split_follows_the_longer_table(small, monkeypatch, bf16_slots, history_slots):
    """pages_per_split None → shared_math.tiling.default_pages_per_split of the longer page table:
    the history table of an OSCAR cache, the BF16 table of a cache with no INT2 tier. The BF16 tier
    takes that split when it holds the context, and beside an INT2 tier one page a program."""
    from oscar_torch import attention_ops
    from shared_math import tiling

    class Seen(Exception):
        pass

    def capture(q_rows, cache, **kw):
        raise Seen(kw["launch"].pages_per_split, kw["launch"].bf16_pages_per_split)

    monkeypatch.setattr(attention_ops, "_tier_partials", capture)
    q, arrays = small
    arrays = list(arrays)
    arrays[8] = torch.zeros((q.shape[0], bf16_slots), dtype=torch.int32, device=q.device)
    arrays[11] = torch.zeros((q.shape[0], history_slots), dtype=torch.int32, device=q.device)
    kwargs = {**attention_kwargs(SMALL), "pages_per_split": None}
    with pytest.raises(Seen) as seen:
        ops.decode_attention(q, *arrays, **kwargs)
    page_size = arrays[0].shape[2]
    want = tiling.default_pages_per_split(max(bf16_slots, history_slots), 1, page_size)
    assert seen.value.args == (want, want if history_slots == 0 else 1)
    assert seen.value.args[0] == max(-(-tiling.MIN_TOKENS_PER_SPLIT // page_size),
                                     -(-max(bf16_slots, history_slots) // tiling.TARGET_SPLITS))


def test_default_split_of_a_decode_call_follows_the_batch(small, monkeypatch):
    """pages_per_split None in a decode call → shared_math.tiling.decode_pages_per_split over B × Hkv,
    as in oscar_jax (INT2_DECODE_MIN_PROGRAMS set so that the small cache's grid is large)."""
    from oscar_torch import attention_ops
    from shared_math import tiling

    class Seen(Exception):
        pass

    def capture(q_rows, cache, **kw):
        raise Seen(kw["launch"].pages_per_split)

    monkeypatch.setattr(attention_ops, "_tier_partials", capture)
    q, arrays = small
    kv_heads, page_size, history_slots = arrays[2].shape[1], arrays[0].shape[2], 4096
    monkeypatch.setattr(tiling, "INT2_DECODE_MIN_PROGRAMS", 2 * kv_heads * 64)  # b2 doubles once, b1 not
    seen = []
    for batch in (1, 2):
        rows = [arrays[i][:1].repeat(batch, *([1] * (arrays[i].dim() - 1))) for i in (8, 9, 10, 11, 12)]
        rows[3] = torch.zeros((batch, history_slots), dtype=torch.int32, device=q.device)
        with pytest.raises(Seen) as got:
            ops.decode_attention(q[:1].repeat(batch, 1, 1), *arrays[:8], *rows,
                                 **{**attention_kwargs(SMALL), "pages_per_split": None})
        seen.append(got.value.args[0])
    base = tiling.default_pages_per_split(history_slots, 1, page_size)
    want = [tiling.decode_pages_per_split(history_slots, 1, page_size, b * kv_heads) for b in (1, 2)]
    assert seen == want == [base, 2 * base], (seen, base)


def test_bad_torch_query_raises(small):
    q, arrays = small
    kwargs = attention_kwargs(SMALL)
    for bad, message in [
        (q[..., :32].contiguous(), r"k_bf16 must have shape \[\*, \*, \*, 32\]"),
        (q.transpose(0, 1).contiguous().transpose(0, 1), "q must be contiguous"),
        (q.to("meta"), "k_bf16 is on device .* but q is on device meta"),
        (q.cpu().numpy(), "q must be a torch.Tensor, got ndarray"),
    ]:
        with pytest.raises(ValueError, match=message):
            ops.decode_attention(bad, *arrays, **kwargs)


def test_pages_per_block_times_page_size_must_fill_a_dot_tile():
    case = AttentionCase("tiny_pages", 64, 64, 1, 1, (9,), sink=8, page_size=8, pages_per_split=1)
    cache = build_cache(case)
    with pytest.raises(ValueError, match=r"pages_per_block=1 × page size 8 must be >= 16"):
        ops.decode_attention(query(case), *cache_arrays(cache), **attention_kwargs(case))
    out = ops.decode_attention(query(case), *cache_arrays(cache), **{**attention_kwargs(case),
                                                                     "pages_per_block": 2, "pages_per_split": 2})
    assert_close(out.cpu().numpy(), reference_decode(case, cache, case.query()), case.q_dtype)
    assert to_torch(np.zeros(1)).device.type == DEVICE.type


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    AttentionCase("qwen3_8b_asm", 128, 128, 8, 4, (4000, 1337, 300), q_dtype="bfloat16", recent=256, page_size=64,
                  pages_per_split=16),
    AttentionCase("g32_asm", 128, 32, 2, 4, (700, 65), q_dtype="bfloat16"),
], ids=lambda c: c.name)
def test_unpack_asm_on_the_gpu_matches_the_compiler_unpacking(case, int2_layout):
    """The inline-PTX unpacker builds the same operand bits: equal to the compiler's unpacking up to
    float32 reassociation, and within the bf16 tolerance of the float64 reference."""
    cache = build_cache(case)
    arrays, kwargs = cache_arrays(cache), attention_kwargs(case)
    compiler = ops.decode_attention(query(case), *arrays, unpack_asm=False, **kwargs).cpu().numpy()
    unpacked = ops.decode_attention(query(case), *arrays, unpack_asm=True, **kwargs).cpu().numpy()
    default = ops.decode_attention(query(case), *arrays, **kwargs).cpu().numpy()
    np.testing.assert_allclose(unpacked, compiler, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(default, unpacked)  # None → the PTX unpacker on the GPU for bf16 q
    # the rows-on-M launch of D7's alternative (4 warps, 2 stages, uncapped registers): another dot split, no spills
    four_warps = ops.decode_attention(query(case), *arrays, num_warps=4, num_stages=2, max_registers=0,
                                      **kwargs).cpu().numpy()
    assert_close(four_warps, reference_decode(case, cache, case.query()), case.q_dtype)
    assert_close(unpacked, reference_decode(case, cache, case.query()), case.q_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_channels_on_m_int2_tier_matches_tokens_on_m(q_dtype, monkeypatch):
    """The values' dot transposed (oᵀ = Vᵀ·p by 16-bit code pairs, DECISIONS.md D5) gives the partials of the
    shipped tokens-on-M form: several pages a split, GQA 4 in 8 rows, one sequence cut 5 tokens short of
    whole pages (its last page runs masked, with real codes in the cut rows) and one at an odd length
    (interpreter: float32 dots of the same operands, so they differ by summation order only); so does
    the whole decode call, whose default it is where it applies (on a GPU with bf16 queries: the
    inline-PTX unpackers).
    D < 128 has no such form (the dot's M is D / 8)."""
    from oscar_torch.kernels import decode_attention as kdecode

    case = AttentionCase("pairs", 128, 128, 2, 4, (395, 203), pages_per_split=3, pages_per_block=1,
                         q_dtype="bfloat16" if q_dtype == torch.bfloat16 else "float32")
    arrays = list(cache_arrays(build_cache(case)))
    pools, (table, history) = arrays[2:8], arrays[11:13]
    history = history.clone()
    history[0] -= 5  # the codes of the last 5 rows stay in the page: a masked-out token must not count
    assert int(history[1]) % case.page_size != 0 or int(history[0]) % case.page_size != 0
    gen = torch.Generator().manual_seed(5)
    q = torch.randn((2, 2, 8, 128), generator=gen).to(q_dtype).to(DEVICE)
    for pages_per_split, pages_per_block in ((3, 1), (4, 2)):  # two pages a block: a bench variant (DECISIONS.md D5)
        common = dict(group_size=128, softmax_scale=case.softmax_scale, pages_per_split=pages_per_split,
                      pages_per_block=pages_per_block, block_m=8, tokens_on_m=True)
        o_rows, lse_rows = kdecode.int2_tier_partials(q, *pools, table, history, **common)
        o_pairs, lse_pairs = kdecode.int2_tier_partials(q, *pools, table, history, channels_on_m=True, **common)
        nonempty = torch.isfinite(lse_rows)
        assert nonempty.sum() > 8 and torch.equal(torch.isfinite(lse_pairs), nonempty)
        torch.testing.assert_close(lse_pairs[nonempty], lse_rows[nonempty], rtol=1e-5, atol=1e-5)
        tol = 1e-4 if q_dtype == torch.bfloat16 else 1e-5  # bf16: the bias-carrying dots' order (below)
        torch.testing.assert_close(o_pairs, o_rows, rtol=tol, atol=tol)
        assert o_rows[nonempty].abs().max() > 0.1  # the outputs compared are not all zero
    small = AttentionCase("d64", 64, 64, 1, 1, (70,), pages_per_split=2, pages_per_block=1)
    arrays64 = list(cache_arrays(build_cache(small)))
    with pytest.raises(ValueError, match="channels_on_m=True needs the INT2 tier's tokens-on-M layout"):
        ops.decode_attention(query(small), *arrays64, channels_on_m=True, **attention_kwargs(small))  # a small grid
    assert torch.equal(ops.decode_attention(query(small), *arrays64, **attention_kwargs(small)),
                       ops.decode_attention(query(small), *arrays64, channels_on_m=False, **attention_kwargs(small)))
    from shared_math import tiling

    monkeypatch.setattr(tiling, "DECODE_TWO_WARPS_MIN_PROGRAMS", 1)  # tokens on M at test sizes (conftest)
    out = ops.decode_attention(query(case), *arrays[:11], table, history, channels_on_m=True,
                               **attention_kwargs(case))
    default = ops.decode_attention(query(case), *arrays[:11], table, history, **attention_kwargs(case))
    assert torch.equal(default, out)  # None → on where it applies
    want = ops.decode_attention(query(case), *arrays[:11], table, history, channels_on_m=False,
                                **attention_kwargs(case))
    # bf16 queries: the code dots carry a bias ~100x the output that cancels within each page; another
    # summation order moves the result by ~1e-5 (up to 3.6e-5 on the H200)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="channels_on_m needs tokens_on_m and head_dim >= 128"):
        kdecode.int2_tier_partials(torch.zeros((1, 1, 8, 64), device=DEVICE), *arrays64[2:8], *arrays64[11:13],
                                   channels_on_m=True, **dict(common, group_size=64))
    with pytest.raises(ValueError, match="channels_on_m=1 must be a bool or None"):
        ops.decode_attention(query(case), *arrays, channels_on_m=1, **attention_kwargs(case))


def test_default_register_cap_follows_the_int2_layout(monkeypatch):
    """max_registers None → shared_math.tiling.int2_decode_max_registers: INT2_CHANNELS_ON_M_MAX_REGISTERS
    with the tokens and channels on M (D = 128 on a tokens-on-M grid), the compiler's choice (0) with
    the tokens on M only (D = 64), TRITON_INT2_MAX_REGISTERS with the rows on M; an explicit cap wins."""
    from oscar_torch import attention_ops
    from shared_math import tiling

    class Launched(Exception):
        pass

    seen = []

    def spy(*args, **kw):
        seen.append((kw["launch"].max_registers, kw["launch"].channels_on_m, kw["int2_rows"] is not None))
        raise Launched

    monkeypatch.setattr(attention_ops, "_tier_partials", spy)
    d128 = AttentionCase("pairs", 128, 128, 2, 4, (395, 203), pages_per_split=3, pages_per_block=1)
    d64 = AttentionCase("d64", 64, 64, 1, 1, (330,), pages_per_split=2, pages_per_block=1)
    calls = [(d128, 1, {}), (d64, 1, {}), (d128, 10**9, {}), (d128, 1, dict(max_registers=96))]
    for case, min_programs, extra in calls:  # tokens on M at test sizes, or not at all
        monkeypatch.setattr(tiling, "DECODE_TWO_WARPS_MIN_PROGRAMS", min_programs)
        with pytest.raises(Launched):
            ops.decode_attention(query(case), *cache_arrays(build_cache(case)), **attention_kwargs(case), **extra)
    assert seen == [(tiling.INT2_CHANNELS_ON_M_MAX_REGISTERS, True, True), (0, False, True),
                    (tiling.TRITON_INT2_MAX_REGISTERS, False, False), (96, True, True)]
    assert tiling.INT2_CHANNELS_ON_M_MAX_REGISTERS == 160  # DECISIONS.md D6


def test_tokens_on_m_int2_tier_matches_rows_on_m_and_needs_one_group():
    """The INT2 tier's two score layouts give the same partials (interpreter: float32 dots, so they
    differ by summation order only), 8 rows with tokens on M as 16 with rows on M; G < D has no
    tokens-on-M form in this backend."""
    from oscar_torch.kernels import decode_attention as kdecode

    case = AttentionCase("history", 64, 64, 2, 2, (330, 200), pages_per_split=2, pages_per_block=1)
    arrays = list(cache_arrays(build_cache(case)))
    pools, tables = arrays[2:8], arrays[11:13]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn((2, 2, 16, 64), generator=gen).to(DEVICE)
    common = dict(group_size=64, softmax_scale=0.125, pages_per_split=2, pages_per_block=1)
    o16, lse16 = kdecode.int2_tier_partials(q, *pools, *tables, block_m=16, **common)
    o8, lse8 = kdecode.int2_tier_partials(q[:, :, :8].contiguous(), *pools, *tables, block_m=8, tokens_on_m=True,
                                          **common)
    nonempty = torch.isfinite(lse16[:, :, :, :8])
    assert nonempty.any() and torch.equal(torch.isfinite(lse8), nonempty)
    torch.testing.assert_close(lse8[nonempty], lse16[:, :, :, :8][nonempty], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o8, o16[:, :, :, :8], rtol=1e-5, atol=1e-6)
    g32 = AttentionCase("g32_rows", 64, 32, 1, 1, (70,), pages_per_split=2, pages_per_block=1)
    small = list(cache_arrays(build_cache(g32)))
    with pytest.raises(ValueError, match="tokens_on_m needs one group per row"):
        kdecode.int2_tier_partials(torch.zeros((1, 1, 8, 64), device=DEVICE), *small[2:8], *small[11:13],
                                   block_m=8, tokens_on_m=True, group_size=32, softmax_scale=0.1, pages_per_split=2,
                                   pages_per_block=1)
