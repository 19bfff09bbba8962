"""The `backend` fixtures of the op suites (parity_tests/test_ops_*.py): one test, every
implementation, numpy in and out through parity_tests.backends, shared_math the reference.

  backend         the public ops: "jax" (oscar_jax's Pallas kernels: interpret mode on CPU),
                  "xla" (oscar_jax's native XLA path) and "torch" (oscar_torch's Triton kernels:
                  the interpreter on CPU).
  kernel_backend  the kernel sets' own launchers and block bodies: "jax" (Pallas) and "torch"
                  (Triton); the XLA path has none.
"""

import pytest

OP_BACKENDS = ("jax", "xla", "torch")
KERNEL_BACKENDS = ("jax", "torch")


@pytest.fixture(params=OP_BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request) -> str:
    return request.param
