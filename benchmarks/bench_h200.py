"""One command for the H200 benchmarks: correctness-checked timings written as raw JSON.

    export PYTHONPATH=. OSCAR_GIT_SHA=$(git rev-parse HEAD) OSCAR_JAX_REGISTER_CAP=1
    python3 -m benchmarks.bench_h200 --sections copy,decode --out benchmarks/results
    python3 -m benchmarks.bench_h200 --sections write,e2e --no-capacity --out benchmarks/results
    XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
        python3 -m benchmarks.bench_h200 --sections e2e --capacity-only --out benchmarks/results

`OSCAR_JAX_REGISTER_CAP=1` opts the Pallas INT2 decode kernel into its register cap, off by default
(`oscar_jax.kernels.register_cap`: a patch of a private JAX function; benchmarks/DECISIONS.md D6): the
committed figures were measured with it. The first two run with JAX's allocator growing on demand (torch shares the GPU); the capacity
search at 100K needs its own process with the memory preallocated, as a server runs: a growing
allocator fragments its regions and fails to allocate a 47 GiB pool with 55 GB free
so without preallocation the e2e section skips the capacity search and
says so. JAX preallocates 75 % of the device unless told otherwise: 0.92 leaves the rest to the
CUDA context and the compiler (at 0.75 the same search fits 43 INT2 and 6 BF16 sequences of 100K
instead of 55 and 7). The three processes take about 8 minutes on an H200.

Run it from a committed, clean tree and name the commit in OSCAR_GIT_SHA (a copy of the tree on
another machine may carry a stale .git): every file records it with the hash of the tree that ran
(`harness.git_worktree_tree`), and `summarize` warns where the two disagree.

Whether a re-run reproduces the committed files, figure by figure (summary keys, the fastest
variants, the baselines, write, e2e, capacity), against a stated noise tolerance:

    python3 -m benchmarks.compare_runs benchmarks/results RERUN_DIR --tolerance 0.05

Sections (each writes `<out>/<section>_h200.json` with the environment and the copy bandwidth
measured in the same run): copy (device copy bandwidth), decode (bench_decode), write
(bench_write), e2e (bench_e2e). `python3 -m benchmarks.summarize` turns the files into
summary_h200.json, the plots and BENCHMARKS.md.

`--splits 4,8,16,32,64` adds both INT2 kernels at each of those splits to every decode config: the
check of the default split (`shared_math.tiling.decode_pages_per_split`; benchmarks/DECISIONS.md D2).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.harness import JAX_TIMING_MODES

SECTIONS = ("copy", "decode", "write", "e2e")
# Tilings timed as extra variants at 128K, batch 1 and 8 (or everywhere with --sweep-all): the
# launches around each default of benchmarks/DECISIONS.md, spelled out in full so that a variant's
# name means the same launch whatever the defaults. `unpack_asm=False` is the compiler's unpacking
# (D10), `fma_asm=False` separate multiplies and adds (D14).
TUNING_128K = [
    dict(pages_per_split=ps, pages_per_block=pb, num_warps=nw, num_stages=ns, unpack_asm=asm)
    for ps, pb, nw, ns, asm in [(16, 1, 1, 3, False), (16, 1, 1, 2, True), (16, 1, 1, 4, True), (8, 1, 1, 3, True),
                                (32, 1, 1, 3, True), (16, 2, 1, 3, True), (16, 1, 2, 3, True)]
] + [  # the default launch with separate multiplies and adds (D14)
    dict(pages_per_split=16, pages_per_block=1, num_warps=1, num_stages=3, unpack_asm=True, fma_asm=False)
] + [  # the values' dot with the rows on M, its V codes read a byte a load (D5's alternative;
    # the variants above run with the channels on M where that applies, as the default does)
    dict(channels_on_m=False),
    # XLA's own register count, uncapped (D6)
    dict(max_registers=0)]
TRITON_TUNING_128K = (
    # the compiler's unpacking and other splits, at the default launch
    [dict(pages_per_split=16, pages_per_block=1, unpack_asm=False)]
    + [dict(pages_per_split=ps) for ps in (8, 32)]
    # the launches around the default (1 warp, 3 stages, no register cap): shallower or deeper
    # pipelining, register caps (occupancy: 241 registers hold 8 one-warp programs per SM, 168 hold
    # 12, 128 hold 16), 2 warps (the rows-on-M launch, D7)
    + [dict(num_warps=nw, num_stages=ns, max_registers=mr)
       for nw, ns, mr in [(1, 2, 0), (1, 4, 0), (1, 3, 192), (1, 3, 168), (1, 3, 128), (2, 3, 0)]]
    # two pages a block, the values' dot with the rows on M (D5's alternative), and the compiler's
    # register count (D6's alternative)
    + [dict(pages_per_block=2), dict(channels_on_m=False), dict(max_registers=0)]
)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _variants(text: str) -> tuple[dict, ...]:
    variants = json.loads(text)
    if not isinstance(variants, list) or not all(isinstance(v, dict) and v for v in variants):
        raise argparse.ArgumentTypeError(f"expected a JSON list of non-empty objects, got {text!r}")
    return tuple(variants)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="copy,decode,write,e2e",
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, required=True, help="directory for the raw JSON files")
    parser.add_argument("--contexts", type=_ints, default=None, help="decode contexts (default 8192,32768,131072)")
    parser.add_argument("--batches", type=_ints, default=None, help="decode batches (default 1,8,32)")
    parser.add_argument("--group-size", type=int, default=128, help="INT2 group size G")
    parser.add_argument("--no-tuning", action="store_true", help="skip the tiling sweep at 128K")
    parser.add_argument("--sweep-all", action="store_true",
                        help="time the tiling sweep at every (context, batch), not only 128K × batch 1 and 8")
    parser.add_argument("--splits", type=_ints, default=(),
                        help="decode: also time both INT2 kernels at these pages_per_split (default launch "
                             "otherwise) at every (context, batch), e.g. 4,8,16,32,64: the check of the split "
                             "policy, shared_math.tiling.decode_pages_per_split")
    parser.add_argument("--variants", type=_variants, default=(),
                        help="decode: also time both INT2 kernels with these launch keywords at every (context, "
                             "batch), as a JSON list of objects, e.g. '[{\"pages_per_block\": 2}]': the check "
                             "of a candidate default outside 128K")
    parser.add_argument("--merge", action="store_true",
                        help="keep the (context, batch) configs of an existing <out>/decode_h200.json that this "
                             "run does not re-measure (a sweep split over several device calls)")
    parser.add_argument("--e2e-contexts", type=_ints, default=None, help="end-to-end contexts (default 30000,60000,100000)")
    parser.add_argument("--e2e-steps", type=int, default=None,
                        help="end-to-end: donated steps per timed loop (default bench_e2e.STEPS)")
    parser.add_argument("--no-capacity", action="store_true", help="end-to-end: skip the capacity search at 100K")
    parser.add_argument("--capacity-only", action="store_true",
                        help="end-to-end: only the capacity search, merged into an existing <out>/e2e_h200.json "
                             "(its steps keep their git sha; run with XLA_PYTHON_CLIENT_PREALLOCATE=true, as a "
                             "server would, so that the allocator's regions do not fragment)")
    parser.add_argument("--jax-timing", default="unrolled", choices=JAX_TIMING_MODES,
                        help="how JAX steps are repeated in the timed program (benchmarks.harness)")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

    from benchmarks import harness

    harness.JAX_TIMING = args.jax_timing
    args.out.mkdir(parents=True, exist_ok=True)
    env = harness.environment()
    print(f"{env['gpu']} jax {env['jax']} torch {env['torch']} triton {env['triton']} git {env['git_sha'][:10]}",
          flush=True)
    copy = harness.copy_bandwidth()
    print(f"copy bandwidth: torch {copy['torch']['gb_per_s']:.0f} GB/s, jax {copy['jax']['gb_per_s']:.0f} GB/s; "
          f"read-only stream {copy['read_gb_per_s']:.0f} GB/s", flush=True)

    def save(section: str, payload: dict, name: str | None = None, quiet: bool = False) -> None:
        path = args.out / f"{name or section}_h200.json"
        path.write_text(json.dumps({"section": section, "environment": env, "copy_bandwidth": copy, **payload},
                                   indent=1))
        if not quiet:
            print(f"wrote {path}", flush=True)

    if "copy" in sections:
        save("copy", {})
    if "decode" in sections:
        from benchmarks import bench_decode

        configs = []
        previous = args.out / "decode_h200.json"
        if args.merge and previous.exists():
            configs = json.loads(previous.read_text())["configs"]
            print(f"merging into {len(configs)} configs of {previous}", flush=True)
        for context in args.contexts or bench_decode.CONTEXTS:
            for batch in args.batches or bench_decode.BATCHES:
                sweep = (args.sweep_all or (context >= 131072 and batch in (1, 8))) and not args.no_tuning
                splits = [dict(pages_per_split=ps) for ps in args.splits] + list(args.variants)
                tuning, triton_tuning = ((list(TUNING_128K), list(TRITON_TUNING_128K)) if sweep else ([], []))
                tuning += [s for s in splits if s not in tuning]
                triton_tuning += [s for s in splits if s not in triton_tuning]
                t0 = time.perf_counter()
                # A config cut off by a time limit leaves what it measured in decode_partial_h200.json;
                # decode_h200.json (what the summary reads) only ever holds complete configs.
                config = bench_decode.run_config(
                    context, batch, args.group_size, tuning=tuning, triton_tuning=triton_tuning,
                    on_variant=lambda partial: save("decode", {"configs": [{**partial, "git_sha": env["git_sha"]}]},
                                                    name="decode_partial", quiet=True))
                config["git_sha"] = env["git_sha"]  # merged files may hold configs of several runs
                config["copy_gb_per_s"] = copy["gb_per_s"]  # … each with the bandwidths of its own run
                config["read_gb_per_s"] = copy["read_gb_per_s"]
                configs = [c for c in configs if (c["context"], c["batch"]) != (context, batch)] + [config]
                save("decode", {"configs": configs})
                print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if "write" in sections:
        from benchmarks import bench_write

        cases = {"write_pages": [], "demote": []}
        for dtype in ("float32", "bfloat16"):
            cases["write_pages"].append(bench_write.write_pages_case(65536, args.group_size, dtype))
        cases["demote"].append(bench_write.demote_case(32, args.group_size))
        cases["demote"].append(bench_write.demote_case(256, args.group_size))
        save("write", cases)
    if "e2e" in sections:
        from benchmarks import bench_e2e

        preallocated = os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"].strip().lower() not in ("false", "0")
        capacity_command = (f"XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m "
                            f"benchmarks.bench_h200 --sections e2e --capacity-only --out {args.out}")
        if args.capacity_only:
            if args.no_capacity:
                parser.error("--capacity-only and --no-capacity exclude each other")
            if not preallocated:
                parser.error(f"--capacity-only needs the memory preallocated (module docstring): {capacity_command}")
            path = args.out / "e2e_h200.json"
            if not path.exists():
                parser.error(f"--capacity-only merges into {path}, which does not exist")
            previous = json.loads(path.read_text())

            def save_capacity(partial):  # the steps keep their environment; capacity carries its own
                previous["capacity"] = {**partial.get("capacity", {}), "git_sha": env["git_sha"],
                                        "environment": env, "copy_bandwidth": copy}
                path.write_text(json.dumps(previous, indent=1))

            save_capacity(bench_e2e.run(contexts=(), floor_gb_per_s=copy["read_gb_per_s"], on_progress=save_capacity))
            print(f"wrote {path} (capacity merged)", flush=True)
        else:
            capacity = {"capacity_context": None} if args.no_capacity or not preallocated else {}
            if not args.no_capacity and not preallocated:
                print(f"e2e: capacity search skipped (the allocator grows on demand); run: {capacity_command}",
                      flush=True)
            steps = {} if args.e2e_steps is None else {"steps": args.e2e_steps}
            save("e2e", bench_e2e.run(contexts=args.e2e_contexts, floor_gb_per_s=copy["read_gb_per_s"], **capacity, **steps,
                                      on_progress=lambda partial: save("e2e", partial)))


if __name__ == "__main__":
    main()
