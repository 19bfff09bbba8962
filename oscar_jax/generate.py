"""Generate text through the OSCAR INT2 cache (or a BF16 cache, for comparison).

    python -m oscar_jax.generate --prompt-file doc.txt --kv-cache-dtype int2 --max-new-tokens 64

Flags follow the OSCAR articles' serving flags (--kv-cache-dtype, --oscar-rotation-path,
--oscar-sink-size, --oscar-recent-size, --oscar-group-size) and vLLM's --tensor-parallel-size.
The output streams as it is decoded; the run ends with the KV bytes of both caches, bits per
element and tokens/s.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax.parallel import add_distributed_arguments, validate_distributed_arguments
from shared_math.models import shipped_artifact  # noqa: F401  (also imported from here)
from shared_math.spec import OscarConfig
from shared_math.tiers import bf16_kv_bytes_per_layer, kv_bytes_per_layer

LONG_CONTEXT = 131072  # the context the paper's 2.28 bits/element refers to


def kv_bytes(cfg, config: OscarConfig, length: int) -> tuple[int, int]:
    """(BF16, OSCAR) KV bytes of one sequence of `length` tokens over all layers. Sliding-window
    layers hold their window in BF16 under both caches; the others hold all `length` tokens, in
    BF16 or in the OSCAR tiers."""
    local = len(cfg.local_layers) * bf16_kv_bytes_per_layer(min(length, cfg.sliding_window or 0), cfg.head_dim,
                                                            cfg.num_kv_heads)
    paged = len(cfg.global_layers)
    return (local + paged * bf16_kv_bytes_per_layer(length, cfg.head_dim, cfg.num_kv_heads),
            local + paged * kv_bytes_per_layer(length, config, cfg.num_kv_heads).stored_bytes)


def sample(logits: jax.Array, key, temperature: float, top_p: float) -> int:
    """Greedy at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return int(jnp.argmax(logits))
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32) / temperature), np.float64)
    order = np.argsort(-probs)
    keep = np.cumsum(probs[order]) - probs[order] < top_p  # always keeps the most likely token
    kept = order[keep]
    p = probs[kept] / probs[kept].sum()
    return int(kept[np.asarray(jax.random.choice(key, len(kept), p=jnp.asarray(p)))])


class TextStream:
    """Prints the decoded text as tokens arrive (re-decoding keeps multi-byte characters whole)."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out, [], ""

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m oscar_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", type=Path)
    p.add_argument("--model", default="smollm2-135m", help="a known model name (default: smollm2-135m)")
    p.add_argument("--model-path", help="a .gguf file or a Hugging Face directory (overrides --model)")
    p.add_argument("--kv-cache-dtype", choices=("int2", "bf16"), default="int2")
    p.add_argument("--oscar-rotation-path", type=Path,
                   help="calibration output dir, or a dir with the OSCAR authors' k_rotation*.pt + v_rotation*.pt "
                        "(RotationZoo; imported on the fly) (default: the shipped artifact)")
    p.add_argument("--oscar-sink-size", type=int, default=64)
    p.add_argument("--oscar-recent-size", type=int, default=256)
    p.add_argument("--oscar-group-size", type=int, default=None, help="default: the artifact's")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=None, help="cache capacity (default: prompt + new tokens)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices the model and the INT2 cache are split over, by heads (default: 1)")
    add_distributed_arguments(p)
    args = p.parse_args(argv)
    validate_distributed_arguments(p, args)
    if args.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size={args.tensor_parallel_size} must be at least 1")
    if args.tensor_parallel_size > 1 and args.kv_cache_dtype != "int2":
        p.error(f"--tensor-parallel-size={args.tensor_parallel_size} runs the OSCAR cache: use --kv-cache-dtype int2")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p={args.top_p} must be in (0, 1]")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        p.error(f"--prompt-file {args.prompt_file} does not exist")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from oscar_jax.compile_cache import use_persistent_cache
    from oscar_jax.parallel import initialize_from_args, make_mesh

    try:  # before anything else touches JAX's backends
        initialize_from_args(args)
        use_persistent_cache()
        mesh = make_mesh(args.tensor_parallel_size) if args.tensor_parallel_size > 1 else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from oscar_jax.cache_api import DenseKVCache
    from oscar_jax.loaders import load_model
    from oscar_jax.model import _decode_step_jit, _prefill_jit, cast_params, describe
    from calibration.import_rotations import read_rotation_path
    from oscar_jax.runtime import OscarRuntime, fingerprint
    from oscar_jax.tokenizer import load_tokenizer
    from oscar_jax.xla import kernels
    from shared_math.artifact import ArtifactError

    model = args.model_path or args.model
    try:
        cfg, params = load_model(model)
        tokenizer = load_tokenizer(model)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = args.prompt if args.prompt is not None else args.prompt_file.read_text(encoding="utf-8")
    if args.chat:
        from oscar_jax.loaders import resolve_model_path
        from oscar_jax.serving.chat import ChatTemplate, TemplateError, read_chat_template

        try:
            text = ChatTemplate(read_chat_template(resolve_model_path(model)), tokenizer).render(
                [{"role": "user", "content": text}])
        except (TemplateError, ValueError) as e:
            print(f"error: --chat: {e} (leave out --chat to continue the prompt as text)", file=sys.stderr)
            return 2
    prompt = np.asarray(tokenizer.encode(text), np.int32)
    max_seq_len = args.max_seq_len or len(prompt) + args.max_new_tokens
    print(f"[oscar] {model}: {describe(cfg)}", file=sys.stderr)
    print(f"[oscar] prompt {len(prompt)} tokens, cache {args.kv_cache_dtype}", file=sys.stderr)

    if args.kv_cache_dtype == "int2":
        rotation_path = args.oscar_rotation_path or shipped_artifact(args.model if not args.model_path else "")
        if rotation_path is None:
            print("error: --oscar-rotation-path is required for this model (run `python -m calibration`)", file=sys.stderr)
            return 2
        try:
            artifact = read_rotation_path(rotation_path, fingerprint(cfg))  # ours, or the authors' .pt pair
            runtime = OscarRuntime(params, cfg, artifact, max_batch=1, max_seq_len=max_seq_len,
                                   sink=args.oscar_sink_size, recent=args.oscar_recent_size,
                                   group_size=args.oscar_group_size, mesh=mesh)
        except (ArtifactError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        oscar_config = runtime.config
        if oscar_config.key_layout == "channel":
            print(f"[oscar] format v2: keys quantized per channel over pages of {oscar_config.page_size} tokens",
                  file=sys.stderr)
        t0 = time.perf_counter()
        seq_id, logits, _ = runtime.admit(prompt)
        step = lambda token: runtime.step([seq_id], [token])[0]  # noqa: E731
    else:
        oscar_config = OscarConfig(head_dim=cfg.head_dim, sink=args.oscar_sink_size, recent=args.oscar_recent_size)
        params = cast_params(params, jnp.bfloat16)
        state = {"cache": DenseKVCache.create(num_layers=cfg.num_layers, batch=1, num_kv_heads=cfg.num_kv_heads,
                                              max_seq_len=max_seq_len, head_dim=cfg.head_dim)}
        t0 = time.perf_counter()
        logits, state["cache"] = _prefill_jit(params, cfg, jnp.asarray(prompt)[None], state["cache"])
        logits = logits[0]
        position = [len(prompt)]

        def step(token):
            out, state["cache"] = _decode_step_jit(params, cfg, jnp.asarray([token]), state["cache"],
                                                   jnp.asarray(position, jnp.int32))
            position[0] += 1
            return out[0]

    jax.block_until_ready(logits)
    prefill_s = time.perf_counter() - t0
    key = jax.random.PRNGKey(args.seed)
    # Every process of a multi-host run decodes the same tokens; the first one prints them.
    stream = TextStream(tokenizer, out=sys.stdout if jax.process_index() == 0 else io.StringIO())
    stop = {t for t in (tokenizer.eos_id,) if t is not None}
    generated, timed, t1 = 0, 0, None
    for i in range(args.max_new_tokens):
        key, sub = jax.random.split(key)
        token = sample(logits, sub, args.temperature, args.top_p)
        stream.push(token)
        generated += 1
        if token in stop or i == args.max_new_tokens - 1:
            break
        logits = step(token)
        if t1 is None:  # the first decode step compiles: time the steady state after it
            jax.block_until_ready(logits)
            t1 = time.perf_counter()
        else:
            timed += 1
    jax.block_until_ready(logits)
    decode_s = time.perf_counter() - t1 if t1 is not None else 0.0
    length = len(prompt) + generated
    oscar = kv_bytes_per_layer(length, oscar_config, cfg.num_kv_heads)
    split = oscar.split
    print("\n")
    print(f"[oscar] tokens: {len(prompt)} prompt + {generated} generated = {length} "
          f"(sink {split.sink_tokens}, INT2 history {split.history_tokens}, BF16 recent {split.recent_tokens})")
    bf16, ours = kv_bytes(cfg, oscar_config, length)
    paged = f"{len(cfg.global_layers)} global layers" if cfg.local_layers else f"{cfg.num_layers} layers"
    windows = (f"; the {len(cfg.local_layers)} sliding-window layers keep {min(length, cfg.sliding_window)} BF16 "
               "tokens each in both" if cfg.local_layers else "")
    print(f"[oscar] KV bytes for this sequence: BF16 {bf16 / 2**20:.2f} MiB, OSCAR {ours / 2**20:.2f} MiB "
          f"({bf16 / max(ours, 1):.2f}x smaller; {oscar.bits_per_element:.3f} bits/element in the {paged}, "
          f"{oscar.allocated_bits_per_element:.3f} with page padding{windows})")
    long = kv_bytes_per_layer(LONG_CONTEXT, oscar_config, cfg.num_kv_heads)
    long_bf16, long_ours = kv_bytes(cfg, oscar_config, LONG_CONTEXT)
    print(f"[oscar] the BF16 windows dominate short sequences; at {LONG_CONTEXT} tokens the same cache would hold "
          f"{long.bits_per_element:.3f} bits/element in the {paged} ({long_bf16 / long_ours:.2f}x smaller)")
    print(f"[oscar] cache {args.kv_cache_dtype}: prefill {len(prompt) / prefill_s:.1f} tok/s "
          f"(includes compilation), decode {timed / decode_s if timed else float('nan'):.2f} tok/s "
          f"on {jax.default_backend()}" + (f" ({kernels()} path)" if args.kv_cache_dtype == "int2" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
