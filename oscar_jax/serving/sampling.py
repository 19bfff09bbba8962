"""Per-request sampling parameters and the on-device sampler.

`sample_tokens` draws one token per row of a logits batch on the device: greedy where
temperature is 0, else softmax(logits / temperature) restricted to the top_k most likely tokens
and to the smallest set whose mass reaches top_p (the most likely token is always kept). Each
row's randomness is `fold_in(PRNGKey(seed), index of the token in the output)`, so a seeded
request draws the same tokens whatever batch it shares a step with.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

MAX_TEMPERATURE = 2.0  # OpenAI's range


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and of the stop conditions (OpenAI / vLLM names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        def integer(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer ≥ 1")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature!r} must be in [0, {MAX_TEMPERATURE}]")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not integer(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1, 0 (no cut) or a positive integer")
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer below 2**63")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={list(self.stop)!r} must be non-empty strings")
        if not all(integer(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={list(self.stop_token_ids)!r} must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@jax.jit
def greedy_tokens(logits: jax.Array) -> jax.Array:
    """logits f32 [B, V] → int32 [B], the most likely token of each row."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@jax.jit
def sample_tokens(logits, temperature, top_p, top_k, seeds, counters) -> jax.Array:
    """logits f32 [B, V]; temperature, top_p f32 [B]; top_k int32 [B] (≤ 0: off); seeds uint32
    [B, 2] (a PRNG key's two words); counters int32 [B] (tokens drawn so far) → int32 [B]."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # descending; ties by index
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    keep = (mass_before < top_p[:, None]) & (rank < k)
    keep = keep.at[:, 0].set(True)
    masked = jnp.where(keep, ranked, -jnp.inf)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.wrap_key_data(s, impl="threefry2x32"), n))(
        seeds, counters)
    pick = jax.vmap(jax.random.categorical)(keys, masked)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    greedy = jnp.argmax(logits, axis=-1)
    return jnp.where(temperature == 0, greedy, sampled).astype(jnp.int32)


def seed_words(seed: int) -> np.ndarray:
    """A 64-bit seed as the two uint32 words of a threefry key."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


def sample_on_device(logits: jax.Array, params: list[SamplingParams], seeds: list[int],
                     counters: list[int]) -> jax.Array:
    """Tokens int32 [B] of every row of `logits` [B, V], left on the device: the first
    len(params) rows as their requests ask (counter: the index of the token drawn), the padding
    rows greedily."""
    rows = logits.shape[0]
    if all(p.greedy for p in params):
        return greedy_tokens(logits)
    temperature = np.zeros(rows, np.float32)
    top_p = np.ones(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    words = np.zeros((rows, 2), np.uint32)
    count = np.zeros(rows, np.int32)
    for i, (p, seed, c) in enumerate(zip(params, seeds, counters)):
        temperature[i], top_p[i], top_k[i], words[i], count[i] = p.temperature, p.top_p, p.top_k, seed_words(seed), c
    return sample_tokens(logits, jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k),
                         jnp.asarray(words), jnp.asarray(count))


def sample_batch(logits: jax.Array, params: list[SamplingParams], seeds: list[int], counters: list[int]) -> np.ndarray:
    """`sample_on_device`'s tokens of the first len(params) rows, as a host int32 array."""
    return np.asarray(sample_on_device(logits, params, seeds, counters))[: len(params)]
