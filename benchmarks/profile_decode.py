"""Decode attention at 128K context for Nsight Compute: one INT2 cache, the Pallas and the Triton kernel.

    ncu --kernel-name regex:int2_tier --section SpeedOfLight --section WarpStateStats ... \\
        python3 -m benchmarks.profile_decode --batch 8

Each kernel runs twice (compile + warm, then the profiled launch); NOTES.md quotes the report.

    python3 -m benchmarks.profile_decode --batch 1 --breakdown OUT.json

`--breakdown` instead traces `--calls` calls of each backend (jax.profiler for Pallas,
torch.profiler for Triton) and writes, per backend, every kernel of one call with its time
(`profile_e2e.summarize_kernels`): where the time between the tier kernels and the whole op goes
(padding, concatenation, merge).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def _compiled_triton_kernels() -> list[dict]:
    """Registers, spills and shared memory of the torch backend's decode kernels as launched (with
    the runtime's argument specialisation, which the static analysis must reproduce)."""
    from benchmarks.static_analysis import async_copies
    from oscar_torch.kernels import decode_attention as kdecode

    found = []
    for name in ("_bf16_tier_kernel", "_int2_tier_kernel"):
        for caches in getattr(getattr(kdecode, name), "device_caches", {}).values():
            for compiled in caches[0].values():
                found.append({"kernel": name, "registers": compiled.n_regs, "spills": compiled.n_spills,
                              "shared": compiled.metadata.shared,
                              "async_copies": async_copies(compiled.asm["ttgir"])})
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--breakdown", type=Path, default=None, help="write a per-kernel breakdown JSON here")
    parser.add_argument("--calls", type=int, default=20, help="calls traced per backend with --breakdown")
    parser.add_argument("--unrolled", action="store_true",
                        help="with --breakdown, trace the Pallas calls as bench_decode times them: one jitted "
                             "program of --calls calls written out (harness.time_jax_loop's default), not one "
                             "dispatch per call")
    parser.add_argument("--num-warps", type=int, default=None,
                        help="warps of both backends' tier kernels (default: each backend's own default)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import torch

    from benchmarks import bench_decode
    from oscar_jax import ops
    from oscar_torch import attention_ops as torch_attention

    shapes = bench_decode.QWEN3_8B
    pools, bf16_tables, history_tables, lengths = bench_decode.build_int2_cache(
        jax.random.key(0), args.batch, args.context, 1, args.group_size, shapes["kv_heads"], shapes["head_dim"])
    names = ("k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
    q = jax.random.normal(jax.random.key(1), (args.batch, shapes["q_heads"], shapes["head_dim"])).astype(jnp.bfloat16)
    common = dict(sink_slots=bench_decode.SINK // bench_decode.PAGE, group_size=args.group_size,
                  softmax_scale=shapes["head_dim"] ** -0.5, num_warps=args.num_warps)
    tables = (jnp.asarray(bf16_tables[0]), jnp.asarray(lengths["sink_tokens"]), jnp.asarray(lengths["recent_tokens"]),
              jnp.asarray(history_tables[0]), jnp.asarray(lengths["history_tokens"]))
    pool_args = tuple(pools[n] for n in names)
    for _ in range(2):
        jax.block_until_ready(ops.decode_attention(q, *pool_args, *tables, **common))
    tq = torch.from_dlpack(q)
    targs = tuple(torch.from_dlpack(a) for a in pool_args + tables)
    for _ in range(2):
        torch_attention.decode_attention(tq, *targs, **common)
    torch.cuda.synchronize()
    if args.breakdown is None:
        print("profiled: Pallas and Triton INT2 decode attention", args, flush=True)
        return

    from benchmarks import harness, profile_e2e

    def attend(q_, pools_, tables_):
        return ops.decode_attention(q_, *pools_, *tables_, **common)

    if args.unrolled:
        def calls(q_, pools_, tables_):
            for _ in range(args.calls):  # the bench's step: a serial dependency, the same values
                q_ = (q_.astype(jnp.float32) + 0.0 * attend(q_, pools_, tables_)).astype(q_.dtype)
            return q_
        pallas, dispatches = jax.jit(calls), 1
    else:
        pallas, dispatches = jax.jit(attend), args.calls
    jax.block_until_ready(pallas(q, pool_args, tables))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(dispatches):
                out = pallas(q, pool_args, tables)
            jax.block_until_ready(out)
        jax_events, _ = harness.device_kernels(trace_dir)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            torch_attention.decode_attention(tq, *targs, **common)
        torch.cuda.synchronize()
    torch_events = [(e.name, int(e.time_range.start * 1e3), int(e.time_range.elapsed_us() * 1e3))
                    for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    result = {"environment": harness.environment(), "context": args.context, "batch": args.batch,
              "group_size": args.group_size, "calls": args.calls, "unrolled": args.unrolled,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "pallas": profile_e2e.summarize_kernels(jax_events, args.calls),
              "triton": profile_e2e.summarize_kernels(torch_events, args.calls),
              "triton_compiled": _compiled_triton_kernels()}
    args.breakdown.write_text(json.dumps(result, indent=1))
    for backend in ("pallas", "triton"):
        summary = result[backend]
        print(f"{backend}: {summary.get('kernels_per_step', 0):.0f} kernels per call, busy "
              f"{summary.get('busy_us_per_step', 0):.1f} us, span {summary.get('span_us_per_step', 0):.1f} us")
        for k in summary.get("top_kernels", [])[:8]:
            print(f"  {k['us_per_step']:8.1f} us  x{k['launches_per_step']:.0f}  {k['name'][:100]}")
    print(f"wrote {args.breakdown}", flush=True)


if __name__ == "__main__":
    main()
