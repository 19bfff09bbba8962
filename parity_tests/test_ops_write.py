"""The write kernels of both backends against shared_math, bit for bit: one suite for oscar_jax
(Pallas) and oscar_torch (Triton) on the `kernel_backend` fixture, numpy in and out through
parity_tests.backends. What is tested here is below the public ops (whose bytes across the four
implementations are test_parity.py's): the launchers' rotation operand and encode by planes
(unrotated rows landing exactly; rotated bfloat16 rows taking the split rotation's products).
Framework-only behaviour stays in each backend's tests (jit and donation, torch devices and
strides, which path a block takes, compile checks).
"""

import numpy as np
import pytest

from parity_tests import backends
from parity_tests.cases import (assert_same_bits, bf16_bits, bf16_values, destinations, expected_pools, random_rotations,
                                sentinel_int2_pools)
from shared_math import codec as ref
from shared_math.rotation import split_bf16
from shared_math.spec import clip_index

F32 = np.float32
ARRAYS = ("packed", "scale", "minimum")
POOLS = ("codes", "scale", "minimum")
NUM_TOKENS, NUM_HEADS, D, PAGE_SIZE, NUM_PAGES = 37, 3, 64, 16, 4


def zero_int2_pools(num_pages, num_heads, page_size, d, group_size, layers=()):
    lead = tuple(layers) + (num_pages, num_heads, page_size)
    return (np.zeros(lead + (d // 4,), np.uint8), np.zeros(lead + (d // group_size,), np.float16),
            np.zeros(lead + (d // group_size,), np.float16))


def planes_rows(rng, dtype):
    """Rows [37, 3, 64] as the write kernels see them (float32, or bfloat16 bits), one token's head
    with a NaN (token 18, head 2: its block of 16 falls back), and their float32 values."""
    rows = (rng.standard_normal((NUM_TOKENS, NUM_HEADS, D)) * 3).astype(F32)
    rows[NUM_TOKENS // 2, NUM_HEADS - 1, 5] = np.nan
    if dtype == "bfloat16":
        rows = bf16_bits(rows)
        return rows, bf16_values(rows)
    return rows, rows


def _pools_and_destinations(rng, pools, layers=()):
    """The pools a variant starts from and, for the first, where the tokens land: "sentinel" draws
    random pools then the destinations (the JAX suite's), "zeros" zero pools and the destinations
    right after the rows (the torch suite's)."""
    if pools == "sentinel":
        return sentinel_int2_pools(rng, NUM_PAGES, NUM_HEADS, PAGE_SIZE, D, D, layers)
    return zero_int2_pools(NUM_PAGES, NUM_HEADS, PAGE_SIZE, D, D, layers)


# Each backend keeps the pools and destinations its suite had before the two merged (a variant takes
# 5-10 s in Pallas interpret mode); both compare every byte of the pools.
VARIANTS = [("jax", "sentinel"), ("torch", "zeros")]


@pytest.mark.parametrize("rows_dtype", ["bfloat16", "float32"])
def test_bf16_rows_take_the_rotation_split_like_shared_math(kernel_backend, rows_dtype):
    """The launcher's bf16 parts of R (for the kernel: bfloat16 under jit on the device for JAX,
    int16 bits for torch) are bit for bit shared_math's split (integer rounding: no
    excess-precision pass can skip it); float32 rows take R itself."""
    rotation = random_rotations(np.random.default_rng(3), 2, 64)
    operand = backends.rotation_operand(kernel_backend, rotation, rows_dtype)
    if rows_dtype == "float32":
        np.testing.assert_array_equal(operand, rotation)
        return
    assert operand.dtype == {"jax": np.uint16, "torch": np.int16}[kernel_backend]  # bf16 bits, int16 bits
    assert operand.shape == (2, 3, 64, 64)
    want = np.stack(split_bf16(rotation), axis=-3).view(np.uint32) >> 16
    np.testing.assert_array_equal(operand.view(np.uint16), want.astype(np.uint16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"], ids=["bf16", "f32"])
@pytest.mark.parametrize("kernel_backend,pools", VARIANTS)
def test_write_kernels_by_planes_land_exactly(kernel_backend, pools, dtype):
    """write_int2_rows, write_pages_rows and demote_pages_rows with planes=True (unrotated rows,
    G = D): shared_math's bytes, a partial last block and a block falling back (a NaN) included;
    every byte of the pools not written keeps its value."""
    rng = np.random.default_rng(41)
    kw = dict(group_size=D, clip_index=clip_index(0.92, D), levels="minmax", planes=True)
    rows, values = planes_rows(rng, dtype)
    want = ref.encode(values, group_size=D, clip_ratio=0.92)
    got = backends.write_int2_rows(kernel_backend, rows, None, block_tokens=16, **kw)
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(a, e, f"write_int2 planes {name}")

    if pools == "zeros":
        page_ids, slots = destinations(rng, NUM_TOKENS, NUM_PAGES, PAGE_SIZE)
    start = _pools_and_destinations(rng, pools)
    if pools == "sentinel":
        page_ids, slots = destinations(rng, NUM_TOKENS, NUM_PAGES, PAGE_SIZE)
    got = backends.write_pages_rows(kernel_backend, start, rows, page_ids, slots, None, block_tokens=16, **kw)
    for name, a, e in zip(POOLS, got, expected_pools(start, want, page_ids, slots)):
        assert_same_bits(a, e, f"write_pages planes {name}")

    bf16_pool = bf16_bits(values[:32].reshape(2, PAGE_SIZE, NUM_HEADS, D).transpose(0, 2, 1, 3))[None]
    start = (sentinel_int2_pools(rng, 3, NUM_HEADS, PAGE_SIZE, D, D, (1,)) if pools == "sentinel"
             else zero_int2_pools(3, NUM_HEADS, PAGE_SIZE, D, D, (1,)))
    got = backends.demote_pages_rows(kernel_backend, bf16_pool, start, np.array([1, 0], np.int32),
                                     np.array([0, 2], np.int32), **kw)
    encoded = ref.encode(bf16_values(bf16_pool[0, [1, 0]]), group_size=D, clip_ratio=0.92)
    for name, pool, a, e in zip(POOLS, start, got, encoded):
        expected = np.array(pool, copy=True)
        expected[0, [0, 2]] = e
        assert_same_bits(a, expected, f"demote planes {name}")


@pytest.mark.parametrize("kernel_backend,pools", VARIANTS)
def test_rotated_bf16_rows_by_planes_take_the_planes_products(kernel_backend, pools):
    """bfloat16 rows rotated in the kernel with planes=True (the split rotation's products plane by
    plane, then encode_planes): write_int2_rows and write_pages_rows write planes=False's bytes, a
    partial last block and a falling-back block (a NaN row) included."""
    rng = np.random.default_rng(43)
    rows, _ = planes_rows(rng, "bfloat16")
    rotation = random_rotations(rng, NUM_HEADS, D)
    kw = dict(group_size=D, clip_index=clip_index(0.96, D), levels="minmax", block_tokens=16)
    want = backends.write_int2_rows(kernel_backend, rows, rotation, planes=False, **kw)
    got = backends.write_int2_rows(kernel_backend, rows, rotation, planes=True, **kw)
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(a, e, f"write_int2 rotated planes {name}")
    start = _pools_and_destinations(rng, pools)
    page_ids, slots = destinations(rng, NUM_TOKENS, NUM_PAGES, PAGE_SIZE)
    want = backends.write_pages_rows(kernel_backend, start, rows, page_ids, slots, rotation, planes=False, **kw)
    got = backends.write_pages_rows(kernel_backend, start, rows, page_ids, slots, rotation, planes=True, **kw)
    for name, a, e in zip(POOLS, got, want):
        assert_same_bits(a, e, f"write_pages rotated planes {name}")


def test_write_by_planes_is_refused_for_rotated_float32_rows_and_groups(kernel_backend):
    x = np.zeros((4, 2, 64), F32)
    with pytest.raises(ValueError, match="with a rotation needs bfloat16 rows"):
        backends.write_int2_rows(kernel_backend, x, np.eye(64, dtype=F32)[None].repeat(2, 0), group_size=64,
                                 clip_index=58, levels="minmax", planes=True)
    with pytest.raises(ValueError, match="group_size=32, head_dim=64"):
        backends.write_int2_rows(kernel_backend, x, None, group_size=32, clip_index=58, levels="minmax", planes=True)
