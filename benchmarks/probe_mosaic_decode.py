"""Issue 41, first Mosaic GPU kernel: the INT2 tier of decode attention on Pallas Mosaic GPU
(oscar_jax.kernels.mosaic.decode_attention) against the Triton-lowered INT2 tier launched as
oscar_jax.ops.decode_attention launches it by default, on Hopper, Qwen3-8B shapes (32 q heads,
8 KV heads, d 128, G 128, pages of 64), 128K context, batch 1 and 8.

Runs on whichever Hopper card the device gives (the first run got an H100 for an H200 request):
the baseline is timed in the same run, on the same card. Per (context, batch): the INT2 tier's
partials of both kernels on the same pools and split
(`shared_math.tiling.resolve_splits`, the default), compared (lse, and o where the split holds
tokens; relative error ‖Δ‖/‖ref‖); then each timed alone (harness.time_jax_loop: a chain of calls
in one jitted program, `copies` pool sets rotated so L2 holds none), and the whole default decode
call (both tiers + merge) for scale with PROBE_WHOLE_DECODE=1. Mosaic variants: VARIANTS (unpacking,
buffers, pipeline stages, and the output as written, oᵀ [B, K, S, D, R] with `transposed=True`, or
swapped to the Triton kernel's [B, K, S, R, D] by XLA); then the BF16 tier (sink + recent pages) of
both backends, compared and timed. Writes argv[1] (default
$OUT/probe_mosaic_decode.json; the environment block names the card); prints a table last.

    OSCAR_GIT_SHA=$(git rev-parse HEAD) PYTHONPATH=. python benchmarks/probe_mosaic_decode.py out.json

Measured (results/probe_mosaic_decode_h100.json, H100 80GB HBM3, jax 0.11.2, at 65b5ddd: the kernel
with converted codes and one buffer): compiles, partials match the Triton kernel's (o relative error
2.6e-5 / 2.8e-5, lse 2e-6); 128K b1 114.9–120.0 µs against the Triton INT2 tier's 56.7 µs, b8
864.3–870.7 µs against 289.3 µs (stages 2 / 4 / 8 within 4 %: not the copies; the int → bf16
conversions, a quarter of the integer rate, estimated at ~70 µs of b1's time, are what biased_codes
removes). On an H200 (results/probe_mosaic_decode_h200.json, at 14ff9df, cut by its call's timeout
after the fourth Mosaic variant at 128K b1): Triton 54.2 µs; Mosaic converted 115.6, biased 95.1,
converted + buf2 + lazy + own barriers 114.2, biased + buf2 + lazy + own barriers 83.7 µs.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback

import numpy as np

from benchmarks import harness
from benchmarks.bench_decode import PAGE, QWEN3_8B, RECENT, SINK, build_int2_cache, int2_bytes_read

CONFIGS = ((131072, 1), (131072, 8))
# The Mosaic variants timed: (name, keyword arguments of mosaic int2_tier_partials). The first run
# (results/probe_mosaic_decode_h100.json, at 65b5ddd) timed the converted codes with one buffer at
# stages 2 / 4 / 8 (within 4 % of each other) and the transposed output; the biased codes and the
# second buffer had not been written yet.
VARIANTS = (
    ("mosaic[converted,buf1,stages2]", dict(biased_codes=False, buffers=1, stages=2)),  # as timed at 65b5ddd
    ("mosaic[biased,buf1,stages2]", dict(biased_codes=True, buffers=1, stages=2)),  # the conversions' share
    ("mosaic[converted,buf2,lazy,own,stages2]",  # the barriers' share (18 → 3 a page in the lowered loop)
     dict(biased_codes=False, buffers=2, lazy_sums=True, auto_barriers=False, stages=2)),
    ("mosaic[biased,buf2,lazy,own,stages2]", dict(biased_codes=True, buffers=2, lazy_sums=True, auto_barriers=False,
                                                  stages=2)),
    ("mosaic[biased,buf2,lazy,own,stages4]", dict(biased_codes=True, buffers=2, lazy_sums=True, auto_barriers=False,
                                                  stages=4)),
    ("mosaic[biased,buf2,lazy,own,stages4][transposed]",
     dict(biased_codes=True, buffers=2, lazy_sums=True, auto_barriers=False, stages=4, transposed=True)),
)
TIME_WHOLE_DECODE = os.environ.get("PROBE_WHOLE_DECODE", "0") == "1"  # ops.decode_attention, both tiers
# PROBE_VARIANTS="name;name": only those of VARIANTS (a call's time limit holds a few compiles, not all)
if os.environ.get("PROBE_VARIANTS"):
    _chosen = os.environ["PROBE_VARIANTS"].split(";")
    _unknown = sorted(set(_chosen) - {name for name, _ in VARIANTS})
    if _unknown:
        raise SystemExit(f"PROBE_VARIANTS: unknown {_unknown}; known: {[name for name, _ in VARIANTS]}")
    VARIANTS = tuple(v for v in VARIANTS if v[0] in _chosen)
# PROBE_SMOKE=1: the script's own check on a CPU, before a GPU call spends device time on it: a small
# context, every kernel interpreted, each variant run once instead of timed.
SMOKE = os.environ.get("PROBE_SMOKE", "0") == "1"
if SMOKE:
    CONFIGS = ((SINK + RECENT + 2 * PAGE + 17, 1),)


def _time(step, carry, reps, operands):
    """harness.time_jax_loop, or (PROBE_SMOKE) one call's wall time."""
    if not SMOKE:
        return harness.time_jax_loop(step, carry, reps=reps, operands=operands)
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(step(0, carry, *operands))
    return {"median_s": time.perf_counter() - t0, "smoke": True}


def main(out_path: str) -> dict:
    import jax
    import jax.numpy as jnp

    from oscar_jax import ops
    from oscar_jax.kernels import decode_attention as triton_kernels
    from oscar_jax.kernels import register_cap
    from oscar_jax.kernels.mosaic import decode_attention as mosaic_kernels
    from shared_math import tiling

    hq, kv, d = QWEN3_8B["q_heads"], QWEN3_8B["kv_heads"], QWEN3_8B["head_dim"]
    group_size, scale = d, d**-0.5
    rows = tiling.int2_decode_rows(hq // kv)
    result = {"environment": harness.environment(), "configs": []}

    def save():
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    for context, batch in CONFIGS:
        cfg = {"context": context, "batch": batch, "rows": rows, "variants": {}}
        result["configs"].append(cfg)
        read = int2_bytes_read(batch, context, kv, d, group_size)
        history_slots = (context - SINK - RECENT) // PAGE
        bf16_slots = (SINK + RECENT) // PAGE
        pages_per_split, _, _ = tiling.resolve_splits(None, 1, bf16_slots, history_slots, PAGE,
                                                      sequence_heads=batch * kv)
        int2_history_bytes = batch * kv * history_slots * PAGE * 2 * (d // 4 + 4)
        cfg.update(pages_per_split=pages_per_split, history_slots=history_slots,
                   int2_history_bytes=int2_history_bytes, int2_bytes_read_all_tiers=read["total"])
        copies = harness.copies_to_defeat_l2(int2_history_bytes)
        cfg["copies"] = copies
        key = jax.random.key(0)
        pools, bf16_tables, history_tables, lengths = build_int2_cache(
            jax.random.fold_in(key, 2), batch, context, copies, group_size, kv, d)
        names = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
        int2_pools = tuple(pools[n] for n in names)
        history_t = jnp.asarray(history_tables)
        history_tokens = jnp.asarray(lengths["history_tokens"])
        q = jax.random.normal(jax.random.fold_in(key, 1), (batch, hq, d), jnp.float32).astype(jnp.bfloat16)
        q_rows = jnp.pad(q.reshape(batch, kv, hq // kv, d), ((0, 0), (0, 0), (0, 16 - hq // kv), (0, 0)))
        split_common = dict(group_size=group_size, softmax_scale=scale, pages_per_split=pages_per_split,
                            pages_per_block=1, block_m=rows, rows=rows)
        # The Triton-lowered INT2 tier as ops.decode_attention launches it by default on this grid.
        tokens_on_m = tiling.int2_decode_tokens_on_m(batch, kv, history_slots, pages_per_split, PAGE)
        channels_on_m = tiling.int2_decode_channels_on_m(tokens_on_m, group_size, d)
        triton_launch = dict(
            tokens_on_m=tokens_on_m, channels_on_m=channels_on_m, unpack_asm=not SMOKE, fma_asm=not SMOKE,
            num_warps=tiling.INT2_DECODE_NUM_WARPS if tokens_on_m else 2, num_stages=tiling.DECODE_NUM_STAGES,
            # the register cap only where opted in (OSCAR_JAX_REGISTER_CAP=1), as ops.decode_attention
            max_registers=tiling.int2_decode_max_registers(tokens_on_m, channels_on_m, rows_on_m=0)
            if register_cap.opted_in() else 0)
        cfg["triton_launch"] = triton_launch

        def triton_tier(q_, c, operands):
            pools_, table, hist = operands
            return triton_kernels.int2_tier_partials(q_, *pools_, table[c], hist, interpret=SMOKE,
                                                     **split_common, **triton_launch)

        def mosaic_tier(q_, c, operands, **kw):
            pools_, table, hist = operands
            return mosaic_kernels.int2_tier_partials(q_, *pools_, table[c], hist, interpret=SMOKE,
                                                     **split_common, **kw)

        operands = (int2_pools, history_t, history_tokens)
        want_o, want_lse = jax.jit(lambda q_, ops_: triton_tier(q_, 0, ops_))(q_rows, operands)
        want_o, want_lse = np.asarray(want_o), np.asarray(want_lse)
        nonempty = np.isfinite(want_lse)

        def compare(o, lse):
            o, lse = np.asarray(o), np.asarray(lse)
            same_empty = bool((np.isfinite(lse) == nonempty).all())
            o_err = float(np.linalg.norm(o - want_o) / np.linalg.norm(want_o))
            lse_err = float(np.abs(lse[nonempty] - want_lse[nonempty]).max())
            return {"o_rel_error": o_err, "lse_max_abs_error": lse_err, "same_empty_splits": same_empty,
                    "finite": bool(np.isfinite(o).all()),
                    "passed": bool(same_empty and o_err < 1e-2 and lse_err < 1e-2 and np.isfinite(o).all())}

        def timed(name, fn, check=None, bytes_read=int2_history_bytes):
            entry = {}
            try:
                if check is not None:
                    entry.update(check)

                def step(i, q_, ops_):
                    o, lse = fn(q_, i % copies, ops_)
                    return (q_.astype(jnp.float32) + 0.0 * jnp.sum(o) + 0.0 * jnp.sum(lse)).astype(q_.dtype)

                t = _time(step, q_rows, max(32, 2 * copies), (operands,))
                entry.update(t, gb_per_s=bytes_read / t["median_s"] / 1e9, bytes_read=bytes_read)
            except Exception as e:  # noqa: BLE001 - a failing variant is recorded, not fatal
                entry["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
                traceback.print_exc()
            cfg["variants"][name] = entry
            save()
            us = f"{entry['median_s'] * 1e6:8.1f} us {entry['gb_per_s']:6.0f} GB/s" if "median_s" in entry else "ERROR"
            print(f"  {name:34s} {context // 1024}K b{batch}: {us} {check or ''}", flush=True)

        timed("triton_int2_tier_default", triton_tier)
        for name, kw in VARIANTS:
            check = None
            if not kw.get("transposed"):
                try:
                    check = compare(*jax.jit(lambda q_, ops_, kw=kw: mosaic_tier(q_, 0, ops_, **kw))(q_rows, operands))
                except Exception as e:  # noqa: BLE001 - a failing variant is recorded, not fatal
                    cfg["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:3000]}"}
                    traceback.print_exc()
                    save()
                    print(f"  {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                    continue
            timed(name, functools.partial(mosaic_tier, **kw), check)

        # The BF16 tier (sink + recent pages, 5 a sequence at the defaults), both kernels, its own split.
        _, bf16_pps, _ = tiling.resolve_splits(None, 1, bf16_slots, history_slots, PAGE, sequence_heads=batch * kv)
        bf16_warps, bf16_stages = tiling.default_decode_launch(batch, kv, bf16_slots, history_slots, bf16_pps,
                                                               pages_per_split, int2_tokens_on_m=tokens_on_m)[0]
        bf16_ops = ((pools["k_bf16"], pools["v_bf16"]), jnp.asarray(bf16_tables),
                    jnp.asarray(lengths["sink_tokens"]), jnp.asarray(lengths["recent_tokens"]))
        bf16_common = dict(sink_slots=SINK // PAGE, softmax_scale=scale, pages_per_split=bf16_pps, pages_per_block=1)

        def triton_bf16(q_, c, ops_):
            (k_, v_), t_, s_, r_ = ops_
            return triton_kernels.bf16_tier_partials(q_, k_, v_, t_[c], s_, r_, block_m=16, interpret=SMOKE,
                                                     num_warps=bf16_warps, num_stages=bf16_stages, **bf16_common)

        def mosaic_bf16(q_, c, ops_, **kw):
            (k_, v_), t_, s_, r_ = ops_
            return mosaic_kernels.bf16_tier_partials(q_, k_, v_, t_[c], s_, r_, block_m=rows, interpret=SMOKE,
                                                     **bf16_common, **kw)

        try:
            bw_o, bw_lse = map(np.asarray, jax.jit(lambda q_, o_: triton_bf16(q_, 0, o_))(q_rows, bf16_ops))
            bg_o, bg_lse = map(np.asarray, jax.jit(lambda q_, o_: mosaic_bf16(
                q_, 0, o_, stages=2, buffers=2, auto_barriers=False))(q_rows, bf16_ops))
            g = hq // kv  # the real rows
            bf16_check = {"o_rel_error": float(np.linalg.norm(bg_o[..., :g, :] - bw_o[..., :g, :])
                                               / np.linalg.norm(bw_o[..., :g, :])),
                          "lse_max_abs_error": float(np.abs(bg_lse[..., :g] - bw_lse[..., :g]).max())}
            bf16_check["passed"] = bool(bf16_check["o_rel_error"] < 1e-2 and bf16_check["lse_max_abs_error"] < 1e-2)
        except Exception as e:  # noqa: BLE001
            bf16_check = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
            traceback.print_exc()
        saved_operands = operands
        operands = bf16_ops  # `timed` reads the operands of the tier it times
        bf16_tier_bytes = batch * kv * bf16_slots * PAGE * d * 2 * 2  # K and V, bfloat16
        timed("triton_bf16_tier_default", triton_bf16, bytes_read=bf16_tier_bytes)
        if "error" not in bf16_check:
            timed("mosaic_bf16_tier[stages=2,buffers=2,own]",
                  functools.partial(mosaic_bf16, stages=2, buffers=2, auto_barriers=False), bf16_check,
                  bytes_read=bf16_tier_bytes)
        else:
            cfg["variants"]["mosaic_bf16_tier[stages=2,buffers=2,own]"] = bf16_check
        operands = saved_operands

        # The whole default decode call (both tiers + merge), for scale against the cuDNN figures.
        all_pools = tuple(pools[n] for n in ("k_bf16", "v_bf16", *names))
        bf16_t = jnp.asarray(bf16_tables)
        sink, recent = jnp.asarray(lengths["sink_tokens"]), jnp.asarray(lengths["recent_tokens"])
        full_ops = (all_pools, bf16_t, history_t, sink, recent, history_tokens)

        def full_step(i, q_, ops_):
            p_, bt, ht, s_, r_, h_ = ops_
            o = ops.decode_attention(q_, *p_, bt[i % copies], s_, r_, ht[i % copies], h_, sink_slots=SINK // PAGE,
                                     group_size=group_size, softmax_scale=scale)
            return (q_.astype(jnp.float32) + 0.0 * jnp.sum(o)).astype(q_.dtype)

        mosaic_options = dict(int2_options=(("biased_codes", True), ("buffers", 2), ("lazy_sums", True),
                                            ("auto_barriers", False), ("stages", 2)),
                              bf16_options=(("buffers", 2), ("auto_barriers", False), ("stages", 2)))

        def mosaic_step(i, q_, ops_):
            p_, bt, ht, s_, r_, h_ = ops_
            o = mosaic_kernels.decode_attention(q_, *p_, bt[i % copies], s_, r_, ht[i % copies], h_,
                                                sink_slots=SINK // PAGE, group_size=group_size, softmax_scale=scale,
                                                interpret=SMOKE, **mosaic_options)
            return (q_.astype(jnp.float32) + 0.0 * jnp.sum(o)).astype(q_.dtype)

        for name, step in (("ops_decode_attention_default_all_tiers", full_step),
                           ("mosaic_decode_attention_all_tiers[biased,buf2,lazy,own]", mosaic_step)):
            try:
                if not TIME_WHOLE_DECODE:
                    raise RuntimeError("not timed (PROBE_WHOLE_DECODE=1 times it)")
                t = _time(step, q, max(32, 2 * copies), (full_ops,))
                cfg["variants"][name] = dict(t)
                print(f"  {name:34s} {context // 1024}K b{batch}: {t['median_s'] * 1e6:8.1f} us", flush=True)
            except Exception as e:  # noqa: BLE001
                cfg["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        save()
        del pools, int2_pools, operands, full_ops

    print("\nvariant                                  config     median_us  GB/s  check")
    for cfg in result["configs"]:
        for name, v in cfg["variants"].items():
            med = f"{v['median_s'] * 1e6:9.1f}" if "median_s" in v else "    error"
            gbs = f"{v.get('gb_per_s', 0):5.0f}"
            chk = ("pass" if v.get("passed") else "FAIL") if "passed" in v else ""
            print(f"{name:40s} {cfg['context'] // 1024}K b{cfg['batch']}  {med} {gbs}  {chk}")
    return result


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "probe_mosaic_decode.json")
    t0 = time.time()
    main(out)
    print(f"total {time.time() - t0:.0f} s")
