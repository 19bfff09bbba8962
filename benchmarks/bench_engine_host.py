"""The serving engine's host time per decode step, with and without overlap (DECISIONS S2), and the
server's start to /health with an empty and a warm persistent compilation cache.

    python -m benchmarks.bench_engine_host --out benchmarks/results/cpu/engine_host.json

`steps`: an Engine over a toy model with Qwen3-8B's depth (36 layers, tiny widths: the model's
compute is small, the host work per layer and per sequence is not), 32 sequences of 512-token
prompts decoding together (one decode bucket of 32), on whatever CPU runs it (the CPU path of the
ops). Per `EngineConfig.overlap` setting, after 10 warm steps, `--steps` steps: the median wall
time of a step and of its host part (wall − time blocked on the device, `StepTiming`). Each
setting runs twice, interleaved, so drift shows. On a CPU the "device" is the same cores, so
overlap cannot hide anything here: this measures the host work, not the overlap's gain.

`start` (`--start`): `python -m oscar_jax.serve --model smollm2-135m` (INT2, --max-num-seqs 4)
launched twice with one fresh JAX_COMPILATION_CACHE_DIR: seconds from launch until /health answers,
cold then warm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

BATCH, PROMPT, WARM_STEPS = 32, 512, 10


def engine_steps(overlap: bool, steps: int, params, model, *, batch: int = BATCH, prompt: int = PROMPT) -> dict:
    from oscar_jax.runtime import OscarRuntime
    from oscar_jax.serve import identity_artifact
    from oscar_jax.serving.engine import Engine, EngineConfig
    from oscar_jax.serving.sampling import SamplingParams

    runtime = OscarRuntime(params, model, identity_artifact(model), max_batch=batch,
                           max_seq_len=prompt + batch + WARM_STEPS + steps + 8, sink=64, recent=256, page_size=64,
                           prefill_chunk=prompt)
    engine = Engine(runtime, None, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=prompt + batch,
                                                prefill_chunk=prompt, enable_prefix_caching=False,
                                                decode_buckets=(batch,), overlap=overlap))
    rng = np.random.default_rng(0)
    # the first prompts decode while the later ones prefill (one chunk a step): up to `batch` tokens more
    params_ = SamplingParams(max_tokens=batch + WARM_STEPS + steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(rng.integers(0, model.vocab_size, prompt).tolist(), params_, str(i))
    while engine.waiting or any(r.state.name == "PREFILL" for r in engine.running):
        engine.step()
    runtime.compile_demotion(batch)
    for _ in range(WARM_STEPS):
        engine.step()
    timings = []
    for _ in range(steps):
        engine.step()
        timings.append(engine.last_step)
    assert all(t.decode_rows == batch for t in timings), "a step held fewer rows than the batch"
    return {"overlap": overlap, "steps": steps,
            "step_ms_p50": 1e3 * float(np.median([t.total_s for t in timings])),
            "host_ms_p50": 1e3 * float(np.median([t.total_s - t.device_wait_s for t in timings]))}


def server_start(port: int = 8765, timeout_s: float = 900) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache)
        for run in ("cold", "warm"):
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "oscar_jax.serve", "--model", "smollm2-135m",
                                     "--kv-cache-dtype", "int2", "--max-num-seqs", "4", "--port", str(port)],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"the server exited with {proc.returncode} before answering /health")
                    if time.perf_counter() - t0 > timeout_s:
                        raise TimeoutError(f"/health did not answer in {timeout_s} s")
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                            if r.status == 200:
                                break
                    except OSError:
                        time.sleep(0.5)
                out[f"{run}_s"] = time.perf_counter() - t0
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_engine_host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/engine_host.json"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--start", action="store_true", help="also time the server's start, cold and warm")
    args = p.parse_args(argv)
    import jax

    from benchmarks.harness import environment
    from oscar_jax.model import ModelConfig, init_params

    model = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=36, num_q_heads=4,
                        num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-6, tie_embeddings=False,
                        qk_norm=True)
    params = init_params(model, jax.random.key(0), dtype="bfloat16")
    runs = []
    for overlap in (False, True, False, True):
        runs.append(engine_steps(overlap, args.steps, params, model))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result = {"environment": environment(), "batch": BATCH, "prompt": PROMPT, "layers": model.num_layers,
              "cpu_count": os.cpu_count(), "steps": runs}
    if args.start:
        result["server_start"] = server_start()
        print(json.dumps(result["server_start"]), file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
