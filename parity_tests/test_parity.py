"""Cross-framework parity of format v1: shared_math vs oscar_jax (Pallas) vs oscar_jax (XLA path)
vs oscar_torch (Triton).

On CPU (the default, `make test`): Pallas interpret mode, the XLA path and the Triton interpreter. With
OSCAR_TEST_GPU=1 on a GPU machine the same tests run both backends' compiled kernels (and
test_parity_gpu.py records a result file). What is claimed, per test:
  * encode bytes (packed, scale, minimum) bit-identical across the four, every data kind
    (random, heavy-tailed, ties, NaN/Inf/huge/subnormal, tiny), both encoders;
  * INT2 pages written by write_pages and by demote_pages, and BF16 pages written by
    write_bf16_pages, from identical rotated inputs: bit-identical across the four;
  * write_pages with the key rotation fused (float32 and bfloat16 rows): within rare one-level
    flips of shared_math's encoding of the float64-rotated rows; on the GPU, jax ≡ torch;
  * a pool written by one implementation is the format's bytes and another decodes and attends
    over it (jax → torch, torch → jax and xla, xla → torch), within THE tolerance table
    (cases.ATTENTION_TOLERANCES).
Decode and prefill attention of each implementation vs the float64 reference are
test_ops_attention.py's (checks.decode_attention and checks.prefill_attention serve the GPU run).
"""

import pytest

from parity_tests import cases, checks

CODEC_PARAMS = [(case, levels) for case in cases.CODEC_CASES for levels in cases.LEVELS]
WRITE_PARAMS = [(case, cases.LEVELS[i % 2]) for i, case in enumerate(cases.WRITE_CASES)]
CROSS_CASES = (cases.ATTENTION_CASES[0], cases.ATTENTION_CASES[2])  # Qwen3-8B shape; bf16 q + edges


@pytest.mark.parametrize("case,levels", CODEC_PARAMS, ids=lambda p: p if isinstance(p, str) else p.name)
def test_encode_bytes_identical(case, levels):
    checks.codec(case, levels)


@pytest.mark.parametrize("case,levels", WRITE_PARAMS, ids=lambda p: p if isinstance(p, str) else p.name)
def test_written_and_demoted_pages_identical(case, levels):
    checks.write(case, levels)


@pytest.mark.parametrize("rows_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", (cases.WRITE_CASES[2], cases.WRITE_CASES[4]), ids=lambda c: c.name)
def test_fused_rotation_writes_the_rotated_encoding(case, rows_dtype):
    result = checks.fused_rotation(case, rows_dtype, cases.LEVELS[0])
    print(f"{case.name} {rows_dtype}: {result['code_flips_vs_float64_rotation']}, "
          f"xla wrote jax's bytes: {result['xla_equals_jax']}")


@pytest.mark.parametrize("writer", ["jax", "torch", "xla"])
@pytest.mark.parametrize("case", CROSS_CASES, ids=lambda c: c.name)
def test_pool_written_by_one_backend_is_read_by_the_other(case, writer):
    result = checks.cross_backend(case, writer)
    print(f"{case.name} {writer}→{result['readers']}: {result['max_abs_error']}")
