"""Pools with a leading layer axis, read and written in place by the per-layer kernels.

`OscarKVCache` stacks every layer's pools ([Y, P, K, L, ·]). A kernel handed one layer as a slice
(`pool[layer]`) makes XLA materialise that slice, and writing it back with `.at[layer].set` made
XLA copy whole stacked pools around the Pallas calls (216 copies per decode step at Qwen3-8B shapes,
many times the step's bandwidth floor). Instead the kernels take the stacked
pool and a static layer index: the layer axis is squeezed out of the block (so the kernel bodies
see [P, K, L, ·] refs), read-only pools are never copied, and written pools are aliased in place.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl


def layer_block_spec(block_shape, index_map, layer: int | None) -> pl.BlockSpec:
    """`pl.BlockSpec(block_shape, index_map)` of a per-layer pool, or of layer `layer` of a stacked
    pool (one more leading axis, squeezed, at the static index `layer`)."""
    if layer is None:
        return pl.BlockSpec(block_shape, index_map)
    return pl.BlockSpec((None,) + tuple(block_shape), lambda *grid: (layer,) + tuple(index_map(*grid)))


def per_layer_shape(shape, layer: int | None) -> tuple[int, ...]:
    """The shape one layer of a pool has inside the kernel."""
    return tuple(shape) if layer is None else tuple(shape[1:])


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
