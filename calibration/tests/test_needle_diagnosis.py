"""needle_diagnosis on synthetic keys and queries: what each measurement returns, exactly."""

import jax.numpy as jnp
import numpy as np
import pytest

from calibration import needle_diagnosis as nd
from calibration.methods import parse_method

SHAPE = dict(num_layers=1, num_kv_heads=1, head_dim=16)
PROMPT, ANSWER = 40, 3  # 43 keys; windows 4/8 (page 4) put the needle at 10..14 in the history


def _case(seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((PROMPT + ANSWER, 1, 16)).astype(np.float32)
    needle = np.zeros(PROMPT + ANSWER, bool)
    needle[10:15] = True
    q = (rng.standard_normal((ANSWER, 2, 16)) * 0.1).astype(np.float32)  # 2 query heads of the KV head
    q[:, 0] += 3.0 * keys[10:15, 0].mean(axis=0)  # head 0 looks for the needle, head 1 does not
    return q, keys, needle


def test_the_bf16_reference_changes_nothing():
    q, keys, needle = _case()
    got = nd.diagnose_layer(parse_method("bf16", **SHAPE), 0, q, keys, PROMPT, needle)
    np.testing.assert_allclose(got["mass_method"], got["mass_bf16"], rtol=0, atol=1e-12)
    assert np.all(np.isnan(got["key_error_needle"]))  # nothing is history: no error to measure
    assert got["mass_bf16"][0] > 0.5 > got["mass_bf16"][1]  # the head built to find the needle does


def test_a_quantized_history_is_measured_on_its_tokens_only():
    q, keys, needle = _case()
    method = parse_method("quarot-int2:windows=4/8:page=4", **SHAPE)
    got = nd.diagnose_layer(method, 0, q, keys, PROMPT, needle)
    # the relative error of 2-bit rows of 16 Gaussian values: well above 0, well below 1
    assert 0.1 < got["key_error_needle"][0] < 0.6 and 0.1 < got["key_error_history"][0] < 0.6
    assert np.all(got["score_error_needle"] > 0) and np.all(got["score_error_history"] > 0)
    assert np.all(np.abs(got["score_bias_needle"]) <= got["score_error_needle"])  # |mean| ≤ RMS
    far = needle.copy()
    far[:] = False
    far[PROMPT - 2:PROMPT] = True  # in the recent window: BF16 for every method
    recent = nd.diagnose_layer(method, 0, q, keys, PROMPT, far)
    assert np.isnan(recent["key_error_needle"][0]) and np.isnan(recent["score_error_needle"]).all()
    assert recent["key_error_history"][0] == got["key_error_history"][0]  # the history is the same


def test_relative_key_error_matches_a_direct_computation():
    q, keys, needle = _case(1)
    method = parse_method("quarot-int2:windows=4/8:page=4", **SHAPE)
    got = nd.diagnose_layer(method, 0, q, keys, PROMPT, needle)
    rotated = (keys.astype(np.float64) @ method.k_rotation[0, 0]).astype(np.float32)
    stored = np.asarray(jnp.asarray(rotated).astype(jnp.bfloat16).astype(jnp.float32))  # the BF16 cache rows
    quantized = method.quantize_keys(0, stored[None])[0]
    intervals = method.history_intervals(len(keys))
    history = np.zeros(len(keys), bool)
    for t in range(PROMPT, PROMPT + ANSWER):
        history[intervals.k_start[t]:intervals.k_end[t]] = True
    relative = np.linalg.norm(quantized - stored, axis=-1)[:, 0] / np.linalg.norm(stored, axis=-1)[:, 0]
    np.testing.assert_allclose(got["key_error_needle"][0], relative[needle & history].mean(), rtol=1e-6)
    np.testing.assert_allclose(got["key_error_history"][0], relative[history].mean(), rtol=1e-6)


def test_summary_keeps_the_mass_of_the_bf16_retrieval_heads():
    sample = {"correct": {"m": False}, "per_method": {"m": {
        "mass_bf16": np.array([[0.6, 0.1], [0.2, 0.05]]), "mass_method": np.array([[0.3, 0.1], [0.2, 0.5]]),
        "key_error_needle": np.array([[0.3]]), "key_error_history": np.array([[0.2]]),
        "score_error_needle": np.array([[1.0, 2.0], [3.0, 4.0]]), "score_error_history": np.array([[1.0, 1.0], [1.0, 1.0]]),
        "score_bias_needle": np.array([[-0.5, 0.0], [-1.5, 9.0]]), "score_bias_history": np.array([[0.0, 0.0], [0.1, 0.0]])}}}
    got = nd.summarize([sample], ["m"], retrieval_heads=2)["m"]
    assert got["retrieval_head_mass_kept"] == pytest.approx((0.3 + 0.2) / (0.6 + 0.2))  # heads by BF16 mass only
    assert got["retrieval_head_mass_kept_when_wrong"] == got["retrieval_head_mass_kept"]
    assert got["retrieval_head_mass_kept_when_correct"] is None and got["samples_wrong"] == 1
    assert got["score_error_needle"] == pytest.approx(2.5)
    assert got["retrieval_head_score_bias_needle"] == pytest.approx(-1.0)  # heads (0, 0) and (1, 0)
    assert got["retrieval_head_score_error_needle"] == pytest.approx(2.0)


def test_replay_rebuilds_the_samples_of_a_run_and_refuses_others():
    from calibration.passkey import build_sample

    class Tokenizer:  # one token per character
        def encode(self, text):
            return [ord(c) % 97 for c in text]

    docs = [list(range(50 + i)) for i in range(8)]
    config = {"seed": 3, "lengths": [400], "depths": [0.2, 0.8], "samples": 1}
    rng = np.random.default_rng(3)  # the draws of calibration.passkey.run_passkey, in its order
    records = []
    for depth in config["depths"]:
        key = str(rng.integers(10000, 100000))
        sample = build_sample(Tokenizer(), docs, 400, depth, key, first_doc=int(rng.integers(len(docs))))
        records.append({"key": key, "needle_position": sample.needle_position, "sample": 0})
    rebuilt = nd.replay_samples(Tokenizer(), config, records, docs)
    assert [(s.key, s.needle_position, s.depth) for s, _ in rebuilt] == [
        (r["key"], r["needle_position"], d) for r, d in zip(records, config["depths"])]
    with pytest.raises(ValueError, match="does not replay"):
        nd.replay_samples(Tokenizer(), config, [records[0], dict(records[1], key="00000")], docs)
    with pytest.raises(ValueError, match="holds 1 samples"):
        nd.replay_samples(Tokenizer(), config, records[:1], docs)
