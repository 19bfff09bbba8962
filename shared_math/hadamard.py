"""The normalised Sylvester–Hadamard matrix and the fast Walsh–Hadamard transform.

H_1 = [1], H_2n = [[H_n, H_n], [H_n, −H_n]], scaled by 1/√d so that H = Hᵀ = H⁻¹.
`fwht(x)` computes x·H along the last axis in O(d log d) and agrees with `x @ hadamard_matrix(d)`.
"""

from __future__ import annotations

import numpy as np

from shared_math.spec import is_power_of_two


def _check_dim(d: int) -> None:
    if not is_power_of_two(d):
        raise ValueError(f"Hadamard dimension {d=} must be a power of two")


def hadamard_matrix(d: int, dtype=np.float64) -> np.ndarray:
    """Sylvester-ordered Walsh–Hadamard matrix of size d × d, scaled by 1/√d."""
    _check_dim(d)
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(d)).astype(dtype)


def fwht(x: np.ndarray) -> np.ndarray:
    """x·H over the last axis (normalised, Sylvester order), in the input's float dtype."""
    x = np.asarray(x)
    d = x.shape[-1]
    _check_dim(d)
    dtype = x.dtype if np.issubdtype(x.dtype, np.floating) else np.float64
    y = x.astype(dtype, copy=True).reshape(-1, d)
    h = 1
    while h < d:
        # Butterfly on pairs (i, i + h) inside blocks of 2h.
        y = y.reshape(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2)
        h *= 2
    return y.reshape(x.shape) * np.dtype(dtype).type(1.0 / np.sqrt(d))
