"""Calibration and evaluation of a model with sliding-window (local) layers — the tiny random
Gemma-3-shaped model of oscar_jax/tests/test_gemma3.py (layers local, global, local; window 4):
local layers keep their BF16 window for every method (no rotation, no quantization), only the
global layer is calibrated and quantized, and the artifact keeps every layer (identity and clip
1 for the local ones, named in the provenance)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from calibration import evaluate, passkey
from calibration.calibrate import CalibrationOptions, calibrate
from calibration.emulation import emulated_logits, prepare_params, windowed_attention
from calibration.methods import parse_method
from oscar_jax import model as M
from oscar_jax.cache_api import reference_attention
from oscar_jax.tests.test_gemma3 import TINY, _random_params
from shared_math.artifact import ModelFingerprint, read_artifact

CFG = dataclasses.replace(TINY, max_seq_len=512)
ALL_LOCAL = dataclasses.replace(CFG, layer_types=("local",) * 3)
TEXT = "\n\n".join(" ".join(f"w{(i * 7 + j * 13) % 89} {'is' if (i + j) % 3 else 'was'} w{(i + j) % 83}."
                            for j in range(30)) for i in range(30))


class TinyTokenizer:  # one token per byte, BOS added like Gemma's
    bos_id, eos_id, add_bos = 2, 1, True

    def encode(self, text, add_bos=None):
        ids = [3 + b % (CFG.vocab_size - 3) for b in text.encode("utf-8")]
        return ([self.bos_id] if (self.add_bos if add_bos is None else add_bos) else []) + ids


@pytest.fixture(scope="module")
def params():
    return _random_params(CFG)


@pytest.fixture(scope="module")
def artifact(params, tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path_factory.mktemp("artifact")
    import oscar_jax.loaders
    import oscar_jax.tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oscar_jax.loaders, "load_model", lambda path: (CFG, params))
        mp.setattr(oscar_jax.tokenizer, "load_tokenizer", lambda path: TinyTokenizer())
        art, report = calibrate(CalibrationOptions(model_path="tiny-gemma", calib_data=str(text), calib_tokens=512,
                                                   seq_len=128, heldout_tokens=128, output_dir=str(out),
                                                   fit_clip=True, progress=False))
    return read_artifact(out, expected_model=ModelFingerprint(3, 4, 1, 16)), report


def _method(spec, art=None, cfg=CFG):
    return parse_method(spec, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                        artifact=art)


@pytest.mark.parametrize("q_start,t,chunk", [(0, 13, 5), (0, 13, 64), (6, 7, 3)])
def test_windowed_attention_is_the_models_masked_attention(q_start, t, chunk):
    rng = np.random.default_rng(0)
    s = q_start + t
    q = jnp.asarray(rng.standard_normal((1, t, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, s, 1, 16)), jnp.float32) for _ in range(2))
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    want = reference_attention(q, k, v, pos[:, q_start:], pos, window=4)
    got = windowed_attention(q, k, v, 4, q_start=q_start, query_chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_artifact_keeps_every_layer_and_calibrates_the_global_one(artifact):
    art, report = artifact
    eye = np.eye(16, dtype=np.float32)
    for layer in (0, 2):  # local
        for rot in (art.k_rotation, art.v_rotation):
            np.testing.assert_array_equal(rot[layer, 0], eye)
        assert art.k_clip_ratio[layer] == art.v_clip_ratio[layer] == 1.0
        assert not art.k_eigenvalues[layer].any() and not art.v_eigenvalues[layer].any()
    assert np.abs(art.k_rotation[1, 0] - eye).max() > 0.05 and art.k_eigenvalues[1, 0, -1] > 0
    assert art.provenance["unused_layers"] == [0, 2] and "window of 4" in art.provenance["unused_layers_reason"]
    assert report["calibrated_layers"] == [1] and len(report["heldout_errors"]["oscar"]["key_logit"]) == 1
    assert art.codec == {"group_size": 16, "levels": "minmax"}


def test_local_layers_are_the_same_bf16_window_for_every_method(params, artifact):
    """With every layer local no method stores anything of its own: all equal BF16 exactly; with
    the global layer quantized (no BF16 tiers) they differ, and the local layers' weights are
    never touched by a value rotation."""
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, (1, 40)).astype(np.int32)
    art = artifact[0]
    specs = ["oscar:windows=0/0", "quarot-int2:windows=0/0", "kivi2:group=16:residual=16"]
    all_local = _random_params(ALL_LOCAL)
    ref = emulated_logits(all_local, ALL_LOCAL, tokens, _method("bf16", cfg=ALL_LOCAL), query_chunk=8)
    for spec in specs:
        got = emulated_logits(all_local, ALL_LOCAL, tokens, _method(spec, art, ALL_LOCAL), query_chunk=8)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    bf16 = np.asarray(emulated_logits(params, CFG, tokens, _method("bf16"), query_chunk=8))
    for spec in specs:
        assert np.abs(np.asarray(emulated_logits(params, CFG, tokens, _method(spec, art), query_chunk=8)) - bf16).max() > 1e-3
    prepared = prepare_params(params, CFG, _method("quarot-int2"))
    for layer in (0, 2):
        for name in ("wv", "wo"):
            np.testing.assert_array_equal(np.asarray(prepared["layers"][layer][name]),
                                          np.asarray(params["layers"][layer][name]))
    assert not np.array_equal(np.asarray(prepared["layers"][1]["wv"]), np.asarray(params["layers"][1]["wv"]))
    # the BF16 emulation is the model: forward with K/V rounded to bfloat16 differs by that rounding only
    forward = np.asarray(M.forward(params, CFG, jnp.asarray(tokens)))
    assert np.abs(forward - bf16).max() < 2e-2 * np.abs(forward).max()


def test_evaluate_says_which_layers_a_method_covers(params, artifact, tmp_path):
    art_dir = tmp_path / "art"
    from shared_math.artifact import write_artifact

    write_artifact(art_dir, artifact[0])
    text = tmp_path / "prose.txt"
    text.write_text(TEXT)
    args = evaluate.parse_args(["--model", "tiny", "--text-file", str(text), "--context", "48", "--num-windows", "2",
                                "--methods", "bf16,oscar:windows=0/0,quarot-int2,kivi2:group=16:residual=16",
                                "--artifact", str(art_dir), "--json", str(tmp_path / "o.json"), "--no-progress"])
    report = evaluate.run(args, "cmd", model=(CFG, params), tokenizer=TinyTokenizer())
    json.loads(json.dumps(report))
    assert report["config"]["window_start"].startswith("BOS")
    assert report["config"]["local_layers"]["layers"] == [0, 2]
    for r in report["methods"].values():
        assert r["config"]["applies_to_layers"] == [1] and r["config"]["local_layers"]["window"] == 4
        assert np.isfinite(r["perplexity"])
    bf16 = report["methods"]["bf16"]
    assert bf16["bits_per_element_128k"] == 16.0
    assert bf16["bits_per_element_all_layers_128k"] == pytest.approx((16 + 2 * 16 * 4 / 131072) / 3)
    assert report["methods"]["oscar:windows=0/0"]["kl_vs_bf16"] > 0


def test_passkey_runs_with_local_layers(params, artifact):
    tok = TinyTokenizer()
    docs = [tok.encode(p, add_bos=False) for p in TEXT.split("\n\n")]
    sample = passkey.build_sample(tok, docs, 400, 0.5, "12345")
    assert sample.prompt[0] == tok.bos_id and tok.bos_id not in sample.prompt[1:].tolist()
    methods = [_method("bf16"), _method("oscar", artifact[0])]
    run = passkey.run_passkey(params, CFG, tok, methods, lengths=[300], depths=[0.5], docs=docs, progress=False)
    assert run["methods"]["oscar"]["config"]["applies_to_layers"] == [1]
    pre = passkey.answer_logits(params, CFG, sample, methods)
    dec = passkey.answer_logits(params, CFG, sample, methods, mode="decode")
    for m in methods:
        assert pre[m.name].shape == dec[m.name].shape == (len(sample.answer), CFG.vocab_size)
        # float32 prompt (prefill) against BF16 K/V (decode): the same logits but for that rounding
        assert np.abs(pre[m.name] - dec[m.name]).max() < 2e-2 * np.abs(dec[m.name]).max()


def test_blocked_metrics_equal_whole_window_metrics(params, artifact, monkeypatch):
    """A large vocabulary's logits are summed a block of rows at a time: the same metrics."""
    windows = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 30)).astype(np.int32)
    methods = [_method("bf16"), _method("oscar:windows=0/0", artifact[0]), _method("kivi2:group=16:residual=16")]
    whole = evaluate.evaluate_methods(params, CFG, windows, methods, progress=False, query_chunk=8)
    monkeypatch.setattr(evaluate, "LOGIT_BLOCK_ELEMENTS", 10 * CFG.vocab_size)
    monkeypatch.setattr(evaluate, "LOGIT_BLOCK_ROWS_ELEMENTS", 7 * CFG.vocab_size)
    blocked = evaluate.evaluate_methods(params, CFG, windows, methods, progress=False, query_chunk=8)
    for name, r in whole.items():
        for key in ("perplexity", "kl_vs_bf16", "top1_agreement"):
            assert blocked[name][key] == pytest.approx(r[key], rel=1e-5, abs=1e-7), (name, key)
    assert whole["oscar:windows=0/0"]["kl_vs_bf16"] > 0
