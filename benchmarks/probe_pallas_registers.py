"""The Pallas INT2 decode kernel's registers as XLA compiles it, and what a cap buys (NOTES v28).

Nsight Compute on the H200 (results/ncu_launch_b8_128k_v28_h200.txt): at 128K batch 8 the Pallas INT2
tier kernel runs at 217 registers a thread (8 one-warp programs an SM, 12.5 % occupancy) where the
Triton kernel of the same design runs at 166 (12 an SM); the triton package's own sm_90 compile of
the Pallas kernel's Triton IR holds 168 (results/static_analysis_v26.txt). So XLA's compile of the
Triton IR, not the kernel's source, costs the Pallas kernel a third of its resident programs.

This times `oscar_jax.ops.decode_attention` at each `max_registers` (the Triton module's
`ttg.maxnreg`, `oscar_jax.kernels.register_cap`), checks each capped output bit for bit against
the first (a cap changes register allocation, not arithmetic), and writes the medians. Run it
under `ncu --section LaunchStats` with `--calls-only` to read the registers each cap gave
(results/ncu_probe_registers_v28_h200.txt: 217 uncapped, 168 and 160 capped, all bit-identical;
the timings of the caps came from `bench_h200 --variants`, results/decode_register_caps_v28_h200.log).

    PYTHONPATH=. python3 -m benchmarks.probe_pallas_registers --out probe_pallas_registers.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _caps(text: str) -> tuple[int | None, ...]:
    return tuple(None if c == "none" else int(c) for c in text.split(","))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", default="131072")
    parser.add_argument("--batches", default="8,1")
    parser.add_argument("--caps", type=_caps, default=(0, 168, 160, 128),
                        help="max_registers values; 0: the compiler's choice, 'none': the default")
    parser.add_argument("--calls-only", action="store_true", help="one call per cap, no timing (under ncu)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_decode, harness
    from benchmarks.bench_decode import PAGE, QWEN3_8B, RECENT, SINK, build_int2_cache
    from oscar_jax import ops

    hq, kv, d = QWEN3_8B["q_heads"], QWEN3_8B["kv_heads"], QWEN3_8B["head_dim"]
    result = {"environment": harness.environment(), "caps": list(args.caps), "configs": []}
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            read = bench_decode.int2_bytes_read(batch, context, kv, d, 128)["total"]
            copies = 1 if args.calls_only else harness.copies_to_defeat_l2(read)
            key = jax.random.key(0)
            q = jax.random.normal(jax.random.fold_in(key, 1), (batch, hq, d), jnp.float32).astype(jnp.bfloat16)
            pools, bf16_tables, history_tables, lengths = build_int2_cache(
                jax.random.fold_in(key, 2), batch, context, copies, 128, kv, d)
            names = ("k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
            operands = (tuple(pools[n] for n in names), jnp.asarray(bf16_tables), jnp.asarray(history_tables),
                        {n: jnp.asarray(v) for n, v in lengths.items()})

            def attend(q_, c, operands, max_registers):
                pools_, bf16_t, history_t, lens = operands
                return ops.decode_attention(q_, *pools_, bf16_t[c], lens["sink_tokens"], lens["recent_tokens"],
                                            history_t[c], lens["history_tokens"], sink_slots=SINK // PAGE,
                                            group_size=128, softmax_scale=d**-0.5, max_registers=max_registers)

            config = {"context": context, "batch": batch, "bytes_read": read, "variants": {}}
            baseline = None
            for cap in args.caps:
                out = np.asarray(jax.jit(lambda q_, ops_: attend(q_, 0, ops_, cap))(q, operands))
                baseline = out if baseline is None else baseline
                entry = {"bit_identical_to_first": bool(np.array_equal(out.view(np.uint16), baseline.view(np.uint16)))}
                if not args.calls_only:
                    def step(i, q_, ops_):
                        o = attend(q_, i % copies, ops_, cap)
                        return (q_.astype(jnp.float32) + 0.0 * o).astype(q_.dtype)

                    entry.update(harness.time_jax_loop(step, q, reps=max(32, 2 * copies), operands=(operands,)))
                    entry["gb_per_s"] = read / entry["median_s"] / 1e9
                config["variants"][str(cap)] = entry
                timed = f"{entry['median_s'] * 1e6:8.1f} us" if "median_s" in entry else ""
                print(f"ctx {context} b {batch} cap {cap}: {timed} bit-identical {entry['bit_identical_to_first']}",
                      flush=True)
                result_so_far = {**result, "configs": result["configs"] + [config]}
                args.out.write_text(json.dumps(result_so_far, indent=1))
            result["configs"].append(config)
            del pools, operands
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
