"""The native XLA path of every oscar_jax op: plain jax.numpy over the same paged pools.

Which implementation an op runs (decided in the public op, after validation):
  interpret=True / False    the Pallas kernels, interpreted / compiled (always)
  interpret=None            `kernels()` — the innermost `use_kernels(...)` block, else the
                            OSCAR_JAX_KERNELS environment variable, else "auto":
      "auto"    XLA on a CPU backend, the compiled Pallas kernels on a GPU backend
      "pallas"  the Pallas kernels (interpreted on CPU, compiled on GPU)
      "xla"     this package, on any backend
The Pallas interpreter runs every grid program as a separate XLA loop iteration: right for testing
the kernels, ~100× slower than XLA's own CPU code. This path gives the same bytes (the INT2 writes
share the block bodies `kernels.codec.encode_block` / `decode_block`, whose integer-key arithmetic
is exact on XLA:CPU) and reads the same page layout.

Modules (the names of kernels/, side by side): codec.py (encode, decode), write.py (fused
rotate + encode, page scatters, demotion), attention.py (decode and prefill attention).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax

KERNELS_ENV = "OSCAR_JAX_KERNELS"
KERNEL_CHOICES = ("auto", "pallas", "xla")

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("oscar_jax_kernels", default=None)


def _checked(choice: str, where: str) -> str:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{where}={choice!r} must be one of {KERNEL_CHOICES}")
    return choice


def kernels() -> str:
    """The implementation ops with interpret=None run: "pallas" or "xla" (resolved, never "auto")."""
    choice = _override.get()
    if choice is None:
        choice = _checked(os.environ.get(KERNELS_ENV, "auto"), KERNELS_ENV)
    if choice == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    return choice


@contextlib.contextmanager
def use_kernels(choice: str | None):
    """Within the block, ops called with interpret=None (and traced there) run `choice`
    ("auto", "pallas" or "xla"); None leaves the current choice."""
    if choice is None:
        yield
        return
    token = _override.set(_checked(choice, "kernels"))
    try:
        yield
    finally:
        _override.reset(token)


def use_xla(interpret: bool | None) -> bool:
    """Whether an op called with this `interpret` runs the XLA path."""
    return interpret is None and kernels() == "xla"
