"""Serve a model over an OpenAI-compatible HTTP API, with the OSCAR INT2 cache (or a BF16 one).

    python -m oscar_jax.serve --model smollm2-135m --kv-cache-dtype int2 --host 127.0.0.1 --port 8000

Flags follow vLLM's (--max-num-seqs, --max-model-len, --max-num-batched-tokens, --kv-cache-memory,
--enable-prefix-caching) and the OSCAR articles' (--oscar-rotation-path, --oscar-sink-size,
--oscar-recent-size, --oscar-group-size). `--kv-cache-dtype bf16` runs the same paged runtime with
a recent window that covers the whole context, so nothing is ever quantized: the BF16 baseline
with the same scheduler. Pools: by default room for --max-num-seqs sequences of --max-model-len
tokens; --kv-cache-memory (bytes; K/M/G/KiB/MiB/GiB suffixes) or --num-bf16-pages /
--num-int2-pages size them explicitly (then requests wait, or are preempted, when pages run out).
The server compiles its batch and chunk shapes before it answers /health (--no-warmup skips it);
the programs are kept in JAX's persistent compilation cache ($OSCAR_CACHE_DIR/jax, or
JAX_COMPILATION_CACHE_DIR), so a restart with the same shapes loads them instead.
Multi-host (one process per host, as `oscar_jax.generate`): every process is started with the
same flags and its own --process-id; process 0 serves HTTP and the others run its engine steps.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import time
from pathlib import Path

import numpy as np

from oscar_jax.parallel import add_distributed_arguments, initialize_from_args, validate_distributed_arguments

DEFAULT_MODEL = "smollm2-135m"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1e9'-free integers → bytes (K, M, G, T are powers of 1000; KiB… of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"--kv-cache-memory={text!r} is not a size such as 4GiB or 2000000000")
    value, unit, binary = match.groups()
    base = 1024 if binary.lower().startswith("i") else 1000
    return int(float(value) * base ** " KMGT".index(unit.upper() or " "))


def _buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--decode-buckets={text!r} must be comma-separated integers") from err
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--decode-buckets={text!r} must be positive integers")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oscar_jax.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a known model name, a .gguf file or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--served-model-name", help="the name clients send as 'model' (default: --model)")
    p.add_argument("--kv-cache-dtype", choices=("int2", "bf16"), default="int2")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + output tokens (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, decodes + prefill chunks (default: max(2048, chunk + max-num-seqs))")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prefill chunk length, a multiple of the page size (default: %(default)s)")
    p.add_argument("--decode-buckets", type=_buckets, default=None,
                   help="batch sizes decode compiles for, e.g. 1,4,8 (default: powers of two up to max-num-seqs)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="bytes of K/V pages (both tiers)")
    p.add_argument("--num-bf16-pages", type=int, default=None, help="BF16 pages (sink and recent tiers)")
    p.add_argument("--num-int2-pages", type=int, default=None, help="INT2 pages (history tier)")
    p.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each decode step before reading back the previous one's tokens, so scheduling "
                        "and detokenization run while the device computes (default: on)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached prefix pages within a tenant (cache_salt) (default: on)")
    p.add_argument("--oscar-rotation-path", type=Path, default=None,
                   help="our artifact, or a dir with the OSCAR authors' k_rotation*.pt + v_rotation*.pt "
                        "(default: the artifact shipped for --model)")
    p.add_argument("--oscar-sink-size", type=int, default=64)
    p.add_argument("--oscar-recent-size", type=int, default=256)
    p.add_argument("--oscar-group-size", type=int, default=None, help="default: the artifact's")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices the model and the cache are split over, by heads (default: %(default)s)")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="a jinja2 chat template file (default: the one in the model's tokenizer metadata)")
    p.add_argument("--no-warmup", action="store_true", help="compile on first use instead of at startup")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_distributed_arguments(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("max_num_seqs", "max_model_len", "prefill_chunk", "oscar_sink_size", "tensor_parallel_size"):
        if getattr(args, name) < (0 if name == "oscar_sink_size" else 1):
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(2048, args.prefill_chunk + args.max_num_seqs)
    if args.kv_cache_memory is not None and (args.num_bf16_pages or args.num_int2_pages):
        p.error("give --kv-cache-memory or --num-bf16-pages / --num-int2-pages, not both")
    if not 0 < args.port < 65536:
        p.error(f"--port={args.port} must be in [1, 65535]")
    validate_distributed_arguments(p, args)
    return args


def identity_artifact(cfg):
    """Rotations that leave K and V as they are (the BF16 cache needs no calibration)."""
    from oscar_jax.runtime import fingerprint
    from shared_math.artifact import RotationArtifact

    shape = (cfg.num_layers, cfg.num_kv_heads)
    eye = np.broadcast_to(np.eye(cfg.head_dim, dtype=np.float32), shape + (cfg.head_dim,) * 2).copy()
    ones = np.ones(shape + (cfg.head_dim,), np.float32)
    return RotationArtifact(eye, eye.copy(), ones, ones.copy(), np.ones(cfg.num_layers, np.float32),
                            np.ones(cfg.num_layers, np.float32), fingerprint(cfg),
                            {"group_size": min(cfg.head_dim, 128), "levels": "minmax"}, {"command": "identity"})


def page_bytes(cfg, config) -> tuple[int, int]:
    """Bytes of one BF16 page and one INT2 page over the paged (global) layers, K and V."""
    from shared_math.tiers import bf16_row_bytes, int2_key_page_bytes, int2_row_bytes

    heads = len(cfg.global_layers) * cfg.num_kv_heads
    return (heads * 2 * config.page_size * bf16_row_bytes(config),
            heads * (int2_key_page_bytes(config) + config.page_size * int2_row_bytes(config)))


def pool_sizes(args, cfg, config, log=None) -> tuple[int | None, int | None]:
    """(BF16, INT2) page counts from --kv-cache-memory or the explicit flags (None: the runtime's
    default, room for every sequence at full length)."""
    from oscar_jax.runtime import ring_bytes

    if args.kv_cache_memory is None:
        return args.num_bf16_pages, args.num_int2_pages
    rings = ring_bytes(cfg, args.max_num_seqs, args.prefill_chunk)
    if rings and log is not None:
        log(f"[oscar] sliding-window rings of {args.max_num_seqs} sequences: {rings / 2**20:.1f} MiB of the cache memory")
    return pages_for_memory(args.kv_cache_dtype, args.kv_cache_memory - rings, cfg, config, args.max_num_seqs, log=log)


def pages_for_memory(kind: str, memory_bytes: int, cfg, config, max_num_seqs: int, *, log=None) -> tuple[int, int]:
    """(BF16, INT2) pages (scratch pages included) of `memory_bytes` of cache. bf16: all BF16
    pages. int2: the BF16 windows (sink + recent + 2 pages) of max_num_seqs sequences, the rest
    INT2 history pages — fewer where a codes pool would be a byte array the kernels cannot index
    (`ops.byte_array_addressable`), which `log` is told. Pages hold the global layers only (a
    model's sliding-window rings are not in `memory_bytes`)."""
    from oscar_jax import ops
    from shared_math.spec import CODES_PER_BYTE

    if memory_bytes <= 0:
        raise ValueError(f"{memory_bytes} bytes are left for cache pages")
    bf16_bytes, int2_bytes = page_bytes(cfg, config)
    if kind == "bf16":
        return 1 + memory_bytes // bf16_bytes, 2
    windows = 1 + max_num_seqs * ((config.sink + config.recent) // config.page_size + 2)
    left = memory_bytes - windows * bf16_bytes
    if left < int2_bytes:
        raise ValueError(f"{memory_bytes} bytes of cache do not hold the BF16 windows of {max_num_seqs} sequences "
                         f"({windows} pages of {bf16_bytes} bytes)")
    num_int2 = 1 + left // int2_bytes
    codes_page = len(cfg.global_layers) * cfg.num_kv_heads * config.page_size * config.head_dim // CODES_PER_BYTE
    if not ops.byte_array_addressable(num_int2 * codes_page):
        fewer = ops.UNADDRESSABLE_BYTE_ARRAYS[0] // codes_page
        if log is not None:
            log(f"[oscar] {num_int2} INT2 pages would make each codes pool {num_int2 * codes_page} bytes, which the "
                f"GPU kernels cannot index (2–4 GiB): using {fewer}, {(num_int2 - fewer) * int2_bytes / 2**30:.2f} GiB "
                f"of the cache memory unused")
        num_int2 = fewer
    return windows, num_int2


def build_engine(args, *, log=print):
    """(engine, tokenizer, chat template, model name) from parsed flags. Raises ValueError,
    FileNotFoundError or ArtifactError naming what is wrong."""
    from calibration.import_rotations import read_rotation_path
    from oscar_jax.loaders import load_model, resolve_model_path
    from oscar_jax.model import describe
    from oscar_jax.parallel import make_mesh
    from oscar_jax.runtime import OscarRuntime, fingerprint
    from oscar_jax.serving.chat import ChatTemplate, read_chat_template, read_template_file
    from oscar_jax.serving.engine import Engine, EngineConfig
    from oscar_jax.tokenizer import load_tokenizer
    from shared_math.models import shipped_artifact
    from shared_math.spec import OscarConfig

    cfg, params = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    log(f"[oscar] {args.model}: {describe(cfg)}")
    rotation_path = args.oscar_rotation_path or shipped_artifact(args.model)
    if args.kv_cache_dtype == "int2":
        if rotation_path is None:
            raise ValueError(f"--oscar-rotation-path is required for {args.model!r} with --kv-cache-dtype int2 "
                             "(run `python -m calibration`)")
        artifact = read_rotation_path(rotation_path, fingerprint(cfg))
        sink, recent = args.oscar_sink_size, args.oscar_recent_size
    else:
        artifact = read_rotation_path(rotation_path, fingerprint(cfg)) if rotation_path else identity_artifact(cfg)
        page = OscarConfig(head_dim=cfg.head_dim).page_size
        sink, recent = args.oscar_sink_size, -(-args.max_model_len // page) * page  # never demotes
    group = args.oscar_group_size or artifact.group_size
    config = OscarConfig.from_artifact(artifact, group_size=group, sink=sink, recent=recent)
    num_bf16, num_int2 = pool_sizes(args, cfg, config, log)
    runtime = OscarRuntime(params, cfg, artifact, max_batch=args.max_num_seqs, max_seq_len=args.max_model_len,
                           sink=sink, recent=recent, group_size=group, prefill_chunk=args.prefill_chunk,
                           num_bf16_pages=num_bf16, num_int2_pages=num_int2,
                           mesh=make_mesh(args.tensor_parallel_size) if args.tensor_parallel_size > 1 else None)
    prefix_caching = args.enable_prefix_caching and runtime.shares_prefixes
    if args.enable_prefix_caching and not prefix_caching:
        log(f"[oscar] prefix caching off: {args.model} has sliding-window layers, whose windows no shared page holds")
    engine = Engine(runtime, tokenizer, EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk=args.prefill_chunk, enable_prefix_caching=prefix_caching,
        decode_buckets=args.decode_buckets, overlap=args.overlap_schedule))
    bf16_bytes, int2_bytes = page_bytes(cfg, runtime.config)
    alloc = runtime.allocator
    log(f"[oscar] cache {args.kv_cache_dtype}: {alloc.bf16.num_pages - 1} BF16 pages + {alloc.int2.num_pages - 1} "
        f"INT2 pages of {runtime.config.page_size} tokens "
        f"({(alloc.bf16.num_pages * bf16_bytes + alloc.int2.num_pages * int2_bytes) / 2**20:.1f} MiB), "
        f"sink {runtime.config.sink}, recent {runtime.config.recent}")
    template = (read_template_file(args.chat_template) if args.chat_template is not None
                else read_chat_template(resolve_model_path(args.model)))
    chat = ChatTemplate(template, tokenizer)
    if not chat.available:
        log(f"[oscar] {args.model} has no chat template and does not speak ChatML: /v1/chat/completions answers "
            "400 (--chat-template FILE supplies one)")
    return engine, tokenizer, chat, args.served_model_name or args.model


def prefill_chunk_lengths(runtime) -> list[int]:
    """Every padded chunk length a prefill launch can take: powers of two from the minimum bucket."""
    from oscar_jax.runtime import MIN_PREFILL_BUCKET

    lengths, length = [], MIN_PREFILL_BUCKET
    while length < runtime.prefill_chunk:
        lengths.append(length)
        length *= 2
    return lengths + [runtime.prefill_chunk]


def warmup(engine, *, chunk_lengths=None, decode_buckets=None, log=print) -> None:
    """Compile the prefill chunk and decode batch shapes (default: all of them), then free everything.

    Each shape is logged with its time as it compiles: at Qwen3-8B depth one shape takes tens of
    seconds on an H200, so a server's start is otherwise silent for minutes.
    """
    from oscar_jax.serving.engine import EngineStats
    from oscar_jax.serving.sampling import SamplingParams

    t0 = time.perf_counter()
    chunk_lengths = prefill_chunk_lengths(engine.runtime) if chunk_lengths is None else sorted(chunk_lengths)
    decode_buckets = engine.config.buckets if decode_buckets is None else sorted(decode_buckets)
    for i, n in enumerate(chunk_lengths):
        if n + 2 <= engine.max_model_len:
            t = time.perf_counter()
            # a tenant of its own each, so no prompt starts at another's prefix hit
            engine.add_request([1] * n, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), f"warmup-p{i}",
                               tenant=f"warmup-p{i}")
            while engine.has_work():
                engine.step()
            log(f"[oscar] warmup: prefill chunk {n} in {time.perf_counter() - t:.1f} s")
    # Decode warm-up prompts are prefilled in a chunk shape compiled above, each its own tenant so
    # that no prefix hit shortens its chunk (else their prefill compiles one more shape, a minute at
    # Qwen3-8B depth); a bucket is reached by one row more than the bucket below it holds.
    prompt_len = min((n for n in chunk_lengths if n + 3 <= engine.max_model_len), default=1)
    for below, b in zip([0] + list(decode_buckets), decode_buckets):
        t = time.perf_counter()
        for temperature in (0.0, 0.5):  # the greedy and the sampling kernels
            for i in range(below + 1):
                engine.add_request([1] * prompt_len,
                                   SamplingParams(max_tokens=3, temperature=temperature, seed=i, ignore_eos=True),
                                   f"warmup-{b}-{temperature}-{i}", tenant=f"warmup-{b}-{temperature}-{i}")
            while engine.has_work():
                engine.step()
        engine.runtime.compile_demotion(b)  # warm-up prompts seldom cross a page: compiled directly
        log(f"[oscar] warmup: decode batch {b} in {time.perf_counter() - t:.1f} s")
    engine.compile_feeds()  # with overlap: the hand-over of tokens between any two decode buckets
    engine.stats = EngineStats()  # serving statistics start now
    log(f"[oscar] compiled decode batches {list(decode_buckets)} and prefill chunks {chunk_lengths} "
        f"in {time.perf_counter() - t0:.1f} s")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    from oscar_jax.compile_cache import use_persistent_cache
    from shared_math.artifact import ArtifactError

    try:
        initialize_from_args(args)  # before anything else touches JAX's backends
        compiled_programs = use_persistent_cache()
        if compiled_programs is not None:
            log(f"[oscar] compiled programs kept in {compiled_programs} (a restart loads them)")
        engine, tokenizer, chat, name = build_engine(args, log=log)
    except (ValueError, FileNotFoundError, ArtifactError, NotImplementedError) as err:
        log(f"error: {err}")
        return 2
    if not args.no_warmup:
        warmup(engine, log=log)

    import jax

    from oscar_jax.serving.multihost import StepMirror, follow

    mirror = StepMirror() if jax.process_count() > 1 else None
    if mirror is not None and not mirror.is_source:
        log(f"[oscar] process {jax.process_index()} of {jax.process_count()}: running process 0's engine steps")
        steps = follow(engine, mirror)
        log(f"[oscar] process 0 stopped serving after {steps} steps")
        jax.distributed.shutdown()  # process 0 waits for every process here before it exits
        return 0

    import uvicorn

    from oscar_jax.serving.async_engine import AsyncEngine
    from oscar_jax.serving.metrics import Metrics
    from oscar_jax.serving.server import Server, create_app

    metrics = Metrics(name)
    async_engine = AsyncEngine(engine, metrics, mirror)
    async_engine.start()
    metrics.update(engine)

    def shutdown():
        async_engine.stop()  # with a mirror: tells the other processes to stop
        if mirror is not None:
            jax.distributed.shutdown()

    app = StopOnShutdown(create_app(Server(async_engine, tokenizer, chat, name)), shutdown)
    log(f"[oscar] serving {name!r} on http://{args.host}:{args.port}/v1")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.stop()
    return 0


class StopOnShutdown:
    """An ASGI app that runs `stop` (in a thread) when the server shuts down, before uvicorn
    returns: on SIGTERM or SIGINT uvicorn re-raises the signal once it has shut down, so code
    after `uvicorn.run` may never run."""

    def __init__(self, app, stop):
        self.app, self.stop = app, stop

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def receive_then_stop():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await asyncio.to_thread(self.stop)
            return message

        return await self.app(scope, receive_then_stop, send)


if __name__ == "__main__":
    sys.exit(main())
