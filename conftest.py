"""Test-wide environment: CPU JAX, the Triton interpreter, and the gpu marker.

TRITON_INTERPRET must be set before any Triton kernel is defined, so it is set here, before any
test module imports a backend. `make test` sets the same variables; this makes a bare `pytest`
behave the same way.
"""

import os

if os.environ.get("OSCAR_TEST_GPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One JAX persistent compilation cache for the run, fresh each run, read and written by every
# process of it: both xdist workers and the subprocesses the tests start (servers, tensor-parallel
# workers, CLIs) inherit these variables, so a program compiled in one is loaded by the others.
# A cache the user set is used instead, and kept.
_RUN_COMPILE_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import tempfile

    _RUN_COMPILE_CACHE = tempfile.mkdtemp(prefix="oscar-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_COMPILE_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import pytest


def _patch_triton_language_once_per_launch() -> bool:
    """The Triton interpreter (3.6) patches triton.language — inspect.getmembers over its modules,
    ~2 ms — at the launch of a kernel and again at every call of a nested @triton.jit function,
    whose patches are the launch's over again (the same modules, the same interpreter builder) and
    are never restored by themselves: a decode step of the HF SmolLM2 test makes tens of thousands
    of such calls, a sixth of its time. Here a nested call whose language modules the running launch
    has patched skips it; anything else (a launch, a function that sees other modules) patches as
    before. Returns whether the interpreter had the functions this relies on (else nothing changes)."""
    import inspect

    from triton import language as tl
    from triton.runtime import interpreter

    if not (callable(getattr(interpreter, "_patch_lang", None)) and hasattr(interpreter, "GridExecutor")):
        return False
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: list[set[int]] = []  # the language modules each running launch has patched

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    class AlreadyPatched:
        def restore(self) -> None:
            pass

    def patch_lang_once(fn):
        if patched and languages(fn) <= patched[-1]:
            return AlreadyPatched()
        scope = patch_lang(fn)
        patched.append(languages(fn))
        return scope

    def launch_with_one_patch(self, *args, **kwargs):
        depth = len(patched)
        try:
            return launch(self, *args, **kwargs)
        finally:
            del patched[depth:]

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_with_one_patch
    return True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()


def pytest_unconfigure(config):
    if _RUN_COMPILE_CACHE is not None:  # the process that made it (xdist workers inherit it set)
        import shutil

        shutil.rmtree(_RUN_COMPILE_CACHE, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        'kernels(choice): run oscar_jax ops called with interpret=None on "pallas" (the kernels: interpret '
        'mode on CPU) or "xla" (the native XLA path), whatever the platform default (oscar_jax.xla.kernels)',
    )


@pytest.fixture(autouse=True)
def _oscar_jax_kernels(request, monkeypatch):
    """Apply a test's `kernels` marker through OSCAR_JAX_KERNELS (read at each op call)."""
    marker = request.node.get_closest_marker("kernels")
    if marker is not None:
        from oscar_jax.xla import KERNEL_CHOICES, KERNELS_ENV

        choice = marker.args[0]
        assert choice in KERNEL_CHOICES, choice
        monkeypatch.setenv(KERNELS_ENV, choice)


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
