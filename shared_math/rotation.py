"""Attention-aware rotations: R = U·H·P from a covariance (OSCAR_SPEC §2), and ablation variants.

Row-vector convention: a rotated key is k' = k·R. U holds the eigenvectors of the covariance as
columns in numpy's `eigh` order (ascending eigenvalues); H is the normalised Sylvester Hadamard;
P is the bit-reversal placement: with `order` the stable descending argsort of the eigenvalues,
output position br(i) takes channel order[i], so every power-of-two group of output channels
holds one channel of each importance level.
"""

from __future__ import annotations

import numpy as np

from shared_math.hadamard import hadamard_matrix
from shared_math.spec import is_power_of_two

ROTATION_KINDS = ("identity", "hadamard", "eigen", "eigen_hadamard", "oscar")


def bit_reverse_indices(d: int) -> np.ndarray:
    """br(i) for i in 0..d−1: i with its log2(d) bits reversed (int64)."""
    if not is_power_of_two(d):
        raise ValueError(f"{d=} must be a power of two")
    bits = d.bit_length() - 1
    return np.array([int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(d)], np.int64)


def bit_reversal_permutation(eigenvalues: np.ndarray) -> np.ndarray:
    """The d × d permutation matrix P with P[order[i], br(i)] = 1 (so (z·P)[br(i)] = z[order[i]])."""
    eigenvalues = np.asarray(eigenvalues, np.float64)
    if eigenvalues.ndim != 1:
        raise ValueError(f"eigenvalues must be 1-D, got shape {eigenvalues.shape}")
    d = eigenvalues.shape[0]
    order = np.argsort(-eigenvalues, kind="stable")
    p = np.zeros((d, d))
    p[order, bit_reverse_indices(d)] = 1.0
    return p


def eigh_ascending(cov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetrised float64 eigendecomposition: (eigenvalues ascending, eigenvectors as columns)."""
    cov = np.asarray(cov, np.float64)
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"covariance must be square, got shape {cov.shape}")
    if not np.all(np.isfinite(cov)):
        raise ValueError("covariance has non-finite entries")
    return np.linalg.eigh(0.5 * (cov + cov.T))


def rotation_from_covariance(cov: np.ndarray, kind: str = "oscar") -> tuple[np.ndarray, np.ndarray]:
    """(R float64 d×d, eigenvalues ascending) for one of ROTATION_KINDS.

    identity: I; hadamard: H; eigen: U; eigen_hadamard: U·H; oscar: U·H·P.
    The covariance may be any PSD target (C_Q, C_S, KᵀK, VᵀV).
    """
    if kind not in ROTATION_KINDS:
        raise ValueError(f"{kind=} must be one of {ROTATION_KINDS}")
    eigenvalues, u = eigh_ascending(cov)
    d = u.shape[0]
    if kind != "identity" and kind != "eigen" and not is_power_of_two(d):
        raise ValueError(f"head_dim {d=} must be a power of two for a Hadamard rotation")
    if kind == "identity":
        r = np.eye(d)
    elif kind == "hadamard":
        r = hadamard_matrix(d)
    elif kind == "eigen":
        r = u
    elif kind == "eigen_hadamard":
        r = u @ hadamard_matrix(d)
    else:
        r = u @ hadamard_matrix(d) @ bit_reversal_permutation(eigenvalues)
    return r, eigenvalues


def oscar_rotation(cov: np.ndarray) -> np.ndarray:
    """R = U·H·P (float64, d × d) from a covariance: OSCAR_SPEC §2 exactly."""
    return rotation_from_covariance(cov, "oscar")[0]
