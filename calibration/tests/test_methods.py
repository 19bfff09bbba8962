"""KV methods: tier intervals against brute force, bytes against hand counts, quantizers do what they claim."""

import numpy as np
import pytest

from calibration.methods import (
    AsymmetricInt,
    FormatV1Codec,
    KiviMethod,
    SymmetricInt2,
    TieredMethod,
    Windows,
    bits_per_element,
    parse_method,
    parse_method_list,
)
from shared_math.artifact import ModelFingerprint, RotationArtifact
from shared_math.hadamard import hadamard_matrix
from shared_math.spec import OscarConfig
from shared_math.tiers import kv_bytes_per_layer, tier_split

L, HKV, D = 2, 3, 64


def make_artifact(num_layers=L, num_kv_heads=HKV, head_dim=D, group_size=64, levels="minmax", seed=0):
    rng = np.random.default_rng(seed)

    def orthogonal():
        q, _ = np.linalg.qr(rng.normal(size=(num_layers, num_kv_heads, head_dim, head_dim)))
        return q.astype(np.float32)

    eig = np.sort(rng.random((num_layers, num_kv_heads, head_dim)), axis=-1).astype(np.float32)
    return RotationArtifact(
        k_rotation=orthogonal(), v_rotation=orthogonal(), k_eigenvalues=eig, v_eigenvalues=eig.copy(),
        k_clip_ratio=np.linspace(0.9, 0.96, num_layers).astype(np.float32),
        v_clip_ratio=np.full(num_layers, 0.92, np.float32),
        model=ModelFingerprint(num_layers, num_kv_heads * 3, num_kv_heads, head_dim),
        codec={"group_size": group_size, "levels": levels}, provenance={"data": "wiki"},
    )


def build(spec, artifact=None):
    return parse_method(spec, num_layers=L, num_kv_heads=HKV, head_dim=D, artifact=artifact)


# ---------------------------------------------------------------------------------------------
# Tiers


@pytest.mark.parametrize("windows", [Windows(64, 256, 16), Windows(16, 32, 16), Windows(0, 0, 16), Windows(4, 8, 4)])
def test_tiered_history_intervals_match_tier_split_per_position(windows):
    method = TieredMethod("m", "naive-int2", SymmetricInt2(D), windows)
    length = windows.sink + windows.recent + 5 * windows.page_size + 3
    iv = method.history_intervals(length)
    cfg = OscarConfig(head_dim=D, sink=windows.sink, recent=windows.recent, page_size=windows.page_size)
    for t in range(length):
        split = tier_split(t, cfg)  # decoding t attends before the demotion its append makes due
        for s in range(t + 1):
            history = s < t and split.tier_of(s) == "history"
            assert (iv.k_start[t] <= s < iv.k_end[t]) == history, (t, s)
            assert (iv.v_start[t] <= s < iv.v_end[t]) == history, (t, s)


def test_bf16_has_no_history():
    iv = build("bf16").history_intervals(50)
    assert not iv.any_history()


def _kivi_state_machine(length, group, residual):
    """KIVI's decode step literally (models/llama_kivi.py): which positions each query reads quantized."""
    k_quant, k_full, v_quant, v_full = [], [], [], []
    seen_k, seen_v = [], []
    for t in range(length):
        k_full.append(t)
        seen_k.append(set(k_quant))  # attention reads the quantized keys, then the full ones
        if len(k_full) == residual:  # flush after attention
            k_quant += k_full
            k_full = []
        v_full.append(t)
        seen_v.append(set(v_quant))
        if len(v_full) > residual:
            v_quant.append(v_full.pop(0))
    return seen_k, seen_v


@pytest.mark.parametrize("group,residual", [(16, 32), (32, 128), (16, 16)])
def test_kivi_history_intervals_match_its_decode_loop(group, residual):
    length = 3 * residual + 7
    iv = KiviMethod("kivi2", group, residual).history_intervals(length)
    seen_k, seen_v = _kivi_state_machine(length, group, residual)
    for t in range(length):
        assert set(range(iv.k_start[t], iv.k_end[t])) == seen_k[t]
        assert set(range(iv.v_start[t], iv.v_end[t])) == seen_v[t]


# ---------------------------------------------------------------------------------------------
# Bytes


def test_bits_per_element_hand_counts():
    art = make_artifact()
    # OSCAR at G = D = 64, T = 2048: sink 64 + recent 256 rows BF16 (128 B), 1728 history rows of
    # 16 code bytes + 2 fp16 (4 B) = 20 B.
    assert bits_per_element(build("oscar", art), 2048, HKV, D) == pytest.approx((320 * 128 + 1728 * 20) * 8 / (2048 * 64))
    assert bits_per_element(build("oscar", art), 2048, HKV, D) == pytest.approx(4.609375)
    # the same count as shared_math.tiers
    cfg = OscarConfig(head_dim=D, group_size=64)
    for length in (1, 63, 64, 335, 336, 2048, 131072):
        k, v = build("oscar", art).kv_bytes(length, HKV, D)
        assert k + v == kv_bytes_per_layer(length, cfg, HKV).stored_bytes
    # naive INT2: one fp16 scale per row → 18 B per history row
    assert bits_per_element(build("naive-int2"), 2048, HKV, D) == pytest.approx((320 * 128 + 1728 * 18) * 8 / (2048 * 64))
    # INT4: 32 code bytes + 4 B metadata
    assert bits_per_element(build("int4"), 2048, HKV, D) == pytest.approx((320 * 128 + 1728 * 36) * 8 / (2048 * 64))
    assert bits_per_element(build("int4"), 1 << 24, HKV, D) == pytest.approx(4.5, abs=1e-3)
    assert bits_per_element(build("bf16"), 2048, HKV, D) == 16.0
    # KIVI G=32, R=128 at 2048: keys all flushed → (8 code bytes + 4 B) per 32 elements = 3 bits;
    # values: 1920 rows × (16 + 2 groups × 4 B) = 24 B = 3 bits, 128 residual rows BF16.
    kivi = build("kivi2")
    assert bits_per_element(kivi, 2048, HKV, D) == pytest.approx((3.0 + (1920 * 3 + 128 * 16) / 2048) / 2)
    # 2047 tokens: 15 flushed key blocks, 127 key residual rows; 1919 quantized values
    k_bits = (1920 * 3 + 127 * 16) / 2047
    v_bits = (1919 * 3 + 128 * 16) / 2047
    assert bits_per_element(kivi, 2047, HKV, D) == pytest.approx((k_bits + v_bits) / 2)
    assert bits_per_element(build("kivi2:group=64"), 1 << 24, HKV, D) == pytest.approx(2.5, abs=1e-3)
    # windows 0/0 leave at most one unfinished page in BF16
    assert bits_per_element(build("oscar:windows=0/0", art), 2048, HKV, D) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="length=0"):
        bits_per_element(kivi, 0, HKV, D)


# ---------------------------------------------------------------------------------------------
# Quantizers


def test_naive_int2_is_symmetric_four_levels():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 7, D)).astype(np.float32) * np.float32(3)
    q = SymmetricInt2(D).quantize(x)
    scale = (np.abs(x).max(-1, keepdims=True) / 1.5).astype(np.float16).astype(np.float32)
    levels = q / scale
    assert np.allclose(levels, np.round(levels - 0.5) + 0.5) and np.abs(levels).max() <= 1.5  # {±0.5, ±1.5}
    assert np.abs(q - x).max(-1).max() <= (scale / 2 * 1.001).max()  # nearest level (absmax f16-rounded)
    assert np.array_equal(SymmetricInt2(D).quantize(-x), -q)
    assert np.all(SymmetricInt2(D).quantize(np.zeros((2, D), np.float32)) == 0)
    assert SymmetricInt2(32).row_bytes(64) == 16 + 2 * 2


def test_int4_has_sixteen_levels_and_half_step_error():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(40, D)).astype(np.float32)
    quant = AsymmetricInt(4, D)
    q = quant.quantize(x)
    for row, qrow in zip(x, q):
        assert len(np.unique(qrow)) <= 16
        step = np.float32(np.float16((row.max() - row.min()) / 15))
        assert np.abs(qrow - row).max() <= step / 2 + 1e-2 * step  # fp16 minimum rounding
    assert quant.row_bytes(64) == 32 + 4


def test_kivi_keys_are_grouped_per_channel_over_tokens():
    kivi = KiviMethod("kivi2", group_size=16, residual=32)
    rng = np.random.default_rng(3)
    # Each channel takes 4 evenly spaced fp16-exact values within each group of 16 tokens → exact.
    levels = rng.integers(0, 4, size=(1, 32, 2, D)).astype(np.float32)
    levels[:, 0], levels[:, 3], levels[:, 16], levels[:, 19] = 0, 3, 0, 3  # every level range spans 0..3
    offset = rng.integers(-8, 8, size=(1, 2, 1, 2, D)).repeat(16, axis=2).reshape(1, 32, 2, D)
    x = (levels * 0.25 + offset).astype(np.float32)
    assert np.array_equal(kivi.quantize_keys(0, x), x)
    # Groups are independent: changing a token of group 2 changes nothing in group 1.
    y = x.copy()
    y[:, 20] += 100.0
    qx, qy = kivi.quantize_keys(0, x), kivi.quantize_keys(0, y)
    assert np.array_equal(qx[:, :16], qy[:, :16]) and not np.array_equal(qx[:, 16:], qy[:, 16:])
    # Per channel: an outlier channel does not disturb the others (per-token would).
    z = rng.normal(size=(1, 16, 1, D)).astype(np.float32)
    z_out = z.copy()
    z_out[..., 5] *= 1000
    qz, qz_out = kivi.quantize_keys(0, z), kivi.quantize_keys(0, z_out)
    others = np.arange(D) != 5
    assert np.array_equal(qz[..., others], qz_out[..., others])
    # A trailing partial group stays exact (still in KIVI's residual).
    w = rng.normal(size=(1, 21, 1, D)).astype(np.float32)
    assert np.array_equal(kivi.quantize_keys(0, w)[:, 16:], w[:, 16:])


def test_kivi_values_are_per_token():
    kivi = KiviMethod("kivi2", group_size=32, residual=128)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, 6, 2, D)).astype(np.float32)
    y = x.copy()
    y[:, 3] *= 50
    qx, qy = kivi.quantize_values(0, x), kivi.quantize_values(0, y)
    keep = np.arange(6) != 3
    assert np.array_equal(qx[:, keep], qy[:, keep])
    # two groups of 32 channels per row: each has at most 4 distinct values
    for half in (slice(0, 32), slice(32, 64)):
        assert all(len(np.unique(r)) <= 4 for r in qx[..., half].reshape(-1, 32))


def test_rotation_baselines():
    art = make_artifact()
    quarot, oscar = build("quarot-int2", art), build("oscar", art)
    h = hadamard_matrix(D, np.float32)
    assert np.array_equal(quarot.k_rotation[1, 2], h) and np.array_equal(quarot.v_rotation[0, 0], h)
    assert quarot.quantizer == oscar.quantizer  # same codec: the comparison isolates the rotation
    assert quarot.windows == oscar.windows == Windows(64, 256, 16)
    assert np.array_equal(oscar.k_rotation, art.k_rotation) and np.array_equal(oscar.v_rotation, art.v_rotation)
    assert oscar.quantizer.k_clip_ratios == tuple(float(c) for c in art.k_clip_ratio)
    x = np.random.default_rng(5).normal(size=(1, 4, HKV, D)).astype(np.float32)
    codec = FormatV1Codec(64, (0.9, 0.96), (0.92, 0.92), "minmax")
    assert np.array_equal(oscar.quantize_keys(1, x), codec.quantize(x, art.k_clip_ratio[1]))
    # without an artifact quarot uses the format defaults
    plain = build("quarot-int2")
    assert plain.quantizer == FormatV1Codec(64, (0.96,) * L, (0.92,) * L, "minmax")
    overridden = build("quarot-int2:clip=1/1:windows=0/0:levels=moments", art)
    assert overridden.quantizer.k_clip_ratios == (1.0, 1.0) and overridden.quantizer.levels == "moments"
    assert overridden.windows == Windows(0, 0, 16)


def test_levels_pair_gives_keys_and_values_their_own_levels():
    """`levels=minmax/moments`: keys encode with min/max, values with moments, bit for bit as
    shared_math; one name keeps one codec for both; a bad name is refused, naming it."""
    art = make_artifact(levels="moments")
    split = build("oscar:levels=minmax/moments", art)
    x = np.random.default_rng(6).normal(size=(1, 5, HKV, D)).astype(np.float32)
    minmax = FormatV1Codec(64, (0.9, 0.96), (0.92, 0.92), "minmax")
    moments = FormatV1Codec(64, (0.9, 0.96), (0.92, 0.92), "moments")
    for layer in (0, 1):
        assert np.array_equal(split.quantize_keys(layer, x), minmax.quantize(x, art.k_clip_ratio[layer]))
        assert np.array_equal(split.quantize_values(layer, x), moments.quantize(x, art.v_clip_ratio[layer]))
    assert not np.array_equal(split.quantize_keys(0, x), build("oscar", art).quantize_keys(0, x))
    assert split.describe()["levels"] == "minmax/moments"
    assert build("oscar:levels=minmax", art).quantizer.value_levels is None
    with pytest.raises(ValueError, match="levels='median' must be one of"):
        build("oscar:levels=minmax/median", art)


def test_describe_states_windows_and_source():
    art = make_artifact()
    for spec in ("bf16", "naive-int2", "quarot-int2", "kivi2", "oscar", "int4"):
        desc = build(spec, art).describe()
        assert "windows" in desc and desc["family"] == spec
    assert build("kivi2", art).describe()["windows"] is None
    assert build("oscar", art).describe()["windows"] == {"sink": 64, "recent": 256, "page_size": 16}


def test_spec_errors():
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        build("int3")
    with pytest.raises(ValueError, match="needs a calibration artifact"):
        build("oscar")
    with pytest.raises(ValueError, match="no option 'clip'"):
        build("kivi2:clip=1/1")
    with pytest.raises(ValueError, match="must be key=value"):
        build("oscar:windows")
    with pytest.raises(ValueError, match="two int values"):
        build("naive-int2:windows=a/b")
    with pytest.raises(ValueError, match="multiple of page_size"):
        build("naive-int2:windows=10/20")
    with pytest.raises(ValueError, match="residual=48 must be a positive multiple"):
        build("kivi2:residual=48")
    with pytest.raises(ValueError, match="group_size=128"):
        build("quarot-int2:group=128")
    with pytest.raises(ValueError, match="twice"):
        parse_method_list("bf16,oscar,bf16")
    with pytest.raises(ValueError, match="names no method"):
        parse_method_list(" , ")
    assert parse_method_list("bf16, kivi2:group=64") == ["bf16", "kivi2:group=64"]


def test_oscar_artifact_option_loads_another_artifact():
    """`oscar:artifact=DIR` takes its rotations and codec from the artifact `load_artifact(DIR)`
    returns, while plain `oscar` keeps the command's artifact; without a loader it is refused."""
    default, other = make_artifact(seed=0), make_artifact(seed=1, levels="moments")
    loaded = []

    def load(path):
        loaded.append(path)
        return other

    plain = parse_method("oscar", num_layers=L, num_kv_heads=HKV, head_dim=D, artifact=default, load_artifact=load)
    swapped = parse_method("oscar:artifact=/tmp/x8k", num_layers=L, num_kv_heads=HKV, head_dim=D, artifact=default,
                           load_artifact=load)
    assert loaded == ["/tmp/x8k"]
    np.testing.assert_array_equal(plain.k_rotation, default.k_rotation)
    np.testing.assert_array_equal(swapped.k_rotation, other.k_rotation)
    np.testing.assert_array_equal(swapped.v_rotation, other.v_rotation)
    assert swapped.quantizer.levels == "moments" and plain.quantizer.levels == "minmax"
    with pytest.raises(ValueError, match="cannot load another artifact"):
        build("oscar:artifact=/tmp/x8k", default)
    with pytest.raises(ValueError, match="has no option 'artifact'"):
        build("quarot-int2:artifact=/tmp/x8k")


def test_at_rest_history():
    """The history stored after the last token: tier_split(L) for tiered methods; for both
    families what query L will read (demotions and KIVI's key flush happen after attention)."""
    art = make_artifact()
    for length in (1, 20, 31, 32, 33, 64, 65, 100):
        kivi = build("kivi2:group=16:residual=32")
        iv = kivi.history_intervals(length + 1)
        assert kivi.at_rest_history(length) == (0, iv.k_end[length], 0, iv.v_end[length])
        oscar = build("oscar:windows=16/32", art)
        iv = oscar.history_intervals(length + 1)
        assert oscar.at_rest_history(length) == (iv.k_start[length], iv.k_end[length], iv.v_start[length],
                                                 iv.v_end[length])
        split = tier_split(length, OscarConfig(head_dim=D, sink=16, recent=32))
        assert oscar.at_rest_history(length)[:2] == (split.history_start, split.recent_start)
        assert build("bf16").at_rest_history(length) == (0, 0, 0, 0)


# ---------------------------------------------------------------------------------------------
# TurboQuant (vLLM's turboquant_* presets)

from calibration.methods import (  # noqa: E402
    TURBOQUANT_PRESETS,
    TurboQuantKeys,
    TurboQuantMethod,
    TurboQuantValues,
    lloyd_max_gaussian,
    turboquant_boundary_layers,
)


def _lloyd_max_mse(bits):
    """E[(x − Q(x))²] for x ~ N(0, 1), in closed form: 1 − Σ_i P(cell i)·c_i² (centroids = cell means)."""
    from math import erf, sqrt

    c, b = lloyd_max_gaussian(bits)
    cdf = np.array([0.0] + [0.5 * (1 + erf(x / sqrt(2))) for x in b] + [1.0])
    return 1.0 - float(np.sum(np.diff(cdf) * c**2))


def test_lloyd_max_levels_match_the_published_tables():
    # Max (1960) / Lloyd (1982): the optimal quantizers of the unit Gaussian.
    np.testing.assert_allclose(lloyd_max_gaussian(1)[0], [-0.7979, 0.7979], atol=1e-4)
    np.testing.assert_allclose(lloyd_max_gaussian(2)[0], [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    np.testing.assert_allclose(lloyd_max_gaussian(3)[0][4:], [0.2451, 0.7560, 1.3439, 2.1520], atol=1e-4)
    for bits, mse in ((1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)):
        c, b = lloyd_max_gaussian(bits)
        assert len(c) == 1 << bits and np.all(np.diff(c) > 0)
        np.testing.assert_allclose(c, -c[::-1], atol=1e-12)  # symmetric
        np.testing.assert_allclose(b, (c[:-1] + c[1:]) / 2)  # nearest-centroid boundaries
        assert _lloyd_max_mse(bits) == pytest.approx(mse, rel=2e-3)
    with pytest.raises(ValueError, match="bits=0"):
        lloyd_max_gaussian(0)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("norm_correction", [False, True])
def test_turboquant_keys_nearest_centroid_and_error_bound(bits, norm_correction):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((4, 5, D)) * rng.uniform(0.1, 30, (4, 5, 1))).astype(np.float32)
    out = TurboQuantKeys(bits, norm_correction).quantize(x)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    unit, c = x / norm, lloyd_max_gaussian(bits)[0] / np.sqrt(D)
    nearest = c[np.argmin(np.abs(unit[..., None] - c), axis=-1)]  # brute force over the levels
    if norm_correction:
        np.testing.assert_allclose(np.linalg.norm(out, axis=-1, keepdims=True), norm, rtol=1e-3)  # fp16 ‖k‖
        nearest = nearest / np.linalg.norm(nearest, axis=-1, keepdims=True)
    np.testing.assert_allclose(out, np.float16(norm).astype(np.float32) * nearest, rtol=1e-5, atol=1e-6)
    # Gaussian rows: each coordinate of k/‖k‖ is ≈ N(0, 1/D), so the relative MSE is ≈ the Lloyd-Max MSE
    rel = np.sum((out - x) ** 2) / np.sum(x**2)
    assert rel < 1.6 * _lloyd_max_mse(bits)
    assert np.all(TurboQuantKeys(bits, norm_correction).quantize(np.zeros((2, D), np.float32)) == 0)


def test_turboquant_fp8_keys():
    x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
    out = TurboQuantKeys(8, False).quantize(x)
    assert np.all(np.abs(out - x) <= np.abs(x) * 2.0**-4 + 2.0**-10)  # e4m3: 3 mantissa bits
    assert TurboQuantKeys(8, False).row_bytes(D) == D


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turboquant_values_uniform_levels(bits):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((6, D)) * 3 + rng.standard_normal((6, 1))).astype(np.float32)
    out = TurboQuantValues(bits).quantize(x)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    scale = (hi - lo) / ((1 << bits) - 1)
    codes = (out - np.float16(lo).astype(np.float32)) / np.float16(scale).astype(np.float32)
    np.testing.assert_allclose(codes, np.rint(codes), atol=1e-3)  # on the grid min + j·scale
    assert codes.min() > -0.01 and codes.max() < (1 << bits) - 1 + 0.01
    assert len(np.unique(np.rint(codes))) <= 1 << bits
    assert np.all(np.abs(out - x) <= scale / 2 + 2e-3 * (np.abs(x) + np.abs(lo)) + 1e-3)  # ½ step + fp16
    const = np.full((2, D), 1.25, np.float32)
    np.testing.assert_allclose(TurboQuantValues(bits).quantize(const), const)


def test_turboquant_boundary_layers_follow_vllm():
    assert turboquant_boundary_layers(32) == {0, 1, 30, 31}
    assert turboquant_boundary_layers(32, 0) == set()
    assert turboquant_boundary_layers(4) == {0, 1, 2, 3}
    assert turboquant_boundary_layers(8, 10) == set(range(8))
    assert turboquant_boundary_layers(30) == {0, 1, 28, 29}


def test_turboquant_bits_hand_counts():
    def tq(spec, num_layers=L):
        return parse_method(spec, num_layers=num_layers, num_kv_heads=HKV, head_dim=D)

    # D = 64, 3bit_nc: key 24 code bytes + 2 (fp16 norm), value 24 + 4 (fp16 scale, min) = 54-byte slot
    m = tq("turboquant:skip=0")
    assert m.slot_bytes(D) == (26, 28)
    assert bits_per_element(m, 2048, HKV, D) == pytest.approx(54 * 8 / 128) == pytest.approx(3.375)
    assert bits_per_element(m, 7, HKV, D) == pytest.approx(3.375)  # no windows: the same at any length
    assert bits_per_element(tq("turboquant:preset=k3v2_nc:skip=0"), 2048, HKV, D) == pytest.approx(46 * 8 / 128)
    assert bits_per_element(tq("turboquant:preset=k3v4_nc:skip=0"), 2048, HKV, D) == pytest.approx(62 * 8 / 128)
    assert bits_per_element(tq("turboquant:preset=4bit_nc:skip=0"), 2048, HKV, D) == pytest.approx(70 * 8 / 128)
    assert bits_per_element(tq("turboquant:preset=k8v4:skip=0"), 2048, HKV, D) == pytest.approx(100 * 8 / 128)
    # vLLM's default keeps 2 + 2 of SmolLM2's 30 layers in BF16
    assert bits_per_element(tq("turboquant", 30), 2048, HKV, D) == pytest.approx((26 * 3.375 + 4 * 16) / 30)
    assert bits_per_element(tq("turboquant"), 2048, HKV, D) == 16.0  # 2 layers: both are boundary layers
    # at D = 128 the 3bit_nc slot is 50 + 52 bytes = 3.1875 bits
    m128 = parse_method("turboquant:skip=0", num_layers=L, num_kv_heads=1, head_dim=128)
    assert bits_per_element(m128, 100, 1, 128) == pytest.approx(102 * 8 / 256)
    for preset in TURBOQUANT_PRESETS:
        assert sum(tq(f"turboquant:preset={preset}").slot_bytes(D)) % 2 == 0  # slot_size_aligned


def test_turboquant_tiers_rotation_and_options():
    m = parse_method("turboquant", num_layers=6, num_kv_heads=HKV, head_dim=D)
    assert isinstance(m, TurboQuantMethod) and m.skip_layers == {0, 1, 4, 5} and m.v_rotation is None
    iv = m.history_intervals(9)
    assert iv.k_start.tolist() == [0] * 9 and iv.k_end.tolist() == list(range(1, 10))  # itself included
    assert iv.v_end.tolist() == iv.k_end.tolist() and m.at_rest_history(9) == (0, 9, 0, 9)
    h = hadamard_matrix(D, np.float32)
    np.testing.assert_array_equal(m.k_rotation[2, 1], h)
    np.testing.assert_array_equal(m.k_rotation[0, 0], np.eye(D, dtype=np.float32))  # boundary: unrotated BF16
    x = np.random.default_rng(0).standard_normal((1, 3, HKV, D)).astype(np.float32)
    np.testing.assert_array_equal(m.quantize_keys(0, x), x)
    np.testing.assert_array_equal(m.quantize_values(5, x), x)
    assert not np.allclose(m.quantize_keys(2, x), x)
    r = parse_method("turboquant:rotation=random:seed=3:skip=0", num_layers=2, num_kv_heads=HKV, head_dim=D).k_rotation
    np.testing.assert_allclose(np.einsum("lkde,lkfe->lkdf", r, r), np.broadcast_to(np.eye(D), r.shape), atol=1e-5)
    assert not np.allclose(r[0, 0], r[0, 1])  # one per (layer, KV head)
    assert parse_method("turboquant:preset=k8v4", num_layers=2, num_kv_heads=HKV, head_dim=D).k_rotation is None
    assert m.describe()["preset"] == "turboquant_3bit_nc"
    for spec, match in (("turboquant:preset=2bit", "preset='2bit'"), ("turboquant:skip=-1", "skip=-1"),
                        ("turboquant:rotation=dct", "rotation='dct'"), ("turboquant:seed=1", "seed= applies"),
                        ("turboquant:group=32", "no option 'group'")):
        with pytest.raises(ValueError, match=match):
            parse_method(spec, num_layers=2, num_kv_heads=HKV, head_dim=D)
