"""End-to-end JAX decode at Qwen3-8B shapes (random bf16 weights) over the INT2 and BF16 caches.

One decode step = `oscar_jax.model.decode_step` (36 unrolled layers: projections (Q, K, V fused
into one weight as the runtime runs them, `model.fuse_qkv`), the cache's
`attend` — the new token's BF16 write, then two-tier decode attention — MLP, LM head), jitted
with `static_argnames="cfg", donate_argnames="cache"` as `oscar_jax.runtime` does.

Caches (no prefill: the pools are filled with random data on the device and the decode plan is
fabricated directly, in the shape `OscarRuntime.step` gives it; see `plan_tables`):
  int2  the OSCAR tiers at context C (C counts the new token): sink 64 tokens BF16, history the
        largest multiple of the page size ≤ C − 64 − 256 in INT2 pages, recent = the rest
        (256 ≤ recent < 320) BF16. Pages scattered over the pools in random order.
  bf16  the same OscarKVCache with everything in the BF16 tier (sink 64, recent C − 64; INT2
        pools of one page and a history table of no slots, so no INT2 kernel runs) — the
        end-to-end analogue of `bf16_paged_pallas` in bench_decode. The default split-K comes
        from the longer table, here the BF16 one (`shared_math.tiling.default_pages_per_split`).
        Until v13 the history table was as wide as the BF16 table to size that split, and its
        empty INT2 programs cost ~10 µs a layer at 100K (benchmarks/NOTES.md v13).
Tables are sized for the largest context of the run (as the runtime sizes them for
max_seq_len), so one compiled step serves every context of a cache kind at a given batch.

Timing: the step is compiled ahead of time; a Python loop dispatches `steps` donated steps
(dispatch is asynchronous, so host time overlaps the device) and blocks once at the end —
the time until the last step is handed over is kept as `dispatch_median_s` (≈ the step time when
the host is the bound);
per-step time = loop time / steps; median over `trials` loops after two warm-up steps. Every
step writes the new token to the same slot, so the cache state is a fixed point.

Correctness (cheap, not a reference comparison): the logits are finite, and two consecutive
steps from that fixed point give bit-identical logits (determinism). Comparing against the
cacheless `model.forward` reference is too expensive at these lengths; the kernels' accuracy is
covered by bench_decode and the tests.

Floor: (weight bytes read + KV bytes read) / the copy bandwidth measured in the same run. Weight
bytes read = every parameter except the input-embedding table, of which a decode step gathers B
rows (`weight_bytes` is the plain sum of all parameters). KV bytes read: INT2 codes + fp16
metadata of the history, BF16 K/V of the sink and recent tiers, all layers
(`shared_math.tiers.kv_bytes_per_layer`); BF16 cache: C·layers·K·2·D·2.

Capacity at 100K: sequences = ⌊(device memory − weights − workspace reserve) / bytes per
sequence⌋, bytes per sequence being the allocated pages of all layers (INT2: 1 sink + 5 recent
BF16 pages and the history pages; BF16: ⌈C / 64⌉ BF16 pages). Device memory is what this JAX
process may allocate (`memory_stats()["bytes_limit"]`). That batch is then built and timed;
if it does not fit it is stepped down by 10 % until it runs, and both numbers are recorded.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import statistics
import time

import numpy as np

from shared_math.spec import OscarConfig
from shared_math.tiers import bf16_kv_bytes_per_layer, bf16_row_bytes, int2_row_bytes, kv_bytes_per_layer, tier_split

CONTEXTS = (30000, 60000, 100000)
CAPACITY_CONTEXT = 100_000
# Donated steps per timed loop (time_steps). A loop carries a fixed cost (its first dispatch, the
# final sync) of ~3 ms on the H200: at 100K, 10 steps gave 8.11 / 9.90 ms a step (INT2 / BF16),
# 40 steps 7.83 / 9.54, against a traced GPU span of 7.64 / 9.21 (benchmarks/NOTES.md v14).
STEPS = 40
WORKSPACE_RESERVE_BYTES = 4 * 2**30
CACHE_KINDS = ("int2", "bf16")
CLIP_RATIO = 0.96


def qwen3_8b_config():
    from oscar_jax.model import ModelConfig

    return ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                       num_q_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_embeddings=False, qk_norm=True)


def oscar_config(head_dim: int = 128, group_size: int | None = None) -> OscarConfig:
    """Page 64, sink 64, recent 256; G defaults to min(head_dim, 128)."""
    return OscarConfig(head_dim=head_dim, group_size=group_size, page_size=64, sink=64, recent=256)


# ------------------------------------------------------------------------------ accounting


def kv_bytes_read(kind: str, context: int, batch: int, num_layers: int, num_kv_heads: int, oscar: OscarConfig) -> int:
    """Bytes of K/V one decode step's attention must read (all layers, `context` incl. the new token)."""
    if kind == "int2":
        per_layer = kv_bytes_per_layer(context, oscar, num_kv_heads).stored_bytes
    elif kind == "bf16":
        per_layer = bf16_kv_bytes_per_layer(context, oscar.head_dim, num_kv_heads)
    else:
        raise ValueError(f"{kind=} must be one of {CACHE_KINDS}")
    return num_layers * batch * per_layer


def pages_per_sequence(kind: str, context: int, oscar: OscarConfig) -> dict:
    """BF16 and INT2 pages one sequence of `context` tokens holds (per layer), as allocated."""
    page = oscar.page_size
    if kind == "int2":
        # The runtime's allocation: sink slots + recent slots (the window reaches W + page − 1
        # tokens before its oldest page demotes), and the history pages.
        return {"bf16": oscar.sink // page + oscar.recent // page + 1,
                "int2": tier_split(context, oscar).history_pages}
    if kind == "bf16":
        return {"bf16": -(-context // page), "int2": 0}
    raise ValueError(f"{kind=} must be one of {CACHE_KINDS}")


def page_bytes(oscar: OscarConfig, num_kv_heads: int) -> dict:
    """Bytes of one page of K and V (one layer, all KV heads) in each tier."""
    rows = 2 * num_kv_heads * oscar.page_size  # K and V
    return {"bf16": rows * bf16_row_bytes(oscar), "int2": rows * int2_row_bytes(oscar)}


def sequence_cache_bytes(kind: str, context: int, num_layers: int, num_kv_heads: int, oscar: OscarConfig) -> int:
    pages, size = pages_per_sequence(kind, context, oscar), page_bytes(oscar, num_kv_heads)
    return num_layers * (pages["bf16"] * size["bf16"] + pages["int2"] * size["int2"])


def max_sequences(memory_bytes: int, weight_bytes: int, reserve_bytes: int, per_sequence_bytes: int) -> int:
    return max(0, (memory_bytes - weight_bytes - reserve_bytes) // per_sequence_bytes)


def random_params(model, seed: int = 0):
    """Random bf16 weights at `model`'s shapes, Q/K/V fused as `oscar_jax.runtime` runs them."""
    import jax
    import jax.numpy as jnp

    from oscar_jax.model import fuse_qkv, init_params

    params = fuse_qkv(init_params(model, jax.random.key(seed), dtype=jnp.bfloat16))
    jax.block_until_ready(params)
    return params


def param_bytes(params) -> dict:
    """`weight_bytes`: all parameters; `weight_bytes_read`: what one decode step reads (all but the
    input-embedding table, of which it gathers one row per sequence — added by the caller)."""
    import jax

    total = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(params))
    embed = params["embed"]
    return {"weight_bytes": total, "embedding_bytes": int(embed.nbytes),
            "embedding_row_bytes": int(embed.nbytes // embed.shape[0])}


# ------------------------------------------------------------------------------ plan


def plan_tables(kind: str, context: int, batch: int, oscar: OscarConfig, *, table_context: int | None = None,
                seed: int = 0) -> dict:
    """Host-side decode plan for `batch` sequences of `context` tokens (the new one included).

    Returns numpy int32 arrays in `StepPlan`'s fields plus `num_bf16_pages`, `num_int2_pages`
    (page 0 of each pool is the scratch page). Tables are sized for `table_context` ≥ context.
    The new token (position context − 1) is written into its tier's page and counted in the
    tables, as `OscarRuntime.step` plans it.
    """
    table_context = context if table_context is None else table_context
    if not 0 < context <= table_context:
        raise ValueError(f"{context=} must be in [1, {table_context=}]")
    page, sink_slots = oscar.page_size, oscar.sink // oscar.page_size
    if kind == "int2":
        split = tier_split(context, oscar)
        sink, history, recent = split.sink_tokens, split.history_tokens, split.recent_tokens
        bf16_slots = pages_per_sequence("int2", table_context, oscar)["bf16"]
        history_slots = max(1, tier_split(table_context, oscar).history_pages)
        int2_pool = 1 + batch * history_slots
    elif kind == "bf16":
        sink = min(context, oscar.sink)
        history, recent = 0, context - sink
        bf16_slots = pages_per_sequence("bf16", table_context, oscar)["bf16"]
        history_slots = 0  # no INT2 tier (module docstring)
        int2_pool = 1
    else:
        raise ValueError(f"{kind=} must be one of {CACHE_KINDS}")
    bf16_pool = 1 + batch * bf16_slots
    rng = np.random.default_rng(seed)
    bf16_table = (1 + rng.permutation(batch * bf16_slots)).astype(np.int32).reshape(batch, bf16_slots)
    if kind == "int2":
        history_table = (1 + rng.permutation(batch * history_slots)).astype(np.int32).reshape(batch, history_slots)
    else:
        history_table = np.zeros((batch, history_slots), np.int32)
    position = context - 1
    if position < sink:  # the new token is still a sink token
        slot_index, slot = position // page, position % page
    else:
        offset = recent - 1
        slot_index, slot = sink_slots + offset // page, offset % page
    full = lambda value: np.full((batch,), value, np.int32)  # noqa: E731
    return {
        "bf16_page_table": bf16_table, "history_page_table": history_table,
        "sink_tokens": full(sink), "recent_tokens": full(recent), "history_tokens": full(history),
        "new_tokens": full(1),
        "bf16_write_page": bf16_table[:, slot_index : slot_index + 1].copy(), "bf16_write_slot": full(slot)[:, None],
        "int2_write_page": full(int2_pool)[:, None], "int2_write_slot": full(0)[:, None],  # out of range: no write
        "num_bf16_pages": bf16_pool, "num_int2_pages": int2_pool,
    }


def step_plan(tables: dict):
    import jax.numpy as jnp

    from oscar_jax.cache import StepPlan

    return StepPlan(**{f.name: jnp.asarray(tables[f.name]) for f in dataclasses.fields(StepPlan)})


# ------------------------------------------------------------------------------ device state


def _fill_fns():
    import functools

    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, donate_argnums=0, static_argnames="kind")
    def fill(pool, key, layer, kind):
        """pool[layer] ← random data of its tier (one layer at a time bounds the temporaries)."""
        shape = pool.shape[1:]
        if kind == "codes":  # random bytes via uint32 words
            words = jax.random.bits(key, shape[:-1] + (shape[-1] // 4,), jnp.uint32)
            x = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)
        elif kind == "scale":
            x = jax.random.uniform(key, shape, jnp.float32, 0.02, 0.12).astype(pool.dtype)
        elif kind == "min":  # −1.5 × a scale-like draw: codes 0…3 span roughly [−1.5 s, 1.5 s]
            x = (-1.5 * jax.random.uniform(key, shape, jnp.float32, 0.02, 0.12)).astype(pool.dtype)
        else:
            x = (0.1 * jax.random.normal(key, shape, jnp.float32)).astype(pool.dtype)
        return jax.lax.dynamic_update_index_in_dim(pool, x, layer, 0)

    return fill


def random_cache(model, oscar: OscarConfig, tables: dict, *, seed: int = 0, interpret=None):
    """OscarKVCache.create (zero pools), then every pool filled layer by layer on the device."""
    import jax
    import jax.numpy as jnp

    from oscar_jax.cache import POOL_NAMES, OscarKVCache

    d = model.head_dim
    rotation = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (model.num_layers, model.num_kv_heads, d, d))
    cache = OscarKVCache.create(
        oscar, num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
        num_bf16_pages=tables["num_bf16_pages"], num_int2_pages=tables["num_int2_pages"], k_rotation=rotation,
        k_clip_ratio=[CLIP_RATIO] * model.num_layers, v_clip_ratio=[CLIP_RATIO] * model.num_layers,
        interpret=interpret)
    fill = _fill_fns()
    key = jax.random.key(seed)
    pools = {}
    for i, name in enumerate(POOL_NAMES):
        pool = getattr(cache, name)
        kind = name.split("_", 1)[1]  # bf16, codes, scale, min
        for layer in range(model.num_layers):
            pool = fill(pool, jax.random.fold_in(key, i * 1000 + layer), jnp.int32(layer), kind)
        pools[name] = pool
    return dataclasses.replace(cache, **pools).with_plan(step_plan(tables), "decode")


# ------------------------------------------------------------------------------ timing


def _decode_fn():
    import jax

    from oscar_jax.model import decode_step

    return jax.jit(decode_step, static_argnames="cfg", donate_argnames="cache")


_HLO_COPY = re.compile(r"= \S+ copy\(")


def compile_step(params, model, tokens, cache, positions) -> tuple:
    """AOT-compile the donated decode step; returns (callable(params, tokens, cache, positions), info)."""
    t0 = time.perf_counter()
    compiled = _decode_fn().lower(params, model, tokens, cache, positions).compile()
    info = {"compile_s": time.perf_counter() - t0}
    try:
        mem = compiled.memory_analysis()
        info["temp_bytes"] = int(mem.temp_size_in_bytes)
        info["argument_bytes"] = int(mem.argument_size_in_bytes)
        info["alias_bytes"] = int(mem.alias_size_in_bytes)
    except Exception as err:  # noqa: BLE001 - diagnostics only; some backends lack the analysis
        info["memory_analysis"] = f"unavailable ({type(err).__name__})"
    try:  # whole-array copies in the optimized program (a pool copied per layer shows up here)
        info["hlo_copy_ops"] = len(_HLO_COPY.findall(compiled.as_text()))
    except Exception as err:  # noqa: BLE001
        info["hlo_copy_ops"] = f"unavailable ({type(err).__name__})"
    return compiled, info


def time_steps(step, params, tokens, cache, positions, *, steps: int, trials: int):
    """Median per-step seconds of a Python loop of donated steps (module docstring), plus checks."""
    import jax
    import numpy as np

    before = _pool_pointers(cache)
    logits, cache = step(params, tokens, cache, positions)
    first = np.asarray(logits)
    after = _pool_pointers(cache)
    logits, cache = step(params, tokens, cache, positions)
    second = np.asarray(logits)
    times, dispatch = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = step(params, tokens, cache, positions)
        # Host time to hand the steps over; ≈ the loop's time when the host, not the GPU, is the bound.
        dispatch.append((time.perf_counter() - t0) / steps)
        jax.block_until_ready((logits, cache))
        times.append((time.perf_counter() - t0) / steps)
    checks = {"logits_finite": bool(np.all(np.isfinite(first)) and np.all(np.isfinite(second))),
              "deterministic": bool(np.array_equal(first, second)),
              "logits_abs_max": float(np.max(np.abs(first))),
              # a donated step must update the pools in place; a moved pool is a whole-pool copy
              "pools_moved": sorted(n for n in before if before[n] is not None and before[n] != after[n])}
    timing = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": steps,
              "trials": trials, "dispatch_median_s": statistics.median(dispatch)}
    return timing, checks, cache


def _pool_pointers(cache) -> dict:
    """Device address of every pool (None where the backend does not expose it)."""
    from oscar_jax.cache import POOL_NAMES

    pointers = {}
    for name in POOL_NAMES:
        try:
            pointers[name] = getattr(cache, name).unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - diagnostics only
            pointers[name] = None
    return pointers


def _is_oom(err: Exception) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return any(s in text for s in ("resource_exhausted", "out of memory", "oom", "resource exhausted"))


def _device_memory_bytes() -> tuple[int | None, str]:
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices may not report
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "jax memory_stats()['bytes_limit']"
    return None, "unavailable"


# ------------------------------------------------------------------------------ run


def run(contexts=None, *, floor_gb_per_s: float | None = None, model=None, oscar: OscarConfig | None = None,
        batch: int = 1, capacity_context: int | None = CAPACITY_CONTEXT, memory_bytes: int | None = None,
        reserve_bytes: int = WORKSPACE_RESERVE_BYTES, steps: int = STEPS, trials: int = 5, interpret=None,
        seed: int = 0, on_progress=None, kinds=CACHE_KINDS) -> dict:
    """End-to-end decode steps per (cache, context), and capacity at `capacity_context`.

    `model` defaults to Qwen3-8B (`qwen3_8b_config`), `oscar` to page 64 / sink 64 / recent 256 /
    G 128. `floor_gb_per_s` (the caller's measured read-only bandwidth: a decode step only
    reads its weights and KV) sets the floors (None: no floors). `kinds`: the caches to step (a subset of CACHE_KINDS). `memory_bytes` overrides the
    device memory used for capacity; `capacity_context=None` skips the capacity part. `on_progress(result)` is called with the partial result after every
    measurement, so a run cut off by a time limit still leaves what it measured.
    """
    import jax
    import jax.numpy as jnp

    model = model or qwen3_8b_config()
    oscar = oscar or oscar_config(model.head_dim)
    contexts = CONTEXTS if contexts is None else tuple(contexts)  # () → capacity only
    if unknown := set(kinds) - set(CACHE_KINDS):
        raise ValueError(f"kinds {sorted(unknown)} are not among {CACHE_KINDS}")
    t_start = time.perf_counter()

    def log(msg):
        print(f"  [e2e {time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

    params = random_params(model, seed)
    weights = param_bytes(params)
    log(f"random bf16 params: {weights['weight_bytes'] / 1e9:.2f} GB")

    def weight_bytes_read(b):
        return weights["weight_bytes"] - weights["embedding_bytes"] + b * weights["embedding_row_bytes"]

    def floor(b, kv):
        if not floor_gb_per_s:
            return None
        return (weight_bytes_read(b) + kv) / (floor_gb_per_s * 1e9)

    def measure(kind, context, b, table_context, compiled=None):
        """Build the cache, (compile), time. Returns (entry, compiled, info)."""
        tables = plan_tables(kind, context, b, oscar, table_context=table_context, seed=seed + context)
        cache = random_cache(model, oscar, tables, seed=seed, interpret=interpret)
        tokens = jax.random.randint(jax.random.key(seed + 1), (b,), 0, model.vocab_size, jnp.int32)
        positions = jnp.full((b,), context - 1, jnp.int32)
        info = None
        if compiled is None:
            compiled, info = compile_step(params, model, tokens, cache, positions)
            log(f"compiled {kind} b={b} tables for {table_context}: {info}")
        timing, checks, cache = time_steps(compiled, params, tokens, cache, positions, steps=steps, trials=trials)
        kv = kv_bytes_read(kind, context, b, model.num_layers, model.num_kv_heads, oscar)
        entry = {"cache": kind, "context": context, "batch": b, "table_context": table_context,
                 "tiers": {n: int(tables[n][0]) for n in ("sink_tokens", "history_tokens", "recent_tokens")},
                 "pool_bytes": int(cache.nbytes()), **timing, **checks,
                 "weight_bytes_read": weight_bytes_read(b), "kv_bytes_read": kv, "floor_s": floor(b, kv)}
        entry["step_over_floor"] = entry["median_s"] / entry["floor_s"] if entry["floor_s"] else None
        entry["tokens_per_s"] = b / entry["median_s"]
        del cache
        gc.collect()
        ratio = f", {entry['step_over_floor']:.2f}x floor" if entry["step_over_floor"] else ""
        log(f"{kind} ctx {context} b {b}: {entry['median_s'] * 1e3:.2f} ms/step{ratio}, "
            f"finite={entry['logits_finite']} deterministic={entry['deterministic']} "
            f"pools moved by a step: {entry['pools_moved'] or 'none'}")
        return entry, compiled, info

    result = {"model": dataclasses.asdict(model), "model_name": "qwen3-8b shapes, random bf16 weights",
              "oscar": oscar.to_dict(), "batch": batch, "contexts": list(contexts),
              "floor_gb_per_s": floor_gb_per_s, **weights,
              "timing_method": "AOT-compiled donated step; Python loop of `steps` steps, one block at the end; "
                               "median over `trials` loops after 2 warm-up steps",
              "runs": [], "compile": {}}
    table_context = max(contexts, default=0)
    for kind in kinds if contexts else ():
        compiled = None
        for context in contexts:
            entry, compiled, info = measure(kind, context, batch, table_context, compiled)
            if info is not None:
                result["compile"][f"{kind}_b{batch}"] = info
            result["runs"].append(entry)
            if on_progress:
                on_progress(result)
        del compiled
        gc.collect()

    if capacity_context:
        result["capacity"] = {}
        capacity(measure, model, oscar, weights["weight_bytes"], capacity_context, memory_bytes, reserve_bytes, log,
                 out=result["capacity"], on_progress=(lambda: on_progress(result)) if on_progress else None)
    result["wall_s"] = time.perf_counter() - t_start
    del params
    gc.collect()
    return result


def capacity(measure, model, oscar, weight_bytes, context, memory_bytes, reserve_bytes, log, *, out=None,
             on_progress=None) -> dict:
    source = "argument"
    if memory_bytes is None:
        memory_bytes, source = _device_memory_bytes()
    out = {} if out is None else out
    out |= {"context": context, "memory_bytes": memory_bytes, "memory_source": source,
           "workspace_reserve_bytes": reserve_bytes, "weight_bytes": weight_bytes,
           # A growing allocator (preallocate false) fragments its regions: the run at git 51405f0
           # failed to allocate a 47 GiB pool with 55 GB free (probe_capacity_int2_b55_h200.json at caf5132).
           "allocator": {n: os.environ.get(n) for n in ("XLA_PYTHON_CLIENT_PREALLOCATE",
                                                         "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                         "XLA_PYTHON_CLIENT_ALLOCATOR")}}
    if memory_bytes is None:
        log("capacity skipped: device memory unknown")
        return out
    for kind in CACHE_KINDS:
        per_seq = sequence_cache_bytes(kind, context, model.num_layers, model.num_kv_heads, oscar)
        n = max_sequences(memory_bytes, weight_bytes, reserve_bytes, per_seq)
        entry = {"per_sequence_bytes": per_seq, "max_concurrent_100k": int(n), "attempts": []}
        out[kind] = entry
        b = n
        while b >= 1:
            try:
                run_entry, compiled, info = measure(kind, context, b, context)
                del compiled
            except Exception as err:  # noqa: BLE001 - OOM steps the batch down; anything else is recorded
                gc.collect()
                entry["attempts"].append({"batch": b, "error": f"{type(err).__name__}: {str(err)[:300]}"})
                log(f"capacity {kind} b={b}: {type(err).__name__}: {str(err)[:200]}")
                if on_progress:
                    on_progress()
                if not _is_oom(err):
                    break
                b = min(b - 1, int(b * 0.9))
                continue
            entry["attempts"].append({"batch": b, "ok": True})
            entry.update(built_batch=b, step=run_entry, compile=info,
                         tokens_per_s_at_capacity=b / run_entry["median_s"])
            break
        else:
            entry.update(built_batch=0, tokens_per_s_at_capacity=None)
        entry.setdefault("tokens_per_s_at_capacity", None)
        gc.collect()
        if on_progress:
            on_progress()
    return out
