"""Ablations of OSCAR's choices, decode-faithfully evaluated, by one command.

    python -m calibration.ablations --model smollm2-135m --data wiki --context 2048 --num-windows 4 \\
        --cache-dir .cache/oscar_ablations --json ablations.json [--plot ablations.png] [--only rotation,windows]

Every variant changes one thing against the paper configuration ("base": calibration on
`--calib-tokens` wiki calibration-split tokens, R = U·H·P from C_Q (keys) and C_S = second moment
of the attention outputs (values), one rotation per (layer, KV head), G = min(D, 128), fixed clip
ratios 0.96 / 0.92, min/max levels, windows 64/256):

  rotation            identity · hadamard · eigen (U) · eigen_hadamard (U·H) · oscar (U·H·P),
                      and oscar with U from KᵀK / VᵀV instead of C_Q / C_S
  value_objective     C_S by the paper's definition · the authors' diagonal surrogate
  granularity         per (layer, KV head) · per layer
  group_size          min(D, 128) (the default; 64 on SmolLM2) · 32 / 64
  clip                fixed 0.96/0.92 · fitted per layer on held-out tokens · none (1/1)
  levels              min/max · moments (clip 0.96/0.92) · moments without clip
  windows             0/0 · 16/64 · 64/256 · 128/512 (sink/recent, page 16)
  calibration_tokens  2K · 8K · 32K

Artifacts come from `calibration.calibrate.calibrate(CalibrationOptions(...))` and are cached in
`--cache-dir/<hash of the options>/` (reused when present); identical (artifact, method)
variants are evaluated once. All variants share one BF16 reference pass per window. Evaluation
text is the wiki *evaluation* split (or `--text-file`), disjoint from calibration documents.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

from calibration.calibrate import CalibrationOptions, calibrate, recorded_options
from calibration.evaluate import (
    check_no_calibration_overlap,
    environment,
    evaluate_methods,
    load_text_tokens,
    make_windows,
)
from calibration.methods import parse_method
from shared_math.spec import DEFAULT_RECENT, DEFAULT_SINK, default_group_size


@dataclasses.dataclass(frozen=True)
class Variant:
    group: str
    label: str
    calibration: dict[str, Any]  # overrides of the base CalibrationOptions
    method: str = "oscar"  # method spec evaluated with that artifact


def variants(base_tokens: int, head_dim: int) -> list[Variant]:
    """Every ablation variant; the base configuration recurs under one label per group."""
    small, large = max(1, base_tokens // 4), base_tokens * 4
    default_g = default_group_size(head_dim)
    other_g = [g for g in (32, 64) if g != default_g and 16 <= g <= head_dim]

    def tokens_label(n):
        return f"{n // 1024}K" if n % 1024 == 0 else str(n)

    def window_method(s, w):
        return "oscar" if (s, w) == (DEFAULT_SINK, DEFAULT_RECENT) else f"oscar:windows={s}/{w}"

    return [
        *(Variant("rotation", kind, {"rotation_kind": kind})
          for kind in ("identity", "hadamard", "eigen", "eigen_hadamard")),
        Variant("rotation", "oscar", {}),
        Variant("rotation", "oscar, U from KᵀK / VᵀV", {"key_target": "key", "value_target": "value"}),
        Variant("value_objective", "C_S (paper)", {}),
        Variant("value_objective", "surrogate (authors' code)", {"value_target": "surrogate"}),
        Variant("granularity", "per (layer, KV head)", {}),
        Variant("granularity", "per layer", {"per_layer": True}),
        Variant("group_size", f"G={default_g} (default)", {}),
        *(Variant("group_size", f"G={g}", {"group_size": g}) for g in other_g),
        Variant("clip", "fixed 0.96/0.92", {}),
        Variant("clip", "fitted per layer", {"fit_clip": True}),
        Variant("clip", "none (1/1)", {}, "oscar:clip=1/1"),
        Variant("levels", "minmax", {}),
        Variant("levels", "moments, clip 0.96/0.92", {"levels": "moments"}),
        Variant("levels", "moments, no clip", {"levels": "moments"}, "oscar:clip=1/1"),
        *(Variant("windows", f"{s}/{w}", {}, window_method(s, w)) for s, w in ((0, 0), (16, 64), (64, 256), (128, 512))),
        *(Variant("calibration_tokens", tokens_label(n), {} if n == base_tokens else {"calib_tokens": n})
          for n in (small, base_tokens, large)),
    ]


GROUPS = tuple(dict.fromkeys(v.group for v in variants(8192, 64)))


def _options_key(opts: CalibrationOptions) -> str:
    fields = {k: v for k, v in recorded_options(opts).items() if k not in ("output_dir", "progress")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def artifact_for(base: CalibrationOptions, overrides: dict[str, Any], cache_dir: Path,
                 calibrate_fn: Callable = calibrate):
    """(artifact, directory): from the cache when an artifact with these exact options exists."""
    from shared_math.artifact import ArtifactError, read_artifact

    opts = dataclasses.replace(base, **overrides)
    key = _options_key(opts)
    out = cache_dir / key
    wanted = {k: v for k, v in recorded_options(opts).items() if k not in ("output_dir", "progress")}
    try:
        art = read_artifact(out)
        stored = {k: v for k, v in art.provenance.get("options", {}).items() if k not in ("output_dir", "progress")}
        if stored == wanted:
            return art, out
    except ArtifactError:
        pass
    art, _ = calibrate_fn(dataclasses.replace(opts, output_dir=str(out)),
                          command=f"calibration.ablations (cache key {key})")
    return art, out


def run_ablations(
    params,
    cfg,
    windows,
    *,
    base: CalibrationOptions,
    cache_dir: str | Path,
    groups: list[str] | None = None,
    progress: bool = True,
    calibrate_fn: Callable = calibrate,
    query_chunk: int | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """{group: {label: metrics + {"method", "calibration", "artifact"}}} for the selected groups."""
    cache_dir = Path(cache_dir)
    chosen = [v for v in variants(base.calib_tokens, cfg.head_dim) if groups is None or v.group in groups]
    if not chosen:
        raise ValueError(f"no ablation group selected from {list(GROUPS)}")
    methods, name_of = {}, []
    for v in chosen:
        art, directory = artifact_for(base, v.calibration, cache_dir, calibrate_fn)
        key = (str(directory), v.method)
        if key not in methods:
            m = parse_method(v.method, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, artifact=art)
            methods[key] = dataclasses.replace(m, name=f"{Path(directory).name}:{v.method}")
        name_of.append((methods[key].name, str(directory)))
    kwargs = {} if query_chunk is None else {"query_chunk": query_chunk}
    results = evaluate_methods(params, cfg, windows, list(methods.values()), progress=progress, **kwargs)
    table: dict[str, dict[str, Any]] = {}
    for v, (name, directory) in zip(chosen, name_of):
        table.setdefault(v.group, {})[v.label] = {
            **results[name], "method": v.method, "calibration": v.calibration, "artifact": directory}
    return table


def plot(table, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(3.2 * len(table), 4.2), squeeze=False)
    for ax, (group, rows) in zip(axes[0], table.items()):
        labels = list(rows)
        ax.bar(range(len(labels)), [max(rows[k]["kl_vs_bf16"], 1e-6) for k in labels], color="tab:purple")
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(group, fontsize=9)
    axes[0][0].set_ylabel("mean KL(BF16 ‖ OSCAR variant)")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def format_table(table) -> str:
    lines = []
    for group, rows in table.items():
        lines.append(f"\n[{group}]")
        lines.append(f"  {'variant':<30} {'ppl':>9} {'ppl/bf16':>9} {'KL':>9} {'top-1':>7} {'bits':>6}")
        for label, r in rows.items():
            lines.append(f"  {label:<30} {r['perplexity']:9.3f} {r['perplexity_vs_bf16']:9.4f} "
                         f"{r['kl_vs_bf16']:9.5f} {r['top1_agreement']:7.4f} {r['bits_per_element']:6.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m calibration.ablations", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", choices=["wiki"])
    src.add_argument("--text-file")
    p.add_argument("--calib-data", default="wiki", help="calibration text (default: wiki calibration split)")
    p.add_argument("--calib-tokens", type=int, default=8192, help="the base calibration size")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--num-windows", type=int, default=4)
    p.add_argument("--cache-dir", default=".cache/oscar_ablations")
    p.add_argument("--only", help=f"comma-separated groups of {list(GROUPS)}")
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    groups = None
    if args.only:
        groups = [g.strip() for g in args.only.split(",") if g.strip()]
        unknown = sorted(set(groups) - set(GROUPS))
        if unknown:
            p.error(f"unknown ablation groups {unknown}; known: {list(GROUPS)}")
    if args.context < 2 or args.num_windows < 1 or args.calib_tokens < 4:
        p.error("--context must be ≥ 2, --num-windows ≥ 1, --calib-tokens ≥ 4")
    command = "python -m calibration.ablations " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        from oscar_jax.loaders import load_model
        from oscar_jax.tokenizer import load_tokenizer

        t0 = time.time()
        env = environment()  # at the start: the code that runs, not the checkout at the end
        cfg, params = load_model(args.model)
        source = args.text_file or args.data
        if source != "wiki" and Path(source).resolve() == Path(args.calib_data).resolve():
            raise ValueError(f"{source} is also the calibration text: evaluation would overlap calibration")
        tokens = load_text_tokens(source, load_tokenizer(args.model), args.context * args.num_windows)
        windows = make_windows(tokens, args.context, args.num_windows)
        base = CalibrationOptions(model_path=args.model, calib_data=args.calib_data, calib_tokens=args.calib_tokens,
                                  progress=not args.no_progress)
        table = run_ablations(params, cfg, windows, base=base, cache_dir=args.cache_dir, groups=groups,
                              progress=not args.no_progress)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {
        "ablations": table,
        "config": {"command": command, "model": args.model, "data": source,
                   "split": check_no_calibration_overlap(source, None), "calibration_data": args.calib_data,
                   "base_calibration": dataclasses.asdict(base), "context": args.context,
                   "num_windows": args.num_windows, "seconds": round(time.time() - t0, 1)},
        "environment": env,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(table, args.plot)
    print(format_table(table))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
