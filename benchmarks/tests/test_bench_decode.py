"""bench_decode's SDPA baselines on the CPU: the decode form is the call a user writes (one query row
per head, `enable_gqa=True`), and both forms compute the same GQA attention as a float64 reference."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks import bench_decode


def _reference(q, k, v):
    """float64 GQA decode attention: q [B, Hq, d], k/v [B, Hkv, S, d]; query head h reads KV head
    h // (Hq / Hkv)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhd,bhsd->bhs", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhs,bhsd->bhd", p, v)


@pytest.mark.parametrize("form", sorted(bench_decode.SDPA_FORMS))
def test_both_sdpa_forms_compute_gqa_decode_attention(form):
    batch, hq, kv, seq, d = 2, 8, 2, 37, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, hq, d, generator=gen)
    k, v = (torch.randn(batch, kv, seq, d, generator=gen) for _ in range(2))
    q_sdpa, extra = bench_decode.sdpa_query(q, kv, form)
    out = F.scaled_dot_product_attention(q_sdpa, k, v, **extra).reshape(batch, hq, d)
    np.testing.assert_allclose(out.numpy(), _reference(q, k, v), rtol=1e-5, atol=1e-6)  # float32 softmax


def test_the_decode_form_is_the_users_call():
    q = torch.zeros(3, 32, 128)
    q_sdpa, extra = bench_decode.sdpa_query(q, 8, "decode")
    assert tuple(q_sdpa.shape) == (3, 32, 1, 128) and extra == {"enable_gqa": True}
    q_rows, extra = bench_decode.sdpa_query(q, 8, "rows_as_queries")
    assert tuple(q_rows.shape) == (3, 8, 4, 128) and extra == {}
    with pytest.raises(ValueError, match="'grouped'"):
        bench_decode.sdpa_query(q, 8, "grouped")


def test_every_sdpa_variant_is_a_bf16_baseline():
    names = {f"{b}{suffix}" for suffix in bench_decode.SDPA_FORMS.values() for b in ("cudnn_bf16", "flash2_bf16")}
    assert names | {"bf16_paged_pallas"} == set(bench_decode.BF16_VARIANTS)
    assert not set(bench_decode.INT2_DEFAULTS) & set(bench_decode.BF16_VARIANTS)
