"""Split-K attention with log-sum-exp merge equals one-pass softmax (float64, 1e-12)."""

import numpy as np
import pytest

from shared_math.attention import (
    attention_partial,
    merge_partials,
    mixed_tier_decode_attention,
    softmax_attention,
    split_attention,
)
from shared_math.codec import decode, encode

TOL = 1e-12


@pytest.mark.parametrize("s,hq,hkv,chunk", [(1, 1, 1, 4), (37, 9, 3, 8), (513, 32, 8, 64), (100, 4, 4, 100)])
def test_split_merge_equals_one_pass(s, hq, hkv, chunk):
    rng = np.random.default_rng(s)
    q = rng.normal(size=(hq, 64)) * 3
    k = rng.normal(size=(s, hkv, 64))
    v = rng.normal(size=(s, hkv, 64))
    ref = softmax_attention(q, k, v, softmax_scale=0.125)
    assert np.abs(split_attention(q, k, v, softmax_scale=0.125, chunk_size=chunk) - ref).max() < TOL


def test_merge_ignores_empty_chunks_and_returns_lse():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(2, 16)), rng.normal(size=(10, 1, 16)), rng.normal(size=(10, 1, 16))
    o1, l1 = attention_partial(q, k[:4], v[:4], softmax_scale=1.0)
    o0, l0 = attention_partial(q, k[:0], v[:0], softmax_scale=1.0)
    o2, l2 = attention_partial(q, k[4:], v[4:], softmax_scale=1.0)
    out, lse = merge_partials([o1, o0, o2], [l1, l0, l2])
    assert np.abs(out - softmax_attention(q, k, v, softmax_scale=1.0)).max() < TOL
    full = np.log(np.exp(np.einsum("hd,sd->hs", q, k[:, 0])).sum(-1))
    assert np.abs(lse - full).max() < TOL


def test_mixed_tier_equals_softmax_over_dequantized_cache():
    rng = np.random.default_rng(7)
    d, hkv, hq, g = 64, 3, 9, 32
    sink = rng.normal(size=(64, hkv, d)), rng.normal(size=(64, hkv, d))
    hist_k, hist_v = rng.normal(size=(96, hkv, d)), rng.normal(size=(96, hkv, d))
    recent = rng.normal(size=(261, hkv, d)), rng.normal(size=(261, hkv, d))
    kq = encode(hist_k, group_size=g, clip_ratio=0.96)
    vq = encode(hist_v, group_size=g, clip_ratio=0.92)
    q = rng.normal(size=(hq, d))
    out = mixed_tier_decode_attention(q, sink=sink, history=(kq, vq), recent=recent, group_size=g,
                                      softmax_scale=d**-0.5, chunk_size=48)
    k_all = np.concatenate([sink[0], decode(*kq, group_size=g), recent[0]])
    v_all = np.concatenate([sink[1], decode(*vq, group_size=g), recent[1]])
    assert np.abs(out - softmax_attention(q, k_all, v_all, softmax_scale=d**-0.5)).max() < TOL


def test_bad_shapes():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        softmax_attention(np.zeros((5, 16)), np.zeros((3, 2, 16)), np.zeros((3, 2, 16)), softmax_scale=1.0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        split_attention(np.zeros((2, 16)), np.zeros((3, 2, 16)), np.zeros((3, 2, 16)), softmax_scale=1.0, chunk_size=0)
    empty = np.zeros((0, 1, 16))
    e = encode(empty, group_size=16, clip_ratio=1.0)
    with pytest.raises(ValueError, match="empty"):
        mixed_tier_decode_attention(np.zeros((1, 16)), sink=(empty, empty), history=(e, e), recent=(empty, empty),
                                    group_size=16, softmax_scale=1.0)
