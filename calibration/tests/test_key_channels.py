"""`oscar:keys=channel[:kgroup=G][:krot=artifact|none|eigen|hadamard]`: KIVI's per-channel keys over whole
history pages, OSCAR's values, OSCAR's BF16 windows."""

import dataclasses

import jax
import numpy as np
import pytest

from calibration import passkey
from calibration.methods import KiviMethod, bits_per_element, hadamard_permutations, quantize_key_channels
from calibration.tests.test_evaluate import CFG, WordTokenizer, _haystack_docs
from calibration.tests.test_evaluate import build as build_cfg
from calibration.tests.test_methods import D, HKV, build, make_artifact
from oscar_jax.model import init_params
from shared_math.hadamard import hadamard_matrix
from shared_math.rotation import bit_reversal_permutation, rotation_from_covariance


@pytest.fixture(scope="module")
def art():
    return make_artifact()


def _keys(t, seed=0):
    return np.random.default_rng(seed).normal(size=(2, t, HKV, D)).astype(np.float32) * 3


@pytest.mark.parametrize("spec, group", [("oscar:keys=channel", 64), ("oscar:keys=channel:krot=none", 64),
                                         ("oscar:keys=channel:kgroup=32", 32)])
def test_keys_are_kivis_per_channel_codec_on_the_history_groups(art, spec, group):
    method = build(spec, art)
    sink = method.windows.sink
    t = sink + 3 * group + 21  # three whole groups and a partial one after the sink
    x = _keys(t)
    got = method.quantize_keys(0, x)
    kivi = KiviMethod("kivi2", group_size=group, residual=group).quantize_keys(0, x[:, sink:])
    assert np.array_equal(got[:, sink:], kivi)  # bit for bit, groups aligned on the history's start
    assert np.array_equal(got[:, :sink], x[:, :sink])  # the sink is never quantized
    assert np.array_equal(got[:, sink + 3 * group:], x[:, sink + 3 * group:])  # nor a partial group
    assert not np.array_equal(got[:, sink:sink + group], x[:, sink:sink + group])
    # the same function KIVI runs, started at the sink
    assert np.array_equal(got, quantize_key_channels(x, group, start=sink))


@pytest.mark.parametrize("spec", ["oscar:keys=channel", "oscar:keys=channel:krot=none",
                                  "oscar:keys=channel:krot=eigen", "oscar:keys=channel:krot=hadamard"])
def test_values_and_value_history_are_the_defaults_bit_for_bit(art, spec):
    method, default = build(spec, art), build("oscar", art)
    v = _keys(700, seed=1)
    for layer in range(2):
        assert np.array_equal(method.quantize_values(layer, v), default.quantize_values(layer, v))
    assert np.array_equal(method.v_rotation, default.v_rotation)
    ours, theirs = method.history_intervals(1000), default.history_intervals(1000)
    assert np.array_equal(ours.v_start, theirs.v_start) and np.array_equal(ours.v_end, theirs.v_end)
    assert np.array_equal(ours.k_start, theirs.k_start)
    # keys: only the whole groups of 64 tokens of the history, the rest of it in BF16
    count = theirs.k_end - theirs.k_start
    assert np.array_equal(ours.k_end, theirs.k_start + (count // 64) * 64)
    assert (ours.k_end < theirs.k_end).any() and (ours.k_end == theirs.k_end).any()
    assert method.at_rest_history(1000) == (64, 64 + 640, 64, 64 + 672)  # history 672 = 10½ groups


def test_key_rotation_option(art):
    assert np.array_equal(build("oscar:keys=channel", art).k_rotation, build("oscar", art).k_rotation)
    plain = build("oscar:keys=channel:krot=none", art)
    assert plain.k_rotation is None and plain.describe()["rotation"].endswith("keys: none")


def _calibrated_artifact(art, seed=0):
    """`art` with keys rotated as calibration rotates them: R_K = U·H·P from a covariance per (layer,
    KV head), its eigenvalues ascending (float32, as stored); returns the artifact and the U's."""
    rng = np.random.default_rng(seed)
    rotations, eigenvalues, us = (np.empty(art.k_rotation.shape[:2] + s) for s in ((D, D), (D,), (D, D)))
    for index in np.ndindex(*art.k_rotation.shape[:2]):
        a = rng.normal(size=(3 * D, D)) * rng.gamma(0.5, size=D)  # an uneven spectrum
        rotations[index], eigenvalues[index] = rotation_from_covariance(a.T @ a, "oscar")
        us[index] = rotation_from_covariance(a.T @ a, "eigen")[0]
    return dataclasses.replace(art, k_rotation=rotations.astype(np.float32),
                               k_eigenvalues=eigenvalues.astype(np.float32)), us


def test_eigen_and_hadamard_key_rotations_split_r_k(art):
    """krot=eigen is U and krot=hadamard is H·P of the artifact's R_K = U·H·P: U·(H·P) gives R_K back,
    U is the calibration's eigenbasis, H·P is shared_math's Hadamard times the bit-reversal placement of
    the stored eigenvalues; both orthogonal. The values and the key codec are krot=artifact's."""
    cal, us = _calibrated_artifact(art)
    eigen, hadamard = (build(f"oscar:keys=channel:krot={k}", cal) for k in ("eigen", "hadamard"))
    reference = build("oscar:keys=channel", cal)
    for m in (eigen, hadamard):
        assert m.k_rotation.shape == reference.k_rotation.shape and m.k_rotation.dtype == np.float32
        assert np.abs(np.swapaxes(m.k_rotation, -1, -2) @ m.k_rotation - np.eye(D)).max() < 1e-5
        assert np.array_equal(m.v_rotation, reference.v_rotation) and m.key_group == reference.key_group
    assert np.abs(eigen.k_rotation.astype(np.float64) @ hadamard.k_rotation - cal.k_rotation).max() < 1e-5
    assert np.abs(eigen.k_rotation - us).max() < 1e-5
    for index in np.ndindex(*cal.k_rotation.shape[:2]):
        hp = hadamard_matrix(D) @ bit_reversal_permutation(cal.k_eigenvalues[index])
        assert np.array_equal(hadamard.k_rotation[index], hp.astype(np.float32))
    # any artifact: U = R_K·(H·P)ᵀ reproduces R_K
    hp = hadamard_permutations(art.k_eigenvalues)
    u = build("oscar:keys=channel:krot=eigen", art).k_rotation
    assert np.abs(u.astype(np.float64) @ hp - art.k_rotation).max() < 1e-5
    assert not np.allclose(u, art.k_rotation, atol=1e-2) and not np.allclose(hp, art.k_rotation, atol=1e-2)
    assert eigen.describe()["rotation"].endswith("keys: U of R_K = U·H·P per layer and KV head")
    assert hadamard.describe()["rotation"].endswith("keys: H·P of R_K (no U) per layer and KV head")


def test_bits(art):
    # 128K, D = 64: history 130,752 = 2,043 whole groups of 64 → the keys cost what per-token rows
    # cost (64 channels × (16 code bytes + 4 B) per 64 tokens = 20 B per token): the default's 2.533
    method, default = build("oscar:keys=channel", art), build("oscar", art)
    assert bits_per_element(method, 131072, HKV, D) == bits_per_element(default, 131072, HKV, D)
    assert bits_per_element(method, 131072, HKV, D) == pytest.approx((320 * 128 + 130752 * 20) * 8 / (131072 * 64))
    assert round(bits_per_element(method, 131072, HKV, D), 3) == 2.533
    # 1000 tokens: history 672 = 10 groups + 32 tokens still BF16 keys; values as the default
    k, v = method.kv_bytes(1000, HKV, D)
    k_default, v_default = default.kv_bytes(1000, HKV, D)
    assert v == v_default
    assert k == HKV * ((1000 - 640) * 128 + 10 * 64 * 20)
    assert k - k_default == HKV * 32 * (128 - 20)
    assert bits_per_element(method, 1000, HKV, D) == pytest.approx(8 * (k + v) / (2 * 1000 * HKV * D))
    # kgroup=32: 64 channels × (8 + 4 B) per 32 tokens = 24 B per token → 3 bits per key element
    k32, _ = build("oscar:keys=channel:kgroup=32", art).kv_bytes(131072, HKV, D)
    assert k32 == HKV * (320 * 128 + 130752 * 24)
    # salient tokens with per-channel keys: a BF16 row and half a 32-bit index on each side, on top
    k_s, v_s = build("oscar:keys=channel:salient=8", art).kv_bytes(1000, HKV, D)
    assert (k_s - k, v_s - v) == (HKV * 8 * (128 + 2), HKV * 8 * (128 + 2))


@pytest.mark.parametrize("spec, message", [
    ("oscar:keys=chanel", "keys='chanel' must be one of"),
    ("oscar:kgroup=64", "kgroup= and krot= apply only with keys=channel"),
    ("oscar:krot=none", "kgroup= and krot= apply only with keys=channel"),
    ("oscar:keys=channel:krot=random", "krot='random' must be one of"),
    ("oscar:keys=channel:krot=Eigen", "krot='Eigen' must be one of"),
    ("oscar:krot=eigen", "kgroup= and krot= apply only with keys=channel"),
    ("oscar:keys=channel:kgroup=48", "kgroup=48 must be a power of two"),
    ("oscar:keys=channel:kgroup=8", "kgroup=8 must be a power of two"),
    ("oscar:keys=channel:kgroup=16:page=32", "kgroup=16 .* multiple of page=32"),
    ("oscar:keys=channel:kgroup=x", "kgroup='x' must be an integer"),
    ("kivi2:keys=channel", "has no option 'keys'"),
])
def test_refusals_name_the_bad_value(art, spec, message):
    with pytest.raises(ValueError, match=message):
        build(spec, art)


def test_passkey_answer_reads_whole_groups_only():
    """End to end on a tiny model: the option runs through passkey's answer path; the prompt pass
    (float32, no cache reads) is the default's exactly, the answer steps read other keys than the
    default's and differ between the two key bases, and the stored history holds whole key groups
    only (the trailing partial group stays BF16). Which keys a step reads is checked by
    history_intervals in test_values_and_value_history_are_the_defaults_bit_for_bit."""
    params = init_params(CFG, jax.random.PRNGKey(0), std=0.2)
    art = make_artifact(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
    sample = passkey.build_sample(WordTokenizer(), _haystack_docs(), 120, 0.4, "27182")
    methods = [build_cfg(s, art) for s in ("oscar:windows=16/16", "oscar:windows=16/16:keys=channel:kgroup=32",
                                           "oscar:windows=16/16:keys=channel:kgroup=32:krot=none")]
    got = passkey.answer_logits(params, CFG, sample, methods, query_chunk=16)
    p = len(sample.prompt)
    assert methods[1].at_rest_history(p) == (16, 16 + 64, 16, 16 + 80)  # 2 groups of 32 + 16 BF16 keys
    default, channel, plain = (got[m.name] for m in methods)
    assert np.array_equal(default[0], channel[0]) and np.array_equal(default[0], plain[0])  # prompt pass
    assert np.abs(channel[1:] - default[1:]).max() > 1e-4 and np.abs(plain[1:] - channel[1:]).max() > 1e-4


def _channel_artifact(art):
    """The test artifact as if calibrated with `--key-layout channel` (its key clips 0.9 … 0.96)."""
    return dataclasses.replace(art, codec=dict(art.codec, key_layout="channel"))


def test_channel_artifact_key_clips_are_used_over_each_group(art):
    """An artifact calibrated for per-channel keys: keys=channel clips each channel over a group's G
    values with the layer's key clip ratio; a v1 artifact keeps clip 1 (runs 14-15), bit for bit."""
    channel = _channel_artifact(art)
    fitted, v1 = build("oscar:keys=channel", channel), build("oscar:keys=channel", art)
    assert v1.key_clip is None and v1.describe()["k_clip_ratio"] == 1.0
    assert fitted.key_clip == tuple(float(c) for c in art.k_clip_ratio)
    assert fitted.describe()["k_clip_ratio"] == list(fitted.key_clip)
    sink = fitted.windows.sink
    x = _keys(sink + 2 * 64 + 10)
    for layer in range(2):
        c = float(art.k_clip_ratio[layer])
        got = fitted.quantize_keys(layer, x)
        assert np.array_equal(got, quantize_key_channels(x, 64, start=sink, clip_ratio=c))
        assert not np.array_equal(got, v1.quantize_keys(layer, x))  # k = ⌊c·64⌋ < 63: a clip
        assert np.array_equal(v1.quantize_keys(layer, x), quantize_key_channels(x, 64, start=sink))
    # the clip index is over the group's tokens: c = 0.99 → ⌊0.99·64⌋ = 63 = no clip at G = 64
    assert np.array_equal(build("oscar:keys=channel:clip=0.99/0.92", channel).quantize_keys(0, x),
                          v1.quantize_keys(0, x))
    # values stay the artifact's (per token, its value clips)
    assert np.array_equal(fitted.quantize_values(1, x), v1.quantize_values(1, x))


def test_channel_artifact_keys_default_to_channel_and_refuse_token(art):
    channel = _channel_artifact(art)
    assert build("oscar", channel).key_group == 64 and build("oscar", art).key_group == 0
    with pytest.raises(ValueError, match="keys=token with an artifact calibrated for per-channel keys"):
        build("oscar:keys=token", channel)
