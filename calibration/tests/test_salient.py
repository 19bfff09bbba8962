"""`oscar:salient=N`: history tokens kept in BF16 for the answer, chosen at the end of the prompt."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calibration import passkey
from calibration.emulation import EmulatedCache, forward_with_cache
from calibration.methods import SALIENT_INDEX_BITS, bits_per_element, salient_positions
from calibration.tests.test_evaluate import CFG, WordTokenizer, _haystack_docs, build
from calibration.tests.test_methods import make_artifact
from oscar_jax.model import init_params

WINDOWS = "windows=16/16"
LENGTH = 120  # prompt 115 tokens: history [16, 96) at rest, and no page demoted during the 5 answer steps


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0), std=0.2)


@pytest.fixture(scope="module")
def artifact():
    return make_artifact(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)


@pytest.fixture(scope="module")
def sample():
    return passkey.build_sample(WordTokenizer(), _haystack_docs(), LENGTH, 0.4, "27182")


def test_no_salient_tokens_is_the_plain_method_bit_for_bit(params, artifact, sample):
    methods = [build(f"oscar:{WINDOWS}", artifact), build(f"oscar:{WINDOWS}:salient=0", artifact),
               build(f"oscar:{WINDOWS}:salient=8:observe=4", artifact)]  # makes the prefill keep its queries
    got = passkey.answer_logits(params, CFG, sample, methods, query_chunk=16)
    plain, zero, some = (got[m.name] for m in methods)
    assert np.array_equal(plain, zero)
    assert np.array_equal(plain[0], some[0])  # the first answer token comes from the prompt's own pass
    assert np.abs(some[1:] - plain[1:]).max() > 1e-3  # 8 BF16 tokens change the answer steps


def test_salient_beyond_the_history_is_bf16_attention(params, artifact, sample):
    method = build(f"oscar:{WINDOWS}:salient=1000", artifact)
    p, a = len(sample.prompt), len(sample.answer)
    iv = method.history_intervals(p + a)
    start, end = method.at_rest_history(p)[:2]
    assert end - start == 80 and all((iv.k_start[t], iv.k_end[t]) == (start, end) for t in range(p, p + a))
    # the same rotations, nothing quantized: BF16 attention in the rotated basis
    reference = dataclasses.replace(method, name="rotated-bf16", quantizer=None, salient=0)
    plain = build(f"oscar:{WINDOWS}", artifact)
    got = passkey.answer_logits(params, CFG, sample, [method, reference, plain], query_chunk=16)
    np.testing.assert_allclose(got[method.name], got["rotated-bf16"], atol=1e-5, rtol=0)
    assert np.abs(got[plain.name] - got["rotated-bf16"])[1:].max() > 1e-2  # the history is quantized otherwise


def test_salient_with_per_channel_keys(params, artifact, sample):
    """With keys per channel (whole groups of the history quantized) salient rows are chosen over
    the values' history and replace both copies: beyond the history it is BF16 attention, and 8
    tokens change the answer steps of the per-channel method."""
    keys = f"oscar:{WINDOWS}:keys=channel:kgroup=32"  # history 80 tokens: keys quantized over [16, 80)
    method = build(f"{keys}:salient=1000", artifact)
    reference = dataclasses.replace(method, name="rotated-bf16", quantizer=None, salient=0, key_group=0)
    plain, some = build(keys, artifact), build(f"{keys}:salient=8:observe=4", artifact)
    got = passkey.answer_logits(params, CFG, sample, [method, reference, plain, some], query_chunk=16)
    np.testing.assert_allclose(got[method.name], got["rotated-bf16"], atol=1e-5, rtol=0)
    assert np.abs(got[plain.name] - got["rotated-bf16"])[1:].max() > 1e-2
    assert np.array_equal(got[plain.name][0], got[some.name][0])
    assert np.abs(got[some.name] - got[plain.name])[1:].max() > 1e-3


def _numpy_selection(q, k, start, end, n):
    """float64 reference: causal softmax of the last W rows, summed over rows and grouped heads."""
    b, w, hq, d = q.shape
    p, kv = k.shape[1], k.shape[2]
    q = q.astype(np.float64).reshape(b, w, kv, hq // kv, d)
    scores = np.einsum("bwkgd,bskd->bkgws", q, k.astype(np.float64)) / np.sqrt(d)
    pos = np.arange(p - w, p)
    scores = np.where(np.arange(p)[None, :] <= pos[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    mass = probs.sum(axis=(2, 3))[:, :, start:end]
    return np.sort(np.argsort(-mass, axis=-1)[:, :, :n], axis=-1) + start, mass


def test_selection_is_the_top_n_by_attention_mass():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 8, 6, 16)).astype(np.float32) * 2
    k = rng.standard_normal((2, 50, 2, 16)).astype(np.float32)
    got = salient_positions(q, k, (5, 40), 7)
    want, mass = _numpy_selection(q, k, 5, 40, 7)
    assert got.shape == (2, 2, 7) and np.array_equal(got, want)
    kept = np.take_along_axis(mass, got - 5, axis=-1)
    assert np.all(kept.min(-1) >= np.sort(mass, axis=-1)[:, :, -7])  # no left-out token has more mass
    assert salient_positions(q, k, (5, 40), 100).shape == (2, 2, 35)  # capped at the candidates
    assert salient_positions(q, k, (5, 5), 3).shape == (2, 2, 0)


def test_answer_cache_selects_from_the_rotated_bf16_prompt(params, artifact, sample):
    """The wiring: the prompt's last W queries and BF16 keys in the method's rotated basis, history only."""
    method = build(f"oscar:{WINDOWS}:salient=5:observe=6", artifact)
    p = len(sample.prompt)
    capture = passkey.PrefillCapture(16, keep_queries=6)
    forward_with_cache(params, CFG, sample.prompt[None], capture, rows=[p - 1])
    cache = passkey.AnswerCache(method, capture, 16)
    forward_with_cache(params, CFG, sample.answer[None, :-1], cache, start=p)
    start, end = method.at_rest_history(p)[:2]
    for layer in range(CFG.num_layers):
        rot = jnp.asarray(method.k_rotation[layer])
        q = np.asarray(passkey.AnswerCache._rotate(capture.q[layer], rot))
        k = np.asarray(passkey.AnswerCache._rotate(capture.k[layer], rot).astype(jnp.bfloat16).astype(jnp.float32))
        want, _ = _numpy_selection(q, k, start, end, 5)
        assert np.array_equal(cache.selected[layer], want), layer
        assert cache.selected[layer].min() >= start and cache.selected[layer].max() < end


def test_bits_count_the_bf16_rows_and_their_index(artifact):
    plain, salient = build("oscar", artifact), build("oscar:salient=256", artifact)
    kv, d, n = CFG.num_kv_heads, CFG.head_dim, 131072
    extra = 256 * (2 * d * 16 + SALIENT_INDEX_BITS) / (2 * n * d)  # K and V BF16 rows + one index per head
    assert bits_per_element(salient, n, kv, d) == pytest.approx(bits_per_element(plain, n, kv, d) + extra, abs=1e-12)
    assert bits_per_element(plain, n, kv, 64) == pytest.approx(2.533, abs=1e-3)
    assert bits_per_element(salient, n, kv, 64) == pytest.approx(2.533 + 0.0317, abs=1e-3)
    short = build("oscar:windows=16/16:salient=1000", artifact)  # more than the history: capped at it
    history = short.at_rest_history(100)[1] - short.at_rest_history(100)[0]
    base = build("oscar:windows=16/16", artifact)
    extra = history * (2 * d * 16 + SALIENT_INDEX_BITS) / (2 * 100 * d)
    assert bits_per_element(short, 100, kv, d) == pytest.approx(bits_per_element(base, 100, kv, d) + extra)


def test_salient_is_refused_where_it_is_not_emulated(params, artifact, sample):
    method = build("oscar:salient=4", artifact)
    assert method.describe()["salient"]["tokens"] == 4
    with pytest.raises(ValueError, match="end of a prompt"):
        EmulatedCache(method)
    with pytest.raises(ValueError, match="prefill-chunk 0"):
        passkey.answer_logits(params, CFG, sample, [method], prefill_chunk=32)
    with pytest.raises(ValueError, match="observe= applies only"):
        build("oscar:observe=8", artifact)
    with pytest.raises(ValueError, match="salient"):
        build("oscar:salient=-1", artifact)


def test_only_lengths_draws_a_fixed_subset_and_parts_merge_into_the_full_run(params, artifact):
    methods = [build("bf16"), build(f"oscar:{WINDOWS}", artifact)]
    kw = dict(lengths=[100, 120], depths=[0.2, 0.8], samples=1, docs=_haystack_docs(), progress=False, seed=5,
              query_chunk=16)
    full = passkey.run_passkey(params, CFG, WordTokenizer(), methods, **kw)
    parts = [passkey.run_passkey(params, CFG, WordTokenizer(), methods, only_lengths=[n], **kw) for n in (120, 100)]
    assert [r["length"] for r in parts[0]["samples"]] == [120, 120]
    assert parts[0]["samples"] == full["samples"][2:] and list(parts[0]["methods"]["bf16"]["by_length"]) == ["120"]
    config = {"model": "tiny", "mode": "prefill", "prefill_chunk": 0, "lengths": [100, 120], "depths": [0.2, 0.8],
              "samples": 1, "seed": 5, "haystack": "docs", "artifact": None, "seconds": 1.0}
    for part, n in zip(parts, (120, 100)):
        part["config"] = {**config, "only_lengths": [n], "command": f"part {n}"}
    merged = passkey.merge_results(parts, "merge")
    assert merged["samples"] == full["samples"] and merged["methods"] == full["methods"]
    assert merged["config"]["only_lengths"] is None and merged["config"]["seconds"] == 2.0
    with pytest.raises(ValueError, match="overlap"):
        passkey.merge_results([parts[0], parts[0]], "merge")
    with pytest.raises(ValueError, match="subset"):
        passkey.run_passkey(params, CFG, WordTokenizer(), methods, only_lengths=[64], **kw)
