"""Tensor-parallel decode step at Qwen3-8B shapes (random bf16 weights): tp 1 vs tp N, INT2 and BF16 caches.

    python -m benchmarks.bench_tp --tp 1 2 --contexts 32768 102400 --batches 1 8 --out benchmarks/results/tp/RUN.json

What one row times: the decode step of `oscar_jax.model.decode_step` over an OscarKVCache at
context C and batch B, as bench_e2e builds it (random pools filled on the device, the plan of
`bench_e2e.plan_tables`: INT2 = sink 64 + INT2 history + BF16 recent; BF16 = everything in the
BF16 tier), timed by `bench_e2e.time_steps` (a Python loop of donated steps, median of trials).
  tp 1  today's single-device step (`bench_e2e.compile_step`), on the first device
  tp 1, mesh  (--mesh-of-one) the sharded step on a mesh of one device: its time against tp 1's
        is what the shard_map wrapping costs (nothing, if XLA sees through it)
  tp N  the same step under `jax.shard_map` on a mesh of N devices (oscar_jax.parallel): weights
        by heads / MLP columns / vocabulary, pools by KV head, 2 all-reduces per layer + 1 for the
        embedding and 1 all-gather of the logits
Per tp-N row, on a GPU: `collectives_s`, the time per step of the NCCL kernels (all-reduce,
all-gather) on the first GPU, from a jax.profiler trace of `profile_steps` steps (kernel events
whose name says AllReduce / AllGather / all-reduce / all-gather), and their names.
Capacity per row: concurrent sequences of C tokens that fit, per device, beside its share of the
weights and a workspace reserve (`bench_e2e.max_sequences`): each device holds K/N KV heads of
every sequence (K·r/N when KV heads are replicated), so capacity scales ~N× in sequences.
Every row records the logits' checks of `time_steps` (finite, deterministic, no pool copied). A row
whose cache does not fit (BF16 at 100K, batch 8, on one 80 GB GPU) records `error` instead.

`--tiny` runs a tiny model at the given (small) contexts: the CPU test of this script's plumbing
(`XLA_FLAGS=--xla_force_host_platform_device_count=2`); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import bench_e2e

COLLECTIVE = re.compile(r"all[-_]?reduce|all[-_]?gather|nccl", re.IGNORECASE)
DEFAULT_CONTEXTS = (32768, 102400)
DEFAULT_BATCHES = (1, 8)


def tiny_config():
    from oscar_jax.model import ModelConfig

    return ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_q_heads=8,
                       num_kv_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=False,
                       qk_norm=True)


def tiny_oscar():
    from shared_math.spec import OscarConfig

    return OscarConfig(head_dim=64, page_size=16, sink=16, recent=32)


@functools.lru_cache(maxsize=None)
def _sharded_fill(tp, kind: str):
    """pool[layer] ← random data of its tier, each shard filling its own heads (never whole)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from oscar_jax.parallel import POOL_SPEC, TP_AXIS, _shard_map

    fill = bench_e2e._fill_fns()

    def body(pool, key, layer):
        return fill(pool, jax.random.fold_in(key, jax.lax.axis_index(TP_AXIS)), layer, kind)

    return jax.jit(_shard_map(tp, body, (POOL_SPEC, P(), P()), POOL_SPEC), donate_argnums=0)


def sharded_cache(tp, oscar, tables, *, seed: int = 0):
    """tp.create_cache (pools allocated sharded) filled with random data shard by shard."""
    import jax
    import jax.numpy as jnp

    from oscar_jax.cache import POOL_NAMES

    model = tp.cfg
    cache = tp.create_cache(oscar, num_bf16_pages=tables["num_bf16_pages"], num_int2_pages=tables["num_int2_pages"],
                            k_rotation=np.broadcast_to(np.eye(model.head_dim, dtype=np.float32), (
                                model.num_layers, model.num_kv_heads // tp.kv_replicas, model.head_dim,
                                model.head_dim)),
                            k_clip_ratio=[bench_e2e.CLIP_RATIO] * model.num_layers,
                            v_clip_ratio=[bench_e2e.CLIP_RATIO] * model.num_layers)
    key = jax.random.key(seed)
    pools = {}
    for i, name in enumerate(POOL_NAMES):
        pool, fill = getattr(cache, name), _sharded_fill(tp, name.split("_", 1)[1])
        for layer in range(model.num_layers):
            pool = fill(pool, jax.random.fold_in(key, i * 1000 + layer), jnp.int32(layer))
        pools[name] = pool
    return dataclasses.replace(cache, **pools).with_plan(bench_e2e.step_plan(tables), "decode")


def device_bytes(tree, device) -> int:
    """Bytes of a pytree's arrays that live on `device`."""
    import jax

    return sum(int(s.data.nbytes) for leaf in jax.tree_util.tree_leaves(tree) for s in leaf.addressable_shards
               if s.device == device)


def collective_seconds(run, steps: int) -> dict:
    """NCCL kernel time per step on the first GPU (module docstring), from a profile of `steps` calls."""
    import jax

    from benchmarks.harness import device_kernels

    if jax.default_backend() != "gpu":
        return {"collectives_s": None, "collectives_note": f"no GPU profile on {jax.default_backend()}"}
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(run())
        events, _ = device_kernels(trace_dir)
    picked = [(name, dur) for name, _, dur in events if COLLECTIVE.search(name)]
    total = sum(dur for _, dur in events)
    return {"collectives_s": sum(d for _, d in picked) / steps / 1e9,
            "kernels_s": total / steps / 1e9,
            "collective_kernels": sorted({n for n, _ in picked})[:8],
            "collective_launches_per_step": len(picked) / steps}


def run_row(tp_size: int, kind: str, context: int, batch: int, *, model, oscar, make_params, steps: int,
            trials: int, profile_steps: int, memory_bytes: int | None, reserve_bytes: int,
            mesh: bool = False) -> dict:
    import jax
    import jax.numpy as jnp

    from oscar_jax.parallel import TensorParallel, _decode_step, make_mesh

    tables = bench_e2e.plan_tables(kind, context, batch, oscar)
    tokens = jnp.zeros((batch,), jnp.int32)
    positions = jnp.full((batch,), context - 1, jnp.int32)
    row = {"tp": tp_size, "mesh": mesh or tp_size > 1, "kind": kind, "context": context, "batch": batch}
    if not row["mesh"]:
        from oscar_jax.model import fuse_qkv

        params = fuse_qkv(make_params())
        cache = bench_e2e.random_cache(model, oscar, tables)
        step, info = bench_e2e.compile_step(params, model, tokens, cache, positions)
        kv_heads_per_device, device = model.num_kv_heads, jax.devices()[0]
    else:
        tp = TensorParallel.plan(model, make_mesh(tp_size))
        # Made per row and dropped once sharded: a whole copy kept on the first device would take
        # the room of the cache there.
        params = tp.shard_params(make_params())
        cache = sharded_cache(tp, oscar, tables)
        t0 = time.perf_counter()
        step = _decode_step.lower(params, tokens, cache, positions, tp=tp).compile()
        info = {"compile_s": time.perf_counter() - t0, "kv_replicas": tp.kv_replicas}
        kv_heads_per_device, device = tp.local.num_kv_heads, tp.mesh.devices.flat[0]
    timing, checks, cache = bench_e2e.time_steps(step, params, tokens, cache, positions, steps=steps, trials=trials)
    row.update(timing=timing, checks=checks, compile=info)
    if tp_size > 1:
        state = {"cache": cache}

        def one():
            logits, state["cache"] = step(params, tokens, state["cache"], positions)
            return logits

        row.update(collective_seconds(one, profile_steps))
    weights = device_bytes(params, device)
    per_sequence = bench_e2e.sequence_cache_bytes(kind, context, model.num_layers, kv_heads_per_device, oscar)
    row["capacity"] = {
        "device_weight_bytes": weights, "device_bytes_per_sequence": per_sequence,
        "kv_heads_per_device": kv_heads_per_device, "device_memory_bytes": memory_bytes,
        "reserve_bytes": reserve_bytes,
        "sequences": None if memory_bytes is None else bench_e2e.max_sequences(memory_bytes, weights, reserve_bytes,
                                                                               per_sequence)}
    del cache, params
    return row


def run(tp_sizes, kinds, contexts, batches, *, tiny: bool = False, steps: int = bench_e2e.STEPS, trials: int = 5,
        profile_steps: int = 5, mesh_of_one: bool = False, log=print) -> dict:
    import jax

    from oscar_jax.model import init_params

    model = tiny_config() if tiny else bench_e2e.qwen3_8b_config()
    oscar = tiny_oscar() if tiny else bench_e2e.oscar_config(model.head_dim)
    if max(tp_sizes) > jax.device_count():
        raise ValueError(f"--tp {max(tp_sizes)} needs {max(tp_sizes)} devices, but {jax.device_count()} "
                         f"{jax.devices()[0].platform} devices are present")

    def make_params():
        return init_params(model, jax.random.key(0), dtype=jax.numpy.bfloat16)

    memory_bytes, memory_source = bench_e2e._device_memory_bytes()
    reserve = 0 if tiny else bench_e2e.WORKSPACE_RESERVE_BYTES
    rows = []
    for kind in kinds:
        for context in contexts:
            for batch in batches:
                for tp_size, mesh in [(t, False) for t in tp_sizes] + ([(1, True)] if mesh_of_one else []):
                    try:
                        row = run_row(tp_size, kind, context, batch, model=model, oscar=oscar,
                                      make_params=make_params, steps=steps, trials=trials, profile_steps=profile_steps,
                                      memory_bytes=memory_bytes, reserve_bytes=reserve, mesh=mesh)
                    except Exception as err:  # noqa: BLE001 - a cache too large for tp 1 is a result, not a crash
                        if not bench_e2e._is_oom(err):
                            raise
                        rows.append({"tp": tp_size, "mesh": mesh or tp_size > 1, "kind": kind, "context": context,
                                     "batch": batch, "error": f"out of memory: {str(err)[:200]}"})
                        log(f"[bench_tp] {kind} C={context} B={batch} tp={tp_size}: out of memory")
                        continue
                    rows.append(row)
                    log(f"[bench_tp] {kind} C={context} B={batch} tp={tp_size}{' (mesh)' if mesh else ''}: "
                        f"{row['timing']['median_s'] * 1e3:.3f} ms/step"
                        + (f", collectives {row['collectives_s'] * 1e3:.3f} ms" if row.get("collectives_s") else "")
                        + f", capacity {row['capacity']['sequences']}")
    timed = [r for r in rows if "timing" in r]
    for row in timed:  # tp N against tp 1 of the same kind, context and batch
        same = [r for r in timed if all(r[k] == row[k] for k in ("kind", "context", "batch"))]
        base = next((r for r in same if r["tp"] == 1 and not r["mesh"]), None)
        if base is not None:
            row["step_ratio_vs_tp1"] = row["timing"]["median_s"] / base["timing"]["median_s"]
            if row["capacity"]["sequences"] and base["capacity"]["sequences"]:
                row["capacity_ratio_vs_tp1"] = row["capacity"]["sequences"] / base["capacity"]["sequences"]
    return {"model": dataclasses.asdict(model), "oscar": oscar.to_dict(), "tiny": tiny,
            "memory_source": memory_source, "devices": [str(d) for d in jax.devices()],
            "target": "tp 2 step <= 0.6 x tp 1 at batch 8, 100K, INT2 (issue TP-GPU)", "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--kinds", nargs="+", choices=bench_e2e.CACHE_KINDS, default=list(bench_e2e.CACHE_KINDS))
    p.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS))
    p.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES))
    p.add_argument("--steps", type=int, default=bench_e2e.STEPS)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--mesh-of-one", action="store_true", help="also time the sharded step on a mesh of one device")
    p.add_argument("--tiny", action="store_true", help="a tiny model: the CPU plumbing test")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if min(args.tp) < 1:
        p.error(f"--tp {args.tp}: sizes must be positive")
    result = run(args.tp, args.kinds, args.contexts, args.batches, tiny=args.tiny, steps=args.steps,
                 trials=args.trials, profile_steps=args.profile_steps, mesh_of_one=args.mesh_of_one)
    from benchmarks.harness import environment

    result["environment"] = environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"[bench_tp] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
