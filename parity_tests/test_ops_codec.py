"""encode / decode of every implementation against shared_math.codec, bit for bit (format v1): one
suite for oscar_jax (Pallas kernels, XLA path) and oscar_torch (Triton kernels).

The public ops run on the `backend` fixture (jax, xla, torch), the kernel sets' encode launcher and
block bodies on `kernel_backend` (jax, torch); numpy in and out through parity_tests.backends. On
CPU the kernels run interpreted; with OSCAR_TEST_GPU=1 on a GPU machine, compiled. The codec bytes
of parity_tests.cases.CODEC_CASES (real model shapes × every data kind × both encoders) are
test_parity.py's; this suite adds a seeded sample of (d, G, c, levels, leading shape), the FORMAT.md
worked examples, the input dtypes, a property test, decode, and the error paths common to both
frameworks. Framework-only behaviour stays in each backend's tests (jit, interpret defaults, torch
devices and strides, compile checks).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import torch
from jax.experimental import pallas as pl

from oscar_jax.kernels import codec as jax_kcodec
from oscar_torch.kernels import codec as torch_kcodec

from parity_tests import backends
from parity_tests.cases import (DATA, LEVELS, assert_same_bits, bf16_bits, bf16_values, checked_max_rows,
                                encode_planes_rows, heavy_tailed_rows, normal_rows, order_statistic_rows)
from shared_math import codec as ref
from shared_math.spec import clip_index

F32 = np.float32
ARRAYS = ("packed", "scale", "minimum")


def assert_encode_matches(backend, x, *, group_size, clip_ratio, levels, expected_input=None, what=""):
    got = backends.encode(backend, x, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    want = ref.encode(x if expected_input is None else expected_input, group_size=group_size,
                      clip_ratio=clip_ratio, levels=levels)
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(a, e, f"{backend} {what} {name} d={np.shape(x)[-1]} G={group_size} c={clip_ratio} {levels}")
    return got


# ------------------------------------------------------------------------------------- encode


def _sampled_cases():
    """A seeded sample of the product (d, G, c, levels, leading shape)."""
    rng = np.random.default_rng(2024)
    shapes = [(1,), (3,), (17,), (2, 3, 5), (40,)]
    cases = []
    for d, group_size in [(16, 16), (64, 16), (64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]:
        for levels in LEVELS:
            clip_ratio = [0.5, 0.92, 0.96, 1.0][rng.integers(4)]
            lead = shapes[rng.integers(len(shapes))]
            cases.append((d, group_size, clip_ratio, levels, lead))
    return cases


@pytest.mark.parametrize("d,group_size,clip_ratio,levels,lead", _sampled_cases())
def test_encode_bit_identical(kernel_backend, d, group_size, clip_ratio, levels, lead):
    """Every data kind (parity_tests.cases.DATA: normal, heavy-tailed, ties, NaN/Inf/huge/subnormal
    with both zeros in a group, tiny), each drawn from the shape's seed, in one launch. The kernels
    only: the XLA path compiles each shape anew, and its bytes of every data kind are
    test_parity.py's (CODEC_CASES)."""
    backend = kernel_backend
    kinds = sorted(DATA)
    x = np.stack([DATA[kind](np.random.default_rng(d * 7 + group_size + len(lead)), lead + (d,)) for kind in kinds])
    got = backends.encode(backend, x, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    want = ref.encode(x, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    for i, kind in enumerate(kinds):
        for name, a, e in zip(ARRAYS, got, want):
            assert_same_bits(a[i], e[i], f"{backend} {kind} {name} d={d} G={group_size} c={clip_ratio} {levels}")


@pytest.mark.parametrize("levels", LEVELS)
def test_golden_vectors(backend, levels):
    # FORMAT.md worked example: x = −8 … 7, c = 1, G = 16 (both encoders give the same bytes).
    packed, scale, minimum = backends.encode(backend, np.arange(-8, 8, dtype=F32), group_size=16, clip_ratio=1.0,
                                             levels=levels)
    assert packed.tolist() == [0xA4, 0xE4, 0xE4, 0xE5]
    assert scale.tolist() == [5.0] and minimum.tolist() == [-8.0]


def test_golden_clip(backend):
    # d = 16, c = 0.9 → k = 14: τ = 50, so 100 → 50 (shared_math/tests/test_codec.py).
    x = np.zeros(16, F32)
    x[14], x[15] = 100.0, -50.0
    packed, scale, minimum = backends.encode(backend, x, group_size=16, clip_ratio=0.9)
    assert packed.tolist() == [0x55, 0x55, 0xD5, 0x15]
    assert scale.tolist() == [33.34375] and minimum.tolist() == [-50.0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64", "int32", "int64"])
def test_input_dtypes_encode_their_float32_values(backend, dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 64)) * 40).astype(F32)
    if dtype == "bfloat16":
        x = bf16_bits(x)  # the backends take uint16 as bfloat16 bit patterns
        expected = bf16_values(x)
    else:
        if dtype.startswith("int"):
            x = np.round(x).astype(dtype)
            x.reshape(-1)[:3] = [2**24 + 1, -(2**24) - 3, 123456789]  # not representable in float32
        elif dtype == "float64":
            x = x.astype(np.float64) + 1e-9  # rounds to float32 on the way in
        else:
            x = x.astype(dtype)
        expected = np.asarray(x, np.float64).astype(F32)
    assert_encode_matches(backend, x, group_size=32, clip_ratio=0.96, levels="minmax", expected_input=expected)


def test_group_holding_both_zeros_has_minimum_minus_zero(backend):
    """FORMAT.md step 3: −0 orders below +0 (IEEE 754-2019 minimum/maximum), so a group whose
    extreme is a zero and that holds both zeros has lo = −0, hi = +0; bytes equal shared_math."""
    x = np.full((2, 16), 2.0, F32)
    x[:, 3], x[:, 9] = -0.0, 0.0
    x[1] = -x[1]  # maximum is the zero: hi = +0
    _, _, minimum = assert_encode_matches(backend, x, group_size=16, clip_ratio=1.0, levels="minmax")
    assert minimum[:1].tolist() == [[0.0]] and np.signbit(minimum[0]).all()  # the minimum is −0


# `backend` is a name (a str): nothing of it to reset between examples.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    x=hnp.arrays(np.float32, (4, 32), elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
    clip_ratio=st.sampled_from([0.5, 0.96, 1.0]),
    levels=st.sampled_from(LEVELS),
)
def test_encode_total_property(backend, x, clip_ratio, levels):
    assert_encode_matches(backend, x, group_size=16, clip_ratio=clip_ratio, levels=levels)


def test_encode_is_deterministic_and_handles_empty_rows(backend):
    x = DATA["heavy"](np.random.default_rng(5), (6, 64))
    first = backends.encode(backend, x, group_size=32, clip_ratio=0.96, levels="moments")
    for name, a, b in zip(ARRAYS, first, backends.encode(backend, x, group_size=32, clip_ratio=0.96, levels="moments")):
        assert_same_bits(a, b, f"{name} run twice")
    packed, scale, minimum = backends.encode(backend, np.zeros((0, 3, 64), F32), group_size=32, clip_ratio=0.96)
    assert packed.shape == (0, 3, 16) and scale.shape == minimum.shape == (0, 3, 2)
    assert backends.decode(backend, packed, scale, minimum, group_size=32).shape == (0, 3, 64)


# ------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("d,group_size,lead", [(16, 16, (1,)), (64, 32, (3, 5)), (64, 64, (21, 3)), (128, 32, (5,)),
                                                (128, 64, (17,)), (128, 128, (40,))])
def test_decode_bit_identical(backend, d, group_size, lead):
    """Random codes and float16 metadata of every kind, bytes of shared_math's decode; (d, G) of
    the codec cases and more."""
    rng = np.random.default_rng(d + group_size)
    packed = rng.integers(0, 256, size=lead + (d // 4,), dtype=np.uint8)
    meta_shape = lead + (d // group_size,)
    # finite float16 metadata of all kinds: normal, subnormal, ±0, ±65504
    scale = rng.choice(np.array([0.0, 6e-8, 1e-5, 0.0132, 1.0, 333.0, 65504.0], np.float16), meta_shape)
    minimum = (rng.standard_normal(meta_shape) * 10).astype(np.float16)
    special = np.array([-0.0, -65504.0, 6e-8], np.float16)
    minimum.reshape(-1)[: special.size] = special[: minimum.size]
    got = backends.decode(backend, packed, scale, minimum, group_size=group_size)
    assert_same_bits(got, ref.decode(packed, scale, minimum, group_size=group_size), "decode")


def test_round_trip_equals_reference_round_trip(backend):
    x = heavy_tailed_rows(np.random.default_rng(11), (3, 7, 128))
    encoded = backends.encode(backend, x, group_size=64, clip_ratio=0.92, levels="moments")
    want = ref.decode(*ref.encode(x, group_size=64, clip_ratio=0.92, levels="moments"), group_size=64)
    assert_same_bits(backends.decode(backend, *encoded, group_size=64), want, "round trip")


# ------------------------------------------------------------------------------- bad inputs

GOOD = np.zeros((2, 64), F32)
PACKED, SCALE = np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.float16)


def _encode(x, **kwargs):
    return lambda backend: backends.encode(backend, x, **kwargs)


def _decode(packed, scale, minimum, **kwargs):
    return lambda backend: backends.decode(backend, packed, scale, minimum, **kwargs)


@pytest.mark.parametrize(
    "call,match",
    [
        (_encode(GOOD.astype(np.complex64), group_size=32, clip_ratio=0.9), "dtype complex64"),
        (_encode(GOOD.astype(bool), group_size=32, clip_ratio=0.9), "dtype bool"),
        (_encode(np.float32(1.0), group_size=16, clip_ratio=0.9), "at least one axis"),
        (_encode(np.zeros((2, 48), F32), group_size=16, clip_ratio=0.9), "head_dim=48"),
        (_encode(np.zeros((2, 8), F32), group_size=8, clip_ratio=0.9), "head_dim=8"),
        (_encode(GOOD, group_size=24, clip_ratio=0.9), "group_size=24"),
        (_encode(GOOD, group_size=128, clip_ratio=0.9), "group_size=128"),
        (_encode(GOOD, group_size=8, clip_ratio=0.9), "group_size=8"),
        (_encode(GOOD, group_size=32, clip_ratio=0.0), "clip_ratio=0.0"),
        (_encode(GOOD, group_size=32, clip_ratio=1.5), "clip_ratio=1.5"),
        (_encode(GOOD, group_size=32, clip_ratio="0.9"), "clip_ratio='0.9'"),
        (_encode(GOOD, group_size=32, clip_ratio=0.9, levels="lloyd"), "levels='lloyd'"),
        (_decode(PACKED.astype(np.int8), SCALE, SCALE, group_size=32),
         {"jax": "packed must be uint8", "torch": "packed must have dtype uint8"}),
        (_decode(PACKED, SCALE.astype(F32), SCALE, group_size=32),
         {"jax": "scale must be float16", "torch": "scale must have dtype float16"}),
        (_decode(PACKED, SCALE, SCALE.astype(F32), group_size=32),
         {"jax": "minimum must be float16", "torch": "minimum must have dtype float16"}),
        (_decode(PACKED, SCALE[:, :1], SCALE, group_size=32), r"scale has shape \(2, 1\)"),
        (_decode(PACKED, SCALE, SCALE[:1], group_size=32), r"minimum has shape \(1, 2\)"),
        (_decode(PACKED[:, :12], SCALE, SCALE, group_size=16), "head_dim=48"),
        (_decode(PACKED, SCALE, SCALE, group_size=48), "group_size=48"),
        (_decode(np.uint8(3), SCALE, SCALE, group_size=16), "at least one axis"),
    ],
)
def test_bad_inputs_raise_value_error(backend, call, match):
    if isinstance(match, dict):
        match = match["torch" if backend == "torch" else "jax"]
    with pytest.raises(ValueError, match=match):
        call(backend)


# ------------------------------------------------------------------- the kernels' order statistics


@pytest.mark.parametrize("clip_ratio", [0.05, 0.5, 0.92, 0.96, 1.0])
def test_order_statistic_methods_agree_with_sort(kernel_backend, clip_ratio):
    """Every exact order statistic gives the sorted value's bytes (bfloat16 rows, so that
    tagged_max applies; the values are bfloat16-exact, so every method sees the same rows)."""
    d = 64
    x = order_statistic_rows(d)
    k = clip_index(clip_ratio, d)
    want = ref.encode(x, group_size=32, clip_ratio=clip_ratio)
    for method in backends.kernel_codec(kernel_backend).ORDER_STATISTICS:
        got = backends.encode_rows(kernel_backend, bf16_bits(x), group_size=32, clip_index=k, levels="minmax",
                                   order_statistic=method)
        for name, a, e in zip(ARRAYS, got, want):
            assert_same_bits(a, e, f"{name} {method}")


@pytest.mark.parametrize("ties", ["none", "one_row"])
def test_checked_max_fast_path_and_fallback(kernel_backend, ties):
    """checked_max on float32 rows: tie-free blocks keep the max rounds' value; a block with one
    row whose largest values tie falls back to max_drop, the other blocks do not care."""
    x, k = checked_max_rows(ties == "one_row"), clip_index(0.96, 128)
    want = ref.encode(x, group_size=128, clip_ratio=0.96)
    got = backends.encode_rows(kernel_backend, x, group_size=128, clip_index=k, levels="minmax",
                               order_statistic="checked_max")
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(a, e, name)


def test_default_order_statistic_choice(kernel_backend):
    kcodec = backends.kernel_codec(kernel_backend)
    bf16, f32 = (backends.rows_dtype_of(kernel_backend, name) for name in ("bfloat16", "float32"))
    assert kcodec.select_order_statistic(128, clip_index(0.96, 128), rows_bf16=False) == "checked_max"
    assert kcodec.select_order_statistic(128, clip_index(0.92, 128), rows_bf16=True) == "tagged_max"
    assert kcodec.select_order_statistic(128, clip_index(0.5, 128), rows_bf16=True) == "bisect"
    assert kcodec.select_order_statistic(64, clip_index(1.0, 64), rows_bf16=False) == "checked_max"
    assert kcodec.resolve_order_statistic(None, 128, clip_index(0.96, 128), bf16) == "tagged_max"
    assert kcodec.resolve_order_statistic(None, 128, clip_index(0.96, 128), bf16, rotated=True) == "checked_max"
    with pytest.raises(ValueError, match="tagged_max.*float32"):
        kcodec.resolve_order_statistic("tagged_max", 128, 122, f32)
    with pytest.raises(ValueError, match="rotated"):
        kcodec.resolve_order_statistic("tagged_max", 128, 122, bf16, rotated=True)
    with pytest.raises(ValueError, match="sorting"):
        kcodec.resolve_order_statistic("sorting", 128, 122, f32)


# ------------------------------------------------------------------------- encode by planes


def _encode_planes_in_a_pallas_kernel(x, *, clip_index, rows_bf16, block_rows=32):
    """encode_planes as the Pallas kernels run it (in a kernel body; XLA:GPU compiling the jnp
    function outside one gave other bytes for some rows in a GPU run): rows x [N, D] → packed,
    scale, minimum [N, ·] and exact [N] (bool), the rows padded with zeros to whole blocks."""
    n, d = x.shape
    rows = -(-n // block_rows) * block_rows
    padded = np.zeros((rows, d), F32)
    padded[:n] = x
    quarter = d // 4

    def kernel(x_ref, packed_ref, scale_ref, minimum_ref, exact_ref):
        planes = [jax.lax.bitcast_convert_type(p, jnp.int32) for p in jax_kcodec.load_planes(x_ref, None)]
        packed, scale, minimum, exact = jax_kcodec.encode_planes(planes, clip_index=clip_index, rows_bf16=rows_bf16)
        packed_ref[...] = packed
        scale_ref[...] = scale
        minimum_ref[...] = minimum
        exact_ref[...] = exact.astype(jnp.int32)

    block = lambda width: pl.BlockSpec((block_rows, width), lambda i: (i, 0))  # noqa: E731
    outputs = pl.pallas_call(
        kernel,
        grid=(rows // block_rows,),
        in_specs=[block(d)],
        out_specs=[block(quarter), block(1), block(1), block(1)],
        out_shape=[jax.ShapeDtypeStruct((rows, quarter), jnp.uint8), jax.ShapeDtypeStruct((rows, 1), jnp.float16),
                   jax.ShapeDtypeStruct((rows, 1), jnp.float16), jax.ShapeDtypeStruct((rows, 1), jnp.int32)],
        interpret=jax_kcodec.resolve_interpret(None),
    )(jnp.asarray(padded))
    packed, scale, minimum, exact = (np.asarray(a)[:n] for a in outputs)
    return packed, scale, minimum, exact[:, 0] == 1


@triton.jit
def _encode_planes_probe(x_ptr, packed_ptr, scale_ptr, minimum_ptr, exact_ptr, CLIP_INDEX: tl.constexpr,
                         D: tl.constexpr, ROWS: tl.constexpr, ROWS_BF16: tl.constexpr):
    """encode_planes on ROWS rows of float32 x, with its per-row `exact` claim (no fallback)."""
    Q: tl.constexpr = D // 4
    row = tl.arange(0, ROWS)[:, None]
    plane = x_ptr + row * D + tl.arange(0, Q)[None, :]
    packed, scale, minimum, exact = torch_kcodec.encode_planes(
        tl.load(plane).to(tl.int32, bitcast=True), tl.load(plane + Q).to(tl.int32, bitcast=True),
        tl.load(plane + 2 * Q).to(tl.int32, bitcast=True), tl.load(plane + 3 * Q).to(tl.int32, bitcast=True),
        CLIP_INDEX, ROWS_BF16)
    tl.store(packed_ptr + row * Q + tl.arange(0, Q)[None, :], packed.to(tl.uint8))
    tl.store(scale_ptr + row, scale)
    tl.store(minimum_ptr + row, minimum)
    tl.store(exact_ptr + row, exact.to(tl.int32))


def _encode_planes_in_a_triton_kernel(x, *, clip_index, rows_bf16):
    """encode_planes in one Triton program: rows x [N, 128] → packed, scale, minimum [N, ·] and
    exact [N] (bool), the rows padded with ones to a power of two."""
    n, d = x.shape
    rows = 1 << (n - 1).bit_length()
    padded = np.concatenate([x, np.ones((rows - n, d), F32)])
    device = backends.TORCH_DEVICE
    packed = torch.empty((rows, d // 4), dtype=torch.uint8, device=device)
    scale, minimum = (torch.empty((rows, 1), dtype=torch.float16, device=device) for _ in range(2))
    exact = torch.empty(rows, dtype=torch.int32, device=device)
    _encode_planes_probe[(1,)](backends.to_torch(padded), packed, scale, minimum, exact, CLIP_INDEX=clip_index, D=d,
                               ROWS=rows, ROWS_BF16=rows_bf16)
    packed, scale, minimum, exact = (backends.from_torch(a)[:n] for a in (packed, scale, minimum, exact))
    return packed, scale, minimum, exact.astype(bool)


ENCODE_PLANES = {"jax": _encode_planes_in_a_pallas_kernel, "torch": _encode_planes_in_a_triton_kernel}


@pytest.mark.parametrize("kernel_backend,clip_ratio", [
    ("jax", 0.96), ("jax", 0.92), pytest.param("jax", 0.5, marks=pytest.mark.slow),
    ("torch", 0.96), ("torch", 0.92), ("torch", 0.5)])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16_rows", "f32_rows"])
def test_encode_planes_is_exact_where_it_says_so(kernel_backend, bf16, clip_ratio):
    """encode_planes on its own, in a kernel: every row it calls exact has shared_math's bytes (all
    data kinds, NaN/Inf/huge/subnormal/zeros included), and it takes the rows it is for (N(0, 1)-like
    rows, ties between bfloat16 values) while declining each condition it cannot meet."""
    x, should_take = encode_planes_rows(bf16)
    packed, scale, minimum, exact = ENCODE_PLANES[kernel_backend](x, clip_index=clip_index(clip_ratio, 128),
                                                                  rows_bf16=bf16)
    want = ref.encode(x, group_size=128, clip_ratio=clip_ratio)
    for name, a, e in zip(ARRAYS, (packed, scale, minimum), want):
        assert_same_bits(a[exact], e[exact], f"{name} of the rows called exact")
    declined = should_take & ~exact
    assert not declined.any(), f"declined rows it is for: {np.flatnonzero(declined)}"
    if clip_ratio == 0.96:
        assert not exact[-16:][: 6 if bf16 else 7].any(), "took a row it cannot encode exactly"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"], ids=["bf16", "f32"])
def test_encode_rows_by_planes_bit_identical(kernel_backend, dtype):
    """encode_rows(planes=True): blocks of ordinary rows by planes, blocks holding a row that
    encode_planes declines (NaN, Inf, huge, ties, zeros) by encode_block, a partial last block
    (3 rows of 115 on Pallas, 4 of 116 on Triton: each backend's rows before the suites merged;
    Pallas interpret mode takes 5 s a launch): shared_math's bytes."""
    rng = np.random.default_rng(31)
    normal = {"jax": 50, "torch": 51}[kernel_backend]
    x = np.concatenate([DATA[name](rng, (13, 128)) for name in sorted(DATA)] + [normal_rows(rng, (normal, 128))])
    x = bf16_bits(x) if dtype == "bfloat16" else x.astype(F32)
    exact = bf16_values(x) if dtype == "bfloat16" else x  # the values the kernel sees
    for clip_ratio in (0.96, 0.92):
        want = ref.encode(exact, group_size=128, clip_ratio=clip_ratio)
        got = backends.encode_rows(kernel_backend, x, group_size=128,
                                   clip_index=clip_index(clip_ratio, 128), levels="minmax", block_rows=16, planes=True)
        for name, a, e in zip(ARRAYS, got, want):
            assert_same_bits(a, e, f"{name} c={clip_ratio}")


def test_encode_rows_by_planes_needs_one_group_and_minmax(kernel_backend):
    x = np.zeros((4, 128), F32)
    with pytest.raises(ValueError, match="group_size=64, head_dim=128"):
        backends.encode_rows(kernel_backend, x, group_size=64, clip_index=122, levels="minmax", planes=True)
    with pytest.raises(ValueError, match="levels='moments'"):
        backends.encode_rows(kernel_backend, x, group_size=128, clip_index=122, levels="moments", planes=True)


# ------------------------------------------------------------- format v2: per-channel key pages

@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("pages,page_size,d,clip_ratio", [(3, 16, 16, 1.0), (2, 64, 64, 0.96), (2, 32, 128, 0.9)])
def test_channel_pages_bytes_identical(pages, page_size, d, clip_ratio, data, levels):
    """oscar_jax's per-channel key pages (the XLA path; the kernels' block body) equal
    shared_math.encode_channels bit for bit on every data kind, and decode to decode_channels."""
    from oscar_jax.xla.codec import decode_channel_pages, encode_channel_pages

    rng = np.random.default_rng(page_size * d + len(data))
    x = DATA[data](rng, (pages, page_size, d)).astype(F32)
    want = ref.encode_channels(x, clip_ratio=clip_ratio, levels=levels)
    got = encode_channel_pages(jnp.asarray(x), clip_index=clip_index(clip_ratio, page_size), levels=levels)
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(np.asarray(a), e, f"channel pages {name} {data} page={page_size} d={d} c={clip_ratio} {levels}")
    assert_same_bits(np.asarray(decode_channel_pages(*got)), ref.decode_channels(*want), "decoded channel pages")


def test_channel_key_demotion_bytes_identical():
    """Demotion into format v2 key pages (the XLA path): every layer's BF16 pages src[n] become the
    INT2 key pages dst[n] of shared_math.encode_channels; pages not named keep their bytes, and
    out-of-range pairs are skipped."""
    from oscar_jax.xla.write import demote_channel_key_pages

    rng = np.random.default_rng(5)
    layers, pool_pages, heads, page_size, d = 2, 6, 3, 16, 64
    bf16 = bf16_values(bf16_bits(heavy_tailed_rows(rng, (layers, pool_pages, heads, page_size, d))))
    codes = rng.integers(0, 256, (layers, 5, heads, page_size, d // 4), dtype=np.uint8)
    scale = rng.standard_normal((layers, 5, heads, d)).astype(np.float16)
    minimum = rng.standard_normal((layers, 5, heads, d)).astype(np.float16)
    src, dst = np.array([4, 0, 2, 9], np.int32), np.array([1, 3, -1, 0], np.int32)  # the last two skipped
    got = demote_channel_key_pages(jnp.asarray(bf16, jnp.bfloat16), jnp.asarray(codes), jnp.asarray(scale),
                                   jnp.asarray(minimum), jnp.asarray(src), jnp.asarray(dst),
                                   groups=((clip_index(0.96, page_size), (0, 1)),), levels="minmax")
    want = [codes.copy(), scale.copy(), minimum.copy()]
    for s_page, d_page in ((4, 1), (0, 3)):
        encoded = ref.encode_channels(bf16[:, s_page], clip_ratio=0.96)  # [Y, K, L, ...]
        for pool, value in zip(want, encoded):
            pool[:, d_page] = value
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(np.asarray(a), e, f"demoted channel key pages {name}")


def test_prefill_writes_whole_per_channel_key_pages():
    """A page-aligned chunk of two sequences (56 tokens: 3 pages of 16 and a half page, padded)
    written into format v2 key pools (the XLA path, stacked layer 1): the chunk pages whose first
    token goes to slot 0 of a page hold shared_math.encode_channels of their 16 rows; chunk pages of
    BF16 tokens (destination past the pool) and the padded half page are skipped; every other page
    keeps its bytes."""
    from oscar_jax.xla.write import write_channel_key_pages

    rng = np.random.default_rng(9)
    batch, tokens, heads, page_size, d, pool_pages = 2, 56, 2, 16, 64, 7
    x = heavy_tailed_rows(rng, (batch, tokens, heads, d)).astype(F32)
    page_ids = np.full((batch, tokens), pool_pages, np.int32)  # BF16 tokens: no INT2 destination
    slots = np.tile(np.arange(tokens, dtype=np.int32) % page_size, (batch, 1))
    page_ids[0, 16:48] = np.repeat([5, 2], page_size)  # sequence 0: chunk pages 1 and 2 are history
    page_ids[1, 0:16] = 6  # sequence 1: chunk page 0
    codes = rng.integers(0, 256, (2, pool_pages, heads, page_size, d // 4), dtype=np.uint8)
    scale = rng.standard_normal((2, pool_pages, heads, d)).astype(np.float16)
    minimum = rng.standard_normal((2, pool_pages, heads, d)).astype(np.float16)
    k = clip_index(0.9, page_size)
    got = write_channel_key_pages(*(jnp.asarray(a) for a in (codes, scale, minimum, x, page_ids, slots)), None,
                                  clip_index=k, levels="minmax", layer=1)
    want = [codes.copy(), scale.copy(), minimum.copy()]
    for b, first, dest in ((0, 16, 5), (0, 32, 2), (1, 0, 6)):
        page = x[b, first:first + page_size].transpose(1, 0, 2)  # [K, L, D]
        for pool, value in zip(want, ref.encode_channels(page, clip_ratio=0.9)):
            pool[1, dest] = value
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(np.asarray(a), e, f"prefill-written channel key pages {name}")


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("data", ["heavy", "special", "ties"])
@pytest.mark.parametrize("pages,page_size,d,clip_ratio,dtype", [(3, 16, 16, 1.0, "float32"), (2, 64, 64, 0.96, "float32"),
                                                                (2, 32, 128, 0.9, "bfloat16")])
def test_channel_pages_kernels_bytes_identical(kernel_backend, pages, page_size, d, clip_ratio, dtype, data, levels):
    """Both kernel sets' per-channel key page kernels (Pallas and Triton; interpreted on CPU, compiled
    with OSCAR_TEST_GPU=1) equal shared_math.encode_channels bit for bit."""
    rng = np.random.default_rng(page_size * d + len(data) + 1)
    x = DATA[data](rng, (pages, page_size, d)).astype(F32)
    if dtype == "bfloat16":
        x = bf16_values(bf16_bits(x))
    k = clip_index(clip_ratio, page_size)
    arg = bf16_bits(x) if dtype == "bfloat16" else x
    if kernel_backend == "jax":
        got = [np.asarray(a) for a in jax_kcodec.encode_channel_pages(backends.to_jax(arg), clip_index=k, levels=levels)]
    else:
        got = [a.cpu().numpy() for a in torch_kcodec.encode_channel_pages(backends.to_torch(arg), clip_index=k,
                                                                           levels=levels)]
    want = ref.encode_channels(x, clip_ratio=clip_ratio, levels=levels)
    for name, a, e in zip(ARRAYS, got, want):
        assert_same_bits(a, e, f"{kernel_backend} channel pages {name} {data} page={page_size} d={d} {dtype} {levels}")
