"""The parity suite on a GPU: Pallas compiled by JAX vs oscar_jax's XLA path vs Triton compiled by
torch vs shared_math.

Skipped on CPU (the root conftest skips `gpu` tests unless OSCAR_TEST_GPU=1 on a GPU machine).
Runs every named case of parity_tests.cases through every check of parity_tests.checks, does not
stop at the first failure, and writes what it measured (bit-identity per check, attention errors
against the tolerance table, environment) to the JSON file named by OSCAR_PARITY_RESULT, if set.

Command (from the repository root, on the GPU machine):
  OSCAR_TEST_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false OSCAR_PARITY_RESULT=parity_gpu.json \
      python -m pytest -q -m gpu parity_tests
With OSCAR_TEST_GPU=1 the other parity tests (test_parity.py) also run on the GPU.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
import traceback

import pytest

from parity_tests import backends, cases, checks


def _environment() -> dict:
    import jax
    import torch
    import triton

    sha = os.environ.get("OSCAR_GIT_SHA")  # the tree that ran, when the checkout's HEAD is not it (benchmarks.harness)
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = None
    return dict(
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        jax=jax.__version__, jax_backend=jax.default_backend(), jax_devices=[str(d) for d in jax.devices()],
        torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
        python=platform.python_version(), git_sha=sha,
    )


def _named_checks():
    for case in cases.CODEC_CASES:
        for levels in cases.LEVELS:
            yield f"codec/{case.name}/{levels}", lambda c=case, lv=levels: checks.codec(c, lv)
    for case in cases.WRITE_CASES:
        for levels in cases.LEVELS:
            yield f"write/{case.name}/{levels}", lambda c=case, lv=levels: checks.write(c, lv)
        for rows_dtype in ("float32", "bfloat16"):
            yield (f"fused_rotation/{case.name}/{rows_dtype}",
                   lambda c=case, d=rows_dtype: checks.fused_rotation(c, d, cases.LEVELS[0]))
    for case in cases.ATTENTION_CASES:
        yield f"decode_attention/{case.name}", lambda c=case: checks.decode_attention(c)
        for writer in ("jax", "torch", "xla"):
            yield f"cross_backend/{case.name}/{writer}", lambda c=case, w=writer: checks.cross_backend(c, w)
    for case in cases.PREFILL_CASES:
        yield f"prefill_attention/{case.name}", lambda c=case: checks.prefill_attention(c)


@pytest.mark.gpu
def test_gpu_parity_suite():
    import jax

    assert backends.TORCH_DEVICE.type == "cuda", "torch sees no cuda device"
    assert jax.default_backend() == "gpu", f"jax runs on {jax.default_backend()}"
    results, failures = {}, []
    for name, check in _named_checks():
        start = time.perf_counter()
        try:
            outcome = dict(passed=True, **check())
        except Exception as error:  # record every failure, then fail once
            outcome = dict(passed=False, error=f"{type(error).__name__}: {error}"[:2000],
                           traceback=traceback.format_exc()[-4000:])
            failures.append(name)
        outcome["seconds"] = round(time.perf_counter() - start, 3)
        results[name] = outcome
        print(f"{name}: {'ok' if outcome['passed'] else 'FAILED ' + outcome['error'][:300]}")
    summary = dict(environment=_environment(), checks=len(results), failed=failures, results=results,
                   tolerances=cases.ATTENTION_TOLERANCES)
    path = os.environ.get("OSCAR_PARITY_RESULT")
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    assert not failures, f"{len(failures)} of {len(results)} parity checks failed: {failures}"
