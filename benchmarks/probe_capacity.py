"""Why the capacity search at 100K runs out of memory one pool short (benchmarks/NOTES.md, capacity).

bench_e2e's capacity search (git 51405f0) failed inside `jit_decode_step` with an allocation of
exactly one pool's size (INT2: one codes pool, 47.04 GiB at batch 55; BF16: one K/V pool,
48.08 GiB at batch 7), although the compiled step reports every pool aliased and 0.2 GB of
temporaries. This probe separates the candidates. Each micro-probe runs one donated call on a
fresh buffer while ballast holds the rest of the memory, so that a second copy cannot fit:

  dus           jit(pool.at[0].set(1), donate)                 XLA's own in-place update
  pallas_write  ops.write_bf16_pages(stacked pool, layer=0)    our aliased Pallas write, donated
  passthrough   jit(lambda pool, s: (pool, s + 1), donate)     a donated buffer returned as is

at sizes below and above 32 GiB. Then one real decode step (Qwen3-8B shapes, bench_e2e's cache) at
a given batch, with the compiled memory analysis and the allocator's statistics before the step.

Finding (NOTES.md v5): no probe needed a second buffer; the b = 55 failure is the growing
allocator fragmenting while the cache is built (largest free block 18 GB of 55 GB free), which is
why the capacity search runs with XLA_PYTHON_CLIENT_PREALLOCATE=true.

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.probe_capacity --out probe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np

GIB = 2**30
HEADROOM = 6 * GIB  # left free beside the probed buffer: room for temporaries, not for a copy


def _memory_stats() -> dict:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {k: int(v) for k, v in stats.items()}


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def micro_probe(kind: str, size_bytes: int) -> dict:
    """One donated call on a `size_bytes` buffer with ballast leaving HEADROOM free."""
    import jax
    import jax.numpy as jnp

    from benchmarks import bench_e2e
    from oscar_jax import ops

    model = bench_e2e.qwen3_8b_config()
    oscar = bench_e2e.oscar_config(model.head_dim)
    entry = {"kind": kind, "size_gib": size_bytes / GIB}
    stats = _memory_stats()
    ballast_bytes = stats["bytes_limit"] - stats["bytes_in_use"] - size_bytes - HEADROOM
    ballast = jnp.zeros((max(ballast_bytes, 1),), jnp.uint8) if ballast_bytes > 0 else None
    try:
        if kind == "pallas_write":
            page = (model.num_kv_heads, oscar.page_size, model.head_dim)  # one BF16 page, all KV heads
            pool = jnp.zeros((1, size_bytes // (2 * np.prod(page)), *page), jnp.bfloat16)
            rows = jnp.ones((1, model.num_kv_heads, model.head_dim), jnp.float32)
            ids = jnp.zeros((1,), jnp.int32)
            fn = jax.jit(lambda p, r: ops.write_bf16_pages(p, r, ids, ids, layer=0), donate_argnums=0)
            args = (pool, rows)
        elif kind == "dus":
            pool = jnp.zeros((size_bytes,), jnp.uint8)
            fn = jax.jit(lambda p, s: p.at[0].set(s), donate_argnums=0)
            args = (pool, jnp.uint8(1))
        elif kind == "passthrough":
            pool = jnp.zeros((size_bytes,), jnp.uint8)
            fn = jax.jit(lambda p, s: (p, s + 1), donate_argnums=0)
            args = (pool, jnp.int32(1))
        else:
            raise ValueError(f"unknown probe {kind=}")
        jax.block_until_ready(args)
        before = pool.unsafe_buffer_pointer()
        entry["free_before_call_gib"] = (_memory_stats()["bytes_limit"] - _memory_stats()["bytes_in_use"]) / GIB
        out = jax.block_until_ready(fn(*args))
        new_pool = out[0] if isinstance(out, tuple) else out
        entry.update(ok=True, moved=new_pool.unsafe_buffer_pointer() != before)
        del out, new_pool
    except Exception as err:  # noqa: BLE001 - the outcome is the measurement
        entry.update(ok=False, error=_error(err))
    del ballast
    gc.collect()
    return entry


def real_step(kind: str, batch: int, params, model, context: int) -> dict:
    """bench_e2e's cache at `batch` × `context`, compiled step, two donated steps."""
    import jax.numpy as jnp

    from benchmarks import bench_e2e

    oscar = bench_e2e.oscar_config(model.head_dim)
    entry = {"kind": kind, "batch": batch, "context": context,
             "sequence_bytes": bench_e2e.sequence_cache_bytes(kind, context, model.num_layers, model.num_kv_heads, oscar)}
    try:
        tables = bench_e2e.plan_tables(kind, context, batch, oscar, table_context=context)
        cache = bench_e2e.random_cache(model, oscar, tables)
        entry["pool_bytes"] = {n: int(getattr(cache, n).nbytes) for n in ("k_bf16", "v_bf16", "k_codes", "k_scale")}
        tokens = jnp.zeros((batch,), jnp.int32)
        positions = jnp.full((batch,), context - 1, jnp.int32)
        compiled, info = bench_e2e.compile_step(params, model, tokens, cache, positions)
        mem = compiled.memory_analysis()
        info["output_bytes"] = int(mem.output_size_in_bytes)
        info["generated_code_bytes"] = int(mem.generated_code_size_in_bytes)
        entry["compile"] = info
        text = compiled.as_text()
        # copies XLA wraps in fusions do not show as `copy(` ops: count every pool-shaped copy-like op
        pool_shapes = {f"{getattr(cache, n).dtype}[{','.join(map(str, getattr(cache, n).shape))}]".replace("uint8", "u8")
                       .replace("bfloat16", "bf16").replace("float16", "f16") for n in ("k_bf16", "k_codes")}
        entry["pool_shaped_copy_lines"] = [line.strip()[:300] for line in text.splitlines()
                                           if "copy" in line and any(shape in line for shape in pool_shapes)][:20]
        entry["memory_before_step"] = _memory_stats()
        timing, checks, cache = bench_e2e.time_steps(compiled, params, tokens, cache, positions, steps=2, trials=1)
        entry.update(ok=True, **timing, **checks, memory_after=_memory_stats())
        del cache, compiled
    except Exception as err:  # noqa: BLE001 - the outcome is the measurement
        entry.update(ok=False, error=_error(err), memory_at_error=_memory_stats())
    gc.collect()
    return entry


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes-gib", default="30,34", help="micro-probe buffer sizes")
    parser.add_argument("--steps", default="int2:39,bf16:5", help="real decode steps kind:batch (empty: none)")
    parser.add_argument("--context", type=int, default=100_000)
    args = parser.parse_args(argv)

    from benchmarks import bench_e2e, harness

    result = {"environment": harness.environment(), "headroom_gib": HEADROOM / GIB, "micro": [], "steps": []}

    def save():
        args.out.write_text(json.dumps(result, indent=1))

    t0 = time.perf_counter()
    for size in (float(s) for s in args.sizes_gib.split(",") if s):
        for kind in ("dus", "passthrough", "pallas_write"):
            entry = micro_probe(kind, int(size * GIB))
            print(f"[{time.perf_counter() - t0:5.0f} s] {entry}", flush=True)
            result["micro"].append(entry)
            save()
    if args.steps:
        model = bench_e2e.qwen3_8b_config()
        params = bench_e2e.random_params(model)
        for item in args.steps.split(","):
            kind, batch = item.split(":")
            entry = real_step(kind, int(batch), params, model, args.context)
            print(f"[{time.perf_counter() - t0:5.0f} s] {json.dumps(entry)[:1500]}", flush=True)
            result["steps"].append(entry)
            save()


if __name__ == "__main__":
    main()
