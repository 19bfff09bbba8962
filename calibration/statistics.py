"""Streaming second-moment statistics per (layer, KV head), float64.

Memory is fixed by the model shape ([L, Hkv, D, D] sums), never by the number of tokens: each
batch of activations is folded into the sums and dropped.

Targets (all on post-QK-norm, post-RoPE activations, as attention consumes them):
  query            C_Q = (1/N) Σ qᵀq over the tokens and the query heads of the KV head's group
  attention_output C_S = (1/N) Σ oᵀo, o = S·V the per-head attention output (the paper's C_S)
  key, value       KᵀK/N, VᵀV/N (ablation targets)
  surrogate        the authors' diagonal stand-in: Σ_t w_t v_tᵀv_t / Σ_t w_t, w_t = k_t C_Q k_tᵀ
"""

from __future__ import annotations

import numpy as np

TARGETS = ("query", "attention_output", "key", "value", "surrogate")


class SecondMoments:
    """Σ xᵀx and counts per (layer, KV head) for one target."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        self.sums = np.zeros((num_layers, num_kv_heads, head_dim, head_dim))
        self.weights = np.zeros((num_layers, num_kv_heads))

    def add(self, layer: int, rows: np.ndarray, weights: np.ndarray | None = None) -> None:
        """rows [N, Hkv, D] (or [N, Hkv, G, D] for a query group), optional weights [N, Hkv]."""
        rows = np.asarray(rows, np.float64)
        if rows.ndim == 4:  # fold the query group into the token axis
            n, h, g, d = rows.shape
            rows = rows.transpose(0, 2, 1, 3).reshape(n * g, h, d)
            if weights is not None:
                weights = np.repeat(weights, g, axis=0)
        by_head = rows.transpose(1, 0, 2)  # [Hkv, N, D]: batched BLAS matmuls below
        if weights is None:
            self.sums[layer] += np.swapaxes(by_head, 1, 2) @ by_head
            self.weights[layer] += rows.shape[0]
        else:
            w = np.asarray(weights, np.float64).T[..., None]  # [Hkv, N, 1]
            self.sums[layer] += np.swapaxes(by_head * w, 1, 2) @ by_head
            self.weights[layer] += w.sum(axis=(1, 2))

    def covariance(self) -> np.ndarray:
        """[L, Hkv, D, D] normalised second moments (symmetrised)."""
        if np.any(self.weights <= 0):
            raise ValueError("no tokens were accumulated for some (layer, KV head)")
        cov = self.sums / self.weights[..., None, None]
        return 0.5 * (cov + np.swapaxes(cov, -1, -2))


def group_queries(q: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """[N, Hq, D] → [N, Hkv, G, D]: query head h belongs to KV head h // G."""
    n, hq, d = q.shape
    return q.reshape(n, num_kv_heads, hq // num_kv_heads, d)


def surrogate_weights(k: np.ndarray, c_q: np.ndarray) -> np.ndarray:
    """w_t = k_t C_Q k_tᵀ per token and KV head: k [N, Hkv, D], c_q [Hkv, D, D] → [N, Hkv]."""
    return np.einsum("nhd,hde,nhe->nh", np.asarray(k, np.float64), c_q, np.asarray(k, np.float64))
