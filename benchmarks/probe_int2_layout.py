"""The Pallas INT2-tier kernel alone at 128K, by score layout, query rows and warps.

Static sm_90 counts (benchmarks/NOTES.md v15, `benchmarks.static_analysis`): the shipped kernel
(scores [16, L], 2 warps) executes 34.2 warp instructions per (token, KV head); one warp 27.5 (no
cross-warp reductions, q's fragments reused over 64 tokens instead of 32) at 255 registers; scores
as [L, 8] (tokens on the dot's M, `tokens_on_m`, the 4 query rows padded to 8 instead of 16) at one
warp 22.2 at 227 registers. Fewer instructions did not always mean less time (v11, v12), so this
times them: each variant's merged output is checked against the shipped launch's first, then timed
(`harness.time_jax_loop`, two page-table copies alternating so that no call finds its pages in L2).

    PYTHONPATH=. python3 -m benchmarks.probe_int2_layout --out probe_int2_layout.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (query rows, tokens_on_m, num_warps, num_stages); the first is the shipped launch from batch 1 at 128K.
VARIANTS = [(16, False, 2, 3), (16, False, 1, 3), (16, False, 1, 2), (16, True, 1, 3), (8, True, 1, 3),
            (8, True, 1, 2), (8, True, 2, 3), (4, True, 1, 3), (16, False, 4, 3)]
CONFIGS = [(131072, 1), (131072, 8)]
KV_HEADS, Q_PER_KV, HEAD_DIM, PAGE, GROUP = 8, 4, 128, 64, 128
PAGES_PER_SPLIT = 16
REL_TOL = 1e-3  # against the shipped launch (itself 2–3e-3 from float64, bench_decode); the H200 run: ≤ 4e-5


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU check of the script: interpret mode, 2K context")
    args = parser.parse_args(argv)
    configs, interpret = ([(2048, 2)], True) if args.smoke else (CONFIGS, False)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import harness
    from oscar_jax.attention_ops import merge_partials
    from oscar_jax.kernels.decode_attention import int2_tier_partials

    result = {"environment": harness.environment(), "pages_per_split": PAGES_PER_SPLIT, "configs": []}
    for context, batch in configs:
        pages = context // PAGE
        copies = 2
        key = jax.random.key(context + batch)
        pool_pages = copies * batch * pages
        shape = (pool_pages, KV_HEADS, PAGE, HEAD_DIM // 4)
        words = jax.random.bits(key, shape[:-1] + (shape[-1] // 4,), jnp.uint32)
        k_codes = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)
        words = jax.random.bits(jax.random.fold_in(key, 1), shape[:-1] + (shape[-1] // 4,), jnp.uint32)
        v_codes = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)
        meta_shape = (pool_pages, KV_HEADS, PAGE, HEAD_DIM // GROUP)
        # K and V each their own metadata, as in a cache: one shared buffer read ~11 % fewer bytes from
        # DRAM (the v15 probe did; its b8 figure came out 12.5 µs under the kernel in the decode call, NOTES v16).
        k_scale, v_scale = (jax.random.uniform(jax.random.fold_in(key, 2 + i), meta_shape, jnp.float32, 0.02, 0.12)
                            .astype(jnp.float16) for i in range(2))
        k_min, v_min = ((-1.5 * x.astype(jnp.float32)).astype(jnp.float16) for x in (k_scale, v_scale))
        tables = jnp.asarray(np.random.default_rng(0).permutation(pool_pages).reshape(copies, batch, pages), jnp.int32)
        history = jnp.full((batch,), context, jnp.int32)
        q = jax.random.normal(jax.random.fold_in(key, 4), (batch, KV_HEADS, Q_PER_KV, HEAD_DIM), jnp.bfloat16)
        operands = (k_codes, k_scale, k_min, v_codes, v_scale, v_min, tables, history)
        config = {"context": context, "batch": batch, "variants": []}

        def attend(q4, c, ops, rows, tokens_on_m, warps, stages):
            kc, ks, km, vc, vs, vm, tbl, hist = ops
            q_rows = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - Q_PER_KV), (0, 0)))
            o, lse = int2_tier_partials(
                q_rows, kc, ks, km, vc, vs, vm, tbl[c], hist, group_size=GROUP, softmax_scale=HEAD_DIM**-0.5,
                pages_per_split=PAGES_PER_SPLIT, pages_per_block=1, block_m=rows, interpret=interpret,
                num_warps=warps, num_stages=stages, unpack_asm=not interpret, tokens_on_m=tokens_on_m)
            return merge_partials(o[:, :, :, :Q_PER_KV], lse[:, :, :, :Q_PER_KV])[0]

        reference = None
        for rows, tokens_on_m, warps, stages in VARIANTS:
            name = f"rows{rows}_{'tokens_on_m' if tokens_on_m else 'rows_on_m'}_w{warps}_s{stages}"
            entry = {"name": name, "rows": rows, "tokens_on_m": tokens_on_m, "num_warps": warps, "num_stages": stages}
            try:
                fn = jax.jit(lambda q4, ops, c, v=(rows, tokens_on_m, warps, stages): attend(q4, c, ops, *v),
                             static_argnums=2)
                out = np.asarray(fn(q, operands, 0))
                if reference is None:
                    reference = out
                entry["rel_error_vs_shipped"] = harness.relative_error(out, reference)
                entry["passed"] = bool(entry["rel_error_vs_shipped"] <= REL_TOL)
                if entry["passed"]:
                    def step(i, q_, ops, v=(rows, tokens_on_m, warps, stages)):
                        o = attend(q_, i % copies, ops, *v)
                        return (q_.astype(jnp.float32) + 0.0 * o).astype(q_.dtype)
                    entry.update(harness.time_jax_loop(step, q, reps=2 if interpret else 32, trials=1 if interpret else 5,
                                                       operands=(operands,)))
            except Exception as err:  # noqa: BLE001 - a variant that does not compile is a finding
                entry["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            config["variants"].append(entry)
            t = f"{entry['median_s'] * 1e6:8.1f} us" if "median_s" in entry else entry.get("error", "not timed")[:120]
            print(f"ctx {context} b {batch} {name:32s} err {entry.get('rel_error_vs_shipped', float('nan')):.1e} {t}",
                  flush=True)
            args.out.write_text(json.dumps({**result, "configs": result["configs"] + [config]}, indent=1))
        result["configs"].append(config)
        del operands, k_codes, v_codes, k_scale, v_scale, k_min, v_min
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
