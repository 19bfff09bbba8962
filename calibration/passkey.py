"""Passkey retrieval with a real-text haystack: does a quantized KV cache still find the needle?

    python -m calibration.passkey --model smollm2-135m --lengths 1024,2048,4096,8192 \\
        --depths 0.1,0.3,0.5,0.7,0.9 --samples 1 --methods bf16,naive-int2,quarot-int2,kivi2,oscar \\
        --artifact DIR --json passkey.json

A sample of `length` tokens is
    PREFIX ‖ haystack[:i] ‖ NEEDLE ‖ haystack[i:] ‖ QUESTION ‖ answer
with the haystack made of whole Wikipedia summaries of the *evaluation* split (never used for
calibration), the needle "The pass key is NNNNN. Remember it. NNNNN is the pass key." placed at
the document boundary nearest to `depth` of the haystack, a random 5-digit key, and the answer
" NNNNN" (SmolLM2 tokenizes it as ' ' and one token per digit). The space is forced, not scored
(the model may phrase the start differently); a sample is correct when greedy decoding after it
reproduces every digit, which is checked exactly by teacher forcing: each key token must be the
argmax given the previous ones.

Modes (how the prompt enters the cache):
  prefill (default, the serving path of oscar_jax.runtime): the prompt is prefilled in chunks of
    `--prefill-chunk` tokens (the runtime's default, 512); every prompt token is written once
    into its *final* tier (tier_split of the whole prompt; for KIVI its state after the prompt),
    and a chunk attends to itself in full precision and to the tokens before it through those
    tiers. The answer tokens are then decode steps reading the cache through the method's tiers.
    The first answer token (the forced space) comes from the prefill logits, so every scored
    digit is predicted by a decode step. With `--prefill-chunk 0` (or a chunk ≥ the prompt) the
    prompt attends to itself entirely in float32; its pass is then shared by all methods and
    each method costs only the answer tokens. Otherwise each method costs one full pass.
    A rounding-level difference from the runtime: rows that are history at the end of the prompt
    are quantized from bfloat16 here (the runtime's fused prefill write quantizes them from
    float32); a chunk reads its own K/V in float32, as the runtime does.
  decode: every prompt token is emulated as if decoded one at a time (calibration.emulation) —
    stricter; one full pass per method.

Salient tokens (`oscar:salient=N[:observe=W]`, an experiment): at the end of the prompt, per
(layer, KV head), the N history positions (neither sink nor recent window) with the most attention
mass from the prompt's last W queries (the question) are kept in BF16 for the answer tokens
(`calibration.methods.salient_positions`: BF16 keys as the cache holds them, float32 math). The
selection is known only once the prompt has ended, so the prompt's own attention reads history as
today (with `--prefill-chunk 0`, the only mode that emulates it, the prompt attends to itself in
float32 anyway) and only the answer steps change: AnswerCache replaces the quantized copy of the
selected rows with their BF16 rows. Tokens demoted into history after the prompt are not
candidates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
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
    NO_RAW,
    bf16_round,
    emulated_logits,
    forward_with_cache,
    mixed_attention,
    windowed_attention,
)
from calibration.methods import HistoryIntervals, KVMethod, parse_method, parse_method_list, salient_positions

PREFIX = ("There is an important piece of information hidden inside a lot of irrelevant text. "
          "Find it and memorize it. I will quiz you about the important information there.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is"
SEPARATOR = "\n\n"
MODES = ("prefill", "decode")
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_METHODS = ("bf16", "naive-int2", "quarot-int2", "kivi2", "oscar")


@dataclasses.dataclass(frozen=True)
class Sample:
    length: int
    depth: float
    key: str
    prompt: np.ndarray  # int32 [P]
    answer: np.ndarray  # int32 [A]: the forced continuation, `lead` tokens then the key's tokens
    needle_position: int  # token index where the needle starts
    lead: int = 0  # leading answer tokens that are forced but not scored (the space before the key)

    @property
    def key_tokens(self) -> np.ndarray:
        return self.answer[self.lead :]


def haystack_documents(tokenizer, source: str = "wiki") -> list[list[int]]:
    from calibration.data import documents

    enc = _plain_encode(tokenizer)
    return [enc(doc) for doc in documents(source, "evaluation")]


def _plain_encode(tokenizer):
    """encode without BOS: the prompt is assembled from pieces, and a tokenizer that adds BOS
    (Gemma) gets one BOS at the start of the prompt instead (`build_sample`)."""
    if getattr(tokenizer, "add_bos", False):
        return lambda text: tokenizer.encode(text, add_bos=False)
    return tokenizer.encode


def build_sample(tokenizer, docs: list[list[int]], length: int, depth: float, key: str, first_doc: int = 0) -> Sample:
    """A prompt + answer of exactly `length` tokens; the haystack starts at document `first_doc`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"{depth=} must lie in [0, 1]")
    enc = _plain_encode(tokenizer)
    prefix, sep, question = enc(PREFIX), enc(SEPARATOR), enc(QUESTION)
    if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None:
        prefix = [tokenizer.bos_id] + prefix
    needle, lead, digits = enc(NEEDLE.format(key=key)), enc(" "), enc(key)
    answer = lead + digits
    budget = length - len(prefix) - len(needle) - len(sep) - len(question) - len(answer)
    if budget < 1:
        raise ValueError(f"{length=} leaves no room for a haystack")
    hay, boundaries = [], [0]
    for i in range(len(docs)):
        doc = docs[(first_doc + i) % len(docs)]
        hay += doc + sep
        boundaries.append(len(hay))
        if len(hay) >= budget:
            break
    if len(hay) < budget:
        raise ValueError(f"the haystack text holds {len(hay)} tokens, fewer than the {budget} needed")
    hay = hay[:budget]
    boundaries = [b for b in boundaries if b <= budget]
    at = min(boundaries, key=lambda b: abs(b - depth * budget))
    prompt = prefix + hay[:at] + needle + sep + hay[at:] + question
    return Sample(length, depth, key, np.asarray(prompt, np.int32), np.asarray(answer, np.int32), len(prefix) + at,
                  lead=len(lead))


# ---------------------------------------------------------------------------------------------
# Prefill mode: a shared float32 prefill, then per-method answer steps through the tiers


class PrefillCapture:
    """The prompt attends to itself in float32 (the runtime's prefill attention); its K and V are
    kept per layer for the answer steps."""

    def __init__(self, query_chunk: int = DEFAULT_QUERY_CHUNK, keep_queries: int = 0):
        self.query_chunk = query_chunk
        self.k, self.v = {}, {}
        self.keep_queries = keep_queries  # the prompt's last queries kept per layer (salient selection)
        self.q: dict[int, jax.Array] = {}
        self._none, self._plans = None, {}

    def attend(self, layer, q, k, v, positions, window: int | None = None):
        t = q.shape[1]
        self.k[layer], self.v[layer] = k.astype(jnp.float32), v.astype(jnp.float32)
        if self.keep_queries:
            self.q[layer] = q[:, max(0, t - self.keep_queries):].astype(jnp.float32)
        if window is not None:  # a sliding-window layer attends within its window
            out = windowed_attention(q, self.k[layer], self.v[layer], window, query_chunk=self.query_chunk)
            return out.astype(q.dtype), self
        if self._none is None:
            self._none = HistoryIntervals(*(np.zeros(t, np.int64),) * 4)
        out = mixed_attention(q, self.k[layer], None, self.v[layer], None, self._none,
                              query_chunk=self.query_chunk, plan_cache=self._plans)
        return out.astype(q.dtype), self


class AnswerCache:
    """Queries after a captured prompt: the prompt's K/V and the answer tokens' own K/V, stored
    as the method stores them (rotated, bfloat16, history quantized per tier)."""

    def __init__(self, method: KVMethod, capture: PrefillCapture, query_chunk: int = DEFAULT_QUERY_CHUNK):
        self.m, self.capture, self.query_chunk = method, capture, query_chunk
        self._intervals, self._plans = None, {}  # the same for every layer
        self.salient = getattr(method, "salient", 0)
        self.selected: dict[int, np.ndarray] = {}  # layer → salient positions [B, Hkv, N]
        if self.salient and capture.keep_queries < method.salient_window:
            raise ValueError(f"{method.name}: the prefill kept {capture.keep_queries} queries, the selection "
                             f"needs the last {method.salient_window}")

    @staticmethod
    def _rotate(x, rotation, inverse=False):  # x [B, T, H, D], rotation [Hkv, D, D]
        b, t, h, d = x.shape
        kv = rotation.shape[0]
        spec = "btkgd,ked->btkge" if inverse else "btkgd,kde->btkge"
        return jnp.einsum(spec, x.reshape(b, t, kv, h // kv, d), rotation,
                          precision=jax.lax.Precision.HIGHEST).reshape(b, t, h, d)

    def attend(self, layer, q, k, v, positions, window: int | None = None):
        start = int(np.asarray(positions)[0, 0])
        prefix = self.capture.k[layer].shape[1]
        if start != prefix:
            raise ValueError(f"answer tokens must start right after the prompt (position {prefix}), got {start}")
        keys = jnp.concatenate([self.capture.k[layer], k.astype(jnp.float32)], axis=1)
        values = jnp.concatenate([self.capture.v[layer], v.astype(jnp.float32)], axis=1)
        q = q.astype(jnp.float32)
        if window is not None:  # a sliding-window layer: its BF16 window for every method
            out = windowed_attention(q, bf16_round(keys), bf16_round(values), window, q_start=start,
                                     query_chunk=self.query_chunk)
            return out.astype(jnp.float32), self
        if self.m.k_rotation is not None:
            rot = jnp.asarray(self.m.k_rotation[layer])
            q, keys = self._rotate(q, rot), self._rotate(keys, rot)
        if self.m.v_rotation is not None:
            values = self._rotate(values, jnp.asarray(self.m.v_rotation[layer]))
        k_hi, v_hi = bf16_round(keys), bf16_round(values)
        if self._intervals is None:
            self._intervals = HistoryIntervals(*(a[start:] for a in self.m.history_intervals(keys.shape[1])[:4]))
        iv = self._intervals
        k_lo = jnp.asarray(self.m.quantize_keys(layer, np.asarray(k_hi))) if np.any(iv.k_end > iv.k_start) else None
        v_lo = jnp.asarray(self.m.quantize_values(layer, np.asarray(v_hi))) if np.any(iv.v_end > iv.v_start) else None
        if self.salient:
            k_lo, v_lo = self._keep_salient(layer, start, k_hi, k_lo, v_hi, v_lo)
        out = mixed_attention(q, k_hi, k_lo, v_hi, v_lo, iv, query_chunk=self.query_chunk, q_start=start,
                              plan_cache=self._plans)
        if self.m.v_rotation is not None:
            out = self._rotate(out, jnp.asarray(self.m.v_rotation[layer]), inverse=True)
        return out.astype(jnp.float32), self

    def _keep_salient(self, layer, prompt_length, k_hi, k_lo, v_hi, v_lo):
        """The quantized copies with the layer's salient rows replaced by their BF16 rows."""
        w = self.m.salient_window
        q_window = self.capture.q[layer][:, -w:]
        if self.m.k_rotation is not None:
            q_window = self._rotate(q_window, jnp.asarray(self.m.k_rotation[layer]))
        k_start, k_end, v_start, v_end = self.m.at_rest_history(prompt_length)
        if k_start != v_start or k_end > v_end:  # per-channel keys: whole groups, a prefix of the values'
            raise ValueError(f"{self.m.name}: salient tokens need the keys' history within the values'")
        # chosen over the values' history: the keys past the last whole group are BF16 already
        sel = salient_positions(np.asarray(q_window), np.asarray(k_hi[:, :prompt_length]), (v_start, v_end),
                                self.salient)
        self.selected[layer] = sel
        if sel.shape[-1] == 0:
            return k_lo, v_lo
        b, kv = sel.shape[:2]
        rows = (np.arange(b)[:, None, None], sel, np.arange(kv)[None, :, None])  # → [B, Hkv, N, D]
        if k_lo is not None:
            k_lo = k_lo.at[rows].set(k_hi[rows])
        if v_lo is not None:
            v_lo = v_lo.at[rows].set(v_hi[rows])
        return k_lo, v_lo


class ServingTiers:
    """A method seen through the runtime's serving path: chunked prefill of a prompt, then decode.

    Query t < prompt_length in the chunk starting at c0 reads history [start, min(end, c0)) of the
    prompt's final (at-rest) history [start, end): earlier chunks' tokens through their final
    tiers, and its own chunk [c0, t] in float32 (raw_start = c0). Queries ≥ prompt_length read
    what decoding reads.
    """

    def __init__(self, method: KVMethod, prompt_length: int, prefill_chunk: int):
        if prefill_chunk < 1:
            raise ValueError(f"{prefill_chunk=} must be positive")
        self.method, self.prompt_length, self.prefill_chunk = method, prompt_length, prefill_chunk
        self.name, self.k_rotation, self.v_rotation = method.name, method.k_rotation, method.v_rotation
        self.quantize_keys, self.quantize_values = method.quantize_keys, method.quantize_values

    def history_intervals(self, length: int) -> HistoryIntervals:
        iv = [a.copy() for a in self.method.history_intervals(length)[:4]]
        final = self.method.at_rest_history(self.prompt_length)
        rows = np.arange(min(length, self.prompt_length))
        chunk_start = (rows // self.prefill_chunk) * self.prefill_chunk
        for i, (start, end) in enumerate(((final[0], final[1]), (final[2], final[3]))):
            iv[2 * i][rows] = start
            iv[2 * i + 1][rows] = np.maximum(start, np.minimum(end, chunk_start))
        raw_start = np.full(length, NO_RAW, np.int64)
        raw_start[rows] = chunk_start
        return HistoryIntervals(*iv, raw_start=raw_start)


def answer_logits(params, cfg, sample: Sample, methods: list[KVMethod], *, mode: str = "prefill",
                  prefill_chunk: int = 0, query_chunk: int = DEFAULT_QUERY_CHUNK) -> dict[str, np.ndarray]:
    """{method name: float32 [A, V]}: the logits that predict each answer token.

    prefill_chunk: 0 (or ≥ the prompt) prefills the whole prompt at once, else in chunks."""
    if mode not in MODES:
        raise ValueError(f"{mode=} must be one of {MODES}")
    if prefill_chunk < 0:
        raise ValueError(f"{prefill_chunk=} must be ≥ 0")
    prompt, answer = sample.prompt[None], sample.answer[None]
    p, a = prompt.shape[1], answer.shape[1]
    out = {}
    keep = max((m.salient_window for m in methods if getattr(m, "salient", 0)), default=0)
    if mode == "decode" or 0 < prefill_chunk < p:
        if keep:
            raise ValueError("salient tokens are emulated only in prefill mode with the whole prompt at once "
                             "(--prefill-chunk 0)")
        tokens = np.concatenate([prompt, answer[:, :-1]], axis=1)
        rows = np.arange(p - 1, p + a - 1)
        for m in methods:
            view = m if mode == "decode" else ServingTiers(m, p, prefill_chunk)
            out[m.name] = np.asarray(emulated_logits(params, cfg, tokens, view, rows=rows, query_chunk=query_chunk)[0])
        return out
    capture = PrefillCapture(query_chunk, keep_queries=keep)
    first = np.asarray(forward_with_cache(params, cfg, prompt, capture, rows=[p - 1])[0])  # [1, V]
    for m in methods:
        rest = forward_with_cache(params, cfg, answer[:, :-1], AnswerCache(m, capture, query_chunk), start=p)
        out[m.name] = np.concatenate([first, np.asarray(rest[0])], axis=0)
    return out


# ---------------------------------------------------------------------------------------------
# Experiment and CLI


def run_passkey(params, cfg, tokenizer, methods: list[KVMethod], *, lengths, depths, samples: int = 1,
                mode: str = "prefill", prefill_chunk: int = 0, seed: int = 0, docs=None, progress: bool = True,
                query_chunk: int = DEFAULT_QUERY_CHUNK, only_lengths=None) -> dict[str, Any]:
    """only_lengths: evaluate only the samples of these lengths, drawn exactly as the full run over
    `lengths` draws them (the same keys and haystacks: a fixed subset of that run)."""
    docs = haystack_documents(tokenizer) if docs is None else docs
    rng = np.random.default_rng(seed)
    records = []
    cases = [(length, depth, s) for length in lengths for depth in depths for s in range(samples)]
    if only_lengths is not None:
        if not only_lengths or not set(only_lengths) <= set(lengths):
            raise ValueError(f"only_lengths {list(only_lengths)} must be a non-empty subset of {list(lengths)}")
    evaluated = [n for n in lengths if only_lengths is None or n in only_lengths]
    todo = sum(n in evaluated for n, _, _ in cases)
    bar = tqdm(total=todo, desc=f"passkey ({mode})", disable=not progress)
    for length, depth, s in cases:
        key = str(rng.integers(10000, 100000))
        first_doc = int(rng.integers(len(docs)))
        if length not in evaluated:
            continue
        sample = build_sample(tokenizer, docs, length, depth, key, first_doc=first_doc)
        logits = answer_logits(params, cfg, sample, methods, mode=mode, prefill_chunk=prefill_chunk,
                               query_chunk=query_chunk)
        rec = {"length": length, "depth": depth, "sample": s, "key": key, "needle_position": sample.needle_position,
               "methods": {}}
        for name, lg in logits.items():
            pred = np.argmax(lg, axis=-1)[sample.lead :]  # the rows that predict the key's tokens
            rec["methods"][name] = {"correct": bool(np.array_equal(pred, sample.key_tokens)),
                                    "token_accuracy": float(np.mean(pred == sample.key_tokens)),
                                    "predicted": pred.tolist()}
        records.append(rec)
        bar.update()
    bar.close()
    configs = {m.name: m.describe() for m in methods}
    if cfg.local_layers:  # sliding-window layers: BF16 windows for every method
        from calibration.evaluate import local_layer_note

        configs = {name: {**c, **local_layer_note(cfg)} for name, c in configs.items()}
    return {"methods": summarize(records, configs, evaluated, depths), "samples": records}


def summarize(records: list[dict], configs: dict[str, dict], lengths, depths) -> dict[str, Any]:
    """Accuracy per method (overall, by length, by depth, per cell) of the sample records."""
    summary = {}
    for name, config in configs.items():
        def acc(rows):
            return float(np.mean([r["methods"][name]["correct"] for r in rows])) if rows else None
        summary[name] = {
            "accuracy": acc(records),
            "by_length": {str(n): acc([r for r in records if r["length"] == n]) for n in lengths},
            "by_depth": {str(d): acc([r for r in records if r["depth"] == d]) for d in depths},
            "grid": {str(n): {str(d): acc([r for r in records if r["length"] == n and r["depth"] == d])
                              for d in depths} for n in lengths},
            "token_accuracy": float(np.mean([r["methods"][name]["token_accuracy"] for r in records])),
            "config": config,
        }
    return summary


MERGE_KEYS = ("model", "mode", "prefill_chunk", "lengths", "depths", "samples", "seed", "haystack", "artifact")


def merge_results(parts: list[dict], command: str) -> dict[str, Any]:
    """One result from runs of the same samples (same seed, lengths, depths, methods) that evaluated
    disjoint `--only-lengths`: the records in the full run's order, the summary recomputed."""
    first = parts[0]["config"]
    names = list(parts[0]["methods"])
    seen: set[int] = set()
    for part in parts:
        c = part["config"]
        if any(c.get(k) != first.get(k) for k in MERGE_KEYS) or list(part["methods"]) != names:
            raise ValueError("the parts differ in their samples or methods: " + ", ".join(
                k for k in MERGE_KEYS if c.get(k) != first.get(k)) or "methods")
        if any(part["methods"][n]["config"] != parts[0]["methods"][n]["config"] for n in names):
            raise ValueError("the parts' methods are configured differently")
        own = set(c.get("only_lengths") or c["lengths"])
        if own & seen:
            raise ValueError(f"the parts overlap in lengths {sorted(own & seen)}")
        seen |= own
    order = {n: i for i, n in enumerate(first["lengths"])}
    depth = {d: i for i, d in enumerate(first["depths"])}
    records = sorted((r for part in parts for r in part["samples"]),
                     key=lambda r: (order[r["length"]], depth[r["depth"]], r["sample"]))
    lengths = [n for n in first["lengths"] if n in seen]
    configs = {n: parts[0]["methods"][n]["config"] for n in names}
    config = {**{k: first.get(k) for k in MERGE_KEYS}, "command": command,
              "only_lengths": None if len(lengths) == len(first["lengths"]) else lengths,
              "seconds": round(sum(p["config"]["seconds"] for p in parts), 1),
              "parts": [{k: p["config"].get(k) for k in ("command", "only_lengths", "seconds")}
                        | {"git_sha": p.get("environment", {}).get("git_sha")} for p in parts]}
    return {"methods": summarize(records, configs, lengths, first["depths"]), "samples": records,
            "config": config, "environment": parts[0].get("environment", {})}


def _floats(text, name):
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} {text!r} must be comma-separated numbers") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m calibration.passkey", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    p.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)))
    p.add_argument("--samples", type=int, default=1, help="samples per (length, depth)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--artifact", help="calibration artifact (default: the one shipped for the model, if any)")
    p.add_argument("--mode", choices=MODES, default="prefill")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill chunk in tokens (default: oscar_jax.runtime's); 0 = the whole prompt at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only-lengths", default=None,
                   help="evaluate only the samples of these lengths (comma-separated), drawn as the full run over "
                        "--lengths draws them: a fixed subset of that run")
    p.add_argument("--json", required=True)
    p.add_argument("--merge", nargs="+", metavar="PART",
                   help="write one result from these result files (the same samples and methods, disjoint "
                        "--only-lengths) instead of running")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    command = "python -m calibration.passkey " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.merge:
        try:
            result = merge_results([json.loads(Path(f).read_text()) for f in args.merge], command)
        except (ValueError, OSError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        for name, r in result["methods"].items():
            print(f"{name:<24} accuracy {r['accuracy']:.3f}  by length {r['by_length']}")
        print(f"wrote {args.json}")
        return 0
    try:
        lengths = [int(x) for x in _floats(args.lengths, "lengths")]
        depths = _floats(args.depths, "depths")
        only_lengths = None if args.only_lengths is None else [int(x) for x in _floats(args.only_lengths, "only-lengths")]
        if only_lengths is not None and (not only_lengths or not set(only_lengths) <= set(lengths)):
            raise ValueError(f"--only-lengths {only_lengths} must be a non-empty subset of --lengths {lengths}")
        specs = parse_method_list(args.methods)
        if args.samples < 1 or not lengths or not depths:
            raise ValueError("--samples, --lengths and --depths must be non-empty / positive")
        if args.prefill_chunk is None:
            from oscar_jax.runtime import DEFAULT_PREFILL_CHUNK

            args.prefill_chunk = DEFAULT_PREFILL_CHUNK
        if args.prefill_chunk < 0:
            raise ValueError(f"--prefill-chunk {args.prefill_chunk} must be ≥ 0")
    except ValueError as e:
        p.error(str(e))
    try:
        from calibration.evaluate import environment, shipped_artifact
        from oscar_jax.loaders import load_model
        from oscar_jax.tokenizer import load_tokenizer
        from shared_math.artifact import ModelFingerprint, read_artifact

        t0 = time.time()
        env = environment()  # at the start: the code that runs, not the checkout at the end
        cfg, params = load_model(args.model)
        too_long = [n for n in lengths if n > cfg.max_seq_len]
        if too_long:
            raise ValueError(f"--lengths {too_long} exceed the model's trained context {cfg.max_seq_len}")
        fp = ModelFingerprint(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim)
        artifact_path = args.artifact or shipped_artifact(args.model)
        artifact = read_artifact(artifact_path, expected_model=fp) if artifact_path else None
        methods = [parse_method(s, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                artifact=artifact, load_artifact=lambda path: read_artifact(path, expected_model=fp))
                   for s in specs]
        result = run_passkey(params, cfg, load_tokenizer(args.model), methods, lengths=lengths, depths=depths,
                             samples=args.samples, mode=args.mode, prefill_chunk=args.prefill_chunk, seed=args.seed,
                             progress=not args.no_progress, only_lengths=only_lengths)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["config"] = {"command": command, "model": args.model, "mode": args.mode,
                        "prefill_chunk": args.prefill_chunk if args.mode == "prefill" else None, "lengths": lengths,
                        "depths": depths, "samples": args.samples, "seed": args.seed,
                        "only_lengths": only_lengths,
                        "haystack": "wiki evaluation split (never used for calibration)",
                        "artifact": None if artifact_path is None else str(artifact_path), "seconds": round(time.time() - t0, 1)}
    if cfg.local_layers:
        from calibration.evaluate import local_layer_note

        result["config"]["local_layers"] = local_layer_note(cfg)["local_layers"]
    result["environment"] = env
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, r in result["methods"].items():
        print(f"{name:<24} accuracy {r['accuracy']:.3f}  by length {r['by_length']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
