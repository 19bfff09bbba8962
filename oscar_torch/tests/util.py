"""Helpers of the oscar_torch tests: the device they run on, numpy ↔ torch conversion, a cache on
the device from parity_tests.cases (a backend-free module: numpy + shared_math only).

CPU (the default): Triton interpreter (the root conftest sets TRITON_INTERPRET=1). With
OSCAR_TEST_GPU=1 on a GPU machine the same tests run the compiled kernels on cuda.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from parity_tests import cases

ON_GPU = os.environ.get("OSCAR_TEST_GPU") == "1" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def to_torch(a: np.ndarray, device=DEVICE) -> torch.Tensor:
    """numpy → torch on the test device; uint16 arrays are bfloat16 bit patterns."""
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """torch → numpy; bfloat16 as uint16 bit patterns."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def query(case: cases.AttentionCase) -> torch.Tensor:
    return to_torch(case.query()).to(TORCH_DTYPES[case.q_dtype])


def cache_arrays(cache: cases.PagedCache) -> tuple[torch.Tensor, ...]:
    """The 13 cache arguments of decode_attention on the test device."""
    return tuple(to_torch(a) for a in cache.pools() + cache.tables())


def attention_kwargs(case: cases.AttentionCase) -> dict:
    return dict(
        sink_slots=case.sink_slots, group_size=case.group_size, softmax_scale=case.softmax_scale,
        pages_per_split=case.pages_per_split, pages_per_block=case.pages_per_block,
    )
