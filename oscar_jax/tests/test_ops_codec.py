"""oscar_jax.ops.encode / decode against shared_math.codec, bit for bit (format v1).

Runs in Pallas interpret mode on CPU; with JAX_PLATFORMS=cuda the same tests compile the kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jax.experimental import pallas as pl

from oscar_jax import ops
from oscar_jax.kernels import codec as kcodec
from parity_tests.cases import (DATA, assert_same_bits, checked_max_rows, encode_planes_rows, heavy_tailed_rows,
                                normal_rows, order_statistic_rows)
from shared_math import codec as ref
from shared_math.spec import FP16_MAX, clip_index

pytestmark = pytest.mark.kernels("pallas")  # the Pallas kernels (interpret mode on CPU), not the XLA path

F32 = np.float32


def assert_encode_matches(x, *, group_size, clip_ratio, levels, expected_input=None):
    got = ops.encode(x, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    want = ref.encode(
        np.asarray(x) if expected_input is None else expected_input,
        group_size=group_size, clip_ratio=clip_ratio, levels=levels,
    )
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        assert_same_bits(a, e, f"{name} d={np.shape(x)[-1]} G={group_size} c={clip_ratio} {levels}")
    return got


# Data kinds (normal, heavy-tailed, ties, special values incl. both zeros in a group, subnormals):
# parity_tests.cases.DATA, the generators every implementation's codec tests share.


def _cases():
    """A seeded sample of the product (d, G, c, levels, leading shape, data)."""
    rng = np.random.default_rng(2024)
    shapes = [(1,), (3,), (17,), (2, 3, 5), (40,)]
    cases = []
    for d, group_size in [(16, 16), (64, 16), (64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]:
        for levels in ("minmax", "moments"):
            clip_ratio = [0.5, 0.92, 0.96, 1.0][rng.integers(4)]
            lead = shapes[rng.integers(len(shapes))]
            cases.append((d, group_size, clip_ratio, levels, lead))
    return cases


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("d,group_size,clip_ratio,levels,lead", _cases())
def test_encode_bit_identical(d, group_size, clip_ratio, levels, lead, data):
    rng = np.random.default_rng(d * 7 + group_size + len(lead))
    x = DATA[data](rng, lead + (d,))
    assert_encode_matches(x, group_size=group_size, clip_ratio=clip_ratio, levels=levels)


@pytest.mark.parametrize("levels", ["minmax", "moments"])
def test_golden_vectors(levels):
    # FORMAT.md worked example: x = −8 … 7, c = 1, G = 16 (both encoders give the same bytes).
    packed, scale, minimum = ops.encode(np.arange(-8, 8, dtype=F32), group_size=16, clip_ratio=1.0, levels=levels)
    assert np.asarray(packed).tolist() == [0xA4, 0xE4, 0xE4, 0xE5]
    assert np.asarray(scale).tolist() == [5.0] and np.asarray(minimum).tolist() == [-8.0]


def test_golden_clip():
    # d = 16, c = 0.9 → k = 14: τ = 50, so 100 → 50 (shared_math/tests/test_codec.py).
    x = np.zeros(16, F32)
    x[14], x[15] = 100.0, -50.0
    packed, scale, minimum = ops.encode(x, group_size=16, clip_ratio=0.9)
    assert np.asarray(packed).tolist() == [0x55, 0x55, 0xD5, 0x15]
    assert np.asarray(scale).tolist() == [33.34375] and np.asarray(minimum).tolist() == [-50.0]


@pytest.mark.parametrize("clip_ratio", [0.05, 0.5, 0.92, 0.96, 1.0])
def test_order_statistic_methods_agree_with_sort(clip_ratio):
    """Every exact order statistic equals the sorted value and gives shared_math's bytes."""
    d = 64
    x = order_statistic_rows(d)
    k = clip_index(clip_ratio, d)
    sanitized = ref.sanitize(x)
    want = np.sort(np.abs(sanitized), axis=-1)[:, k : k + 1].view(np.int32)
    abs_bits = jnp.asarray(np.abs(sanitized).view(np.int32))
    for method in kcodec.ORDER_STATISTICS:
        got = jax.jit(
            functools.partial(kcodec.clip_threshold_bits, clip_index=k, order_statistic=method)
        )(abs_bits)
        assert_same_bits(got, want, method)
        packed, scale, minimum = kcodec.encode_rows(
            jnp.asarray(x, jnp.bfloat16), group_size=32, clip_index=k, levels="minmax", order_statistic=method
        )
        for name, a, e in zip(("packed", "scale", "minimum"), (packed, scale, minimum),
                              ref.encode(x, group_size=32, clip_ratio=clip_ratio)):
            assert_same_bits(a, e, f"{name} {method}")


@pytest.mark.parametrize("ties", ["none", "one_row"])
def test_checked_max_fast_path_and_fallback(ties):
    """checked_max on float32 rows: tie-free blocks keep the max rounds' value; a block with one
    row whose largest values tie falls back to max_drop, the other blocks do not care."""
    x, k = checked_max_rows(ties == "one_row"), clip_index(0.96, 128)
    want = ref.encode(x, group_size=128, clip_ratio=0.96)
    got = kcodec.encode_rows(jnp.asarray(x), group_size=128, clip_index=k, levels="minmax",
                             order_statistic="checked_max")
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        assert_same_bits(a, e, name)


def test_default_order_statistic_choice():
    assert kcodec.select_order_statistic(128, clip_index(0.96, 128), rows_bf16=False) == "checked_max"
    assert kcodec.select_order_statistic(128, clip_index(0.92, 128), rows_bf16=True) == "tagged_max"
    assert kcodec.select_order_statistic(128, clip_index(0.5, 128), rows_bf16=True) == "bisect"
    assert kcodec.select_order_statistic(64, clip_index(1.0, 64), rows_bf16=False) == "checked_max"
    assert kcodec.resolve_order_statistic(None, 128, clip_index(0.96, 128), jnp.bfloat16) == "tagged_max"
    assert kcodec.resolve_order_statistic(None, 128, clip_index(0.96, 128), jnp.bfloat16, rotated=True) \
        == "checked_max"
    with pytest.raises(ValueError, match="tagged_max.*float32"):
        kcodec.resolve_order_statistic("tagged_max", 128, 122, jnp.float32)
    with pytest.raises(ValueError, match="rotated"):
        kcodec.resolve_order_statistic("tagged_max", 128, 122, jnp.bfloat16, rotated=True)
    with pytest.raises(ValueError, match="sorting"):
        kcodec.resolve_order_statistic("sorting", 128, 122, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, np.float64, np.int32, np.int64])
def test_input_dtypes_encode_their_float32_values(dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 64)) * 40).astype(np.float32)
    if np.issubdtype(np.dtype(dtype), np.integer):
        x = np.round(x).astype(dtype)
        x.reshape(-1)[:3] = [2**24 + 1, -(2**24) - 3, 123456789]  # not representable in float32
    elif dtype == np.float64:
        x = x.astype(np.float64) + 1e-9  # rounds to float32 on the host
    else:
        x = jnp.asarray(x).astype(dtype)
    expected = np.asarray(x, dtype=np.float64).astype(np.float32) if not isinstance(x, jax.Array) \
        else np.asarray(x.astype(jnp.float32))
    assert_encode_matches(x, group_size=32, clip_ratio=0.96, levels="minmax", expected_input=expected)


def test_mixed_signed_zero_extremes_differ_only_in_the_sign_of_zero():
    """The one documented divergence: a group whose min (or max) is a zero and that holds both
    +0 and −0. numpy's min/max reduction returns a SIMD-lane-dependent zero there; the kernel
    returns −0 for the minimum (IEEE 754-2019 ordering). Codes and every value are equal."""
    x = np.full((1, 16), 2.0, F32)
    x[0, 3], x[0, 9] = -0.0, 0.0
    packed, scale, minimum = ops.encode(x, group_size=16, clip_ratio=1.0)
    rp, rs, rm = ref.encode(x, group_size=16, clip_ratio=1.0)
    assert_same_bits(packed, rp, "packed")
    assert_same_bits(scale, rs, "scale")
    assert np.asarray(minimum).tolist() == rm.tolist() == [[0.0]]  # equal values …
    assert np.signbit(np.asarray(minimum)).all()  # … and the kernel's zero is −0


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float32, (4, 32), elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
    clip_ratio=st.sampled_from([0.5, 0.96, 1.0]),
    levels=st.sampled_from(["minmax", "moments"]),
)
def test_encode_total_property(x, clip_ratio, levels):
    # −0 → +0: mixed-signed zeros are the documented divergence above (the spec's, not ours).
    x = x + F32(0)
    assert_encode_matches(x, group_size=16, clip_ratio=clip_ratio, levels=levels)


# ------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("d,group_size,lead", [(16, 16, (1,)), (64, 32, (3, 5)), (128, 64, (17,)), (128, 128, (40,))])
def test_decode_bit_identical(d, group_size, lead):
    rng = np.random.default_rng(d + group_size)
    packed = rng.integers(0, 256, size=lead + (d // 4,), dtype=np.uint8)
    meta_shape = lead + (d // group_size,)
    # finite float16 metadata of all kinds: normal, subnormal, ±0, ±65504
    scale = rng.choice(np.array([0.0, 6e-8, 1e-5, 0.0132, 1.0, 333.0, 65504.0], np.float16), meta_shape)
    minimum = (rng.standard_normal(meta_shape) * 10).astype(np.float16)
    special = np.array([-0.0, -65504.0, 6e-8], np.float16)
    minimum.reshape(-1)[: special.size] = special[: minimum.size]
    got = ops.decode(packed, scale, minimum, group_size=group_size)
    assert_same_bits(got, ref.decode(packed, scale, minimum, group_size=group_size), "decode")


def test_round_trip_equals_reference_round_trip():
    rng = np.random.default_rng(11)
    x = heavy_tailed_rows(rng, (3, 7, 128))
    packed, scale, minimum = ops.encode(x, group_size=64, clip_ratio=0.92, levels="moments")
    want = ref.decode(*ref.encode(x, group_size=64, clip_ratio=0.92, levels="moments"), group_size=64)
    assert_same_bits(ops.decode(packed, scale, minimum, group_size=64), want, "round trip")


def test_ops_are_jittable_and_deterministic():
    rng = np.random.default_rng(5)
    x = jnp.asarray(normal_rows(rng, (6, 64)))
    enc = jax.jit(functools.partial(ops.encode, group_size=32, clip_ratio=0.96))
    dec = jax.jit(functools.partial(ops.decode, group_size=32))
    first = enc(x)
    for a, b in zip(first, enc(x)):
        assert_same_bits(a, b, "run twice")
    for a, e in zip(first, ref.encode(np.asarray(x), group_size=32, clip_ratio=0.96)):
        assert_same_bits(a, e, "jit")
    assert_same_bits(dec(*first), ops.decode(*first, group_size=32), "decode under jit")


def test_empty_leading_dims():
    packed, scale, minimum = ops.encode(np.zeros((0, 3, 64), F32), group_size=32, clip_ratio=0.96)
    assert packed.shape == (0, 3, 16) and scale.shape == minimum.shape == (0, 3, 2)
    assert ops.decode(packed, scale, minimum, group_size=32).shape == (0, 3, 64)


def test_interpret_default_follows_the_backend():
    assert kcodec.resolve_interpret(None) == (jax.default_backend() == "cpu")
    assert kcodec.resolve_interpret(True) is True and kcodec.resolve_interpret(False) is False


# ------------------------------------------------------------------------------- bad inputs

GOOD = np.zeros((2, 64), F32)
PACKED, SCALE = np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.float16)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.encode(GOOD.astype(np.complex64), group_size=32, clip_ratio=0.9), "dtype complex64"),
        (lambda: ops.encode(GOOD.astype(bool), group_size=32, clip_ratio=0.9), "dtype bool"),
        (lambda: ops.encode(np.float32(1.0), group_size=16, clip_ratio=0.9), "at least one axis"),
        (lambda: ops.encode(np.zeros((2, 48), F32), group_size=16, clip_ratio=0.9), "head_dim=48"),
        (lambda: ops.encode(np.zeros((2, 8), F32), group_size=8, clip_ratio=0.9), "head_dim=8"),
        (lambda: ops.encode(GOOD, group_size=24, clip_ratio=0.9), "group_size=24"),
        (lambda: ops.encode(GOOD, group_size=128, clip_ratio=0.9), "group_size=128"),
        (lambda: ops.encode(GOOD, group_size=8, clip_ratio=0.9), "group_size=8"),
        (lambda: ops.encode(GOOD, group_size=32, clip_ratio=0.0), "clip_ratio=0.0"),
        (lambda: ops.encode(GOOD, group_size=32, clip_ratio=1.5), "clip_ratio=1.5"),
        (lambda: ops.encode(GOOD, group_size=32, clip_ratio=0.9, levels="lloyd"), "levels='lloyd'"),
        (lambda: ops.decode(PACKED.astype(np.int8), SCALE, SCALE, group_size=32), "packed must be uint8"),
        (lambda: ops.decode(PACKED, SCALE.astype(F32), SCALE, group_size=32), "scale must be float16"),
        (lambda: ops.decode(PACKED, SCALE, SCALE.astype(F32), group_size=32), "minimum must be float16"),
        (lambda: ops.decode(PACKED, SCALE[:, :1], SCALE, group_size=32), r"scale has shape \(2, 1\)"),
        (lambda: ops.decode(PACKED, SCALE, SCALE[:1], group_size=32), r"minimum has shape \(1, 2\)"),
        (lambda: ops.decode(PACKED[:, :12], SCALE, SCALE, group_size=16), "head_dim=48"),
        (lambda: ops.decode(PACKED, SCALE, SCALE, group_size=48), "group_size=48"),
        (lambda: ops.decode(np.uint8(3), SCALE, SCALE, group_size=16), "at least one axis"),
    ],
)
def test_bad_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------- encode by planes


def encode_planes_in_a_kernel(x, *, clip_index, rows_bf16, block_rows=32):
    """encode_planes as the kernels run it (a Pallas kernel body; XLA:GPU compiling the jnp function
    outside one gave other bytes for some rows in the v24 GPU run): rows x [N, D], N a multiple of
    block_rows → packed, scale, minimum, exact [N, 1]."""
    rows, d = x.shape
    quarter = d // 4

    def kernel(x_ref, packed_ref, scale_ref, minimum_ref, exact_ref):
        planes = [jax.lax.bitcast_convert_type(p, jnp.int32) for p in kcodec.load_planes(x_ref, None)]
        packed, scale, minimum, exact = kcodec.encode_planes(planes, clip_index=clip_index, rows_bf16=rows_bf16)
        packed_ref[...] = packed
        scale_ref[...] = scale
        minimum_ref[...] = minimum
        exact_ref[...] = exact.astype(jnp.int32)

    block = lambda width: pl.BlockSpec((block_rows, width), lambda i: (i, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(rows // block_rows,),
        in_specs=[block(d)],
        out_specs=[block(quarter), block(1), block(1), block(1)],
        out_shape=[jax.ShapeDtypeStruct((rows, quarter), jnp.uint8), jax.ShapeDtypeStruct((rows, 1), jnp.float16),
                   jax.ShapeDtypeStruct((rows, 1), jnp.float16), jax.ShapeDtypeStruct((rows, 1), jnp.int32)],
        interpret=kcodec.resolve_interpret(None),
    )(jnp.asarray(x))


@pytest.mark.parametrize("clip_ratio", [0.96, 0.92, pytest.param(0.5, marks=pytest.mark.slow)])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16_rows", "f32_rows"])
def test_encode_planes_is_exact_where_it_says_so(bf16, clip_ratio):
    """encode_planes in a kernel: every row it calls exact has shared_math's bytes (all data kinds,
    NaN/Inf/huge/subnormal/zeros included), it takes the rows it is for and declines each condition
    it cannot meet — the cases of the torch backend's test."""
    x, should_take = encode_planes_rows(bf16)
    k = clip_index(clip_ratio, 128)
    padded = np.zeros((-(-len(x) // 32) * 32, 128), F32)  # whole blocks; the zero rows are not checked
    padded[: len(x)] = x
    outputs = encode_planes_in_a_kernel(padded, clip_index=k, rows_bf16=bf16)
    packed, scale, minimum, exact = (np.asarray(a)[: len(x)] for a in outputs)
    exact = exact[:, 0] == 1
    want = ref.encode(x, group_size=128, clip_ratio=clip_ratio)
    for name, a, e in zip(("packed", "scale", "minimum"), (packed, scale, minimum), want):
        assert_same_bits(np.asarray(a)[exact], e[exact], f"{name} of the rows called exact")
    assert not (should_take & ~exact).any(), f"declined rows it is for: {np.flatnonzero(should_take & ~exact)}"
    if clip_ratio == 0.96:
        assert not exact[-16:][: 6 if bf16 else 7].any(), "took a row it cannot encode exactly"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_encode_rows_by_planes_bit_identical(dtype):
    """encode_rows(planes=True) in a kernel: blocks of ordinary rows by planes, blocks holding a
    row that encode_planes declines by encode_block (lax.cond), a partial last block: shared_math's
    bytes."""
    rng = np.random.default_rng(31)
    x = np.concatenate([DATA[name](rng, (13, 128)) for name in sorted(DATA)] + [normal_rows(rng, (50, 128))])
    x = jnp.asarray(x.astype(np.float32)).astype(dtype)
    for clip_ratio in (0.96, 0.92):
        want = ref.encode(np.asarray(x.astype(jnp.float32)), group_size=128, clip_ratio=clip_ratio)
        got = kcodec.encode_rows(x, group_size=128, clip_index=clip_index(clip_ratio, 128), levels="minmax",
                                 block_rows=16, planes=True)
        for name, a, e in zip(("packed", "scale", "minimum"), got, want):
            assert_same_bits(np.asarray(a), e, f"{name} c={clip_ratio}")


def test_encode_rows_by_planes_needs_one_group_and_minmax():
    x = jnp.zeros((4, 128), jnp.float32)
    with pytest.raises(ValueError, match="group_size=64, head_dim=128"):
        kcodec.encode_rows(x, group_size=64, clip_index=122, levels="minmax", planes=True)
    with pytest.raises(ValueError, match="levels='moments'"):
        kcodec.encode_rows(x, group_size=128, clip_index=122, levels="moments", planes=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16_rows", "f32_rows"])
def test_encode_by_planes_compiles_for_h200_and_runs_fewer_instructions(dtype):
    """The Pallas encode with planes, lowered and compiled for sm_90 on the CPU (interpret mode
    applies no GPU lowering rule): no spills, and on the path a block that takes encode_planes runs
    (the shortest way through the SASS: lax.cond's fallback is jumped over) at most 60 % of the
    ALU-pipe instructions an element of encode_block at its shipped 16 rows (NOTES v23: 0.41 bf16,
    0.44 float32)."""
    pytest.importorskip("triton")
    from benchmarks.static_analysis import compile_pallas_for_h200, sass, shortest_path_profile

    alu_per_element = {}
    for planes, rows in ((False, 16), (True, 32)):
        fn = functools.partial(kcodec.encode_rows, group_size=128, clip_index=122, levels="minmax", block_rows=rows,
                               planes=planes, interpret=False)
        (usage,) = compile_pallas_for_h200(fn, jax.ShapeDtypeStruct((4096, 128), dtype)).values()
        assert usage["spills"] == 0 and 0 < usage["registers"] <= 255, usage
        path = shortest_path_profile(sass(usage["compiled"].asm["cubin"]))
        alu_per_element[planes] = path["alu"] * usage["num_warps"] * 32 / (rows * 128)
    assert alu_per_element[True] <= 0.6 * alu_per_element[False], alu_per_element


def test_encode_by_planes_falls_back_only_where_a_row_declines():
    """Which path a block takes: encode_planes_or_block with `load_rows` giving zeros, so that
    a fallback shows — a block of N(0, 1) rows has shared_math's bytes (encode_planes), a block
    holding a NaN row, or a masked-out row only among N(0, 1) rows, as the masks say."""
    x = np.random.default_rng(3).standard_normal((16, 128)).astype(F32)
    zeros = jnp.zeros((16, 128), jnp.float32)
    kw = dict(planes=True, rows_bf16=False, group_size=128, clip_index=122, levels="minmax",
              order_statistic="checked_max")

    def encode(rows, mask=None):
        planes = [jnp.asarray(p) for p in np.split(rows, 4, axis=1)]
        return jax.jit(lambda: kcodec.encode_planes_or_block(lambda: planes, lambda: zeros, mask, **kw))()

    want = ref.encode(x, group_size=128, clip_ratio=0.96)
    for name, a, e in zip(("packed", "scale", "minimum"), encode(x), want):
        assert_same_bits(np.asarray(a), e, f"{name} (planes)")
    declined = x.copy()
    declined[5, 7] = np.nan
    fallback = ref.encode(np.zeros((16, 128), F32), group_size=128, clip_ratio=0.96)
    for name, a, e in zip(("packed", "scale", "minimum"), encode(declined), fallback):
        assert_same_bits(np.asarray(a), e, f"{name} (a NaN row: encode_block)")
    masked = jnp.asarray(np.arange(16)[:, None] != 5)  # the NaN row does not exist: planes again
    for name, a, e in zip(("packed", "scale", "minimum"), encode(declined, masked), want):
        assert_same_bits(np.asarray(a)[np.arange(16) != 5], e[np.arange(16) != 5], f"{name} (masked NaN row)")
