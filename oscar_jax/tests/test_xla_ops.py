"""The native XLA path of oscar_jax.ops (oscar_jax/xla): what only it does (the kernel choice, jit and
donation, stacked pools, traced destinations, the key rotation, per-layer clip ratios, validation,
the runtime end to end), against shared_math and float64 references.

Integer results (packed codes, float16 metadata) are compared bit for bit with shared_math;
attention outputs against the float64 reference over the dequantized cache, within THE tolerance
table (parity_tests.cases.ATTENTION_TOLERANCES); the float32 key rotation against a float64
product (ROTATION_RTOL). The ops' parity with shared_math and the float64 reference over the
named cases (encode, decode, page writes, demotions, decode and prefill attention) is the parity
suite's, whose `backend` fixture runs this path as "xla" (parity_tests/test_parity.py,
test_ops_*.py). Every test here runs the XLA path (the `kernels("xla")` marker), on any backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import attention_ops, ops, xla
from oscar_jax.xla import codec as xla_codec
from oscar_jax.xla.write import rotate_rows
from parity_tests import cases
from parity_tests.backends import from_jax, to_jax  # uint16 arrays are bfloat16 bit patterns
from parity_tests.cases import assert_same_bits
from shared_math import codec as ref

pytestmark = pytest.mark.kernels("xla")

ARRAYS = ("packed", "scale", "minimum")
# float32 rotation vs float64: D products of |x·r| ≤ |x| summed in float32, |Δ| ≤ D·2⁻²⁴·‖x‖ ≈ 4e-6·‖x‖
# at D = 64; measured ≤ 5e-7 relative (in norm) on these rows. Half a decade of margin.
ROTATION_RTOL = 2e-6


def assert_encoding(got, want, what: str) -> None:
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(from_jax(a), e, f"{what} {name}")


# ------------------------------------------------------------------------------------ dispatch


def test_interpret_none_runs_xla_and_interpret_true_runs_the_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(xla_codec, "encode_rows", lambda *a, **k: calls.append("xla") or (None, None, None))
    monkeypatch.setattr(ops, "encode_rows", lambda *a, **k: calls.append("pallas") or (None, None, None))
    x = np.zeros((2, 64), np.float32)
    for interpret in (None, True):
        with pytest.raises(AttributeError):  # the stubs return None; only which one ran matters
            ops.encode(x, group_size=64, clip_ratio=0.9, interpret=interpret)
    assert calls == ["xla", "pallas"]


@pytest.mark.parametrize("choice,want", [("xla", "xla"), ("pallas", "pallas"),
                                         ("auto", "xla" if jax.default_backend() == "cpu" else "pallas")])
def test_the_environment_variable_and_the_context_choose(monkeypatch, choice, want):
    monkeypatch.setenv(xla.KERNELS_ENV, choice)
    assert xla.kernels() == want
    other = "pallas" if want == "xla" else "xla"
    with xla.use_kernels(other):
        assert xla.kernels() == other
    assert xla.kernels() == want


def test_an_unknown_choice_is_named(monkeypatch):
    monkeypatch.setenv(xla.KERNELS_ENV, "triton")
    with pytest.raises(ValueError, match="OSCAR_JAX_KERNELS='triton'"):
        xla.kernels()
    with pytest.raises(ValueError, match="kernels='cuda'"):
        with xla.use_kernels("cuda"):
            pass


# --------------------------------------------------------------------------------------- codec


def test_encode_is_deterministic_and_jittable():
    x = cases.CODEC_CASES[0].rows("ties")
    encode = jax.jit(lambda a: ops.encode(a, group_size=128, clip_ratio=0.96, levels="moments"))
    first, second = encode(x), encode(x)
    for a, b in zip(first, second):
        assert_same_bits(np.asarray(a), np.asarray(b), "run twice")
    assert_encoding(first, ref.encode(x, group_size=128, clip_ratio=0.96, levels="moments"), "jit")


# ---------------------------------------------------------------------------------- write path


@pytest.mark.parametrize("rows_dtype", ["float32", "bfloat16"])
def test_rotated_write_is_the_encoding_of_a_float32_accurate_rotation(rows_dtype):
    """Bytes: exactly shared_math.encode of the rows this path rotated. The rotation: within
    ROTATION_RTOL of the float64 product (bfloat16 rows: of their bfloat16 values)."""
    case = cases.WRITE_CASES[4]  # 77 tokens, 2 kv heads, D 64, G 16
    rows, rotation = case.rows("random"), case.rotation()
    if rows_dtype == "bfloat16":
        rows = cases.bf16_values(cases.bf16_bits(rows))
    x = jnp.asarray(rows).astype(rows_dtype)
    rotated = np.asarray(rotate_rows(x, jnp.asarray(rotation)))
    exact = np.einsum("tkd,kde->tke", rows.astype(np.float64), rotation.astype(np.float64))
    error = np.linalg.norm(rotated - exact, axis=-1) / np.linalg.norm(exact, axis=-1)
    assert error.max() < ROTATION_RTOL, error.max()
    got = ops.write_int2(x, rotation, group_size=case.group_size, clip_ratio=case.clip_ratio)
    assert_encoding(got, ref.encode(rotated, group_size=case.group_size, clip_ratio=case.clip_ratio), rows_dtype)


@pytest.mark.parametrize("case,levels", [(c, cases.LEVELS[(i + 1) % 2]) for i, c in enumerate(cases.WRITE_CASES)],
                         ids=lambda p: p if isinstance(p, str) else p.name)
def test_write_pages_land_exactly_with_the_other_encoder(case, levels):
    """Rows land at their (page, slot) with shared_math's bytes; every other byte of the (random)
    pools is unchanged. test_parity.py's write check runs each case with one encoder on every
    backend (test_written_and_demoted_pages_identical); this is the other, on the XLA path."""
    kwargs = dict(group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    pools, rows = case.int2_pools(), case.rows()
    page_ids, slots = case.destinations()
    got = ops.write_pages(*pools, rows, page_ids, slots, **kwargs)
    assert_encoding(got, cases.reference_scatter(pools, rows, page_ids, slots, **kwargs), case.name)


@pytest.mark.parametrize("case", [c for c in cases.WRITE_CASES if c.num_layers > 1], ids=lambda c: c.name)
def test_stacked_pools_write_one_layer_and_demote_all_layers(case):
    kwargs = dict(group_size=case.group_size, clip_ratio=case.clip_ratio, levels="minmax")
    pools, rows = case.int2_pools(layers=True), case.rows()
    page_ids, slots = case.destinations()
    layer = case.num_layers - 1
    got = [from_jax(a) for a in ops.write_pages(*pools, rows, page_ids, slots, layer=layer, **kwargs)]
    want = cases.reference_scatter(tuple(p[layer] for p in pools), rows, page_ids, slots, **kwargs)
    for name, a, p, w in zip(ARRAYS, got, pools, want):
        assert_same_bits(a[layer], w, f"layer {layer} {name}")
        assert_same_bits(a[:layer], p[:layer], f"other layers' {name}")  # untouched
    bf16_pool = case.bf16_pool(layers=True)
    src, dst = case.demotions()
    got = ops.demote_pages(to_jax(bf16_pool), *pools, src, dst, **kwargs)
    assert_encoding(got, cases.reference_demote(bf16_pool, pools, src, dst, **kwargs), f"{case.name} demote")



@pytest.mark.parametrize("levels", ["minmax", "moments"])
def test_cache_demotes_layers_with_different_clip_ratios_by_group(levels):
    """OscarKVCache.demote with a clip ratio per layer (a calibrated artifact's: here three layers,
    two clip indices) encodes each layer's pages with its own ratio, in one program per clip index
    (xla.write.demote_layer_groups): the bytes of shared_math's per-layer demotion."""
    from oscar_jax.cache import OscarKVCache
    from shared_math.spec import OscarConfig, clip_index

    case = next(c for c in cases.WRITE_CASES if c.name == "many_pages_odd")  # 3 layers, D = 64, G = 16
    ratios = (0.96, 0.84, 0.96)
    assert len({clip_index(r, case.head_dim) for r in ratios}) == 2
    config = OscarConfig(head_dim=case.head_dim, group_size=case.group_size, page_size=case.page_size,
                         sink=0, recent=0, levels=levels)
    cache = OscarKVCache.create(config, num_layers=case.num_layers, num_kv_heads=case.num_kv_heads,
                                num_bf16_pages=case.num_pages, num_int2_pages=case.num_pages,
                                k_rotation=np.broadcast_to(np.eye(case.head_dim, dtype=np.float32),
                                                           (case.num_layers, case.num_kv_heads) + (case.head_dim,) * 2),
                                k_clip_ratio=ratios, v_clip_ratio=ratios[::-1])
    assert cache.kernels == "xla"
    bf16_pool, pools = case.bf16_pool(layers=True), case.int2_pools(layers=True)
    v_pool = bf16_pool[::-1].copy()
    cache = dataclasses.replace(cache, k_bf16=to_jax(bf16_pool), v_bf16=to_jax(v_pool),
                                **{f"{t}_{n}": jnp.asarray(p) for t in "kv" for n, p in zip(("codes", "scale", "min"), pools)})
    src, dst = case.demotions()
    got = jax.jit(lambda c, s, d: c.demote(s, d))(cache, src, dst)
    for prefix, pool, layer_ratios in (("k", bf16_pool, ratios), ("v", v_pool, ratios[::-1])):
        for layer, ratio in enumerate(layer_ratios):
            want = cases.reference_demote(pool[layer], tuple(p[layer] for p in pools), src, dst,
                                          group_size=case.group_size, clip_ratio=ratio, levels=levels)
            have = [getattr(got, f"{prefix}_{n}")[layer] for n in ("codes", "scale", "min")]
            assert_encoding(have, want, f"{prefix} layer {layer} (clip ratio {ratio})")


def test_cache_holds_per_channel_key_pages_on_the_xla_path_only():
    """Format v2: OscarKVCache keeps a key scale and minimum per channel and page (values as v1), on
    the XLA path and with the Pallas kernels alike."""
    from oscar_jax.cache import OscarKVCache
    from shared_math.spec import OscarConfig

    args = dict(num_layers=1, num_kv_heads=2, num_bf16_pages=2, num_int2_pages=3,
                k_rotation=np.broadcast_to(np.eye(64, dtype=np.float32), (1, 2, 64, 64)), k_clip_ratio=[1.0],
                v_clip_ratio=[1.0])
    config = OscarConfig(head_dim=64, key_layout="channel")
    cache = OscarKVCache.create(config, **args)
    assert cache.k_scale.shape == cache.k_min.shape == (1, 3, 2, 64)
    assert cache.v_scale.shape == (1, 3, 2, 16, 1) and cache.k_codes.shape == (1, 3, 2, 16, 16)
    pallas = OscarKVCache.create(config, interpret=True, **args)
    assert pallas.k_scale.shape == cache.k_scale.shape and pallas.interpret is True


def test_traced_out_of_range_destinations_are_skipped():
    """Under jit the ids are not checked on the host: a page or slot outside the pool (negative ones
    included, which indexing would wrap) is never written; the valid rows are."""
    case = cases.WRITE_CASES[4]
    kwargs = dict(group_size=case.group_size, clip_ratio=case.clip_ratio, levels="minmax")
    pools, rows = case.int2_pools(), case.rows()[:6]
    page_ids = np.array([-1, case.num_pages, 0, 2, 3, 4], np.int32)
    slots = np.array([0, 0, -1, case.page_size, 5, 7], np.int32)
    got = jax.jit(lambda p, s: ops.write_pages(*pools, rows, p, s, **kwargs))(page_ids, slots)
    want = cases.reference_scatter(pools, rows[4:], page_ids[4:], slots[4:], **kwargs)
    assert_encoding(got, want, "only the two valid rows")
    src, dst = np.array([-1, 1, 2], np.int32), np.array([0, case.num_pages, 3], np.int32)
    bf16_pool = case.bf16_pool()
    got = jax.jit(lambda s, d: ops.demote_pages(to_jax(bf16_pool), *pools, s, d, **kwargs))(src, dst)
    assert_encoding(got, cases.reference_demote(bf16_pool, pools, src[2:], dst[2:], **kwargs), "one valid demotion")


def test_write_pages_token_by_token_under_jit_with_donation():
    """The cache's pattern: the pools donated to a jit that writes one token; 19 steps equal one write."""
    case = cases.WRITE_CASES[2]
    kwargs = dict(group_size=case.group_size, clip_ratio=case.clip_ratio, levels="minmax")
    pools, rows = case.int2_pools(), case.rows()
    page_ids, slots = case.destinations()
    step = jax.jit(lambda c, s, m, r, p, t: ops.write_pages(c, s, m, r, p, t, **kwargs), donate_argnums=(0, 1, 2))
    state = tuple(jnp.asarray(p) for p in pools)
    for t in range(case.num_tokens):
        state = step(*state, rows[t : t + 1], page_ids[t : t + 1], slots[t : t + 1])
    assert_encoding(state, cases.reference_scatter(pools, rows, page_ids, slots, **kwargs), "token by token")


# ----------------------------------------------------------------------------------- attention


def _decode(case, cache, **kwargs):
    out = attention_ops.decode_attention(
        to_jax(case.query()).astype(case.q_dtype), *(to_jax(a) for a in cache.pools() + cache.tables()),
        sink_slots=case.sink_slots, group_size=case.group_size, softmax_scale=case.softmax_scale, **kwargs)
    return np.asarray(out)


def test_a_sequence_with_no_cached_token_gets_zeros():
    case = cases.AttentionCase("empty_and_full", 64, 64, 3, 3, (0, 100))
    cache = cases.build_cache(case)
    out = _decode(case, cache)
    assert np.all(out[0] == 0)
    rest = dataclasses.replace(cache, sequences=cache.sequences[1:])  # the reference rejects an empty cache
    cases.assert_close(out[1:], cases.reference_decode(case, rest, case.query()[1:]), case.q_dtype)


def test_stacked_pools_read_one_layer_in_place():
    """layer=1 of pools stacked [3, P, …] reads exactly what the unstacked call reads."""
    case = cases.ATTENTION_CASES[1]
    cache = cases.build_cache(case)
    stacked = tuple(np.stack([np.roll(a, 1, axis=0), a, a[::-1]]) for a in cache.pools())
    q = to_jax(case.query())
    common = dict(sink_slots=case.sink_slots, group_size=case.group_size, softmax_scale=case.softmax_scale)
    tables = tuple(to_jax(a) for a in cache.tables())
    got = attention_ops.decode_attention(q, *(to_jax(a) for a in stacked), *tables, layer=1, **common)
    want = attention_ops.decode_attention(q, *(to_jax(a) for a in cache.pools()), *tables, **common)
    assert_same_bits(np.asarray(got), np.asarray(want), "layer 1 of the stack")


# --------------------------------------------------------------------------------- error paths


GOOD = np.zeros((3, 2, 64), np.float32)
POOLS = (np.zeros((2, 2, 16, 16), np.uint8), np.zeros((2, 2, 16, 1), np.float16), np.zeros((2, 2, 16, 1), np.float16))
IDS = np.zeros(3, np.int32)


@pytest.mark.parametrize("call,match", [
    (lambda: ops.encode(GOOD, group_size=24, clip_ratio=0.9), "group_size=24"),
    (lambda: ops.encode(GOOD, group_size=64, clip_ratio=1.5), "clip_ratio=1.5"),
    (lambda: ops.encode(GOOD, group_size=64, clip_ratio=0.9, levels="lloyd"), "levels='lloyd'"),
    (lambda: ops.decode(POOLS[0], POOLS[1][..., :0], POOLS[2], group_size=64), "scale has shape"),
    (lambda: ops.write_int2(GOOD, np.zeros((2, 64, 64), np.float64), group_size=64, clip_ratio=0.9),
     "rotation must be float32"),
    (lambda: ops.write_pages(*POOLS, GOOD, np.array([0, 1, 2], np.int32), IDS, group_size=64, clip_ratio=0.9),
     r"page_ids must lie in \[0, 2\)"),
    (lambda: ops.write_pages(*POOLS, GOOD, IDS, IDS, group_size=64, clip_ratio=0.9), "must be distinct"),
    (lambda: ops.write_bf16_pages(np.zeros((2, 2, 16, 64), jnp.bfloat16), GOOD, IDS, np.array([0, 1, 16], np.int32)),
     r"slots must lie in \[0, 16\)"),
    (lambda: ops.demote_pages(np.zeros((2, 2, 16, 64), jnp.bfloat16), *POOLS, np.array([0]), np.array([2]),
                              group_size=64, clip_ratio=0.9), r"dst_pages must lie in \[0, 2\)"),
])
def test_bad_inputs_raise_value_error_before_dispatch(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_attention_validation_is_the_same_on_the_xla_path():
    case = cases.ATTENTION_CASES[1]
    cache = cases.build_cache(case)
    args = [to_jax(a) for a in cache.pools() + cache.tables()]
    common = dict(sink_slots=case.sink_slots, group_size=case.group_size, softmax_scale=case.softmax_scale)
    q = to_jax(case.query())
    with pytest.raises(ValueError, match="query heads Hq=8"):
        attention_ops.decode_attention(q[:, :8], *args, **common)
    with pytest.raises(ValueError, match="softmax_scale=-1.0"):
        attention_ops.decode_attention(q, *args, **{**common, "softmax_scale": -1.0})
    with pytest.raises(ValueError, match="history_tokens must have dtype int32"):
        attention_ops.decode_attention(q, *args[:-1], args[-1].astype(jnp.int64 if jax.config.x64_enabled
                                                                         else jnp.int16), **common)
    chunk = jnp.zeros((2, 4, 9, 64), jnp.float32)
    with pytest.raises(ValueError, match="k_new has 2 KV heads but the cache has 3"):
        attention_ops.prefill_attention(chunk, chunk[:, :, :2], chunk[:, :, :2], *args, **common)


# ------------------------------------------------------------------------------------- runtime


def test_runtime_on_the_xla_path_matches_the_tier_reference(monkeypatch):
    """OscarRuntime end to end (prefill, decode, demotions) on the XLA path, against the float
    reference that emulates the tiers (oscar_jax/tests/test_runtime.py), with its tolerance; the
    runtime's prefill_pages_per_split reaches every prefill attention call (validated there)."""
    from oscar_jax import ops
    from oscar_jax.model import init_params
    from oscar_jax.tests.test_runtime import CFG, LOGIT_TOL, _run_both
    from shared_math.artifact import ModelFingerprint
    from shared_math.tests.test_artifact import make_artifact

    splits, prefill_attention = [], ops.prefill_attention

    def spy(*args, **kwargs):
        splits.append(kwargs["pages_per_split"])
        return prefill_attention(*args, **kwargs)

    monkeypatch.setattr(ops, "prefill_attention", spy)
    params = init_params(CFG, jax.random.PRNGKey(1), std=0.08)
    art = make_artifact(ModelFingerprint(2, 6, 2, 64))
    prompt = (np.arange(81) * 7 + 3) % CFG.vocab_size
    rt, got, want = _run_both(params, art, prompt, steps=40, prefill_chunk=32, prefill_pages_per_split=2)
    assert rt.cache.kernels == "xla" and rt.cache.prefill_pages_per_split == 2
    assert splits and set(splits) == {2}, splits  # traced once per layer of the prefill program
    assert rt.allocator.sequences[0].history_pages  # the INT2 tier was written and demoted into
    err = np.abs(got - want).max(axis=-1)
    assert err.max() < LOGIT_TOL, f"max logit error {err.max():.2e} at step {err.argmax()}"


def test_the_caches_prefill_tier_block_m_reaches_the_prefill_attention():
    """OscarKVCache.prefill_tier_block_m is what the prefill passes as tier_block_m: a value the op
    refuses (not a power of two) fails the runtime's prefill, naming it; a good one serves."""
    import dataclasses

    from oscar_jax.model import init_params
    from oscar_jax.runtime import OscarRuntime
    from oscar_jax.tests.test_runtime import CFG
    from shared_math.artifact import ModelFingerprint
    from shared_math.tests.test_artifact import make_artifact

    params = init_params(CFG, jax.random.PRNGKey(1), std=0.08)
    rt = OscarRuntime(params, CFG, make_artifact(ModelFingerprint(2, 6, 2, 64)), max_seq_len=128, prefill_chunk=32)
    prompt = [int(t) for t in (np.arange(40) * 7 + 3) % CFG.vocab_size]
    rt.cache = dataclasses.replace(rt.cache, prefill_tier_block_m=48)
    with pytest.raises(ValueError, match="tier_block_m=48"):
        rt.admit(prompt)
    rt = OscarRuntime(params, CFG, make_artifact(ModelFingerprint(2, 6, 2, 64)), max_seq_len=128, prefill_chunk=32)
    rt.cache = dataclasses.replace(rt.cache, prefill_tier_block_m=128)
    assert np.isfinite(np.asarray(rt.admit(prompt)[1])).all()


def test_decode_attention_over_per_channel_key_pages():
    """Format v2: the XLA decode attention reads history keys as per-channel pages (scale and minimum
    f16 [P, K, D]) and equals the float64 reference (shared_math mixed_tier_decode_attention with
    key_layout "channel") within THE float32 tolerance; two ragged sequences, GQA 3, stale NaN in
    unused BF16 rows."""
    from oscar_jax.xla.attention import decode_attention

    rng = np.random.default_rng(11)
    batch, kv, gq, d, page, g = 2, 2, 3, 64, 16, 64
    num_bf16, num_int2 = 8, 9
    k_bf16 = cases.bf16_values(cases.bf16_bits(rng.standard_normal((num_bf16, kv, page, d)).astype(np.float32)))
    v_bf16 = cases.bf16_values(cases.bf16_bits(rng.standard_normal((num_bf16, kv, page, d)).astype(np.float32)))
    k_bf16[7], v_bf16[7] = np.nan, np.nan  # a page no table names a valid row of
    history_k = rng.standard_normal((num_int2, page, kv, d)).astype(np.float32) * np.linspace(0.3, 4, d, dtype=np.float32)
    history_v = rng.standard_normal((num_int2, page, kv, d)).astype(np.float32)
    k_codes, k_scale, k_min = ref.encode_channels(history_k.transpose(0, 2, 1, 3), clip_ratio=1.0)  # [P, K, L, …]
    v_codes, v_scale, v_min = (a.transpose(0, 2, 1, 3) for a in ref.encode(history_v, group_size=g, clip_ratio=0.92))
    # sequence 0: sink page 0 (16), history pages 3, 5, 1 (48 tokens), recent pages 2, 4 (16 + 5)
    # sequence 1: sink page 6 (9 tokens, a short prompt), no history, no recent
    bf16_table = np.array([[0, 2, 4], [6, 7, 7]], np.int32)
    sink_tokens, recent_tokens = np.array([16, 9], np.int32), np.array([21, 0], np.int32)
    history_table = np.array([[3, 5, 1], [0, 0, 0]], np.int32)
    history_tokens = np.array([48, 0], np.int32)
    q = rng.standard_normal((batch, kv * gq, d)).astype(np.float32) * 3
    pools = [jnp.asarray(k_bf16, jnp.bfloat16), jnp.asarray(v_bf16, jnp.bfloat16)] + [
        jnp.asarray(a) for a in (k_codes, k_scale, k_min, v_codes, v_scale, v_min)]
    cache = tuple(pools) + tuple(jnp.asarray(a) for a in (bf16_table, sink_tokens, recent_tokens, history_table,
                                                          history_tokens))
    got = np.asarray(decode_attention(jnp.asarray(q), cache, sink_slots=1, group_size=g, softmax_scale=d**-0.5,
                                      key_layout="channel"))
    for b in range(batch):
        sink_page, recent_pages = bf16_table[b, 0], bf16_table[b, 1:]
        sink = tuple(p[sink_page].transpose(1, 0, 2)[: sink_tokens[b]] for p in (k_bf16, v_bf16))
        recent = tuple(np.concatenate([p[r].transpose(1, 0, 2) for r in recent_pages])[: recent_tokens[b]]
                       for p in (k_bf16, v_bf16))
        pages = history_table[b, : history_tokens[b] // page]
        k_hist = (k_codes[pages], k_scale[pages], k_min[pages])  # [P, K, L, D/4], [P, K, D]
        v_hist = tuple(a[pages].transpose(0, 2, 1, 3).reshape((-1,) + a.shape[1:2] + a.shape[3:])
                       for a in (v_codes, v_scale, v_min))  # token-major [S, K, …]
        want = cases.reference_attention.mixed_tier_decode_attention(
            q[b], sink=sink, history=(k_hist, v_hist), recent=recent, group_size=g, softmax_scale=d**-0.5,
            key_layout="channel")
        cases.assert_close(got[b], want, "float32")
