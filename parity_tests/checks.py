"""The parity checks, one function per claim, shared by the CPU tests and the GPU run.

Each check asserts (bytes bit-identical, or attention within cases.ATTENTION_TOLERANCES of the
float64 reference over the dequantized cache) and returns what it measured, so the GPU test can
record a result file. Backends: "shared_math", "jax" (Pallas), "xla" (oscar_jax's XLA path),
"torch" (parity_tests.backends).
"""

from __future__ import annotations

import numpy as np

from parity_tests import backends, cases
from parity_tests.cases import assert_close, assert_same_bits
from shared_math.codec import decode as reference_decode_rows
from shared_math.codec import unpack_codes as reference_unpack

CODEC_BACKENDS = ("shared_math", "jax", "xla", "torch")
KERNEL_BACKENDS = CODEC_BACKENDS[1:]  # the implementations that run attention and the fused rotation
ARRAYS = ("packed", "scale", "minimum")


def _same(results: dict, what: str) -> None:
    """Every backend's arrays bit-identical to shared_math's."""
    want = results["shared_math"]
    for backend, got in results.items():
        for name, a, e in zip(ARRAYS, got, want):
            assert_same_bits(a, e, f"{what}: {backend} {name} vs shared_math")


def codec(case: cases.CodecCase, levels: str) -> dict:
    """encode bytes of every data kind (one launch per backend): bit-identical across the four."""
    kinds = sorted(cases.DATA)
    x = np.stack([case.rows(kind) for kind in kinds])
    kwargs = dict(group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    results = {b: backends.encode(b, x, **kwargs) for b in CODEC_BACKENDS}
    for i, kind in enumerate(kinds):
        _same({b: tuple(a[i] for a in r) for b, r in results.items()}, f"{case.name} {kind} {levels}")
    return dict(rows=int(np.prod(x.shape[:-1])), kinds=kinds, bit_identical=True)


def write(case: cases.WriteCase, levels: str) -> dict:
    """INT2 pages written by write_pages and by demote_pages, and BF16 pages written by
    write_bf16_pages, from identical (rotated) inputs: bit-identical across the four."""
    codec_args = dict(group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    pools, rows = case.int2_pools(), case.rows()
    page_ids, slots = case.destinations()
    _same({b: backends.write_pages(b, pools, rows, page_ids, slots, **codec_args) for b in CODEC_BACKENDS},
          f"{case.name} write_pages {levels}")
    layered = case.num_layers > 1
    bf16_pool, pools = case.bf16_pool(layered), case.int2_pools(layered)
    src, dst = case.demotions()
    _same({b: backends.demote_pages(b, bf16_pool, pools, src, dst, **codec_args) for b in CODEC_BACKENDS},
          f"{case.name} demote_pages {levels}")
    pool = case.bf16_pool()
    bf16 = {b: backends.write_bf16_pages(b, pool, rows, page_ids, slots) for b in CODEC_BACKENDS}
    for backend, got in bf16.items():
        assert_same_bits(got, bf16["shared_math"], f"{case.name} write_bf16_pages: {backend}")
    return dict(tokens=case.num_tokens, demoted_pages=int(src.size) * case.num_layers, bit_identical=True)


def fused_rotation(case: cases.WriteCase, rows_dtype: str, levels: str) -> dict:
    """write_pages with the key rotation fused into the write (bfloat16 rows: R split into three
    bfloat16 products; float32 rows: IEEE float32). The rotation's float32 rounding is not part
    of the format, so against shared_math's encoding of the float64-rotated rows each backend may
    flip a code by one level (metadata by one float16 step) where a rotated value sits on a
    threshold, rarely; compiled on the GPU the two backends run the same products in the same
    order and write bit-identical pages. (The interpreters and the XLA path sum in their own orders; whether
    the XLA path wrote the Pallas interpreter's bytes is recorded as `xla_equals_jax`, not asserted:
    a CPU's dot library may order the sums either way.)"""
    codec_args = dict(group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    pools, rows, rotation = case.int2_pools(), case.rows("random"), case.rotation()
    page_ids, slots = case.destinations()
    if rows_dtype == "bfloat16":
        rows = cases.bf16_bits(rows)  # uint16: the backends take bfloat16 rows
        exact = cases.bf16_values(rows)
    else:
        exact = rows
    rotated = np.einsum("tkd,kde->tke", exact.astype(np.float64), rotation.astype(np.float64)).astype(np.float32)
    want = cases.reference_scatter(pools, rotated, page_ids, slots, **codec_args)
    got = {b: backends.write_pages(b, pools, rows, page_ids, slots, rotation=rotation, **codec_args)
           for b in KERNEL_BACKENDS}
    flips = {}
    for backend, arrays in got.items():
        codes = reference_unpack(arrays[0][page_ids, :, slots]).astype(int)
        want_codes = reference_unpack(want[0][page_ids, :, slots]).astype(int)
        assert np.abs(codes - want_codes).max() <= 1, f"{case.name} {rows_dtype}: {backend} code off by > 1 level"
        flips[backend] = float(np.mean(codes != want_codes))
        assert flips[backend] < 1e-2, f"{case.name} {rows_dtype}: {backend} flips {flips[backend]:.2%} of codes"
        for name, a, e in zip(ARRAYS[1:], arrays[1:], want[1:]):
            steps = np.abs(a.view(np.int16).astype(int) - e.view(np.int16).astype(int))
            assert steps.max() <= 1, f"{case.name} {rows_dtype}: {backend} {name} off by {steps.max()} f16 steps"
        untouched = np.ones(arrays[0].shape[:1] + arrays[0].shape[2:3], bool)
        untouched[page_ids, slots] = False  # [P, L]: slots no token was written to keep their bytes
        assert np.array_equal(arrays[0].transpose(0, 2, 1, 3)[untouched], pools[0].transpose(0, 2, 1, 3)[untouched])
    if backends.ON_GPU:
        for name, a, e in zip(ARRAYS, got["jax"], got["torch"]):
            assert_same_bits(a, e, f"{case.name} {rows_dtype} fused rotation: jax vs torch {name}")
    xla_equals_jax = all(np.array_equal(a.view(np.uint8), e.view(np.uint8)) for a, e in zip(got["xla"], got["jax"]))
    return dict(tokens=case.num_tokens, rows_dtype=rows_dtype, code_flips_vs_float64_rotation=flips,
                jax_torch_bit_identical=True if backends.ON_GPU else None,  # None: not checked (interpreters)
                xla_equals_jax=xla_equals_jax)


def _within_tolerance(outputs: dict, want: np.ndarray, q_dtype: str) -> dict:
    """Max abs error of every backend's output; then assert each within the tolerance table (all
    errors are measured first, so a failure names every backend's error)."""
    errors = {b: float(np.max(np.abs(np.asarray(o, np.float64) - want))) for b, o in outputs.items()}
    failed = []
    for backend, out in outputs.items():
        try:
            assert_close(out, want, q_dtype)
        except AssertionError:
            failed.append(backend)
    if failed:
        raise AssertionError(f"{failed} outside {cases.ATTENTION_TOLERANCES[q_dtype]}: max abs errors {errors}")
    return errors


def decode_attention(case: cases.AttentionCase) -> dict:
    """Every backend's decode attention on the same pools vs the float64 reference (one table): the
    GPU run's record (on CPU, test_ops_attention.py checks each backend)."""
    cache = cases.build_cache(case)
    q = case.query()
    want = cases.reference_decode(case, cache, q)
    outputs = {b: backends.decode_attention(b, case, cache.pools(), cache.tables(), q) for b in KERNEL_BACKENDS}
    errors = _within_tolerance(outputs, want, case.q_dtype)
    return dict(max_abs_error=errors, tolerance=cases.ATTENTION_TOLERANCES[case.q_dtype])


def cross_backend(case: cases.AttentionCase, writer: str) -> dict:
    """A page pool written by `writer` (its write path, from the poisoned empty pools) holds the
    format's bytes, and another implementation decodes it (format decode of the INT2 pages) and
    attends over it within the tolerance table: jax → torch, torch → jax and xla, xla → torch."""
    readers = {"jax": ("torch",), "torch": ("jax", "xla"), "xla": ("torch",)}[writer]
    cache = cases.build_cache(case)
    pools = backends.write_cache(writer, case, cache)
    for name, got, want in zip(cache.POOLS, pools, cache.pools()):
        assert_same_bits(got, want, f"{case.name}: {name} written by {writer}")
    k_codes, k_scale, k_min = pools[2:5]
    q = case.query()
    want = cases.reference_decode(case, cache, q)
    errors = {}
    for reader in readers:
        decoded = backends.decode(reader, k_codes, k_scale, k_min, group_size=case.group_size)
        np.testing.assert_array_equal(decoded,
                                      reference_decode_rows(k_codes, k_scale, k_min, group_size=case.group_size))
        out = backends.decode_attention(reader, case, pools, cache.tables(), q)
        errors[reader] = assert_close(out, want, case.q_dtype)
    return dict(writer=writer, readers=readers, max_abs_error=errors, tolerance=cases.ATTENTION_TOLERANCES[case.q_dtype])


def prefill_attention(case: cases.PrefillCase) -> dict:
    """Every backend's prefill (chunk causal in full precision + prefix through the tiers) vs the
    float64 reference, within the tolerance table (keyed by q's dtype): the GPU run's record (on
    CPU, test_ops_attention.py checks each backend)."""
    cache = cases.build_cache(case.prefix)
    q, k_new, v_new = case.chunk_arrays()
    want = cases.reference_prefill(case, cache, q, k_new, v_new)
    outputs = {b: backends.prefill_attention(b, case, cache.pools(), cache.tables(), q, k_new, v_new)
               for b in KERNEL_BACKENDS}
    errors = _within_tolerance(outputs, want, case.prefix.q_dtype)
    return dict(max_abs_error=errors, tolerance=cases.ATTENTION_TOLERANCES[case.prefix.q_dtype])
