"""Why a 2-bit cache loses the passkey: key error and attention on the needle, per rotation.

    python -m calibration.needle_diagnosis --passkey calibration/results/passkey_smollm2_seed2.json \\
        --lengths 4096,8192 --methods quarot-int2,oscar --json calibration/results/needle_diagnosis_smollm2.json \\
        --plot calibration/results/needle_diagnosis_smollm2.png

Rebuilds the samples of a committed passkey run exactly (same seed, same draws; each sample's key
and needle position are checked against the file), prefills each prompt once in float32 (the
passkey tool's `--prefill-chunk 0` path) and takes the BF16 model's queries at the answer steps
(the forced space and the first digits: every query that predicts a digit). Then, per method,
layer and head, with the keys stored as the method stores them (rotated, bfloat16, the history
tier through its quantizer):

- relative key error ‖k̂ − k‖ / ‖k‖ of the needle's tokens and of all history tokens;
- the score error q·(k̂ − k)/√d of the answer queries on the needle's tokens and on the history:
  its RMS and its mean (a bias: a quantizer that shrinks the needle's key along the query lowers
  the needle's score even when its RMS error is small);
- the attention mass the answer queries put on the needle, with BF16 keys and with the method's.

The queries are the BF16 model's (first order: a quantized run's residual stream differs too),
and only keys are examined (values are read at BF16 here). The summary compares the methods on
the "retrieval heads" — the (layer, query head) pairs that put the most BF16 attention on the
needle — and splits samples by whether the method retrieved the key in the passkey run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from calibration.emulation import bf16_round, forward_with_cache
from calibration.methods import KVMethod, parse_method, parse_method_list
from calibration.passkey import NEEDLE, AnswerCache, PrefillCapture, Sample, build_sample, haystack_documents

RETRIEVAL_HEADS = 16  # (layer, query head) pairs per sample with the most BF16 attention on the needle


class _QueryRecorder(AnswerCache):
    """The BF16 answer steps, keeping each layer's queries and keys (unrotated float32)."""

    def __init__(self, method: KVMethod, capture: PrefillCapture):
        super().__init__(method, capture)
        self.q, self.keys = {}, {}

    def attend(self, layer, q, k, v, positions):
        self.q[layer] = np.asarray(q, np.float32)[0]  # [A, Hq, D]
        self.keys[layer] = np.concatenate([np.asarray(self.capture.k[layer])[0], np.asarray(k, np.float32)[0]])
        return super().attend(layer, q, k, v, positions)


def replay_samples(tokenizer, config: dict, records: list[dict], docs) -> list[tuple[Sample, dict]]:
    """The samples of a passkey run, rebuilt with its seed and draw order (calibration.passkey.run_passkey)."""
    rng = np.random.default_rng(config["seed"])
    cases = [(n, d, s) for n in config["lengths"] for d in config["depths"] for s in range(config["samples"])]
    if len(cases) != len(records):
        raise ValueError(f"the passkey file holds {len(records)} samples, its configuration {len(cases)}")
    out = []
    for (length, depth, _), record in zip(cases, records):
        key = str(rng.integers(10000, 100000))
        sample = build_sample(tokenizer, docs, length, depth, key, first_doc=int(rng.integers(len(docs))))
        if (key, sample.needle_position) != (record["key"], record["needle_position"]):
            raise ValueError(f"sample {length}/{depth}/{record['sample']} does not replay: key {key} vs "
                             f"{record['key']}, needle at {sample.needle_position} vs {record['needle_position']}")
        out.append((sample, record))
    return out


def _rotate(x: np.ndarray, rotation: np.ndarray | None) -> np.ndarray:
    """x [T, H, D] with H a multiple of rotation's Hkv → x·R of each head's KV head. In NumPy
    float64 (not passkey.AnswerCache._rotate's float32 einsum): the errors measured here are
    differences of rotated values, and a float32 product would add its own rounding to them."""
    if rotation is None:
        return x
    t, h, d = x.shape
    kv = rotation.shape[0]
    return np.einsum("tkgd,kde->tkge", x.reshape(t, kv, h // kv, d), rotation).reshape(t, h, d)


def _softmax_mass(scores: np.ndarray, span: np.ndarray) -> np.ndarray:
    """scores [Hq, S] → softmax mass on the positions `span` (bool [S]), per head."""
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (p[:, span].sum(axis=-1) / p.sum(axis=-1)).astype(np.float64)


def diagnose_layer(method: KVMethod, layer: int, q: np.ndarray, keys: np.ndarray, prompt_length: int,
                   needle: np.ndarray, intervals=None) -> dict[str, np.ndarray]:
    """One layer: q [A, Hq, D] at positions prompt_length…, keys [S, Hkv, D] (S = prompt_length + A, the
    last A the answer tokens'), needle bool [S]. Per KV head: relative key error on needle / history;
    per query head: RMS score error on needle / history and the attention mass on the needle
    (BF16 keys, the method's keys), averaged over the A queries. `intervals`: the method's
    history_intervals(S), if already computed."""
    rotation = None if method.k_rotation is None else np.asarray(method.k_rotation[layer], np.float64)
    d = q.shape[-1]
    k_rot = np.asarray(bf16_round(jnp.asarray(_rotate(keys.astype(np.float64), rotation), jnp.float32)))
    q_rot = _rotate(q.astype(np.float64), rotation)
    quantizes = getattr(method, "quantizer", True) is not None  # the BF16 reference has quantizer None
    k_lo = np.asarray(method.quantize_keys(layer, k_rot[None]))[0] if quantizes else k_rot
    error = (k_lo - k_rot).astype(np.float64)
    if intervals is None:
        intervals = method.history_intervals(keys.shape[0])
    group = q.shape[1] // keys.shape[1]
    out: dict[str, list] = {"mass_bf16": [], "mass_method": [], "score_error_needle": [], "score_error_history": [],
                            "score_bias_needle": [], "score_bias_history": []}
    history_any = np.zeros(keys.shape[0], bool)
    for a in range(q.shape[0]):
        t = prompt_length + a
        history = np.zeros(keys.shape[0], bool)
        history[intervals.k_start[t]:intervals.k_end[t]] = True
        history_any |= history
        visible = slice(0, t + 1)
        stored = np.where(history[:, None, None], k_lo, k_rot)[visible]
        qa = q_rot[a].reshape(keys.shape[1], group, d)  # [Hkv, G, D]
        ref_scores = np.einsum("kgd,skd->kgs", qa, k_rot[visible].astype(np.float64)).reshape(-1, t + 1) / np.sqrt(d)
        scores = np.einsum("kgd,skd->kgs", qa, stored.astype(np.float64)).reshape(-1, t + 1) / np.sqrt(d)
        span = needle[visible]
        out["mass_bf16"].append(_softmax_mass(ref_scores, span))
        out["mass_method"].append(_softmax_mass(scores, span))
        delta = scores - ref_scores
        h_needle, h_all = span & history[visible], history[visible]
        for where, mask in (("needle", h_needle), ("history", h_all)):
            missing = np.full(delta.shape[0], np.nan)
            out[f"score_error_{where}"].append(np.sqrt(np.mean(delta[:, mask] ** 2, axis=-1)) if mask.any() else missing)
            out[f"score_bias_{where}"].append(np.mean(delta[:, mask], axis=-1) if mask.any() else missing)
    result = {name: np.mean(values, axis=0) for name, values in out.items()}
    relative = np.linalg.norm(error, axis=-1) / np.maximum(np.linalg.norm(k_rot, axis=-1), 1e-30)  # [S, Hkv]
    needle_history = needle & history_any
    nan = np.full(keys.shape[1], np.nan)
    result["key_error_needle"] = relative[needle_history].mean(axis=0) if needle_history.any() else nan
    result["key_error_history"] = relative[history_any].mean(axis=0) if history_any.any() else nan
    return result


def needle_span(tokenizer, sample: Sample) -> np.ndarray:
    """bool [P + A]: the needle sentence's tokens in the prompt."""
    span = np.zeros(len(sample.prompt) + len(sample.answer) - 1, bool)
    length = len(tokenizer.encode(NEEDLE.format(key=sample.key)))
    span[sample.needle_position:sample.needle_position + length] = True
    return span


def diagnose_sample(params, cfg, tokenizer, sample: Sample, methods: list[KVMethod], reference: KVMethod) -> dict:
    prompt, answer = sample.prompt[None], sample.answer[None]
    capture = PrefillCapture()
    forward_with_cache(params, cfg, prompt, capture, rows=[prompt.shape[1] - 1])
    recorder = _QueryRecorder(reference, capture)
    forward_with_cache(params, cfg, answer[:, :-1], recorder, start=prompt.shape[1])
    needle = needle_span(tokenizer, sample)
    per_method = {}
    for m in methods:
        intervals = m.history_intervals(len(needle))
        layers = [diagnose_layer(m, i, recorder.q[i], recorder.keys[i], prompt.shape[1], needle, intervals)
                  for i in range(cfg.num_layers)]
        per_method[m.name] = {name: np.stack([layer[name] for layer in layers]) for name in layers[0]}  # [L, H]
    return per_method


def summarize(samples: list[dict], method_names: list[str], retrieval_heads: int = RETRIEVAL_HEADS) -> dict:
    """Per method: key and score errors (needle vs history), and on each sample's retrieval heads
    (chosen by BF16 mass, the same heads for every method) the needle mass kept, also split by the
    passkey run's outcome for that method."""
    out = {}
    for name in method_names:
        rows = [s for s in samples if name in s["per_method"]]

        def mean_of(key, subset=rows):
            values = [np.nanmean(np.asarray(s["per_method"][name][key])) for s in subset]
            return float(np.nanmean(values)) if values else None

        def on_retrieval_heads(key):
            values = []
            for s in rows:
                m = s["per_method"][name]
                top = np.argsort(np.asarray(m["mass_bf16"]).ravel())[::-1][:retrieval_heads]
                values.append(np.nanmean(np.asarray(m[key]).ravel()[top]))
            return float(np.nanmean(values)) if values else None

        def kept(subset):
            ratios = []
            for s in subset:
                m = s["per_method"][name]
                ref = np.asarray(m["mass_bf16"]).ravel()
                top = np.argsort(ref)[::-1][:retrieval_heads]
                ratios.append(float(np.mean(np.asarray(m["mass_method"]).ravel()[top]) / np.mean(ref[top])))
            return (float(np.mean(ratios)), len(ratios)) if ratios else (None, 0)

        correct = [s for s in rows if s["correct"].get(name) is True]
        wrong = [s for s in rows if s["correct"].get(name) is False]
        out[name] = {
            "key_error_needle": mean_of("key_error_needle"), "key_error_history": mean_of("key_error_history"),
            "score_error_needle": mean_of("score_error_needle"), "score_error_history": mean_of("score_error_history"),
            "retrieval_head_score_bias_needle": on_retrieval_heads("score_bias_needle"),
            "retrieval_head_score_bias_history": on_retrieval_heads("score_bias_history"),
            "retrieval_head_score_error_needle": on_retrieval_heads("score_error_needle"),
            "retrieval_head_mass_kept": kept(rows)[0],
            "retrieval_head_mass_kept_when_correct": kept(correct)[0], "samples_correct": len(correct),
            "retrieval_head_mass_kept_when_wrong": kept(wrong)[0], "samples_wrong": len(wrong),
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for name in names:
        key_needle = np.nanmean([np.asarray(s["per_method"][name]["key_error_needle"]) for s in result["samples"]], 0)
        key_hist = np.nanmean([np.asarray(s["per_method"][name]["key_error_history"]) for s in result["samples"]], 0)
        layers = np.arange(len(key_needle))
        line, = axes[0].plot(layers, np.nanmean(key_needle, 1), label=f"{name}: needle")
        axes[0].plot(layers, np.nanmean(key_hist, 1), "--", color=line.get_color(), label=f"{name}: history")
        ratio = np.nanmean([np.asarray(s["per_method"][name]["score_error_needle"])
                            / np.asarray(s["per_method"][name]["score_error_history"]) for s in result["samples"]], 0)
        axes[1].plot(layers, np.nanmean(ratio, 1), color=line.get_color(), label=name)
        ref = np.concatenate([np.asarray(s["per_method"][name]["mass_bf16"]).ravel() for s in result["samples"]])
        got = np.concatenate([np.asarray(s["per_method"][name]["mass_method"]).ravel() for s in result["samples"]])
        axes[2].scatter(ref, got, s=4, alpha=0.4, color=line.get_color(), label=name)
    axes[0].set(xlabel="layer", ylabel="relative key error", title="keys: needle tokens vs all history")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set(xlabel="layer", ylabel="RMS score error, needle / history", title="answer queries' score error")
    lim = [0, 1]
    axes[2].plot(lim, lim, color="grey", lw=0.8)
    axes[2].set(xlabel="needle attention mass, BF16 keys", ylabel="with the method's keys",
                title="every (sample, layer, query head)", xlim=(0, 1), ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _listify(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _listify(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_listify(v) for v in tree]
    if isinstance(tree, np.ndarray):
        return np.round(tree.astype(np.float64), 6).tolist()
    return tree


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m calibration.needle_diagnosis", description=__doc__.split("\n\n")[0])
    p.add_argument("--passkey", required=True, help="a passkey result JSON (prefill mode) whose samples to rebuild")
    p.add_argument("--lengths", default=None, help="only these prompt lengths (default: all of the file's)")
    p.add_argument("--methods", default="quarot-int2,oscar")
    p.add_argument("--artifact", help="calibration artifact (default: the one the passkey run used)")
    p.add_argument("--limit", type=int, default=None, help="only the first N chosen samples (a quick look)")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    command = "python -m calibration.needle_diagnosis " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        passkey = json.loads(Path(args.passkey).read_text())
        config = passkey["config"]
        if config.get("mode") != "prefill":
            raise ValueError(f"{args.passkey}: mode {config.get('mode')!r}; the diagnosis replays prefill-mode runs")
        lengths = None if args.lengths is None else {int(x) for x in args.lengths.split(",") if x.strip()}
        specs = parse_method_list(args.methods)

        from calibration.evaluate import environment, shipped_artifact
        from oscar_jax.loaders import load_model
        from oscar_jax.tokenizer import load_tokenizer
        from shared_math.artifact import ModelFingerprint, read_artifact

        t0 = time.time()
        env = environment()
        cfg, params = load_model(config["model"])
        tokenizer = load_tokenizer(config["model"])
        fp = ModelFingerprint(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim)
        artifact_path = args.artifact or config.get("artifact") or shipped_artifact(config["model"])
        artifact = read_artifact(artifact_path, expected_model=fp)
        shape = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        methods = [parse_method(s, **shape, artifact=artifact) for s in specs]
        reference = parse_method("bf16", **shape)
        replayed = replay_samples(tokenizer, config, passkey["samples"], haystack_documents(tokenizer))
        chosen = [(s, r) for s, r in replayed if lengths is None or s.length in lengths]
        chosen = chosen[:args.limit] if args.limit else chosen
        if not chosen:
            raise ValueError(f"no sample of length {sorted(lengths)} in {args.passkey}")
        samples = []
        for sample, record in tqdm(chosen, desc="needle diagnosis", disable=args.no_progress):
            per_method = diagnose_sample(params, cfg, tokenizer, sample, methods, reference)
            samples.append({"length": sample.length, "depth": sample.depth, "key": sample.key,
                            "needle_position": sample.needle_position,
                            "correct": {name: rec["correct"] for name, rec in record["methods"].items()},
                            "per_method": per_method})
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"summary": summarize(samples, [m.name for m in methods]), "samples": samples,
              "config": {"command": command, "passkey": args.passkey, "lengths": sorted(lengths) if lengths else None, "limit": args.limit,
                         "methods": specs, "artifact": str(artifact_path), "retrieval_heads": RETRIEVAL_HEADS,
                         "seconds": round(time.time() - t0, 1)},
              "environment": env}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_listify(result), indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    for name, row in result["summary"].items():
        print(f"{name:<14} key error needle {row['key_error_needle']:.3f} / history {row['key_error_history']:.3f}; "
              f"retrieval-head mass kept {row['retrieval_head_mass_kept']:.3f} "
              f"(correct {row['retrieval_head_mass_kept_when_correct']}, wrong {row['retrieval_head_mass_kept_when_wrong']})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
