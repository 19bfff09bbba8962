"""Prefill at Qwen3-8B shapes: each chunk's time against its prefix, and where a chunk's time goes.

    python -m benchmarks.bench_prefill --out benchmarks/results/prefill_h200.json

One sequence of `--prompt-len` tokens (default 32768) through OscarRuntime in chunks of
`--prefill-chunk` (2048), with the OSCAR tiers (sink 64 + recent 256 BF16, history INT2), random
bf16 weights and identity rotations (as bench_serve: the rotations' values do not change the
work). A first pass compiles; a second is timed chunk by chunk (each blocked on its logits). A
third runs the first and the last chunk under the JAX profiler and sums the device's kernel time
by kernel name (the `--top` largest), so a slow chunk shows which kernels take it. Beside it, the
reference a chunk cannot beat: the same model over the chunk alone with a dense BF16 cache (XLA
attention, no prefix, no tiers), timed the same way. `--splits` repeats the three passes for each
split of the chunk's cache partials (OscarKVCache.prefill_pages_per_split): the tiling policy's
default (one split over the whole table since DECISIONS.md P2; "whole" names it explicitly) or a
page count, e.g. the decode-style splits it replaced (a chunk's row blocks already fill the grid,
so splits by the table only size partials to write and merge). `--tier-block-m` does the same for
each count of query rows a block of the prefix's tiers takes (OscarKVCache.prefill_tier_block_m;
"default" = attention_ops' block_m): each row block unpacks the whole INT2 prefix.

`--tiny` runs the same plumbing on a 2-layer model at toy sizes (the CPU test does).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def kernel_time(trace_dir: str, top: int) -> dict:
    """Device time by kernel name in a JAX profiler trace: {total_ns, kernels: [[name, ns, count]]}.
    Device planes are the GPU's; without one (a CPU run) the XLA executor threads stand in."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    planes = list(ProfileData.from_file(path).planes)
    device = [p for p in planes if p.name.startswith("/device:GPU")]
    totals, counts = collections.Counter(), collections.Counter()
    for plane in device or [p for p in planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if not device and not line.name.startswith("tf_XLA"):
                continue
            if device and not line.name.startswith("Stream"):
                continue
            for event in line.events:
                totals[event.name] += event.duration_ns
                counts[event.name] += 1
    return {"total_ns": sum(totals.values()),
            "kernels": [[name, ns, counts[name]] for name, ns in totals.most_common(top)]}


def prefill_pass(runtime, tokens, chunk: int, *, profile_chunks=(), top: int = 25) -> dict:
    """Prefill `tokens` as one new sequence (no prefix sharing), chunk by chunk, each blocked;
    the chunks in `profile_chunks` run under the profiler. The sequence is finished after."""
    import jax

    plan = runtime.start(tokens, share_prefix=False)
    seconds, profiles = [], {}
    for index, begin in enumerate(range(0, len(tokens), chunk)):
        stop = min(begin + chunk, len(tokens))
        trace = tempfile.mkdtemp(prefix="oscar_prefill_trace_") if index in profile_chunks else None
        if trace:
            jax.profiler.start_trace(trace)
        t = time.perf_counter()
        runtime.prefill(plan.seq_id, begin, stop).block_until_ready()
        seconds.append(time.perf_counter() - t)
        if trace:
            jax.profiler.stop_trace()
            profiles[str(index)] = {"prefix_tokens": begin, "tokens": stop - begin, **kernel_time(trace, top)}
    runtime.finish(plan.seq_id)
    return {"chunk_s": seconds, "profiles": profiles}


def dense_chunk_s(params, cfg, chunk: int, repeats: int = 3) -> float:
    """Median seconds of the model over one chunk with a dense BF16 cache of the chunk's length."""
    import jax
    import jax.numpy as jnp

    from oscar_jax.cache_api import DenseKVCache
    from oscar_jax.model import prefill

    step = jax.jit(prefill, static_argnames=("cfg", "all_logits"))
    tokens = jnp.ones((1, chunk), jnp.int32)

    def once():
        cache = DenseKVCache.create(num_layers=cfg.num_layers, batch=1, num_kv_heads=cfg.num_kv_heads,
                                    max_seq_len=chunk, head_dim=cfg.head_dim)
        t = time.perf_counter()
        step(params, cfg, tokens, cache)[0].block_until_ready()
        return time.perf_counter() - t

    once()  # compiles
    return float(np.median([once() for _ in range(repeats)]))


SPLIT_POLICIES = ("default", "whole")


def split_pages(policy: str, runtime) -> int | None:
    """pages_per_split of a prefill chunk's cache partials under `policy`: "default" (None, the
    tiling policy of shared_math.tiling), "whole" (one split over the whole page table), or a
    number of pages."""
    from shared_math.tiling import default_pages_per_block, whole_table_pages_per_split

    if policy == "default":
        return None
    if policy == "whole":  # the longer of the two tiers' tables (the BF16 cache's is all BF16)
        config = runtime.config
        slots = max(runtime.history_slots, (config.sink + config.recent) // config.page_size)
        return whole_table_pages_per_split(slots, default_pages_per_block(config.page_size))
    try:
        return int(policy)
    except ValueError:
        raise ValueError(f"split policy {policy!r} must be one of {SPLIT_POLICIES} or a number of pages") from None


def run(cfg, *, prompt_len: int, chunk: int, sink: int, recent: int, page_size: int, top: int,
        splits=SPLIT_POLICIES, tier_block_ms=("default",), log=print) -> dict:
    import dataclasses

    import jax

    from oscar_jax.model import init_params
    from oscar_jax.runtime import OscarRuntime
    from oscar_jax.serve import identity_artifact

    params = init_params(cfg, jax.random.key(0), dtype="bfloat16")
    max_seq_len = -(-(prompt_len + recent) // page_size) * page_size
    runtime = OscarRuntime(params, cfg, identity_artifact(cfg), max_batch=1, max_seq_len=max_seq_len, sink=sink,
                           recent=recent, page_size=page_size, prefill_chunk=chunk)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len).tolist()
    policies = {}
    for policy, tier_block_m in ((p, m) for p in splits for m in tier_block_ms):
        pages = split_pages(policy, runtime)
        rows = None if tier_block_m == "default" else int(tier_block_m)
        runtime.cache = dataclasses.replace(runtime.cache, prefill_pages_per_split=pages, prefill_tier_block_m=rows)
        policy = policy if rows is None else f"{policy}+tier_block_m={rows}"  # the variant's name
        t = time.perf_counter()
        prefill_pass(runtime, tokens, chunk)
        compile_pass_s = time.perf_counter() - t
        log(f"[prefill] split {policy} ({pages} pages): compiling pass {compile_pass_s:.1f} s")
        timed = prefill_pass(runtime, tokens, chunk)
        chunks = len(timed["chunk_s"])
        log(f"[prefill] split {policy}: chunks (s): {' '.join(f'{s:.3f}' for s in timed['chunk_s'])}")
        profiled = prefill_pass(runtime, tokens, chunk, profile_chunks=(0, chunks - 1), top=top)
        for index, p in profiled["profiles"].items():
            log(f"[prefill] split {policy}: chunk {index} (prefix {p['prefix_tokens']}): device "
                f"{p['total_ns'] / 1e6:.1f} ms; top: "
                + "; ".join(f"{name[:60]} {ns / 1e6:.1f} ms ×{n}" for name, ns, n in p["kernels"][:5]))
        policies[policy] = {
            "pages_per_split": pages, "tier_block_m": rows, "compile_pass_s": compile_pass_s,
            "chunks": [{"prefix_tokens": i * chunk, "seconds": s} for i, s in enumerate(timed["chunk_s"])],
            "tokens_per_s": prompt_len / sum(timed["chunk_s"]), "profiles": profiled["profiles"],
        }
    dense = dense_chunk_s(params, cfg, chunk)
    log(f"[prefill] dense BF16 cache, the chunk alone: {dense:.3f} s")
    return {
        "model": {k: v for k, v in vars(cfg).items()}, "prompt_len": prompt_len, "prefill_chunk": chunk,
        "max_seq_len": max_seq_len, "history_slots": runtime.history_slots, "sink": sink, "recent": recent,
        "page_size": page_size, "splits": policies, "dense_chunk_alone_s": dense,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_h200.json"))
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--top", type=int, default=25, help="kernels kept per profiled chunk (default: %(default)s)")
    p.add_argument("--splits", default="default",
                   help="comma-separated split policies of the chunk's cache partials, each timed: "
                        "default, whole (one split over the history table) or a page count (default: %(default)s)")
    p.add_argument("--tier-block-m", default="default",
                   help="comma-separated query rows a block of the prefix's tiers takes, each timed with each split: "
                        "default (attention_ops' block_m) or a power of two (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model at toy sizes (the plumbing only)")
    args = p.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.tiny:
        from benchmarks.bench_serve import tiny_setup

        setup = tiny_setup()
        cfg, windows = setup.model, dict(sink=setup.sink, recent=setup.recent, page_size=setup.page_size)
        prompt_len, chunk = 3 * setup.prefill_chunk + setup.page_size, setup.prefill_chunk
    else:
        from benchmarks.bench_e2e import qwen3_8b_config

        cfg, windows = qwen3_8b_config(), dict(sink=64, recent=256, page_size=64)
        prompt_len, chunk = args.prompt_len, args.prefill_chunk
    from benchmarks.harness import environment

    result = {"environment": environment(),
              **run(cfg, prompt_len=prompt_len, chunk=chunk, top=args.top, splits=args.splits.split(","),
                    tier_block_ms=args.tier_block_m.split(","), log=log, **windows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    log(f"[prefill] wrote {args.out}: tokens/s " + ", ".join(f"{name} {r['tokens_per_s']:.0f}"
                                                         for name, r in result["splits"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
