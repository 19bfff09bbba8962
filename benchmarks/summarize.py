"""Turn the raw H200 benchmark files into summary_h200.json, plots and BENCHMARKS.md.

    python3 -m benchmarks.summarize --results benchmarks/results

Reads `<results>/{decode,write,e2e,copy}_h200.json` (written by `benchmarks.bench_h200`); any of
them may be missing, and then the keys that depend on it are null and a warning is printed. A
file that is present but malformed raises `ResultsError` naming the file and the key.

Writes:
  <results>/summary_h200.json             exactly the keys of `SUMMARY_KEYS`
  <results>/summary_h200_provenance.json  which variant / batch / file each value came from, warnings
  <results>/decode_time_vs_context.png, decode_bandwidth.png, e2e_step_vs_floor.png
  BENCHMARKS.md (repo root)               conditions, tables, targets — every number from the files

Definitions:
  decode speedup vs cuDNN at 128K (131072 tokens), batch 1 and 8: cudnn_bf16 median / median of
    jax: the fastest passing Pallas INT2 variant (default tiling or a tuning variant),
    torch: the fastest passing Triton INT2 variant (likewise).
  fraction of copy bandwidth at 128K: achieved GB/s (bytes the kernel must read / median time) ÷
    the copy bandwidth recorded in the same file; at batch 8 when the file has it, else batch 1.
  e2e step over floor at 100K: the e2e step median ÷ (weight + KV bytes read) / copy bandwidth.
  concurrency and throughput at capacity: INT2 cache ÷ BF16 cache at 100K tokens per sequence.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from benchmarks import harness

FILES = ("decode", "write", "e2e", "copy")
CONTEXT_128K = 131072
CONTEXT_100K = 100_000
PALLAS = "oscar_int2_pallas"
TRITON = "oscar_int2_triton"
CUDNN = "cudnn_bf16"
FA2 = "flash2_bf16"
SUMMARY_KEYS = (
    "decode_speedup_vs_cudnn_bf16_128k_b1",
    "decode_speedup_vs_cudnn_bf16_128k_b8",
    "decode_fraction_of_copy_bandwidth_128k",
    "e2e_decode_step_over_bandwidth_floor",
    "concurrent_100k_sequences_int2_over_bf16",
    "throughput_at_capacity_100k_int2_over_bf16",
)
# The targets (GPU-PERF, issue 7).
TARGET_SPEEDUP = 5.0
TARGET_FRACTION = 0.75
TARGET_BACKEND_GAP = 0.15
TARGET_WRITE_FRACTION = 0.5
TARGET_E2E_OVER_FLOOR = 1.15
TARGET_CONCURRENCY = 6.5


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
        if "copy_gb_per_s" in config and _get(config, "copy_gb_per_s", NUM, where) <= 0:
            raise ResultsError(f"{where}: copy_gb_per_s must be > 0")
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


def _warn(warnings: list[str], message: str) -> None:
    warnings.append(message)
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ summary


def _config(decode, context: int, batch: int):
    if decode is None:
        return None
    return next((c for c in decode["configs"] if c["context"] == context and c["batch"] == batch), None)


def _config_copy(decode, config) -> float:
    """The copy bandwidth a config's fractions are taken against: the one measured in the config's own
    run (`bench_h200 --merge` files hold configs of several runs), else the file's."""
    return config.get("copy_gb_per_s", decode["copy_bandwidth"]["gb_per_s"])


def timed_variant(config, name: str):
    """The variant entry if it passed its check and was timed, else None."""
    v = (config or {}).get("variants", {}).get(name)
    return v if isinstance(v, dict) and v.get("passed") and "median_s" in v else None


def best_variant(config, base: str):
    """(name, entry) of the fastest passing variant named `base` or `base[tiling]`, or (None, None)."""
    best = (None, None)
    for name, v in (config or {}).get("variants", {}).items():
        if (name == base or name.startswith(base + "[")) and timed_variant(config, name):
            if best[1] is None or v["median_s"] < best[1]["median_s"]:
                best = (name, v)
    return best


def best_pallas(config):
    return best_variant(config, PALLAS)


def best_triton(config):
    return best_variant(config, TRITON)


def _ratio(num, den):
    return num / den if num is not None and den else None


def _speedups(config, baseline: str) -> dict:
    base = timed_variant(config, baseline)
    _, pallas = best_pallas(config)
    _, triton = best_triton(config)
    return {"jax": _ratio(base and base["median_s"], pallas and pallas["median_s"]),
            "torch": _ratio(base and base["median_s"], triton and triton["median_s"])}


def _fraction_batch(decode) -> int | None:
    for batch in (8, 1):
        if _config(decode, CONTEXT_128K, batch) is not None:
            return batch
    return None


def e2e_run(e2e, cache: str, context: int = CONTEXT_100K, batch: int = 1):
    if e2e is None:
        return None
    return next((r for r in e2e["runs"] if r["cache"] == cache and r["context"] == context
                 and r["batch"] == batch), None)


def _over_floor(e2e, run):
    if run is None:
        return None
    if run.get("step_over_floor") is not None:
        return run["step_over_floor"]
    floor = (run["weight_bytes_read"] + run["kv_bytes_read"]) / (e2e["copy_bandwidth"]["gb_per_s"] * 1e9)
    return run["median_s"] / floor


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
    for batch in (1, 8):
        key = f"decode_speedup_vs_cudnn_bf16_128k_b{batch}"
        config = _config(decode, CONTEXT_128K, batch)
        if decode is not None and config is None:
            _warn(warnings, f"decode_h200.json has no config at context {CONTEXT_128K}, batch {batch}: {key} is null")
        summary[key] = None if config is None else _speedups(config, CUDNN)
        if config is not None:
            provenance[key] = {"jax_variant": best_pallas(config)[0], "torch_variant": best_triton(config)[0],
                               "baseline": CUDNN,
                               "context": CONTEXT_128K, "batch": batch}
            for backend, value in summary[key].items():
                if value is None:
                    _warn(warnings, f"{key}.{backend} is null: a variant failed or was not timed")

    batch = _fraction_batch(decode)
    key = "decode_fraction_of_copy_bandwidth_128k"
    if batch is None:
        summary[key] = None
    else:
        config = _config(decode, CONTEXT_128K, batch)
        copy = _config_copy(decode, config)
        name, pallas = best_pallas(config)
        triton_name, triton = best_triton(config)
        summary[key] = {"jax": _ratio(pallas and pallas["gb_per_s"], copy),
                        "torch": _ratio(triton and triton["gb_per_s"], copy)}
        provenance[key] = {"context": CONTEXT_128K, "batch": batch, "jax_variant": name,
                           "torch_variant": triton_name, "copy_gb_per_s": copy}

    key = "e2e_decode_step_over_bandwidth_floor"
    if e2e is None:
        summary[key] = None
    else:
        summary[key] = {cache: _over_floor(e2e, e2e_run(e2e, cache)) for cache in ("int2", "bf16")}
        provenance[key] = {"context": CONTEXT_100K, "batch": 1}
        for cache, value in summary[key].items():
            if value is None:
                _warn(warnings, f"{key}.{cache} is null: no e2e run at context {CONTEXT_100K}, batch 1")

    capacity = (e2e or {}).get("capacity") or {}
    int2, bf16 = capacity.get("int2") or {}, capacity.get("bf16") or {}
    if e2e is not None and not (int2 and bf16):
        _warn(warnings, "e2e_h200.json has no capacity results: the capacity ratios are null")
    # Sequences that fit = the batch whose decode step was built and ran, not the byte accounting
    # (max_concurrent_100k): an unexplained pool-sized allocation has made the two differ.
    concurrency = _ratio(int2.get("built_batch") or None, bf16.get("built_batch") or None)
    if int2 and bf16 and concurrency is None:
        _warn(warnings, "concurrent_100k_sequences_int2_over_bf16 is null: a capacity batch was not built "
                        f"(built: int2 {int2.get('built_batch')}, bf16 {bf16.get('built_batch')}; byte accounting: "
                        f"int2 {int2.get('max_concurrent_100k')}, bf16 {bf16.get('max_concurrent_100k')})")
    throughput = _ratio(int2.get("tokens_per_s_at_capacity"), bf16.get("tokens_per_s_at_capacity"))
    summary["concurrent_100k_sequences_int2_over_bf16"] = None if e2e is None else {"jax": concurrency}
    summary["throughput_at_capacity_100k_int2_over_bf16"] = None if e2e is None else {"jax": throughput}
    if int2 and bf16:
        provenance["capacity"] = {kind: {k: entry.get(k) for k in ("max_concurrent_100k", "built_batch",
                                                                   "tokens_per_s_at_capacity")}
                                  for kind, entry in (("int2", int2), ("bf16", bf16))}
        provenance["capacity"]["concurrency_basis"] = "built_batch (max_concurrent_100k is the byte accounting)"
    assert tuple(summary) == SUMMARY_KEYS
    return summary, provenance


# ------------------------------------------------------------------------------ targets


def _met(value, ok) -> str:
    return "no data" if value is None else ("met" if ok(value) else "**not met**")


def targets(results: dict, summary: dict) -> list[dict]:
    """The issue's targets, each {target, value, threshold, status}."""
    rows = []

    def add(target, value, threshold, ok, fmt="{:.2f}"):
        rows.append({"target": target, "value": None if value is None else fmt.format(value),
                     "threshold": threshold, "status": _met(value, ok)})

    for batch in (1, 8):
        s = summary[f"decode_speedup_vs_cudnn_bf16_128k_b{batch}"] or {}
        for backend in ("jax", "torch"):
            add(f"decode speedup vs cuDNN BF16, 128K, b{batch}, {backend}", s.get(backend),
                f"≥ {TARGET_SPEEDUP:g}×", lambda v: v >= TARGET_SPEEDUP, "{:.2f}×")
    fraction = summary["decode_fraction_of_copy_bandwidth_128k"] or {}
    for backend in ("jax", "torch"):
        add(f"decode achieved / copy bandwidth, 128K, {backend}", fraction.get(backend),
            f"≥ {TARGET_FRACTION:.0%}", lambda v: v >= TARGET_FRACTION, "{:.1%}")
    for batch in (1, 8):
        s = summary[f"decode_speedup_vs_cudnn_bf16_128k_b{batch}"] or {}
        gap = None
        if s.get("jax") and s.get("torch"):
            gap = max(s["jax"], s["torch"]) / min(s["jax"], s["torch"]) - 1
        add(f"Pallas vs Triton time gap, 128K, b{batch}", gap, f"≤ {TARGET_BACKEND_GAP:.0%}",
            lambda v: v <= TARGET_BACKEND_GAP, "{:.1%}")
    write = results.get("write")
    for backend in ("pallas", "triton"):
        worst = None
        if write is not None:
            copy = write["copy_bandwidth"]["gb_per_s"]
            fractions = [e[backend]["gb_per_s"] / copy for _, e in write_rows(write)]
            worst = min(fractions) if fractions else None
        add(f"write path (worst case) / copy bandwidth, {backend}", worst, f"≥ {TARGET_WRITE_FRACTION:.0%}",
            lambda v: v >= TARGET_WRITE_FRACTION, "{:.1%}")
    e2e = summary["e2e_decode_step_over_bandwidth_floor"] or {}
    for cache in ("int2", "bf16"):
        add(f"e2e decode step / bandwidth floor, 100K, {cache} cache", e2e.get(cache),
            f"≤ {TARGET_E2E_OVER_FLOOR:g}×", lambda v: v <= TARGET_E2E_OVER_FLOOR, "{:.2f}×")
    conc = (summary["concurrent_100k_sequences_int2_over_bf16"] or {}).get("jax")
    add("concurrent 100K sequences, INT2 / BF16", conc, f"≥ {TARGET_CONCURRENCY:g}×",
        lambda v: v >= TARGET_CONCURRENCY, "{:.2f}×")
    thr = (summary["throughput_at_capacity_100k_int2_over_bf16"] or {}).get("jax")
    rows.append({"target": "throughput at capacity, 100K, INT2 / BF16",
                 "value": None if thr is None else f"{thr:.2f}×", "threshold": "(reported)",
                 "status": "no data" if thr is None else "—"})
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


def make_plots(results: dict, out_dir: Path, warnings: list[str]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _warn(warnings, "matplotlib is not installed: no plots")
        return []
    written = []
    decode, e2e = results.get("decode"), results.get("e2e")
    if decode is not None and decode["configs"]:
        batches = sorted({c["batch"] for c in decode["configs"]})
        copy = decode["copy_bandwidth"]["gb_per_s"]
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
                if kind == "bw":
                    ax.axhline(copy, color="black", linestyle="--", label=f"copy bandwidth {copy:.0f} GB/s")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("context (tokens)")
                ax.set_ylabel(ylabel)
                ax.set_title(f"batch {batch}" + (" (× = Pallas tunings)" if kind == "time" else ""))
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
            fig.tight_layout()
            path = out_dir / fname
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    if e2e is not None and e2e["runs"]:
        runs = [r for r in e2e["runs"] if r.get("floor_s")]
        if runs:
            fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(runs)), 4))
            xs = range(len(runs))
            ax.bar([x - 0.2 for x in xs], [r["median_s"] * 1e3 for r in runs], 0.4, label="decode step")
            ax.bar([x + 0.2 for x in xs], [r["floor_s"] * 1e3 for r in runs], 0.4, label="bandwidth floor")
            ax.set_xticks(list(xs), [f"{r['cache']}\n{r['context'] // 1000}K b{r['batch']}" for r in runs])
            ax.set_ylabel("ms per decode step")
            ax.set_title("end-to-end decode step vs (weights + KV) / copy bandwidth")
            ax.legend()
            fig.tight_layout()
            path = out_dir / "e2e_step_vs_floor.png"
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


# ------------------------------------------------------------------------------ markdown


def _f(value, fmt="{:.1f}", none="—"):
    return none if value is None else fmt.format(value)


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
                    command: str) -> str:
    decode, write, e2e = results.get("decode"), results.get("write"), results.get("e2e")
    lines = ["# OSCAR-JAX benchmarks (H200)", "",
             f"Generated by `{command}` from the raw files in `benchmarks/results/` (written by "
             "`python3 -m benchmarks.bench_h200`, and the capacity search by `XLA_PYTHON_CLIENT_PREALLOCATE=true "
             "python3 -m benchmarks.bench_h200 --sections e2e --capacity-only`; the commands are in its docstring). "
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
                 _f(present[s]["copy_bandwidth"]["gb_per_s"], "{:.0f}")] for s, e in envs.items()]
        lines += _table(["file", "git sha", "date (UTC)", "copy GB/s torch", "copy GB/s JAX", "copy GB/s used"], rows)
        lines += ["Copy bandwidth = (bytes read + bytes written) / time of a device-to-device copy; the larger of "
                  "the torch and JAX measurements is the reference (`copy GB/s used`).", ""]
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
    lines += ["## Targets (issue 7)", ""]
    lines += _table(["target", "measured", "threshold", "status"],
                    [[t["target"], t["value"] or "—", t["threshold"], t["status"]] for t in targets(results, summary)])
    batch = (provenance.get("decode_fraction_of_copy_bandwidth_128k") or {}).get("batch")
    lines += ["The JAX (torch) figures use the fastest passing Pallas (Triton) INT2 variant: the default tiling or one "
              "of the tilings swept at 128K; which one is in `summary_h200_provenance.json`. The fraction of copy bandwidth is taken at "
              f"128K with batch 8 when measured, else batch 1 (this run: {'batch ' + str(batch) if batch else 'no data'}). "
              "The Pallas/Triton gap is the slower median over the faster, minus one.", ""]

    # ---- decode
    if decode is not None:
        lines += ["## Decode attention", "",
                  "Median time per call; GB/s = bytes the variant must read / time; × copy = that over the copy "
                  "bandwidth (measured in the config's own run where it was recorded, else the file's); speedups are the cuDNN BF16 (or FlashAttention-2 BF16) median over this variant's. "
                  "A variant that failed its accuracy check is not timed. `git`: the code each (context, batch) "
                  "was measured at (`bench_h200 --merge` keeps configs of earlier runs).", ""]
        rows = []
        for c in sorted(decode["configs"], key=lambda c: (c["context"], c["batch"])):
            cudnn, fa2, copy = timed_variant(c, CUDNN), timed_variant(c, FA2), _config_copy(decode, c)
            for name, v in c["variants"].items():
                if "error" in v:
                    rows.append([c["context"], c["batch"], f"`{name}`", "error", "", "", "", "", "",
                                 v["error"][:80].replace("|", "/"), _short_sha(c)])
                    continue
                timed = timed_variant(c, name)
                t = timed["median_s"] if timed else None
                rows.append([c["context"], c["batch"], f"`{name}`", _f(t and t * 1e6),
                             _f(timed and timed["gb_per_s"], "{:.0f}"), _f(timed and timed["gb_per_s"] / copy, "{:.2f}"),
                             _f(_ratio(cudnn and cudnn["median_s"], t), "{:.2f}"),
                             _f(_ratio(fa2 and fa2["median_s"], t), "{:.2f}"),
                             _f(v.get("rel_error"), "{:.1e}"), "passed" if v.get("passed") else "**failed**",
                             _short_sha(c)])
        lines += _table(["context", "batch", "variant", "µs", "GB/s", "× copy", "vs cuDNN", "vs FA2", "rel. error",
                         "check", "git"], rows)

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
        lines += ["## End-to-end decode (JAX)", "",
                  "Floor = (weight bytes read + KV bytes read) / copy bandwidth. Checks: logits finite, and two "
                  "steps from the same state bit-identical (not a comparison against a reference model).", ""]
        rows = [[r["cache"], r["context"], r["batch"], _f(r["median_s"] * 1e3, "{:.2f}"),
                 _f(r.get("floor_s") and r["floor_s"] * 1e3, "{:.2f}"), _f(_over_floor(e2e, r), "{:.2f}"),
                 _f(r["weight_bytes_read"] / 1e9, "{:.2f}"), _f(r["kv_bytes_read"] / 1e9, "{:.2f}"),
                 _f(r["batch"] / r["median_s"], "{:.0f}"),
                 "yes" if r.get("logits_finite") and r.get("deterministic") else "**no**"]
                for r in e2e["runs"]]
        lines += _table(["cache", "context", "batch", "step ms", "floor ms", "step / floor", "weights GB",
                         "KV GB", "tokens/s", "finite + deterministic"], rows)
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
    written = make_plots(results, results_dir, warnings) if plots else []
    (results_dir / "summary_h200.json").write_text(json.dumps(summary, indent=1) + "\n")
    (results_dir / "summary_h200_provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    if markdown_path is not None:
        markdown_path = Path(markdown_path)
        markdown_path.write_text(render_markdown(results, summary, provenance, written,
                                                 markdown_path.resolve().parent, command))
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"), help="directory of the raw files")
    parser.add_argument("--markdown", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md",
                        help="where to write BENCHMARKS.md (default: the repo root)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.results, args.markdown, plots=not args.no_plots)
    except ResultsError as err:
        sys.exit(f"error: {err}")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.results / 'summary_h200.json'} and {args.markdown}", flush=True)


if __name__ == "__main__":
    main()
