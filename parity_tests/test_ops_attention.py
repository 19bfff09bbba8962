"""Attention ops of every implementation against the float64 reference: one suite for oscar_jax
(Pallas kernels, XLA path) and oscar_torch (Triton kernels) on the `backend` fixture, numpy in and
out through parity_tests.backends, the named cases and tolerances of parity_tests.cases.

Decode over ATTENTION_CASES, a partly valid last history page, pools written by one backend and
read by another, and prefill are test_parity.py's; each backend's own attention tests keep their
case lists, launch policy, layouts and compile checks.
"""

import numpy as np

from parity_tests import backends, cases


def test_long_split_keeps_the_code_bias_from_accumulating(backend):
    """The bf16 code bias cancels page by page (parity_tests.cases.BIAS_CANCELLATION_CASE): q = 0 over
    128 INT2 pages in one split, relative error in norm within BIAS_CANCELLATION_TOLERANCE."""
    case = cases.BIAS_CANCELLATION_CASE
    cache = cases.bias_cancellation_cache()
    q = np.zeros((1, case.num_kv_heads * case.heads_per_kv, case.head_dim), np.float32)
    out = backends.decode_attention(backend, case, cache.pools(), cache.tables(), q)
    assert out.dtype == np.float32 and out.shape == q.shape
    expected = cases.reference_decode(case, cache, np.zeros(q.shape))
    relative = np.linalg.norm(out.astype(np.float64) - expected) / np.linalg.norm(expected)
    print(f"{backend}: relative error {relative:.2e}")
    assert relative < cases.BIAS_CANCELLATION_TOLERANCE
