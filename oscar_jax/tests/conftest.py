"""oscar_jax tests run on CPU (Pallas interpret mode) unless JAX_PLATFORMS says otherwise.

On a GPU machine, `JAX_PLATFORMS=cuda python -m pytest oscar_jax/tests` reruns the same tests with
the kernels compiled (the ops' `interpret=None` resolves to False on a GPU backend).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
