"""oscar_jax tests run on CPU (Pallas interpret mode) unless OSCAR_TEST_GPU=1 or JAX_PLATFORMS
says otherwise.

On a GPU machine, `OSCAR_TEST_GPU=1 python -m pytest oscar_jax/tests` reruns the same tests with
the kernels compiled (the ops' `interpret=None` resolves to False on a GPU backend); the root
conftest then refuses to run if JAX finds no GPU, so a GPU run never silently falls back to CPU.
"""

import os

if os.environ.get("OSCAR_TEST_GPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
