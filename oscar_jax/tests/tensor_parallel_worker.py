"""The tensor-parallel checks, run in a fresh process with 8 fake CPU devices (test_tensor_parallel.py).

XLA_FLAGS=--xla_force_host_platform_device_count must be set before JAX initialises its backend,
and a pytest process has already initialised JAX with one device: so the tests run this file as a
subprocess, `python oscar_jax/tests/tensor_parallel_worker.py CHECK OUT.json`, and assert on the
facts it writes (tokens, logit differences, page mismatches, collective counts, error messages).
`multihost` is one of two processes that jax.distributed joins over 127.0.0.1.

On GPUs (issue TP-GPU): `TP_PLATFORM=gpu TP_SIZES=2 python oscar_jax/tests/tensor_parallel_worker.py
decode qwen3 OUT.json` runs the same checks on the real devices (no fake-device flag).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    if os.environ.get("TP_PLATFORM", "cpu") == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={os.environ.get('TP_DEVICES', '8')}")
        os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from oscar_jax.cache import POOL_NAMES  # noqa: E402
from oscar_jax.model import ModelConfig, init_params  # noqa: E402
from oscar_jax.parallel import TensorParallel, initialize_distributed, make_mesh, shard_pages  # noqa: E402
from oscar_jax.runtime import OscarRuntime  # noqa: E402
from shared_math.artifact import ModelFingerprint  # noqa: E402
from shared_math.tests.test_artifact import make_artifact  # noqa: E402

# Head counts of the real models at test widths (head_dim 64: the INT2 kernel's minimum).
MODELS = {
    # Qwen3-8B's heads (32 q / 8 KV, qk_norm, untied): tp 1, 2, 4, 8
    "qwen3": ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_q_heads=32,
                         num_kv_heads=8, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=False,
                         qk_norm=True),
    # SmolLM2-135M's heads (9 q / 3 KV, tied): tp 1, 3
    "smollm2": ModelConfig(vocab_size=96, hidden_size=96, intermediate_size=96, num_layers=2, num_q_heads=9,
                           num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5, tie_embeddings=True),
    # 2 KV heads on 4 shards: each KV head replicated twice
    "replicated": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_q_heads=8,
                              num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-6, tie_embeddings=True),
}
TP_SIZES = {"qwen3": (2, 4, 8), "smollm2": (3,), "replicated": (4,), "qwen3_v2": (2, 8)}
if os.environ.get("TP_SIZES"):  # the sizes a machine has devices for (every model gets them)
    TP_SIZES = {name: tuple(int(t) for t in os.environ["TP_SIZES"].split(",")) for name in TP_SIZES}
WINDOWS = dict(sink=16, recent=16, max_seq_len=128)  # small windows: the decode steps demote pages
# 57 and 50 tokens (one prefill bucket): history pages from the prefill, more from demotions
PROMPTS = [np.arange(3, 60) * 7 % 90 + 1, np.arange(5, 55) * 11 % 90 + 2]
STEPS = 8


def model(name: str, *, silent_outputs: bool = False):
    """Random weights (std 0.1: decisive logits); silent_outputs zeroes W_o and W_down, so every
    layer's input is the embedding, exactly, on any number of shards. A name ending in "_v2": that
    model with an artifact for format v2's per-channel key pages (pages of 16)."""
    channel_keys = name.endswith("_v2")
    cfg = MODELS[name.removesuffix("_v2")]
    params = init_params(cfg, jax.random.PRNGKey(7), std=0.1)
    if silent_outputs:
        params = dict(params, layers=[dict(layer, wo=layer["wo"] * 0, w_down=layer["w_down"] * 0)
                                      for layer in params["layers"]])
    art = make_artifact(ModelFingerprint(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim), seed=3)
    if channel_keys:
        art = dataclasses.replace(art, codec={**art.codec, "key_layout": "channel", "key_group": 16})
    return cfg, params, art


def decode(runtime, steps=STEPS):
    """Greedy tokens and logits of the two PROMPTS decoded together."""
    ids, tokens, logits = [], [], []
    for prompt in PROMPTS:
        sid, first, _ = runtime.admit(prompt)
        ids.append(sid)
        tokens.append([int(np.argmax(first))])
    for _ in range(steps):
        out = np.asarray(runtime.step(ids, [t[-1] for t in tokens]))
        logits.append(out)
        for row, t in zip(out, tokens):
            t.append(int(np.argmax(row)))
    return tokens, np.stack(logits)


def pool_mismatches(reference, runtime) -> dict:
    """Per pool and layer: elements of the sharded cache (shards concatenated in mesh order, with
    replicated KV heads mapped back to their source head) that differ from the tp-1 cache."""
    tp = runtime.tp
    out = {}
    for name in POOL_NAMES:
        want = np.asarray(getattr(reference.cache, name))
        shards = shard_pages(runtime.cache, name)
        got = np.concatenate(shards, axis=2)[:, :, :: tp.kv_replicas]
        # Every replica of a KV head holds the same bytes.
        copies = np.concatenate(shards, axis=2).reshape(got.shape[:2] + (-1, tp.kv_replicas) + got.shape[3:])
        replicas_equal = bool(np.all(copies == copies[:, :, :, :1]))
        out[name] = {"per_layer": [int(np.sum(want[y] != got[y])) for y in range(want.shape[0])],
                     "elements": int(want[0].size), "shards": len(shards), "replicas_equal": replicas_equal}
    return out


def int2_pages_used(runtime) -> int:
    pool = runtime.allocator.int2
    return int(pool.num_pages - 1 - pool.num_free)  # page 0 is scratch


def check_decode(name: str) -> dict:
    cfg, params, art = model(name)
    reference = OscarRuntime(params, cfg, art, max_batch=2, **WINDOWS)
    ref_tokens, ref_logits = decode(reference)
    result = {"reference_tokens": ref_tokens, "tp": {}}
    for tp in (1,) + TP_SIZES[name]:
        runtime = OscarRuntime(params, cfg, art, max_batch=2, mesh=make_mesh(tp), **WINDOWS)
        tokens, logits = decode(runtime)
        result["tp"][tp] = {"tokens": tokens, "max_logit_diff": float(np.abs(logits - ref_logits).max()),
                            "logit_scale": float(np.abs(ref_logits).max()),
                            "pools": pool_mismatches(reference, runtime),
                            "int2_pages_used": int2_pages_used(runtime)}
    return result


def _exact_qkv(global_cfg: ModelConfig):
    """A stand-in for model.qkv_projections whose q, k, v are gathers of the layer input's
    channels (a fixed pattern per global head): the same bits whatever the mesh, unlike a GEMM
    whose accumulation order depends on its width."""
    import jax.numpy as jnp

    def qkv(layer, cfg, x, positions, *, local=None):
        del local  # these models have no sliding-window layers
        h, d = x.shape[-1], cfg.head_dim
        tp = global_cfg.num_q_heads // cfg.num_q_heads
        shard = jax.lax.axis_index("tp") if tp > 1 else 0
        replicas = cfg.num_kv_heads * tp // global_cfg.num_kv_heads
        q_heads = shard * cfg.num_q_heads + jnp.arange(cfg.num_q_heads)
        kv_heads = (shard * cfg.num_kv_heads + jnp.arange(cfg.num_kv_heads)) // replicas

        def gather(heads, offset):
            channels = (jnp.arange(d)[None] * 3 + heads[:, None] * 5 + offset) % h  # [heads, D]
            return jnp.take(x, channels, axis=-1)  # [B, T, heads, D]

        return gather(q_heads, 0), gather(kv_heads, 1), gather(kv_heads, 2)

    return qkv


def check_exact_pages(name: str) -> dict:
    """Every layer's q, k, v the same bits on any mesh (W_o = W_down = 0 keep each layer's input
    the embedding, and the projections are exact gathers): then every page of every layer and
    pool must equal the tp-1 cache's pages of the same heads."""
    import oscar_jax.model

    cfg, params, art = model(name, silent_outputs=True)
    oscar_jax.model.qkv_projections = _exact_qkv(cfg)
    reference = OscarRuntime(params, cfg, art, max_batch=2, **WINDOWS)
    ref_tokens, _ = decode(reference, steps=STEPS)
    result = {"tp": {}}
    for tp in TP_SIZES[name]:
        runtime = OscarRuntime(params, cfg, art, max_batch=2, mesh=make_mesh(tp), **WINDOWS)
        tokens, _ = decode(runtime, steps=STEPS)
        result["tp"][tp] = {"tokens_equal": tokens == ref_tokens, "pools": pool_mismatches(reference, runtime),
                            "int2_pages_used": int2_pages_used(runtime)}
    return result


def check_hlo() -> dict:
    """Collectives in the lowered (StableHLO) and compiled (HLO) decode step of Qwen3-shaped tp 2."""
    cfg, params, art = model("qwen3")
    runtime = OscarRuntime(params, cfg, art, max_batch=2, mesh=make_mesh(2), **WINDOWS)
    sid, _, _ = runtime.admit(PROMPTS[0])
    captured = {}
    step = runtime._steps[1]

    def spy(*args):
        from oscar_jax.parallel import _decode_step

        lowered = _decode_step.lower(*args[:1], *args[2:], tp=runtime.tp)
        captured["lowered"] = lowered.as_text()
        captured["compiled"] = lowered.compile().as_text()
        return step(*args)

    runtime._steps = (runtime._steps[0], spy, runtime._steps[2])
    runtime.step([sid], [1])
    names = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
    lowered = {n: len(re.findall(rf"stablehlo\.{n}\b", captured["lowered"])) for n in names}
    compiled = {n: len(re.findall(rf"= \S+ {n.replace('_', '-')}(-start)?\(", captured["compiled"])) for n in names}
    return {"num_layers": cfg.num_layers, "lowered": lowered, "compiled": compiled}


def check_errors() -> dict:
    """The messages of bad configurations."""
    out = {}
    cases = {
        "more_devices_than_present": lambda: make_mesh(9),
        "zero_tp": lambda: make_mesh(0),
        "q_heads_not_divisible": lambda: TensorParallel.plan(MODELS["qwen3"], make_mesh(3)),
        "kv_heads_neither_divides": lambda: TensorParallel.plan(
            ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=1, num_q_heads=12,
                        num_kv_heads=4, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-6, tie_embeddings=True),
            make_mesh(6)),
        "vocab_not_divisible": lambda: TensorParallel.plan(
            ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=1, num_q_heads=6,
                        num_kv_heads=3, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-6, tie_embeddings=True),
            make_mesh(3)),
        "wrong_axis": lambda: TensorParallel.plan(
            MODELS["qwen3"], jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))),
        "partial_distributed_flags": lambda: initialize_distributed("127.0.0.1:1", None, 0),
    }
    for name, make in cases.items():
        try:
            make()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


SNAPSHOT_MESHES = {"qwen3": (2, (2, 4, None)),  # saved at tp 2; restored at tp 2, tp 4, one device
                   "replicated": (4, (4, 2, None))}  # saved with each KV head twice; restored into 1 copy


def logical_pages(runtime, name: str) -> np.ndarray:
    """A pool with one copy of each KV head, gathered from the shards."""
    if runtime.tp is None:
        return np.asarray(getattr(runtime.cache, name))
    return np.concatenate(shard_pages(runtime.cache, name), axis=2)[:, :, :: runtime.tp.kv_replicas]


def check_snapshot(name: str) -> dict:
    """Save on one mesh after decoding; restore onto others; pages and the next step must agree."""
    from oscar_jax.snapshot import restore_snapshot, save_snapshot

    cfg, params, art = model(name)
    source_tp, targets = SNAPSHOT_MESHES[name]
    source = OscarRuntime(params, cfg, art, max_batch=2, mesh=make_mesh(source_tp), **WINDOWS)
    tokens, _ = decode(source, steps=8)
    ids = sorted(source.allocator.sequences)
    saved = {n: logical_pages(source, n) for n in POOL_NAMES}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_snapshot(source, Path(tmp) / "snap")
        continued = np.asarray(source.step(ids, [t[-1] for t in tokens])).argmax(-1).tolist()
        for size in targets:
            target = OscarRuntime(params, cfg, art, max_batch=2, mesh=None if size is None else make_mesh(size),
                                  **WINDOWS)
            restore_snapshot(target, Path(tmp) / "snap")
            pages_equal = {n: bool(np.array_equal(saved[n], logical_pages(target, n))) for n in POOL_NAMES}
            shards = len(target.cache.k_codes.sharding.device_set)
            after = np.asarray(target.step(ids, [t[-1] for t in tokens])).argmax(-1).tolist()
            out["one_device" if size is None else f"tp{size}"] = {
                "pages_equal": pages_equal, "shards": shards, "next_tokens": after, "source_next_tokens": continued,
                "kv_replicas": 1 if target.tp is None else target.tp.kv_replicas}
    return out


def check_multihost(process_id: int, port: int) -> dict:
    """One of two processes (one CPU device each) decoding Qwen3-shaped tp 2 across them."""
    initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    cfg, params, art = model("qwen3")
    runtime = OscarRuntime(params, cfg, art, max_batch=2, mesh=make_mesh(2), **WINDOWS)
    tokens, logits = decode(runtime, steps=8)
    from oscar_jax.parallel import iter_layer_activations

    tp = TensorParallel.plan(cfg, make_mesh(2))
    try:  # calibration gathers layers onto a device of its own process: refused across processes
        next(iter_layer_activations(tp.shard_params(params, fuse=False), tp, np.ones((1, 8), np.int32)))
        calibration_error = None
    except NotImplementedError as e:
        calibration_error = str(e)
    return {"process_count": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "tokens": tokens, "calibration_error": calibration_error}


def check_calibration(name: str) -> dict:
    """calibration's statistics and rotations from the forward pass on tp N vs one device (bitwise)."""
    from calibration.calibrate import _layer_activations
    from calibration.fit import rotations
    from calibration.statistics import SecondMoments, group_queries

    cfg, params, _ = model(name)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 96)

    def statistics(params, tp):
        moments = {n: SecondMoments(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) for n in ("query", "output")}
        for layer, q, k, v, o in _layer_activations(params, cfg, tokens, tp):
            moments["query"].add(layer, group_queries(q, cfg.num_kv_heads))
            moments["output"].add(layer, group_queries(o, cfg.num_kv_heads))
        return {n: m.covariance() for n, m in moments.items()}

    reference = statistics(params, None)
    out = {}
    for size in TP_SIZES[name]:
        tp = TensorParallel.plan(cfg, make_mesh(size))
        cov = statistics(tp.shard_params(params, fuse=False), tp)
        out[size] = {
            "cov_equal": {n: bool(np.array_equal(cov[n], reference[n])) for n in cov},
            "rotation_equal": bool(np.array_equal(rotations(cov["query"], "oscar")[0],
                                                  rotations(reference["query"], "oscar")[0])),
            "nonzero": bool(np.abs(reference["query"]).max() > 0),
        }
    return out


def check_smollm2_real() -> dict:
    """The real SmolLM2-135M with its shipped artifact at tp 3 vs one device: a 200-token text
    prompt with small windows (sink 16, recent 32), so history pages are written and demoted."""
    from oscar_jax.generate import shipped_artifact
    from oscar_jax.loaders import load_model
    from oscar_jax.tokenizer import load_tokenizer
    from shared_math import read_artifact

    cfg, params = load_model("smollm2-135m")
    art = read_artifact(shipped_artifact("smollm2-135m"))
    text = " ".join(["The history of the city begins with a small settlement on the river."] * 16)
    prompt = np.asarray(load_tokenizer("smollm2-135m").encode(text), np.int32)[:200]
    out = {}
    for label, mesh in (("one_device", None), ("tp3", make_mesh(3))):
        runtime = OscarRuntime(params, cfg, art, max_batch=1, max_seq_len=256, sink=16, recent=32, mesh=mesh)
        sid, logits, _ = runtime.admit(prompt)
        tokens, all_logits = [int(np.argmax(logits))], [np.asarray(logits)]
        for _ in range(16):
            logits = np.asarray(runtime.step([sid], [tokens[-1]])[0])
            all_logits.append(logits)
            tokens.append(int(np.argmax(logits)))
        out[label] = {"tokens": tokens, "logits": np.stack(all_logits)}
    return {"tokens": {k: v["tokens"] for k, v in out.items()},
            "max_logit_diff": float(np.abs(out["tp3"]["logits"] - out["one_device"]["logits"]).max()),
            "logit_scale": float(np.abs(out["one_device"]["logits"]).max())}


def check_engine(name: str) -> dict:
    """The serving engine (continuous batching, chunked prefill, on-device sampling) over a tp-N
    runtime vs one device: three greedy requests, one of them seeded sampling."""
    from oscar_jax.serving.engine import Engine, EngineConfig
    from oscar_jax.serving.sampling import SamplingParams

    cfg, params, art = model(name)
    requests = {"a": (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)),
                "b": (PROMPTS[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
                "c": (PROMPTS[0][:20], SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True))}
    out = {}
    for size in (None, TP_SIZES[name][0]):
        runtime = OscarRuntime(params, cfg, art, max_batch=4, prefill_chunk=32,
                               mesh=None if size is None else make_mesh(size), **WINDOWS)
        engine = Engine(runtime, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=36, prefill_chunk=32))
        for rid, (prompt, sampling) in requests.items():
            engine.add_request(prompt.tolist(), sampling, rid)
        got = {rid: [] for rid in requests}
        for _ in range(200):
            if not engine.has_work():
                break
            for o in engine.step():
                got[o.request_id].extend(o.token_ids)
        out["one_device" if size is None else f"tp{size}"] = got
    return out


def check_single(name: str) -> dict:
    """The tokens of one process on one device (the multi-host comparison)."""
    cfg, params, art = model(name)
    tokens, _ = decode(OscarRuntime(params, cfg, art, max_batch=2, **WINDOWS), steps=8)
    return {"tokens": tokens}


def main(argv) -> int:
    check, out = argv[0], Path(argv[-1])
    if check == "decode":
        result = check_decode(argv[1])
    elif check == "exact_pages":
        result = check_exact_pages(argv[1])
    elif check == "hlo":
        result = check_hlo()
    elif check == "errors":
        result = check_errors()
    elif check == "snapshot":
        result = check_snapshot(argv[1])
    elif check == "multihost":
        result = check_multihost(int(argv[1]), int(argv[2]))
    elif check == "calibration":
        result = check_calibration(argv[1])
    elif check == "smollm2_real":
        result = check_smollm2_real()
    elif check == "engine":
        result = check_engine(argv[1])
    elif check == "single":
        result = check_single(argv[1])
    else:
        raise SystemExit(f"unknown check {check!r}")
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
