"""Turn the raw H200 benchmark files into summary_h200.json, plots and BENCHMARKS.md.

    python3 -m benchmarks.summarize --results benchmarks/results

Reads `<results>/{decode,write,e2e,copy}_h200.json` (written by `benchmarks.bench_h200`); any of
them may be missing, and then the keys that depend on it are null and a warning is printed. A
file that is present but malformed raises `ResultsError` naming the file and the key. Reads also
every `<results>/serve_*.json` (written by `benchmarks.bench_serve`) for BENCHMARKS.md's Serving
section only (never the summary); one without bench_serve's shape is listed there as skipped.

Writes:
  <results>/summary_h200.json             exactly the keys of `SUMMARY_KEYS`
  <results>/summary_h200_provenance.json  which variant / batch / file each value came from, warnings
  <results>/decode_time_vs_context.png, decode_bandwidth.png, e2e_step_vs_floor.png
  <results>/serve_ratios_and_latency.png  the serve files: INT2 / BF16 ratios, inter-token latency
  BENCHMARKS.md (repo root)               conditions, tables, targets — every number from the files

Definitions (one set, used by the summary, BENCHMARKS.md, the plots and README):
  fastest BF16: per (context, batch), the fastest passing BF16 variant measured in the same run
    (`bench_decode.BF16_VARIANTS`: cuDNN and FlashAttention-2 through torch SDPA called as users call
    them for decode, the project's BF16 paged kernel, and the rows-as-queries SDPA forms); the tables
    name which one it was.
  decode speed-up: fastest BF16 median / the median of a backend's default launch (jax:
    `oscar_int2_pallas`, torch: `oscar_int2_triton`). Tuning sweeps are reported apart, never here.
  fraction of read bandwidth: (bytes the kernel must read / median) / the read-only stream measured in
    the config's own run (`harness.copy_bandwidth`'s `read_gb_per_s`; files written before it was
    recorded per config fall back to the file's). "× floor" is its inverse: time over bytes / read
    bandwidth. The read+write copy figure is reported beside it, never divided into.
  e2e step over read floor at 100K, batch 1: step median / ((weight + KV bytes read) / the e2e file's
    read-only bandwidth); and the plain ratio of steps a user feels, BF16 / INT2.
  capacity at 100K: exact = BF16 bytes per sequence / INT2 bytes per sequence (the byte ratio);
    whole_sequences = INT2 sequences built / BF16 sequences built (whole sequences fit in memory).
  throughput at capacity: INT2 tokens/s at its built batch / BF16 tokens/s at its built batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from benchmarks import bench_serve, harness

FILES = ("decode", "write", "e2e", "copy")
CONTEXT_100K = 100_000
PALLAS = "oscar_int2_pallas"
TRITON = "oscar_int2_triton"
DEFAULTS = {"jax": PALLAS, "torch": TRITON}  # the default launch of each backend
CUDNN = "cudnn_bf16"
FA2 = "flash2_bf16"
BF16_VARIANTS = ("cudnn_bf16", "flash2_bf16", "bf16_paged_pallas", "cudnn_bf16_rows_as_queries",
                 "flash2_bf16_rows_as_queries")  # = bench_decode.BF16_VARIANTS (a test keeps them equal)
SERVE_GLOB = "serve_*.json"  # bench_serve's files: BENCHMARKS.md's Serving section, never the summary
SERVE_KINDS = ("int2", "bf16")
PLOT_FILES = ("decode_time_vs_context.png", "decode_bandwidth.png", "e2e_step_vs_floor.png")  # make_plots' files
SERVE_PLOT = "serve_ratios_and_latency.png"  # make_serve_plot's file, shown in the Serving section
DECODE_POINTS = {"128k_b1": (131072, 1), "128k_b8": (131072, 8), "32k_b1": (32768, 1), "32k_b8": (32768, 8)}
SUMMARY_KEYS = (
    "decode_speedup_vs_best_bf16",
    "decode_fraction_of_read_bandwidth",
    "e2e_step_over_read_floor_100k_b1",
    "e2e_bf16_over_int2_step_100k_b1",
    "capacity_100k_int2_over_bf16",
    "throughput_at_capacity_100k_int2_over_bf16",
)
# Targets: BASELINES / MOSAIC (issues 36, 41) on these definitions; the write path's from GPU-PERF (issue 7).
TARGET_SPEEDUP_128K = 5.0
TARGET_SPEEDUP_32K = 4.0
TARGET_READ_FRACTION = 0.75
TARGET_BACKEND_GAP = 0.10
TARGET_WRITE_FRACTION = 0.5
TARGET_E2E_OVER_READ_FLOOR = 1.25
TARGET_E2E_BF16_OVER_INT2 = 1.6
TARGET_THROUGHPUT_AT_CAPACITY = 6.0


class ResultsError(ValueError):
    """A raw result file does not have the structure bench_h200 writes."""


# ------------------------------------------------------------------------------ loading


def _get(obj, key, types, where: str, *, optional: bool = False):
    """obj[key] checked against `types` (a tuple; numbers exclude bool); ResultsError otherwise."""
    if not isinstance(obj, dict):
        raise ResultsError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj or obj[key] is None:
        if optional:
            return None
        raise ResultsError(f"{where}: missing key {key!r}")
    value = obj[key]
    numeric = any(t in (int, float) for t in types)
    if not isinstance(value, types) or (numeric and isinstance(value, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise ResultsError(f"{where}.{key}: expected {names}, got {type(value).__name__} ({value!r:.60})")
    if numeric and isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
        raise ResultsError(f"{where}.{key}: not a finite number ({value!r})")
    return value


NUM = (int, float)


def _decode_timing_line(decode: dict) -> str:
    """How the decode rows were timed: torch by CUDA events over graph replays; JAX by the method its
    entries name (harness.JAX_TIMING_METHOD), or one program's wall time for configs measured before."""
    methods = {v.get("method") for c in decode["configs"] for name, v in c["variants"].items()
               if name.endswith("pallas") or name.startswith("oscar_int2_pallas[")}
    jax_text = "; ".join(sorted(f"`{m}`" if m else "one program's wall time / reps (configs measured before v16)"
                                for m in methods)) or "—"
    if harness.DEVICE_TIMING_METHOD in methods:
        jax_text += f" (the latter for calls under {harness.DEVICE_TIMING_BELOW_S * 1e6:.0f} µs)"
    return ("Timing: torch variants (Triton, cuDNN, FlashAttention-2) by CUDA events over replays of one CUDA graph; "
            f"JAX variants (Pallas) per call: {jax_text}. Medians of repeated trials; inputs rotated among copies "
            "so that no call finds its data in L2.")


def _check_timing(entry, where: str, positive=("median_s",)) -> None:
    for key in positive:
        if _get(entry, key, NUM, where) <= 0:
            raise ResultsError(f"{where}.{key}: must be > 0")
    _get(entry, "gb_per_s", NUM, where)


def _check_common(data, name: str) -> None:
    if not isinstance(data, dict):
        raise ResultsError(f"{name}: the top level must be an object")
    copy = _get(data, "copy_bandwidth", (dict,), name)
    if _get(copy, "gb_per_s", NUM, f"{name}: copy_bandwidth") <= 0:
        raise ResultsError(f"{name}: copy_bandwidth.gb_per_s must be > 0")
    _get(data, "environment", (dict,), name)


def validate_decode(data, name: str = "decode_h200.json") -> None:
    _check_common(data, name)
    for i, config in enumerate(_get(data, "configs", (list,), name)):
        where = f"{name}: configs[{i}]"
        for key in ("context", "batch", "int2_bytes_read", "bf16_bytes_read"):
            _get(config, key, (int,), where)
        for key in ("copy_gb_per_s", "read_gb_per_s"):
            if key in config and _get(config, key, NUM, where) <= 0:
                raise ResultsError(f"{where}: {key} must be > 0")
        for vname, v in _get(config, "variants", (dict,), where).items():
            vwhere = f"{where}.variants[{vname!r}]"
            if isinstance(v, dict) and "error" in v:
                _get(v, "error", (str,), vwhere)
                continue
            _get(v, "passed", (bool,), vwhere)
            _get(v, "bytes_read", (int,), vwhere)
            if "median_s" in v or v.get("passed"):  # a passing variant is always timed
                _check_timing(v, vwhere)


def validate_write(data, name: str = "write_h200.json") -> None:
    _check_common(data, name)
    for i, case in enumerate(_get(data, "write_pages", (list,), name)):
        where = f"{name}: write_pages[{i}]"
        for key in ("tokens", "group_size", "bytes_moved"):
            _get(case, key, (int,), where)
        _get(case, "rows_dtype", (str,), where)
        for variant in ("unrotated", "rotated"):
            entry = _get(case, variant, (dict,), where)
            _get(entry, "jax_torch_bit_identical", (bool,), f"{where}.{variant}")
            for backend in ("pallas", "triton"):
                _check_timing(_get(entry, backend, (dict,), f"{where}.{variant}"), f"{where}.{variant}.{backend}")
    for i, case in enumerate(_get(data, "demote", (list,), name)):
        where = f"{name}: demote[{i}]"
        for key in ("pages", "layers", "group_size", "bytes_moved"):
            _get(case, key, (int,), where)
        _get(case, "jax_torch_bit_identical", (bool,), where)
        for backend in ("pallas", "triton"):
            _check_timing(_get(case, backend, (dict,), where), f"{where}.{backend}")


def validate_e2e(data, name: str = "e2e_h200.json") -> None:
    _check_common(data, name)
    for i, run in enumerate(_get(data, "runs", (list,), name)):
        where = f"{name}: runs[{i}]"
        if _get(run, "cache", (str,), where) not in ("int2", "bf16"):
            raise ResultsError(f"{where}.cache: must be 'int2' or 'bf16', got {run['cache']!r}")
        for key in ("context", "batch", "kv_bytes_read", "weight_bytes_read"):
            _get(run, key, (int,), where)
        if _get(run, "median_s", NUM, where) <= 0:
            raise ResultsError(f"{where}.median_s: must be > 0")
        _get(run, "floor_s", NUM, where, optional=True)
        _get(run, "logits_finite", (bool,), where)
    capacity = _get(data, "capacity", (dict,), name, optional=True)
    if capacity is not None:
        for kind in ("int2", "bf16"):
            entry = _get(capacity, kind, (dict,), f"{name}: capacity", optional=True)
            if entry is not None:
                _get(entry, "max_concurrent_100k", (int,), f"{name}: capacity.{kind}")
                _get(entry, "tokens_per_s_at_capacity", NUM, f"{name}: capacity.{kind}", optional=True)


def validate_copy(data, name: str = "copy_h200.json") -> None:
    _check_common(data, name)


VALIDATORS = {"decode": validate_decode, "write": validate_write, "e2e": validate_e2e, "copy": validate_copy}


def load_results(results_dir: Path, warnings: list[str]) -> dict:
    """{section: parsed and validated JSON or None (missing, with a warning)}."""
    out = {}
    for section in FILES:
        path = Path(results_dir) / f"{section}_h200.json"
        if not path.exists():
            _warn(warnings, f"{path} is missing: the values that depend on it are null")
            out[section] = None
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ResultsError(f"{path.name}: not valid JSON ({err})") from err
        VALIDATORS[section](data, path.name)
        out[section] = data
    return out


def validate_serve(data, name: str) -> None:
    """bench_serve's shape: environment, setup, and runs that name their kind, prompt, rate and tokens/s."""
    if not isinstance(data, dict):
        raise ResultsError(f"{name}: the top level must be an object")
    _get(data, "environment", (dict,), name)
    _get(data, "setup", (dict,), name)
    for i, run in enumerate(_get(data, "results", (list,), name)):
        where = f"{name}: results[{i}]"
        _get(run, "kind", (str,), where)
        _get(run, "prompt_len", (int,), where)
        _get(run, "output_tokens_per_s", NUM, where)
        if not isinstance(run.get("rate"), (int, float, str)) or _rate(run["rate"]) is None:
            raise ResultsError(f"{where}.rate: expected a number or 'inf', got {run.get('rate')!r:.60}")


def load_serve(results_dir: Path) -> list[tuple[str, dict | None, str | None]]:
    """(file name, data, None) of every serve_*.json sorted by name, or (name, None, why it was skipped)."""
    out = []
    for path in sorted(Path(results_dir).glob(SERVE_GLOB)):
        try:
            data = json.loads(path.read_text())
            validate_serve(data, path.name)
        except (json.JSONDecodeError, ResultsError) as err:
            out.append((path.name, None, str(err) if isinstance(err, ResultsError) else f"not valid JSON ({err})"))
            continue
        out.append((path.name, data, None))
    return out


def _warn(warnings: list[str], message: str) -> None:
    warnings.append(message)
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ summary


def _config(decode, context: int, batch: int):
    if decode is None:
        return None
    return next((c for c in decode["configs"] if c["context"] == context and c["batch"] == batch), None)


def config_copy(decode, config) -> float:
    """The read+write copy bandwidth of a config's own run (`bench_h200 --merge` files hold configs of
    several runs), else the file's. Reported beside the read bandwidth, never divided into."""
    return config.get("copy_gb_per_s", decode["copy_bandwidth"]["gb_per_s"])


def read_bandwidth(data, config=None) -> float | None:
    """The read-only stream (GB/s) measured in the run of `config` (or of the file): what a decode
    kernel, which only reads, is held to. None when the file predates its recording."""
    if config is not None and config.get("read_gb_per_s"):
        return config["read_gb_per_s"]
    copy = data["copy_bandwidth"]
    return copy.get("read_gb_per_s") or (copy.get("torch_read_only") or {}).get("gb_per_s")


def timed_variant(config, name: str):
    """The variant entry if it passed its check and was timed, else None."""
    v = (config or {}).get("variants", {}).get(name)
    return v if isinstance(v, dict) and v.get("passed") and "median_s" in v else None


def best_variant(config, base: str):
    """(name, entry) of the fastest passing variant named `base` or `base[tiling]`, or (None, None):
    for comparing sweeps between runs, never for the summary (which takes the default launch)."""
    best = (None, None)
    for name, v in (config or {}).get("variants", {}).items():
        if (name == base or name.startswith(base + "[")) and timed_variant(config, name):
            if best[1] is None or v["median_s"] < best[1]["median_s"]:
                best = (name, v)
    return best


def best_bf16(config):
    """(name, entry) of the fastest passing BF16 variant of a config (BF16_VARIANTS), or (None, None)."""
    timed = [(name, timed_variant(config, name)) for name in BF16_VARIANTS if timed_variant(config, name)]
    return min(timed, key=lambda nv: nv[1]["median_s"], default=(None, None))


def is_sweep(name: str) -> bool:
    """A tuning variant (`base[launch keywords]`), reported in its own table."""
    return "[" in name


def _ratio(num, den):
    return num / den if num is not None and den else None


def decode_point(decode, config) -> dict:
    """Every figure of one (context, batch) by the definitions above: the fastest BF16 (name, µs), and
    per backend the default launch's time, speed-up over that BF16, fraction of read bandwidth, × floor."""
    name, bf16 = best_bf16(config)
    read = read_bandwidth(decode, config)
    out = {"best_bf16": name, "best_bf16_s": bf16 and bf16["median_s"], "read_gb_per_s": read,
           "copy_gb_per_s": config_copy(decode, config)}
    for backend, variant in DEFAULTS.items():
        v = timed_variant(config, variant)
        t = v and v["median_s"]
        fraction = _ratio(v and v["bytes_read"] / v["median_s"] / 1e9, read)
        out[backend] = {"variant": variant, "median_s": t, "speedup": _ratio(bf16 and bf16["median_s"], t),
                        "fraction_of_read": fraction, "over_floor": _ratio(1.0, fraction)}
    return out


def e2e_run(e2e, cache: str, context: int = CONTEXT_100K, batch: int = 1):
    if e2e is None:
        return None
    return next((r for r in e2e["runs"] if r["cache"] == cache and r["context"] == context
                 and r["batch"] == batch), None)


def e2e_read_floor_s(e2e, run) -> float | None:
    """(weight + KV bytes read) / the e2e file's read-only bandwidth."""
    read = read_bandwidth(e2e)
    return _ratio(run["weight_bytes_read"] + run["kv_bytes_read"], read and read * 1e9)


def _over_read_floor(e2e, run):
    return None if run is None else _ratio(run["median_s"], e2e_read_floor_s(e2e, run))


REPO_ROOT = Path(__file__).resolve().parents[1]


def _tree_warning(env: dict) -> str | None:
    """Why the code that ran may not be the recorded git sha, or None. Files since v17 hold the
    tree hash of the tree that ran (harness.git_worktree_tree), checked here against the sha's tree
    in this checkout; older files only say whether the device's own .git saw a clean tree, which a
    stale .git cannot (a hand-written git_sha_note explains those)."""
    sha, tree = env.get("git_sha"), env.get("git_worktree_tree")
    if tree is not None:
        return harness.tree_mismatch(str(sha), tree, cwd=REPO_ROOT)
    if env.get("git_tree_matches_head") is False and not env.get("git_sha_note"):
        return f"the tree that ran differed from its recorded git sha {sha} (harness.git_tree_matches_head)"
    return None


def summarize_results(results: dict, warnings: list[str]) -> tuple[dict, dict]:
    """(summary with exactly SUMMARY_KEYS, provenance)."""
    decode, e2e = results.get("decode"), results.get("e2e")
    summary, provenance = {}, {"sources": {}, "warnings": warnings}
    for section, data in results.items():
        if data is not None:
            env = data.get("environment", {})
            provenance["sources"][section] = {"git_sha": env.get("git_sha"), "date_utc": env.get("date_utc"),
                                              "copy_gb_per_s": data["copy_bandwidth"]["gb_per_s"]}
            tree_warning = _tree_warning(env)
            if tree_warning:
                warnings.append(f"{section}_h200.json: {tree_warning}")
    speedups, fractions = {}, {}
    for point, (context, batch) in DECODE_POINTS.items():
        config = _config(decode, context, batch)
        if decode is not None and config is None:
            _warn(warnings, f"decode_h200.json has no config at context {context}, batch {batch}: {point} is null")
        if config is None:
            speedups[point] = fractions[point] = None
            continue
        figures = decode_point(decode, config)
        speedups[point] = {b: figures[b]["speedup"] for b in DEFAULTS}
        fractions[point] = {b: figures[b]["fraction_of_read"] for b in DEFAULTS}
        provenance[f"decode_{point}"] = figures
        if figures["read_gb_per_s"] is None:
            _warn(warnings, f"decode config {point}: no read-only bandwidth recorded: its fractions are null")
        for backend in DEFAULTS:
            if figures[backend]["speedup"] is None:
                _warn(warnings, f"decode {point}.{backend} is null: the default launch or every BF16 baseline "
                                "failed or was not timed")
    summary["decode_speedup_vs_best_bf16"] = None if decode is None else speedups
    summary["decode_fraction_of_read_bandwidth"] = None if decode is None else fractions

    int2, bf16 = e2e_run(e2e, "int2"), e2e_run(e2e, "bf16")
    if e2e is None:
        summary["e2e_step_over_read_floor_100k_b1"] = summary["e2e_bf16_over_int2_step_100k_b1"] = None
    else:
        summary["e2e_step_over_read_floor_100k_b1"] = {"int2": _over_read_floor(e2e, int2),
                                                       "bf16": _over_read_floor(e2e, bf16)}
        summary["e2e_bf16_over_int2_step_100k_b1"] = _ratio(bf16 and bf16["median_s"], int2 and int2["median_s"])
        provenance["e2e_100k_b1"] = {"context": CONTEXT_100K, "batch": 1, "read_gb_per_s": read_bandwidth(e2e),
                                     **{f"{k}_floor_s": r and e2e_read_floor_s(e2e, r)
                                        for k, r in (("int2", int2), ("bf16", bf16))}}
        if int2 is None or bf16 is None:
            _warn(warnings, f"e2e: no run of both caches at context {CONTEXT_100K}, batch 1: the e2e keys are "
                            "(partly) null")

    capacity = (e2e or {}).get("capacity") or {}
    cap_int2, cap_bf16 = capacity.get("int2") or {}, capacity.get("bf16") or {}
    if e2e is not None and not (cap_int2 and cap_bf16):
        _warn(warnings, "e2e_h200.json has no capacity results: the capacity ratios are null")
    # Whole sequences = the batches whose decode steps were built and ran, not the byte accounting.
    whole = _ratio(cap_int2.get("built_batch") or None, cap_bf16.get("built_batch") or None)
    if cap_int2 and cap_bf16 and whole is None:
        _warn(warnings, "capacity whole_sequences is null: a capacity batch was not built "
                        f"(built: int2 {cap_int2.get('built_batch')}, bf16 {cap_bf16.get('built_batch')}; byte "
                        f"accounting: int2 {cap_int2.get('max_concurrent_100k')}, bf16 "
                        f"{cap_bf16.get('max_concurrent_100k')})")
    exact = _ratio(cap_bf16.get("per_sequence_bytes"), cap_int2.get("per_sequence_bytes"))
    summary["capacity_100k_int2_over_bf16"] = None if e2e is None else {"exact": exact, "whole_sequences": whole}
    summary["throughput_at_capacity_100k_int2_over_bf16"] = None if e2e is None else _ratio(
        cap_int2.get("tokens_per_s_at_capacity"), cap_bf16.get("tokens_per_s_at_capacity"))
    if cap_int2 and cap_bf16:
        provenance["capacity"] = {kind: {k: entry.get(k) for k in ("per_sequence_bytes", "max_concurrent_100k",
                                                                   "built_batch", "tokens_per_s_at_capacity")}
                                  for kind, entry in (("int2", cap_int2), ("bf16", cap_bf16))}
    assert tuple(summary) == SUMMARY_KEYS
    return summary, provenance


# ------------------------------------------------------------------------------ targets


def _met(value, ok) -> str:
    return "no data" if value is None else ("met" if ok(value) else "**not met**")


def targets(results: dict, summary: dict) -> list[dict]:
    """The targets, each {target, value, threshold, status}, on the definitions of the module docstring."""
    rows = []

    def add(target, value, threshold, ok, fmt="{:.2f}"):
        rows.append({"target": target, "value": None if value is None else fmt.format(value),
                     "threshold": threshold, "status": _met(value, ok)})

    speedups = summary["decode_speedup_vs_best_bf16"] or {}
    for point, threshold in (("128k_b1", TARGET_SPEEDUP_128K), ("128k_b8", TARGET_SPEEDUP_128K),
                             ("32k_b1", TARGET_SPEEDUP_32K), ("32k_b8", TARGET_SPEEDUP_32K)):
        for backend in DEFAULTS:
            add(f"decode speed-up vs fastest BF16, {point}, {backend}", (speedups.get(point) or {}).get(backend),
                f"≥ {threshold:g}×", lambda v, t=threshold: v >= t, "{:.2f}×")
    decode = results.get("decode")
    for backend in DEFAULTS:
        slowest = None
        if decode is not None:
            values = [decode_point(decode, c)[backend]["speedup"] for c in decode["configs"] if c["context"] >= 4096]
            slowest = min((v for v in values if v is not None), default=None)
        add(f"decode speed-up vs fastest BF16, slowest (context, batch) ≥ 4K, {backend}", slowest, "≥ 1×",
            lambda v: v >= 1.0, "{:.2f}×")
    fractions = summary["decode_fraction_of_read_bandwidth"] or {}
    for point in ("128k_b1", "128k_b8"):
        for backend in DEFAULTS:
            add(f"decode fraction of read bandwidth, {point}, {backend}", (fractions.get(point) or {}).get(backend),
                f"≥ {TARGET_READ_FRACTION:.0%}", lambda v: v >= TARGET_READ_FRACTION, "{:.1%}")
    for point in ("128k_b1", "128k_b8"):
        s = speedups.get(point) or {}
        gap = s["torch"] / s["jax"] - 1 if s.get("jax") and s.get("torch") else None  # Pallas time over Triton's
        add(f"Pallas time over Triton's, minus one, {point}", gap, f"≤ {TARGET_BACKEND_GAP:.0%}",
            lambda v: v <= TARGET_BACKEND_GAP, "{:+.1%}")
    write = results.get("write")
    for backend in ("pallas", "triton"):
        worst = None
        if write is not None:
            copy = write["copy_bandwidth"]["gb_per_s"]
            fractions_w = [e[backend]["gb_per_s"] / copy for _, e in write_rows(write)]
            worst = min(fractions_w) if fractions_w else None
        add(f"write path (worst case) / copy bandwidth (it reads and writes), {backend}", worst,
            f"≥ {TARGET_WRITE_FRACTION:.0%}", lambda v: v >= TARGET_WRITE_FRACTION, "{:.1%}")
    e2e = summary["e2e_step_over_read_floor_100k_b1"] or {}
    for cache in ("int2", "bf16"):
        add(f"e2e decode step / read floor, 100K b1, {cache} cache", e2e.get(cache),
            f"≤ {TARGET_E2E_OVER_READ_FLOOR:g}×", lambda v: v <= TARGET_E2E_OVER_READ_FLOOR, "{:.2f}×")
    add("e2e BF16 step / INT2 step, 100K b1", summary["e2e_bf16_over_int2_step_100k_b1"],
        f"≥ {TARGET_E2E_BF16_OVER_INT2:g}×", lambda v: v >= TARGET_E2E_BF16_OVER_INT2, "{:.2f}×")
    add("tokens/s at capacity, 100K, INT2 / BF16", summary["throughput_at_capacity_100k_int2_over_bf16"],
        f"≥ {TARGET_THROUGHPUT_AT_CAPACITY:g}×", lambda v: v >= TARGET_THROUGHPUT_AT_CAPACITY, "{:.2f}×")
    cap = summary["capacity_100k_int2_over_bf16"] or {}
    for basis in ("exact", "whole_sequences"):
        value = cap.get(basis)
        rows.append({"target": f"sequences of 100K that fit, INT2 / BF16 ({basis.replace('_', ' ')})",
                     "value": None if value is None else f"{value:.2f}×", "threshold": "(reported)",
                     "status": "no data" if value is None else "—"})
    return rows


def write_rows(write):
    """(label, entry with pallas/triton timings and bit-identity) of every write-path case."""
    rows = []
    for case in write["write_pages"]:
        for variant in ("unrotated", "rotated"):
            rows.append((f"write_pages {case['tokens']} tokens, {case['rows_dtype']} rows, {variant}, "
                         f"G={case['group_size']}", dict(case[variant], bytes_moved=case["bytes_moved"])))
    for case in write["demote"]:
        rows.append((f"demote {case['pages']} pages × {case['layers']} layers, G={case['group_size']}", case))
    return rows


# ------------------------------------------------------------------------------ plots


def _pyplot(warnings: list[str], what: str):
    """matplotlib.pyplot on the Agg backend, or None (and a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _warn(warnings, f"matplotlib is not installed: no {what}")
        return None
    return plt


def make_plots(results: dict, out_dir: Path, warnings: list[str]) -> list[Path]:
    plt = _pyplot(warnings, "plots")
    if plt is None:
        return []
    written = []
    decode, e2e = results.get("decode"), results.get("e2e")
    if decode is not None and decode["configs"]:
        batches = sorted({c["batch"] for c in decode["configs"]})
        copy, read = decode["copy_bandwidth"]["gb_per_s"], read_bandwidth(decode)
        for kind, ylabel, fname in (("time", "decode attention time (µs)", "decode_time_vs_context.png"),
                                    ("bw", "achieved GB/s (bytes read / time)", "decode_bandwidth.png")):
            fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
            for ax, batch in zip(axes[0], batches):
                configs = sorted((c for c in decode["configs"] if c["batch"] == batch), key=lambda c: c["context"])
                names = sorted({n for c in configs for n in c["variants"]})
                for name in names:
                    points = [(c["context"], timed_variant(c, name)) for c in configs]
                    points = [(x, v["median_s"] * 1e6 if kind == "time" else v["gb_per_s"]) for x, v in points if v]
                    if not points:
                        continue
                    tuned = "[" in name
                    ax.plot(*zip(*points), "x" if tuned else "o-", label=None if tuned else name,
                            color="grey" if tuned else None, markersize=5 if tuned else 4)
                if kind == "bw" and read:
                    ax.axhline(read, color="black", linestyle="--", label=f"read-only stream {read:.0f} GB/s")
                if kind == "bw":
                    ax.axhline(copy, color="grey", linestyle=":", label=f"copy (read+write) {copy:.0f} GB/s")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("context (tokens)")
                ax.set_ylabel(ylabel)
                ax.set_title(f"batch {batch}" + (" (× = tuning sweeps)" if kind == "time" else ""))
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
            fig.tight_layout()
            path = out_dir / fname
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    if e2e is not None and e2e["runs"]:
        runs = [dict(r, floor_s=e2e_read_floor_s(e2e, r)) for r in e2e["runs"]]
        runs = [r for r in runs if r["floor_s"]]
        if runs:
            fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(runs)), 4))
            xs = range(len(runs))
            ax.bar([x - 0.2 for x in xs], [r["median_s"] * 1e3 for r in runs], 0.4, label="decode step")
            ax.bar([x + 0.2 for x in xs], [r["floor_s"] * 1e3 for r in runs], 0.4, label="read floor")
            ax.set_xticks(list(xs), [f"{r['cache']}\n{r['context'] // 1000}K b{r['batch']}" for r in runs])
            ax.set_ylabel("ms per decode step")
            ax.set_title("end-to-end decode step vs (weights + KV bytes) / read-only bandwidth")
            ax.legend()
            fig.tight_layout()
            path = out_dir / "e2e_step_vs_floor.png"
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


def _serve_points(serve) -> tuple[list[dict], list[dict]]:
    """(INT2 / BF16 ratios per file and prompt both kinds ran at all at once, with overlap where a
    file ran both; ITL p50 / p99 and the median decode step of every run) from load_serve's list."""
    ratios, latencies = [], []
    for name, data, _ in serve:
        if data is None:
            continue
        stem = name.removeprefix("serve_").removesuffix(".json")
        by_prompt = {}
        for run in data["results"]:
            if math.isinf(run["rate"]) and run.get("overlap", True):
                by_prompt.setdefault(run["prompt_len"], {})[run["kind"]] = run
            if run["itl_s"]["p50"] is not None and (run.get("decode_step_s") or {}).get("p50"):
                overlap = {True: ", overlap", False: ", no overlap"}.get(run.get("overlap"), "")
                latencies.append({"label": f"{stem}\n{run['kind']}{overlap}", "itl_p50": run["itl_s"]["p50"],
                                  "itl_p99": run["itl_s"]["p99"], "step": run["decode_step_s"]["p50"]})
        for prompt, kinds in sorted(by_prompt.items()):
            if {"int2", "bf16"} <= set(kinds):
                int2, bf16 = kinds["int2"], kinds["bf16"]
                ratios.append({"label": f"{stem}\n{prompt // 1024}K", "output": _ratio(
                    int2["output_tokens_per_s"], bf16["output_tokens_per_s"]), "decode": _ratio(
                    int2.get("decode_tokens_per_s"), bf16.get("decode_tokens_per_s")), "ceiling": _ratio(
                    bf16.get("duration_s"), int2.get("prefill_steps_total_s"))})
    return ratios, latencies


def make_serve_plot(serve, out_dir: Path, warnings: list[str]) -> Path | None:
    """SERVE_PLOT: INT2 / BF16 output tokens/s, decode-only tokens/s and the workload's ceiling per
    file (the 3.5× target dashed); inter-token p50 / p99 against the median decode step per run (the
    1.5× target as a mark), one panel above the other. None without a run to draw or without matplotlib."""
    ratios, latencies = _serve_points(serve)
    if not ratios and not latencies:
        return None
    plt = _pyplot(warnings, "serving plot")
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(2, 1, figsize=(max(8, 1.0 * len(latencies)), 9),
                                      gridspec_kw={"height_ratios": [1, 1.2]})
    xs = range(len(ratios))
    for offset, key, label in ((-0.27, "output", "output tok/s (whole run)"),
                               (0.0, "decode", "tok/s while only decoding"),
                               (0.27, "ceiling", "ceiling: BF16 run / INT2 prefill steps")):
        left.bar([x + offset for x in xs], [r[key] or 0 for r in ratios], 0.26, label=label)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.axhline(3.5, color="grey", linestyle="--", label="target 3.5×")
    left.set_xticks(list(xs), [r["label"] for r in ratios], fontsize=8)
    left.set_ylabel("INT2 / BF16")
    left.set_title("serving, same memory, all requests at once")
    left.legend(fontsize=7)
    xs = range(len(latencies))
    left_x = [x - 0.2 for x in xs]
    right.bar(left_x, [r["itl_p50"] * 1e3 for r in latencies], 0.4, label="inter-token p50")
    right.bar([x + 0.2 for x in xs], [r["itl_p99"] * 1e3 for r in latencies], 0.4, label="inter-token p99")
    right.scatter(left_x, [1.5 * r["step"] * 1e3 for r in latencies], marker="_", s=300, color="black",
                  zorder=3, label="target: 1.5× median decode step")
    right.set_yscale("log")
    right.set_xticks(list(xs), [r["label"] for r in latencies], fontsize=7, rotation=30, ha="right")
    right.set_ylabel("ms")
    right.set_title("inter-token latency (prefill chunks ride in decode steps)")
    right.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / SERVE_PLOT
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ markdown


def _f(value, fmt="{:.1f}", none="—"):
    return none if value is None else fmt.format(value)


def _rate(value):
    """'all at once' for an infinite rate (inf / Infinity / 'inf'), else 'N/s'; None if not a rate."""
    try:
        rate = float(value)
    except (TypeError, ValueError):
        return None
    return "all at once" if math.isinf(rate) else f"{rate:g}/s"


def _pct(run: dict, key: str, stat: str = "p50", scale: float = 1.0):
    """run[key][stat] × scale, or None where the run did not record it."""
    entry = run.get(key)
    value = entry.get(stat) if isinstance(entry, dict) else None
    return value * scale if isinstance(value, NUM) and not isinstance(value, bool) else None


def _per_kind(values, fmt: str) -> str:
    """'int2 7 / bf16 1' of a {kind: value} object."""
    return " / ".join(f"{kind} {_f(v, fmt)}" for kind, v in (values or {}).items()) or "—"


def _serve_conditions(data: dict) -> str:
    env, setup = data["environment"], data["setup"]
    memory = setup.get("kv_cache_memory_bytes")
    return (f"GPU {env.get('gpu', '?')}, git `{(env.get('git_sha') or '?')[:7]}`, {env.get('date_utc', '?')}; "
            f"prompt {', '.join(str(p) for p in setup.get('prompt_lens') or []) or '—'} tokens, output "
            f"{setup.get('output_len', '—')} tokens; KV cache {_f(memory and memory / 2**30, '{:.2f}')} GiB; decode "
            f"buckets `{setup.get('decode_buckets', '—')}`, prefill split `{setup.get('prefill_split', '—')}`; "
            f"capacity (sequences) {_per_kind(data.get('capacity'), '{}')}; compile "
            f"{_per_kind(data.get('compile_s'), '{:.1f}')} s.")


def _serve_row(run: dict) -> list:
    overlap = {True: "on", False: "off"}.get(run.get("overlap"), "—")  # files before the field: —
    return [run["kind"], run["prompt_len"], _rate(run["rate"]), overlap, run.get("requests", "—"),
            _f(run["output_tokens_per_s"], "{:.2f}"), _f(_pct(run, "ttft_s"), "{:.2f}"),
            _f(_pct(run, "ttft_s", "p99"), "{:.2f}"), _f(_pct(run, "itl_s", scale=1e3), "{:.2f}"),
            _f(_pct(run, "itl_s", "p99", 1e3), "{:.2f}"), _f(_pct(run, "decode_step_s", scale=1e3), "{:.2f}"),
            _f(run.get("decode_tokens_per_s"), "{:.1f}"), _f(_pct(run, "prefill_step_s", scale=1e3), "{:.1f}"),
            _f(_pct(run, "prefill_step_device_share", scale=100), "{:.1f} %")]


def _serve_ratios(runs: list[dict], asked=None) -> list[str]:
    """INT2 / BF16 output tokens/s per (prompt, rate) both kinds ran at; a line per kind that never ran
    (`asked`: the kinds the run was given, where the file records them)."""
    by_point = {}
    for run in runs:
        if run.get("overlap", True):  # the engine's default where a file ran both
            by_point.setdefault((run["prompt_len"], _rate(run["rate"])), {})[run["kind"]] = run["output_tokens_per_s"]
    pairs = [f"{_f(_ratio(k['int2'], k['bf16']), '{:.2f}×')} at prompt {p}, {rate}"
             for (p, rate), k in by_point.items() if "int2" in k and "bf16" in k]
    lines = [f"INT2 / BF16 output tokens/s: {'; '.join(pairs)}."] if pairs else []
    kinds = {run["kind"] for run in runs}
    for kind in (k for k in SERVE_KINDS if k not in kinds):
        if asked is None:
            lines.append(f"No {kind.upper()} run in this file.")
        elif kind in asked:
            lines.append(f"{kind.upper()} run missing: the run was cut off.")
    if not pairs and set(SERVE_KINDS) <= kinds:
        lines.append("INT2 / BF16 output tokens/s: no prompt length and rate that both kinds ran at.")
    return lines


def _serve_targets(targets) -> str:
    """The file's targets (bench_serve.targets): value against target, met / not met."""
    items = []
    for name, t in (targets or {}).items():
        t = t if isinstance(t, dict) else {"value": t}
        value = t.get("value")
        text = f"`{name}` {_f(value, '{:.2f}') if isinstance(value, (int, float)) else value}"
        where = f", prompt {t['prompt_len']}" if "prompt_len" in t else ""
        if "target" in t:
            text += f" (target {t['target']}{where})"
        status = "reported" if "met" not in t else ("met" if t["met"] else "**not met**")
        items.append(f"{text}: {status}")
    return "Targets (`bench_serve.targets`): " + ("; ".join(items) if items else "none evaluated") + "."


def _serve_http(http) -> list[str]:
    if not isinstance(http, dict):
        return []
    engine, client = http.get("engine") or {}, http.get("http") or {}
    return [f"HTTP (streaming client) at prompt {http.get('prompt_len')}, {http.get('requests')} requests: "
            f"{_f(client.get('output_tokens_per_s'), '{:.2f}')} output tokens/s against the engine's "
            f"{_f(engine.get('output_tokens_per_s'), '{:.2f}')}; ITL p50 HTTP / engine "
            f"{_f(http.get('itl_ratio'), '{:.2f}×')}."]


def serve_markdown(serve: list[tuple[str, dict | None, str | None]], plot: Path | None = None,
                   md_dir: Path | None = None) -> list[str]:
    """BENCHMARKS.md's Serving section: per bench_serve file its conditions, a row per run, the INT2 / BF16
    ratio, its targets; files without bench_serve's shape listed as skipped."""
    if not serve:
        return []
    lines = ["## Serving (`bench_serve`)", "",
             "From `benchmarks/results/serve_*.json` (written by `python -m benchmarks.bench_serve`: the engine at "
             "Qwen3-8B shapes with random weights, prompts of random token ids, INT2 and BF16 caches in the same "
             "memory). Output tok/s = all output tokens / the time from the first arrival to the last token; "
             "decode step = the median of steps without a prefill chunk, decode tok/s = their rows over their wall time "
             "(files before it was recorded: —); prefill step = steps carrying a prefill "
             "chunk, with the share of their wall time blocked on the device (runs marked on / off under overlap: "
             "the engine waits only on a prompt's last chunk, so the share is near 0 and the wait falls in later "
             "steps); overlap = `EngineConfig.overlap` (— : files before it).", ""]
    if plot is not None:
        lines += [f"![{plot.stem}]({os.path.relpath(plot, md_dir or plot.parent)})", ""]
    header = ["kind", "prompt", "rate", "overlap", "requests", "output tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
              "ITL p99 ms", "decode step p50 ms", "decode tok/s", "prefill step p50 ms", "prefill device share p50"]
    for name, data, skipped in serve:
        if data is not None:
            try:
                lines += _serve_file(name, data, header)
                continue
            except (TypeError, ValueError, AttributeError, KeyError) as err:  # a field of another shape
                skipped = f"{name}: cannot be read as bench_serve's ({type(err).__name__}: {err})"
        lines += [f"### `{name}`", "", f"Skipped: not bench_serve's shape ({skipped}).", ""]
    return lines


def _serve_file_targets(data: dict) -> dict:
    """The targets as bench_serve evaluates them now, for files whose runs record their overlap
    setting (the host share is judged differently with and without it); older files' own."""
    if data["results"] and all("overlap" in run for run in data["results"]):
        return bench_serve.targets(data["results"], data.get("http"))
    return data.get("targets")


def _serve_file(name: str, data: dict, header: list[str]) -> list[str]:
    lines = [f"### `{name}`", "", _serve_conditions(data), ""]
    lines += _table(header, [_serve_row(run) for run in data["results"]])
    ran = {run["prompt_len"] for run in data["results"]}
    unrun = [str(p) for p in data["setup"].get("prompt_lens") or [] if p not in ran]
    notes = ([f"No run at prompt {', '.join(unrun)} (in the setup's prompt_lens)."] if unrun else [])
    notes += _serve_ratios(data["results"], data["setup"].get("kinds")) + _serve_http(data.get("http")) + [_serve_targets(_serve_file_targets(data))]
    for line in notes:
        lines += [line, ""]
    return lines


def _capacity_provenance(cap: dict) -> str:
    """' Measured at git X with <allocator settings>.' where the capacity block records them."""
    parts = []
    if cap.get("git_sha"):
        parts.append(f"git `{str(cap['git_sha'])[:10]}`")
    allocator = {k: v for k, v in (cap.get("allocator") or {}).items() if v is not None}
    if allocator:
        parts.append("allocator " + ", ".join(f"`{k}={v}`" for k, v in sorted(allocator.items())))
    return f" Measured at {' with '.join(parts)}." if parts else ""


def _short_sha(config: dict) -> str:
    """The first 7 hex digits of a decode config's git sha ("—" when the file predates per-config shas)."""
    return f"`{config['git_sha'][:7]}`" if config.get("git_sha") else "—"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def render_markdown(results: dict, summary: dict, provenance: dict, plots: list[Path], md_dir: Path,
                    command: str, serve: list | None = None, serve_plot: Path | None = None) -> str:
    decode, write, e2e = results.get("decode"), results.get("write"), results.get("e2e")
    lines = ["# OSCAR-JAX benchmarks (H200)", "",
             f"Generated by `{command}` from the raw files in `benchmarks/results/` (written by "
             "`python3 -m benchmarks.bench_h200`, and the capacity search by `XLA_PYTHON_CLIENT_PREALLOCATE=true "
             "XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m benchmarks.bench_h200 --sections e2e --capacity-only`; "
             "the commands are in its docstring). "
             "Do not edit by hand: every number below comes from those files.",
             ""]
    # ---- conditions
    lines += ["## Conditions", ""]
    present = {s: d for s, d in results.items() if d is not None}
    if not present:
        lines += ["No result files yet.", ""]
    envs = {s: d["environment"] for s, d in present.items()}
    if envs:
        first = next(iter(envs.values()))
        for label, key in (("GPU", "gpu"), ("nvidia-smi", "nvidia_smi"), ("JAX / jaxlib", "jax"),
                           ("torch / CUDA / cuDNN", "torch"), ("Triton", "triton"), ("Python", "python")):
            value = first.get(key)
            if key == "jax":
                value = f"{first.get('jax')} / {first.get('jaxlib')} ({first.get('jax_backend')})"
            if key == "torch":
                value = f"{first.get('torch')} / {first.get('cuda')} / {first.get('cudnn')}"
            lines.append(f"- {label}: {value}")
        lines += ["", "Per file (git sha of the code that produced it, date, copy bandwidth measured in that run):", ""]
        rows = [[f"`{s}_h200.json`", f"`{(e.get('git_sha') or '?')[:12]}`", e.get("date_utc"),
                 _f(present[s]["copy_bandwidth"].get("torch", {}).get("gb_per_s"), "{:.0f}"),
                 _f(present[s]["copy_bandwidth"].get("jax", {}).get("gb_per_s"), "{:.0f}"),
                 _f(present[s]["copy_bandwidth"]["gb_per_s"], "{:.0f}"), _f(read_bandwidth(present[s]), "{:.0f}")]
                for s, e in envs.items()]
        lines += _table(["file", "git sha", "date (UTC)", "copy GB/s torch", "copy GB/s JAX", "copy GB/s",
                         "read-only GB/s"], rows)
        lines += ["Copy bandwidth = (bytes read + bytes written) / time of a device-to-device copy (the larger of "
                  "torch and JAX); read-only = bytes / time of a reduction over 4 GiB (torch). Decode and the "
                  "end-to-end step only read, so their fractions and floors use the read-only figure; the write "
                  "path reads and writes, so its fractions use the copy figure.", ""]
    missing = [f"`{s}_h200.json`" for s in FILES if results.get(s) is None]
    if missing:
        lines += [f"Missing result files: {', '.join(missing)} (the values that depend on them are shown as "
                  "no data).", ""]
    if decode is not None and decode["configs"]:
        c = decode["configs"][0]
        lines += [f"Decode attention shapes: one layer, {c.get('q_heads')} query heads, {c.get('kv_heads')} KV heads, "
                  f"head dim {c.get('head_dim')}, page size {c.get('page_size')}, INT2 group size G = "
                  f"{c.get('group_size')}, sink {c.get('sink')} + recent {c.get('recent')} tokens in BF16, the rest "
                  "of the context in INT2 pages.", ""]
        lines += [_decode_timing_line(decode), ""]
    if e2e is not None:
        m, o = e2e.get("model", {}), e2e.get("oscar", {})
        lines += [f"End-to-end: {e2e.get('model_name', 'model')}: {m.get('num_layers')} layers, hidden "
                  f"{m.get('hidden_size')}, {m.get('num_q_heads')}/{m.get('num_kv_heads')} heads × {m.get('head_dim')}, "
                  f"vocab {m.get('vocab_size')}; cache page {o.get('page_size')}, G = {o.get('group_size')}, sink "
                  f"{o.get('sink')}, recent {o.get('recent')}. Timing: {e2e.get('timing_method', '?')}.", ""]

    # ---- targets
    lines += ["## Targets", "",
              "Definitions (`benchmarks/summarize.py`): a speed-up is the fastest BF16 variant measured in the same "
              "run for that (context, batch) over the **default launch** of each backend (jax: "
              f"`{PALLAS}`, torch: `{TRITON}`); fractions and floors are taken against the **read-only stream** "
              "measured in the same run (a decode kernel only reads); tuning sweeps are reported apart and never "
              "enter these figures.", ""]
    lines += _table(["target", "measured", "threshold", "status"],
                    [[t["target"], t["value"] or "—", t["threshold"], t["status"]] for t in targets(results, summary)])

    # ---- decode
    if decode is not None:
        configs = sorted(decode["configs"], key=lambda c: (c["context"], c["batch"]))
        lines += ["## Decode attention: default launches against the fastest BF16", "",
                  "Per (context, batch): the fastest passing BF16 variant of the same run, and each backend's default "
                  "launch: its median, the speed-up over that BF16, its fraction of the read-only bandwidth (bytes "
                  "it must read / time / read GB/s) and × floor (its time over bytes / read GB/s). `read GB/s` and "
                  "`copy GB/s` are the read-only stream and the read+write copy measured in the config's own run.", ""]
        rows = []
        for c in configs:
            p = decode_point(decode, c)
            rows.append([c["context"], c["batch"], f"`{p['best_bf16']}`" if p["best_bf16"] else "—",
                         _f(p["best_bf16_s"] and p["best_bf16_s"] * 1e6)]
                        + [x for b in DEFAULTS for x in (_f(p[b]["median_s"] and p[b]["median_s"] * 1e6),
                                                         _f(p[b]["speedup"], "{:.2f}×"),
                                                         _f(p[b]["fraction_of_read"], "{:.0%}"),
                                                         _f(p[b]["over_floor"], "{:.2f}"))]
                        + [_f(p["read_gb_per_s"], "{:.0f}"), _f(p["copy_gb_per_s"], "{:.0f}"), _short_sha(c)])
        lines += _table(["context", "batch", "fastest BF16", "BF16 µs", "Pallas µs", "Pallas ×", "Pallas of read",
                         "Pallas × floor", "Triton µs", "Triton ×", "Triton of read", "Triton × floor", "read GB/s",
                         "copy GB/s", "git"], rows)

        def variant_rows(sweeps: bool) -> list[list]:
            out = []
            for c in configs:
                _, bf16 = best_bf16(c)
                read = read_bandwidth(decode, c)
                for name, v in c["variants"].items():
                    if is_sweep(name) != sweeps:
                        continue
                    if "error" in v:
                        out.append([c["context"], c["batch"], f"`{name}`", "error", "", "", "", "",
                                    v["error"][:80].replace("|", "/"), _short_sha(c)])
                        continue
                    timed = timed_variant(c, name)
                    t = timed["median_s"] if timed else None
                    fraction = _ratio(timed and timed["gb_per_s"], read)
                    out.append([c["context"], c["batch"], f"`{name}`", _f(t and t * 1e6),
                                _f(timed and timed["gb_per_s"], "{:.0f}"), _f(fraction, "{:.2f}"),
                                _f(_ratio(bf16 and bf16["median_s"], t), "{:.2f}"),
                                _f(v.get("rel_error"), "{:.1e}"), "passed" if v.get("passed") else "**failed**",
                                _short_sha(c)])
            return out

        header = ["context", "batch", "variant", "µs", "GB/s", "of read", "vs fastest BF16", "rel. error", "check",
                  "git"]
        lines += ["### Every variant at its default launch", "",
                  "GB/s = bytes the variant must read / median time. A variant that failed its accuracy check is not "
                  "timed. The `_rows_as_queries` SDPA variants pass the 4 query heads of a KV head as 4 query rows of "
                  "that head, a form no decode user writes (`bench_decode`'s docstring); they count as BF16 "
                  "baselines all the same.", ""]
        lines += _table(header, variant_rows(sweeps=False))
        sweep_rows = variant_rows(sweeps=True)
        if sweep_rows:
            lines += ["### Tuning sweeps", "",
                      "Launch keywords other than the defaults (`bench_h200`'s TUNING_128K / TRITON_TUNING_128K, "
                      "`--splits`, `--variants`), each timed once; never used in the figures above.", ""]
            lines += _table(header, sweep_rows)

    # ---- write
    if write is not None:
        copy = write["copy_bandwidth"]["gb_per_s"]
        lines += ["## Write path", "",
                  "GB/s = bytes moved (rows read + codes and fp16 metadata written; demotion: BF16 pages read + INT2 "
                  "pages written) / median time; fraction = that over the copy bandwidth.", ""]
        rows = []
        for label, e in write_rows(write):
            for backend in ("pallas", "triton"):
                rows.append([label, backend, _f(e[backend]["median_s"] * 1e6), _f(e[backend]["gb_per_s"], "{:.0f}"),
                             _f(e[backend]["gb_per_s"] / copy, "{:.1%}"),
                             "yes" if e.get("jax_torch_bit_identical") else "**no**"])
        lines += _table(["case", "backend", "µs", "GB/s", "of copy", "Pallas = Triton bytes"], rows)

    # ---- e2e
    if e2e is not None:
        read = read_bandwidth(e2e)
        lines += ["## End-to-end decode (JAX)", "",
                  f"Floor = (weight bytes read + KV bytes read) / the read-only bandwidth of the run "
                  f"({_f(read, '{:.0f}')} GB/s). BF16 / INT2 = the BF16 cache's step over the INT2 cache's at the same "
                  "context and batch: what a user feels. Checks: logits finite, and two steps from the same state "
                  "bit-identical (not a comparison against a reference model).", ""]

        def bf16_over_int2(r):  # on the INT2 rows: the BF16 step at the same context and batch over this one
            pair = e2e_run(e2e, "bf16", r["context"], r["batch"]) if r["cache"] == "int2" else None
            return pair and _ratio(pair["median_s"], r["median_s"])

        rows = [[r["cache"], r["context"], r["batch"], _f(r["median_s"] * 1e3, "{:.2f}"),
                 _f(e2e_read_floor_s(e2e, r) and e2e_read_floor_s(e2e, r) * 1e3, "{:.2f}"),
                 _f(_over_read_floor(e2e, r), "{:.2f}"), _f(bf16_over_int2(r), "{:.2f}×", none=""),
                 _f(r["weight_bytes_read"] / 1e9, "{:.2f}"), _f(r["kv_bytes_read"] / 1e9, "{:.2f}"),
                 _f(r["batch"] / r["median_s"], "{:.0f}"),
                 "yes" if r.get("logits_finite") and r.get("deterministic") else "**no**"]
                for r in e2e["runs"]]
        lines += _table(["cache", "context", "batch", "step ms", "read floor ms", "step / floor", "BF16 / INT2",
                         "weights GB", "KV GB", "tokens/s", "finite + deterministic"], rows)
        cap = e2e.get("capacity") or {}
        if cap.get("int2") or cap.get("bf16"):
            lines += [f"Capacity at {cap.get('context')} tokens per sequence: ⌊(device memory "
                      f"{_f(cap.get('memory_bytes') and cap['memory_bytes'] / 2**30, '{:.1f}')} GiB ({cap.get('memory_source')}) − "
                      f"weights − {_f(cap.get('workspace_reserve_bytes', 0) / 2**30, '{:.1f}')} GiB reserve) / bytes per "
                      "sequence⌋; that batch is built and timed (stepped down by 10 % on out-of-memory)."
                      + _capacity_provenance(cap), ""]
            rows = []
            for kind in ("int2", "bf16"):
                entry = cap.get(kind) or {}
                step = entry.get("step") or {}
                rows.append([kind, _f(entry.get("per_sequence_bytes") and entry["per_sequence_bytes"] / 1e9, "{:.2f}"),
                             entry.get("max_concurrent_100k", "—"), entry.get("built_batch", "—"),
                             _f(step.get("median_s") and step["median_s"] * 1e3, "{:.2f}"),
                             _f(entry.get("tokens_per_s_at_capacity"), "{:.0f}")])
            lines += _table(["cache", "GB / sequence", "max sequences", "built batch", "step ms", "tokens/s"], rows)
            ratio = summary.get("capacity_100k_int2_over_bf16") or {}
            lines += [f"INT2 / BF16: {_f(ratio.get('exact'), '{:.2f}×')} by bytes per sequence (exact), "
                      f"{_f(ratio.get('whole_sequences'), '{:.2f}×')} in whole sequences built; tokens/s at capacity "
                      f"{_f(summary.get('throughput_at_capacity_100k_int2_over_bf16'), '{:.2f}×')}.", ""]

    # ---- serving (bench_serve's files)
    lines += serve_markdown(serve or [], serve_plot, md_dir)

    # ---- summary and plots
    lines += ["## Summary (`summary_h200.json`)", "", "```json", json.dumps(summary, indent=1), "```", ""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({os.path.relpath(p, md_dir)})" for p in plots] + [""]
    if provenance.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {w}" for w in provenance["warnings"]] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ entry point


def summarize(results_dir, markdown_path=None, *, plots: bool = True,
              command: str = "python3 -m benchmarks.summarize --results benchmarks/results") -> dict:
    """Read, validate, write summary + provenance (+ plots, + markdown when a path is given)."""
    results_dir = Path(results_dir)
    warnings: list[str] = []
    results = load_results(results_dir, warnings)
    summary, provenance = summarize_results(results, warnings)
    results_dir.mkdir(parents=True, exist_ok=True)
    # --no-plots keeps (and still shows) the PNGs a previous run drew
    written = (make_plots(results, results_dir, warnings) if plots
               else [path for path in (results_dir / name for name in PLOT_FILES) if path.exists()])
    serve = load_serve(results_dir)
    serve_plot = (make_serve_plot(serve, results_dir, warnings) if plots
                  else (results_dir / SERVE_PLOT if (results_dir / SERVE_PLOT).exists() else None))
    (results_dir / "summary_h200.json").write_text(json.dumps(summary, indent=1) + "\n")
    (results_dir / "summary_h200_provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    if markdown_path is not None:
        markdown_path = Path(markdown_path)
        markdown_path.write_text(render_markdown(results, summary, provenance, written,
                                                 markdown_path.resolve().parent, command, serve, serve_plot))
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"), help="directory of the raw files")
    parser.add_argument("--markdown", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md",
                        help="where to write BENCHMARKS.md (default: the repo root)")
    parser.add_argument("--no-plots", action="store_true",
                        help="draw no plots; BENCHMARKS.md shows the ones already there")
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.results, args.markdown, plots=not args.no_plots)
    except ResultsError as err:
        sys.exit(f"error: {err}")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.results / 'summary_h200.json'} and {args.markdown}", flush=True)


if __name__ == "__main__":
    main()
