"""The SmolLM2 artifacts that ship in the package — the product default (moment-placed levels, no
clip: QUALITY.md) and the paper's configuration kept as the reference — valid, and each reproduced
by the command recorded in it."""

import shlex

import numpy as np
import pytest

from calibration.__main__ import main
from oscar_jax.generate import shipped_artifact
from shared_math.artifact import ModelFingerprint, read_artifact
from shared_math.hadamard import hadamard_matrix
from shared_math.rotation import bit_reversal_permutation

DOCUMENTED = "python -m calibration --model-path smollm2-135m --calib-data wiki --calib-tokens 8192 --output-dir"
SHIPPED = {  # directory under oscar_jax/artifacts → (options after the output dir, levels, K clip, V clip)
    "smollm2-135m": ("--levels moments --k-clip-ratio 1.0 --v-clip-ratio 1.0", "moments", 1.0, 1.0),
    "smollm2-135m-paper": ("", "minmax", 0.96, 0.92),
}
SMOLLM2 = ModelFingerprint(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_artifact_is_valid_and_documented(name):
    options, levels, k_clip, v_clip = SHIPPED[name]
    path = shipped_artifact(name)
    assert path is not None
    art = read_artifact(path, expected_model=SMOLLM2)
    assert art.k_rotation.shape == art.v_rotation.shape == (30, 3, 64, 64)
    assert art.provenance["command"] == f"{DOCUMENTED} oscar_jax/artifacts/{name} {options}".strip()
    assert art.provenance["calibration_tokens"] == 8192 and art.provenance["data"] == "wiki"
    assert art.levels == levels and art.group_size == 64
    np.testing.assert_array_equal(art.k_clip_ratio, np.float32(k_clip))  # stored as float32
    np.testing.assert_array_equal(art.v_clip_ratio, np.float32(v_clip))


def test_default_and_paper_artifacts_share_their_rotations():
    """Levels and clip do not enter the rotations (calibration.calibrate): the two artifacts differ
    only in the codec, so QUALITY.md's comparison between them isolates the codec."""
    default, paper = (read_artifact(shipped_artifact(n)) for n in ("smollm2-135m", "smollm2-135m-paper"))
    assert np.array_equal(default.k_rotation, paper.k_rotation)
    assert np.array_equal(default.v_rotation, paper.v_rotation)


def _covariances(rotation, eigenvalues):
    """U·diag(λ)·Uᵀ with U = R·Pᵀ·H: independent of eigenvector signs, so comparable across BLAS builds."""
    h = hadamard_matrix(rotation.shape[-1])
    out = np.empty(rotation.shape)
    for idx in np.ndindex(rotation.shape[:2]):
        lam = eigenvalues[idx].astype(np.float64)
        u = rotation[idx].astype(np.float64) @ bit_reversal_permutation(lam).T @ h
        out[idx] = (u * lam) @ u.T
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_documented_command_reproduces_the_shipped_artifact(name, tmp_path):
    shipped = read_artifact(shipped_artifact(name))
    argv = shlex.split(shipped.provenance["command"])[3:]  # drop "python -m calibration"
    out = argv.index("--output-dir") + 1
    argv[out] = str(tmp_path)
    assert main([*argv, "--no-progress"]) == 0
    again = read_artifact(tmp_path, expected_model=SMOLLM2)
    for kv in ("k", "v"):
        lam_a, lam_b = getattr(shipped, f"{kv}_eigenvalues"), getattr(again, f"{kv}_eigenvalues")
        assert np.allclose(lam_a, lam_b, rtol=1e-4, atol=1e-6 * lam_a.max())
        cov_a = _covariances(getattr(shipped, f"{kv}_rotation"), lam_a)
        cov_b = _covariances(getattr(again, f"{kv}_rotation"), lam_b)
        assert np.abs(cov_a - cov_b).max() <= 1e-4 * np.abs(cov_a).max()
    assert again.codec == shipped.codec
    assert np.array_equal(shipped.k_clip_ratio, again.k_clip_ratio)
    assert np.array_equal(shipped.v_clip_ratio, again.v_clip_ratio)
