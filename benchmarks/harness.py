"""Shared pieces of the H200 benchmarks: environment record, timers, copy bandwidth, error metric.

Timing rules (../shared METHOD): warm up first, median of repeated measurements, inputs rotated
among copies so that a call never finds its data in the 50 MB L2, and many launches per timed
region so that host dispatch stays out of the kernel time:
  * JAX: `time_jax_loop` runs the step `reps` times inside one jitted program (the step chooses
    its input copy from the call index) and takes the wall time that a second program queued
    behind the first adds, divided by `reps` (JAX_TIMING_METHOD: why); calls shorter than
    DEVICE_TIMING_BELOW_S are timed instead by their device span in a profiler trace
    (DEVICE_TIMING_METHOD, `trace_program_seconds`). JAX_TIMING picks how:
    "unrolled" (the default) writes the reps out as straight-line code, so the host enqueues every
    launch ahead of the GPU, as a model step does and as a replayed CUDA graph does for torch;
    "loop" runs them in a `fori_loop`, whose while loop reads its predicate back to the host each
    iteration and lets the GPU idle between calls (measured: benchmarks/NOTES.md v7). Unrolling
    is only sound when a step cannot fuse with the next (a kernel call between them); steps of
    plain jnp ops keep mode="loop".
  * torch: `time_torch_graph` captures one CUDA graph of the calls on every input copy and
    times its replays with CUDA events.
"""

from __future__ import annotations

import glob
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

L2_BYTES = 50 * 2**20  # H200 L2; inputs are rotated so that each call reads ≥ 4× this much between reuses


def copies_to_defeat_l2(bytes_per_call: int, cap: int = 32) -> int:
    return int(min(cap, max(1, math.ceil(4 * L2_BYTES / max(bytes_per_call, 1)))))


def git_head(cwd=None) -> str | None:
    """`git rev-parse HEAD` of the checkout, or None outside one."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=cwd).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_tree_matches_head(cwd=None) -> bool | None:
    """Whether the tracked files equal HEAD's (None outside a checkout). A copy of a working tree
    that travels without its .git (or with a stale one) shows here as False: the recorded sha would
    not name the code that ran (benchmarks/NOTES.md v16)."""
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, check=True, cwd=cwd).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return status.strip() == ""


def git_worktree_tree(cwd=None) -> str | None:
    """The git tree hash of the working tree as it stands (every file .gitignore keeps), built in
    a throwaway index: it names the code that ran even where the checkout's .git is stale (the
    device's copy, benchmarks/NOTES.md v16–v17), and `summarize` checks it against the tree of the
    recorded sha. None outside a checkout. (`git add` into the throwaway index stores the blobs in
    .git/objects, as any `git add` does.)"""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
        try:
            subprocess.run(["git", "add", "-A", "."], env=env, cwd=cwd, check=True, capture_output=True)
            return subprocess.run(["git", "write-tree"], env=env, cwd=cwd, check=True, capture_output=True,
                                  text=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None


def git_commit_tree(sha: str, cwd=None) -> str | None:
    """The tree hash of commit `sha` in the checkout at cwd, or None where it is not a commit there."""
    try:
        return subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{sha}^{{tree}}"], capture_output=True,
                              text=True, check=True, cwd=cwd).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def tree_mismatch(sha: str, tree: str, cwd=None) -> str | None:
    """Why `sha` does not name the code whose tree hash is `tree` (`git_worktree_tree`), or None
    where it does. Checked in the checkout at cwd: `summarize` on the recorded files, and
    `environment` at the start of a run, where a sha taken from a stale .git (the device copy's)
    is caught before any time is spent (benchmarks/NOTES.md v19)."""
    expected = git_commit_tree(str(sha), cwd=cwd)
    if expected is None:
        return f"its git sha {sha} is not a commit of this checkout: the tree that ran cannot be checked"
    if expected != tree:
        return f"the tree that ran ({tree[:12]}) differed from its recorded git sha {sha} (tree {expected[:12]})"
    return None


def environment() -> dict:
    """GPU, driver and package versions, git sha (OSCAR_GIT_SHA, else `git rev-parse`)."""
    import jax
    import jaxlib
    import torch
    import triton

    sha = os.environ.get("OSCAR_GIT_SHA") or git_head() or "unknown"
    gpu = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
             "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        smi = "unavailable"
    worktree = git_worktree_tree()
    if worktree is not None and (mismatch := tree_mismatch(sha, worktree)) is not None:
        print(f"WARNING: {mismatch}; set OSCAR_GIT_SHA to the commit of this tree", file=sys.stderr, flush=True)
    return {
        "gpu": gpu.name if gpu else "none",
        "gpu_memory_bytes": int(gpu.total_memory) if gpu else 0,
        "sm_count": int(gpu.multi_processor_count) if gpu else 0,
        "nvidia_smi": smi,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "jax_backend": jax.default_backend(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "triton": triton.__version__, "numpy": np.__version__, "python": platform.python_version(),
        # whether the Pallas INT2 decode ran under its opt-in register cap (DECISIONS.md D6)
        "oscar_jax_register_cap": os.environ.get("OSCAR_JAX_REGISTER_CAP", "") == "1",
        "git_sha": sha,
        "git_tree_matches_head": git_tree_matches_head(),
        "git_worktree_tree": worktree,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def relative_error(got, want) -> float:
    """‖got − want‖ / ‖want‖ in float64 (NaN anywhere → inf, so it never passes)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


JAX_TIMING_MODES = ("unrolled", "loop")
# One program's wall time also holds a fixed cost (its dispatch until the first kernel runs, the
# final sync), which torch's event-timed graph replays do not: 0.7–1.5 ms a program, at 32 calls a
# program 22.8 µs a call at 8K b1 and 26.4 at 128K b1 (benchmarks/NOTES.md v16). The per-call time
# is therefore the *difference* between two
# programs queued back to back (the second fed the first's output) and one, over reps: the fixed cost
# cancels, as a model's steps queued behind each other see it. `wall_median_s` keeps one program's
# wall time per call.
JAX_TIMING_METHOD = "(wall of 2 chained programs - wall of 1) / reps"
JAX_TIMING = "unrolled"  # bench_h200 --jax-timing sets it
# Calls shorter than this are timed on the device as well, from a profiler trace of `trials`
# programs (each program's first kernel start to its last kernel end, / reps), and that time is
# the one reported: the host-timed difference above spread ±25–40 % for the same kernel at
# 8K / 32K batch 1 (~10–35 µs a call) where Triton's CUDA-event timing spread ±6 %
# (benchmarks/NOTES.md v21).
DEVICE_TIMING_BELOW_S = 100e-6
DEVICE_TIMING_METHOD = "device span of 1 program (first kernel start to last kernel end) / reps, jax.profiler trace"


def device_kernels(trace_dir: str) -> tuple[list[tuple[str, int, int]], dict]:
    """Kernel events (name, start_ns, duration_ns) on the stream lines of the first GPU plane of the
    jax.profiler trace in `trace_dir`, and the plane's line names with their event counts."""
    from jax.profiler import ProfileData

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    data = ProfileData.from_file(paths[0])
    events, lines = [], {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            line_events = list(line.events)
            lines[f"{plane.name} | {line.name}"] = len(line_events)
            if line.name.startswith("Stream"):
                events += [(e.name, int(e.start_ns), int(e.duration_ns)) for e in line_events]
        break
    return events, lines


def busy_ns(events: list[tuple[str, int, int]]) -> int:
    """Time the GPU ran any of `events` (name, start_ns, duration_ns): the length of the union of
    their intervals."""
    intervals = sorted((start, start + dur) for _, start, dur in events)
    busy, (cur_start, cur_end) = 0, intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return busy + cur_end - cur_start


def program_times(events: list[tuple[str, int, int]], programs: int) -> list[tuple[int, int]]:
    """(span, busy) in ns of each of `programs` programs run one after another, each launching the
    same kernels: the events in start order cut into `programs` equal runs; span = first kernel
    start to last kernel end, busy = `busy_ns` (span − busy: the GPU idle between kernels)."""
    if programs < 1 or not events or len(events) % programs:
        raise ValueError(f"{len(events)} kernel events do not split into {programs} programs of equal length")
    ordered = sorted(events, key=lambda e: e[1])
    per_program = len(ordered) // programs
    runs = [ordered[i * per_program:(i + 1) * per_program] for i in range(programs)]
    return [(max(start + dur for _, start, dur in run) - run[0][1], busy_ns(run)) for run in runs]


def trace_program_seconds(run, programs: int) -> list[tuple[float, float]]:
    """Device (span, busy) seconds (`program_times`) of each of `programs` calls of `run()` (a jitted
    program, already compiled and warm), from one jax.profiler trace; the calls synchronised one by one."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(programs):
                jax.block_until_ready(run())
        events, _ = device_kernels(trace_dir)
    return [(span / 1e9, busy / 1e9) for span, busy in program_times(events, programs)]


def time_jax_loop(step, carry, reps: int, trials: int = 5, operands=(), mode: str | None = None) -> dict:
    """Median seconds per call of `step(i, carry, *operands) -> carry`, run `reps` times in one
    jitted program (`mode`: JAX_TIMING_MODES, None → JAX_TIMING; the module docstring says why).
    Pass every array the step reads as `operands` (a tuple of pytrees), not by closure: JAX embeds
    the arrays a jitted function closes over in the program as constants, and a multi-GB constant
    makes compilation take minutes (128K × batch 8: past the device limit)."""
    import jax

    mode = JAX_TIMING if mode is None else mode
    if mode not in JAX_TIMING_MODES:
        raise ValueError(f"mode={mode!r} must be one of {JAX_TIMING_MODES}")

    @jax.jit
    def loop(carry, operands):
        if mode == "loop":
            return jax.lax.fori_loop(0, reps, lambda i, c: step(i, c, *operands), carry)
        for i in range(reps):  # i is a Python int: the step's input copy is a static index
            carry = step(i, carry, *operands)
        return carry

    jax.block_until_ready(loop(carry, operands))  # compile + warm up
    jax.block_until_ready(loop(loop(carry, operands), operands))
    walls, steady = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(carry, operands))
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.block_until_ready(loop(loop(carry, operands), operands))  # the second queued behind the first
        two = time.perf_counter() - t0
        walls.append(one / reps)
        steady.append((two - one) / reps)
    timing = {"median_s": statistics.median(steady), "min_s": min(steady), "max_s": max(steady),
              "wall_median_s": statistics.median(walls), "reps": reps, "trials": trials, "mode": mode,
              "method": JAX_TIMING_METHOD}
    if timing["median_s"] < DEVICE_TIMING_BELOW_S and jax.default_backend() == "gpu":
        traced = trace_program_seconds(lambda: loop(carry, operands), trials)
        span, busy = ([t[i] / reps for t in traced] for i in (0, 1))
        timing.update({f"queued_{k}": timing[k] for k in ("median_s", "min_s", "max_s", "method")})
        timing.update(median_s=statistics.median(span), min_s=min(span), max_s=max(span),
                      busy_median_s=statistics.median(busy), method=DEVICE_TIMING_METHOD)
    return timing


def time_torch_graph(calls, trials: int = 10) -> dict:
    """Median seconds per call of a list of zero-argument callables (one per input copy),
    captured as one CUDA graph; falls back to eager launches timed by events when capture fails."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (autotuning, workspace allocation) outside the capture
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph, mode = torch.cuda.CUDAGraph(), "cuda_graph"
    try:
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        run = graph.replay
    except Exception as err:  # noqa: BLE001 - a backend that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        mode = f"eager ({type(err).__name__})"

        def run():
            for call in calls:
                call()
    run()
    torch.cuda.synchronize()
    repeat = max(1, 16 // len(calls))
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (repeat * len(calls)))
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "calls_per_trial": repeat * len(calls), "trials": trials, "mode": mode}


def copy_bandwidth(num_bytes: int = 4 * 2**30) -> dict:
    """Device-to-device copy bandwidth (bytes read + bytes written per second), torch and JAX, and
    the read-only stream (a reduction over the same bytes) as `read_gb_per_s`."""
    import jax
    import jax.numpy as jnp
    import torch

    # float32 elements: copy_ of uint8 tensors measured 30 % slower (narrow loads) on the H200.
    src = torch.rand((num_bytes // 4,), dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    torch_time = time_torch_graph([lambda: dst.copy_(src)])
    read_time = time_torch_graph([lambda: src.sum()])  # the read-only stream
    del src, dst
    torch.cuda.empty_cache()

    x = jax.random.bits(jax.random.key(0), (num_bytes // 4,), jnp.uint32)

    def step(i, carry):
        return carry + jnp.uint32(1)  # reads and writes every byte once

    # A loop, never unrolled: XLA fuses 20 straight-line adds into one pass (it measured 75 TB/s).
    jax_time = time_jax_loop(step, x, reps=20, mode="loop")
    del x
    out = {}
    for name, t in (("torch", torch_time), ("jax", jax_time)):
        out[name] = dict(t, bytes_moved=2 * num_bytes, gb_per_s=2 * num_bytes / t["median_s"] / 1e9)
    out["gb_per_s"] = max(out["torch"]["gb_per_s"], out["jax"]["gb_per_s"])
    out["torch_read_only"] = dict(read_time, bytes_moved=num_bytes, gb_per_s=num_bytes / read_time["median_s"] / 1e9)
    # Decode kernels only read: their fractions and floors are taken against this stream, not the copy.
    out["read_gb_per_s"] = out["torch_read_only"]["gb_per_s"]
    return out
