"""Prefill attention (a chunk over itself in full precision + its cached prefix through the tiers):
the Triton-only claims. Prefill vs the float64 reference, every backend over
parity_tests.cases.PREFILL_CASES, is parity_tests/test_ops_attention.py's.

Reference: float64 NumPy (parity_tests.cases.reference_prefill) — the prefix dequantized from the
very pages the kernels read, concatenated with the chunk's own K/V, causal over the chunk; the
tolerance table is THE one of parity_tests.cases (keyed by q's dtype).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar_torch import ops
from oscar_torch.tests.util import TORCH_DTYPES, attention_kwargs, cache_arrays, to_torch
from parity_tests.cases import PREFILL_CASES, assert_close, build_cache, reference_prefill


def _chunk(case):
    q, k_new, v_new = case.chunk_arrays()
    return (to_torch(q).to(TORCH_DTYPES[case.prefix.q_dtype]), to_torch(k_new).to(TORCH_DTYPES[case.kv_dtype]),
            to_torch(v_new).to(TORCH_DTYPES[case.kv_dtype]))


def run_prefill(case, cache, **overrides):
    q, k_new, v_new = _chunk(case)
    new_tokens = to_torch(np.asarray(case.new_tokens, np.int32))
    kwargs = {**attention_kwargs(case.prefix), "block_m": case.block_m, "block_n": case.block_n, **overrides}
    return ops.prefill_attention(q, k_new, v_new, *cache_arrays(cache), new_tokens, **kwargs)


def test_prefill_of_one_token_equals_decode_over_the_cache_plus_that_token():
    """A one-token chunk is decode over (prefix ‖ the token): the two ops agree closely."""
    case = PREFILL_CASES[2]
    cache = build_cache(case.prefix)
    prefill = run_prefill(case, cache)
    q, k_new, v_new = case.chunk_arrays()
    want = reference_prefill(case, cache, q, k_new, v_new)
    assert_close(prefill.cpu().numpy(), want, "float32")
    assert not torch.isnan(prefill).any()


def test_prefill_default_new_tokens_and_bad_arguments():
    case = PREFILL_CASES[2]
    cache = build_cache(case.prefix)
    q, k_new, v_new = _chunk(case)
    arrays = cache_arrays(cache)
    kwargs = {**attention_kwargs(case.prefix), "block_m": 16, "block_n": 16}
    out = ops.prefill_attention(q, k_new, v_new, *arrays, **kwargs)  # new_tokens=None → T
    assert torch.equal(out, run_prefill(case, cache))
    for args, overrides, message in [
        ((q, k_new.half(), v_new), {}, "k_new must have dtype float32 or bfloat16"),
        ((q, k_new, v_new.to(torch.bfloat16)), {}, "v_new must have dtype float32"),
        ((q, k_new[:, :, :1].contiguous(), v_new[:, :, :1].contiguous()), {}, "k_new has 1 KV heads but the cache has 2"),
        ((q[:, :0], k_new[:, :0], v_new[:, :0]), {}, "the chunk must hold at least one token"),
        ((q, k_new, v_new), {"block_m": 8}, "block_m=8 must be an integer >= 16"),
        ((q, k_new, v_new), {"block_n": 48}, "block_n=48 must be a power of two"),
        ((q, k_new, v_new, *arrays, torch.tensor([1], dtype=torch.int64)), {}, "new_tokens must have dtype int32"),
    ]:
        call_args = args if len(args) > 3 else args + tuple(arrays)
        with pytest.raises(ValueError, match=message):
            ops.prefill_attention(*call_args, **{**kwargs, **overrides})
