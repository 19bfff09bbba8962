"""OscarRuntime: a model decoding from OscarKVCache — admit (prefill), step (decode), finish.

The host plans every step with the PageAllocator (page tables, write destinations, demotions);
the device runs one jitted, cache-donating function per step. Prompts are admitted one at a
time, so a prompt can reuse pages of any earlier prompt in its namespace (prefix sharing) and
never pages that are still being written.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from shared_math.allocator import PageAllocator
from oscar_jax.cache import OscarKVCache, StepPlan
from oscar_jax.model import ModelConfig, Params, decode_step, fold_value_rotation, fuse_qkv, prefill
from shared_math.artifact import ModelFingerprint, RotationArtifact
from shared_math.spec import OscarConfig
from shared_math.tiers import tier_split

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
        interpret: bool | None = None,
    ):
        if artifact.model != fingerprint(cfg):
            raise ValueError(f"the rotation artifact was calibrated for {artifact.model}, not {fingerprint(cfg)}")
        defaults = OscarConfig(head_dim=cfg.head_dim)
        self.config = OscarConfig(
            head_dim=cfg.head_dim,
            group_size=group_size or artifact.group_size,
            k_clip_ratio=float(artifact.k_clip_ratio[0]),  # per-layer ratios live in the cache
            v_clip_ratio=float(artifact.v_clip_ratio[0]),
            levels=artifact.levels,
            sink=defaults.sink if sink is None else sink,
            recent=defaults.recent if recent is None else recent,
            page_size=page_size or defaults.page_size,
        )
        self.cfg = cfg
        self.params = fuse_qkv(fold_value_rotation(params, cfg, artifact.v_rotation))
        self.max_seq_len = max_seq_len
        page = self.config.page_size
        if prefill_chunk < page or prefill_chunk % page:
            raise ValueError(f"{prefill_chunk=} must be a positive multiple of the page size {page}")
        self.prefill_chunk = prefill_chunk
        self.history_slots = -(-max_seq_len // page)
        per_seq_bf16 = (self.config.sink + self.config.recent) // page + 1
        num_bf16 = 1 + max_batch * per_seq_bf16 + extra_pages
        num_int2 = 1 + max_batch * self.history_slots + extra_pages
        self.allocator = PageAllocator(self.config, num_bf16_pages=num_bf16, num_int2_pages=num_int2)
        self.cache = OscarKVCache.create(
            self.config, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            num_bf16_pages=num_bf16, num_int2_pages=num_int2, k_rotation=artifact.k_rotation,
            k_clip_ratio=artifact.k_clip_ratio, v_clip_ratio=artifact.v_clip_ratio, interpret=interpret,
        )

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
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if len(tokens) > self.max_seq_len:
            raise ValueError(f"prompt of {len(tokens)} tokens exceeds max_seq_len={self.max_seq_len}")
        plan = self.allocator.admit(tokens.tolist(), namespace=namespace, share_prefix=share_prefix)
        seq = self.allocator.sequences[plan.seq_id]
        length = plan.length
        assert plan.reused_tokens < length, "the allocator never shares the page holding the last token"
        split = tier_split(length, self.config)
        cfg, page = self.config, self.config.page_size
        for start in range(plan.reused_tokens, length, self.prefill_chunk):
            chunk = min(self.prefill_chunk, length - start)
            bucket = max(MIN_PREFILL_BUCKET, 1 << (chunk - 1).bit_length())
            writes = self._no_write((1, bucket))
            for i, position in enumerate(range(start, start + chunk)):
                tier, page_id, slot = self._destination(seq, position, split)
                writes[f"{tier}_write_page"][0, i], writes[f"{tier}_write_slot"][0, i] = page_id, slot
            # The prefix before this chunk, in its final tiers (chunk starts are page-aligned).
            sink = min(start, split.sink_tokens)
            history = min(max(start - split.history_start, 0), split.history_tokens)
            recent = max(start - split.recent_start, 0)
            tables = self.allocator.tables([plan.seq_id], self.history_slots)
            tables["history_page_table"][0, history // page :] = 0
            tables["bf16_page_table"][0, cfg.sink // page + -(-recent // page) :] = 0
            tables.update(sink_tokens=np.array([sink], np.int32), recent_tokens=np.array([recent], np.int32),
                          history_tokens=np.array([history], np.int32))
            cache = self.cache.with_plan(self._plan(tables, writes, [chunk]), "prefill")
            padded = np.zeros((1, bucket), np.int32)
            padded[0, :chunk] = tokens[start : start + chunk]
            positions = (start + np.arange(bucket, dtype=np.int32))[None]
            logits, cache = _prefill(self.params, self.cfg, jnp.asarray(padded), cache, jnp.asarray(positions),
                                     jnp.asarray([chunk], jnp.int32))
            self.cache = dataclasses.replace(cache, plan=None)
        return plan.seq_id, logits[0], plan.reused_tokens

    def step(self, seq_ids, tokens) -> jax.Array:
        """Append one token to each sequence and decode: logits f32 [B, V]."""
        seq_ids = list(seq_ids)
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if len(tokens) != len(seq_ids):
            raise ValueError(f"{len(tokens)} tokens for {len(seq_ids)} sequences")
        for sid in seq_ids:
            if self.allocator.sequences[sid].length >= self.max_seq_len:
                raise ValueError(f"sequence {sid} reached max_seq_len={self.max_seq_len}")
        positions = np.array([self.allocator.sequences[s].length for s in seq_ids], np.int32)
        demotions = [self.allocator.extend(sid, tok) for sid, tok in zip(seq_ids, tokens)]
        tables = self.allocator.tables(seq_ids, self.history_slots)
        writes = self._no_write((len(seq_ids), 1))
        for i, (sid, position) in enumerate(zip(seq_ids, positions)):
            seq = self.allocator.sequences[sid]
            page, sink = self.config.page_size, int(tables["sink_tokens"][i])
            if position < self.config.sink:
                writes["bf16_write_page"][i, 0], writes["bf16_write_slot"][i, 0] = seq.sink_pages[position // page], position % page
            else:
                offset = position - sink - int(tables["history_tokens"][i])
                writes["bf16_write_page"][i, 0], writes["bf16_write_slot"][i, 0] = seq.recent_pages[offset // page], offset % page
        cache = self.cache.with_plan(self._plan(tables, writes, np.ones(len(seq_ids))), "decode")
        logits, cache = _decode(self.params, self.cfg, jnp.asarray(tokens), cache, jnp.asarray(positions))
        cache = dataclasses.replace(cache, plan=None)
        due = [d for d in demotions if d is not None]
        if due:
            src = jnp.asarray([d.src_bf16_page for d in due], jnp.int32)
            dst = jnp.asarray([d.dst_int2_page for d in due], jnp.int32)
            cache = _demote(cache, src, dst)
            for d in due:
                self.allocator.demoted(d)
        self.cache = cache
        return logits

    def finish(self, seq_id: int) -> None:
        self.allocator.finish(seq_id)

    def length(self, seq_id: int) -> int:
        return self.allocator.sequences[seq_id].length
