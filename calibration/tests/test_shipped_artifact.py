"""The SmolLM2 artifact that ships in the package: valid, and reproduced by its documented command."""

import shlex

import numpy as np
import pytest

from calibration.__main__ import main
from oscar_jax.generate import shipped_artifact
from shared_math.artifact import ModelFingerprint, read_artifact
from shared_math.hadamard import hadamard_matrix
from shared_math.rotation import bit_reversal_permutation

DOCUMENTED = "python -m calibration --model-path smollm2-135m --calib-data wiki --calib-tokens 8192 --output-dir"
SMOLLM2 = ModelFingerprint(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64)


def test_shipped_artifact_is_valid_and_documented():
    path = shipped_artifact("smollm2-135m")
    assert path is not None
    art = read_artifact(path, expected_model=SMOLLM2)
    assert art.k_rotation.shape == art.v_rotation.shape == (30, 3, 64, 64)
    assert art.provenance["command"].startswith(DOCUMENTED)
    assert art.provenance["calibration_tokens"] == 8192 and art.provenance["data"] == "wiki"


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
def test_documented_command_reproduces_the_shipped_artifact(tmp_path):
    shipped = read_artifact(shipped_artifact("smollm2-135m"))
    argv = shlex.split(shipped.provenance["command"])[3:]  # drop "python -m calibration"
    out = argv.index("--output-dir") + 1
    argv[out] = str(tmp_path)
    assert main([*argv, "--no-progress"]) == 0
    again = read_artifact(tmp_path, expected_model=SMOLLM2)
    for name in ("k", "v"):
        lam_a, lam_b = getattr(shipped, f"{name}_eigenvalues"), getattr(again, f"{name}_eigenvalues")
        assert np.allclose(lam_a, lam_b, rtol=1e-4, atol=1e-6 * lam_a.max())
        cov_a = _covariances(getattr(shipped, f"{name}_rotation"), lam_a)
        cov_b = _covariances(getattr(again, f"{name}_rotation"), lam_b)
        assert np.abs(cov_a - cov_b).max() <= 1e-4 * np.abs(cov_a).max()
    assert np.array_equal(shipped.k_clip_ratio, again.k_clip_ratio)
