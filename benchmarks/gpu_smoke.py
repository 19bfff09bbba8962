"""GPU smoke test of the Pallas kernels: compile on the GPU and match shared_math.

    PYTHONPATH=. python benchmarks/gpu_smoke.py --out results/gpu_smoke_h200.json

Codec, write and demotion bytes are compared bit for bit with shared_math; decode and prefill
attention against float64 attention over the dequantized cache (tolerances from the test table).
Shapes are real ones: Qwen3-8B (8 KV heads, 4 query heads each, d 128) and SmolLM2 (3 × 3, d 64).
Timings here are single-shot wall clock, for orientation only; GPU-PERF owns the benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import attention_ops, ops
from oscar_jax.tests.test_decode_attention import TOLERANCES, build_cache
from shared_math import attention as reference
from shared_math import codec

SHAPES = {"qwen3-8b": dict(kv_heads=8, group=4, d=128, g=128), "smollm2-135m": dict(kv_heads=3, group=3, d=64, g=64)}


def _environment() -> dict:
    import jaxlib

    return {
        "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
        "jaxlib": jaxlib.__version__, "numpy": np.__version__, "python": platform.python_version(),
        "git_sha": os.environ.get("OSCAR_GIT_SHA", "unknown"),
    }


def _rows(rng, shape) -> np.ndarray:
    x = (rng.standard_t(3, size=shape) * rng.uniform(0.05, 20, size=shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, shape[-1])[:4, :3] = [[np.nan, np.inf, -np.inf]] * 4
    x.reshape(-1, shape[-1])[4] = 0.5  # a constant row
    return x


def check_codec(rng, shape) -> dict:
    out = {}
    x = _rows(rng, (4096, shape["kv_heads"], shape["d"]))
    for levels, clip in (("minmax", 0.96), ("minmax", 0.92), ("moments", 1.0)):
        want = codec.encode(x, group_size=shape["g"], clip_ratio=clip, levels=levels)
        t = time.perf_counter()
        got = jax.block_until_ready(ops.encode(jnp.asarray(x), group_size=shape["g"], clip_ratio=clip, levels=levels))
        elapsed = time.perf_counter() - t
        same = all(np.array_equal(np.asarray(a).view(np.uint8), b.view(np.uint8)) for a, b in zip(got, want))
        dec = np.asarray(ops.decode(*got, group_size=shape["g"]))
        dec_same = np.array_equal(dec.view(np.uint32), codec.decode(*want, group_size=shape["g"]).view(np.uint32))
        out[f"encode_{levels}_{clip}"] = {"bit_identical": bool(same), "decode_bit_identical": bool(dec_same),
                                          "first_call_s": round(elapsed, 3)}
    return out


def check_write_and_demote(rng, shape) -> dict:
    kv, d, g = shape["kv_heads"], shape["d"], shape["g"]
    pages, page = 12, 16
    codes = jnp.zeros((pages, kv, page, d // 4), jnp.uint8)
    scale = jnp.zeros((pages, kv, page, d // g), jnp.float16)
    minimum = jnp.zeros_like(scale)
    rows = _rows(rng, (37, kv, d))
    rotation = np.linalg.qr(rng.normal(size=(kv, d, d)))[0].astype(np.float32)
    page_ids = rng.permutation(np.repeat(np.arange(1, 4), page))[:37].astype(np.int32)
    slots = np.array([np.sum(page_ids[:i] == p) for i, p in enumerate(page_ids)], np.int32)
    got = ops.write_pages(codes, scale, minimum, rows, page_ids, slots, rotation=rotation, group_size=g,
                          clip_ratio=0.96)
    rotated = np.asarray(jnp.einsum("tkd,kde->tke", rows, rotation, precision=jax.lax.Precision.HIGHEST))
    want = codec.encode(rotated, group_size=g, clip_ratio=0.96)
    write_ok = all(np.array_equal(np.asarray(a)[page_ids, :, slots].view(np.uint8), b.view(np.uint8))
                   for a, b in zip(got, want))
    bf16 = jnp.asarray(rng.normal(size=(2, pages, kv, page, d)), jnp.bfloat16)  # two layers
    int2 = [jnp.zeros((2,) + a.shape, a.dtype) for a in (codes, scale, minimum)]
    src, dst = np.array([3, 7], np.int32), np.array([5, 2], np.int32)
    demoted = ops.demote_pages(bf16, *int2, src, dst, group_size=g, clip_ratio=0.92)
    ref = codec.encode(np.asarray(bf16.astype(jnp.float32))[:, src], group_size=g, clip_ratio=0.92)
    demote_ok = all(np.array_equal(np.asarray(a)[:, dst].view(np.uint8), b.view(np.uint8)) for a, b in zip(demoted, ref))
    return {"write_pages_bit_identical": bool(write_ok), "demote_pages_bit_identical": bool(demote_ok)}


def check_attention(rng, shape, lengths, dtype) -> dict:
    kv, group, d, g = shape["kv_heads"], shape["group"], shape["d"], shape["g"]
    cache = build_cache(rng, lengths, num_kv_heads=kv, head_dim=d, group_size=g, recent=256)
    q = jnp.asarray(rng.normal(size=(len(lengths), kv * group, d)), dtype)
    args = [jnp.asarray(a, jnp.bfloat16) if i < 2 else jnp.asarray(a) for i, a in enumerate(cache.arrays)]
    kwargs = dict(sink_slots=4, group_size=g, softmax_scale=d**-0.5)
    out = np.asarray(jax.block_until_ready(attention_ops.decode_attention(q, *args, **kwargs)))
    t = time.perf_counter()
    jax.block_until_ready(attention_ops.decode_attention(q, *args, **kwargs))
    second = time.perf_counter() - t
    qf = np.asarray(q.astype(jnp.float32), np.float64)
    errors = []
    for b, seq in enumerate(cache.sequences):
        k, v = seq.dequantized(g)
        want = reference.softmax_attention(qf[b], k, v, softmax_scale=d**-0.5)
        errors.append(float(np.abs(out[b] - want).max()))
    tol = TOLERANCES[dtype]
    return {"lengths": list(lengths), "dtype": jnp.dtype(dtype).name, "max_abs_error": max(errors),
            "tolerance_atol": tol["atol"], "within_tolerance": bool(max(errors) <= tol["atol"] + tol["rtol"]),
            "second_call_s": round(second, 5)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    result = {"environment": _environment(), "checks": {}}
    for name, shape in SHAPES.items():
        r = result["checks"][name] = {}
        r["codec"] = check_codec(rng, shape)
        r["write"] = check_write_and_demote(rng, shape)
        r["decode_attention"] = [check_attention(rng, shape, lengths, dtype)
                                 for lengths, dtype in (((1, 63, 337, 2049), jnp.float32),
                                                        ((5000, 321), jnp.bfloat16))]
        print(json.dumps({name: r}, indent=1), flush=True)
    flat = json.dumps(result)
    result["all_passed"] = '"bit_identical": false' not in flat and '"within_tolerance": false' not in flat \
        and '_bit_identical": false' not in flat
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("ALL PASSED" if result["all_passed"] else "FAILURES", flush=True)
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
