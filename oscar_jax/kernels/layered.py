"""Pools with a leading layer axis, read and written in place by the per-layer kernels.

`OscarKVCache` stacks every layer's pools ([Y, P, K, L, ·]). A kernel handed one layer as a slice
(`pool[layer]`) makes XLA materialise that slice, and writing it back with `.at[layer].set` made
XLA copy whole stacked pools around the Pallas calls (216 copies per decode step at Qwen3-8B shapes,
many times the step's bandwidth floor). Instead a kernel takes the stacked pool viewed as one pool
of Y·P pages (`flat_pool`, a bitcast) and the first page of its layer as an operand
(`layer_page_base`), added to every page id it reads from a table: read-only pools are never
copied, written pools are aliased in place, and the kernel is the same for every layer. The
layer is data, not part of the kernel, so XLA compiles each kernel once per program rather than
once per layer (its kernel cache is keyed by the kernel's IR; benchmarks/DECISIONS.md K1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def per_layer_shape(shape, layer: int | None) -> tuple[int, ...]:
    """The shape of one layer of a pool."""
    return tuple(shape) if layer is None else tuple(shape[1:])


def flat_pool(pool, layer: int | None):
    """The pool as the kernels index it: [P, ·] as it is, stacked [Y, P, ·] as [Y·P, ·] (row-major,
    so XLA's reshape is a bitcast: no copy)."""
    return pool if layer is None else pool.reshape((-1,) + tuple(pool.shape[2:]))


def layer_page_base(pool_shape, layer: int | None) -> jax.Array:
    """int32[1]: the first page of layer `layer` in the flat pool (0 for a per-layer pool)."""
    pages = per_layer_shape(pool_shape, layer)[0]
    return jnp.full((1,), 0 if layer is None else layer * pages, jnp.int32)


def layer_page_base_spec() -> pl.BlockSpec:
    """The BlockSpec of `layer_page_base`'s operand (read in the kernel as `ref[0]`)."""
    return pl.BlockSpec((1,), lambda *_: (0,))


def layer_views(pools: dict, layer: int | None) -> dict:
    """Check the stacked pools share a leading layer axis holding `layer`; return shape-only views
    of that layer (`jax.ShapeDtypeStruct`) for validation. `layer=None`: the pools unchanged."""
    if layer is None:
        return pools
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"layer={layer!r} must be a Python int (a static index) or None")
    layers = {name: (tuple(p.shape)[0] if len(p.shape) else None) for name, p in pools.items()}
    if len(set(layers.values())) != 1 or None in layers.values():
        raise ValueError(f"with layer={layer}, every pool needs the same leading layer axis, got shapes "
                         f"{ {name: tuple(p.shape) for name, p in pools.items()} }")
    num_layers = next(iter(layers.values()))
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer} must lie in [0, {num_layers}) (the pools' leading layer axis)")
    return {name: jax.ShapeDtypeStruct(tuple(p.shape)[1:], p.dtype) for name, p in pools.items()}
