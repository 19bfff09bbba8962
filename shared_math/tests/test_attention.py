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
from shared_math.codec import decode, decode_channels, encode, encode_channels, unpack_codes

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


def test_mixed_tier_with_per_channel_key_pages():
    """Format v2: history keys as pages quantized per channel; the reference reads page p's row t
    as history token p·L + t, and a page's scores are (q ⊙ s)·c + q·m — one scaled query and one
    bias per page, the form the kernels will use."""
    rng = np.random.default_rng(8)
    d, hkv, hq, page, pages = 64, 2, 6, 16, 5
    sink = rng.normal(size=(16, hkv, d)), rng.normal(size=(16, hkv, d))
    recent = rng.normal(size=(37, hkv, d)), rng.normal(size=(37, hkv, d))
    hist_k = rng.normal(size=(pages * page, hkv, d)) * np.linspace(0.2, 5, d)  # channels of unequal range
    hist_v = rng.normal(size=(pages * page, hkv, d))
    k_pages = encode_channels(hist_k.reshape(pages, page, hkv, d).transpose(0, 2, 1, 3), clip_ratio=1.0)
    vq = encode(hist_v, group_size=d, clip_ratio=0.92)
    q = rng.normal(size=(hq, d))
    out = mixed_tier_decode_attention(q, sink=sink, history=(k_pages, vq), recent=recent, group_size=d,
                                      softmax_scale=d**-0.5, chunk_size=24, key_layout="channel")
    k_hist = decode_channels(*k_pages).transpose(0, 2, 1, 3).reshape(pages * page, hkv, d)
    assert np.abs(k_hist - hist_k).max() <= np.float64(k_pages[1].max()) / 2 + 1e-6  # half a step
    k_all = np.concatenate([sink[0], k_hist, recent[0]])
    v_all = np.concatenate([sink[1], decode(*vq, group_size=d), recent[1]])
    assert np.abs(out - softmax_attention(q, k_all, v_all, softmax_scale=d**-0.5)).max() < TOL
    # the per-page score identity, page 2, KV head 1, its first query head
    codes = unpack_codes(k_pages[0][2, 1]).astype(np.float64)  # [L, D]
    s, m = (a[2, 1].astype(np.float64) for a in k_pages[1:])
    direct = k_hist[2 * page: 3 * page, 1] @ q[hq // hkv]
    assert np.abs(codes @ (q[hq // hkv] * s) + q[hq // hkv] @ m - direct).max() < 1e-9
    with pytest.raises(ValueError, match="key_layout='rows'"):
        mixed_tier_decode_attention(q, sink=sink, history=(k_pages, vq), recent=recent, group_size=d,
                                    softmax_scale=1.0, key_layout="rows")


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
