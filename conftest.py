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


def _has_gpu() -> bool:
    if os.environ.get("OSCAR_TEST_GPU") != "1":
        return False
    try:
        import jax

        return jax.default_backend() == "gpu"
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (set OSCAR_TEST_GPU=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
