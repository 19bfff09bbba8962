"""The interface between the model and a KV cache, and the dense cache that implements it.

The model never touches cache buffers: each attention layer hands its post-RoPE q, k, v to
`cache.attend(layer, q, k, v, positions)`, which stores k, v at `positions` and returns the
attention of q over every cached token at a position ≤ the query's own. This one call is the
whole contract, so the same `prefill` / `decode_step` run with `DenseKVCache` (here) and with a
paged mixed-precision cache (OscarKVCache) that may rotate, quantize and tier what it stores.

Conventions (shared by every implementation):
  shapes   q [B, T, Hq, D]; k, v [B, T, K, D]; positions int32 [B, T]; out [B, T, Hq, D],
           with Hq = K·G (grouped-query attention: query head i reads KV head i // G).
  scale    softmax(q·kᵀ / √D); masking is by absolute position (key position ≤ query position),
           so a right-padded batch needs no extra mask: padding writes beyond a row's length are
           masked for that row's real queries and overwritten when decoding reaches them.
  window   a sliding-window layer (Gemma 3's local layers) calls `attend(..., window=w)`: a key
           is then visible only when query position − key position < w (the query itself and
           the w − 1 positions before it). Global layers never pass it, so a cache without
           sliding windows needs no such keyword (a local layer then fails loudly).
  purity   `attend` returns a new cache (a pytree) instead of mutating, so callers can jit the
           model step with the cache donated.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp


@runtime_checkable
class KVCache(Protocol):
    """What `oscar_jax.model.prefill` and `decode_step` need from a cache."""

    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, "KVCache"]:
        """Store k, v [B, T, K, D] at `positions` [B, T] of `layer`; return (attention output
        [B, T, Hq, D] in q's dtype, the updated cache)."""
        ...


def reference_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, k_positions: jax.Array,
    *, window: int | None = None,
) -> jax.Array:
    """Masked GQA softmax attention in float32, the math every cache must reproduce.

    q [B, T, Hq, D]; k, v [B, S, K, D]; q_positions [B, T]; k_positions [B, S] (a key is visible
    to a query when k_position ≤ q_position, and with `window` also q_position − k_position <
    window). Returns [B, T, Hq, D] in q's dtype.
    """
    if window is not None and window < 1:
        raise ValueError(f"{window=} must be ≥ 1")
    b, t, hq, d = q.shape
    kv_heads = k.shape[2]
    if hq % kv_heads:
        raise ValueError(f"query heads {hq=} must be a multiple of KV heads {kv_heads=}")
    g = hq // kv_heads
    qf = q.astype(jnp.float32).reshape(b, t, kv_heads, g, d)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", qf, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    ) * (d**-0.5)
    visible = k_positions[:, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if window is not None:
        visible &= q_positions[:, :, None] - k_positions[:, None, :] < window
    # A finite floor instead of -inf: a row is never fully masked (a query sees itself), but a
    # finite value keeps padded garbage from producing NaN through inf - inf.
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bkgts,bskd->btkgd", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return out.reshape(b, t, hq, d).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """Unquantized cache: per layer, K and V buffers [B, K, S_max, D] (head-major, like the
    paged layout). The baseline OSCAR is measured against, and the decode-equivalence oracle.
    """

    k: tuple[jax.Array, ...]  # per layer [B, K, S_max, D]
    v: tuple[jax.Array, ...]  # per layer [B, K, S_max, D]

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype=jnp.bfloat16,
    ) -> "DenseKVCache":
        """Zero-filled buffers; pass `dtype=jnp.float32` for exact comparisons."""
        shape = (batch, num_kv_heads, max_seq_len, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        )

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[2]

    def attend(self, layer, q, k, v, positions, *, window: int | None = None):
        """The KVCache contract; `window` masks a sliding-window layer (the buffers still hold
        every position: this cache is the oracle, not the memory-saving layout)."""
        k_cache, v_cache = self.k[layer], self.v[layer]
        b, t = positions.shape
        if k.shape[:2] != (b, t) or k.shape[2:] != (k_cache.shape[1], k_cache.shape[3]):
            raise ValueError(
                f"k {k.shape} does not match positions {positions.shape} and cache "
                f"{k_cache.shape} (want [B, T, K, D])"
            )
        if t > k_cache.shape[2]:
            raise ValueError(f"{t=} tokens do not fit the cache (max_seq_len={k_cache.shape[2]})")
        rows = jnp.arange(b)[:, None]
        # Advanced indices (rows, positions) are split by a slice, so the indexed view is
        # [B, T, K, D] — exactly k's layout. Positions ≥ S_max are dropped by the scatter.
        k_cache = k_cache.at[rows, :, positions].set(k.astype(k_cache.dtype))
        v_cache = v_cache.at[rows, :, positions].set(v.astype(v_cache.dtype))
        slots = jnp.broadcast_to(jnp.arange(k_cache.shape[2], dtype=positions.dtype), (b, k_cache.shape[2]))
        out = reference_attention(
            q, k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3), positions, slots,
            window=window,
        )
        new = dataclasses.replace(
            self,
            k=self.k[:layer] + (k_cache,) + self.k[layer + 1 :],
            v=self.v[:layer] + (v_cache,) + self.v[layer + 1 :],
        )
        return out, new
