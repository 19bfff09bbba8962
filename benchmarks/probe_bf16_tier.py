"""The BF16-cache decode attention of the end-to-end benchmark, one layer, at each launch of its BF16 tier.

The e2e BF16 cache (bench_e2e.step_tables, kind "bf16") holds the whole context in the BF16 tier and
gave the INT2 tier as many (empty) slots until v13, to size the default split-K by the context. Its
100K step took 9.82 ms at v11 (both tiers at 4 warps, 2 stages) and 10.35–10.38 ms since v12. This
times that layer's attention at each (num_warps, num_stages) of the BF16 tier — alone (a history
table of no slots, the same split) — and as the e2e step runs it (the default launch, the empty
INT2 tier included), so that the per-layer difference × 36 layers can be set against the step.

    PYTHONPATH=. python3 -m benchmarks.probe_bf16_tier --out probe_bf16_tier.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LAUNCHES = ((4, 2), (4, 3), (2, 2), (2, 3))
CONTEXTS = (30000, 60000, 100000)
BATCHES = (1, 7)  # the e2e step; the BF16 capacity batch at 100K


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_e2e, harness
    from oscar_jax import attention_ops as ops
    from shared_math.spec import CODES_PER_BYTE
    from shared_math.tiling import default_decode_launch, default_pages_per_split

    model, oscar = bench_e2e.qwen3_8b_config(), bench_e2e.oscar_config()
    kv, hq, d, page = model.num_kv_heads, model.num_q_heads, model.head_dim, oscar.page_size
    result = {"environment": harness.environment(), "launches": [list(x) for x in LAUNCHES], "configs": []}
    for batch in BATCHES:
        for context in CONTEXTS if batch == 1 else CONTEXTS[-1:]:
            slots = -(-context // page)
            pps = default_pages_per_split(slots, 1, page)
            key = jax.random.key(context + batch)
            pool_shape = (1 + batch * slots, kv, page, d)
            k_pool = jax.random.normal(key, pool_shape, jnp.bfloat16)
            v_pool = jax.random.normal(jax.random.fold_in(key, 1), pool_shape, jnp.bfloat16)
            table = jnp.asarray(1 + np.random.default_rng(0).permutation(batch * slots).reshape(batch, slots),
                                jnp.int32)
            codes = jnp.zeros((1, kv, page, d // CODES_PER_BYTE), jnp.uint8)
            meta = jnp.zeros((1, kv, page, d // oscar.group_size), jnp.float16)
            sink = jnp.full((batch,), oscar.sink, jnp.int32)
            recent = jnp.full((batch,), context - oscar.sink, jnp.int32)
            no_history = jnp.zeros((batch,), jnp.int32)
            q = jax.random.normal(jax.random.fold_in(key, 2), (batch, hq, d), jnp.bfloat16)
            common = dict(sink_slots=oscar.sink // page, group_size=oscar.group_size, softmax_scale=d**-0.5,
                          pages_per_split=pps)
            history_tables = {"bf16_tier_only": jnp.zeros((batch, 0), jnp.int32),
                              "as_e2e": jnp.zeros((batch, slots), jnp.int32)}
            operands = (k_pool, v_pool, codes, meta, meta, codes, meta, meta, table, sink, recent)

            def attend(q_, operands_, history_table, **launch):
                return ops.decode_attention(q_, *operands_, history_table, no_history, **common, **launch)

            variants = [("bf16_tier_only", dict(num_warps=w, num_stages=s)) for w, s in LAUNCHES]
            variants.append(("as_e2e", {}))
            config = {"context": context, "batch": batch, "pages_per_split": pps,
                      "default_launch": default_decode_launch(batch, kv, slots, slots, pps, pps), "variants": []}
            reference = None
            for table_name, launch in variants:
                history_table = history_tables[table_name]

                def step(i, q_, operands_, history_table=history_table, launch=launch):
                    o = attend(q_, operands_, history_table, **launch)
                    return (q_.astype(jnp.float32) + 0.0 * o).astype(q_.dtype)

                out = np.asarray(jax.jit(lambda q_, o_, h=history_table, l=launch: attend(q_, o_, h, **l))(
                    q, operands))
                reference = out if reference is None else reference
                err = harness.relative_error(out, reference)
                timing = harness.time_jax_loop(step, q, reps=32, operands=(operands,))
                config["variants"].append({"history_table": table_name, **launch, "rel_err_vs_first": err,
                                           "median_us": timing["median_s"] * 1e6, "timing": timing})
                print(f"  ctx {context:6d} b {batch}: {table_name:15s} {launch or 'default'}: "
                      f"{timing['median_s'] * 1e6:8.1f} us (err vs first {err:.1e})", flush=True)
            result["configs"].append(config)
            args.out.write_text(json.dumps(result, indent=1))
            del k_pool, v_pool
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
