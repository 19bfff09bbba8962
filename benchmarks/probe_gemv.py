"""Batch-1 projections as XLA compiles them: which weight shapes reach a GEMM kernel, and at what speed.

The step profile (NOTES.md v5) shows Qwen3-8B's K and V projections ([4096] × [4096, 1024] bf16) as
multiply + reduce fusions at 0.4–0.8 TB/s while the Q projection ([4096, 4096]) runs as a GEMM
fusion at ~3 TB/s. This times `x @ w` at batch 1 for the model's projection widths and for K and V
(and Q, K, V) fused into one weight, each on its own weights (no L2 reuse), and records the kernel
XLA chose (the optimized HLO's fusion kinds).

    PYTHONPATH=. python3 -m benchmarks.probe_gemv --out probe_gemv.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

def widths(model) -> dict:
    """Output widths of the model's batch-1 projections, alone and fused."""
    q, kv = model.num_q_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {"k_or_v": kv, "k_and_v": 2 * kv, "q": q, "q_k_v": q + 2 * kv, "gate_or_up": model.intermediate_size}


COPIES = 8  # distinct weights per shape, cycled, so that no call finds its weights in the 50 MB L2


def kernel_kinds(hlo_text: str) -> list[str]:
    """Fusion kinds and custom-call targets of the optimized module's entry instructions."""
    kinds = re.findall(r"kind=(k\w+)", hlo_text) + re.findall(r'custom_call_target="([^"]+)"', hlo_text)
    return sorted(set(kinds))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks import bench_e2e, harness

    model = bench_e2e.qwen3_8b_config()
    hidden = model.hidden_size
    copy = harness.copy_bandwidth()
    result = {"environment": harness.environment(), "copy_gb_per_s": copy["gb_per_s"], "hidden": hidden,
              "copies": COPIES, "shapes": {}}
    x = jax.random.normal(jax.random.key(0), (1, hidden), jnp.float32).astype(jnp.bfloat16)
    for name, width in widths(model).items():
        weights = tuple(jax.random.normal(jax.random.key(c), (hidden, width), jnp.float32).astype(jnp.bfloat16)
                        for c in range(COPIES))

        def step(i, carry, *weights):  # one call per weight copy, each depending on the last
            for w in weights:
                carry = carry + 0 * (carry @ w)[:, :1].astype(carry.dtype)
            return carry

        timing = harness.time_jax_loop(step, x, reps=16, operands=weights, mode="loop")  # plain jnp steps
        timing = {**timing, "median_s": timing["median_s"] / COPIES, "min_s": timing["min_s"] / COPIES,
                  "max_s": timing["max_s"] / COPIES, "calls_per_rep": COPIES}
        hlo = jax.jit(lambda a, w: a @ w).lower(x, weights[0]).compile().as_text()
        bytes_read = hidden * width * 2
        entry = {"width": width, **timing, "weight_bytes": bytes_read,
                 "gb_per_s": bytes_read / timing["median_s"] / 1e9, "kernels": kernel_kinds(hlo)}
        entry["fraction_of_copy"] = entry["gb_per_s"] / copy["gb_per_s"]
        result["shapes"][name] = entry
        print(f"{name:11s} [{hidden}, {width:5d}]: {timing['median_s'] * 1e6:7.1f} us {entry['gb_per_s']:6.0f} GB/s "
              f"({entry['fraction_of_copy']:.0%} of copy) {entry['kernels']}", flush=True)
        del weights
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
