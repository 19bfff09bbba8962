"""`make demo`: a long real-text prompt decoded through the OSCAR INT2 cache, then through BF16.

The prompt is built from held-out Wikipedia summaries (the evaluation split, never used for
calibration) and is long enough (≥ 1K tokens) that most of the cache is in the INT2 tier. Both
caches serve the same float32 weights (loaded once), so the cache is the only difference between
the two answers. On a CPU the ops run their native XLA path (oscar_jax/xla; OSCAR_JAX_KERNELS=pallas
runs the Pallas kernels in interpret mode instead, minutes slower).

Every program is compiled before it is timed: a warm-up prompt of the same prefill chunk shape,
whose first decode step also demotes a page, compiles the INT2 runtime's prefill, decode step and
demotion; the BF16 cache's prefill and decode step are compiled ahead of time. (Compiling both in two
threads saved nothing on 2 cores: one XLA compile already keeps them busy.) Compiled programs are
kept in JAX's persistent cache, so only a machine's first run pays for compilation. The reported
tokens/s measure the steady state: prefill of the whole prompt, and every decode step, demotions
included.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from calibration.data import wiki_documents
from oscar_jax.compile_cache import use_persistent_cache

MODEL = "smollm2-135m"
PROMPT_TOKENS = (1000, 1024)  # ≥ 1K tokens, in at most two prefill chunks of 512
NEW_TOKENS = 40
QUESTION = "\n\nIn one sentence: what is the first topic above about?"


def build_prompt(tokenizer) -> str:
    """Held-out summaries + a question, as a chat turn whose token count lies in PROMPT_TOKENS."""
    lo, hi = PROMPT_TOKENS
    text = ""
    for doc in wiki_documents("evaluation"):
        text += doc + "\n\n"
        if len(tokenizer.encode(text)) >= hi:
            break
    ids = tokenizer.encode(text)
    while True:
        prompt = tokenizer.decode(ids) + QUESTION
        count = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])))
        if count <= hi:
            assert count >= lo, f"demo prompt has {count} tokens"
            return prompt
        ids = ids[: len(ids) - (count - hi)]


class Int2Cache:
    """The OSCAR runtime (paged INT2 + BF16 tiers) for one sequence."""

    name = "int2"

    def __init__(self, cfg, params, max_seq_len: int):
        from oscar_jax.generate import shipped_artifact
        from oscar_jax.runtime import OscarRuntime
        from shared_math.artifact import read_artifact

        self.runtime = OscarRuntime(params, cfg, read_artifact(shipped_artifact(MODEL)), max_batch=1,
                                    max_seq_len=max_seq_len)
        self.config = self.runtime.config

    def warm_up(self, prompt_len: int) -> None:
        """Compile prefill, decode and demotion: a prompt with the demo prompt's chunk shape, whose
        recent window is one token short of a demotion, then one decode step (which demotes)."""
        from oscar_jax.runtime import prefill_bucket as bucket

        cfg, rt = self.config, self.runtime
        length = cfg.sink + cfg.recent + cfg.page_size - 1  # the recent window one token short of W + page
        # The runtime pads a chunk to a power of two: every chunk of the demo prompt (≥ 1000 tokens in
        # chunks of 512) and this one share a shape.
        last_chunk = prompt_len - (prompt_len - 1) // rt.prefill_chunk * rt.prefill_chunk
        assert bucket(length) == bucket(min(prompt_len, rt.prefill_chunk)) == bucket(last_chunk), (length, prompt_len)
        seq_id, _, _ = self.runtime.admit(np.ones(length, np.int32), share_prefix=False)
        jax.block_until_ready(self.runtime.step([seq_id], [1]))
        self.runtime.finish(seq_id)

    def prefill(self, prompt):
        self.seq_id, logits, _ = self.runtime.admit(prompt, share_prefix=False)
        return logits

    def step(self, token: int):
        return self.runtime.step([self.seq_id], [token])[0]


class Bf16Cache:
    """The dense BF16 cache (cache_api.DenseKVCache) for one sequence."""

    name = "bf16"

    def __init__(self, cfg, params, max_seq_len: int):
        from oscar_jax.cache_api import DenseKVCache

        self.cfg, self.params = cfg, params
        self.fresh = lambda: DenseKVCache.create(num_layers=cfg.num_layers, batch=1, num_kv_heads=cfg.num_kv_heads,
                                                 max_seq_len=max_seq_len, head_dim=cfg.head_dim)

    def warm_up(self, prompt_len: int) -> None:
        """Compile prefill (for this prompt length) and the decode step ahead of time."""
        from oscar_jax.model import _decode_step_jit, _prefill_jit

        cache = self.fresh()
        tokens = jnp.zeros((1, prompt_len), jnp.int32)
        _prefill_jit.lower(self.params, self.cfg, tokens, cache).compile()
        _decode_step_jit.lower(self.params, self.cfg, tokens[:, 0], cache, jnp.zeros((1,), jnp.int32)).compile()

    def prefill(self, prompt):
        from oscar_jax.model import _prefill_jit

        logits, self.cache = _prefill_jit(self.params, self.cfg, jnp.asarray(prompt)[None], self.fresh())
        self.position = len(prompt)
        return logits[0]

    def step(self, token: int):
        from oscar_jax.model import _decode_step_jit

        logits, self.cache = _decode_step_jit(self.params, self.cfg, jnp.asarray([token], jnp.int32), self.cache,
                                              jnp.asarray([self.position], jnp.int32))
        self.position += 1
        return logits[0]


def generate(cache, prompt, tokenizer) -> dict:
    """Greedy decoding of up to NEW_TOKENS tokens, streamed; prefill and decode timed separately."""
    from oscar_jax.generate import TextStream

    start = time.perf_counter()
    logits = jax.block_until_ready(cache.prefill(prompt))
    prefill_s = time.perf_counter() - start
    stream, generated, start = TextStream(tokenizer), [], time.perf_counter()
    for i in range(NEW_TOKENS):
        token = int(jnp.argmax(logits))  # a host sync per token, as any streaming decoder has
        stream.push(token)
        generated.append(token)
        if token == tokenizer.eos_id or i == NEW_TOKENS - 1:
            break
        logits = cache.step(token)
    decode_s = time.perf_counter() - start
    print(flush=True)
    steps = len(generated) - 1  # the decode steps run (the first token comes from the prefill)
    return dict(tokens=generated, prefill_tokens_per_s=len(prompt) / prefill_s,
                decode_tokens_per_s=steps / decode_s if steps else float("nan"))


def main(argv=None) -> int:
    from oscar_jax.loaders import load_model
    from oscar_jax.model import describe
    from oscar_jax.tokenizer import load_tokenizer
    from oscar_jax.xla import kernels
    from shared_math.tiers import bf16_kv_bytes_per_layer, kv_bytes_per_layer

    if argv:
        print(f"usage: python -m oscar_jax.demo (no arguments; got {argv})", file=sys.stderr)
        return 2
    begin = time.perf_counter()
    cache_dir = use_persistent_cache()
    cfg, params = load_model(MODEL)
    tokenizer = load_tokenizer(MODEL)
    prompt = np.asarray(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": build_prompt(tokenizer)}])), np.int32)
    max_seq_len = len(prompt) + NEW_TOKENS
    print(f"[oscar] {MODEL}: {describe(cfg)}; float32 weights for both caches")
    print(f"[oscar] prompt: {len(prompt)} tokens of held-out Wikipedia summaries + a question; "
          f"{NEW_TOKENS} new tokens, greedy")
    caches = [Int2Cache(cfg, params, max_seq_len), Bf16Cache(cfg, params, max_seq_len)]

    start = time.perf_counter()
    for cache in caches:
        cache.warm_up(len(prompt))
    print(f"[oscar] compiled both caches' prefill, decode and demotion in {time.perf_counter() - start:.1f} s "
          f"on {jax.default_backend()} ({kernels()} path for the INT2 ops)"
          + (f"; compiled programs kept in {cache_dir}" if cache_dir else ""))

    results = {}
    for cache in caches:
        print(f"\n===== {cache.name} cache =====", flush=True)
        results[cache.name] = generate(cache, prompt, tokenizer)

    int2, bf16 = results["int2"], results["bf16"]
    length = len(prompt) + len(int2["tokens"])
    config = caches[0].config
    oscar = kv_bytes_per_layer(length, config, cfg.num_kv_heads)
    dense = bf16_kv_bytes_per_layer(length, cfg.head_dim, cfg.num_kv_heads)
    split = oscar.split
    same = next((i for i, (a, b) in enumerate(zip(int2["tokens"], bf16["tokens"])) if a != b),
                min(len(int2["tokens"]), len(bf16["tokens"])))
    print()
    print(f"[oscar] INT2 cache at {length} tokens: sink {split.sink_tokens}, INT2 history {split.history_tokens}, "
          f"BF16 recent {split.recent_tokens}; KV bytes ({cfg.num_layers} layers) BF16 "
          f"{dense * cfg.num_layers / 2**20:.2f} MiB, OSCAR {oscar.stored_bytes * cfg.num_layers / 2**20:.2f} MiB "
          f"({dense / max(oscar.stored_bytes, 1):.2f}x smaller, {oscar.bits_per_element:.3f} bits/element; the BF16 "
          "windows dominate short sequences)")
    print(f"[oscar] the two answers agree on their first {same} tokens")
    for name, r in results.items():
        print(f"[oscar] cache {name}: prefill {r['prefill_tokens_per_s']:.1f} tok/s, decode "
              f"{r['decode_tokens_per_s']:.2f} tok/s (compiled beforehand; batch 1)")
    print(f"[oscar] demo wall time {time.perf_counter() - begin:.1f} s after imports")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
