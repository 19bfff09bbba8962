"""The calibration report: report.json (all numbers), report.md (summary) and two plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _plots(out: Path, report: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (name, eig) in zip(axes, report["eigenvalues"].items()):
        eig = np.asarray(eig)  # [L, Hkv, D] ascending
        cmap = plt.get_cmap("viridis")
        for layer in range(eig.shape[0]):
            spectrum = eig[layer].mean(axis=0)[::-1]
            ax.semilogy(np.maximum(spectrum / spectrum.sum(), 1e-12), color=cmap(layer / max(1, eig.shape[0] - 1)), lw=0.8)
        ax.set_title(f"{name} rotation target: eigenvalue spectra (colour = layer)")
        ax.set_xlabel("eigenvalue rank")
        ax.set_ylabel("share of the trace")
    fig.tight_layout()
    fig.savefig(out / "eigenvalue_spectra.png", dpi=110)
    plt.close(fig)
    files.append("eigenvalue_spectra.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in zip(axes, ("key_logit", "value_output"), ("key: logit error", "value: output error")):
        kinds = list(report["heldout_errors"])
        width = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            values = report["heldout_errors"][kind][metric]
            ax.bar(np.arange(len(values)) + i * width, values, width, label=kind)
        ax.set_yscale("log")
        ax.set_title(f"held-out relative {title} per layer")
        ax.set_xlabel("layer")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "layer_errors.png", dpi=110)
    plt.close(fig)
    files.append("layer_errors.png")
    return files


def write_report(out: Path, report: dict, provenance: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"provenance": provenance, **report}, indent=1))
    plots = _plots(out, report)
    lines = [
        "# OSCAR calibration report",
        "",
        f"Command: `{provenance['command']}`  ",
        f"Data: {provenance['data']}, {provenance['calibration_tokens']} calibration tokens, "
        f"{provenance['heldout_tokens']} held-out tokens; git {provenance['git_sha'][:12]}; {report['seconds']} s.",
        "",
        "Mean held-out relative error over layers (lower is better):",
        "",
        "| rotation | key logit error | value output error |",
        "|---|---|---|",
    ]
    for kind, errs in report["heldout_errors"].items():
        lines.append(f"| {kind} | {np.mean(errs['key_logit']):.4f} | {np.mean(errs['value_output']):.4f} |")
    lines += ["", f"Clip ratios K: {sorted(set(report['k_clip_ratio']))}, V: {sorted(set(report['v_clip_ratio']))}", ""]
    lines += [f"![{p}]({p})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")
