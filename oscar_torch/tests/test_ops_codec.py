"""oscar_torch.ops.encode / decode against shared_math.codec, bit for bit (format v1).

Runs the Triton kernels in the interpreter on CPU; with OSCAR_TEST_GPU=1 on a GPU machine the same
tests run them compiled on cuda. Cases come from parity_tests.cases (shared with oscar_jax and the
parity suite), plus the FORMAT.md worked examples and every error path.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from oscar_torch import ops
from oscar_torch.kernels import codec as kcodec
from oscar_torch.tests.util import DEVICE, to_numpy, to_torch
from parity_tests.cases import (CODEC_CASES, DATA, LEVELS, assert_same_bits, checked_max_rows, encode_planes_rows,
                                normal_rows, order_statistic_rows)
from shared_math import codec as ref
from shared_math.spec import clip_index

F32 = np.float32


def assert_encode_matches(x, *, group_size, clip_ratio, levels, expected_input=None, what=""):
    got = ops.encode(x if isinstance(x, torch.Tensor) else to_torch(x), group_size=group_size,
                     clip_ratio=clip_ratio, levels=levels)
    want = ref.encode(x if expected_input is None else expected_input, group_size=group_size,
                      clip_ratio=clip_ratio, levels=levels)
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        assert_same_bits(to_numpy(a), e, f"{what} {name} G={group_size} c={clip_ratio} {levels}")
    return got


# ------------------------------------------------------------------------------------- encode


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("case", CODEC_CASES, ids=lambda c: c.name)
def test_encode_bit_identical(case, levels):
    """Every data kind (random, heavy-tailed, ties, NaN/Inf/huge/subnormal, tiny) in one launch."""
    x = np.stack([case.rows(data) for data in sorted(DATA)])
    got = ops.encode(to_torch(x), group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    want = ref.encode(x, group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    for i, data in enumerate(sorted(DATA)):
        for name, a, e in zip(("packed", "scale", "minimum"), got, want):
            assert_same_bits(to_numpy(a)[i], e[i], f"{case.name} {data} {levels} {name}")


@pytest.mark.parametrize("d,group_size,clip_ratio", [(16, 16, 0.5), (64, 32, 0.92), (128, 64, 0.96), (128, 16, 1.0)])
def test_encode_small_shapes(d, group_size, clip_ratio):
    rng = np.random.default_rng(d + group_size)
    for levels in LEVELS:
        for data in ("heavy", "special"):
            x = DATA[data](rng, (17, d))
            assert_encode_matches(x, group_size=group_size, clip_ratio=clip_ratio, levels=levels, what=data)


@pytest.mark.parametrize("levels", LEVELS)
def test_golden_vectors(levels):
    # FORMAT.md worked example: x = −8 … 7, c = 1, G = 16 (both encoders give the same bytes).
    packed, scale, minimum = ops.encode(to_torch(np.arange(-8, 8, dtype=F32)), group_size=16, clip_ratio=1.0,
                                        levels=levels)
    assert to_numpy(packed).tolist() == [0xA4, 0xE4, 0xE4, 0xE5]
    assert to_numpy(scale).tolist() == [5.0] and to_numpy(minimum).tolist() == [-8.0]


def test_golden_clip():
    # d = 16, c = 0.9 → k = 14: τ = 50, so 100 → 50 (shared_math/tests/test_codec.py).
    x = np.zeros(16, F32)
    x[14], x[15] = 100.0, -50.0
    packed, scale, minimum = ops.encode(to_torch(x), group_size=16, clip_ratio=0.9)
    assert to_numpy(packed).tolist() == [0x55, 0x55, 0xD5, 0x15]
    assert to_numpy(scale).tolist() == [33.34375] and to_numpy(minimum).tolist() == [-50.0]


@pytest.mark.parametrize("clip_ratio", [0.05, 0.5, 0.92, 0.96, 1.0])
def test_order_statistic_methods_agree_with_sort(clip_ratio):
    """Every exact order statistic gives the sorted value's bytes (bfloat16 rows, so that
    tagged_max applies; the values are bfloat16-exact, so every method sees the same rows)."""
    d = 64
    x = order_statistic_rows(d)
    k = clip_index(clip_ratio, d)
    want = ref.encode(x, group_size=32, clip_ratio=clip_ratio)
    for method in kcodec.ORDER_STATISTICS:
        got = kcodec.encode_rows(to_torch(x).to(torch.bfloat16), group_size=32, clip_index=k, levels="minmax",
                                 order_statistic=method)
        for name, a, e in zip(("packed", "scale", "minimum"), got, want):
            assert_same_bits(to_numpy(a), e, f"{name} {method}")


@pytest.mark.parametrize("ties", ["none", "one_row"])
def test_checked_max_fast_path_and_fallback(ties):
    """checked_max on float32 rows: tie-free blocks keep the max rounds' value; a block with one
    row whose largest values tie falls back to max_drop, the other blocks do not care."""
    x, k = checked_max_rows(ties == "one_row"), clip_index(0.96, 128)
    want = ref.encode(x, group_size=128, clip_ratio=0.96)
    got = kcodec.encode_rows(to_torch(x), group_size=128, clip_index=k, levels="minmax", order_statistic="checked_max")
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        assert_same_bits(to_numpy(a), e, name)


def test_default_order_statistic_choice():
    assert kcodec.select_order_statistic(128, clip_index(0.96, 128), rows_bf16=False) == "checked_max"
    assert kcodec.select_order_statistic(128, clip_index(0.92, 128), rows_bf16=True) == "tagged_max"
    assert kcodec.select_order_statistic(128, clip_index(0.5, 128), rows_bf16=True) == "bisect"
    assert kcodec.resolve_order_statistic(None, 128, clip_index(0.96, 128), torch.bfloat16) == "tagged_max"
    assert kcodec.resolve_order_statistic(None, 128, clip_index(0.96, 128), torch.bfloat16, rotated=True) \
        == "checked_max"
    with pytest.raises(ValueError, match="tagged_max.*float32"):
        kcodec.resolve_order_statistic("tagged_max", 128, 122, torch.float32)
    with pytest.raises(ValueError, match="sorting"):
        kcodec.resolve_order_statistic("sorting", 128, 122, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64])
def test_input_dtypes_encode_their_float32_values(dtype):
    rng = np.random.default_rng(3)
    x = torch.from_numpy((rng.standard_normal((5, 64)) * 40).astype(F32))
    if not dtype.is_floating_point:
        x = torch.round(x).to(dtype)
        x.view(-1)[:3] = torch.tensor([2**24 + 1, -(2**24) - 3, 123456789], dtype=dtype)  # not f32-exact
    elif dtype == torch.float64:
        x = x.to(torch.float64) + 1e-9  # rounds to float32 on the way in
    else:
        x = x.to(dtype)
    expected = x.numpy().astype(F32) if dtype != torch.bfloat16 else x.to(torch.float32).numpy()
    assert_encode_matches(x.to(DEVICE), group_size=32, clip_ratio=0.96, levels="minmax", expected_input=expected)


def test_group_holding_both_zeros_has_minimum_minus_zero():
    """FORMAT.md step 3: −0 orders below +0 (IEEE 754-2019 minimum/maximum), so a group whose
    extreme is a zero and that holds both zeros has lo = −0, hi = +0; bytes equal shared_math."""
    x = np.full((2, 16), 2.0, F32)
    x[:, 3], x[:, 9] = -0.0, 0.0
    x[1] = -x[1]  # maximum is the zero: hi = +0
    assert_encode_matches(x, group_size=16, clip_ratio=1.0, levels="minmax")
    _, _, minimum = ops.encode(to_torch(x), group_size=16, clip_ratio=1.0)
    assert np.signbit(to_numpy(minimum)[0]).all()


@settings(max_examples=25, deadline=None)
@given(
    x=hnp.arrays(np.float32, (4, 32), elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
    clip_ratio=st.sampled_from([0.5, 0.96, 1.0]),
    levels=st.sampled_from(LEVELS),
)
def test_encode_total_property(x, clip_ratio, levels):
    assert_encode_matches(x, group_size=16, clip_ratio=clip_ratio, levels=levels)


def test_encode_is_deterministic_and_handles_empty_rows():
    x = to_torch(DATA["heavy"](np.random.default_rng(5), (6, 64)))
    first = ops.encode(x, group_size=32, clip_ratio=0.96, levels="moments")
    for a, b in zip(first, ops.encode(x, group_size=32, clip_ratio=0.96, levels="moments")):
        assert torch.equal(a, b)
    packed, scale, minimum = ops.encode(torch.zeros((0, 3, 64), device=DEVICE), group_size=32, clip_ratio=0.96)
    assert packed.shape == (0, 3, 16) and scale.shape == minimum.shape == (0, 3, 2)
    assert ops.decode(packed, scale, minimum, group_size=32).shape == (0, 3, 64)


# ------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("d,group_size,lead", [(16, 16, (1,)), (64, 32, (3, 5)), (128, 64, (17,)), (128, 128, (40,))])
def test_decode_bit_identical(d, group_size, lead):
    rng = np.random.default_rng(d + group_size)
    packed = rng.integers(0, 256, size=lead + (d // 4,), dtype=np.uint8)
    meta_shape = lead + (d // group_size,)
    scale = rng.choice(np.array([0.0, 6e-8, 1e-5, 0.0132, 1.0, 333.0, 65504.0], np.float16), meta_shape)
    minimum = (rng.standard_normal(meta_shape) * 10).astype(np.float16)
    special = np.array([-0.0, -65504.0, 6e-8], np.float16)
    minimum.reshape(-1)[: special.size] = special[: minimum.size]
    got = ops.decode(to_torch(packed), to_torch(scale), to_torch(minimum), group_size=group_size)
    assert_same_bits(to_numpy(got), ref.decode(packed, scale, minimum, group_size=group_size), "decode")


def test_round_trip_equals_reference_round_trip():
    x = DATA["heavy"](np.random.default_rng(11), (3, 7, 128))
    encoded = ops.encode(to_torch(x), group_size=64, clip_ratio=0.92, levels="moments")
    want = ref.decode(*ref.encode(x, group_size=64, clip_ratio=0.92, levels="moments"), group_size=64)
    assert_same_bits(to_numpy(ops.decode(*encoded, group_size=64)), want, "round trip")


# ------------------------------------------------------------------------------- bad inputs

GOOD = torch.zeros((2, 64), device=DEVICE)
PACKED = torch.zeros((2, 16), dtype=torch.uint8, device=DEVICE)
SCALE = torch.zeros((2, 2), dtype=torch.float16, device=DEVICE)
META = torch.device("meta")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.encode(np.zeros((2, 64), F32), group_size=32, clip_ratio=0.9), "x must be a torch.Tensor"),
        (lambda: ops.encode(GOOD.to(torch.complex64), group_size=32, clip_ratio=0.9), "dtype complex64"),
        (lambda: ops.encode(GOOD.to(torch.bool), group_size=32, clip_ratio=0.9), "dtype bool"),
        (lambda: ops.encode(GOOD[0, 0], group_size=16, clip_ratio=0.9), "at least one axis"),
        (lambda: ops.encode(torch.zeros((64, 2), device=DEVICE).T, group_size=32, clip_ratio=0.9),
         r"x must be contiguous, got strides \(1, 2\)"),
        (lambda: ops.encode(GOOD.to(META), group_size=32, clip_ratio=0.9), "x is on device meta"),
        (lambda: ops.encode(torch.zeros((2, 48), device=DEVICE), group_size=16, clip_ratio=0.9), "head_dim=48"),
        (lambda: ops.encode(torch.zeros((2, 8), device=DEVICE), group_size=8, clip_ratio=0.9), "head_dim=8"),
        (lambda: ops.encode(GOOD, group_size=24, clip_ratio=0.9), "group_size=24"),
        (lambda: ops.encode(GOOD, group_size=128, clip_ratio=0.9), "group_size=128"),
        (lambda: ops.encode(GOOD, group_size=8, clip_ratio=0.9), "group_size=8"),
        (lambda: ops.encode(GOOD, group_size=32, clip_ratio=0.0), "clip_ratio=0.0"),
        (lambda: ops.encode(GOOD, group_size=32, clip_ratio=1.5), "clip_ratio=1.5"),
        (lambda: ops.encode(GOOD, group_size=32, clip_ratio="0.9"), "clip_ratio='0.9'"),
        (lambda: ops.encode(GOOD, group_size=32, clip_ratio=0.9, levels="lloyd"), "levels='lloyd'"),
        (lambda: ops.decode(PACKED.to(torch.int8), SCALE, SCALE, group_size=32), "packed must have dtype uint8"),
        (lambda: ops.decode(PACKED, SCALE.float(), SCALE, group_size=32), "scale must have dtype float16"),
        (lambda: ops.decode(PACKED, SCALE, SCALE.float(), group_size=32), "minimum must have dtype float16"),
        (lambda: ops.decode(PACKED, SCALE[:, :1].contiguous(), SCALE, group_size=32), r"scale has shape \(2, 1\)"),
        (lambda: ops.decode(PACKED, SCALE, SCALE[:1], group_size=32), r"minimum has shape \(1, 2\)"),
        (lambda: ops.decode(PACKED[:, :12], SCALE, SCALE, group_size=16), "packed must be contiguous"),
        (lambda: ops.decode(PACKED[:, :12].contiguous(), SCALE, SCALE, group_size=16), "head_dim=48"),
        (lambda: ops.decode(PACKED, SCALE, SCALE, group_size=48), "group_size=48"),
        (lambda: ops.decode(PACKED[0, 0], SCALE, SCALE, group_size=16), "at least one axis"),
        (lambda: ops.decode(PACKED, SCALE.to(META), SCALE, group_size=32), "scale is on device meta"),
        (lambda: ops.decode(PACKED.to(META), SCALE.to(META), SCALE.to(META), group_size=32),
         "packed is on device meta: oscar_torch kernels run on cuda"),
    ],
)
def test_bad_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------- encode by planes


@triton.jit
def _encode_planes_probe(x_ptr, packed_ptr, scale_ptr, minimum_ptr, exact_ptr, CLIP_INDEX: tl.constexpr,
                         D: tl.constexpr, ROWS: tl.constexpr, ROWS_BF16: tl.constexpr):
    """encode_planes on ROWS rows of float32 x, with its per-row `exact` claim (no fallback)."""
    Q: tl.constexpr = D // 4
    row = tl.arange(0, ROWS)[:, None]
    plane = x_ptr + row * D + tl.arange(0, Q)[None, :]
    packed, scale, minimum, exact = kcodec.encode_planes(
        tl.load(plane).to(tl.int32, bitcast=True), tl.load(plane + Q).to(tl.int32, bitcast=True),
        tl.load(plane + 2 * Q).to(tl.int32, bitcast=True), tl.load(plane + 3 * Q).to(tl.int32, bitcast=True),
        CLIP_INDEX, ROWS_BF16)
    tl.store(packed_ptr + row * Q + tl.arange(0, Q)[None, :], packed.to(tl.uint8))
    tl.store(scale_ptr + row, scale)
    tl.store(minimum_ptr + row, minimum)
    tl.store(exact_ptr + row, exact.to(tl.int32))


@pytest.mark.parametrize("clip_ratio", [0.96, 0.92, 0.5])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16_rows", "f32_rows"])
def test_encode_planes_is_exact_where_it_says_so(bf16, clip_ratio):
    """encode_planes on its own: every row it calls exact has shared_math's bytes (all data kinds,
    NaN/Inf/huge/subnormal/zeros included), and it takes the rows it is for (N(0, 1)-like rows,
    ties between bfloat16 values) while declining each condition it cannot meet."""
    x, should_take = encode_planes_rows(bf16)
    rows = 1 << (len(x) - 1).bit_length()
    x = np.concatenate([x, np.ones((rows - len(x), 128), F32)])
    k = clip_index(clip_ratio, 128)
    packed = torch.empty((rows, 32), dtype=torch.uint8, device=DEVICE)
    scale, minimum = (torch.empty(rows, dtype=torch.float16, device=DEVICE) for _ in range(2))
    exact = torch.empty(rows, dtype=torch.int32, device=DEVICE)
    _encode_planes_probe[(1,)](to_torch(x), packed, scale, minimum, exact, CLIP_INDEX=k, D=128, ROWS=rows,
                               ROWS_BF16=bf16)
    exact = to_numpy(exact)[: len(should_take)].astype(bool)
    want = ref.encode(x, group_size=128, clip_ratio=clip_ratio)
    for name, a, e in zip(("packed", "scale", "minimum"), (packed, scale, minimum), want):
        a, e = to_numpy(a)[: len(exact)], e.reshape(rows, -1)[: len(exact)].reshape(to_numpy(a)[: len(exact)].shape)
        assert_same_bits(a[exact], e[exact], f"{name} of the rows called exact")
    declined = should_take & ~exact
    assert not declined.any(), f"declined rows it is for: {np.flatnonzero(declined)}"
    if clip_ratio == 0.96:
        assert not exact[-16:][: 6 if bf16 else 7].any(), "took a row it cannot encode exactly"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_encode_rows_by_planes_bit_identical(dtype):
    """encode_rows(planes=True): blocks of ordinary rows by planes, blocks holding a row that
    encode_planes declines (NaN, Inf, huge, ties, zeros) by encode_block: shared_math's bytes."""
    rng = np.random.default_rng(31)
    x = np.concatenate([DATA[name](rng, (13, 128)) for name in sorted(DATA)] + [normal_rows(rng, (51, 128))])
    x = torch.from_numpy(x.astype(F32)).to(dtype)
    for clip_ratio in (0.96, 0.92):
        want = ref.encode(x.float().numpy(), group_size=128, clip_ratio=clip_ratio)
        got = kcodec.encode_rows(x.to(DEVICE), group_size=128, clip_index=clip_index(clip_ratio, 128), levels="minmax",
                                 block_rows=16, planes=True)
        for name, a, e in zip(("packed", "scale", "minimum"), got, want):
            assert_same_bits(to_numpy(a), e, f"{name} c={clip_ratio}")


def test_encode_rows_by_planes_needs_one_group_and_minmax():
    x = torch.zeros((4, 128), device=DEVICE)
    with pytest.raises(ValueError, match="group_size=64, head_dim=128"):
        kcodec.encode_rows(x, group_size=64, clip_index=122, levels="minmax", planes=True)
    with pytest.raises(ValueError, match="levels='moments'"):
        kcodec.encode_rows(x, group_size=128, clip_index=122, levels="moments", planes=True)


@triton.jit
def _zeros_encode_block(x, GROUP_SIZE: tl.constexpr, CLIP_INDEX: tl.constexpr, LEVELS: tl.constexpr,
                        ORDER_STATISTIC: tl.constexpr):
    """A stand-in for encode_block that marks its blocks: every output zero."""
    ROWS: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    return (tl.zeros((ROWS, D // 4), tl.int32), tl.zeros((ROWS, D // GROUP_SIZE), tl.float16),
            tl.zeros((ROWS, D // GROUP_SIZE), tl.float16))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="swaps a kernel function, which only the interpreter sees")
def test_encode_by_planes_falls_back_only_where_a_row_declines(monkeypatch):
    """Which path each block takes (encode_block swapped for a stand-in that writes zeros): blocks
    of N(0, 1) rows come from encode_planes (shared_math's bytes), the block with a NaN row and
    only it from encode_block — so a decision that always fell back could not pass unseen."""
    monkeypatch.setattr(kcodec, "encode_block", _zeros_encode_block)
    x = np.random.default_rng(3).standard_normal((48, 128)).astype(F32)
    x[20, 7] = np.nan  # in the second block of 16
    got = kcodec.encode_rows(to_torch(x), group_size=128, clip_index=122, levels="minmax", block_rows=16, planes=True)
    want = ref.encode(x, group_size=128, clip_ratio=0.96)
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        a = to_numpy(a)
        assert_same_bits(np.delete(a, np.s_[16:32], axis=0), np.delete(e, np.s_[16:32], axis=0), name)
        assert not a[16:32].view(f"u{a.itemsize}").any(), f"{name}: the NaN block did not fall back"
