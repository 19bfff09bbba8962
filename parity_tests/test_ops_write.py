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
from parity_tests.cases import (assert_same_bits, bf16_bits, bf16_values, destinations, expected_pools,
                                random_rotations, sentinel_int2_pools)
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


# ------------------------------------------------------------------------------- bad inputs
# The public write ops' errors that numpy inputs can make, every backend (`backend`: jax, xla,
# torch); torch's devices and strides and what only a framework's own arrays can express (float64
# into JAX) stay in each backend's tests. Two setups, each the one its suite had before the two
# merged: "j" (3 tokens, 4 pages, sentinel pools) and "t" (2 tokens, 3 zero pages). A message that
# differs between the frameworks is a {"jax": ..., "torch": ...} pair ("jax" also for the XLA path).

J_X = np.zeros((3, 2, 64), F32)
J_R = np.tile(np.eye(64, dtype=F32), (2, 1, 1))
J_POOLS = sentinel_int2_pools(np.random.default_rng(0), 4, 2, 16, 64, 32)
J_CODES, J_SCALE, J_MINIMUM = J_POOLS
J_BF16 = np.zeros((4, 2, 16, 64), np.uint16)  # bfloat16 bits
J_IDS = J_SLOTS = np.array([0, 1, 2])

T_D, T_G, T_K, T_L, T_P = 64, 32, 2, 16, 3
T_ROWS = np.zeros((2, T_K, T_D), F32)
T_IDS = np.array([0, 1], np.int32)
T_BF16 = np.zeros((T_P, T_K, T_L, T_D), np.uint16)


def _t_pools(**overrides):
    pools = dict(codes=np.zeros((T_P, T_K, T_L, T_D // 4), np.uint8),
                 scale=np.zeros((T_P, T_K, T_L, T_D // T_G), np.float16),
                 minimum=np.zeros((T_P, T_K, T_L, T_D // T_G), np.float16))
    pools.update(overrides)
    return pools["codes"], pools["scale"], pools["minimum"]


def _jwp(*args, **kwargs):
    """write_pages(codes, scale, minimum, rows, page_ids, slots) at G 32, c 0.9."""
    return lambda b: backends.write_pages(b, args[:3], *args[3:6], **{"group_size": 32, "clip_ratio": 0.9, **kwargs})


def _jdp(bf16_pool, codes, scale, minimum, src, dst, **kwargs):
    return lambda b: backends.demote_pages(b, bf16_pool, (codes, scale, minimum), np.asarray(src), np.asarray(dst),
                                           **{"group_size": 32, "clip_ratio": 0.9, **kwargs})


def _int2(x, rotation, **kwargs):
    return lambda b: backends.write_int2(b, x, rotation, **kwargs)


def _bf16(pool, rows, page_ids, slots):
    return lambda b: backends.write_bf16_pages(b, pool, rows, np.asarray(page_ids), np.asarray(slots))


def _twrite(rows=T_ROWS, page_ids=T_IDS, slots=T_IDS, rotation=None, group_size=T_G, clip_ratio=0.9,
            levels="minmax", **pools):
    return lambda b: backends.write_pages(b, _t_pools(**pools), rows, np.asarray(page_ids), np.asarray(slots),
                                          rotation=rotation, group_size=group_size, clip_ratio=clip_ratio,
                                          levels=levels)


def _tdemote(bf16_pool=T_BF16, src=T_IDS, dst=T_IDS, group_size=T_G, clip_ratio=0.9, levels="minmax", **pools):
    return lambda b: backends.demote_pages(b, bf16_pool, _t_pools(**pools), np.asarray(src), np.asarray(dst),
                                           group_size=group_size, clip_ratio=clip_ratio, levels=levels)


BAD_WRITES = [
    # write_int2
    (_int2(J_X.astype(np.complex64), J_R, group_size=32, clip_ratio=0.9), "x must be a real"),
    (_int2(J_X[0], J_R, group_size=32, clip_ratio=0.9), r"x must be \[tokens, kv_heads"),
    (_int2(np.zeros((3, 2, 48), F32), None, group_size=16, clip_ratio=0.9), "head_dim=48"),
    (_int2(J_X, J_R, group_size=48, clip_ratio=0.9), "group_size=48"),
    (_int2(J_X, J_R, group_size=32, clip_ratio=2.0), "clip_ratio=2.0"),
    (_int2(J_X, J_R, group_size=32, clip_ratio=0.9, levels="x"), "levels='x'"),
    (_int2(J_X, J_R[:1], group_size=32, clip_ratio=0.9),
     {"jax": r"rotation has shape \(1, 64, 64\)",
      "torch": r"rotation must have shape \[2, 64, 64\] .*got shape \(1, 64, 64\)"}),
    (_int2(J_X, J_R[:, :32], group_size=32, clip_ratio=0.9),
     {"jax": r"rotation has shape \(2, 32, 64\)",
      "torch": r"rotation must have shape \[2, 64, 64\] .*got shape \(2, 32, 64\)"}),
    (_int2(T_ROWS[0], None, group_size=T_G, clip_ratio=0.9), r"x must be \[tokens, kv_heads"),
    (_int2(T_ROWS.astype(bool), None, group_size=T_G, clip_ratio=0.9), "dtype bool"),
    (_int2(T_ROWS, np.zeros((T_K + 1, T_D, T_D), F32), group_size=T_G, clip_ratio=0.9),
     {"jax": r"rotation has shape \(3, 64, 64\), expected \(2, 64, 64\)",
      "torch": r"rotation must have shape \[2, 64, 64\]"}),
    (_int2(T_ROWS, None, group_size=T_G, clip_ratio=0.9, levels="median"), "levels='median'"),
    (_int2(T_ROWS, None, group_size=12, clip_ratio=0.9), "group_size=12"),
    (_int2(T_ROWS, None, group_size=T_G, clip_ratio=-1.0), "clip_ratio=-1.0"),
    # write_pages
    (_jwp(J_CODES.astype(np.int8), J_SCALE, J_MINIMUM, J_X, J_IDS, J_SLOTS),
     {"jax": "codes must be uint8", "torch": "codes must have dtype uint8"}),
    (_jwp(J_CODES, J_SCALE.astype(F32), J_MINIMUM, J_X, J_IDS, J_SLOTS),
     {"jax": "scale must be float16", "torch": "scale must have dtype float16"}),
    (_jwp(J_CODES, J_SCALE, J_MINIMUM.astype(F32), J_X, J_IDS, J_SLOTS),
     {"jax": "minimum must be float16", "torch": "minimum must have dtype float16"}),
    (_jwp(J_CODES[0], J_SCALE[0], J_MINIMUM[0], J_X, J_IDS, J_SLOTS), r"codes must be \[pages, kv_heads"),
    (_jwp(J_CODES, J_SCALE[..., :1], J_MINIMUM, J_X, J_IDS, J_SLOTS), "scale .* and minimum .* same shape"),
    (_jwp(J_CODES, J_SCALE[:2], J_MINIMUM[:2], J_X, J_IDS, J_SLOTS), "must share codes' leading axes"),
    (_jwp(*J_POOLS, np.zeros((3, 2, 32), F32), J_IDS, J_SLOTS), r"rows has shape \(3, 2, 32\)"),
    (_jwp(*J_POOLS, np.zeros((3, 1, 64), F32), J_IDS, J_SLOTS), r"rows has shape \(3, 1, 64\)"),
    (_jwp(*J_POOLS, J_X, J_IDS, J_SLOTS, group_size=16), "hold 2 groups per row, expected .* 4"),
    (_jwp(*J_POOLS, J_X, J_IDS.astype(F32), J_SLOTS),
     {"jax": "page_ids must be an integer array", "torch": "page_ids must be an integer tensor"}),
    (_jwp(*J_POOLS, J_X, J_IDS[:2], J_SLOTS), r"page_ids must have shape \[3\]"),
    (_jwp(*J_POOLS, J_X, J_IDS, J_SLOTS[None]), r"slots must have shape \[3\]"),
    (_jwp(*J_POOLS, J_X, np.array([0, 4, 1]), J_SLOTS), r"page_ids must lie in \[0, 4\).*\[4\]"),
    (_jwp(*J_POOLS, J_X, np.array([0, -1, 1]), J_SLOTS), r"page_ids must lie in \[0, 4\).*\[-1\]"),
    (_jwp(*J_POOLS, J_X, J_IDS, np.array([0, 16, 1])), r"slots must lie in \[0, 16\)"),
    (_jwp(*J_POOLS, J_X, np.array([1, 1, 0]), np.array([5, 5, 0])), "must be distinct"),
    (_jwp(*J_POOLS, J_X, J_IDS, J_SLOTS, rotation=J_R[:1]),
     {"jax": r"rotation has shape", "torch": r"rotation must have shape \[2, 64, 64\] .*got shape \(1, 64, 64\)"}),
    (_twrite(codes=np.zeros((T_P, T_K, T_L, T_D // 4), np.int8)),
     {"jax": "codes must be uint8, got dtype int8", "torch": "codes must have dtype uint8"}),
    (_twrite(scale=np.zeros((T_P, T_K, T_L, T_D // T_G), F32)),
     {"jax": "scale must be float16, got dtype float32", "torch": "scale must have dtype float16"}),
    (_twrite(codes=np.zeros((T_K, T_L, T_D // 4), np.uint8)),
     r"codes must be \[pages, kv_heads, page_size, head_dim/4\]"),
    (_twrite(minimum=np.zeros((T_P, T_K, T_L, 1), np.float16)), "scale .* and minimum .* must have the same shape"),
    (_twrite(scale=np.zeros((T_P, T_K, T_L + 1, 2), np.float16), minimum=np.zeros((T_P, T_K, T_L + 1, 2), np.float16)),
     "must share codes' leading axes"),
    (_twrite(scale=np.zeros((T_P, T_K, T_L, 4), np.float16), minimum=np.zeros((T_P, T_K, T_L, 4), np.float16)),
     "hold 4 groups per row, expected head_dim/group_size = 2"),
    (_twrite(rows=np.zeros((2, T_K + 1, T_D), F32)), r"rows has shape \(2, 3, 64\)"),
    (_twrite(rows=np.zeros((2, T_K, T_D), np.complex64)), "dtype complex64"),
    (_twrite(rotation=np.zeros((T_K, T_D, T_D), np.float16)),
     {"jax": "rotation must be float32, got dtype float16", "torch": "rotation must have dtype float32"}),
    (_twrite(page_ids=T_IDS.astype(F32)),
     {"jax": "page_ids must be an integer array, got dtype float32", "torch": "page_ids must be an integer tensor"}),
    (_twrite(slots=T_IDS[:1]), r"slots must have shape \[2\] \(one per token\)"),
    (_twrite(page_ids=np.array([0, T_P])), r"page_ids must lie in \[0, 3\) .* \[3\]"),
    (_twrite(slots=np.array([-1, 0])), r"slots must lie in \[0, 16\) .* \[-1\]"),
    (_twrite(page_ids=np.array([1, 1]), slots=np.array([4, 4])),
     r"\(page_id, slot\) destinations must be distinct, got repeated \[\[1, 4\]\]"),
    (_twrite(group_size=64), "hold 2 groups per row, expected head_dim/group_size = 1"),
    (_twrite(clip_ratio=2.0), "clip_ratio=2.0"),
    (_twrite(levels="kmeans"), "levels='kmeans'"),
    # write_bf16_pages
    (_bf16(J_BF16.view(np.uint16).astype(np.float16), J_X, J_IDS, J_SLOTS),
     {"jax": "pool must be bfloat16", "torch": "pool must have dtype bfloat16, got dtype float16"}),
    (_bf16(J_BF16[0], J_X, J_IDS, J_SLOTS), r"pool must be \[pages, kv_heads"),
    (_bf16(J_BF16, J_X.astype(np.int32), J_IDS, J_SLOTS),
     {"jax": "rows must be a float array", "torch": "rows must be a float tensor, got dtype int32"}),
    (_bf16(J_BF16, J_X[:, :1], J_IDS, J_SLOTS), r"rows has shape \(3, 1, 64\)"),
    (_bf16(J_BF16, J_X, np.array([0, 9, 1]), J_SLOTS), r"page_ids must lie in \[0, 4\)"),
    (_bf16(J_BF16, J_X, J_IDS, np.array([0, 1, 99])), r"slots must lie in \[0, 16\)"),
    (_bf16(T_BF16.astype(F32), T_ROWS, T_IDS, T_IDS),
     {"jax": "pool must be bfloat16, got dtype float32", "torch": "pool must have dtype bfloat16"}),
    (_bf16(T_BF16[0], T_ROWS, T_IDS, T_IDS), r"pool must be \[pages, kv_heads"),
    (_bf16(T_BF16, T_ROWS.astype(np.int32), T_IDS, T_IDS),
     {"jax": "rows must be a float array, got dtype int32", "torch": "rows must be a float tensor, got dtype int32"}),
    (_bf16(T_BF16, T_ROWS[:, :1], T_IDS, T_IDS), r"rows has shape \(2, 1, 64\)"),
    (_bf16(T_BF16, T_ROWS, np.array([0, 5]), T_IDS), r"page_ids must lie in \[0, 3\)"),
    (_bf16(T_BF16, T_ROWS, T_IDS, np.array([0, 16])), r"slots must lie in \[0, 16\)"),
    # demote_pages
    (_jdp(J_BF16.astype(F32), *J_POOLS, [0], [1]),
     {"jax": "bf16_pool must be bfloat16", "torch": "bf16_pool must have dtype bfloat16, got dtype float32"}),
    (_jdp(J_BF16[0], *J_POOLS, [0], [1]), "bf16_pool must be"),
    (_jdp(J_BF16, J_CODES[None], J_SCALE[None], J_MINIMUM[None], [0], [1]), "codes must be"),
    (_jdp(J_BF16[..., :32], *J_POOLS, [0], [1]), "head_dim=32 differs"),
    (_jdp(J_BF16[:, :1], *J_POOLS, [0], [1]), "must match bf16_pool"),
    (_jdp(np.zeros((4, 2, 12, 64), np.uint16), *sentinel_int2_pools(np.random.default_rng(0), 4, 2, 12, 64, 32), [0],
          [1]), "page_size=12"),
    (_jdp(J_BF16, *J_POOLS, [0, 1], [1]), r"dst_pages must have shape \[2\]"),
    (_jdp(J_BF16, *J_POOLS, [4], [1]), r"src_pages must lie in \[0, 4\)"),
    (_jdp(J_BF16, *J_POOLS, [0], [-2]), r"dst_pages must lie in \[0, 4\)"),
    (_jdp(J_BF16, *J_POOLS, [0, 1], [2, 2]), "dst_pages must be distinct"),
    (_jdp(J_BF16, *J_POOLS, [0.0], [1]),
     {"jax": "src_pages must be an integer array", "torch": "src_pages must be an integer tensor, got dtype float64"}),
    (_jdp(J_BF16, *J_POOLS, [0], [1], levels="median"), "levels='median'"),
    (_tdemote(bf16_pool=T_BF16.astype(F32)),
     {"jax": "bf16_pool must be bfloat16, got dtype float32", "torch": "bf16_pool must have dtype bfloat16"}),
    (_tdemote(bf16_pool=T_BF16[0]), r"bf16_pool must be \[pages, kv_heads, page_size, head_dim\] or"),
    (_tdemote(bf16_pool=T_BF16[None]), r"codes must be \[layers, pages"),
    (_tdemote(bf16_pool=np.zeros((T_P, T_K, T_L, 2 * T_D), np.uint16)),
     "bf16_pool head_dim=128 differs from the INT2 pools' head_dim=64"),
    (_tdemote(bf16_pool=np.zeros((T_P, T_K + 1, T_L, T_D), np.uint16)),
     "must match bf16_pool .* in layers, kv_heads and page_size"),
    (_tdemote(bf16_pool=np.zeros((T_P, T_K, 12, T_D), np.uint16), codes=np.zeros((T_P, T_K, 12, T_D // 4), np.uint8),
              scale=np.zeros((T_P, T_K, 12, 2), np.float16), minimum=np.zeros((T_P, T_K, 12, 2), np.float16)),
     "page_size=12 of the pools must be a power of two"),
    (_tdemote(src=T_IDS.astype(F32)),
     {"jax": "src_pages must be an integer array, got dtype float32", "torch": "src_pages must be an integer tensor"}),
    (_tdemote(dst=T_IDS[:1]), r"dst_pages must have shape \[2\]"),
    (_tdemote(src=np.array([0, T_P])), r"src_pages must lie in \[0, 3\)"),
    (_tdemote(dst=np.array([0, -1])), r"dst_pages must lie in \[0, 3\)"),
    (_tdemote(dst=np.array([2, 2])), r"dst_pages must be distinct, got repeated \[\[2\]\]"),
    (_tdemote(group_size=16), "hold 2 groups per row, expected head_dim/group_size = 4"),
    (_tdemote(clip_ratio=0), "clip_ratio=0"),
    (_tdemote(levels="minimax"), "levels='minimax'"),
]


@pytest.mark.parametrize("call,match", BAD_WRITES, ids=[str(i) for i in range(len(BAD_WRITES))])
def test_bad_inputs_raise_value_error(backend, call, match):
    if isinstance(match, dict):
        match = match["torch" if backend == "torch" else "jax"]
    with pytest.raises(ValueError, match=match):
        call(backend)
