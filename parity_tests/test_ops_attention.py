"""Attention ops of every implementation against the float64 reference: one suite for oscar_jax
(Pallas kernels, XLA path) and oscar_torch (Triton kernels) on the `backend` fixture, numpy in and
out through parity_tests.backends, the named cases and tolerances of parity_tests.cases.

Decode over DECODE_CASES (the kernel backends in both INT2 layouts), a partly valid last history
page, prefill over PREFILL_CASES, the code bias over a long split, the split merge and the errors
numpy inputs can make; pools written by one backend and read by another are test_parity.py's;
each backend's own attention tests keep their launch policy, tiling defaults and compile checks.
"""

import functools

import numpy as np
import pytest

from parity_tests import backends, cases
from parity_tests.conftest import OP_BACKENDS
from shared_math import attention as reference_attention

INT2_LAYOUTS = ("rows_on_m", "tokens_on_m")


def layout_params(case_list) -> list:
    """(backend, int2_layout, case) of every case: the kernel backends in both INT2 layouts of the
    default launch (the root conftest's `int2_layout` fixture, indirect), the XLA path once (it has
    no layouts). oscar_torch keeps rows on M where G < D, so its tokens-on-M run of such a case
    would be its rows-on-M run again and is left out."""
    params = []
    for case in case_list:
        for backend in OP_BACKENDS:
            for layout in INT2_LAYOUTS:
                if layout == "tokens_on_m" and (backend == "xla" or (
                        backend == "torch" and case.group_size < case.head_dim)):
                    continue
                name = f"{case.name}-{backend}" + ("" if backend == "xla" else f"-{layout}")
                params.append(pytest.param(backend, layout, case, id=name))
    return params


@functools.lru_cache(maxsize=None)
def _decode_inputs(case: cases.AttentionCase, cut_history_tokens: int = 0):
    """The case's poisoned cache (its last INT2 pages cut short by `cut_history_tokens`), q and the
    float64 reference, built once per worker for all backends and layouts."""
    cache = cases.build_cache(case)
    if cut_history_tokens:
        cache = cases.cut_history(cache, cut_history_tokens, case.page_size)
    q = case.query()
    return cache, q, cases.reference_decode(case, cache, q)


def _decode_within_tolerance(backend, case, cut_history_tokens=0) -> float:
    cache, q, want = _decode_inputs(case, cut_history_tokens)
    out = backends.decode_attention(backend, case, cache.pools(), cache.tables(), q)
    assert out.dtype == np.float32 and out.shape == q.shape
    return cases.assert_close(out, want, case.q_dtype)


@pytest.mark.parametrize("backend,int2_layout,case", layout_params(cases.DECODE_CASES), indirect=["int2_layout"])
def test_decode_attention_within_tolerance_of_reference(backend, int2_layout, case):
    """Decode over a poisoned, shuffled cache (a read of an invalid token gives NaN) vs the split-K
    float64 reference over the dequantized cache, within ATTENTION_TOLERANCES[q dtype]. One case of
    oscar_jax's former list is redundant and left out (cases.DECODE_CASES says why), as is oscar_torch's
    tokens-on-M run where G < D (layout_params)."""
    error = _decode_within_tolerance(backend, case)
    print(f"{case.name} {backend} {int2_layout}: max abs error {error:.2e}")


@pytest.mark.parametrize("case", cases.DECODE_CASES, ids=lambda c: c.name)
def test_split_k_reference_is_the_one_pass_softmax(case):
    """The reference the decode test uses (split-K over tiers and pages, merged) equals a one-pass
    softmax over the concatenated dequantized cache, to 1e-12."""
    cache, q, want = _decode_inputs(case)
    for b, tiers in enumerate(cache.sequences):
        k, v = cases.dequantized_cache(case, tiers)
        one_pass = reference_attention.softmax_attention(q[b].astype(np.float64), k, v,
                                                         softmax_scale=case.softmax_scale)
        np.testing.assert_allclose(want[b], one_pass, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend,int2_layout,case",
                         layout_params(cases.ATTENTION_CASES[:2] + cases.ATTENTION_CASES[3:]),
                         indirect=["int2_layout"])
def test_decode_attention_masks_a_partly_valid_last_history_page(backend, int2_layout, case):
    """With history_tokens 5 short of whole pages (and those 5 rows holding real codes), the output
    matches the reference over the shorter history. The Triton INT2 tier with tokens on M runs whole
    pages unmasked and only the block holding the partial page masked (DECISIONS.md D15). Cases: one
    page a block (both score layouts), two pages a block (a full page and the partial one in the
    masked block), G < D; edges_bf16 adds none of these (its one history sequence is G < D, one page
    a block)."""
    error = _decode_within_tolerance(backend, case, cut_history_tokens=5)
    print(f"{case.name} {backend} {int2_layout}: max abs error {error:.2e}")


@pytest.mark.parametrize("backend,int2_layout,case",
                         [p for p in layout_params(cases.CHANNEL_KEY_CASES) if p.values[0] != "torch"],
                         indirect=["int2_layout"])
def test_decode_over_per_channel_key_pages_within_tolerance_of_reference(backend, int2_layout, case):
    """Format v2 (keys per channel and page): oscar_jax's Pallas INT2 tier, in both score layouts,
    and its XLA path against the float64 reference, within ATTENTION_TOLERANCES[q dtype].
    oscar_torch does not read the layout yet (OscarTorchCache refuses it by name)."""
    pools, tables, q = cases.channel_key_cache(case)
    out = backends.channel_key_decode_attention(backend, case, pools, tables, q)
    error = cases.assert_close(out, cases.reference_channel_key_decode(case, pools, tables, q), case.q_dtype)
    print(f"{case.name} {backend} {int2_layout}: max abs error {error:.2e}")


@functools.lru_cache(maxsize=None)
def _prefill_inputs(case: cases.PrefillCase):
    cache = cases.build_cache(case.prefix)
    q, k_new, v_new = case.chunk_arrays()
    return cache, q, k_new, v_new, cases.reference_prefill(case, cache, q, k_new, v_new)


@pytest.mark.parametrize("case", cases.PREFILL_CASES, ids=lambda c: c.name)
def test_prefill_attention_within_tolerance_of_reference(backend, case):
    """The chunk causal over itself in full precision plus its prefix through the tiers vs the
    float64 reference, within ATTENTION_TOLERANCES[q dtype] (float32 q: every dot float32). The
    padding rows of a ragged chunk hold NaN in k_new and v_new: they leak neither into valid rows
    nor out (their output rows are exactly 0)."""
    cache, q, k_new, v_new, want = _prefill_inputs(case)
    pad = np.arange(case.chunk)[None, :] >= np.asarray(case.new_tokens)[:, None]  # [B, T]
    k_pad, v_pad = (np.where(pad[:, :, None, None], np.float32(np.nan), x) for x in (k_new, v_new))
    out = backends.prefill_attention(backend, case, cache.pools(), cache.tables(), q, k_pad, v_pad)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert np.all(out[pad] == 0)
    error = cases.assert_close(out, want, case.prefix.q_dtype)
    print(f"{case.name} {backend}: max abs error {error:.2e}")


def test_long_split_keeps_the_code_bias_from_accumulating(backend):
    """The bf16 code bias cancels page by page (parity_tests.cases.BIAS_CANCELLATION_CASE): q = 0 over
    128 INT2 pages in one split, relative error in norm within BIAS_CANCELLATION_TOLERANCE."""
    case = cases.BIAS_CANCELLATION_CASE
    cache = cases.bias_cancellation_cache()
    q = np.zeros((1, case.num_kv_heads * case.heads_per_kv, case.head_dim), np.float32)
    out = backends.decode_attention(backend, case, cache.pools(), cache.tables(), q)
    assert out.dtype == np.float32 and out.shape == q.shape
    expected = cases.reference_decode(case, cache, np.zeros(q.shape))
    relative = np.linalg.norm(out.astype(np.float64) - expected) / np.linalg.norm(expected)
    print(f"{backend}: relative error {relative:.2e}")
    assert relative < cases.BIAS_CANCELLATION_TOLERANCE


@pytest.mark.parametrize("merge", ["jax", "torch"])
def test_merge_partials_weighs_empty_splits_zero(merge):
    """The split merge of each framework (plain array code: the XLA path's is the JAX one): random
    partials with empty splits equal shared_math's merge, a hand-computed merge (weights 1 : 3 : 0),
    and rows with no token anywhere give o = 0, lse = −inf."""
    rng = np.random.default_rng(3)
    outputs = rng.standard_normal((3, 2, 4))
    lses = np.array([[0.5, -np.inf], [-np.inf, -np.inf], [1.5, 2.0]])
    o, lse = backends.merge_partials(merge, outputs.astype(np.float32), lses.astype(np.float32))
    expected_o, expected_lse = reference_attention.merge_partials(outputs, lses)
    np.testing.assert_allclose(o, expected_o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-6)
    o, lse = backends.merge_partials(merge, np.array([[[1.0, 2.0]], [[5.0, 5.0]], [[0.0, 0.0]]], np.float32),
                                     np.array([[0.0], [np.log(3.0)], [-np.inf]], np.float32))
    np.testing.assert_allclose(o, [[4.0, 4.25]], rtol=1e-6)
    np.testing.assert_allclose(lse, [np.log(4.0)], rtol=1e-6)
    for d in (2, 4):
        o, lse = backends.merge_partials(merge, np.zeros((2, 1, d), np.float32), np.full((2, 1), -np.inf, np.float32))
        assert np.all(o == 0) and np.all(np.isneginf(lse))


# ------------------------------------------------------------------------------- bad inputs
# The errors numpy inputs can make, every backend (torch's devices and strides, and each backend's
# launch knobs beyond these, stay in its own tests). A message that differs between the frameworks
# is a {"jax": ..., "torch": ...} pair ("jax" also for the XLA path).

SMALL = cases.AttentionCase("small", 64, 32, 2, 2, (70, 5), pages_per_split=2, pages_per_block=1)


@pytest.fixture(scope="module")
def small():
    cache = cases.build_cache(SMALL)
    return SMALL.query(), list(cache.pools()), list(cache.tables())


def _message(match, backend):
    return match["torch" if backend == "torch" else "jax"] if isinstance(match, dict) else match


def _decode(backend, q, pools, tables, **overrides):
    return backends.decode_attention(backend, SMALL, pools, tables, q, **overrides)


NAMES = cases.PagedCache.POOLS + cases.PagedCache.TABLES


@pytest.mark.parametrize(
    "name,transform,message",
    [
        ("k_bf16", cases.bf16_values, "k_bf16 must have dtype bfloat16"),
        ("k_bf16", lambda a: a[..., :32], r"k_bf16 must have shape \[\*, \*, \*, 64\]"),
        ("k_bf16", lambda a: a[:, :, :12], r"v_bf16 must have shape|page size 12"),
        ("v_bf16", lambda a: a[..., :32], "v_bf16 must have shape"),
        ("v_bf16", lambda a: a[:-1], r"v_bf16 must have shape \["),
        ("k_codes", lambda a: a.astype(np.int32), "k_codes must have dtype uint8"),
        ("k_codes", lambda a: a.astype(np.int8), "k_codes must have dtype uint8"),
        ("k_codes", lambda a: a[..., :8], r"k_codes must have shape \[\*, 2, 16, 16\]"),
        ("k_scale", lambda a: a.astype(np.float32), "k_scale must have dtype float16"),
        ("k_min", lambda a: a[:-1], "k_min must have shape"),
        ("v_codes", lambda a: a[:-1], "v_codes must have shape"),
        ("v_min", lambda a: a[..., :1], "v_min must have shape"),
        ("bf16_page_table", lambda a: a.astype(np.uint32), "bf16_page_table must have dtype int32"),
        ("bf16_page_table", lambda a: a[:1], r"bf16_page_table must have shape \[2, \*\]"),
        ("bf16_page_table", lambda a: a[:, :2], "sink_slots=4 exceeds the BF16 page table's 2 slots"),
        ("sink_tokens", lambda a: a[:1], r"sink_tokens must have shape \[2\]"),
        ("recent_tokens", lambda a: a.astype(np.float32), "recent_tokens must have dtype int32"),
        ("history_tokens", lambda a: a.astype(np.float32), "history_tokens must have dtype int32"),
    ],
)
def test_bad_cache_arrays_raise(backend, small, name, transform, message):
    q, pools, tables = small
    arrays = pools + tables
    i = NAMES.index(name)
    arrays[i] = transform(arrays[i])
    with pytest.raises(ValueError, match=_message(message, backend)):
        _decode(backend, q, arrays[:8], arrays[8:])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(group_size=24), "group_size=24"),
        (dict(group_size=48), "group_size=48"),
        (dict(group_size=128), "group_size=128"),
        (dict(group_size=16), {"jax": r"k_scale must have shape \[\d+, 2, 16, 4\], got \(\d+, 2, 16, 2\)",
                               "torch": r"k_scale must have shape \[\d+, 2, 16, 4\], got shape \(\d+, 2, 16, 2\)"}),
        (dict(softmax_scale=0.0), "softmax_scale=0.0 must be a finite positive number"),
        (dict(softmax_scale=float("nan")), "softmax_scale=nan"),
        (dict(pages_per_split=3, pages_per_block=2), "pages_per_split=3 must be a multiple of pages_per_block=2"),
        (dict(pages_per_split=6, pages_per_block=4), "pages_per_split=6 must be a multiple of pages_per_block=4"),
        (dict(pages_per_block=4, pages_per_split=2), "pages_per_block=4 must not exceed pages_per_split=2"),
        (dict(pages_per_block=8, pages_per_split=4), "pages_per_block=8"),
        (dict(pages_per_block=0), "pages_per_block=0 must be an integer >= 1"),
        (dict(sink_slots=99), "sink_slots=99"),
        (dict(sink_slots=-1), "sink_slots=-1 must be an integer >= 0"),
        (dict(sink_slots=1.5), "sink_slots=1.5 must be an integer"),
        (dict(num_warps=3), "num_warps=3 must be a power of two"),
        (dict(num_warps=0), "num_warps=0 must be an integer >= 1"),
        (dict(num_stages=0), "num_stages=0 must be an integer >= 1"),
        (dict(num_stages=2.0), "num_stages=2.0 must be an integer >= 1"),
    ],
)
def test_bad_static_arguments_raise(backend, small, overrides, message):
    q, pools, tables = small
    with pytest.raises(ValueError, match=_message(message, backend)):
        _decode(backend, q, pools, tables, **overrides)


def test_bad_query_raises(backend, small):
    q, pools, tables = small
    for bad, message in [
        (q.astype(np.float16), "q must have dtype float32 or bfloat16"),
        (q[0], r"q must have shape \[\*, \*, \*\]"),
        (q[:, :3], "query heads Hq=3 must be a multiple of KV heads Hkv=2"),
        (np.zeros((2, 4, 128), np.float32), r"k_bf16 must have shape \[\*, \*, \*, 128\]"),
        (q[1:], r"bf16_page_table must have shape \[1, \*\]"),
        (q[:1], r"bf16_page_table must have shape \[1, \*\]"),
    ]:
        with pytest.raises(ValueError, match=_message(message, backend)):
            _decode(backend, q=bad, pools=pools, tables=tables)
