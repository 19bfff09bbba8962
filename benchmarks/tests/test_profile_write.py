"""profile_write's rotation variants: each is what it says, and each really reaches the kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import profile_write
from oscar_jax.kernels import write as kwrite


class _Ref:
    def __init__(self, value):
        self.value = value

    def __getitem__(self, index):
        return self.value[index]


def test_bf16x3_rotation_is_float32_accurate_for_bf16_rows():
    """R split into three bf16 parts times bf16-exact rows: within float32 rounding of the float64
    product (relative 1e-6 of the row norm), where one bf16 product is ~1e-3 off."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16).astype(jnp.float32)
    r, _ = np.linalg.qr(rng.standard_normal((128, 128)))
    want = np.asarray(x, np.float64) @ r
    got = np.asarray(profile_write._rotate_variant("bf16x3")(x, _Ref(jnp.asarray(r, jnp.float32))))
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.linalg.norm(want, axis=1))
    one_pass = np.asarray(jnp.dot(x.astype(jnp.bfloat16), jnp.asarray(r, jnp.bfloat16),
                                  preferred_element_type=jnp.float32))
    assert np.max(np.abs(one_pass - want)) > 1e-4 * np.max(np.linalg.norm(want, axis=1))


@pytest.mark.parametrize("name,expected_dots", [("ieee", 1), ("bf16x3", 3)])
def test_each_variant_reaches_the_traced_kernel(name, expected_dots, monkeypatch):
    """The launcher is jitted with static arguments only: without clearing JAX's caches a second
    variant reuses the first one's trace (the first H200 run measured ieee five times). The
    product's kernel rotates bf16 rows by three dots of host-split parts; a float32 variant
    reads R whole (one [D, D] float32 operand) and does its own dots."""
    rows = jnp.zeros((16, 1, 64), jnp.bfloat16)
    pools = (jnp.zeros((1, 1, 16, 16), jnp.uint8), jnp.zeros((1, 1, 16, 1), jnp.float16),
             jnp.zeros((1, 1, 16, 1), jnp.float16))
    ids, slots = jnp.zeros(16, jnp.int32), jnp.arange(16, dtype=jnp.int32)
    rotation = jnp.eye(64, dtype=jnp.float32)[None]
    launch = functools.partial(kwrite.write_pages_rows, group_size=64, clip_index=61, levels="minmax",
                               interpret=True)

    def trace():
        return str(jax.make_jaxpr(launch)(*pools, rows, ids, slots, rotation))

    assert trace().count("dot_general") == 3 and "bf16[1,3,64,64]" in trace()  # the product, now cached
    monkeypatch.setattr(kwrite, "_rotate", profile_write._rotate_variant(name))
    monkeypatch.setattr(kwrite, "_rotation_operand", profile_write._float32_operand(kwrite._rotation_operand))
    try:
        assert "bf16[1,3,64,64]" in trace()  # the stale trace
        jax.clear_caches()  # what profile_write does before each variant
        assert trace().count("dot_general") == expected_dots
        assert "bf16[1,3,64,64]" not in trace() and "f32[1,64,64]" in trace()
    finally:  # no later test may meet a cached trace of the variant
        monkeypatch.undo()
        jax.clear_caches()
