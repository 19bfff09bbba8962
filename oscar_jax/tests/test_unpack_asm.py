"""The Pallas INT2 kernel's inline PTX: `decode_attention(unpack_asm=True)`, the unpacker
(shared_math.ptx, whose PTX is emulated in shared_math/tests/test_ptx.py), and `fma_asm=True`, its
multiply-adds as one fma each (`kernels.decode_attention.multiply_add`) — each refused where it
cannot run, and on the GPU equal to the compiler's form and chosen by default."""

import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax.attention_ops import decode_attention

pytestmark = pytest.mark.kernels("pallas")  # the Pallas kernels (interpret mode on CPU), not the XLA path


def test_unpack_asm_refuses_what_it_cannot_run():
    from oscar_jax.tests.test_decode_attention import SINK_SLOTS, build_cache

    cache = build_cache(np.random.default_rng(0), (200,), num_kv_heads=1, head_dim=64, group_size=64)
    call = lambda q, **kw: decode_attention(q, *cache.arrays, sink_slots=SINK_SLOTS, group_size=64,  # noqa: E731
                                            softmax_scale=0.1, unpack_asm=True, **kw)
    with pytest.raises(ValueError, match="interpret mode cannot run PTX"):
        call(jnp.zeros((1, 2, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="q float32"):
        call(jnp.zeros((1, 2, 64), jnp.float32), interpret=False)
    with pytest.raises(ValueError, match="unpack_asm='yes' must be a bool"):
        decode_attention(jnp.zeros((1, 2, 64), jnp.bfloat16), *cache.arrays, sink_slots=SINK_SLOTS, group_size=64,
                         softmax_scale=0.1, unpack_asm="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group_size,page_size", [(128, 128, 64), (128, 32, 64), (64, 16, 16)])
def test_unpack_asm_on_the_gpu_matches_the_compiler_unpacking(head_dim, group_size, page_size):
    from oscar_jax.tests.test_decode_attention import SINK, build_cache

    cache = build_cache(np.random.default_rng(1), (4000, 1337, 300), num_kv_heads=2, head_dim=head_dim,
                        group_size=group_size, page_size=page_size, recent=256)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8, head_dim)), jnp.bfloat16)
    kw = dict(sink_slots=SINK // page_size, group_size=group_size, softmax_scale=head_dim**-0.5, interpret=False)
    compiler = np.asarray(decode_attention(q, *cache.arrays, unpack_asm=False, **kw))
    unpacked = np.asarray(decode_attention(q, *cache.arrays, unpack_asm=True, **kw))
    default = np.asarray(decode_attention(q, *cache.arrays, **kw))
    # the same dot operands (bits) feed the same arithmetic: equal up to float32 reassociation
    np.testing.assert_allclose(unpacked, compiler, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(default, unpacked)  # None → the PTX unpacker on the GPU for bf16 q


def test_fma_asm_refuses_what_it_cannot_run():
    from oscar_jax.tests.test_decode_attention import SINK_SLOTS, build_cache

    cache = build_cache(np.random.default_rng(0), (200,), num_kv_heads=1, head_dim=64, group_size=64)
    q = jnp.zeros((1, 2, 64), jnp.float32)
    kw = dict(sink_slots=SINK_SLOTS, group_size=64, softmax_scale=0.1)
    with pytest.raises(ValueError, match="interpret mode cannot run PTX"):
        decode_attention(q, *cache.arrays, fma_asm=True, interpret=True, **kw)
    with pytest.raises(ValueError, match="fma_asm='yes' must be a bool"):
        decode_attention(q, *cache.arrays, fma_asm="yes", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group_size,page_size,dtype", [
    (128, 128, 64, jnp.bfloat16),  # the whole-page kernel, one group a row (Qwen3-8B's)
    (128, 32, 64, jnp.float32),  # several groups: the scores' chain of multiply-adds
    (64, 16, 16, jnp.bfloat16),  # the token-gather kernel
])
def test_fma_asm_on_the_gpu_matches_separate_multiply_adds(head_dim, group_size, page_size, dtype):
    from oscar_jax.tests.test_decode_attention import SINK, build_cache

    cache = build_cache(np.random.default_rng(1), (4000, 1337, 300), num_kv_heads=2, head_dim=head_dim,
                        group_size=group_size, page_size=page_size, recent=256)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8, head_dim)), dtype)
    kw = dict(sink_slots=SINK // page_size, group_size=group_size, softmax_scale=head_dim**-0.5, interpret=False)
    separate = np.asarray(decode_attention(q, *cache.arrays, fma_asm=False, **kw))
    fused = np.asarray(decode_attention(q, *cache.arrays, fma_asm=True, **kw))
    default = np.asarray(decode_attention(q, *cache.arrays, **kw))
    # one rounding instead of two per multiply-add: float32 noise, scaled up where the code dots'
    # bias (128·Σ q, `code_offset`) cancels — 3.6e-5 seen with eight groups a row (H200, v20), 20×
    # under the INT2 error against the float64 reference (2–3e-3)
    np.testing.assert_allclose(fused, separate, rtol=0, atol=1e-4)
    assert np.abs(fused - separate).max() > 0, "fma_asm changed no rounding: the flag did not reach the kernel"
    np.testing.assert_array_equal(default, fused)  # None → the PTX fmas on the GPU
