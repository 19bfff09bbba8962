"""KV caches for models with sliding-window layers (Gemma 3's local layers): a bounded ring buffer
for those layers, and a router that sends each layer to the cache of its kind.

A local layer's query sees only the newest `window` positions (oscar_jax.cache_api: window), so
its cache never needs more than a fixed number of slots: `SlidingWindowKVCache` keeps, per local
layer, a ring of R = window + max_chunk − 1 slots (position p lives in slot p mod R) in BF16, with
the position each slot holds. A step writes its k, v first and then attends over the ring. Why R
and not window: a step of up to max_chunk consecutive positions, right padding included, then
never overwrites a position that one of its real queries, or a later decode step of that row,
still needs — the oldest slot a step can overwrite holds a position ≤ (first position of the
step) − window. Memory is independent of sequence length.

A paged runtime (oscar_jax.runtime) gives each live sequence a ring of its own while the rows of a
step's batch change from step to step: `with_rows(rows)` maps batch row i to ring rows[i] for one
step (ring 0 is the runtime's scratch ring, where padded rows write), and `reset(ring)` empties a
ring for its next sequence. Without rows, batch row i is ring i.

`LayerRoutedKVCache` holds two caches and a static route (model layer → (kind, index)): local
layers go to `local_cache` (e.g. SlidingWindowKVCache), global layers to `global_cache` (e.g.
OscarKVCache built for the global layers only, or DenseKVCache), each indexed from 0 among its
own layers. The model calls it like any cache (`attend(layer, q, k, v, positions[, window=])`).
No model name appears here: the route comes from ModelConfig.layer_types.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from oscar_jax.cache_api import KVCache, reference_attention

EMPTY = jnp.iinfo(jnp.int32).max  # the position of a slot never written: later than every query


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlidingWindowKVCache:
    """Per local layer a ring of R = window + max_chunk − 1 slots (module docstring)."""

    k: tuple[jax.Array, ...]  # per layer [B, K, R, D]
    v: tuple[jax.Array, ...]  # per layer [B, K, R, D]
    slot_positions: tuple[jax.Array, ...]  # per layer int32 [B, R]; EMPTY where never written
    window: int = _static()
    max_chunk: int = _static()
    rows: jax.Array | None = None  # int32 [batch rows]: the ring of each row of this step (None: row i)

    @classmethod
    def create(cls, *, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, window: int,
               max_chunk: int = 1, dtype=jnp.bfloat16) -> "SlidingWindowKVCache":
        """Empty rings; max_chunk is the most tokens one step writes per row (the prefill chunk;
        1 for decode only). dtype=jnp.float32 for exact comparisons."""
        if window < 1 or max_chunk < 1:
            raise ValueError(f"{window=} and {max_chunk=} must be ≥ 1")
        slots = window + max_chunk - 1
        shape = (batch, num_kv_heads, slots, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            slot_positions=tuple(jnp.full((batch, slots), EMPTY, jnp.int32) for _ in range(num_layers)),
            window=window, max_chunk=max_chunk,
        )

    @property
    def slots(self) -> int:
        return self.window + self.max_chunk - 1

    @property
    def num_rings(self) -> int:
        return self.slot_positions[0].shape[0] if self.slot_positions else 0

    def with_rows(self, rows) -> "SlidingWindowKVCache":
        """This cache with batch row i reading and writing ring rows[i] (int32 [B])."""
        return dataclasses.replace(self, rows=jnp.asarray(rows, jnp.int32))

    def reset(self, ring) -> "SlidingWindowKVCache":
        """Ring `ring` emptied in every layer (its slots hold no position), for a new sequence.
        The K/V bytes stay: a slot is read only through its position."""
        held = tuple(h.at[ring].set(EMPTY) for h in self.slot_positions)
        return dataclasses.replace(self, slot_positions=held)

    @staticmethod
    def nbytes_per_ring(*, num_layers: int, num_kv_heads: int, head_dim: int, window: int, max_chunk: int,
                        dtype=jnp.bfloat16) -> int:
        """Bytes one ring holds over `num_layers` local layers (K, V and slot positions)."""
        slots = window + max_chunk - 1
        kv = 2 * num_kv_heads * slots * head_dim * jnp.dtype(dtype).itemsize
        return num_layers * (kv + slots * jnp.dtype(jnp.int32).itemsize)

    def attend(self, layer, q, k, v, positions, *, window: int | None = None):
        """The KVCache contract for a local layer; the positions of a row within one step must be
        consecutive (prefill chunks and decode steps are)."""
        if window != self.window:
            raise ValueError(f"layer {layer} asks for {window=}, this cache keeps window={self.window}")
        k_cache, v_cache, held = self.k[layer], self.v[layer], self.slot_positions[layer]
        b, t = positions.shape
        if k.shape[:2] != (b, t) or k.shape[2:] != (k_cache.shape[1], k_cache.shape[3]):
            raise ValueError(f"k {k.shape} does not match positions {positions.shape} and cache {k_cache.shape}")
        if t > self.max_chunk:
            raise ValueError(f"{t=} tokens in one step exceed max_chunk={self.max_chunk} of this cache")
        if self.rows is None:
            rings = jnp.arange(b)
        elif self.rows.shape != (b,):
            raise ValueError(f"rows {self.rows.shape} must name one ring per batch row ({b})")
        else:
            rings = self.rows
        slot = positions % self.slots  # [B, T], distinct within a row (t ≤ slots, consecutive)
        k_cache = k_cache.at[rings[:, None], :, slot].set(k.astype(k_cache.dtype))
        v_cache = v_cache.at[rings[:, None], :, slot].set(v.astype(v_cache.dtype))
        held = held.at[rings[:, None], slot].set(positions.astype(jnp.int32))
        mine = (lambda x: x) if self.rows is None else (lambda x: x[rings])  # noqa: E731
        out = reference_attention(q, mine(k_cache).transpose(0, 2, 1, 3), mine(v_cache).transpose(0, 2, 1, 3),
                                  positions, mine(held), window=self.window)
        replace = lambda xs, x: xs[:layer] + (x,) + xs[layer + 1:]  # noqa: E731
        return out, dataclasses.replace(self, k=replace(self.k, k_cache), v=replace(self.v, v_cache),
                                        slot_positions=replace(self.slot_positions, held))

    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in (*self.k, *self.v, *self.slot_positions))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerRoutedKVCache:
    """Local layers to `local_cache`, global layers to `global_cache` (module docstring)."""

    local_cache: KVCache
    global_cache: KVCache
    route: tuple[tuple[str, int], ...] = _static()  # per model layer: ("local", i) or ("global", j)

    @classmethod
    def for_layer_types(cls, layer_types, *, local_cache: KVCache, global_cache: KVCache) -> "LayerRoutedKVCache":
        """Route by a model's ModelConfig.layer_types ("local" / "global" per layer)."""
        counts, route = {"local": 0, "global": 0}, []
        for kind in layer_types:
            if kind not in counts:
                raise ValueError(f"layer type {kind!r} must be 'local' or 'global'")
            route.append((kind, counts[kind]))
            counts[kind] += 1
        return cls(local_cache=local_cache, global_cache=global_cache, route=tuple(route))

    def attend(self, layer, q, k, v, positions, *, window: int | None = None):
        kind, index = self.route[layer]
        if (kind == "local") != (window is not None):
            raise ValueError(f"layer {layer} is routed as {kind} but called with {window=}")
        if kind == "local":
            out, cache = self.local_cache.attend(index, q, k, v, positions, window=window)
            return out, dataclasses.replace(self, local_cache=cache)
        out, cache = self.global_cache.attend(index, q, k, v, positions)
        return out, dataclasses.replace(self, global_cache=cache)


__all__ = ["SlidingWindowKVCache", "LayerRoutedKVCache"]
