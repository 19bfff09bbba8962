"""Prefill attention (a chunk over itself in full precision + its cached prefix through the tiers):
the Pallas-only claims. Prefill vs the float64 reference, every backend over
parity_tests.cases.PREFILL_CASES, is parity_tests/test_ops_attention.py's. Caches come from
test_decode_attention.build_cache (poisoned pools, shuffled pages).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax.attention_ops import decode_attention, prefill_attention
from oscar_jax.tests.test_decode_attention import (
    PAGE_SIZE,
    SINK_SLOTS,
    TOLERANCES,
    build_cache,
    compile_triton_kernels_for_h200,
)

pytestmark = pytest.mark.kernels("pallas")  # the Pallas kernels (interpret mode on CPU), not the XLA path

def _random_chunk(rng, batch, chunk, num_kv_heads, heads_per_kv, head_dim, q_dtype, kv_dtype):
    q = jnp.asarray(3.0 * rng.standard_normal((batch, chunk, num_kv_heads * heads_per_kv, head_dim)), q_dtype)
    k_new = jnp.asarray(rng.standard_normal((batch, chunk, num_kv_heads, head_dim)), kv_dtype)
    v_new = jnp.asarray(rng.standard_normal((batch, chunk, num_kv_heads, head_dim)), kv_dtype)
    return q, k_new, v_new


def test_prefill_of_one_token_equals_decode_after_appending_it():
    """The two paths agree: prefill(token | cache) == decode(cache + token) (same bf16-exact K/V)."""
    rng = np.random.default_rng(2)
    lengths = (40, 65, 322)  # the appended token lands in the sink, the recent window, the recent window
    cache = build_cache(rng, lengths, num_kv_heads=2, head_dim=64, group_size=32)
    q = jnp.asarray(3.0 * rng.standard_normal((3, 6, 64)), jnp.float32)
    kwargs = dict(sink_slots=SINK_SLOTS, group_size=32, softmax_scale=0.125)
    after = decode_attention(q, *cache.arrays, **kwargs)
    # The prefix = the same cache less its newest token (the last sink or recent row).
    arrays = list(cache.arrays)
    sink_tokens, recent_tokens = np.array(arrays[9]), np.array(arrays[10])
    last = [tiers.recent if tiers.recent[0].shape[0] else tiers.sink for tiers in cache.sequences]
    recent_tokens -= recent_tokens > 0
    sink_tokens -= np.asarray([tiers.recent[0].shape[0] == 0 for tiers in cache.sequences])
    arrays[9], arrays[10] = jnp.asarray(sink_tokens), jnp.asarray(recent_tokens)
    k_new = jnp.asarray(np.stack([k[-1:] for k, _ in last]))  # [B, 1, Hkv, D]
    v_new = jnp.asarray(np.stack([v[-1:] for _, v in last]))
    before = prefill_attention(q[:, None], k_new, v_new, *arrays, **kwargs)[:, 0]
    np.testing.assert_allclose(np.asarray(before), np.asarray(after), **TOLERANCES[jnp.float32])


def test_prefill_is_deterministic():
    rng = np.random.default_rng(9)
    cache = build_cache(rng, (321, 7), num_kv_heads=1, head_dim=64, group_size=64)
    q, k_new, v_new = _random_chunk(rng, 2, 20, 1, 4, 64, jnp.float32, jnp.float32)
    kwargs = dict(sink_slots=SINK_SLOTS, group_size=64, softmax_scale=0.125)
    run = lambda: np.asarray(prefill_attention(q, k_new, v_new, *cache.arrays, **kwargs))  # noqa: E731
    np.testing.assert_array_equal(run(), run())


@pytest.fixture(scope="module")
def small_prefill():
    rng = np.random.default_rng(4)
    cache = build_cache(rng, (65, 100), num_kv_heads=2, head_dim=64, group_size=32)
    q, k_new, v_new = _random_chunk(rng, 2, 5, 2, 2, 64, jnp.float32, jnp.float32)
    return q, k_new, v_new, cache


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda q, k, v, n: (q, k[:, :, :1], v[:, :, :1], n), "k_new has 1 KV heads but the cache has 2"),
        (lambda q, k, v, n: (q, k[:, :4], v, n), "k_new must have shape"),
        (lambda q, k, v, n: (q, k, v.astype(jnp.bfloat16), n), "v_new must have dtype float32"),
        (lambda q, k, v, n: (q, k.astype(jnp.float16), v.astype(jnp.float16), n), "k_new must have dtype"),
        (lambda q, k, v, n: (q[:, :, :3], k, v, n), "Hq=3 must be a multiple of KV heads Hkv=2"),
        (lambda q, k, v, n: (q[0], k, v, n), "q must have shape"),
        (lambda q, k, v, n: (q, k, v, n.astype(jnp.float32)), "new_tokens must have dtype int32"),
        (lambda q, k, v, n: (q, k, v, n[:1]), "new_tokens must have shape"),
    ],
)
def test_bad_prefill_inputs_raise(small_prefill, mutate, message):
    q, k_new, v_new, cache = small_prefill
    q, k_new, v_new, new_tokens = mutate(q, k_new, v_new, jnp.asarray([5, 5], jnp.int32))
    with pytest.raises(ValueError, match=message):
        prefill_attention(
            q, k_new, v_new, *cache.arrays, new_tokens, sink_slots=SINK_SLOTS, group_size=32,
            softmax_scale=0.125,
        )


@pytest.mark.parametrize(
    "overrides,message", [(dict(block_m=24), "block_m=24"), (dict(block_n=8), "block_n=8"),
                          (dict(tier_block_m=48), "tier_block_m=48")]
)
def test_bad_prefill_blocks_raise(small_prefill, overrides, message):
    q, k_new, v_new, cache = small_prefill
    with pytest.raises(ValueError, match=message):
        prefill_attention(
            q, k_new, v_new, *cache.arrays, sink_slots=SINK_SLOTS, group_size=32, softmax_scale=0.125,
            **overrides,
        )


def test_prefill_kernels_compile_for_h200():
    rng = np.random.default_rng(0)
    cache = build_cache(rng, (337, 65), num_kv_heads=2, head_dim=128, group_size=64)
    q, k_new, v_new = _random_chunk(rng, 2, 100, 2, 4, 128, jnp.bfloat16, jnp.bfloat16)
    fn = lambda q, k, v, *c: prefill_attention(  # noqa: E731
        q, k, v, *c, sink_slots=SINK_SLOTS, group_size=64, softmax_scale=0.1, interpret=False
    )
    kernels = compile_triton_kernels_for_h200(fn, q, k_new, v_new, *cache.arrays)
    assert sorted(name.split("_attention")[0] for name in kernels) == [
        "oscar_bf16_tier",
        "oscar_causal_chunk",
        "oscar_int2_tier",
    ]
    for name, usage in kernels.items():
        assert usage["spills"] == 0, f"{name} spills {usage['spills']} bytes of registers"
    assert PAGE_SIZE == 16  # the cases above assume the default page size


def test_larger_row_blocks_for_the_prefix_tiers_give_the_same_attention():
    """tier_block_m=128 (the prefix's tiers unpacked half as often a chunk) against the default 64:
    400 query rows (100 tokens × 4 heads of a KV head, not a multiple of 128), GQA, prefixes over
    several pages of both tiers. Each row's arithmetic is the same, so the outputs agree to float32
    rounding (1e-6)."""
    rng = np.random.default_rng(11)
    cache = build_cache(rng, (337, 65), num_kv_heads=2, head_dim=64, group_size=32)
    q, k_new, v_new = _random_chunk(rng, 2, 100, 2, 4, 64, jnp.float32, jnp.float32)
    new_tokens = jnp.asarray([100, 37], jnp.int32)  # a ragged second chunk
    kwargs = dict(sink_slots=SINK_SLOTS, group_size=32, softmax_scale=0.125)
    want = prefill_attention(q, k_new, v_new, *cache.arrays, new_tokens, **kwargs)
    got = prefill_attention(q, k_new, v_new, *cache.arrays, new_tokens, tier_block_m=128, **kwargs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(got)[1, 37:] == 0)  # the ragged chunk's padding rows


def test_prefix_tiers_with_128_row_blocks_compile_for_h200_without_spills():
    """Qwen3-8B's head (d 128, G 128, 4 heads a KV head): the tiers at 128 rows a block fit in
    registers; the causal chunk kernel keeps block_m (64), as it spills at 128."""
    rng = np.random.default_rng(0)
    cache = build_cache(rng, (337, 65), num_kv_heads=2, head_dim=128, group_size=128)
    q, k_new, v_new = _random_chunk(rng, 2, 256, 2, 4, 128, jnp.bfloat16, jnp.bfloat16)
    fn = lambda q, k, v, *c: prefill_attention(  # noqa: E731
        q, k, v, *c, sink_slots=SINK_SLOTS, group_size=128, softmax_scale=0.1, interpret=False, tier_block_m=128
    )
    kernels = compile_triton_kernels_for_h200(fn, q, k_new, v_new, *cache.arrays)
    assert sorted(name.split("_attention")[0] + ("_m128" if "_block_m_128_" in name else "") for name in kernels) == [
        "oscar_bf16_tier_m128", "oscar_causal_chunk", "oscar_int2_tier_m128"], list(kernels)
    for name, usage in kernels.items():
        assert usage["spills"] == 0, f"{name} spills {usage['spills']} bytes of registers"
