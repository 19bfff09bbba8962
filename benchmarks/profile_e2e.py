"""Where the time of one end-to-end decode step goes (bench_e2e's step at Qwen3-8B shapes).

Traces `steps` donated steps with jax.profiler and reads the device plane of the trace
(`jax.profiler.ProfileData`): per kernel name its launches and total time, grouped into
categories; per step the GPU busy time (the union of kernel intervals) and the span from the first
kernel's start to the last kernel's end. span − busy is time the GPU sat idle between kernels
(launch gaps, host work) — the part a CUDA graph or fewer launches would remove.

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.profile_e2e --out profile.json
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from benchmarks import harness

# Kernel-name patterns → category (first match wins; the rest is "other": XLA fusions etc.).
CATEGORIES = (
    ("attention", re.compile(r"tier|merge|decode_attention|attention", re.I)),
    ("cache_write", re.compile(r"write", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cublas|cutlass|nvjet|xmma|matmul|dot", re.I)),
)


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def summarize_kernels(events: list[tuple[str, int, int]], steps: int) -> dict:
    """events: (name, start_ns, duration_ns) of every kernel in the traced window."""
    if not events:
        return {"kernels": 0}
    by_name: dict[str, list[int]] = {}
    for name, _, dur in events:
        by_name.setdefault(name, []).append(dur)
    busy = harness.busy_ns(events)
    span = max(start + dur for _, start, dur in events) - min(start for _, start, _ in events)
    categories: dict[str, dict] = {}
    for name, durs in by_name.items():
        c = categories.setdefault(category(name), {"launches_per_step": 0.0, "us_per_step": 0.0})
        c["launches_per_step"] += len(durs) / steps
        c["us_per_step"] += sum(durs) / steps / 1e3
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:40]
    # Idle gaps, keyed by the kernel that ended before each and the one that started after it
    # (a Pallas kernel's per-layer copies, `name__12`, counted as one name).
    gaps: dict[tuple[str, str], list[int]] = {}
    ordered = sorted(events, key=lambda e: e[1])
    previous, end = ordered[0][0], ordered[0][1] + ordered[0][2]
    for name, start, dur in ordered[1:]:
        if start > end:
            key = tuple(re.sub(r"__\d+$", "", n)[:120] for n in (previous, name))
            gaps.setdefault(key, []).append(start - end)
        if start + dur >= end:
            previous, end = name, start + dur
    top_gaps = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "kernels_per_step": len(events) / steps,
        "span_us_per_step": span / steps / 1e3,
        "busy_us_per_step": busy / steps / 1e3,
        "idle_us_per_step": (span - busy) / steps / 1e3,
        "categories": categories,
        "top_kernels": [{"name": n[:160], "category": category(n), "launches_per_step": len(d) / steps,
                         "us_per_step": sum(d) / steps / 1e3, "mean_us": sum(d) / len(d) / 1e3} for n, d in top],
        "top_idle_gaps": [{"after": a, "before": b, "gaps_per_step": len(d) / steps, "us_per_step": sum(d) / steps / 1e3,
                           "mean_us": sum(d) / len(d) / 1e3} for (a, b), d in top_gaps],
    }


_METADATA = re.compile(r'op_name="([^"]*)"(?:.*?source_file="([^"]*)")?(?:.*?source_line=(\d+))?')


def hlo_origin(hlo_text: str, kernel: str) -> str | None:
    """`op_name @ file:line` of the HLO instruction a kernel was emitted for. Trace names write
    `input_reduce_fusion_215` for the instruction `%input_reduce_fusion.215`."""
    match = re.fullmatch(r"(.*?)[._](\d+)", kernel)
    name = rf"{re.escape(match.group(1))}[._]{match.group(2)}" if match else re.escape(kernel)
    for line in hlo_text.splitlines():
        if re.match(rf"\s*(ROOT )?%?{name} = ", line):
            meta = _METADATA.search(line)
            if not meta:
                return None
            op, file, lineno = meta.groups()
            where = f" @ {file.rsplit('/', 1)[-1]}:{lineno}" if file and lineno else ""
            return f"{op}{where}"
    return None


def profile(kind: str, context: int, table_context: int, steps: int, params, model) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks import bench_e2e

    oscar = bench_e2e.oscar_config(model.head_dim)
    tables = bench_e2e.plan_tables(kind, context, 1, oscar, table_context=table_context)
    cache = bench_e2e.random_cache(model, oscar, tables)
    tokens = jnp.zeros((1,), jnp.int32)
    positions = jnp.full((1,), context - 1, jnp.int32)
    compiled, _ = bench_e2e.compile_step(params, model, tokens, cache, positions)
    for _ in range(3):  # warm up
        logits, cache = compiled(params, tokens, cache, positions)
    jax.block_until_ready((logits, cache))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            for _ in range(steps):
                logits, cache = compiled(params, tokens, cache, positions)
            jax.block_until_ready((logits, cache))
            wall = (time.perf_counter() - t0) / steps
        events, lines = harness.device_kernels(trace_dir)
    summary = summarize_kernels(events, steps)
    hlo_text = compiled.as_text()
    for kernel in summary.get("top_kernels", []):  # which model op each of the largest kernels computes
        kernel["hlo_origin"] = hlo_origin(hlo_text, kernel["name"])
    return {"cache": kind, "context": context, "batch": 1, "steps": steps, "traced_wall_us_per_step": wall * 1e6,
            "trace_lines": lines, **summary}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--context", type=int, default=30000)
    parser.add_argument("--table-context", type=int, default=100000, help="tables sized as in bench_e2e")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--caches", default="int2,bf16")
    args = parser.parse_args(argv)

    from benchmarks import bench_e2e

    model = bench_e2e.qwen3_8b_config()
    params = bench_e2e.random_params(model)
    result = {"environment": harness.environment(), "runs": []}
    for kind in args.caches.split(","):
        run = profile(kind, args.context, args.table_context, args.steps, params, model)
        result["runs"].append(run)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in run.items() if k != "top_kernels"}, indent=1), flush=True)
        for k in run.get("top_kernels", [])[:15]:
            print(f"  {k['us_per_step']:8.1f} us  x{k['launches_per_step']:5.1f}  {k['category']:11s} {k['name'][:40]}"
                  f"  {str(k.get('hlo_origin'))[:160]}")


if __name__ == "__main__":
    main()
