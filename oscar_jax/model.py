"""One decoder for the Llama family, Qwen3 and Gemma 3, written as plain functions over a params
pytree.

Why functional JAX and not Flax: the runtime jits `prefill` / `decode_step` with the cache
donated and the config static; a frozen `ModelConfig` plus a dict of arrays is exactly what
`jax.jit` wants, weight surgery (folding rotations, casting, sharding) is a `tree_map`, and
there is no module state to keep in sync with loaders. Flax would add a layer of indirection
and buy nothing here.

Architecture (matches transformers' LlamaForCausalLM / Qwen3ForCausalLM, no biases):
  x = embed[tokens]
  per layer:  h = rms_norm(x);  q, k, v = h·W_q, h·W_k, h·W_v  (split into heads)
              Qwen3 only (cfg.qk_norm): q, k = per-head rms_norm(q), rms_norm(k)
              q, k = rope(q), rope(k)  (HF "rotate_half", non-interleaved halves; float32)
              o = cache.attend(layer, q, k, v, positions)   [or causal attention, no cache]
              x = x + o·W_o;  x = x + W_down(silu(rms_norm(x)·W_gate) * (rms_norm(x)·W_up))
  logits = rms_norm(x)·lm_head   (lm_head = embedᵀ when cfg.tie_embeddings)

Gemma 3 is the same loop with configuration flags (defaults are the Llama behaviour; matches
transformers' Gemma3ForCausalLM): norms scale by (1 + w) (cfg.norm_weight_offset = 1), RMSNorm
also on the attention and MLP outputs before each residual add (cfg.post_norms), embeddings
times √hidden (cfg.scale_embeddings), GELU-tanh instead of SiLU in the gated MLP
(cfg.hidden_act), attention scaled by 1/√query_pre_attn_scalar, and per layer a type
(cfg.layer_types): "local" layers attend to the newest cfg.sliding_window positions only (the
query's own included) and use RoPE θ cfg.rope_local_theta, "global" layers see every position.
A cache learns a local layer's window through `cache.attend(..., window=w)` (global layers are
called exactly as before).

Params layout (weights stored [in, out] so a projection is `x @ w`):
  {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when tied),
   "layers": [ {"attn_norm": [H], "wq": [H, Hq·D], "wk": [H, K·D], "wv": [H, K·D],
                "wo": [Hq·D, H], "q_norm": [D], "k_norm": [D] (qk_norm only),
                "post_attn_norm": [H], "post_mlp_norm": [H] (post_norms only),
                "mlp_norm": [H], "w_gate": [H, I], "w_up": [H, I], "w_down": [I, H]}, ... ]}
`fuse_qkv` replaces a layer's wq, wk, wv by one "wqkv": [H, (Hq + 2K)·D] (the runtime does):
at batch 1 XLA runs the fused projection as one bandwidth-bound GEMM, where the narrow K and V
projections alone ran far below copy bandwidth.
Layers are a Python list (unrolled under jit, gpt-fast style): every layer may then own a
differently-shaped cache entry, and the calibration hook sees one layer at a time.

Tensor parallelism (oscar_jax.parallel runs these functions under `jax.shard_map`): with
`tp_axis` set, the params are one shard's (a shard's query heads with their KV heads, a slice of
the MLP's intermediate width, a slice of the vocabulary) and `cfg` is that shard's config. W_o
and W_down are then row-parallel: their partial products are summed across `tp_axis` (one psum
after attention, one after the MLP); the embedding is summed once from its vocabulary slices and
the logits are gathered once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp

from oscar_jax.cache_api import KVCache, reference_attention

Params = dict
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one decoder. Frozen and hashable: it is a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_embeddings: bool
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    max_seq_len: int = 8192  # the checkpoint's trained context (informational)
    # Gemma 3 (module docstring); the defaults are the Llama / Qwen3 behaviour.
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma stores w − 1 (offset 1)
    post_norms: bool = False  # RMSNorm on attention and MLP outputs before the residual adds
    scale_embeddings: bool = False  # embeddings × √hidden_size (in the embedding dtype)
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scale 1/√(this); None: head_dim
    layer_types: tuple[str, ...] = ()  # per layer "local" or "global"; (): every layer global
    sliding_window: int | None = None  # local layers see positions p with q_pos − p < window
    rope_local_theta: float | None = None  # RoPE θ of local layers (None: rope_theta)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_q_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be ≥ 1")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} must be one of {sorted(HIDDEN_ACTS)}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries, want num_layers={self.num_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types holds {unknown}; each must be one of {LAYER_TYPES}")
        if self.local_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window} must be ≥ 1 when layers are local")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar={self.query_pre_attn_scalar} must be > 0")
        # A head_dim that is not a power of two is fine for the model; the OSCAR codec and
        # Hadamard rotation need one, and the cache / calibration reject such models there.

    @property
    def q_per_kv(self) -> int:
        """G: query heads sharing one KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def head_dim_is_power_of_two(self) -> bool:
        return self.head_dim & (self.head_dim - 1) == 0

    @property
    def local_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers (empty for Llama / Qwen3)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "local")

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend to every position."""
        local = set(self.local_layers)
        return tuple(i for i in range(self.num_layers) if i not in local)

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index`, None for a global layer."""
        return self.sliding_window if self.layer_types and self.layer_types[index] == "local" else None


HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("local", "global")


# Real checkpoints' shapes (from their config.json). `smollm2-135m` and `gemma3-270m` have
# downloadable weights (oscar_jax.loaders; their GGUF metadata gives these same configs); the
# others give real shapes for random-weight GPU runs.
MODEL_CONFIGS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_q_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5,
        tie_embeddings=True, max_seq_len=8192),
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_q_heads=32, num_kv_heads=8, head_dim=128, rope_theta=5e5, rms_norm_eps=1e-5,
        tie_embeddings=False, max_seq_len=8192),
    "qwen3-4b": ModelConfig(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
        num_q_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_embeddings=True, qk_norm=True, max_seq_len=40960),
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_q_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_embeddings=False, qk_norm=True, max_seq_len=40960),
    "qwen3-32b": ModelConfig(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
        num_q_heads=64, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_embeddings=False, qk_norm=True, max_seq_len=40960),
    # MQA (4 q heads, 1 KV head), head_dim 256; 5 sliding-window (512) layers per global layer.
    "gemma3-270m": ModelConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
        num_q_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_embeddings=True, qk_norm=True, max_seq_len=32768, norm_weight_offset=1.0,
        post_norms=True, scale_embeddings=True, hidden_act="gelu_tanh", query_pre_attn_scalar=256.0,
        layer_types=tuple("global" if i % 6 == 5 else "local" for i in range(18)),
        sliding_window=512, rope_local_theta=1e4),
}


def num_params(cfg: ModelConfig) -> int:
    """Parameter count implied by the config (checks the table against published sizes)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_q_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * h * cfg.intermediate_size
    norms = (4 if cfg.post_norms else 2) * h + (2 * d if cfg.qk_norm else 0)
    embed = cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2)
    return cfg.num_layers * (attn + mlp + norms) + embed + h


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random weights at the config's shapes (for GPU runs of models we cannot ship).

    Normal(0, std²) matrices, norm weights that scale by one (1 − cfg.norm_weight_offset).
    One jitted program per layer (compiled once,
    reused for every layer) keeps compile time flat in depth and each program small.
    """
    dtype = jnp.dtype(dtype)
    layer_keys = jax.random.split(key, cfg.num_layers + 2)
    h = cfg.hidden_size
    params = {
        "embed": _normal(layer_keys[-1], (cfg.vocab_size, h), dtype, std),
        "final_norm": _unit_norm(cfg, h, dtype),
        "layers": [_init_layer(cfg, k, dtype, std) for k in layer_keys[: cfg.num_layers]],
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = _normal(layer_keys[-2], (h, cfg.vocab_size), dtype, std)
    return params


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std"))
def _normal(key, shape, dtype, std):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "std"))
def _init_layer(cfg: ModelConfig, key: jax.Array, dtype, std: float) -> Params:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"wq": (h, cfg.num_q_heads * d), "wk": (h, cfg.num_kv_heads * d),
              "wv": (h, cfg.num_kv_heads * d), "wo": (cfg.num_q_heads * d, h),
              "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}
    keys = jax.random.split(key, len(shapes))
    layer = {name: (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
             for k, (name, shape) in zip(keys, shapes.items())}
    names = ["attn_norm", "mlp_norm"] + (["post_attn_norm", "post_mlp_norm"] if cfg.post_norms else [])
    for name in names:
        layer[name] = _unit_norm(cfg, h, dtype)
    if cfg.qk_norm:
        layer["q_norm"] = _unit_norm(cfg, d, dtype)
        layer["k_norm"] = _unit_norm(cfg, d, dtype)
    return layer


def _unit_norm(cfg: ModelConfig, size: int, dtype) -> jax.Array:
    """Norm weights that scale by one under cfg's norm_weight_offset."""
    if cfg.norm_weight_offset == 0:
        return jnp.ones((size,), dtype)
    return jnp.full((size,), 1.0 - cfg.norm_weight_offset, dtype)


# ---------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis in float32 (as transformers does), cast back to x's dtype.
    The scale is (offset + weight): Gemma's norms store w − 1 and pass offset 1."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = weight.astype(jnp.float32)
    if offset:
        scale = scale + offset
    return (scale * xf).astype(x.dtype)


def _norm(x: jax.Array, weight: jax.Array, cfg: "ModelConfig") -> jax.Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_weight_offset)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, HF "rotate_half" convention: channel j pairs with j + D/2.

    x [B, T, H, D], positions int [B, T]. Angles and products in float32.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _dot(x, w):
    # float32 models: exact float32 products (the transformers comparisons need them). bfloat16
    # models: bf16 operands with float32 accumulation; HIGHEST would make XLA run an fp32 GEMM
    # on upcast weights.
    f32 = jnp.dtype(jnp.float32)
    precision = _HIGHEST if f32 in (jnp.dtype(x.dtype), jnp.dtype(w.dtype)) else None
    return jnp.matmul(x, w, precision=precision)


class LayerActivations(NamedTuple):
    """What calibration needs from one attention layer (all post-QK-norm, post-RoPE)."""

    q: jax.Array  # [B, T, Hq, D]
    k: jax.Array  # [B, T, K, D]
    v: jax.Array  # [B, T, K, D]
    attn_out: jax.Array  # [B, T, Hq, D] per-head attention output, before W_o


AttendFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _is_local(cfg: ModelConfig, local: bool | None) -> bool:
    if local is None:
        if cfg.local_layers:
            raise ValueError(
                "this config has sliding-window layers: pass local=cfg.layer_window(index) is not None")
        return False
    return local


def qkv_projections(layer: Params, cfg: ModelConfig, x: jax.Array, positions: jax.Array, *,
                    local: bool | None = None):
    """The attention inputs of one layer: (q [B,T,Hq,D], k, v [B,T,K,D]), post norm and RoPE.

    `local`: whether this is a sliding-window layer (it picks the RoPE θ); required when cfg has
    local layers. q comes pre-multiplied by √(D / query_pre_attn_scalar) when that scalar is not
    D, so every cache's softmax(q·kᵀ/√D) gives the model's scale."""
    local = _is_local(cfg, local)
    b, t, _ = x.shape
    h = _norm(x, layer["attn_norm"], cfg)
    if "wqkv" in layer:  # fuse_qkv: one GEMM, split after
        q_width, kv_width = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = jnp.split(_dot(h, layer["wqkv"]), [q_width, q_width + kv_width], axis=-1)
    else:
        q, k, v = _dot(h, layer["wq"]), _dot(h, layer["wk"]), _dot(h, layer["wv"])
    q = q.reshape(b, t, cfg.num_q_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = _norm(q, layer["q_norm"], cfg)
        k = _norm(k, layer["k_norm"], cfg)
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
        q = (q.astype(jnp.float32) * (cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5).astype(q.dtype)
    return q, k, v


def decoder_layer(
    layer: Params, cfg: ModelConfig, x: jax.Array, positions: jax.Array, attend: AttendFn,
    tp_axis: str | None = None, *, local: bool | None = None,
) -> tuple[jax.Array, LayerActivations]:
    """One pre-norm block. `attend(q, k, v) -> o` is the attention backend (here: causal; for a
    local layer it must apply the window). `local`: as in qkv_projections."""
    q, k, v = qkv_projections(layer, cfg, x, positions, local=local)
    o = attend(q, k, v)
    return layer_output(layer, cfg, x, o, tp_axis), LayerActivations(q, k, v, o)


def _row_parallel(x: jax.Array, w: jax.Array, tp_axis: str | None) -> jax.Array:
    """x·w, where under tensor parallelism x and w hold one shard's slice of the contraction."""
    if tp_axis is None:
        return _dot(x, w)
    # Partial products summed in float32, so a bf16 model rounds once, after the sum, as it
    # does on one device (the all-reduce of a decode step is a few KiB: the width is free).
    f32 = jnp.dtype(jnp.float32)
    precision = _HIGHEST if f32 in (jnp.dtype(x.dtype), jnp.dtype(w.dtype)) else None
    partial = jnp.matmul(x, w, precision=precision, preferred_element_type=jnp.float32)
    return jax.lax.psum(partial, tp_axis).astype(jnp.result_type(x, w))


def layer_output(layer: Params, cfg: ModelConfig, x: jax.Array, o: jax.Array,
                 tp_axis: str | None = None) -> jax.Array:
    """The rest of the block after attention: residual + W_o, then the gated MLP (SwiGLU, or
    GeGLU-tanh); with cfg.post_norms each branch is normed before its residual add."""
    b, t, _ = x.shape
    attn = _row_parallel(o.reshape(b, t, cfg.num_q_heads * cfg.head_dim), layer["wo"], tp_axis)
    if cfg.post_norms:
        attn = _norm(attn, layer["post_attn_norm"], cfg)
    x = x + attn
    h = _norm(x, layer["mlp_norm"], cfg)
    gate = _dot(h, layer["w_gate"])
    gate = jax.nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    mlp = _row_parallel(gate * _dot(h, layer["w_up"]), layer["w_down"], tp_axis)
    if cfg.post_norms:
        mlp = _norm(mlp, layer["post_mlp_norm"], cfg)
    return x + mlp


def embed(params: Params, tokens: jax.Array, tp_axis: str | None = None) -> jax.Array:
    table = params["embed"]
    if tp_axis is None:
        return jnp.take(table, tokens, axis=0)
    # This shard holds rows [first, first + V/tp) of the table: rows it does not hold read as
    # zero, and the psum adds exactly one nonzero row per token (so the sum is exact).
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(tp_axis) * rows
    held = (local >= 0) & (local < rows)
    x = jnp.where(held[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)
    return jax.lax.psum(x, tp_axis)


def input_embeddings(params: Params, cfg: ModelConfig, tokens: jax.Array,
                     tp_axis: str | None = None) -> jax.Array:
    """`embed`, times √hidden_size (rounded to the table's dtype, as transformers does) when
    cfg.scale_embeddings."""
    x = embed(params, tokens, tp_axis)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(cfg.hidden_size**0.5, jnp.float32).astype(x.dtype)
    return x


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array, tp_axis: str | None = None) -> jax.Array:
    """Final norm + output projection; float32 logits (under tp_axis: gathered from the
    shards' vocabulary slices, so every shard returns all of them)."""
    x = _norm(x, params["final_norm"], cfg)
    if cfg.tie_embeddings:
        logits = jnp.einsum("...h,vh->...v", x, params["embed"],
                            precision=_HIGHEST if jnp.dtype(x.dtype) == jnp.float32 else None)
    else:
        logits = _dot(x, params["lm_head"])
    logits = logits.astype(jnp.float32)
    if tp_axis is not None:
        logits = jax.lax.all_gather(logits, tp_axis, axis=logits.ndim - 1, tiled=True)
    return logits


def _default_positions(tokens: jax.Array) -> jax.Array:
    b, t = tokens.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


# ---------------------------------------------------------------------------------------------
# Entry points


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    collect: bool = False,
):
    """Full causal forward without a cache: tokens int [B, T] -> logits f32 [B, T, V].

    With `collect=True` also returns a list of `LayerActivations`, one per layer (memory grows
    with layers × tokens; `iter_layer_activations` streams one layer at a time instead).
    Jit with `static_argnames=("cfg", "collect")`.
    """
    positions = _default_positions(tokens) if positions is None else positions

    def causal(window):
        return lambda q, k, v: reference_attention(q, k, v, positions, positions, window=window)

    x = input_embeddings(params, cfg, tokens)
    collected = []
    for index, layer in enumerate(params["layers"]):
        window = cfg.layer_window(index)
        x, acts = decoder_layer(layer, cfg, x, positions, causal(window), local=window is not None)
        if collect:
            collected.append(acts)
    logits = lm_head(params, cfg, x)
    return (logits, collected) if collect else logits


def iter_layer_activations(
    params: Params, cfg: ModelConfig, tokens: jax.Array, *, positions: jax.Array | None = None
) -> Iterator[tuple[int, LayerActivations]]:
    """Yield (layer index, activations) layer by layer, for streaming calibration statistics.

    Each layer runs through one jitted function (compiled once: all layers share shapes), and
    only the current layer's activations are alive, so memory does not grow with depth.
    """
    positions = _default_positions(tokens) if positions is None else positions
    x = _embed_jit(params["embed"], tokens, cfg)
    for index, layer in enumerate(params["layers"]):
        x, acts = _causal_layer_jit(layer, cfg, x, positions, local=cfg.layer_window(index) is not None)
        yield index, acts


@functools.partial(jax.jit, static_argnames="cfg")
def _embed_jit(table, tokens, cfg):
    return input_embeddings({"embed": table}, cfg, tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "local"))
def _causal_layer_jit(layer, cfg, x, positions, local=None):
    """One layer over its causal (local: sliding-window) attention; compiled once per layer
    type. `local` as in qkv_projections (None is refused for configs with local layers)."""
    window = cfg.sliding_window if local else None
    return decoder_layer(
        layer, cfg, x, positions,
        lambda q, k, v: reference_attention(q, k, v, positions, positions, window=window),
        local=local,
    )


def _run_with_cache(params, cfg, tokens, cache, positions, tp_axis=None):
    x = input_embeddings(params, cfg, tokens, tp_axis)
    for index, layer in enumerate(params["layers"]):
        window = cfg.layer_window(index)
        q, k, v = qkv_projections(layer, cfg, x, positions, local=window is not None)
        if window is None:
            o, cache = cache.attend(index, q, k, v, positions)
        else:  # only caches that implement sliding windows take the keyword
            o, cache = cache.attend(index, q, k, v, positions, window=window)
        x = layer_output(layer, cfg, x, o, tp_axis)
    return x, cache


def prefill(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: KVCache,
    *,
    positions: jax.Array | None = None,
    lengths: jax.Array | None = None,
    all_logits: bool = False,
    tp_axis: str | None = None,
):
    """Run a prompt through the model, filling `cache`.

    tokens int [B, T]; positions int [B, T] (default 0..T-1). Returns (logits, cache): logits
    f32 [B, T, V] when `all_logits`, else [B, V] at index `lengths - 1` per row (default T - 1;
    pass lengths for a right-padded batch). Jit with `static_argnames=("cfg", "all_logits")`,
    `donate_argnames="cache"`. tp_axis: see the module docstring.
    """
    positions = _default_positions(tokens) if positions is None else positions
    x, cache = _run_with_cache(params, cfg, tokens, cache, positions, tp_axis)
    if not all_logits:
        b, t, _ = x.shape
        last = jnp.full((b,), t - 1, jnp.int32) if lengths is None else lengths - 1
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return lm_head(params, cfg, x, tp_axis), cache


def decode_step(
    params: Params, cfg: ModelConfig, token: jax.Array, cache: KVCache, position: jax.Array,
    tp_axis: str | None = None,
):
    """One token per row: token int [B], position int [B] -> (logits f32 [B, V], cache)."""
    x, cache = _run_with_cache(params, cfg, token[:, None], cache, position[:, None], tp_axis)
    return lm_head(params, cfg, x[:, 0], tp_axis), cache


_prefill_jit = jax.jit(prefill, static_argnames=("cfg", "all_logits"), donate_argnames="cache")
_decode_step_jit = jax.jit(decode_step, static_argnames="cfg", donate_argnames="cache")


def generate_greedy(
    params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache, max_new_tokens: int
) -> tuple[jax.Array, KVCache]:
    """Greedy decoding: prefill `tokens` [B, T] then `max_new_tokens` decode steps.

    Returns (new tokens int32 [B, max_new_tokens], cache). The cache argument is donated.
    """
    b, t = tokens.shape
    logits, cache = _prefill_jit(params, cfg, tokens, cache)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out = [token]
    for step in range(max_new_tokens - 1):
        position = jnp.full((b,), t + step, jnp.int32)
        logits, cache = _decode_step_jit(params, cfg, token, cache, position)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(token)
    return jnp.stack(out, axis=1), cache


# ---------------------------------------------------------------------------------------------
# Weight surgery


def fuse_qkv(params: Params, shards: int = 1) -> Params:
    """Each layer's wq, wk, wv concatenated into one wqkv [H, (Hq + 2K)·D] (module docstring: why).
    The projections compute the same dot products; already fused layers are kept. Returns new
    params (the old weights are not referenced by them).

    shards > 1 (tensor parallelism): the columns are ordered shard by shard, [q | k | v] of the
    first 1/shards of the heads, then of the next, so that a contiguous column slice is one
    shard's fused weight."""
    layers = []
    for index, layer in enumerate(params["layers"]):
        if "wqkv" in layer:
            layers.append(layer)
            continue
        missing = [n for n in ("wq", "wk", "wv") if n not in layer]
        if missing:
            raise ValueError(f"layer {index} has no {missing} to fuse")
        parts = [jnp.split(layer[n], shards, axis=1) for n in ("wq", "wk", "wv")]
        fused = jnp.concatenate([w for shard in zip(*parts) for w in shard], axis=1)
        layers.append({**{n: w for n, w in layer.items() if n not in ("wq", "wk", "wv")}, "wqkv": fused})
    return dict(params, layers=layers)


def fold_value_rotation(params: Params, cfg: ModelConfig, v_rotation) -> Params:
    """Fold per-(layer, KV head) value rotations into the weights; the model output is unchanged.

    v_rotation [L, K, D, D] (orthogonal). For KV head h of layer l with R = v_rotation[l, h]:
    W_v's columns of head h become W_v,h·R (so the cache stores v·R), and the W_o rows of every
    query head in h's group become Rᵀ·W_o,rows (undoing R after attention, which is linear in
    v). Math in float32; the result keeps each weight's dtype. Returns new params.
    """
    rot = jnp.asarray(v_rotation, jnp.float32)
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    if rot.shape != want:
        raise ValueError(f"v_rotation shape {rot.shape} must be [L, K, D, D] = {want}")
    kh, g, d = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim
    if any("wqkv" in layer for layer in params["layers"]):
        raise ValueError("fold_value_rotation needs the separate wv: fold before fuse_qkv")
    layers = []
    for index, layer in enumerate(params["layers"]):
        r = rot[index]  # [K, D, D]
        wv = layer["wv"].astype(jnp.float32).reshape(-1, kh, d)  # [H, K, D]
        wv = jnp.einsum("hkd,kde->hke", wv, r, precision=_HIGHEST)
        wo = layer["wo"].astype(jnp.float32).reshape(kh, g, d, -1)  # [K, G, D, H]
        wo = jnp.einsum("kde,kgdh->kgeh", r, wo, precision=_HIGHEST)
        layers.append(dict(layer,
                           wv=wv.reshape(layer["wv"].shape).astype(layer["wv"].dtype),
                           wo=wo.reshape(layer["wo"].shape).astype(layer["wo"].dtype)))
    return dict(params, layers=layers)


def cast_params(params: Params, dtype) -> Params:
    """All weights to `dtype` (norm weights included: RMSNorm upcasts internally)."""
    return jax.tree_util.tree_map(lambda w: w.astype(dtype), params)


def describe(cfg: ModelConfig) -> str:
    """One line for logs."""
    local = len(cfg.local_layers)
    window = f"{local} local (window {cfg.sliding_window}) + {cfg.num_layers - local} global, " if local else ""
    return (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_q_heads} q / "
            f"{cfg.num_kv_heads} kv heads × {cfg.head_dim}, vocab {cfg.vocab_size}, "
            f"{'qk_norm, ' if cfg.qk_norm else ''}{window}{num_params(cfg) / 1e6:,.1f}M params")


__all__ = [
    "ModelConfig", "MODEL_CONFIGS", "LayerActivations", "num_params", "init_params",
    "rms_norm", "rope", "qkv_projections", "decoder_layer", "layer_output", "embed", "input_embeddings",
    "lm_head", "forward",
    "iter_layer_activations", "prefill", "decode_step", "generate_greedy",
    "fold_value_rotation", "cast_params", "describe",
]
