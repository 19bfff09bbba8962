"""Attention-aware rotations: R = U·H·P from a covariance (OSCAR_SPEC §2), and ablation variants.

Row-vector convention: a rotated key is k' = k·R. U holds the eigenvectors of the covariance as
columns in numpy's `eigh` order (ascending eigenvalues); H is the normalised Sylvester Hadamard;
P is the bit-reversal placement: with `order` the stable descending argsort of the eigenvalues,
output position br(i) takes channel order[i], so every power-of-two group of output channels
holds one channel of each importance level.
"""

from __future__ import annotations

import numpy as np

from shared_math.float_bits import bf16_rounded_bits
from shared_math.hadamard import hadamard_matrix
from shared_math.spec import is_power_of_two

ROTATION_KINDS = ("identity", "hadamard", "eigen", "eigen_hadamard", "oscar")

# The fused key rotation of bfloat16 rows runs as three bfloat16 tensor-core products, k·hi +
# k·mid + k·lo with R = hi + mid + lo (each part the round-to-nearest-even bfloat16 of what the
# previous parts leave): a bfloat16 row times a bfloat16 part is exact in float32, so the sum
# keeps ~24 bits of R, as the float32 product does (benchmarks/DECISIONS.md W1). Not part of the
# format: the rotation's rounding is not pinned, only the encoding of the rotated row.
BF16_SPLIT_PARTS = 3


def split_bf16(rotation, *, to_bits=lambda a: a.view(np.int32), from_bits=lambda b: b.view(np.float32)):
    """float32 R [..., D, D] → [hi, mid, lo], float32 arrays holding bfloat16 values, R ≈ hi + mid + lo.

    Integer rounding on the float32 bits, so that every array library gives the same parts (a
    compiler may elide a float32 → bfloat16 → float32 cast pair; it cannot elide integer ops).
    `to_bits` / `from_bits` bitcast float32 ↔ int32 for the caller's array type (NumPy by
    default; the JAX and torch launchers pass their own). R must be finite (a rotation is).
    """
    parts, rest = [], rotation
    for _ in range(BF16_SPLIT_PARTS):
        part = from_bits(bf16_rounded_bits(to_bits(rest)))
        parts.append(part)
        rest = rest - part  # exact: the part holds rest's leading 8 significant bits
    return parts


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
