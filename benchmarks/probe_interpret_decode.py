"""CPU time of OscarRuntime's decode step in interpret mode (the CPU test suite's cost, NOTES v21).

SmolLM2-135M with the shipped artifact, a one-token prompt, then `--steps` decode steps with
640-slot tables (as `oscar_jax/tests/test_smollm2_runtime_vs_emulation.py`); prints the admit time,
the first step (both compile) and the steady step time. `--block-tokens N` runs the decode and
prefill tiers as the torch backend does interpreted (`oscar_torch.attention_ops._resolve_tiling`):
one split of blocks of up to N tokens, when both tilings are left to the default.

    JAX_PLATFORMS=cpu python -m benchmarks.probe_interpret_decode --steps 200 [--block-tokens 512]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-seq-len", type=int, default=640)
    parser.add_argument("--block-tokens", type=int, default=0, help="0: the library's interpret-mode tiling")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from oscar_jax import attention_ops
    from oscar_jax.generate import shipped_artifact
    from oscar_jax.loaders import load_model
    from oscar_jax.runtime import OscarRuntime
    from shared_math.artifact import read_artifact
    from shared_math.tiling import default_pages_per_block, next_power_of_two

    if args.block_tokens:
        library = attention_ops._resolve_tiling

        def big_blocks(pages_per_split, pages_per_block, bf16_table, history_table, page_size, sequence_heads=None):
            if pages_per_split is None and pages_per_block is None and page_size > 0:
                slots = max(bf16_table.shape[1], history_table.shape[1], 1)
                pages_per_block = max(default_pages_per_block(page_size),
                                      min(next_power_of_two(slots), max(1, args.block_tokens // page_size)))
                pages_per_split = pages_per_block * -(-slots // pages_per_block)
            return library(pages_per_split, pages_per_block, bf16_table, history_table, page_size, sequence_heads)

        attention_ops._resolve_tiling = big_blocks

    cfg, params = load_model("smollm2-135m")
    rt = OscarRuntime(params, cfg, read_artifact(shipped_artifact("smollm2-135m")), max_batch=1,
                      max_seq_len=args.max_seq_len)
    t0 = time.perf_counter()
    sid, first, _ = rt.admit(np.array([1]))
    jax.block_until_ready(first)
    print(f"admit {time.perf_counter() - t0:.1f} s", flush=True)
    times = []
    for i in range(1, args.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(rt.step([sid], [5 + i]))
        times.append(time.perf_counter() - t0)
    print(f"first step {times[0]:.1f} s; steady median {statistics.median(times[1:]):.3f} s a step "
          f"over {len(times) - 1} steps, max {max(times[1:]):.1f} s (a demotion's compile)", flush=True)


if __name__ == "__main__":
    main()
