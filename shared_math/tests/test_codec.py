"""Format v1 codec: hand-written golden bytes, an independent scalar implementation, properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared_math import codec
from shared_math.codec import clip_rows, decode, encode, pack_codes, unpack_codes
from shared_math.spec import FP16_MAX, clip_index

F32 = np.float32


# ---------------------------------------------------------------- golden vectors (worked by hand)

def test_golden_minmax_no_clip():
    # x = −8 … 7, c = 1 → τ = 8 (no clip); lo = −8, hi = 7, scale = f16(15·f32(1/3)) = 5,
    # thresholds −5.5, −0.5, 4.5 → codes 0,0,0,1,1,1,1,1,2,2,2,2,2,3,3,3.
    x = np.arange(-8, 8, dtype=F32)
    packed, scale, minimum = encode(x, group_size=16, clip_ratio=1.0)
    # byte i = c[i] | c[i+4]<<2 | c[i+8]<<4 | c[i+12]<<6
    assert packed.tolist() == [0xA4, 0xE4, 0xE4, 0xE5]
    assert scale.tolist() == [5.0] and minimum.tolist() == [-8.0]
    assert decode(packed, scale, minimum, group_size=16).tolist() == [-8.0] * 3 + [-3.0] * 5 + [2.0] * 5 + [7.0] * 3


def test_golden_minmax_clip():
    # d = 16, c = 0.9 → k = floor(14.4) = 14; sorted |x| = 14 zeros, 50, 100 → τ = 50, so 100 → 50.
    # scale = f16(f32(100·f32(1/3))) = 33.34375 (f16 spacing 1/32 at 32), minimum = −50;
    # thresholds −33.328125, 0.015625, 33.359375 → zeros → 1, 50 → 3, −50 → 0.
    x = np.zeros(16, F32)
    x[14], x[15] = 100.0, -50.0
    packed, scale, minimum = encode(x, group_size=16, clip_ratio=0.9)
    assert packed.tolist() == [0x55, 0x55, 0xD5, 0x15]
    assert scale.tolist() == [33.34375] and minimum.tolist() == [-50.0]
    expected = [-50.0 + 33.34375] * 14 + [-50.0 + 3 * 33.34375, -50.0]
    assert decode(packed, scale, minimum, group_size=16).tolist() == expected


def test_golden_moments():
    # x = −8 … 7: μ = −0.5, mean |x − μ| = 4, scale = f16(4·1.25) = 5, minimum = f16(μ − 1.5·5) = −8.
    x = np.arange(-8, 8, dtype=F32)
    packed, scale, minimum = encode(x, group_size=16, clip_ratio=1.0, levels="moments")
    assert packed.tolist() == [0xA4, 0xE4, 0xE4, 0xE5]
    assert scale.tolist() == [5.0] and minimum.tolist() == [-8.0]


def test_worked_packing_example_from_format_doc():
    # d = 16: byte 1 holds elements 1, 5, 9, 13 in bits 0–1, 2–3, 4–5, 6–7.
    codes = np.zeros(16, np.uint8)
    codes[[1, 5, 9, 13]] = [1, 2, 3, 1]
    assert pack_codes(codes).tolist() == [0, 0b01_11_10_01, 0, 0]


def test_all_256_bytes_round_trip():
    packed = np.arange(256, dtype=np.uint8).reshape(64, 4)  # rows of d = 16
    codes = unpack_codes(packed)
    assert codes.max() <= 3
    assert np.array_equal(pack_codes(codes), packed)
    # and every code plane is where the format says
    for plane in range(4):
        assert np.array_equal(codes[:, plane * 4 : (plane + 1) * 4], (packed >> (2 * plane)) & 3)


# ---------------------------------------------------------------- an independent implementation

def _independent_encode_row(row, group_size, clip_ratio, levels):
    """Scalar re-derivation of format v1 from FORMAT.md, one row at a time (no shared helpers)."""
    d = len(row)
    vals = []
    for v in row:
        v = F32(v)
        if np.isnan(v):
            v = F32(0)
        vals.append(F32(min(max(v, F32(-65504)), F32(65504))))
    k = min(int(np.floor(clip_ratio * d)), d - 1)
    tau = sorted(abs(v) for v in vals)[k]
    vals = [F32(min(max(v, -tau), tau)) for v in vals]
    codes, scales, mins = [], [], []
    for g0 in range(0, d, group_size):
        grp = vals[g0 : g0 + group_size]
        if levels == "minmax":
            s16 = np.float16(F32(F32(max(grp) - min(grp)) * F32(1 / 3)))
            m16 = np.float16(min(grp))
        else:
            def tsum(v):
                while len(v) > 1:
                    h = len(v) // 2
                    v = [F32(a + b) for a, b in zip(v[:h], v[h:])]
                return v[0]
            mu = F32(tsum(list(grp)) * F32(1 / group_size))
            mad = F32(tsum([F32(abs(F32(x - mu))) for x in grp]) * F32(1 / group_size))
            s16 = np.float16(min(F32(mad * F32(1.25)), F32(65504)))
            mm = F32(mu - F32(1.5) * F32(s16))
            m16 = np.float16(min(max(mm, F32(-65504)), F32(65504)))
        s, m = F32(s16), F32(m16)
        for x in grp:
            codes.append(sum(int(x >= F32(m + F32(j + 0.5) * s)) for j in range(3)))
        scales.append(s16)
        mins.append(m16)
    q = d // 4
    packed = [codes[i] | codes[i + q] << 2 | codes[i + 2 * q] << 4 | codes[i + 3 * q] << 6 for i in range(q)]
    return packed, scales, mins


@pytest.mark.parametrize("levels", ["minmax", "moments"])
@pytest.mark.parametrize("d,group_size,clip_ratio", [(16, 16, 0.96), (64, 32, 0.92), (128, 128, 0.96), (128, 64, 0.5)])
def test_matches_independent_scalar_implementation(levels, d, group_size, clip_ratio):
    rng = np.random.default_rng(d + group_size)
    x = (rng.standard_t(3, size=(6, d)) * rng.uniform(0.01, 30, size=(6, 1))).astype(F32)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    x[1] = 0.25  # constant row
    packed, scale, minimum = encode(x, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    for r in range(x.shape[0]):
        p, s, m = _independent_encode_row(x[r], group_size, clip_ratio, levels)
        assert packed[r].tolist() == p
        assert scale[r].view(np.uint16).tolist() == np.array(s, np.float16).view(np.uint16).tolist()
        assert minimum[r].view(np.uint16).tolist() == np.array(m, np.float16).view(np.uint16).tolist()


# ---------------------------------------------------------------- properties

rows = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 4), st.sampled_from([16, 32, 64])),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
)


@settings(max_examples=150, deadline=None)
@given(x=rows, clip_ratio=st.sampled_from([0.5, 0.9, 0.96, 1.0]), levels=st.sampled_from(["minmax", "moments"]))
def test_total_deterministic_and_in_range(x, clip_ratio, levels):
    g = 16
    packed, scale, minimum = encode(x, group_size=g, clip_ratio=clip_ratio, levels=levels)
    again = encode(x.copy(), group_size=g, clip_ratio=clip_ratio, levels=levels)
    for a, b in zip((packed, scale, minimum), again):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))  # bit-identical, NaN-safe
    assert np.all(np.isfinite(scale)) and np.all(np.isfinite(minimum)) and np.all(scale >= 0)
    assert unpack_codes(packed).max(initial=0) <= 3
    assert np.all(np.isfinite(decode(packed, scale, minimum, group_size=g)))


@settings(max_examples=150, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.just(32)),
                 elements=st.floats(-1e4, 1e4, width=32)),
)
def test_reconstruction_error_within_half_step(x):
    g = 16
    packed, scale, minimum = encode(x, group_size=g, clip_ratio=1.0)
    xhat = decode(packed, scale, minimum, group_size=g).reshape(x.shape[0], -1, g)
    s = scale.astype(np.float64)[..., None]
    m = minimum.astype(np.float64)[..., None]
    xg = x.reshape(xhat.shape).astype(np.float64)
    in_range = (xg >= m) & (xg <= m + 3 * s)
    # nearest of 4 levels → error ≤ s/2, up to float32 rounding of the thresholds and levels
    slack = 4 * np.finfo(np.float32).eps * (np.abs(m) + 3 * s) + 1e-30
    err = np.abs(xg - xhat)
    assert np.all(np.where(in_range, err <= s / 2 + slack, True))


@settings(max_examples=100, deadline=None)
@given(d=st.sampled_from([16, 64, 128]), clip_ratio=st.floats(0.05, 1.0), seed=st.integers(0, 2**32 - 1))
def test_clip_removes_exactly_the_largest_magnitudes(d, clip_ratio, seed):
    x = np.random.default_rng(seed).permutation(np.arange(1, d + 1, dtype=F32))  # distinct magnitudes
    x *= np.where(np.random.default_rng(seed + 1).random(d) < 0.5, -1, 1).astype(F32)
    k = clip_index(clip_ratio, d)
    clipped = clip_rows(x, k)
    tau = np.sort(np.abs(x))[k]
    assert np.count_nonzero(np.abs(x) > tau) == d - 1 - k
    assert np.count_nonzero(clipped != x) == d - 1 - k
    assert np.abs(clipped).max() == tau


def test_special_values_are_sanitized():
    x = np.array([np.nan, np.inf, -np.inf, 1e38, -1e38, 1e-45, -1e-45, 0.0] * 2, F32)
    san = codec.sanitize(x)
    assert san[0] == 0 and san[1] == FP16_MAX and san[2] == -FP16_MAX and san[3] == FP16_MAX
    packed, scale, minimum = encode(x, group_size=16, clip_ratio=1.0)
    assert minimum[0] == -FP16_MAX and np.isfinite(scale[0])


def test_subnormal_and_constant_groups():
    x = np.full((2, 16), 1e-40, F32)
    x[1] = -3.0
    packed, scale, minimum = encode(x, group_size=16, clip_ratio=0.96)
    xhat = decode(packed, scale, minimum, group_size=16)
    assert scale.ravel().tolist() == [0.0, 0.0]
    assert np.array_equal(xhat[1], x[1])  # a constant row is exact
    assert np.all(np.abs(xhat[0]) < 1e-7)


def test_moments_metadata_saturates():
    x = np.array([-65504.0, 65504.0] * 8, F32)
    _, scale, minimum = encode(x, group_size=16, clip_ratio=1.0, levels="moments")
    assert np.isfinite(scale).all() and scale[0] == 65504.0 and minimum[0] == -65504.0


def test_leading_dimensions_and_empty():
    x = np.random.default_rng(0).normal(size=(2, 3, 5, 64)).astype(F32)
    p, s, m = encode(x, group_size=32, clip_ratio=0.92)
    assert p.shape == (2, 3, 5, 16) and s.shape == m.shape == (2, 3, 5, 2)
    flat = encode(x.reshape(-1, 64), group_size=32, clip_ratio=0.92)
    assert np.array_equal(p.reshape(-1, 16), flat[0])
    p0, s0, m0 = encode(np.zeros((0, 64), F32), group_size=32, clip_ratio=0.92)
    assert p0.shape == (0, 16) and decode(p0, s0, m0, group_size=32).shape == (0, 64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(shape=(4, 48), group_size=16, clip_ratio=0.9), "head_dim=48"),
        (dict(shape=(4, 8), group_size=8, clip_ratio=0.9), "head_dim=8"),
        (dict(shape=(4, 64), group_size=24, clip_ratio=0.9), "group_size=24"),
        (dict(shape=(4, 64), group_size=128, clip_ratio=0.9), "group_size=128"),
        (dict(shape=(4, 64), group_size=32, clip_ratio=0.0), "clip_ratio=0.0"),
        (dict(shape=(4, 64), group_size=32, clip_ratio=1.5), "clip_ratio=1.5"),
        (dict(shape=(4, 64), group_size=32, clip_ratio=0.9, levels="lloyd"), "levels='lloyd'"),
    ],
)
def test_encode_rejects_bad_input(kwargs, match):
    shape = kwargs.pop("shape")
    with pytest.raises(ValueError, match=match):
        encode(np.zeros(shape, F32), **kwargs)


def test_encode_rejects_complex_and_scalar():
    with pytest.raises(ValueError, match="complex"):
        encode(np.zeros((2, 16), np.complex64), group_size=16, clip_ratio=0.9)
    with pytest.raises(ValueError, match="at least one axis"):
        encode(np.float32(1.0), group_size=16, clip_ratio=0.9)


def test_decode_rejects_bad_input():
    p, s, m = encode(np.zeros((3, 64), F32), group_size=32, clip_ratio=0.9)
    with pytest.raises(ValueError, match="uint8"):
        decode(p.astype(np.int32), s, m, group_size=32)
    with pytest.raises(ValueError, match="float16"):
        decode(p, s.astype(np.float32), m, group_size=32)
    with pytest.raises(ValueError, match=r"must have shape \(3, 2\)"):
        decode(p, s[:, :1], m[:, :1], group_size=32)
    with pytest.raises(ValueError, match="group_size=16"):
        decode(p, s, m, group_size=16)


def test_signed_zero_groups_are_deterministic():
    # A group whose minimum is zero and that holds both −0 and +0: lo = −0 whatever the SIMD lane
    # order (the clip keeps zeros as they are because τ = 1 > 0 here).
    for perm in range(4):
        x = np.zeros(16, F32)
        x[np.random.default_rng(perm).permutation(15)[:7]] = -0.0
        x[15] = 1.0
        _, _, minimum = encode(x, group_size=16, clip_ratio=1.0)
        assert minimum.view(np.uint16).tolist() == [0x8000]
        _, scale, minimum = encode(-x, group_size=16, clip_ratio=1.0)  # max side: hi = +0
        assert minimum.tolist() == [-1.0] and scale.tolist() == [np.float16(np.float32(1 / 3))]
    x = np.zeros(16, F32)
    x[15] = 1.0
    _, _, minimum = encode(x, group_size=16, clip_ratio=1.0)
    assert minimum.view(np.uint16).tolist() == [0]  # all +0 stays +0


# ---------------------------------------------------------------- format v2: keys per channel over a page

def test_golden_channels():
    # page = d = 16, c = 1; channel j holds (t − 8) for even j and (8 − t) for odd j over tokens t.
    # Even channels: the v1 example down the column (scale 5, minimum −8, codes 0,0,0,1,1,1,1,1,2,…,3);
    # odd ones: lo = −7, hi = 8, scale 5, minimum −7, thresholds −4.5, 0.5, 5.5, codes 3 − the even code.
    t = np.arange(16, dtype=F32)[:, None]
    x = np.where(np.arange(16) % 2 == 0, t - 8, 8 - t).astype(F32)
    packed, scale, minimum = codec.encode_channels(x, clip_ratio=1.0)
    assert scale.tolist() == [5.0] * 16 and minimum.tolist() == [-8.0, -7.0] * 8
    # byte i of token t holds channels i, i+4, i+8, i+12 — all even or all odd: c·0x55 or (3 − c)·0x55
    even = [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3]
    assert packed.tolist() == [[c * 0x55, (3 - c) * 0x55] * 2 for c in even]
    assert codec.decode_channels(packed, scale, minimum).tolist() == (
        np.where(np.arange(16) % 2 == 0, -8 + 5 * np.array(even, F32)[:, None],
                 -7 + 5 * (3 - np.array(even, F32)[:, None])).tolist())


@pytest.mark.parametrize("page,d,clip_ratio,levels", [(16, 16, 1.0, "minmax"), (64, 64, 0.9, "minmax"),
                                                      (32, 128, 1.0, "moments")])
def test_channels_are_v1_groups_down_each_column(page, d, clip_ratio, levels):
    """Each channel's codes and metadata are what v1's encode gives that channel's page values as
    one row of G = page; the bytes are those codes packed per token as v1 packs a row."""
    x = np.random.default_rng(page + d).standard_normal((3, page, d)).astype(F32) * 4
    packed, scale, minimum = codec.encode_channels(x, clip_ratio=clip_ratio, levels=levels)
    assert packed.shape == (3, page, d // 4) and scale.shape == minimum.shape == (3, d)
    for b in range(3):
        for j in range(d):
            p, s, m = encode(x[b, :, j], group_size=page, clip_ratio=clip_ratio, levels=levels)
            assert s.tolist() == [scale[b, j]] and m.tolist() == [minimum[b, j]]
            assert np.array_equal(unpack_codes(p), unpack_codes(packed[b])[:, j])
    x_hat = codec.decode_channels(packed, scale, minimum)
    step = scale.astype(F32)[:, None, :]
    if clip_ratio == 1.0 and levels == "minmax":  # no clipping: every value within half a step
        assert np.all(np.abs(x_hat - x) <= step / 2 + 1e-6 * np.abs(x))


def test_channels_clip_per_channel_over_the_page():
    # page 16, c = 0.9 → k = 14: in each channel the one largest |x| is clamped to the 15th
    x = np.tile(np.arange(16, dtype=F32)[:, None], (1, 16))
    x[15, 3] = 1000.0
    packed, scale, minimum = codec.encode_channels(x, clip_ratio=0.9)
    x_hat = codec.decode_channels(packed, scale, minimum)
    assert float(scale[3]) == float(np.float16(np.float32(14.0) * codec.ONE_THIRD_F32))  # 1000 clamped to 14
    assert x_hat[15, 3] == x_hat[15, 0]  # the outlier decodes as its column's clamp


def test_channels_reject_bad_input():
    with pytest.raises(ValueError, match="page=12 tokens must be a power of two >= 16"):
        codec.encode_channels(np.zeros((12, 16), F32), clip_ratio=1.0)
    with pytest.raises(ValueError, match=r"shape \[..., page, d\]"):
        codec.encode_channels(np.zeros(16, F32), clip_ratio=1.0)
    with pytest.raises(ValueError, match="head_dim=24"):
        codec.encode_channels(np.zeros((16, 24), F32), clip_ratio=1.0)
    with pytest.raises(ValueError, match="levels='nf2'"):
        codec.encode_channels(np.zeros((16, 16), F32), clip_ratio=1.0, levels="nf2")
    packed, scale, minimum = codec.encode_channels(np.ones((16, 16), F32), clip_ratio=1.0)
    with pytest.raises(ValueError, match=r"must have shape \(16,\)"):
        codec.decode_channels(packed, scale[:8], minimum)
    with pytest.raises(ValueError, match="float16"):
        codec.decode_channels(packed, scale.astype(F32), minimum)
