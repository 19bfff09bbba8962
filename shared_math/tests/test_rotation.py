"""Hadamard, bit reversal and the OSCAR rotation U·H·P."""

import numpy as np
import pytest

from shared_math.hadamard import fwht, hadamard_matrix
from shared_math.rotation import (
    BF16_SPLIT_PARTS,
    ROTATION_KINDS,
    bit_reversal_permutation,
    bit_reverse_indices,
    oscar_rotation,
    rotation_from_covariance,
    split_bf16,
)


def _random_cov(d, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(4 * d, d)) * np.geomspace(10, 0.1, d)  # a spiky spectrum
    return a.T @ a / (4 * d)


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128])
def test_hadamard_is_symmetric_orthogonal_and_matches_fwht(d):
    h = hadamard_matrix(d)
    assert np.allclose(h, h.T) and np.allclose(h @ h, np.eye(d), atol=1e-12)
    assert np.all(np.abs(np.abs(h) * np.sqrt(d) - 1) < 1e-12)  # entries ±1/√d
    x = np.random.default_rng(d).normal(size=(3, 2, d))
    assert np.allclose(fwht(x), x @ h, atol=1e-12)
    assert fwht(x.astype(np.float32)).dtype == np.float32


def test_hadamard_sylvester_order():
    h = hadamard_matrix(4) * 2
    assert h.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="d=12"):
        hadamard_matrix(12)
    with pytest.raises(ValueError, match="d=24"):
        fwht(np.zeros((2, 24)))


@pytest.mark.parametrize("d", [16, 64, 128])
def test_lemma_1_hadamard_flattens_a_diagonal_spectrum(d):
    lam = np.diag(np.random.default_rng(1).exponential(size=d) ** 3)
    h = hadamard_matrix(d)
    assert np.allclose(np.diag(h.T @ lam @ h), np.trace(lam) / d, rtol=1e-12)


def test_bit_reverse_indices():
    assert bit_reverse_indices(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert bit_reverse_indices(128)[:4].tolist() == [0, 64, 32, 96]
    assert bit_reverse_indices(1).tolist() == [0]
    with pytest.raises(ValueError, match="d=6"):
        bit_reverse_indices(6)


def test_permutation_places_rank_i_at_bit_reversed_position():
    eig = np.array([0.5, 3.0, 1.0, 2.0, 2.0, 0.1, 9.0, 4.0])  # a tie at 2.0: stable keeps index 3 first
    p = bit_reversal_permutation(eig)
    order = [6, 7, 1, 3, 4, 2, 0, 5]  # stable descending argsort
    z = np.arange(8.0)
    y = z @ p
    for rank, channel in enumerate(order):
        assert y[bit_reverse_indices(8)[rank]] == z[channel]


@pytest.mark.parametrize("d,group", [(16, 4), (64, 16), (128, 32), (128, 64), (128, 128)])
def test_every_group_holds_one_channel_of_every_importance_level(d, group):
    eig = np.random.default_rng(d).permutation(d).astype(float)
    p = bit_reversal_permutation(eig)
    rank_of_channel = np.empty(d, int)
    rank_of_channel[np.argsort(-eig, kind="stable")] = np.arange(d)
    rank_at_position = rank_of_channel[np.argmax(p, axis=0)]  # which channel lands at each position
    levels_per_group = rank_at_position.reshape(d // group, group) // (d // group)
    for g in levels_per_group:
        assert sorted(g.tolist()) == list(range(group))


@pytest.mark.parametrize("d", [16, 64, 128])
def test_oscar_rotation_is_u_h_p_orthogonal_and_equalises_importance(d):
    cov = _random_cov(d, d)
    r = oscar_rotation(cov)
    eig, u = np.linalg.eigh(cov)
    expected = u @ hadamard_matrix(d) @ bit_reversal_permutation(eig)
    assert np.allclose(r, expected, atol=1e-12)
    assert np.allclose(r.T @ r, np.eye(d), atol=1e-12)
    diag = np.diag(r.T @ cov @ r)
    assert np.allclose(diag, np.trace(cov) / d, rtol=1e-9)


def test_rotation_kinds():
    d = 32
    cov = _random_cov(d, 3)
    eig, u = np.linalg.eigh(cov)
    h = hadamard_matrix(d)
    want = {"identity": np.eye(d), "hadamard": h, "eigen": u, "eigen_hadamard": u @ h, "oscar": oscar_rotation(cov)}
    assert set(want) == set(ROTATION_KINDS)
    for kind, r in want.items():
        got, ev = rotation_from_covariance(cov, kind)
        assert np.allclose(got, r, atol=1e-12), kind
        assert np.all(np.diff(ev) >= 0)
    with pytest.raises(ValueError, match="kind='qr'"):
        rotation_from_covariance(cov, "qr")
    with pytest.raises(ValueError, match="square"):
        oscar_rotation(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="non-finite"):
        oscar_rotation(np.full((16, 16), np.nan))
    with pytest.raises(ValueError, match="power of two"):
        oscar_rotation(np.eye(12))


def test_split_bf16_parts_are_round_to_nearest_even_bfloat16_and_sum_to_r():
    """Each part is the RNE bfloat16 of what the earlier parts leave (ml_dtypes as the oracle),
    and three parts hold a float32 rotation to its last bit."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    r = np.linalg.qr(rng.standard_normal((3, 128, 128)))[0].astype(np.float32)
    r[0, 0, :4] = [0.0, -0.0, 1.0, -2.0**-30]  # zeros, an exact bfloat16, a tiny value
    parts = split_bf16(r)
    assert len(parts) == BF16_SPLIT_PARTS
    rest = r
    for part in parts:
        assert part.dtype == np.float32 and not np.any(part.view(np.uint32) & 0xFFFF)
        np.testing.assert_array_equal(part, rest.astype(ml_dtypes.bfloat16).astype(np.float32))
        rest = rest - part
    total = parts[0].astype(np.float64) + parts[1] + parts[2]
    assert np.mean(total == r) > 0.999 and np.max(np.abs(total - r)) <= 2.0**-24 * np.max(np.abs(r))
    assert np.all([np.array_equal(a, -b) for a, b in zip(split_bf16(-r), parts)])  # sign symmetric
