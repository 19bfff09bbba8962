"""Is the end-to-end INT2 step bound by the host's dispatch? The same step under XLA's command-buffer settings.

NOTES v14 measured the INT2 step flat at 7.5 ms from 30K to 100K and, at 30K, ~1 ms a step of GPU
idle between steps: the host hands over ~940 kernels a step. XLA can record a program's kernels
into CUDA graphs ("command buffers", `--xla_gpu_enable_command_buffer`), which turns per-kernel
launches into one graph launch. Each variant below runs `bench_e2e.run` (INT2 cache, batch 1,
Qwen3-8B shapes) in its own process — XLA reads its flags once — and records the step time and the
host's dispatch time per step (`dispatch_median_s`: the loop's time until the last step is handed
over).

    PYTHONPATH=. python3 -m benchmarks.probe_dispatch --out probe_dispatch.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# XLA_FLAGS appended per variant. The command types are XLA's DebugOptions::CommandBufferCmdType.
VARIANTS = {
    "default": "",
    "command_buffers_off": "--xla_gpu_enable_command_buffer=",
    "command_buffers_min1": "--xla_gpu_graph_min_graph_size=1",
    "command_buffers_wide": ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                             "DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1"),
}
CONTEXTS = (30000, 100000)


def _child(variant: str, out: Path, contexts) -> None:
    from benchmarks import bench_e2e, harness

    result = {"variant": variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "environment": harness.environment()}
    result["e2e"] = bench_e2e.run(contexts, capacity_context=None, kinds=("int2",))
    out.write_text(json.dumps(result, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    contexts = tuple(int(c) for c in args.contexts.split(",") if c)
    if args.child:
        _child(args.child, args.out, contexts)
        return

    names = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in names if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    results = []
    for name in names:
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {VARIANTS[name]}".strip()
        with tempfile.TemporaryDirectory() as tmp:
            child_out = Path(tmp) / "child.json"
            proc = subprocess.run([sys.executable, "-m", "benchmarks.probe_dispatch", "--child", name,
                                   "--out", str(child_out), "--contexts", args.contexts],
                                  env=env, capture_output=True, text=True)
            if proc.returncode or not child_out.exists():
                results.append({"variant": name, "xla_flags": env["XLA_FLAGS"], "returncode": proc.returncode,
                                "stderr_tail": proc.stderr[-3000:]})
                print(f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-1500:]}", flush=True)
                continue
            result = json.loads(child_out.read_text())
        results.append(result)
        for run in result["e2e"]["runs"]:
            print(f"{name:22s} {run['cache']} ctx {run['context']:6d}: step {run['median_s'] * 1e3:6.2f} ms, "
                  f"dispatch {run['dispatch_median_s'] * 1e3:6.2f} ms, deterministic={run['deterministic']}",
                  flush=True)
        args.out.write_text(json.dumps({"variants": results}, indent=1))


if __name__ == "__main__":
    main()
