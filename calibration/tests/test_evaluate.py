"""Decode-faithful emulation against token-by-token decoding, and the evaluation CLI on a tiny model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calibration import evaluate
from calibration.emulation import EmulatedCache, _band_of, emulated_logits, mixed_attention, prepare_params
from calibration.methods import HistoryIntervals, KiviMethod, TurboQuantMethod, parse_method
from calibration.tests.test_methods import make_artifact
from oscar_jax.cache_api import reference_attention
from oscar_jax.model import ModelConfig, decode_step, init_params, prefill
from shared_math.artifact import write_artifact

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_q_heads=6,
                  num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-5, tie_embeddings=True,
                  max_seq_len=512)
# One pass vs T decode steps differ in float32 op order; a K/V element rounded to bfloat16 the
# other way can then move a quantization group's min/max or flip a code. Measured: ≤ 1e-3 (bf16),
# ≤ 4e-3 (KIVI's 16-token key groups) on logits of std ≈ 1.6. One key read from the wrong tier
# moves them by 0.1–3 (the off-by-one mutant below).
LOGIT_ATOL = 1e-2


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0), std=0.2)  # std 0.2: attention far from uniform


@pytest.fixture(scope="module")
def artifact():
    return make_artifact(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)


def build(spec, artifact=None):
    return parse_method(spec, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim,
                        artifact=artifact)


def tokens_of(length, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (1, length), 0, CFG.vocab_size)


class DecodeReference:
    """A dense cache decoded one token at a time, holding the tiers literally.

    Tiered methods: append to the sink while it is not full, else to the recent list; when the
    recent list reaches W + page rows, quantize its oldest page into the history after this step's
    attention (the runtime's demotion: shared_math.allocator keeps the pre-demotion view). KIVI: its
    decode step (keys flushed R at a time after attention, values kept R + 1 during attention).
    Attention is a float64 softmax over [sink, history, recent] / KIVI's lists.
    """

    def __init__(self, method):
        self.m = method
        self.state = {}

    def _rotate(self, x, layer):
        if self.m.k_rotation is None:
            return np.asarray(x, np.float32)
        rot = self.m.k_rotation[layer]  # [K, D, D]
        t, h, d = x.shape
        xg = np.asarray(x, np.float32).reshape(t, rot.shape[0], h // rot.shape[0], d)
        return np.einsum("tkgd,kde->tkge", xg, rot).reshape(t, h, d).astype(np.float32)

    @staticmethod
    def _bf16(x):
        return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))

    def attend(self, layer, q, k, v, positions):
        if q.shape[1] > 1:  # a one-chunk prefill: rows enter the tiers one by one; the chunk attends to itself in float32
            for i in range(q.shape[1]):
                row = self._bf16(self._rotate(np.asarray(k[0, i : i + 1]), layer))[0]
                self._store(layer, row, self._bf16(np.asarray(v[0, i])))
            return reference_attention(q, k, v, positions, positions), self
        q = self._rotate(np.asarray(q[0]), layer)[0]  # [Hq, D]
        k = self._bf16(self._rotate(np.asarray(k[0]), layer))[0]  # [K, D]
        v = self._bf16(np.asarray(v[0], np.float32))[0]
        keys, values = self._store(layer, k, v)
        hq, d = q.shape
        kv = keys.shape[1]
        qg = q.reshape(kv, hq // kv, d).astype(np.float64)
        scores = np.einsum("kgd,skd->kgs", qg, keys.astype(np.float64)) / np.sqrt(d)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.einsum("kgs,skd->kgd", p, values.astype(np.float64)).reshape(1, 1, hq, d)
        return jnp.asarray(out, jnp.float32), self

    def _store(self, layer, k, v):
        if isinstance(self.m, KiviMethod):
            return self._kivi(layer, k, v)
        return (self._turboquant if isinstance(self.m, TurboQuantMethod) else self._tiered)(layer, k, v)

    def _turboquant(self, layer, k, v):
        """vLLM: the new token is quantized into the cache, then attention reads the whole cache."""
        st = self.state.setdefault(layer, [])
        st.append((self.m.quantize_keys(layer, k[None, None])[0, 0], self.m.quantize_values(layer, v[None, None])[0, 0]))
        return np.stack([r[0] for r in st]), np.stack([r[1] for r in st])

    def _tiered(self, layer, k, v):
        w = self.m.windows
        st = self.state.setdefault(layer, {"sink": [], "history": [], "recent": []})
        (st["sink"] if len(st["sink"]) < w.sink else st["recent"]).append((k, v))
        rows = st["sink"] + st["history"] + st["recent"]  # attention reads these, then a due page demotes
        if len(st["recent"]) == w.recent + w.page_size:
            page, st["recent"] = st["recent"][: w.page_size], st["recent"][w.page_size :]
            pk = self.m.quantize_keys(layer, np.stack([p[0] for p in page])[None])[0]
            pv = self.m.quantize_values(layer, np.stack([p[1] for p in page])[None])[0]
            st["history"] += list(zip(pk, pv))
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def _kivi(self, layer, k, v):
        r = self.m.residual
        st = self.state.setdefault(layer, {"kq": [], "kf": [], "vq": [], "vf": []})
        st["kf"].append(k)
        keys = np.stack(st["kq"] + st["kf"])  # attention reads these, then the flush happens
        if len(st["kf"]) == r:
            st["kq"] += list(self.m.quantize_keys(layer, np.stack(st["kf"])[None])[0])
            st["kf"] = []
        st["vf"].append(v)
        values = np.stack(st["vq"] + st["vf"])
        if len(st["vf"]) > r:
            st["vq"].append(self.m.quantize_values(layer, st["vf"][0][None, None])[0, 0])
            st["vf"] = st["vf"][1:]
        return keys, values


def decode_reference_logits(params, method, tokens):
    p = prepare_params(params, CFG, method)
    cache = DecodeReference(method)
    out = []
    for t in range(tokens.shape[1]):
        logits, cache = decode_step(p, CFG, tokens[:, t], cache, jnp.full((1,), t, jnp.int32))
        out.append(np.asarray(logits[0]))
    return np.stack(out)


@pytest.mark.parametrize("spec,length", [
    ("oscar:windows=16/16", 72),
    ("quarot-int2:windows=0/16:page=16", 56),
    ("naive-int2:windows=16/32", 72),
    ("kivi2:group=16:residual=32", 75),
])
def test_emulation_matches_token_by_token_decoding(params, artifact, spec, length):
    method = build(spec, artifact)
    tokens = tokens_of(length)
    emulated = np.asarray(emulated_logits(params, CFG, tokens, method, query_chunk=16)[0])
    reference = decode_reference_logits(params, method, tokens)
    np.testing.assert_allclose(emulated, reference, atol=LOGIT_ATOL, rtol=0)
    # ...and the tolerance can see a wrong tier: quantizing one more key per query is far outside it
    mutant = np.asarray(emulated_logits(params, CFG, tokens, OneMoreHistoryKey(method), query_chunk=16)[0])
    assert np.abs(mutant - reference).max() > 10 * LOGIT_ATOL


@pytest.mark.parametrize("spec", ["turboquant:skip=0", "turboquant:preset=k3v2_nc:rotation=random:skip=0"])
def test_turboquant_emulation_matches_quantize_on_write_decoding(params, spec):
    method = build(spec)
    tokens = tokens_of(40)
    emulated = np.asarray(emulated_logits(params, CFG, tokens, method, query_chunk=16)[0])
    reference = decode_reference_logits(params, method, tokens)
    np.testing.assert_allclose(emulated, reference, atol=LOGIT_ATOL, rtol=0)
    # ...and reading the new token's key from BF16 instead (one key per query off) is visible
    mutant = OneMoreHistoryKey(method, shift=-1)
    assert np.abs(np.asarray(emulated_logits(params, CFG, tokens, mutant, query_chunk=16)[0]) - reference).max() \
        > 10 * LOGIT_ATOL


def test_turboquant_boundary_layers_are_the_bf16_cache(params):
    tokens = tokens_of(24)
    tq = build("turboquant")  # 2 layers: vLLM keeps both (first 2 / last 2) unquantized
    assert tq.skip_layers == {0, 1}
    np.testing.assert_allclose(np.asarray(emulated_logits(params, CFG, tokens, tq, query_chunk=8)),
                               np.asarray(emulated_logits(params, CFG, tokens, build("bf16"), query_chunk=8)),
                               atol=1e-5, rtol=0)


class OneMoreHistoryKey:
    """A method whose K history interval ends `shift` positions later (an off-by-one tier bug)."""

    def __init__(self, method, shift=1):
        self.method, self.name, self.shift = method, method.name + f"{shift:+d}", shift
        self.k_rotation, self.v_rotation = method.k_rotation, method.v_rotation
        self.quantize_keys, self.quantize_values = method.quantize_keys, method.quantize_values

    def history_intervals(self, length):
        iv = self.method.history_intervals(length)
        k_end = np.where(iv.k_end > iv.k_start, np.minimum(iv.k_end + self.shift, np.arange(length) + 1), iv.k_end)
        return iv._replace(k_end=k_end)


def test_emulated_logits_equal_prefill_with_the_emulated_cache(params, artifact):
    method = build("oscar:windows=16/16", artifact)
    tokens = tokens_of(48)
    via_prefill, _ = prefill(prepare_params(params, CFG, method), CFG, tokens, EmulatedCache(method), all_logits=True)
    fast = emulated_logits(params, CFG, tokens, method, query_chunk=16)
    np.testing.assert_allclose(np.asarray(fast), np.asarray(via_prefill), atol=LOGIT_ATOL, rtol=0)
    rows = np.array([3, 40, 47])
    some = emulated_logits(params, CFG, tokens, method, query_chunk=16, rows=rows)
    np.testing.assert_allclose(np.asarray(some), np.asarray(fast)[:, rows], atol=1e-5, rtol=0)


def test_emulated_cache_rejects_other_positions(params):
    cache = EmulatedCache(build("bf16"))
    q = jnp.zeros((1, 2, 6, 64))
    kv = jnp.zeros((1, 2, 2, 64))
    with pytest.raises(ValueError, match="positions must be 0..T-1"):
        cache.attend(0, q, kv, kv, jnp.array([[5, 6]]))
    with pytest.raises(TypeError, match="without jax.jit"):
        jax.jit(lambda p: cache.attend(0, q, kv, kv, p))(jnp.array([[0, 1]]))


def _dense_mixed_attention(q, k_hi, k_lo, v_hi, v_lo, iv, k_raw=None, v_raw=None):
    """Per-(query, key) selection with dense masks, float64."""
    b, t, hq, d = q.shape
    kv = k_hi.shape[2]
    s = np.arange(t)
    in_k = (s >= iv.k_start[:, None]) & (s < iv.k_end[:, None])  # [T, S]
    in_v = (s >= iv.v_start[:, None]) & (s < iv.v_end[:, None])
    raw = np.zeros((t, t), bool) if iv.raw_start is None else s >= iv.raw_start[:, None]
    qg = q.astype(np.float64).reshape(b, t, kv, hq // kv, d)

    def scores(keys):
        return np.einsum("btkgd,bskd->bkgts", qg, keys) / np.sqrt(d)

    sc = np.where(in_k, scores(k_lo), scores(k_hi))
    if k_raw is not None:
        sc = np.where(raw, scores(k_raw), sc)
    sc = np.where(s[None, :] <= s[:, None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    hi = ~in_v & ~raw
    out = np.einsum("bkgts,bskd->btkgd", np.where(hi, p, 0), v_hi) + np.einsum("bkgts,bskd->btkgd", np.where(in_v, p, 0), v_lo)
    if v_raw is not None:
        out += np.einsum("bkgts,bskd->btkgd", np.where(raw, p, 0), v_raw)
    return out.reshape(b, t, hq, d)


def test_mixed_attention_with_an_unrounded_prefill_chunk():
    """raw_start (a prefill chunk attending to itself in float32), with query chunks that straddle it."""
    from calibration.emulation import NO_RAW

    rng = np.random.default_rng(1)
    t, hq, kv, d, prompt = 120, 4, 2, 16, 100
    arrays = [rng.normal(size=s).astype(np.float32) for s in [(1, t, hq, d)] + [(1, t, kv, d)] * 6]
    q, k_hi, k_lo, k_raw, v_hi, v_lo, v_raw = arrays
    pos = np.arange(t)
    c0 = (pos // 32) * 32
    end = np.where(pos < prompt, np.clip(c0, 8, 60), np.maximum(8, pos - 30))
    iv = HistoryIntervals(np.full(t, 8), end, np.full(t, 8), end, np.where(pos < prompt, c0, NO_RAW))
    out = mixed_attention(*(jnp.asarray(a) for a in (q, k_hi, k_lo, v_hi, v_lo)), iv, query_chunk=24,
                          k_raw=jnp.asarray(k_raw), v_raw=jnp.asarray(v_raw))
    np.testing.assert_allclose(np.asarray(out), _dense_mixed_attention(q, k_hi, k_lo, v_hi, v_lo, iv, k_raw, v_raw),
                               atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="needs k_raw"):
        mixed_attention(*(jnp.asarray(a) for a in (q, k_hi, k_lo, v_hi, v_lo)), iv)
    bad = iv._replace(raw_start=np.zeros(t, int))  # overlaps the history
    with pytest.raises(ValueError, match="overlaps the history"):
        mixed_attention(*(jnp.asarray(a) for a in (q, k_hi, k_lo, v_hi, v_lo)), bad, k_raw=jnp.asarray(k_raw),
                        v_raw=jnp.asarray(v_raw))


def _intervals(kind, t, rng):
    pos = np.arange(t)
    if kind == "random":
        a, c = rng.integers(0, t, (2, t)), rng.integers(0, t, (2, t))
        return HistoryIntervals(np.minimum(a[0], c[0]), np.maximum(a[0], c[0]), np.minimum(a[1], c[1]), np.maximum(a[1], c[1]))
    if kind == "oscar":
        return build("naive-int2:windows=16/64").history_intervals(t)
    if kind == "kivi":
        return KiviMethod("kivi2", 16, 32).history_intervals(t)
    return HistoryIntervals(np.full(t, 3), np.maximum(3, pos - 5), np.zeros(t, int), pos // 2)


@pytest.mark.parametrize("kind,t,chunk", [("random", 37, 10), ("skewed", 37, 10), ("oscar", 220, 64),
                                          ("kivi", 200, 48), ("random", 200, 256)])
def test_mixed_attention_against_dense_selection(kind, t, chunk):
    """Chunks and bands (keys whose tier differs inside a chunk) against dense per-(query, key) masks."""
    rng = np.random.default_rng(0)
    hq, kv, d = 4, 2, 16
    q, k_hi, k_lo, v_hi, v_lo = (rng.normal(size=s).astype(np.float32) for s in [(1, t, hq, d)] + [(1, t, kv, d)] * 4)
    iv = _intervals(kind, t, rng)
    out = mixed_attention(*(jnp.asarray(a) for a in (q, k_hi, k_lo, v_hi, v_lo)), iv, query_chunk=chunk)
    np.testing.assert_allclose(np.asarray(out), _dense_mixed_attention(q, k_hi, k_lo, v_hi, v_lo, iv), atol=2e-5, rtol=0)
    if kind == "oscar":  # no history at all: the lo arrays may be absent
        none = HistoryIntervals(*(np.zeros(t, int),) * 4)
        plain = mixed_attention(*(jnp.asarray(a) for a in (q, k_hi)), None, jnp.asarray(v_hi), None, none, query_chunk=chunk)
        np.testing.assert_allclose(np.asarray(plain), _dense_mixed_attention(q, k_hi, k_hi, v_hi, v_hi, none), atol=2e-5)


def test_band_plan_is_narrow_for_tiered_methods():
    """For OSCAR-style tiers the per-chunk band spans about one chunk (plus a page), not all keys."""
    iv = build("naive-int2").history_intervals(2048)
    q_pos = np.arange(1024, 1280)
    base_lo, start, width = _band_of(iv.k_start[1024:1280], iv.k_end[1024:1280], q_pos, 1280)
    assert width <= 256 + 64 and base_lo[64:start].all() and not base_lo[:64].any() and start > 64


# ---------------------------------------------------------------------------------------------
# evaluate_methods and the CLI


def test_bf16_against_itself_and_metric_sanity(params, artifact):
    windows = np.asarray(tokens_of(3 * 40, seed=7)).reshape(3, 40)
    methods = [build("bf16"), build("naive-int2:windows=0/0"), build("oscar:windows=16/16", artifact)]
    res = evaluate.evaluate_methods(params, CFG, windows, methods, progress=False, query_chunk=16)
    assert res["bf16"]["kl_vs_bf16"] == 0.0 and res["bf16"]["top1_agreement"] == 1.0
    assert res["bf16"]["perplexity_vs_bf16"] == 1.0 and res["bf16"]["bits_per_element"] == 16.0
    naive = res["naive-int2:windows=0/0"]
    assert naive["kl_vs_bf16"] > 0 and naive["top1_agreement"] < 1 and len(naive["per_window"]) == 3
    # pooled perplexity = exp(mean NLL) = geometric mean of equal-length windows' perplexities
    assert naive["perplexity"] == pytest.approx(np.exp(np.mean([np.log(w["perplexity"]) for w in naive["per_window"]])))
    # a reference that is not requested is still computed (KL needs it) but not reported
    res2 = evaluate.evaluate_methods(params, CFG, windows[:1], methods[1:2], progress=False, query_chunk=16)
    assert list(res2) == ["naive-int2:windows=0/0"]
    assert res2["naive-int2:windows=0/0"]["kl_vs_bf16"] == pytest.approx(naive["per_window"][0]["kl_vs_bf16"])


class ByteTokenizer:
    eos_id = 0

    def encode(self, text):
        return [1 + b % (CFG.vocab_size - 1) for b in text.encode("utf-8")]


def _args(tmp_path, *extra):
    text = tmp_path / "prose.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(20)))
    return evaluate.parse_args(["--model", "tiny", "--text-file", str(text), "--context", "64", "--num-windows", "2",
                                "--json", str(tmp_path / "out.json"), "--no-progress", *extra])


def test_cli_json_shape(params, artifact, tmp_path):
    art_dir = tmp_path / "art"
    write_artifact(art_dir, artifact)
    args = _args(tmp_path, "--methods", "bf16,naive-int2,quarot-int2,kivi2:group=16:residual=32,oscar,int4,"
                 "int4:windows=0/0,turboquant:skip=0,turboquant:preset=k3v2_nc", "--artifact", str(art_dir))
    report = evaluate.run(args, "cmd", model=(CFG, params), tokenizer=ByteTokenizer())
    json.loads(json.dumps(report))  # serialisable
    assert set(report) == {"methods", "config", "environment"}
    assert list(report["methods"]) == args.method_specs
    for r in report["methods"].values():
        assert {"perplexity", "kl_vs_bf16", "top1_agreement", "bits_per_element"} <= set(r)
        assert np.isfinite(r["perplexity"]) and 0 <= r["top1_agreement"] <= 1
    assert report["config"]["context"] == 64 and "text file" in report["config"]["split"]
    assert report["config"]["artifact"]["codec"] == {"group_size": 64, "levels": "minmax"}
    assert report["environment"]["jax_backend"] == "cpu"
    assert report["methods"]["turboquant:skip=0"]["bits_per_element"] == pytest.approx(3.375)
    assert report["methods"]["turboquant:preset=k3v2_nc"]["bits_per_element"] == 16.0  # both layers are boundary
    assert report["methods"]["int4:windows=0/0"]["bits_per_element"] < report["methods"]["int4"]["bits_per_element"]
    out = evaluate.plot(report["methods"], tmp_path / "plot.png")
    assert out.stat().st_size > 0


def test_environment_is_recorded_when_the_run_starts(params, monkeypatch, tmp_path):
    """A long run must record the code it ran with, not whatever the checkout holds when it ends."""
    checkout = {"sha": "at-start"}
    evaluate_methods = evaluate.evaluate_methods

    def work_then_commit(*args, **kwargs):
        out = evaluate_methods(*args, **kwargs)
        checkout["sha"] = "at-end"  # someone commits while the run goes on
        return out

    monkeypatch.setattr(evaluate, "_git_sha", lambda: checkout["sha"])
    monkeypatch.setattr(evaluate, "evaluate_methods", work_then_commit)
    report = evaluate.run(_args(tmp_path, "--methods", "bf16"), "cmd", model=(CFG, params), tokenizer=ByteTokenizer())
    assert report["environment"]["git_sha"] == "at-start"


def test_cli_errors(params, artifact, tmp_path, capsys):
    model = dict(model=(CFG, params), tokenizer=ByteTokenizer())
    with pytest.raises(SystemExit):
        _args(tmp_path, "--methods", "bf16,int3")
    assert "unknown method 'int3'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args(tmp_path, "--context", "1")
    with pytest.raises(ValueError, match="too short for 50 windows × 64 tokens"):
        evaluate.run(_args(tmp_path, "--num-windows", "50", "--methods", "bf16"), "cmd", **model)
    assert evaluate.shipped_artifact("tiny") is None
    with pytest.raises(ValueError, match="needs a calibration artifact"):
        evaluate.run(_args(tmp_path, "--methods", "oscar"), "cmd", **model)
    with pytest.raises(ValueError, match="exceeds the model's trained context"):
        evaluate.run(_args(tmp_path, "--context", "1024", "--methods", "bf16"), "cmd", **model)
    # the artifact's own calibration file cannot be the evaluation text
    args = _args(tmp_path, "--methods", "bf16")
    calibrated_here = make_artifact(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
    calibrated_here.provenance["data"] = args.text_file
    with pytest.raises(ValueError, match="overlap calibration"):
        evaluate.check_no_calibration_overlap(args.text_file, calibrated_here)
    # … nor the calibration file of a second artifact named by `oscar:artifact=DIR`
    write_artifact(tmp_path / "here", calibrated_here)
    with pytest.raises(ValueError, match="overlap calibration"):
        evaluate.run(_args(tmp_path, "--methods", f"bf16,oscar:artifact={tmp_path / 'here'}"), "cmd", **model)
    assert "calibration reads only the calibration split" in evaluate.check_no_calibration_overlap("wiki", None)
    # the named off-distribution sources: evaluation-only, refused when an artifact says it was calibrated on one
    assert evaluate.parse_args(["--text-source", "kjv", "--json", "x"]).data == "kjv"
    assert evaluate.parse_args(["--data", "shakespeare", "--json", "x"]).data == "shakespeare"
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--text-source", "dickens", "--json", "x"])
    assert "evaluation-only" in evaluate.check_no_calibration_overlap("kjv", calibrated_here)
    calibrated_here.provenance["data"] = "kjv"
    with pytest.raises(ValueError, match="calibrated on 'kjv'"):
        evaluate.check_no_calibration_overlap("kjv", calibrated_here)
    with pytest.raises(ValueError, match="windows must be int"):
        evaluate.evaluate_methods(None, CFG, np.zeros((2, 1), np.int32), [build("bf16")], progress=False)


@pytest.mark.slow
def test_smollm2_smoke(tmp_path):
    """Real SmolLM2 and wiki evaluation text: one short window, bf16 vs naive INT2 vs INT4."""
    rc = evaluate.main(["--data", "wiki", "--context", "128", "--num-windows", "1", "--no-progress",
                        "--methods", "bf16,naive-int2:windows=0/0,int4:windows=0/0", "--json", str(tmp_path / "o.json")])
    assert rc == 0
    res = json.loads((tmp_path / "o.json").read_text())["methods"]
    assert 1 < res["bf16"]["perplexity"] < 200
    assert res["int4:windows=0/0"]["kl_vs_bf16"] < res["naive-int2:windows=0/0"]["kl_vs_bf16"]


# ---------------------------------------------------------------------------------------------
# Ablations (planning, caching and de-duplication; the calibration itself is faked)


def test_ablations_cache_and_deduplicate(params, tmp_path):
    from calibration import ablations
    from calibration.calibrate import CalibrationOptions, recorded_options

    calls = []

    def fake_calibrate(opts, command=None):
        calls.append(opts)
        art = make_artifact(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, group_size=opts.group_size or 64,
                            levels=opts.levels, seed=len(calls))
        art.provenance["options"] = recorded_options(opts)  # what calibrate records
        write_artifact(opts.output_dir, art)
        return art, {}

    base = CalibrationOptions(model_path="tiny", calib_tokens=256)
    windows = np.asarray(tokens_of(40, seed=3))
    groups = ["windows", "clip", "granularity"]
    table = ablations.run_ablations(params, CFG, windows, base=base, cache_dir=tmp_path, groups=groups,
                                    progress=False, calibrate_fn=fake_calibrate, query_chunk=16)
    assert len(calls) == 3  # base, fitted clip, per layer
    assert list(table) == ["granularity", "clip", "windows"] and list(table["windows"]) == ["0/0", "16/64", "64/256", "128/512"]
    base_row = table["windows"]["64/256"]
    # the same (artifact, method) is evaluated once and reported under every group that uses it
    assert table["clip"]["fixed 0.96/0.92"]["kl_vs_bf16"] == base_row["kl_vs_bf16"]
    assert table["granularity"]["per (layer, KV head)"]["artifact"] == base_row["artifact"]
    assert table["windows"]["0/0"]["bits_per_element"] < base_row["bits_per_element"]
    assert table["clip"]["fitted per layer"]["calibration"] == {"fit_clip": True}
    ablations.run_ablations(params, CFG, windows, base=base, cache_dir=tmp_path, groups=["clip"],
                            progress=False, calibrate_fn=fake_calibrate, query_chunk=16)
    assert len(calls) == 3  # cached artifacts reused
    assert "rotation" in ablations.GROUPS and "calibration_tokens" in ablations.GROUPS
    labels = [v.label for v in ablations.variants(8192, 64) if v.group == "calibration_tokens"]
    assert labels == ["2K", "8K", "32K"]
    with pytest.raises(ValueError, match="no ablation group"):
        ablations.run_ablations(params, CFG, windows, base=base, cache_dir=tmp_path, groups=["nope"],
                                calibrate_fn=fake_calibrate)


# ---------------------------------------------------------------------------------------------
# Passkey


class WordTokenizer:
    """Words → crc32 buckets; a run of digits → one token per digit (like SmolLM2)."""

    eos_id = 0

    def encode(self, text):
        import zlib

        out = []
        for word in text.split():
            if word.isdigit():
                out += [1 + int(c) for c in word]
            else:
                out.append(11 + zlib.crc32(word.encode()) % (CFG.vocab_size - 11))
        return out


def _haystack_docs(n=40):
    rng = np.random.default_rng(9)
    return [list(rng.integers(11, CFG.vocab_size, rng.integers(5, 15))) for _ in range(n)]


def test_passkey_samples():
    from calibration import passkey

    tok, docs = WordTokenizer(), _haystack_docs()
    for depth in (0.0, 0.5, 1.0):
        s = passkey.build_sample(tok, docs, 160, depth, "31415", first_doc=3)
        assert len(s.prompt) + len(s.answer) == 160 and s.answer.tolist() == [4, 2, 5, 2, 6]
        needle = tok.encode(passkey.NEEDLE.format(key="31415"))
        assert s.prompt[s.needle_position : s.needle_position + len(needle)].tolist() == needle
        assert s.prompt[-len(tok.encode(passkey.QUESTION)):].tolist() == tok.encode(passkey.QUESTION)
    early = passkey.build_sample(tok, docs, 160, 0.1, "31415").needle_position
    late = passkey.build_sample(tok, docs, 160, 0.9, "31415").needle_position
    assert early < late
    with pytest.raises(ValueError, match="no room"):
        passkey.build_sample(tok, docs, 20, 0.5, "31415")
    with pytest.raises(ValueError, match="fewer than"):
        passkey.build_sample(tok, docs[:2], 400, 0.5, "31415")
    with pytest.raises(ValueError, match="depth"):
        passkey.build_sample(tok, docs, 160, 1.5, "31415")


def test_passkey_prefill_mode_matches_prefill_then_decode(params, artifact):
    """Shared float32 prefill + per-method answer steps == runtime-style prefill then decode_step."""
    from calibration import passkey

    sample = passkey.build_sample(WordTokenizer(), _haystack_docs(), 100, 0.3, "27182")
    methods = [build("oscar:windows=16/16", artifact), build("kivi2:group=16:residual=32"), build("turboquant:skip=0"),
               build("bf16")]
    got = passkey.answer_logits(params, CFG, sample, methods, mode="prefill", query_chunk=16)
    p = len(sample.prompt)
    for m in methods[:3]:  # bf16 has no history: covered by the others' BF16 tiers
        folded = prepare_params(params, CFG, m)
        cache = DecodeReference(m)
        logits, cache = prefill(folded, CFG, jnp.asarray(sample.prompt)[None], cache)
        rows = [np.asarray(logits[0])]
        for i, token in enumerate(sample.answer[:-1]):
            logits, cache = decode_step(folded, CFG, jnp.asarray([token]), cache, jnp.asarray([p + i]))
            rows.append(np.asarray(logits[0]))
        np.testing.assert_allclose(got[m.name], np.stack(rows), atol=LOGIT_ATOL, rtol=0, err_msg=m.name)
    assert np.abs(got[methods[0].name] - got["bf16"])[1:].max() > 10 * LOGIT_ATOL  # history was read
    decode = passkey.answer_logits(params, CFG, sample, methods[:1], mode="decode", query_chunk=16)
    assert decode[methods[0].name].shape == got[methods[0].name].shape
    result = passkey.run_passkey(params, CFG, WordTokenizer(), methods[3:], lengths=[100], depths=[0.2, 0.8],
                                 docs=_haystack_docs(), progress=False, query_chunk=16)
    assert set(result["methods"]["bf16"]["grid"]["100"]) == {"0.2", "0.8"} and len(result["samples"]) == 2


@pytest.mark.parametrize("spec", ["oscar:windows=16/16", "kivi2:group=16:residual=32"])
def test_chunked_prefill_tiers(artifact, spec):
    """Prompt query t reads earlier chunks through the prompt's final tiers, its own chunk unquantized."""
    from calibration.passkey import ServingTiers
    from shared_math.spec import OscarConfig
    from shared_math.tiers import tier_split

    method, prompt, chunk, total = build(spec, artifact), 90, 32, 100
    iv = ServingTiers(method, prompt, chunk).history_intervals(total)
    decode = method.history_intervals(total)
    for t in range(total):
        for s in range(t + 1):
            if t >= prompt:
                want_k = decode.k_start[t] <= s < decode.k_end[t]
                want_v = decode.v_start[t] <= s < decode.v_end[t]
            elif isinstance(method, KiviMethod):
                own_chunk = s >= (t // chunk) * chunk
                want_k = not own_chunk and s < (prompt // 32) * 32
                want_v = not own_chunk and s < prompt - 32
            else:
                final = tier_split(prompt, OscarConfig(head_dim=64, sink=16, recent=16)).tier_of(s)
                want_k = want_v = s < (t // chunk) * chunk and final == "history"
            assert (iv.k_start[t] <= s < iv.k_end[t]) == want_k, (t, s)
            assert (iv.v_start[t] <= s < iv.v_end[t]) == want_v, (t, s)


def test_passkey_paths_agree(params, artifact):
    """The shared-prefill fast path equals the per-method emulated path when the prompt is one chunk."""
    from calibration import passkey

    sample = passkey.build_sample(WordTokenizer(), _haystack_docs(), 100, 0.5, "16180")
    method = build("oscar:windows=16/16", artifact)
    fast = passkey.answer_logits(params, CFG, sample, [method], prefill_chunk=0, query_chunk=16)[method.name]
    p, a = len(sample.prompt), len(sample.answer)
    tokens = np.concatenate([sample.prompt, sample.answer[:-1]])[None]
    one_chunk = passkey.ServingTiers(method, p, p)
    slow = np.asarray(emulated_logits(params, CFG, tokens, one_chunk, rows=np.arange(p - 1, p + a - 1), query_chunk=16)[0])
    np.testing.assert_allclose(fast, slow, atol=LOGIT_ATOL, rtol=0)
    chunked = passkey.answer_logits(params, CFG, sample, [method], prefill_chunk=32, query_chunk=16)[method.name]
    assert chunked.shape == fast.shape and np.abs(chunked - fast).max() > 10 * LOGIT_ATOL  # chunks read history
