"""OscarRuntime: a model decoding from OscarKVCache — admit (prefill), step (decode), finish.

The host plans every step with the PageAllocator (page tables, write destinations, demotions);
the device runs one jitted, cache-donating function per step. A prompt is either admitted whole
(`admit`) or started (`start`) and then prefilled chunk by chunk between decode steps
(`prefill`, what a serving engine does). A prompt's pages are published for prefix sharing only
once their chunk is written, so a prompt can reuse pages of any earlier prompt in its namespace
and never pages that are still being written.

Models with sliding-window layers (Gemma 3's local layers): only the global layers use the OSCAR
cache; each live sequence gets a BF16 ring of its own for the local layers
(oscar_jax.window_cache), `max_batch` rings in all plus a scratch ring for padded rows. Such a
runtime shares no prefixes: a shared page would come without the local layers' window, which no
page holds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from shared_math.allocator import SCRATCH_PAGE, AdmitPlan, PageAllocator, PoolExhausted
from oscar_jax.cache import OscarKVCache, StepPlan
from oscar_jax.model import ModelConfig, Params, decode_step, fold_value_rotation, fuse_qkv, prefill
from oscar_jax.parallel import TensorParallel
from oscar_jax.window_cache import LayerRoutedKVCache, SlidingWindowKVCache
from shared_math.artifact import ModelFingerprint, RotationArtifact
from shared_math.spec import OscarConfig
from shared_math.tiers import demotes_on_append, tier_split

MIN_PREFILL_BUCKET = 16  # chunks are padded to a power of two ≥ this, to bound recompilation
DEFAULT_PREFILL_CHUNK = 512  # tokens per prefill launch (a multiple of the page size)


def fingerprint(cfg: ModelConfig) -> ModelFingerprint:
    return ModelFingerprint(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim)


@functools.partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def _prefill(params, cfg, tokens, cache, positions, lengths):
    return prefill(params, cfg, tokens, cache, positions=positions, lengths=lengths)


@functools.partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def _decode(params, cfg, tokens, cache, positions):
    return decode_step(params, cfg, tokens, cache, positions)


@functools.partial(jax.jit, donate_argnames="cache")
def _demote(cache, src, dst):
    return cache.demote(src, dst)


@functools.partial(jax.jit, donate_argnames="rings")
def _reset_ring(rings, ring):
    return rings.reset(ring)


SCRATCH_RING = 0  # the ring of padded batch rows (as SCRATCH_PAGE is their page)


def ring_bytes(cfg: ModelConfig, max_batch: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> int:
    """Bytes of the sliding-window rings a runtime allocates (0 without local layers)."""
    if not cfg.local_layers:
        return 0
    return (1 + max_batch) * SlidingWindowKVCache.nbytes_per_ring(
        num_layers=len(cfg.local_layers), num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        window=cfg.sliding_window, max_chunk=prefill_bucket(prefill_chunk))


def prefill_bucket(length: int) -> int:
    """The padded length of a prefill launch of `length` tokens: a power of two ≥ MIN_PREFILL_BUCKET."""
    return max(MIN_PREFILL_BUCKET, 1 << (length - 1).bit_length())


class OscarRuntime:
    """A model with folded value rotations and a paged OSCAR cache for up to `max_batch` sequences."""

    def __init__(
        self,
        params: Params,
        cfg: ModelConfig,
        artifact: RotationArtifact,
        *,
        max_batch: int = 1,
        max_seq_len: int = 8192,
        sink: int | None = None,
        recent: int | None = None,
        group_size: int | None = None,
        page_size: int | None = None,
        extra_pages: int = 0,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        num_bf16_pages: int | None = None,
        num_int2_pages: int | None = None,
        interpret: bool | None = None,
        mesh: jax.sharding.Mesh | None = None,
        prefill_pages_per_split: int | None = None,
    ):
        """Pools default to room for `max_batch` sequences of `max_seq_len` tokens (+ extra_pages
        each); num_bf16_pages / num_int2_pages size them explicitly (page 0 of each is scratch).
        mesh: a mesh with axis "tp" (oscar_jax.parallel.make_mesh) runs the model and the cache
        tensor-parallel over its devices; the page counts are per KV head, as on one device.
        prefill_pages_per_split: the split of a prefill chunk's cache partials (OscarKVCache's field;
        None: the tiling policy's)."""
        if artifact.model != fingerprint(cfg):
            raise ValueError(f"the rotation artifact was calibrated for {artifact.model}, not {fingerprint(cfg)}")
        if cfg.local_layers and mesh is not None:
            raise ValueError(f"tensor parallelism over {mesh.devices.size} devices does not cover sliding-window "
                             f"layers yet (this model has {len(cfg.local_layers)}): run it on one device")
        self.config = OscarConfig.from_artifact(artifact, group_size=group_size, sink=sink, recent=recent,
                                                page_size=page_size)
        self.cfg = cfg
        self.tp = None if mesh is None else TensorParallel.plan(cfg, mesh)
        folded = fold_value_rotation(params, cfg, artifact.v_rotation)
        self.params = fuse_qkv(folded) if self.tp is None else self.tp.shard_params(folded)
        self._steps = (_prefill, _decode, _demote) if self.tp is None else (
            self.tp.prefill, self.tp.decode, self.tp.demote)
        self.max_seq_len = max_seq_len
        page = self.config.page_size
        if prefill_chunk < page or prefill_chunk % page:
            raise ValueError(f"{prefill_chunk=} must be a positive multiple of the page size {page}")
        self.prefill_chunk = prefill_chunk
        # The most history pages a sequence of max_seq_len tokens holds (tier_split): the sink and the
        # recent window never demote, so their tokens need no history slot. Every slot is gathered by
        # the XLA path's attention, so a table sized by max_seq_len // page read ~40% empty slots at
        # 1K tokens.
        self.history_slots = max(1, (max_seq_len - self.config.sink - self.config.recent) // page)
        per_seq_bf16 = (self.config.sink + self.config.recent) // page + 1
        num_bf16 = num_bf16_pages or 1 + max_batch * per_seq_bf16 + extra_pages
        num_int2 = num_int2_pages or 1 + max_batch * self.history_slots + extra_pages
        self.max_batch = max_batch
        self._written: dict[int, int] = {}  # seq_id → prompt tokens prefilled so far
        self.allocator = PageAllocator(self.config, num_bf16_pages=num_bf16, num_int2_pages=num_int2)
        # The OSCAR pools hold the global layers only (all layers of a model without local ones).
        paged = np.asarray(cfg.global_layers)
        pools = dict(num_bf16_pages=num_bf16, num_int2_pages=num_int2,
                     k_rotation=np.asarray(artifact.k_rotation)[paged],
                     k_clip_ratio=np.asarray(artifact.k_clip_ratio).reshape(-1)[paged],
                     v_clip_ratio=np.asarray(artifact.v_clip_ratio).reshape(-1)[paged], interpret=interpret)
        self.cache = (self.tp.create_cache(self.config, **pools) if self.tp is not None else
                      OscarKVCache.create(self.config, num_layers=len(paged), num_kv_heads=cfg.num_kv_heads,
                                          **pools))
        self.rings: SlidingWindowKVCache | None = None
        self._ring_of: dict[int, int] = {}  # seq_id → its ring (models with local layers)
        if cfg.local_layers:
            self.rings = SlidingWindowKVCache.create(
                num_layers=len(cfg.local_layers), batch=1 + max_batch, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, window=cfg.sliding_window, max_chunk=prefill_bucket(prefill_chunk))
            self._free_rings = list(range(max_batch, SCRATCH_RING, -1))
        if prefill_pages_per_split is not None:
            self.cache = dataclasses.replace(self.cache, prefill_pages_per_split=prefill_pages_per_split)

    # ------------------------------------------------------------------ planning

    def _no_write(self, shape) -> dict[str, np.ndarray]:
        bf16_pages, int2_pages = self.cache.k_bf16.shape[1], self.cache.k_codes.shape[1]
        return {
            "bf16_write_page": np.full(shape, bf16_pages, np.int32), "bf16_write_slot": np.zeros(shape, np.int32),
            "int2_write_page": np.full(shape, int2_pages, np.int32), "int2_write_slot": np.zeros(shape, np.int32),
        }

    def _plan(self, tables: dict, writes: dict, new_tokens) -> StepPlan:
        return StepPlan(
            bf16_page_table=jnp.asarray(tables["bf16_page_table"]),
            history_page_table=jnp.asarray(tables["history_page_table"]),
            sink_tokens=jnp.asarray(tables["sink_tokens"]),
            recent_tokens=jnp.asarray(tables["recent_tokens"]),
            history_tokens=jnp.asarray(tables["history_tokens"]),
            new_tokens=jnp.asarray(np.asarray(new_tokens, np.int32)),
            **{k: jnp.asarray(v) for k, v in writes.items()},
        )

    @property
    def shares_prefixes(self) -> bool:
        """Whether prompts can reuse another's pages (not with sliding-window layers: module docstring)."""
        return self.rings is None

    def _run(self, fn, plan: StepPlan, phase: str, rows, tokens, *inputs):
        """fn(params, cfg, tokens, cache, *inputs), one jitted step, over the cache with this
        step's plan and, for local layers, the rings of `rows` (a sequence id per batch row, None
        for padding); keeps the updated cache. Returns the step's logits."""
        cache = self.cache.with_plan(plan, phase)
        if self.rings is not None:
            ring_rows = np.asarray([SCRATCH_RING if sid is None else self._ring_of[sid] for sid in rows], np.int32)
            cache = LayerRoutedKVCache.for_layer_types(self.cfg.layer_types, global_cache=cache,
                                                       local_cache=self.rings.with_rows(ring_rows))
        logits, cache = fn(self.params, self.cfg, tokens, cache, *inputs)
        if self.rings is not None:
            self.rings = dataclasses.replace(cache.local_cache, rows=None)
            cache = cache.global_cache
        self.cache = dataclasses.replace(cache, plan=None)
        return logits

    def _destination(self, seq, position: int, split) -> tuple[str, int, int]:
        """(tier, page, slot) of a position under the given split."""
        page = self.config.page_size
        if position < split.sink_tokens:
            return "bf16", seq.sink_pages[position // page], position % page
        if position < split.recent_start:
            offset = position - split.history_start
            return "int2", seq.history_pages[offset // page], offset % page
        offset = position - split.recent_start
        return "bf16", seq.recent_pages[offset // page], offset % page

    # ------------------------------------------------------------------ public API

    def admit(self, tokens, *, namespace: str | None = None, share_prefix: bool = True):
        """Admit and prefill a prompt. Returns (seq_id, logits f32 [V] of its last token, reused tokens).

        The prompt is prefilled in chunks of `prefill_chunk` tokens; every token is written once,
        straight into its final tier (history positions are quantized by the fused write). A
        chunk attends to itself in full precision and to everything before it through the tiers.
        """
        plan = self.start(tokens, namespace=namespace, share_prefix=share_prefix)
        for begin in range(plan.reused_tokens, plan.length, self.prefill_chunk):
            logits = self.prefill(plan.seq_id, begin, min(begin + self.prefill_chunk, plan.length))
        return plan.seq_id, logits, plan.reused_tokens

    def start(self, tokens, *, namespace: str | None = None, share_prefix: bool = True) -> AdmitPlan:
        """Allocate the pages of a prompt (reusing its namespace's prefix pages) without computing
        anything: `prefill` then writes tokens [reused_tokens, length) in page-aligned chunks.
        Raises PoolExhausted, with nothing allocated, when the pools cannot hold the prompt."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if len(tokens) > self.max_seq_len:
            raise ValueError(f"prompt of {len(tokens)} tokens exceeds max_seq_len={self.max_seq_len}")
        if self.rings is not None and not self._free_rings:
            raise PoolExhausted(f"all {self.max_batch} sliding-window rings (max_batch) hold live sequences: "
                                "finish one first")
        plan = self.allocator.admit(tokens.tolist(), namespace=namespace,
                                    share_prefix=share_prefix and self.shares_prefixes)
        if self.rings is not None:
            self._ring_of[plan.seq_id] = ring = self._free_rings.pop()
            self.rings = _reset_ring(self.rings, ring)
        assert plan.reused_tokens < plan.length, "the allocator never shares the page holding the last token"
        self._written[plan.seq_id] = plan.reused_tokens
        # The allocator registers every full page of the prompt at admission; until a page is
        # written, a request of the same namespace must not find it.
        self._publish(plan.seq_id)
        return plan

    def prefill(self, seq_id: int, start: int, stop: int) -> jax.Array:
        """Write prompt tokens [start, stop) of a started sequence: logits f32 [V] of token stop − 1.

        `start` must be where the previous chunk ended (a multiple of the page size) and the chunk
        at most `prefill_chunk` long; its length is padded to a power of two ≥ MIN_PREFILL_BUCKET.
        """
        seq = self._sequence(seq_id)
        written, length, page = self._written.get(seq_id, seq.length), seq.length, self.config.page_size
        if start != written or not start < stop <= length or stop - start > self.prefill_chunk:
            raise ValueError(f"sequence {seq_id}: chunk [{start}, {stop}) must start at {written} (tokens "
                             f"written), end by {length} and hold at most prefill_chunk={self.prefill_chunk}")
        if start % page:
            raise ValueError(f"sequence {seq_id}: chunk {start=} must be a multiple of the page size {page}")
        split = tier_split(length, self.config)
        chunk = stop - start
        bucket = prefill_bucket(chunk)
        writes = self._no_write((1, bucket))
        for i, position in enumerate(range(start, stop)):
            tier, page_id, slot = self._destination(seq, position, split)
            writes[f"{tier}_write_page"][0, i], writes[f"{tier}_write_slot"][0, i] = page_id, slot
        # The prefix before this chunk, in its final tiers (chunk starts are page-aligned).
        sink = min(start, split.sink_tokens)
        history = min(max(start - split.history_start, 0), split.history_tokens)
        recent = max(start - split.recent_start, 0)
        tables = self.allocator.tables([seq_id], self.history_slots)
        tables["history_page_table"][0, history // page :] = 0
        tables["bf16_page_table"][0, self.config.sink // page + -(-recent // page) :] = 0
        tables.update(sink_tokens=np.array([sink], np.int32), recent_tokens=np.array([recent], np.int32),
                      history_tokens=np.array([history], np.int32))
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :chunk] = seq.tokens[start:stop]
        positions = (start + np.arange(bucket, dtype=np.int32))[None]
        logits = self._run(self._steps[0], self._plan(tables, writes, [chunk]), "prefill", [seq_id],
                           jnp.asarray(padded), jnp.asarray(positions), jnp.asarray([chunk], jnp.int32))
        if stop == length:
            del self._written[seq_id]
        else:
            self._written[seq_id] = stop
        self._publish(seq_id)
        return logits[0]

    def prefilled(self, seq_id: int) -> int:
        """Prompt tokens of a sequence written so far (its length once the prompt is done)."""
        seq = self._sequence(seq_id)
        return self._written.get(seq_id, seq.length)

    def _publish(self, seq_id: int) -> None:
        """Register the sink and history pages of a sequence that are written (up to its
        prefilled length) for prefix sharing; withdraw this sequence's registrations of pages
        that are not written yet."""
        alloc, page = self.allocator, self.config.page_size
        seq = alloc.sequences[seq_id]
        written = self.prefilled(seq_id)
        split = tier_split(seq.length, self.config)
        full_sink = [(alloc.bf16, p, (j + 1) * page) for j, p in enumerate(seq.sink_pages)
                     if (j + 1) * page <= split.sink_tokens]
        history = [(alloc.int2, p, split.history_start + (j + 1) * page) for j, p in enumerate(seq.history_pages)]
        for pool, page_id, end in full_sink + history:
            key = alloc._page_end_key(seq, end)
            if end <= written:
                pool.register(key, page_id)
            elif pool.registry.get(key) == page_id:
                del pool.registry[key], pool.key_of[page_id]

    def pages_needed(self, seq_ids) -> tuple[int, int]:
        """(BF16, INT2) pages that one `step` of these sequences allocates (new recent or sink
        pages, demotion destinations)."""
        bf16 = int2 = 0
        for sid in seq_ids:
            seq = self._sequence(sid)
            demote = demotes_on_append(seq.length, self.config)
            split = tier_split(seq.length + 1, self.config)
            bf16 += max(0, split.sink_pages - len(seq.sink_pages))
            bf16 += max(0, split.recent_pages + demote - len(seq.recent_pages))
            int2 += int(demote)
        return bf16, int2

    def free_pages(self) -> tuple[int, int]:
        """(BF16, INT2) pages that allocation can hand out (free or cached, never scratch)."""
        return self.allocator.bf16.num_free, self.allocator.int2.num_free

    def _sequence(self, seq_id):
        if not isinstance(seq_id, (int, np.integer)) or seq_id not in self.allocator.sequences:
            raise ValueError(f"unknown sequence {seq_id!r}: not admitted, or already finished "
                             f"(live: {sorted(self.allocator.sequences)[:16]})")
        return self.allocator.sequences[seq_id]

    def step(self, seq_ids, tokens, *, batch_size: int | None = None, known=None) -> jax.Array:
        """Append one token to each sequence and decode: logits f32 [B, V].

        batch_size pads the batch to that many rows (rows past len(seq_ids) read and write
        nothing; their logits are meaningless), so callers that vary the batch compile once per
        padded size. tokens: host ints, one per sequence, or an int32 jax.Array of `batch_size`
        rows already on the device (a previous step's samples, not read back), with `known` the
        values the host has of them (one per sequence, None where unknown: `set_tokens` gives
        those later). Nothing changes when a check fails: each sequence at most once, every one
        admitted and fully prefilled, and the pools able to hold the step's new pages (else
        PoolExhausted).
        """
        seq_ids = list(seq_ids)
        on_device = isinstance(tokens, jax.Array)
        if not on_device:
            tokens = np.asarray(tokens, np.int32).reshape(-1)
        if not seq_ids:
            raise ValueError("step needs at least one sequence")
        rows = len(seq_ids) if batch_size is None else batch_size
        if rows < len(seq_ids):
            raise ValueError(f"{batch_size=} is smaller than the {len(seq_ids)} sequences")
        if on_device and tokens.shape != (rows,):
            raise ValueError(f"tokens on the device must be one per padded row, shape ({rows},); got {tokens.shape}")
        if not on_device and len(tokens) != len(seq_ids):
            raise ValueError(f"{len(tokens)} tokens for {len(seq_ids)} sequences")
        seen = set()
        for sid in seq_ids:
            seq = self._sequence(sid)
            if sid in seen:
                raise ValueError(f"sequence {sid} appears more than once in one step ({seq_ids})")
            seen.add(sid)
            if sid in self._written:
                raise ValueError(f"sequence {sid} is still prefilling ({self._written[sid]} of {seq.length} "
                                 "prompt tokens written)")
            if seq.length >= self.max_seq_len:
                raise ValueError(f"sequence {sid} reached max_seq_len={self.max_seq_len}")
        need, free = self.pages_needed(seq_ids), self.free_pages()
        for tier, n, f in zip(("BF16", "INT2"), need, free):
            if n > f:
                raise PoolExhausted(f"this step needs {n} new {tier} pages and {f} are free: finish or "
                                    "preempt a sequence first")
        positions = np.zeros(rows, np.int32)
        positions[: len(seq_ids)] = [self.allocator.sequences[s].length for s in seq_ids]
        if on_device:
            host_tokens = [None] * len(seq_ids) if known is None else list(known)
            if len(host_tokens) != len(seq_ids):
                raise ValueError(f"{len(host_tokens)} known tokens for {len(seq_ids)} sequences")
            padded_tokens = tokens.astype(jnp.int32)
        else:
            padded_tokens = np.zeros(rows, np.int32)
            padded_tokens[: len(seq_ids)] = host_tokens = tokens
        demotions = [self.allocator.extend(sid, tok) for sid, tok in zip(seq_ids, host_tokens)]
        tables = self._padded(self.allocator.tables(seq_ids, self.history_slots), rows)
        writes = self._no_write((rows, 1))
        for i, (sid, position) in enumerate(zip(seq_ids, positions)):
            seq = self.allocator.sequences[sid]
            page, sink = self.config.page_size, int(tables["sink_tokens"][i])
            if position < self.config.sink:
                writes["bf16_write_page"][i, 0], writes["bf16_write_slot"][i, 0] = seq.sink_pages[position // page], position % page
            else:
                offset = position - sink - int(tables["history_tokens"][i])
                writes["bf16_write_page"][i, 0], writes["bf16_write_slot"][i, 0] = seq.recent_pages[offset // page], offset % page
        new_tokens = np.zeros(rows, np.int32)
        new_tokens[: len(seq_ids)] = 1
        logits = self._run(self._steps[1], self._plan(tables, writes, new_tokens), "decode",
                           seq_ids + [None] * (rows - len(seq_ids)), jnp.asarray(padded_tokens), jnp.asarray(positions))
        cache = self.cache
        due = [d for d in demotions if d is not None]
        if due:
            src, dst = self._demotion_pages(len(due))
            src[: len(due)] = [d.src_bf16_page for d in due]
            dst[: len(due)] = [d.dst_int2_page for d in due]
            cache = self._steps[2](cache, jnp.asarray(src), jnp.asarray(dst))
            for d in due:
                self.allocator.demoted(d)
        self.cache = cache
        return logits

    def set_tokens(self, seq_ids, positions, tokens) -> None:
        """The values of tokens a `step` took on the device (host ints, one per sequence)."""
        for sid, position, token in zip(seq_ids, positions, tokens, strict=True):
            self.allocator.set_token(sid, position, token)

    @staticmethod
    def _demotion_pages(count: int) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) page ids for `count` demotions, padded to a power of two with scratch page →
        scratch page: a few demotion shapes, however many rows of a batch cross a page at once.
        (The padding all writes the same bytes to the INT2 scratch page, which no table reads.)"""
        size = 1 << max(count - 1, 0).bit_length()
        return np.full(size, SCRATCH_PAGE, np.int32), np.full(size, SCRATCH_PAGE, np.int32)

    def compile_demotion(self, batch_size: int) -> None:
        """Compile every demotion shape of a decode batch of up to `batch_size` rows (a server's
        warm-up) by running each on padding alone: only the scratch pages are touched."""
        for count in sorted({len(self._demotion_pages(n)[0]) for n in range(1, batch_size + 1)}):
            src, dst = self._demotion_pages(count)
            self.cache = self._steps[2](self.cache, jnp.asarray(src), jnp.asarray(dst))

    @staticmethod
    def _padded(tables: dict, rows: int) -> dict:
        """Page tables padded with rows that hold no token (scratch pages, zero counts)."""
        out = {}
        for name, table in tables.items():
            padded = np.zeros((rows,) + table.shape[1:], table.dtype)
            padded[: len(table)] = table
            out[name] = padded
        return out

    def finish(self, seq_id: int) -> None:
        """Release a sequence's pages (also mid-prefill: its unwritten pages were never published)."""
        self._sequence(seq_id)
        self._written.pop(seq_id, None)
        self.allocator.finish(seq_id)
        if seq_id in self._ring_of:
            self._free_rings.append(self._ring_of.pop(seq_id))

    def length(self, seq_id: int) -> int:
        return self._sequence(seq_id).length

