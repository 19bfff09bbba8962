"""Streaming statistics and attention-aware errors against direct computations."""

import numpy as np
import pytest

from calibration.fit import causal_probabilities, key_logit_error, rotations, value_output_error
from calibration.statistics import SecondMoments, group_queries, surrogate_weights
from shared_math.codec import decode, encode


def test_streaming_equals_one_batch_and_groups_queries_by_kv_head():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(50, 6, 16))  # Hq 6, Hkv 2 → query heads 0-2 → kv 0, 3-5 → kv 1
    whole, streamed = SecondMoments(1, 2, 16), SecondMoments(1, 2, 16)
    whole.add(0, group_queries(q, 2))
    for chunk in np.array_split(q, 7):
        streamed.add(0, group_queries(chunk, 2))
    assert np.allclose(whole.covariance(), streamed.covariance(), rtol=1e-12)
    for kv in range(2):
        rows = q[:, 3 * kv : 3 * kv + 3].reshape(-1, 16)
        assert np.allclose(whole.covariance()[0, kv], rows.T @ rows / len(rows), rtol=1e-12)


def test_weighted_moments_and_surrogate_weights():
    rng = np.random.default_rng(1)
    k, v = rng.normal(size=(40, 2, 8)), rng.normal(size=(40, 2, 8))
    c_q = np.stack([np.eye(8) * 2, np.diag(np.arange(1.0, 9.0))])
    w = surrogate_weights(k, c_q)
    assert np.allclose(w[:, 0], 2 * (k[:, 0] ** 2).sum(-1))
    m = SecondMoments(1, 2, 8)
    m.add(0, v, weights=w)
    direct = np.einsum("n,nd,ne->de", w[:, 1], v[:, 1], v[:, 1]) / w[:, 1].sum()
    assert np.allclose(m.covariance()[0, 1], direct, rtol=1e-12)


def test_empty_moments_raise():
    with pytest.raises(ValueError, match="no tokens"):
        SecondMoments(1, 1, 4).covariance()


def test_errors_match_direct_formulas():
    rng = np.random.default_rng(2)
    t, hq, hkv, d, g = 12, 4, 2, 16, 16
    q, k, v = rng.normal(size=(t, hq, d)), rng.normal(size=(t, hkv, d)), rng.normal(size=(t, hkv, d))
    cov = np.stack([np.stack([np.cov(rng.normal(size=(64, d)), rowvar=False) for _ in range(hkv)])])
    rot = rotations(cov, "oscar")[0][0]
    kwargs = dict(group_size=g, clip_ratio=0.9, levels="minmax")
    num = den = 0.0
    for h in range(hq):
        r = rot[h // 2]
        kr = k[:, h // 2] @ r
        kq = decode(*encode(kr.astype(np.float32), group_size=g, clip_ratio=0.9), group_size=g)
        for i in range(t):
            for j in range(i + 1):
                num += ((q[i, h] @ r) @ (kr[j] - kq[j])) ** 2
                den += ((q[i, h] @ r) @ kr[j]) ** 2
    assert np.isclose(key_logit_error(q, k, rot, **kwargs), num / den, rtol=1e-9)
    probs = causal_probabilities(q, k)  # [Hkv, T·G, T]
    assert np.allclose(probs.sum(-1), 1) and probs[0, 0, 1] == 0
    # direct: softmax per query head over keys ≤ t, then S·(V − V̂)
    vr = np.einsum("thd,hde->the", v, rot)
    vq = decode(*encode(vr.astype(np.float32), group_size=g, clip_ratio=0.9), group_size=g)
    out, ref = np.zeros((t, hq, d)), np.zeros((t, hq, d))
    for h in range(hq):
        logits = q[:, h] @ k[:, h // 2].T / np.sqrt(d)
        logits[np.triu_indices(t, 1)] = -np.inf
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        assert np.allclose(probs[h // 2, h % 2 :: 2], p, atol=1e-12)
        out[:, h], ref[:, h] = p @ (vr - vq)[:, h // 2], p @ vr[:, h // 2]
    assert np.isclose(value_output_error(probs, v, rot, **kwargs), (out**2).sum() / (ref**2).sum(), rtol=1e-9)
    # no clipping and the identity rotation still quantizes: error must be positive and < 1
    assert 0 < key_logit_error(q, k, np.stack([np.eye(d)] * hkv), group_size=g, clip_ratio=1.0, levels="minmax") < 1


def test_per_layer_rotation_is_shared_by_heads():
    rng = np.random.default_rng(3)
    a = rng.normal(size=(2, 3, 64, 16))
    cov = np.einsum("lhnd,lhne->lhde", a, a) / 64
    rot, eig = rotations(cov, "oscar", per_layer=True)
    assert np.allclose(rot[:, 0], rot[:, 2]) and not np.allclose(rot[0], rot[1])
    per_head = rotations(cov, "oscar")[0]
    assert not np.allclose(per_head[0, 0], per_head[0, 1])
