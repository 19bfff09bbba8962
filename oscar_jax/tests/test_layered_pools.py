"""Stacked pools + a static layer index (oscar_jax.kernels.layered): the ops read and write one
layer of [Y, P, …] pools in place, with exactly the results of the per-layer call, never touching
the other layers; and the decode step of OscarKVCache copies no pool.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import ops
from oscar_jax.tests.test_decode_attention import SINK_SLOTS, build_cache, random_query
from oscar_jax.tests.test_ops_write import assert_same_bits

pytestmark = pytest.mark.kernels("pallas")  # the Pallas kernels (interpret mode on CPU), not the XLA path

LAYERS = 3


def _stack(arrays, layer, rng):
    """Y copies of each pool: layer `layer` holds the given pool, the others random bytes."""
    out = []
    for a in arrays:
        a = np.asarray(a)
        others = rng.integers(0, 256, (LAYERS,) + a.shape + (a.itemsize,), dtype=np.uint8)
        stacked = others.view(a.dtype).reshape((LAYERS,) + a.shape)
        if np.issubdtype(a.dtype, np.floating):
            stacked = np.where(np.isfinite(stacked), stacked, 0).astype(a.dtype)  # random but finite
        stacked[layer] = a
        out.append(jnp.asarray(stacked))
    return out


@pytest.mark.parametrize("layer", [0, 2])
def test_decode_attention_on_stacked_pools_equals_per_layer_call(layer):
    rng = np.random.default_rng(layer)
    cache = build_cache(rng, (337, 65, 5), num_kv_heads=2, head_dim=64, group_size=32)
    q = random_query(rng, 3, 6, 64, jnp.bfloat16)
    kw = dict(sink_slots=SINK_SLOTS, group_size=32, softmax_scale=0.125, pages_per_split=4)
    want = ops.decode_attention(q, *cache.arrays, **kw)
    stacked = _stack(cache.arrays[:8], layer, rng)
    got = ops.decode_attention(q, *stacked, *cache.arrays[8:], layer=layer, **kw)
    assert_same_bits(got, want, "decode attention, stacked pools")
    q_chunk = random_query(rng, 3, 4 * 6, 64, jnp.float32).reshape(3, 4, 6, 64)
    k_new = jnp.asarray(rng.standard_normal((3, 4, 2, 64)), jnp.float32)
    want = ops.prefill_attention(q_chunk, k_new, k_new, *cache.arrays, **kw)
    got = ops.prefill_attention(q_chunk, k_new, k_new, *stacked, *cache.arrays[8:], layer=layer, **kw)
    assert_same_bits(got, want, "prefill attention, stacked pools")


def test_channels_on_m_decode_on_stacked_pools_equals_per_layer_call(monkeypatch):
    """channels_on_m reads the V pool as 16-bit pairs (a bitcast view of the stacked pool): the
    layer it reads is the one named, bit for bit as the per-layer call."""
    from shared_math import tiling

    monkeypatch.setattr(tiling, "DECODE_TWO_WARPS_MIN_PROGRAMS", 1)  # tokens on M at test sizes (conftest)
    rng = np.random.default_rng(7)
    cache = build_cache(rng, (337, 65), num_kv_heads=2, head_dim=128, group_size=128)
    q = random_query(rng, 2, 8, 128, jnp.bfloat16)
    kw = dict(sink_slots=SINK_SLOTS, group_size=128, softmax_scale=128**-0.5, pages_per_split=4, channels_on_m=True)
    want = ops.decode_attention(q, *cache.arrays, **kw)
    stacked = _stack(cache.arrays[:8], 1, rng)
    got = ops.decode_attention(q, *stacked, *cache.arrays[8:], layer=1, **kw)
    assert_same_bits(got, want, "channels_on_m decode attention, stacked pools")


def test_writes_on_stacked_pools_touch_only_their_layer():
    rng = np.random.default_rng(7)
    pages, heads, page, d, g, layer = 5, 2, 16, 64, 32, 1
    rows = jnp.asarray(rng.standard_normal((20, heads, d)), jnp.float32)
    page_ids = jnp.asarray(np.arange(20) // page, jnp.int32)
    slots = jnp.asarray(np.arange(20) % page, jnp.int32)

    bf16 = _stack([np.zeros((pages, heads, page, d), jnp.bfloat16)], layer, rng)[0]
    got = ops.write_bf16_pages(bf16, rows, page_ids, slots, layer=layer)
    want = ops.write_bf16_pages(bf16[layer], rows, page_ids, slots)
    assert_same_bits(got[layer], want, "bf16 layer")
    for other in set(range(LAYERS)) - {layer}:
        assert_same_bits(got[other], bf16[other], f"bf16 layer {other} untouched")

    pools = [np.zeros((pages, heads, page, d // 4), np.uint8), np.zeros((pages, heads, page, d // g), np.float16),
             np.zeros((pages, heads, page, d // g), np.float16)]
    stacked = _stack(pools, layer, rng)
    rotation = jnp.asarray(np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0] for _ in range(heads)]), jnp.float32)
    kw = dict(rotation=rotation, group_size=g, clip_ratio=0.96)
    got = ops.write_pages(*stacked, rows, page_ids, slots, layer=layer, **kw)
    want = ops.write_pages(*(p[layer] for p in stacked), rows, page_ids, slots, **kw)
    for name, g_pool, w_pool, before in zip(("codes", "scale", "min"), got, want, stacked):
        assert_same_bits(g_pool[layer], w_pool, f"INT2 {name} layer")
        for other in set(range(LAYERS)) - {layer}:
            assert_same_bits(g_pool[other], before[other], f"INT2 {name} layer {other} untouched")


@pytest.mark.parametrize("layer,message", [(3, "layer=3 must lie in"), (-1, "layer=-1 must lie in"),
                                           (1.0, "must be a Python int")])
def test_bad_layer_raises(layer, message):
    rng = np.random.default_rng(0)
    cache = build_cache(rng, (70,), num_kv_heads=1, head_dim=64, group_size=64)
    stacked = _stack(cache.arrays[:8], 0, rng)
    q = random_query(rng, 1, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match=message):
        ops.decode_attention(q, *stacked, *cache.arrays[8:], sink_slots=SINK_SLOTS, group_size=64,
                             softmax_scale=0.1, layer=layer)
    with pytest.raises(ValueError, match=message):
        ops.write_bf16_pages(stacked[0], jnp.zeros((1, 1, 64)), [0], [0], layer=layer)


def test_mismatched_layer_axes_raise():
    rng = np.random.default_rng(0)
    cache = build_cache(rng, (70,), num_kv_heads=1, head_dim=64, group_size=64)
    stacked = _stack(cache.arrays[:8], 0, rng)
    stacked[3] = stacked[3][:2]  # k_scale with 2 layers, the rest with 3
    q = random_query(rng, 1, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="same leading layer axis"):
        ops.decode_attention(q, *stacked, *cache.arrays[8:], sink_slots=SINK_SLOTS, group_size=64,
                             softmax_scale=0.1, layer=0)


def _h200_step_inputs():
    """A stacked cache (layer 1 real) and the query, rows and ids of a decode step at d = G = 128."""
    rng = np.random.default_rng(3)
    cache = build_cache(rng, (337, 65), num_kv_heads=2, head_dim=128, group_size=128)
    stacked = _stack(cache.arrays[:8], 1, rng)
    return (jnp.zeros((2, 8, 128), jnp.bfloat16), jnp.zeros((2, 2, 128), jnp.float32), jnp.zeros((2,), jnp.int32),
            *stacked, *cache.arrays[8:])


def _step_layers(layers):
    """A decode step over the stacked pools: each layer's two writes and its attention."""
    def step(q, rows, ids, *pools_and_tables):
        pools, outputs = list(pools_and_tables[:8]), []
        for layer in layers:
            pools[0] = ops.write_bf16_pages(pools[0], rows, ids, ids + jnp.arange(2), layer=layer, interpret=False)
            pools[2:5] = ops.write_pages(*pools[2:5], rows, ids, ids + jnp.arange(2), group_size=128,
                                         clip_ratio=0.96, layer=layer, interpret=False)
            outputs.append(ops.decode_attention(q, *pools, *pools_and_tables[8:], sink_slots=SINK_SLOTS,
                                                group_size=128, softmax_scale=0.1, layer=layer, interpret=False))
        return outputs, pools

    return step


def test_layered_kernels_compile_for_h200():
    """The flattened layer axis and the page base must survive the Triton lowering (interpret mode
    does not apply it)."""
    from oscar_jax.tests.test_decode_attention import compile_triton_kernels_for_h200

    kernels = compile_triton_kernels_for_h200(_step_layers([1]), *_h200_step_inputs())
    assert len(kernels) == 5, sorted(kernels)  # two writes, two tiers, the merge
    for name, usage in kernels.items():
        assert usage["spills"] == 0, f"{name} spills {usage['spills']} bytes of registers"


def test_every_layer_runs_the_same_kernels():
    """The layer is an operand, not part of a kernel: a step over all layers holds each kernel once
    (XLA compiles each distinct kernel once per program), so compile time does not grow with depth."""
    pytest.importorskip("triton")
    from benchmarks.static_analysis import triton_backend_configs

    configs = triton_backend_configs(_step_layers(range(LAYERS)), *_h200_step_inputs())
    assert len(configs) == 5 * LAYERS  # two writes, two tiers, the merge per layer
    assert len(set(configs)) == 5, "a kernel differs between layers: XLA would compile it once per layer"
