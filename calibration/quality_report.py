"""The quality report: calibration/REPORT.md generated from the committed evaluation results.

    python -m calibration.quality_report [--results calibration/results] [--out calibration/REPORT.md]

One section per `eval_*.json` written by `python -m calibration.evaluate` (sorted by name): the
command that produced it, its git sha, date, wall time and artifact, a table of every method
(perplexity, × BF16, KL(BF16 ‖ method), top-1 agreement, stored bits per element at 2K and 128K),
the per-window ratios, and the plot next to it. Then one section per `ablations_*.json`
(`python -m calibration.ablations`: a table per group of variants) and per `passkey_*.json`
(`python -m calibration.passkey`: accuracy per method, by length and by depth). Every number is
read from the files; nothing is typed by hand (QUALITY.md holds the interpretation and quotes
these tables).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
METRICS = ("perplexity", "kl_vs_bf16", "top1_agreement", "bits_per_element")


class ResultFileError(ValueError):
    """An evaluation result file that does not have the shape `calibration.evaluate` writes."""


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ResultFileError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ResultFileError(f"{path}: not a readable JSON file ({err})") from err


def _object(value, where: str) -> dict:
    if not isinstance(value, dict) or not value:
        raise ResultFileError(f"{where} must be a non-empty object")
    return value


def _entries(path: Path, key: str) -> tuple[dict, dict]:
    """(the file's top-level object, its non-empty object `key`); ResultFileError names the file."""
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ResultFileError(f"{path}: expected an object")
    return data, _object(data.get(key), f"{path}: {key!r}")


def load_result(path: Path) -> dict:
    """Read and validate one evaluation result (JSON only: no pickle, no code)."""
    data, methods = _entries(path, "methods")
    if "bf16" not in methods:
        raise ResultFileError(f"{path}: the methods hold no 'bf16' reference to compare against")
    for name, entry in methods.items():
        if not isinstance(entry, dict):
            raise ResultFileError(f"{path}: methods[{name!r}] must be an object")
        for metric in METRICS:
            _number(entry.get(metric), f"{path}: methods[{name!r}].{metric}")
        windows = entry.get("per_window", [])
        if not isinstance(windows, list) or not all(isinstance(w, dict) for w in windows):
            raise ResultFileError(f"{path}: methods[{name!r}].per_window must be a list of objects")
        for i, window in enumerate(windows):
            _number(window.get("perplexity"), f"{path}: methods[{name!r}].per_window[{i}].perplexity")
    for key in ("config", "environment"):
        if not isinstance(data.get(key, {}), dict):
            raise ResultFileError(f"{path}: '{key}' must be an object")
    return data


def load_ablations(path: Path) -> dict:
    """Read and validate one `calibration.ablations` result: {group: {variant: metrics}}."""
    data, groups = _entries(path, "ablations")
    for group, rows in groups.items():
        for label, row in _object(rows, f"{path}: ablations[{group!r}]").items():
            where = f"{path}: ablations[{group!r}][{label!r}]"
            _object(row, where)
            for metric in METRICS + ("perplexity_vs_bf16",):
                _number(row.get(metric), f"{where}.{metric}")
    return data


def load_passkey(path: Path) -> dict:
    """Read and validate one `calibration.passkey` result: accuracy per method, length and depth."""
    data, methods = _entries(path, "methods")
    for name, entry in methods.items():
        where = f"{path}: methods[{name!r}]"
        _object(entry, where)
        _number(entry.get("accuracy"), f"{where}.accuracy")
        for key in ("by_length", "by_depth"):
            for k, v in _object(entry.get(key), f"{where}.{key}").items():
                _number(v, f"{where}.{key}[{k!r}]")
    samples = data.get("samples", [])
    if not isinstance(samples, list):
        raise ResultFileError(f"{path}: 'samples' must be a list")
    for i, sample in enumerate(samples):
        per_method = sample.get("methods") if isinstance(sample, dict) else None
        if not isinstance(per_method, dict) or set(per_method) != set(methods):
            raise ResultFileError(f"{path}: samples[{i}].methods must hold exactly the methods {sorted(methods)}")
        for name, r in per_method.items():
            if not isinstance(r, dict) or not isinstance(r.get("correct"), bool):
                raise ResultFileError(f"{path}: samples[{i}].methods[{name!r}].correct must be a bool")
    return data


def _f(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def section(path: Path, data: dict, md_dir: Path) -> list[str]:
    config, env, methods = data.get("config", {}), data.get("environment", {}), data["methods"]
    bf16 = methods["bf16"]
    artifact = config.get("artifact") or {}
    lines = [f"## {path.stem}", "",
             f"`{path.name}` — {config.get('num_windows', '?')} windows × {config.get('context', '?')} tokens "
             f"({config.get('tokens_evaluated', '?')} scored), git `{str(env.get('git_sha', '?'))[:12]}`, "
             f"{env.get('date_utc', '?')}, {_f(config.get('seconds'), '.1f')} s.", ""]
    if config.get("command"):
        lines += ["```", config["command"], "```", ""]
    if artifact:
        path_text = str(artifact.get("path", "?"))
        shipped = path_text.find("oscar_jax/artifacts/")  # absolute paths of the machine that ran it
        lines += [f"Artifact: `{path_text[shipped:] if shipped >= 0 else path_text}` (codec {artifact.get('codec')}).", ""]
    local = config.get("local_layers")
    if isinstance(local, dict):  # a model with sliding-window layers (calibration.evaluate's docstring)
        lines += [f"Layers {local.get('layers')} are sliding-window layers: a BF16 window of {local.get('window')} "
                  "tokens for every method; each method applies to the other (global) layers, and its bits "
                  "count those; the last column adds the windows, over all layers at 128K.", ""]
    all_layers = any("bits_per_element_all_layers_128k" in m for m in methods.values())
    lines += ["| method | perplexity | ×BF16 | KL(BF16‖method) | top-1 | bits/elem @2K | bits/elem @128K |"
              + (" all layers @128K |" if all_layers else ""),
              "|---|---|---|---|---|---|---|" + ("---|" if all_layers else "")]
    for name, m in methods.items():
        lines.append(f"| {name} | {m['perplexity']:.3f} | {m['perplexity'] / bf16['perplexity']:.4f} | "
                     f"{m['kl_vs_bf16']:.4f} | {m['top1_agreement']:.4f} | {m['bits_per_element']:.3f} | "
                     f"{_f(m.get('bits_per_element_128k'), '.3f')} |"
                     + (f" {_f(m.get('bits_per_element_all_layers_128k'), '.3f')} |" if all_layers else ""))
    reference = [w["perplexity"] for w in bf16.get("per_window", [])]
    if reference:
        lines += ["", "Per window, perplexity × BF16 of that window:", "",
                  "| method | " + " | ".join(f"w{i + 1}" for i in range(len(reference))) + " |",
                  "|---|" + "---|" * len(reference)]
        for name, m in methods.items():
            ratios = [w["perplexity"] / r for w, r in zip(m.get("per_window", []), reference)]
            lines.append(f"| {name} | " + " | ".join(f"{x:.4f}" for x in ratios) + " |")
        oscar = methods.get("oscar", {}).get("per_window", [])
        rows = [(name, paired(oscar, m.get("per_window", []))) for name, m in methods.items()
                if name not in ("bf16", "oscar") and len(m.get("per_window", [])) == len(oscar) > 1]
        if rows:
            lines += ["", "OSCAR against each method, window by window (the same windows; a mean log-ratio within "
                      "two standard errors of 0 is not resolved):", "",
                      "| method | OSCAR ppl lower in | mean log(ppl OSCAR / ppl method) ± s.e. | OSCAR KL lower in |",
                      "|---|---|---|---|"]
            for name, p in rows:
                lines.append(f"| {name} | {p['ppl_lower']}/{p['windows']} | {p['mean_log_ratio']:+.4f} ± "
                             f"{p['standard_error']:.4f} | {_f(p['kl_lower'], 'd')}/{p['windows']} |")
    plot = path.with_suffix(".png")
    if plot.is_file():
        lines += ["", f"![{path.stem}]({os.path.relpath(plot, md_dir)})"]
    return lines + [""]


def paired(ours: list[dict], theirs: list[dict]) -> dict:
    """Per-window comparison of two methods on the same windows: in how many windows our perplexity
    (and KL, where both record it) is lower, and the mean and standard error of log(ppl ours / ppl
    theirs). Needs ≥ 2 windows."""
    if len(ours) != len(theirs) or len(ours) < 2:
        raise ValueError(f"paired needs the same ≥ 2 windows, got {len(ours)} and {len(theirs)}")
    logs = [math.log(a["perplexity"] / b["perplexity"]) for a, b in zip(ours, theirs)]
    mean = sum(logs) / len(logs)
    var = sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)
    with_kl = all("kl_vs_bf16" in w for w in ours + theirs)
    return {"windows": len(logs), "ppl_lower": sum(x < 0 for x in logs), "mean_log_ratio": mean,
            "standard_error": math.sqrt(var / len(logs)),
            "kl_lower": sum(a["kl_vs_bf16"] < b["kl_vs_bf16"] for a, b in zip(ours, theirs)) if with_kl else None}


def _provenance(path: Path, data: dict, md_dir: Path) -> list[str]:
    config, env = data.get("config", {}), data.get("environment", {})
    lines = [f"## {path.stem}", "",
             f"`{path.name}` — git `{str(env.get('git_sha', '?'))[:12]}`, {env.get('date_utc', '?')}, "
             f"{_f(config.get('seconds'), '.1f')} s.", ""]
    if config.get("command"):
        lines += ["```", config["command"], "```", ""]
    return lines


def _plot_line(path: Path, md_dir: Path) -> list[str]:
    plot = path.with_suffix(".png")
    return ["", f"![{path.stem}]({os.path.relpath(plot, md_dir)})"] if plot.is_file() else []


def ablations_section(path: Path, data: dict, md_dir: Path) -> list[str]:
    config = data.get("config", {})
    lines = _provenance(path, data, md_dir)
    lines += [f"{config.get('num_windows', '?')} windows × {config.get('context', '?')} tokens; every variant "
              "changes one thing against the paper configuration (module docstring of `calibration.ablations`).", ""]
    for group, rows in data["ablations"].items():
        lines += [f"**{group}**", "", "| variant | perplexity | ×BF16 | KL(BF16‖variant) | top-1 | bits/elem @2K |",
                  "|---|---|---|---|---|---|"]
        for label, r in rows.items():
            lines.append(f"| {label} | {r['perplexity']:.3f} | {r['perplexity_vs_bf16']:.4f} | {r['kl_vs_bf16']:.4f} | "
                         f"{r['top1_agreement']:.4f} | {r['bits_per_element']:.3f} |")
        lines.append("")
    return lines + _plot_line(path, md_dir) + [""]


def passkey_section(path: Path, data: dict, md_dir: Path) -> list[str]:
    config, methods = data.get("config", {}), data["methods"]
    lines = _provenance(path, data, md_dir)
    lines += [f"Mode {config.get('mode', '?')}, {config.get('samples', '?')} samples per (length, depth); haystack: "
              f"{config.get('haystack', '?')}.", ""]
    lengths = list(next(iter(methods.values()))["by_length"])
    depths = list(next(iter(methods.values()))["by_depth"])
    lines += ["| method | accuracy | " + " | ".join(f"{n} tok" for n in lengths) + " | "
              + " | ".join(f"depth {d}" for d in depths) + " |",
              "|---|---|" + "---|" * (len(lengths) + len(depths))]
    for name, m in methods.items():
        cells = [_f(m["by_length"].get(n), ".3f") for n in lengths] + [_f(m["by_depth"].get(d), ".3f") for d in depths]
        lines.append(f"| {name} | {m['accuracy']:.3f} | " + " | ".join(cells) + " |")
    samples = data.get("samples") or []
    if "oscar" in methods and samples:
        lines += ["", "OSCAR against each method on the same samples (exact two-sided McNemar test on the samples "
                  "exactly one of the two retrieves):", "",
                  "| method | only OSCAR right | only the method right | p |", "|---|---|---|---|"]
        for name in methods:
            if name != "oscar":
                t = mcnemar([s["methods"]["oscar"]["correct"] for s in samples],
                            [s["methods"][name]["correct"] for s in samples])
                lines.append(f"| {name} | {t['only_ours']} | {t['only_theirs']} | {t['p_value']:.3f} |")
    return lines + _plot_line(path, md_dir) + [""]


def mcnemar(ours: list[bool], theirs: list[bool]) -> dict:
    """Exact two-sided McNemar test of two methods on the same samples: under "equally good", the
    samples only one of them gets right split 50/50."""
    if len(ours) != len(theirs):
        raise ValueError(f"mcnemar needs the same samples, got {len(ours)} and {len(theirs)}")
    only_ours = sum(a and not b for a, b in zip(ours, theirs))
    only_theirs = sum(b and not a for a, b in zip(ours, theirs))
    n, k = only_ours + only_theirs, min(only_ours, only_theirs)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"only_ours": only_ours, "only_theirs": only_theirs, "p_value": p}


def render(results: Path, md_dir: Path) -> str:
    """The report's text for a file in `md_dir` (links are relative to it)."""
    files = sorted(Path(results).glob("eval_*.json"))
    if not files:
        raise FileNotFoundError(f"no eval_*.json in {results}: run python -m calibration.evaluate first")
    lines = ["# Quality results (generated)", "",
             f"Generated by `python -m calibration.quality_report` from the result files in "
             f"`{os.path.relpath(results, md_dir)}/`; do not edit by hand. Interpretation: QUALITY.md.", ""]
    for path in files:
        lines += section(path, load_result(path), md_dir)
    for path in sorted(Path(results).glob("ablations_*.json")):
        lines += ablations_section(path, load_ablations(path), md_dir)
    for path in sorted(Path(results).glob("passkey_*.json")):
        lines += passkey_section(path, load_passkey(path), md_dir)
    return "\n".join(lines)


def write_report(results: Path = RESULTS, out: Path | None = None) -> Path:
    results = Path(results)
    out = Path(out) if out is not None else results.parent / "REPORT.md"
    out.write_text(render(results, out.parent), encoding="utf-8")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m calibration.quality_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="directory of eval_*.json files")
    p.add_argument("--out", type=Path, default=None, help="report path (default: <results>/../REPORT.md)")
    args = p.parse_args(argv)
    print(f"wrote {write_report(args.results, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
