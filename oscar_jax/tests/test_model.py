"""The JAX decoder against transformers (an implementation no one here wrote), and against itself.

Tiny random Llama / Qwen3 checkpoints are written with transformers and read back with our HF
loader; SmolLM2-135M (slow) is read from the shipped GGUF by both. Logits must agree within
LOGIT_TOL of the logit scale (float32 on CPU; the gap is summation order, ~1e-6 relative).
Greedy decoding through prefill + decode_step with DenseKVCache must pick exactly the tokens
that re-running the full forward pass picks.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import model as M
from oscar_jax.cache_api import DenseKVCache, KVCache
from oscar_jax.loaders import load_hf_dir, load_model, resolve_model_path
from oscar_jax.tokenizer import load_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# max |logits_ours - logits_ref| / max |logits_ref|, float32. Measured: tiny models ~1e-7,
# SmolLM2 (30 layers, 22 tokens) ~5e-6.
LOGIT_TOL = 2e-5
# Same model, same float32 math, different program (cached vs uncached, folded vs unfolded).
SELF_TOL = 2e-5

TINY = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            head_dim=16, rope_theta=10000.0, max_position_embeddings=256)


def _randomize(hf_model, seed: int):
    """HF's init (std 0.02, unit norms) gives near-uniform attention that would hide RoPE or
    head-ordering bugs: use O(1) activations and non-trivial norm weights instead."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights (incl. Qwen3 q_norm / k_norm)
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return hf_model


def _write_tiny(directory, family: str, seed: int = 0):
    if family == "llama":  # GQA 4:2, untied head
        config = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                          tie_word_embeddings=False, **TINY)
        hf = transformers.LlamaForCausalLM(config)
    else:  # Qwen3: qk_norm, GQA 6:2 like SmolLM2's 9:3, tied head
        config = transformers.Qwen3Config(num_attention_heads=6, num_key_value_heads=2,
                                          tie_word_embeddings=True, **TINY)
        hf = transformers.Qwen3ForCausalLM(config)
    _randomize(hf, seed).eval()
    hf.save_pretrained(directory)
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    """(family, hf_model, cfg, params) for a tiny random checkpoint round-tripped via disk."""
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf = _write_tiny(directory, request.param)
    cfg, params = load_hf_dir(directory)
    return request.param, hf, cfg, params


def _hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.array(tokens))).logits.numpy()


def _rel_err(ours, ref) -> float:
    return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


_forward = jax.jit(M.forward, static_argnames=("cfg", "collect"))
_prefill = jax.jit(M.prefill, static_argnames=("cfg", "all_logits"))
_decode_step = jax.jit(M.decode_step, static_argnames="cfg")


def _tokens(cfg, shape, seed):
    return jax.random.randint(jax.random.key(seed), shape, 0, cfg.vocab_size, jnp.int32)


# ---------------------------------------------------------------------------------------------
# Config table


@pytest.mark.parametrize("name, published", [
    ("smollm2-135m", 134.5e6), ("llama-3-8b", 8.03e9), ("qwen3-4b", 4.02e9),
    ("qwen3-8b", 8.19e9), ("qwen3-32b", 32.76e9), ("gemma3-270m", 268.1e6),
])
def test_config_table_matches_published_sizes(name, published):
    assert abs(M.num_params(M.MODEL_CONFIGS[name]) / published - 1) < 0.01


def test_config_rejects_bad_shapes():
    base = M.MODEL_CONFIGS["smollm2-135m"]
    with pytest.raises(ValueError, match="num_q_heads=9 must be a multiple of num_kv_heads=4"):
        M.ModelConfig(**{**base.__dict__, "num_kv_heads": 4})
    with pytest.raises(ValueError, match="head_dim=63 must be even"):
        M.ModelConfig(**{**base.__dict__, "head_dim": 63})
    odd = M.ModelConfig(**{**base.__dict__, "head_dim": 96})  # allowed for the model itself
    assert not odd.head_dim_is_power_of_two


# ---------------------------------------------------------------------------------------------
# Tiny checkpoints vs transformers


def test_tiny_logits_match_transformers(tiny):
    family, hf, cfg, params = tiny
    assert cfg.qk_norm == (family == "qwen3")
    tokens = _tokens(cfg, (2, 23), seed=1)
    ref = _hf_logits(hf, tokens)
    err = _rel_err(_forward(params, cfg, tokens), ref)
    print(f"{family}: max|Δlogit|/max|logit| = {err:.2e} (scale {np.abs(ref).max():.1f})")
    assert err < LOGIT_TOL


def test_tiny_activations_match_transformers(tiny):
    """What calibration collects is what transformers computes: v (v_proj output), the per-head
    attention output (o_proj input), and softmax(q·kᵀ/√D) of the post-QK-norm post-RoPE q, k."""
    family, hf, cfg, params = tiny
    tokens = _tokens(cfg, (1, 17), seed=2)
    captured = {}
    attn = hf.model.layers[1].self_attn
    hooks = [attn.v_proj.register_forward_hook(lambda m, i, o: captured.update(v=o)),
             attn.o_proj.register_forward_pre_hook(lambda m, i: captured.update(o=i[0]))]
    with torch.no_grad():
        out = hf(torch.tensor(np.array(tokens)), output_attentions=True)
    for hook in hooks:
        hook.remove()
    _, acts = _forward(params, cfg, tokens, collect=True)
    layer = acts[1]
    b, t = tokens.shape
    np.testing.assert_allclose(layer.v.reshape(b, t, -1), captured["v"].numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(layer.attn_out.reshape(b, t, -1), captured["o"].numpy(), atol=1e-5, rtol=1e-5)
    k = jnp.repeat(layer.k, cfg.q_per_kv, axis=2)  # query head i reads KV head i // G
    scores = jnp.einsum("bthd,bshd->bhts", layer.q, k) / cfg.head_dim**0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    np.testing.assert_allclose(jax.nn.softmax(scores, -1), out.attentions[1].numpy(), atol=1e-5)


def test_iter_layer_activations_matches_collect(tiny):
    _, _, cfg, params = tiny
    tokens = _tokens(cfg, (2, 9), seed=3)
    _, collected = _forward(params, cfg, tokens, collect=True)
    streamed = list(M.iter_layer_activations(params, cfg, tokens))
    assert [i for i, _ in streamed] == list(range(cfg.num_layers))
    for (_, a), b in zip(streamed, collected):
        assert a.q.shape == (2, 9, cfg.num_q_heads, cfg.head_dim)
        assert a.k.shape == a.v.shape == (2, 9, cfg.num_kv_heads, cfg.head_dim)
        assert a.attn_out.shape == a.q.shape
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Cache: prefill + decode_step


def _cache(cfg, batch, max_seq_len, dtype=jnp.float32):
    return DenseKVCache.create(num_layers=cfg.num_layers, batch=batch, num_kv_heads=cfg.num_kv_heads,
                               max_seq_len=max_seq_len, head_dim=cfg.head_dim, dtype=dtype)


def greedy_without_cache(params, cfg, prompt, max_new_tokens):
    """Oracle: re-run the full causal forward on the growing sequence. The sequence lives in one
    fixed-size buffer (causality makes the zero padding invisible), so it compiles once."""
    b, t = prompt.shape
    buffer = jnp.zeros((b, t + max_new_tokens), jnp.int32).at[:, :t].set(prompt)
    out = []
    for step in range(max_new_tokens):
        logits = _forward(params, cfg, buffer)[:, t + step - 1]
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        buffer = buffer.at[:, t + step].set(token)
        out.append(token)
    return np.asarray(jnp.stack(out, 1))


def _hf_greedy(hf, prompt, max_new_tokens):
    """transformers' own greedy choice, by full forward passes (no pad/eos handling involved,
    unlike `generate`, which would treat a prompt token equal to pad_token_id as padding)."""
    seq = torch.tensor(np.array(prompt))
    with torch.no_grad():
        for _ in range(max_new_tokens):
            seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[:, prompt.shape[1]:].numpy()


def test_dense_cache_is_a_kv_cache():
    assert isinstance(_cache(M.MODEL_CONFIGS["smollm2-135m"], 1, 4), KVCache)


def test_prefill_logits_equal_forward(tiny):
    _, _, cfg, params = tiny
    tokens = _tokens(cfg, (2, 12), seed=4)
    logits, cache = _prefill(params, cfg, tokens, _cache(cfg, 2, 32), all_logits=True)
    assert _rel_err(logits, np.asarray(_forward(params, cfg, tokens))) < SELF_TOL
    last, _ = _prefill(params, cfg, tokens, _cache(cfg, 2, 32))
    np.testing.assert_array_equal(last, logits[:, -1])
    # decode_step after the prompt == forward on prompt + token
    nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    step_logits, _ = _decode_step(params, cfg, nxt, cache, jnp.full((2,), 12, jnp.int32))
    full = _forward(params, cfg, jnp.concatenate([tokens, nxt[:, None]], 1))[:, -1]
    assert _rel_err(step_logits, np.asarray(full)) < SELF_TOL


def test_tiny_greedy_with_cache_equals_without_and_transformers(tiny):
    family, hf, cfg, params = tiny
    prompt = _tokens(cfg, (2, 7), seed=5)
    new, _ = M.generate_greedy(params, cfg, prompt, _cache(cfg, 2, 64), max_new_tokens=16)
    oracle = greedy_without_cache(params, cfg, prompt, 16)
    np.testing.assert_array_equal(np.asarray(new), oracle)
    np.testing.assert_array_equal(np.asarray(new), _hf_greedy(hf, prompt, 16))


def test_right_padded_batch_decodes_each_row_like_alone(tiny):
    """Per-row positions: a short prompt padded on the right decodes as if it were alone."""
    _, _, cfg, params = tiny
    long, short = _tokens(cfg, (1, 9), seed=6), _tokens(cfg, (1, 5), seed=7)
    batch = jnp.concatenate([long, jnp.pad(short, ((0, 0), (0, 4)))], 0)
    lengths = jnp.array([9, 5], jnp.int32)
    logits, cache = _prefill(params, cfg, batch, _cache(cfg, 2, 32), lengths=lengths)
    token, got = jnp.argmax(logits, -1).astype(jnp.int32), []
    for step in range(6):
        got.append(token)
        logits, cache = _decode_step(params, cfg, token, cache, lengths + step)
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    got = np.asarray(jnp.stack(got, 1))
    np.testing.assert_array_equal(got[0], greedy_without_cache(params, cfg, long, 6)[0])
    np.testing.assert_array_equal(got[1], greedy_without_cache(params, cfg, short, 6)[0])


def test_bf16_cache_runs_and_stays_close(tiny):
    _, _, cfg, params = tiny
    tokens = _tokens(cfg, (1, 10), seed=8)
    f32, _ = _prefill(params, cfg, tokens, _cache(cfg, 1, 16), all_logits=True)
    bf16, cache = _prefill(params, cfg, tokens, _cache(cfg, 1, 16, jnp.bfloat16), all_logits=True)
    assert cache.k[0].dtype == jnp.bfloat16
    assert _rel_err(bf16, np.asarray(f32)) < 0.05  # bf16 K/V: ~3 significant digits


def test_cache_rejects_prompt_longer_than_buffer(tiny):
    _, _, cfg, params = tiny
    with pytest.raises(ValueError, match="do not fit the cache"):
        _prefill(params, cfg, _tokens(cfg, (1, 9), 0), _cache(cfg, 1, 8))


# ---------------------------------------------------------------------------------------------
# Rotation folding


def _random_orthogonal(key, shape):
    q, r = jnp.linalg.qr(jax.random.normal(key, shape, jnp.float32))
    return q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def test_fold_value_rotation_keeps_logits(tiny):
    _, _, cfg, params = tiny
    rot = _random_orthogonal(jax.random.key(9), (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim))
    folded = M.fold_value_rotation(params, cfg, rot)
    tokens = _tokens(cfg, (2, 15), seed=10)
    base, base_acts = _forward(params, cfg, tokens, collect=True)
    got, got_acts = _forward(folded, cfg, tokens, collect=True)
    err = _rel_err(got, np.asarray(base))
    print(f"fold: max|Δlogit|/max|logit| = {err:.2e}")
    assert err < SELF_TOL
    # The cache now holds v·R for each KV head.
    want_v = jnp.einsum("btkd,kde->btke", base_acts[0].v, rot[0])
    np.testing.assert_allclose(got_acts[0].v, want_v, atol=1e-5, rtol=1e-5)


def test_fold_value_rotation_rejects_wrong_shape(tiny):
    _, _, cfg, params = tiny
    with pytest.raises(ValueError, match=r"v_rotation shape \(2, 2, 16, 8\)"):
        M.fold_value_rotation(params, cfg, jnp.zeros((2, 2, 16, 8)))


def test_fuse_qkv_gives_the_same_logits_bit_for_bit(tiny):
    """One [H, (Hq + 2K)·D] projection computes the same float32 dot products as three (CPU, f32)."""
    _, _, cfg, params = tiny
    fused = M.fuse_qkv(params)
    q_w, kv_w = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for layer, old in zip(fused["layers"], params["layers"]):
        assert "wq" not in layer and "wk" not in layer and "wv" not in layer
        assert layer["wqkv"].shape == (cfg.hidden_size, q_w + 2 * kv_w)
        np.testing.assert_array_equal(layer["wqkv"][:, q_w + kv_w:], old["wv"])
    assert M.fuse_qkv(fused)["layers"][0]["wqkv"] is fused["layers"][0]["wqkv"]  # already fused: kept
    tokens = _tokens(cfg, (2, 15), seed=11)
    base, base_acts = _forward(params, cfg, tokens, collect=True)
    got, got_acts = _forward(fused, cfg, tokens, collect=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(base))
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(getattr(got_acts[1], name), getattr(base_acts[1], name))


def test_fuse_qkv_and_fold_value_rotation_order(tiny):
    _, _, cfg, params = tiny
    rot = jnp.broadcast_to(jnp.eye(cfg.head_dim), (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim))
    with pytest.raises(ValueError, match="fold before fuse_qkv"):
        M.fold_value_rotation(M.fuse_qkv(params), cfg, rot)
    broken = dict(params, layers=[{k: v for k, v in params["layers"][0].items() if k != "wk"}] + params["layers"][1:])
    with pytest.raises(ValueError, match=r"layer 0 has no \['wk'\] to fuse"):
        M.fuse_qkv(broken)


def test_init_params_runs_at_real_head_layout():
    """Random weights at a real model's head layout (shrunk depth/width) run the cached path."""
    real = M.MODEL_CONFIGS["qwen3-8b"]
    cfg = M.ModelConfig(**{**real.__dict__, "num_layers": 2, "hidden_size": 256,
                           "intermediate_size": 256, "vocab_size": 512})
    params = M.init_params(cfg, jax.random.key(0))
    assert sum(w.size for w in jax.tree_util.tree_leaves(params)) == M.num_params(cfg)
    logits, _ = _prefill(params, cfg, _tokens(cfg, (1, 6), 0), _cache(cfg, 1, 8))
    assert logits.shape == (1, 512) and bool(jnp.all(jnp.isfinite(logits)))


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M from the shipped GGUF (slow: ~100 MB fetch on first use, ~30 s of loading)

SENTENCE = ("The quick brown fox jumps over the lazy dog, and then it runs into the forest "
            "to find its friends.")


@pytest.fixture(scope="module")
def smollm2():
    cfg, params = load_model("smollm2-135m")
    path = resolve_model_path("smollm2-135m")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # Our tokenizer (checked against transformers' in test_loaders); both models get these ids.
    prompt = jnp.array([load_tokenizer("smollm2-135m").encode(SENTENCE)], jnp.int32)
    return cfg, params, hf, prompt


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    cfg, params, hf, tokens = smollm2
    assert cfg == M.MODEL_CONFIGS["smollm2-135m"]
    ref = _hf_logits(hf, tokens)
    ours = np.asarray(_forward(params, cfg, tokens))
    err = _rel_err(ours, ref)
    print(f"smollm2: max|Δlogit| = {np.max(np.abs(ours - ref)):.2e}, relative {err:.2e}, "
          f"scale {np.abs(ref).max():.1f}")
    assert err < LOGIT_TOL
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_smollm2_greedy_with_cache_equals_without(smollm2):
    cfg, params, hf, prompt = smollm2
    new, _ = M.generate_greedy(params, cfg, prompt, _cache(cfg, 1, 64), max_new_tokens=16)
    np.testing.assert_array_equal(np.asarray(new), greedy_without_cache(params, cfg, prompt, 16))
    np.testing.assert_array_equal(np.asarray(new), _hf_greedy(hf, prompt, 16))
