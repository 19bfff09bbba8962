"""Decode attention at 128K context for Nsight Compute: one INT2 cache, the Pallas and the Triton kernel.

    ncu --kernel-name regex:int2_tier --section SpeedOfLight --section WarpStateStats ... \\
        python3 -m benchmarks.profile_decode --batch 8

Each kernel runs twice (compile + warm, then the profiled launch); NOTES.md quotes the report.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=128)
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
                  softmax_scale=shapes["head_dim"] ** -0.5)
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
    print("profiled: Pallas and Triton INT2 decode attention", args, flush=True)


if __name__ == "__main__":
    main()
