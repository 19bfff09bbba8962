"""Does a re-run reproduce a committed set of results? Compare two results directories figure by figure.

    python3 -m benchmarks.compare_runs benchmarks/results /path/to/rerun --tolerance 0.05 \\
        --json rerun_vs_committed.json

Both directories hold the raw files of `benchmarks.bench_h200` (`{decode,write,e2e,copy}_h200.json`).
Compared, where both runs have them:
  - every summary figure (computed from each directory's raw files by `benchmarks.summarize`);
  - decode, every (context, batch): the default launch of each backend, the fastest BF16 variant (named
    on both sides, so a change of which baseline is fastest shows), and each BF16 variant, by median time;
  - write: each write-path case, Pallas and Triton, by median time;
  - end to end: each step's median, and the capacity (sequences built, step at capacity).

A row is `outside` when |new / base − 1| exceeds the tolerance. The tolerance is the caller's
statement of run-to-run noise (re-runs on the H200 have put most figures within a few percent and
the batch-1 Pallas call within ±15 %); this tool only counts, it does not decide.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import summarize as S

def _row(group: str, label: str, base, new, *, unit: str, base_sha=None, new_sha=None) -> dict:
    change = None if base in (None, 0) or new is None else new / base - 1.0
    return {"group": group, "label": label, "unit": unit, "base": base, "new": new, "change": change,
            "base_sha": base_sha, "new_sha": new_sha}


def _sha(config_or_data) -> str | None:
    sha = (config_or_data or {}).get("git_sha") or (config_or_data or {}).get("environment", {}).get("git_sha")
    return None if sha is None else str(sha)[:10]


def _flatten(value, prefix: str) -> dict:
    """{"key.sub.sub": number or None} of a summary value (nested dicts of figures)."""
    if isinstance(value, dict):
        return {k: v for sub, item in value.items() for k, v in _flatten(item, f"{prefix}.{sub}").items()}
    return {prefix: value}


def _summary_rows(base: dict, new: dict) -> list[dict]:
    base_summary, _ = S.summarize_results(base, [])
    new_summary, _ = S.summarize_results(new, [])
    rows = []
    for key in S.SUMMARY_KEYS:
        old_figures, new_figures = _flatten(base_summary.get(key), key), _flatten(new_summary.get(key), key)
        for label in sorted(set(old_figures) | set(new_figures)):
            rows.append(_row("summary", label, old_figures.get(label), new_figures.get(label), unit="×"))
    return rows


def _decode_rows(base, new) -> list[dict]:
    if base is None or new is None:
        return []
    rows = []
    new_configs = {(c["context"], c["batch"]): c for c in new["configs"]}
    for old in base["configs"]:
        cur = new_configs.get((old["context"], old["batch"]))
        if cur is None:
            continue
        where = f"ctx {old['context']} b{old['batch']}"
        shas = dict(base_sha=_sha(old) or _sha(base), new_sha=_sha(cur) or _sha(new))
        (old_name, old_v), (new_name, new_v) = S.best_bf16(old), S.best_bf16(cur)
        names = old_name if old_name == new_name else f"{old_name} → {new_name}"
        rows.append(_row("decode", f"{where} fastest BF16 ({names})", old_v and old_v["median_s"] * 1e6,
                         new_v and new_v["median_s"] * 1e6, unit="µs", **shas))
        for name in tuple(S.DEFAULTS.values()) + S.BF16_VARIANTS:
            old_v, new_v = S.timed_variant(old, name), S.timed_variant(cur, name)
            if old_v or new_v:
                rows.append(_row("decode", f"{where} {name}", old_v and old_v["median_s"] * 1e6,
                                 new_v and new_v["median_s"] * 1e6, unit="µs", **shas))
    return rows


def _write_rows(base, new) -> list[dict]:
    if base is None or new is None:
        return []
    new_rows = dict(S.write_rows(new))
    rows = []
    for label, old in S.write_rows(base):
        cur = new_rows.get(label)
        if cur is None:
            continue
        for backend in ("pallas", "triton"):
            rows.append(_row("write", f"{label}, {backend}", old[backend]["median_s"] * 1e6,
                             cur[backend]["median_s"] * 1e6, unit="µs", base_sha=_sha(base), new_sha=_sha(new)))
    return rows


def _e2e_rows(base, new) -> list[dict]:
    if base is None or new is None:
        return []
    shas = dict(base_sha=_sha(base), new_sha=_sha(new))
    rows = []
    for old in base["runs"]:
        cur = S.e2e_run(new, old["cache"], old["context"], old["batch"])
        if cur is not None:
            rows.append(_row("e2e", f"{old['cache']} step, ctx {old['context']} b{old['batch']}",
                             old["median_s"] * 1e3, cur["median_s"] * 1e3, unit="ms", **shas))
    old_cap, new_cap = base.get("capacity") or {}, new.get("capacity") or {}
    for cache in ("int2", "bf16"):
        old_c, new_c = old_cap.get(cache) or {}, new_cap.get(cache) or {}
        if old_c and new_c:
            rows.append(_row("e2e", f"{cache} sequences of 100K built", old_c.get("built_batch"),
                             new_c.get("built_batch"), unit="sequences", **shas))
            old_step, new_step = (old_c.get("step") or {}).get("median_s"), (new_c.get("step") or {}).get("median_s")
            rows.append(_row("e2e", f"{cache} step at capacity", old_step and old_step * 1e3,
                             new_step and new_step * 1e3, unit="ms", **shas))
    return rows


def compare(base_dir, new_dir, tolerance: float) -> dict:
    """{"tolerance", "rows": [...], "outside": [labels]} comparing the raw files of two directories."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in (0, 1), got {tolerance!r}")
    base, new = S.load_results(Path(base_dir), []), S.load_results(Path(new_dir), [])
    rows = (_summary_rows(base, new) + _decode_rows(base["decode"], new["decode"])
            + _write_rows(base["write"], new["write"]) + _e2e_rows(base["e2e"], new["e2e"]))
    for row in rows:
        row["outside"] = row["change"] is not None and abs(row["change"]) > tolerance
    return {"base": str(base_dir), "new": str(new_dir), "tolerance": tolerance, "rows": rows,
            "outside": [r["label"] for r in rows if r["outside"]],
            "missing": [r["label"] for r in rows if r["change"] is None]}


def render(report: dict) -> str:
    def fmt(x):
        return "—" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))

    lines = [f"base: {report['base']}   new: {report['new']}   tolerance ±{report['tolerance']:.0%}", "",
             "| group | figure | base | new | unit | change | base sha | new sha |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        change = "—" if r["change"] is None else f"{r['change']:+.1%}" + (" **outside**" if r["outside"] else "")
        lines.append(f"| {r['group']} | {r['label']} | {fmt(r['base'])} | {fmt(r['new'])} | {r['unit']} | {change} "
                     f"| {r['base_sha'] or '—'} | {r['new_sha'] or '—'} |")
    lines += ["", f"{len(report['rows'])} figures compared, {len(report['outside'])} outside ±{report['tolerance']:.0%}, "
                  f"{len(report['missing'])} missing on one side"]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="results directory compared against (e.g. benchmarks/results)")
    parser.add_argument("new", type=Path, help="results directory of the re-run")
    parser.add_argument("--tolerance", type=float, default=0.05, help="run-to-run noise, as a fraction (default 0.05)")
    parser.add_argument("--json", type=Path, default=None, help="also write the comparison as JSON here")
    args = parser.parse_args(argv)
    try:
        report = compare(args.base, args.new, args.tolerance)
    except (S.ResultsError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(render(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
