"""Write path of oscar_jax.ops against shared_math: fused rotate + encode, page scatters, demotion.

Every written row must have exactly the bytes of shared_math.encode of the same float32 row, land
exactly at its (page, slot) and leave the rest of the pools untouched. Interpret mode on CPU; with
JAX_PLATFORMS=cuda the same tests compile the kernels (see `assert_rotated_encoding`). The write
kernels' rotation operand and encode by planes, both backends: parity_tests/test_ops_write.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import ops
from oscar_jax.kernels import write as kwrite
from oscar_jax.kernels.codec import resolve_interpret
from parity_tests.cases import assert_same_bits, destinations, expected_pools, random_rotations
from parity_tests.cases import sentinel_int2_pools as int2_pools
from shared_math import codec as ref
from shared_math.spec import clip_index

pytestmark = pytest.mark.kernels("pallas")  # the Pallas kernels (interpret mode on CPU), not the XLA path

F32 = np.float32
INTERPRET = resolve_interpret(None)


def assert_encoding(got, want, what=""):
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        assert_same_bits(a, e, f"{what} {name}")


def reference_rotation(x, rotation):
    """k' = k·R[h] in float32 with the same jnp matmul at Precision.HIGHEST."""
    return np.asarray(
        jnp.einsum(
            "tkd,kde->tke", jnp.asarray(x).astype(jnp.float32), rotation, precision=jax.lax.Precision.HIGHEST
        )
    )


def assert_rotated_encoding(got, x, rotation, *, group_size, clip_ratio, levels):
    """Interpret mode: bit-identical to shared_math.encode of the reference rotation. Compiled
    (GPU): the in-kernel float32 dot may round differently from XLA's matmul in the last bit, so
    a code may flip where a rotated value sits on a threshold: allow rare one-level flips and
    metadata within one float16 step."""
    want = ref.encode(reference_rotation(x, rotation), group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    if INTERPRET:
        assert_encoding(got, want, "rotated")
        return
    codes = ref.unpack_codes(np.asarray(got[0])).astype(int)
    want_codes = ref.unpack_codes(want[0]).astype(int)
    assert np.abs(codes - want_codes).max() <= 1 and np.mean(codes != want_codes) < 1e-2
    for a, e in zip(got[1:], want[1:]):
        assert np.abs(np.asarray(a).view(np.int16).astype(int) - e.view(np.int16).astype(int)).max() <= 1


# ------------------------------------------------------------------------------ write_int2

WRITE_CASES = [  # (T, K, d, G, c, levels)
    (1, 1, 16, 16, 0.96, "minmax"),
    (3, 3, 64, 32, 0.92, "moments"),
    (17, 8, 128, 128, 0.96, "minmax"),
    (17, 3, 64, 64, 1.0, "minmax"),
    (3, 8, 128, 64, 0.5, "moments"),
]


@pytest.mark.parametrize("num_tokens,num_heads,d,group_size,clip_ratio,levels", WRITE_CASES)
def test_write_int2_rotated_keys(num_tokens, num_heads, d, group_size, clip_ratio, levels):
    rng = np.random.default_rng(num_tokens * 100 + d)
    x = (rng.standard_t(4, size=(num_tokens, num_heads, d)) * 3).astype(F32)
    rotation = random_rotations(rng, num_heads, d)
    got = ops.write_int2(x, rotation, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    assert_rotated_encoding(got, x, rotation, group_size=group_size, clip_ratio=clip_ratio, levels=levels)


def test_write_int2_bf16_keys_rotate_their_float32_values():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, 3, 64)).astype(F32)).astype(jnp.bfloat16)
    rotation = random_rotations(rng, 3, 64)
    got = ops.write_int2(x, rotation, group_size=32, clip_ratio=0.96)
    assert_rotated_encoding(got, x, rotation, group_size=32, clip_ratio=0.96, levels="minmax")


def test_rotation_is_float32_accurate():
    """The reference product against float64 (TF32 or bf16 would be ~1e-3 off), and the kernel's
    product on signed permutations: exact in float32, but not if the kernel rounded its inputs
    (TF32 keeps 10 mantissa bits). Per-head permutations also catch a head mix-up."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((17, 3, 64)).astype(F32)
    rotation = random_rotations(rng, 3, 64)
    exact = np.einsum("tkd,kde->tke", x.astype(np.float64), rotation.astype(np.float64))
    assert np.abs(reference_rotation(x, rotation) - exact).max() < 1e-5
    perms = np.stack([rng.permutation(64) for _ in range(3)])
    signs = rng.choice([-1.0, 1.0], size=(3, 64)).astype(F32)
    signed_perm = np.zeros((3, 64, 64), F32)
    for h in range(3):
        signed_perm[h, perms[h], np.arange(64)] = signs[h]  # column j takes x[perm[j]]·sign[j]
    expected_rows = np.stack([x[:, h, perms[h]] * signs[h] for h in range(3)], axis=1)
    got = ops.write_int2(x, signed_perm, group_size=32, clip_ratio=0.92, levels="moments")
    assert_encoding(got, ref.encode(expected_rows, group_size=32, clip_ratio=0.92, levels="moments"), "perm")


@pytest.mark.parametrize("levels", ["minmax", "moments"])
def test_write_int2_values_take_no_rotation(levels):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((17, 3, 128)) * 2).astype(F32)
    x[0, 0, :4] = [np.nan, np.inf, -1e-40, 1e30]
    got = ops.write_int2(x, None, group_size=128, clip_ratio=0.92, levels=levels)
    assert_encoding(got, ref.encode(x, group_size=128, clip_ratio=0.92, levels=levels), "values")


# ----------------------------------------------------------------------------- write_pages

PAGE_CASES = [  # (T, K, d, G, P, L, rotate, levels)
    (1, 1, 16, 16, 2, 4, False, "minmax"),
    (3, 3, 64, 32, 4, 16, True, "minmax"),
    (17, 8, 64, 16, 3, 16, False, "moments"),
    (17, 3, 128, 128, 5, 4, True, "moments"),
]


@pytest.mark.parametrize("num_tokens,num_heads,d,group_size,num_pages,page_size,rotate,levels", PAGE_CASES)
def test_write_pages_lands_exactly(num_tokens, num_heads, d, group_size, num_pages, page_size, rotate, levels):
    rng = np.random.default_rng(num_tokens + 10 * num_heads + d)
    pools = int2_pools(rng, num_pages, num_heads, page_size, d, group_size)
    rows = (rng.standard_normal((num_tokens, num_heads, d)) * 2).astype(F32)
    rotation = random_rotations(rng, num_heads, d) if rotate else None
    page_ids, slots = destinations(rng, num_tokens, num_pages, page_size)
    got = ops.write_pages(
        *pools, rows, page_ids, slots, rotation=rotation, group_size=group_size, clip_ratio=0.96, levels=levels
    )
    if rotate and not INTERPRET:
        written = [np.asarray(p)[page_ids, :, slots] for p in got]
        assert_rotated_encoding(written, rows, rotation, group_size=group_size, clip_ratio=0.96, levels=levels)
        encoded = written  # checked above; the rest of the pools must still be exact
    else:
        source = reference_rotation(rows, rotation) if rotate else rows
        encoded = ref.encode(source, group_size=group_size, clip_ratio=0.96, levels=levels)
    for name, a, e in zip(("codes", "scale", "minimum"), got, expected_pools(pools, encoded, page_ids, slots)):
        assert_same_bits(a, e, name)


def test_write_pages_token_by_token_under_jit_with_donation():
    """A decode loop: one token per step into consecutive slots across page boundaries, the pools
    donated to the jitted step; the result equals one batched write."""
    rng = np.random.default_rng(4)
    num_heads, d, group_size, page_size = 3, 64, 64, 4
    pools = int2_pools(rng, 4, num_heads, page_size, d, group_size)
    rows = rng.standard_normal((9, num_heads, d)).astype(F32)
    rotation = random_rotations(rng, num_heads, d)
    page_ids = np.array([2, 2, 2, 2, 0, 0, 0, 0, 3], np.int32)
    slots = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0], np.int32)
    step = jax.jit(
        functools.partial(ops.write_pages, group_size=group_size, clip_ratio=0.96),
        donate_argnums=(0, 1, 2),
    )
    state = tuple(jnp.asarray(p) for p in pools)
    for t in range(len(rows)):
        state = step(*state, rows[t : t + 1], page_ids[t : t + 1], slots[t : t + 1], rotation=rotation)
    batched = ops.write_pages(
        *pools, rows, page_ids, slots, rotation=rotation, group_size=group_size, clip_ratio=0.96
    )
    for name, a, e in zip(("codes", "scale", "minimum"), state, batched):
        assert_same_bits(a, e, name)


def test_write_pages_under_jit_skips_out_of_range_destinations():
    """Traced ids cannot be checked on the host: an out-of-range page or slot is never written."""
    rng = np.random.default_rng(5)
    num_pages, num_heads, page_size, d, group_size = 3, 2, 4, 32, 16
    pools = int2_pools(rng, num_pages, num_heads, page_size, d, group_size)
    rows = rng.standard_normal((5, num_heads, d)).astype(F32)
    page_ids = np.array([1, -1, num_pages, 0, 2], np.int32)
    slots = np.array([3, 0, 1, page_size, 0], np.int32)
    got = jax.jit(functools.partial(ops.write_pages, group_size=group_size, clip_ratio=0.9))(
        *pools, rows, page_ids, slots
    )
    keep = np.array([0, 4])
    encoded = ref.encode(rows[keep], group_size=group_size, clip_ratio=0.9)
    expected = expected_pools(pools, encoded, page_ids[keep], slots[keep])
    for name, a, e in zip(("codes", "scale", "minimum"), got, expected):
        assert_same_bits(a, e, name)


# ------------------------------------------------------------------------ write_bf16_pages


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_tokens,num_heads", [(1, 1), (17, 3), (3, 8)])
def test_write_bf16_pages_lands_exactly(num_tokens, num_heads, dtype):
    rng = np.random.default_rng(num_tokens * num_heads)
    num_pages, page_size, d = 5, 4, 64
    pool = rng.integers(0, 2**16, size=(num_pages, num_heads, page_size, d), dtype=np.uint16).view(jnp.bfloat16)
    rows = (rng.standard_normal((num_tokens, num_heads, d)) * 100).astype(F32)
    rows[0, 0, :3] = [1.00390625, 1.01171875, -3e38]  # ties of the bf16 rounding, near-overflow
    rows = np.asarray(jnp.asarray(rows).astype(dtype))
    page_ids, slots = destinations(rng, num_tokens, num_pages, page_size)
    got = ops.write_bf16_pages(pool, rows, page_ids, slots)
    expected = np.array(pool, copy=True)
    expected[page_ids, :, slots] = rows.astype(jnp.bfloat16)  # ml_dtypes: round to nearest even
    assert_same_bits(got, expected, "bf16 pool")


# ---------------------------------------------------------------------------- demote_pages

DEMOTE_CASES = [  # (layers, K, d, G, L, P_bf16, P_int2, src, dst, c, levels)
    ((), 1, 16, 16, 4, 3, 2, [2], [1], 0.96, "minmax"),
    ((), 3, 64, 32, 16, 4, 5, [3, 0, 1], [4, 0, 2], 0.92, "moments"),
    ((), 8, 128, 128, 16, 3, 3, [1, 2], [2, 0], 0.96, "minmax"),
    ((3,), 3, 64, 64, 16, 4, 4, [2, 1], [0, 3], 0.96, "minmax"),  # all layers in one launch
    ((2,), 1, 128, 32, 4, 2, 3, [1], [2], 1.0, "moments"),
]


@pytest.mark.parametrize(
    "layers,num_heads,d,group_size,page_size,p_bf16,p_int2,src,dst,clip_ratio,levels", DEMOTE_CASES
)
def test_demote_pages(layers, num_heads, d, group_size, page_size, p_bf16, p_int2, src, dst, clip_ratio, levels):
    rng = np.random.default_rng(d + page_size + len(src))
    rows = (rng.standard_t(3, size=tuple(layers) + (p_bf16, num_heads, page_size, d)) * 5).astype(F32)
    bf16_pool = np.asarray(jnp.asarray(rows).astype(jnp.bfloat16))
    pools = int2_pools(rng, p_int2, num_heads, page_size, d, group_size, layers)
    got = ops.demote_pages(
        bf16_pool, *pools, np.array(src), np.array(dst), group_size=group_size, clip_ratio=clip_ratio, levels=levels
    )
    page_axis = len(layers)
    source = np.take(bf16_pool, src, axis=page_axis).astype(F32)  # BF16 → float32 is exact
    encoded = ref.encode(source, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    for name, pool, a, e in zip(("codes", "scale", "minimum"), pools, got, encoded):
        expected = np.array(pool, copy=True)
        index = (slice(None),) * page_axis + (np.array(dst),)
        expected[index] = e
        assert_same_bits(a, expected, name)


def test_write_bf16_then_demote_equals_writing_the_bf16_rows():
    """The cache's path (BF16 recent page → demotion) gives the bytes of a direct INT2 write of
    the same BF16 rows, under jit with traced page ids."""
    rng = np.random.default_rng(6)
    num_heads, page_size, d, group_size = 3, 16, 64, 64
    rows = rng.standard_normal((page_size, num_heads, d)).astype(F32)
    bf16_pool = jnp.zeros((2, num_heads, page_size, d), jnp.bfloat16)
    bf16_pool = ops.write_bf16_pages(bf16_pool, rows, np.full(page_size, 1), np.arange(page_size))
    pools = int2_pools(rng, 3, num_heads, page_size, d, group_size)
    demote = jax.jit(functools.partial(ops.demote_pages, group_size=group_size, clip_ratio=0.96))
    demoted = demote(bf16_pool, *pools, jnp.array([1]), jnp.array([2]))
    direct = ops.write_pages(
        *pools, jnp.asarray(rows).astype(jnp.bfloat16), np.full(page_size, 2), np.arange(page_size),
        group_size=group_size, clip_ratio=0.96,
    )
    for name, a, e in zip(("codes", "scale", "minimum"), demoted, direct):
        assert_same_bits(a, e, name)


# ------------------------------------------------------------------------------ bad inputs

_RNG = np.random.default_rng(0)
X = np.zeros((3, 2, 64), F32)
R = np.tile(np.eye(64, dtype=F32), (2, 1, 1))
CODES, SCALE, MINIMUM = int2_pools(_RNG, 4, 2, 16, 64, 32)
BF16 = np.zeros((4, 2, 16, 64), jnp.bfloat16)
IDS, SLOTS = np.array([0, 1, 2]), np.array([0, 1, 2])
DP = functools.partial(ops.demote_pages, group_size=32, clip_ratio=0.9)


# The errors numpy inputs can make, every backend: parity_tests/test_ops_write.py. Here what only
# numpy's own dtypes reach (a float64 rotation: JAX without x64 would make it float32 first).


def test_float64_rotation_is_refused():
    with pytest.raises(ValueError, match="rotation must be float32"):
        ops.write_int2(X, R.astype(np.float64), group_size=32, clip_ratio=0.9)


def test_empty_writes_return_the_pools():
    got = ops.write_pages(CODES, SCALE, MINIMUM, X[:0], IDS[:0], SLOTS[:0], group_size=32, clip_ratio=0.9)
    for a, e in zip(got, (CODES, SCALE, MINIMUM)):
        assert_same_bits(a, e)
    assert_same_bits(ops.write_bf16_pages(BF16, X[:0], IDS[:0], SLOTS[:0]), BF16)
    for a, e in zip(DP(BF16, CODES, SCALE, MINIMUM, IDS[:0], IDS[:0]), (CODES, SCALE, MINIMUM)):
        assert_same_bits(a, e)
    packed, scale, minimum = ops.write_int2(X[:0], R, group_size=32, clip_ratio=0.9)
    assert packed.shape == (0, 2, 16) and scale.shape == minimum.shape == (0, 2, 2)


def test_uint8_arrays_of_2_to_4_gib_are_refused_when_compiled():
    """The Triton lowering's 32-bit offsets wrap past 2^31 elements of a ≤ 4 GiB array."""
    check = ops._check_byte_addressable
    for size, refused in ((2**31, False), (2**31 + 1, True), (2**32, True), (2**32 + 1, False)):
        spec = jax.ShapeDtypeStruct((size,), jnp.uint8)
        check(spec, "codes", interpret=True)  # the interpreter has no such limit
        if refused:
            with pytest.raises(NotImplementedError, match=f"codes holds {size} bytes"):
                check(spec, "codes", interpret=False)
        else:
            check(spec, "codes", interpret=False)
    check(jax.ShapeDtypeStruct((2**31 + 1,), jnp.float16), "scale", interpret=False)  # 2-byte: fine


# ------------------------------------------------------------------------- encode by planes


def _planes_rows(rng, num_tokens, num_heads, d, dtype):
    """Rows as the write kernels see them, one token's head with a NaN (its block falls back)."""
    rows = (rng.standard_normal((num_tokens, num_heads, d)) * 3).astype(F32)
    rows[num_tokens // 2, num_heads - 1, 5] = np.nan
    return np.asarray(jnp.asarray(rows).astype(dtype))


def test_rotated_bf16_rows_by_planes_fall_back_only_where_a_row_declines(monkeypatch):
    """Which path each block takes (encode_block swapped for a stand-in writing zeros, so that a
    decision that always fell back could not pass unseen): bfloat16 rows rotated in the kernel
    with planes=True write planes=False's bytes in every block of ordinary rows, and the block
    holding a NaN row and only it falls back (the bytes of both backends by planes:
    parity_tests/test_ops_write.py)."""
    from oscar_jax.kernels import codec as kcodec

    rng = np.random.default_rng(43)
    num_tokens, num_heads, d = 37, 3, 64
    rows = _planes_rows(rng, num_tokens, num_heads, d, jnp.bfloat16)  # NaN: token 18, head 2
    rotation = random_rotations(rng, num_heads, d)
    kw = dict(group_size=d, clip_index=clip_index(0.96, d), levels="minmax", block_tokens=16)
    want = [np.asarray(a) for a in kwrite.write_int2_rows(rows, rotation, planes=False, **kw)]

    def zeros_encode_block(x, *, group_size, **_):
        rows_, d_ = x.shape
        return (jnp.zeros((rows_, d_ // 4), jnp.uint8), jnp.zeros((rows_, d_ // group_size), jnp.float16),
                jnp.zeros((rows_, d_ // group_size), jnp.float16))

    monkeypatch.setattr(kcodec, "encode_block", zeros_encode_block)
    jax.clear_caches()  # the launchers are jitted: trace them again with the stand-in
    got = [np.asarray(a) for a in kwrite.write_int2_rows(rows, rotation, planes=True, **kw)]
    fell_back = np.zeros((num_tokens, num_heads), bool)
    fell_back[16:32, num_heads - 1] = True  # head 2's second block of 16 tokens holds the NaN
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        assert_same_bits(a[~fell_back], e[~fell_back], f"{name}: blocks of ordinary rows by planes")
        assert not a[fell_back].view(f"u{a.itemsize}").any(), f"{name}: the NaN block did not fall back"
    jax.clear_caches()

@pytest.mark.parametrize("launcher", ["write_pages_rows", "demote_pages_rows", "rotated write_pages_rows"])
def test_write_by_planes_compiles_for_h200(launcher):
    """The unrotated write and the demotion with planes=True (bf16 rows, Qwen3-8B value clip k 117),
    and the rotated write of bf16 rows (its default 64 tokens a program: the split rotation plane by
    plane), lowered and compiled for sm_90 on the CPU: no spills (interpret mode applies no GPU rule)."""
    pytest.importorskip("triton")
    from benchmarks.static_analysis import compile_pallas_for_h200

    heads, page, d = 8, 64, 128
    pools = (jax.ShapeDtypeStruct((16, heads, page, d // 4), jnp.uint8),
             jax.ShapeDtypeStruct((16, heads, page, 1), jnp.float16),
             jax.ShapeDtypeStruct((16, heads, page, 1), jnp.float16))
    kw = dict(group_size=d, clip_index=117, levels="minmax", interpret=False, planes=True)
    if launcher.endswith("write_pages_rows"):
        rotated = launcher.startswith("rotated")
        fn = functools.partial(kwrite.write_pages_rows, block_tokens=None if rotated else 32, **kw)
        args = (*pools, jax.ShapeDtypeStruct((256, heads, d), jnp.bfloat16), jax.ShapeDtypeStruct((256,), jnp.int32),
                jax.ShapeDtypeStruct((256,), jnp.int32),
                jax.ShapeDtypeStruct((heads, d, d), jnp.float32) if rotated else None)
    else:
        fn = functools.partial(kwrite.demote_pages_rows, **kw)
        pools = tuple(jax.ShapeDtypeStruct((2,) + p.shape, p.dtype) for p in pools)
        args = (jax.ShapeDtypeStruct((2, 16, heads, page, d), jnp.bfloat16), *pools,
                jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    (usage,) = compile_pallas_for_h200(fn, *args).values()
    assert usage["spills"] == 0 and 0 < usage["registers"] <= 255, usage
