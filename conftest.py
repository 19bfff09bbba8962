"""Test-wide environment: CPU JAX, the Triton interpreter, and the gpu marker.

TRITON_INTERPRET must be set before any Triton kernel is defined, so it is set here, before any
test module imports a backend. `make test` sets the same variables; this makes a bare `pytest`
behave the same way.
"""

import os

if os.environ.get("OSCAR_TEST_GPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def _gpu_missing() -> str | None:
    """Why OSCAR_TEST_GPU=1 cannot be honoured (None when JAX and torch both see a GPU)."""
    try:
        import jax
        import torch
    except ImportError as e:
        return f"a backend does not import: {e}"
    if jax.default_backend() != "gpu":
        return f"JAX runs on {jax.default_backend()!r} (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("OSCAR_TEST_GPU") == "1":
        # a GPU run that quietly fell back to CPU would report interpret-mode passes as GPU passes
        missing = _gpu_missing()
        if missing:
            raise pytest.UsageError(f"OSCAR_TEST_GPU=1 but {missing}")
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (set OSCAR_TEST_GPU=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["rows_on_m", "tokens_on_m"])
def int2_layout(request, monkeypatch):
    """Both layouts of the decode INT2 tier by the default launch (both backends): test-sized grids
    take rows on M, unless the program count from which tokens go on M
    (shared_math.tiling.int2_decode_tokens_on_m) is set to 1."""
    from shared_math import tiling

    if request.param == "tokens_on_m":
        monkeypatch.setattr(tiling, "DECODE_TWO_WARPS_MIN_PROGRAMS", 1)
    return request.param
