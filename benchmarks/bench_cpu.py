"""CPU benchmark of the embedded default: SmolLM2-135M, INT2 (OSCAR) and BF16 caches, XLA vs interpret.

    JAX_PLATFORMS=cpu python -m benchmarks.bench_cpu [--out benchmarks/results/cpu/bench_cpu.json]

What it measures, on whatever CPU runs it (the result records the CPU, core count, versions, git sha):
  * prefill tokens/s and decode tokens/s at batch 1 and 8, for
      int2  OscarRuntime (f32 weights, the shipped rotation artifact) with the ops on their native
            XLA path (oscar_jax/xla, the CPU default), and
      bf16  the dense BF16 cache with bf16 weights, as `python -m oscar_jax.generate --kv-cache-dtype
            bf16` runs it (and, like for like with int2's weights, its decode with the float32 weights
            as `make demo` runs both caches: `f32_weights`, the same cache decoded on);
    prompts are real text (held-out Wikipedia summaries, a different one per sequence, so no prefix
    is shared), `--prompt-tokens` long. Prefill: the batch's prompts admitted (int2: one at a time,
    in chunks of 512, as the runtime does; bf16: one [B, T] call), timed after a compiling run of
    the same shapes. Decode: `--decode-steps` steps timed after `page_size + 1` warm-up steps (the
    first compiles the step, a later one the page demotion), so demotions are in the timed steps
    at their real rate;
  * the ratio to the Pallas kernels in interpret mode (what every op ran on CPU before the XLA
    path): decode at batch 1 on the same cache — the XLA runtime's cache switched to interpret=True
    after its prefill (the pages are the same bytes) — over `--interpret-steps` steps after one
    compiling step; prefill of a `--interpret-prompt-tokens` prompt (one chunk) on both paths, each
    timed on a second admit after a compiling one.
The targets of issue 38 are checked and written beside the figures (`targets`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

RESULT = Path(__file__).resolve().parent / "results" / "cpu" / "bench_cpu.json"
MODEL = "smollm2-135m"
TARGETS = dict(int2_decode_b1_tokens_per_s=10.0, int2_prefill_tokens_per_s=300.0, xla_over_interpret=20.0)


def environment() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    import jaxlib

    return dict(
        cpu=cpu, cores=len(os.sched_getaffinity(0)), platform=platform.platform(),
        python=platform.python_version(), jax=jax.__version__, jaxlib=jaxlib.__version__, numpy=np.__version__,
        jax_backend=jax.default_backend(), git_sha=git("rev-parse", "HEAD"),
        git_dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
    )


def real_prompts(tokenizer, num_tokens: int, batch: int) -> list[np.ndarray]:
    """`batch` prompts of `num_tokens` tokens of held-out Wikipedia text, each from other documents."""
    from calibration.data import wiki_documents

    docs, prompts, text = iter(wiki_documents("evaluation")), [], ""
    while len(prompts) < batch:
        text += next(docs) + "\n\n"
        ids = tokenizer.encode(text)
        if len(ids) >= num_tokens:
            prompts.append(np.asarray(ids[:num_tokens], np.int32))
            text = ""
    return prompts


def _timed(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------- INT2 cache


def _runtime(model, prompts, extra_tokens: int, **kwargs):
    from oscar_jax.runtime import OscarRuntime

    cfg, params, artifact = model
    return OscarRuntime(params, cfg, artifact, max_batch=len(prompts),
                        max_seq_len=len(prompts[0]) + extra_tokens, **kwargs)


def _admit_all(rt, prompts) -> list[int]:
    seq_ids = []
    for prompt in prompts:
        seq_id, logits, _ = rt.admit(prompt, share_prefix=False)
        seq_ids.append(seq_id)
    jax.block_until_ready(logits)
    return seq_ids


def _step_times(rt, seq_ids, steps: int) -> list[float]:
    tokens, times = [1] * len(seq_ids), []
    for _ in range(steps):
        times.append(_timed(lambda: rt.step(seq_ids, tokens)))
    return times


def bench_int2(model, prompts, decode_steps: int, interpret_steps: int = 0) -> dict:
    rt = _runtime(model, prompts, decode_steps + 64)
    warmup = rt.config.page_size + 1
    for seq_id in _admit_all(rt, prompts[:1]):  # compiles the prefill (both chunk shapes)
        rt.finish(seq_id)
    prefill_s = _timed(lambda: _admit_all(rt, prompts))
    seq_ids = list(rt.allocator.sequences)
    _step_times(rt, seq_ids, warmup)
    steps = _step_times(rt, seq_ids, decode_steps)
    result = dict(prompt_tokens=len(prompts[0]), batch=len(prompts), prefill_s=prefill_s,
                  prefill_tokens_per_s=len(prompts) * len(prompts[0]) / prefill_s,
                  decode_steps=decode_steps, decode_step_median_s=float(np.median(steps)),
                  decode_tokens_per_s=len(prompts) * decode_steps / sum(steps))
    if interpret_steps:
        # The same cache, read and written by the Pallas kernels in interpret mode from here on.
        rt.cache = dataclasses.replace(rt.cache, interpret=True, kernels=None)
        first = _step_times(rt, seq_ids, 1)[0]
        interpreted = _step_times(rt, seq_ids, interpret_steps)
        result["interpret"] = dict(decode_steps=interpret_steps, first_step_s=first,
                                   decode_step_median_s=float(np.median(interpreted)),
                                   decode_tokens_per_s=len(prompts) / float(np.median(interpreted)))
        result["interpret"]["xla_over_interpret_decode"] = (result["interpret"]["decode_step_median_s"]
                                                            / result["decode_step_median_s"])
    return result


def bench_prefill_interpret(model, prompt: np.ndarray) -> dict:
    """Prefill of one short prompt, XLA path vs Pallas interpret, each timed on its second admit."""
    out = {}
    for name, interpret in (("xla", None), ("interpret", True)):
        rt = _runtime(model, [prompt], 8, interpret=interpret)
        first = _timed(lambda: _admit_all(rt, [prompt]))
        rt.finish(next(iter(rt.allocator.sequences)))
        seconds = _timed(lambda: _admit_all(rt, [prompt]))
        out[name] = dict(first_admit_s=first, prefill_s=seconds, prefill_tokens_per_s=len(prompt) / seconds)
    out["prompt_tokens"] = len(prompt)
    out["xla_over_interpret_prefill"] = out["interpret"]["prefill_s"] / out["xla"]["prefill_s"]
    return out


# ----------------------------------------------------------------------------------- BF16 cache


def bench_bf16(model, prompts, decode_steps: int) -> dict:
    from oscar_jax.cache_api import DenseKVCache
    from oscar_jax.model import _decode_step_jit, _prefill_jit, cast_params

    cfg, f32_params, _ = model
    params = cast_params(f32_params, jnp.bfloat16)
    tokens = jnp.asarray(np.stack(prompts))
    batch, length = tokens.shape
    warmup = 17  # as the int2 run's page_size + 1

    def fresh():
        return DenseKVCache.create(num_layers=cfg.num_layers, batch=batch, num_kv_heads=cfg.num_kv_heads,
                                   max_seq_len=length + warmup + decode_steps + 1, head_dim=cfg.head_dim)

    _prefill_jit(params, cfg, tokens, fresh())  # compiles
    state = {}

    def prefill():
        logits, state["cache"] = _prefill_jit(params, cfg, tokens, fresh())
        return logits

    prefill_s = _timed(prefill)
    position, step_tokens = [length], jnp.ones((batch,), jnp.int32)

    def step():
        logits, state["cache"] = _decode_step_jit(params, cfg, step_tokens, state["cache"],  # params: read at call
                                                  jnp.full((batch,), position[0], jnp.int32))
        position[0] += 1
        return logits

    for _ in range(warmup):
        _timed(step)
    steps = [_timed(step) for _ in range(decode_steps)]
    result = dict(prompt_tokens=length, batch=batch, prefill_s=prefill_s, prefill_tokens_per_s=batch * length / prefill_s,
                  decode_steps=decode_steps, decode_step_median_s=float(np.median(steps)),
                  decode_tokens_per_s=batch * decode_steps / sum(steps))
    # Like for like with the int2 runtime's float32 weights (as `make demo` runs both caches): the same
    # BF16 cache decoded by the float32 model, after a compiling step (its positions run past the
    # cache's end, whose writes the scatter drops: each step still reads the whole cache, as above).
    params = f32_params
    _timed(step)
    steps = [_timed(step) for _ in range(decode_steps)]
    result["f32_weights"] = dict(decode_step_median_s=float(np.median(steps)),
                                 decode_tokens_per_s=batch * decode_steps / sum(steps))
    return result


# ------------------------------------------------------------------------------------------ plot


def plot(results: dict, path: Path) -> None:
    """Tokens/s of both caches (prefill and decode, each batch) and of the interpreted kernels, on a
    log axis, the issue's targets drawn where they apply."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    for ax, phase in zip(axes, ("prefill", "decode")):
        batches = list(results["int2"])
        bars = {"INT2 (OSCAR, XLA path)": [results["int2"][b][f"{phase}_tokens_per_s"] for b in batches],
                "BF16 cache (bf16 weights)": [results["bf16"][b][f"{phase}_tokens_per_s"] for b in batches],
                "BF16 cache, f32 weights (decode)": [float("nan") if phase == "prefill" else
                                                     results["bf16"][b]["f32_weights"]["decode_tokens_per_s"]
                                                     for b in batches]}
        interpreted = (results["prefill_interpret"]["interpret"]["prefill_tokens_per_s"] if phase == "prefill"
                       else results["int2"]["b1"]["interpret"]["decode_tokens_per_s"])
        short = results["prefill_interpret"]["prompt_tokens"]
        bars[f"INT2, Pallas interpret (prefill: {short}-token prompt)"] = \
            [interpreted] + [float("nan")] * (len(batches) - 1)
        width = 0.8 / len(bars)
        for i, (name, values) in enumerate(bars.items()):
            xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(batches))]
            ax.bar(xs, values, width, label=name)
            for x, v in zip(xs, values):
                if v == v:
                    ax.annotate(f"{v:.0f}" if v >= 10 else f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=8)
        target = TARGETS[f"int2_{phase}_tokens_per_s" if phase == "prefill" else "int2_decode_b1_tokens_per_s"]
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.annotate(f"issue 38 target, batch 1: {target:.0f}", (-0.45, target), fontsize=8, color="gray",
                    va="bottom", ha="left")
        ax.set_xticks(range(len(batches)), [f"batch {b[1:]}" for b in batches])
        ax.set_yscale("log")
        ax.set_title(f"{phase} ({results['int2'][batches[0]]['prompt_tokens']}-token prompts)")
    axes[0].set_ylabel("tokens / s")
    fig.legend(*axes[1].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    env = results["environment"]
    fig.suptitle(f"{MODEL} on {env['cores']} cores of {env['cpu']} (jax {env['jax']}, git {env['git_sha'][:7]})",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def check_targets(results: dict) -> dict:
    int2, bf16 = results["int2"], results["bf16"]
    ratios = [results["int2"]["b1"]["interpret"]["xla_over_interpret_decode"],
              results["prefill_interpret"]["xla_over_interpret_prefill"]]
    checks = {
        "int2_decode_b1_tokens_per_s >= 10": int2["b1"]["decode_tokens_per_s"] >= TARGETS["int2_decode_b1_tokens_per_s"],
        "int2_prefill_tokens_per_s >= 300 (b1)":
            int2["b1"]["prefill_tokens_per_s"] >= TARGETS["int2_prefill_tokens_per_s"],
        "xla_over_interpret >= 20 (decode and prefill)": min(ratios) >= TARGETS["xla_over_interpret"],
    }
    for b in results["int2"]:
        for phase in ("prefill", "decode"):
            checks[f"int2 {phase} {b} >= bf16"] = (int2[b][f"{phase}_tokens_per_s"]
                                                    >= bf16[b][f"{phase}_tokens_per_s"])
    for b in results["int2"]:  # not an issue target: the BF16 cache with the int2 runtime's float32 weights
        checks[f"(f32 weights) int2 decode {b} >= bf16"] = (int2[b]["decode_tokens_per_s"]
                                                            >= bf16[b]["f32_weights"]["decode_tokens_per_s"])
    return checks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULT)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--interpret-steps", type=int, default=3)
    p.add_argument("--interpret-prompt-tokens", type=int, default=512)
    p.add_argument("--plot-only", action="store_true", help="re-render the plot of an existing --out JSON")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.png')}")
        return 0
    if jax.default_backend() != "cpu":
        print(f"error: this is the CPU benchmark; JAX runs on {jax.default_backend()} (set JAX_PLATFORMS=cpu)",
              file=sys.stderr)
        return 2

    from oscar_jax.generate import shipped_artifact
    from oscar_jax.loaders import load_model
    from oscar_jax.tokenizer import load_tokenizer
    from oscar_jax.xla import kernels
    from shared_math.artifact import read_artifact

    assert kernels() == "xla", f"the ops would run {kernels()!r} (OSCAR_JAX_KERNELS is set?)"
    cfg, params = load_model(MODEL)
    model = (cfg, params, read_artifact(shipped_artifact(MODEL)))
    tokenizer = load_tokenizer(MODEL)
    all_prompts = real_prompts(tokenizer, args.prompt_tokens, max(args.batches))
    # The CPU may be shared: the load averages before and after say how busy it was.
    results = dict(environment=environment(), args={k: str(v) for k, v in vars(args).items()}, model=MODEL,
                   load_average_before=os.getloadavg(), int2={}, bf16={})
    start = time.perf_counter()
    for batch in args.batches:
        prompts = all_prompts[:batch]
        key = f"b{batch}"
        results["int2"][key] = bench_int2(model, prompts, args.decode_steps,
                                          interpret_steps=args.interpret_steps if batch == 1 else 0)
        print(f"int2 {key}: {json.dumps(results['int2'][key])}", flush=True)
        results["bf16"][key] = bench_bf16(model, prompts, args.decode_steps)
        print(f"bf16 {key}: {json.dumps(results['bf16'][key])}", flush=True)
    short = real_prompts(tokenizer, args.interpret_prompt_tokens, 1)[0]
    results["prefill_interpret"] = bench_prefill_interpret(model, short)
    print(f"prefill interpret: {json.dumps(results['prefill_interpret'])}", flush=True)
    results["targets"] = check_targets(results) if {"b1"} <= set(results["int2"]) else {}
    results["seconds"] = time.perf_counter() - start
    results["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if results["targets"]:
        plot(results, args.out.with_suffix(".png"))
    for name, ok in results["targets"].items():
        print(f"{'met   ' if ok else 'MISSED'} {name}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
