"""Hugging Face transformers (5.x) integration: OSCAR's paged 2-bit KV cache behind `generate()`.

    import oscar_torch.hf                       # registers the attention implementation "oscar"
    from oscar_torch.hf import OscarHFCache

    model.set_attn_implementation("oscar")      # or from_pretrained(..., attn_implementation="oscar")
    cache = OscarHFCache.from_artifact(artifact_dir, model.config, max_cache_len=4096)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64, do_sample=False)

Two pieces, used together (each refuses to run without the other):

* `OscarHFCache`, a `transformers.Cache`: the paged mixed-precision pools of every layer
  (`oscar_torch.cache.OscarTorchCache`: sink and recent tiers in BF16, history in INT2 pages of
  format v1) and the host planning of each step (`shared_math.allocator.PageAllocator`, pure
  numpy). Its `update(key, value, layer)` — what LlamaAttention / Qwen3Attention call — plans the
  step at layer 0 and returns the new key/value states unchanged: it never materialises a key/value
  tensor of the whole sequence. transformers 5.x hands the attention function neither the cache nor
  the layer (it gets the module, q, k, v, the mask and the model's kwargs), so `update` leaves
  (cache, layer) as this thread's pending update (`_PendingUpdate`) and the attention function takes
  it for exactly the key tensor `update` returned — no attribute on transformers' or torch's
  objects, no patching.
* the attention function registered in transformers' `AttentionInterface` as "oscar". Weights
  are not folded here, so it applies the rotations itself: q' = q·R_K and k' = k·R_K (one R_K per
  KV head, inside `OscarTorchCache.attend`), v' = v·R_V before the write, and o = o'·R_Vᵀ after
  attention. Keys and values are written into their tiers (history positions of a prompt through
  the fused rotate + quantize + pack kernel) and attention reads the pools in place through
  `oscar_torch.ops.prefill_attention` / `decode_attention` (two-tier split-K, log-sum-exp merge).

Semantics are those of `oscar_jax.runtime.OscarRuntime`: a prompt (the first forward on an
empty cache) is prefilled in chunks of `prefill_chunk` (512) tokens, each chunk attending to
itself in full precision (float32) and to the chunks before it through the tiers, every position
written once into its final tier (history positions quantized from their float32 rows); then one
token per forward (decode), reading sink + history + recent; when the recent window reaches
`recent + page_size` tokens, its oldest page is demoted to INT2 (from its BF16 rows) after the
step, in every layer at once. Defaults: sink 64, recent 256, page 16, the artifact's group size,
clip ratios and encoder.

Supported: Llama-family and Qwen3 decoders (full attention; head_dim a power of two ≥ 16),
batches of up to `max_batch_size` sequences of equal length (no padding: a padded batch is
rejected), greedy or sampled decoding, float32 / bfloat16 / float16 models. Not supported (clear
errors): a second multi-token forward on a filled cache (multi-turn continuation: `reset()` and
prefill again), beam search and cache reordering, cropping (assisted decoding), custom attention
masks, sliding-window layers, torch.compile of the step (the host plans every step).

Bad input raises: an artifact calibrated for another model shape (`ArtifactError`, a
ValueError), a batch larger than `max_batch_size` or a sequence longer than `max_cache_len`
(ValueError naming the limit), the cache used without the "oscar" attention implementation or
that implementation without the cache (RuntimeError saying what to set).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from shared_math.allocator import PageAllocator  # pure numpy: the host planner both runtimes share
from oscar_torch.cache import OscarTorchCache, StepPlan
from shared_math.artifact import ArtifactError, ModelFingerprint, RotationArtifact, validate_artifact
from shared_math.spec import OscarConfig
from shared_math.tiers import tier_split
from shared_math.tiling import next_power_of_two

ATTENTION_NAME = "oscar"
DEFAULT_MAX_CACHE_LEN = 4096
DEFAULT_PREFILL_CHUNK = 512  # as oscar_jax.runtime: tokens per prefill launch (a multiple of the page size)


class _PendingUpdate(threading.local):
    """The (cache, layer) whose `update` ran last on this thread and the key states it returned,
    weakly held: what the "oscar" attention function called next with those key states attends
    through. Taken once."""

    def __init__(self):
        self._cache = self._key = None
        self._layer = -1

    def set(self, cache: "OscarHFCache", layer: int, key_states: torch.Tensor) -> None:
        self._cache, self._layer, self._key = weakref.ref(cache), layer, weakref.ref(key_states)

    def take(self, key_states: torch.Tensor):
        """(cache, layer) if `key_states` is the tensor the pending update returned, else None."""
        pending = self._cache and self._cache(), self._layer, self._key and self._key()
        self._cache = self._key = None
        cache, layer, key = pending
        return (cache, layer) if cache is not None and key is key_states else None


_PENDING = _PendingUpdate()


def model_fingerprint(model_config) -> ModelFingerprint:
    """The shape fingerprint of a transformers decoder config (the text config of a composite one)."""
    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    try:
        num_layers = int(cfg.num_hidden_layers)
        num_q_heads = int(cfg.num_attention_heads)
    except AttributeError as e:
        raise ValueError(f"model_config must be a transformers decoder config (num_hidden_layers, "
                         f"num_attention_heads, ...): {e}") from None
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_q_heads
    return ModelFingerprint(num_layers, num_q_heads, int(num_kv_heads), int(head_dim))


def _check_full_attention(model_config) -> None:
    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other or getattr(cfg, "use_sliding_window", False):
        raise NotImplementedError(
            f"OscarHFCache supports full-attention decoders only; this config has layer types {other or ['sliding']}"
        )


@dataclasses.dataclass
class _Step:
    """One forward pass: its phase, the plans of its launches, and how far the layers got."""

    phase: str  # "prefill" | "decode"
    batch: int
    tokens: int
    start: int  # position of the first token of this step
    plans: list[tuple[int, int, StepPlan]]  # (first, end) token rows of the step, plan
    demotions: list  # shared_math.allocator.Demotion, run after the last layer
    updated: int = 0  # layers whose `update` has run
    attended: int = 0  # layers whose attention has run


class _OscarLayer(CacheLayerMixin):
    """Per-layer view for transformers' bookkeeping; the pools and the planning live in the cache."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "OscarHFCache", layer: int):
        super().__init__()
        self._cache, self._layer = cache, layer

    def lazy_initialization(self, key_states, value_states) -> None:  # pools are created by the cache
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self._layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self._layer)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self._layer)

    def get_max_length(self) -> int:
        return self._cache.max_cache_len

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx) -> None:
        self._cache.reorder_cache(beam_idx)

    def offload(self):
        raise NotImplementedError("OscarHFCache does not offload layers")

    def prefetch(self):
        pass


class OscarHFCache(Cache):
    """OSCAR's paged mixed-precision KV cache as a transformers `Cache` (see the module docstring).

    Build it with `from_artifact`. Public state: `config` (OscarConfig: tiers, pages, codec),
    `pools` (the OscarTorchCache, None until the first forward when no device was given),
    `allocator` (PageAllocator of the live sequences), `max_batch_size`, `max_cache_len`.
    """

    def __init__(
        self,
        artifact: RotationArtifact,
        fingerprint: ModelFingerprint,
        *,
        max_batch_size: int = 1,
        max_cache_len: int = DEFAULT_MAX_CACHE_LEN,
        sink: int | None = None,
        recent: int | None = None,
        page_size: int | None = None,
        group_size: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        device: torch.device | str | None = None,
    ):
        validate_artifact(artifact, fingerprint)  # ArtifactError naming the mismatch
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len),
                            ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.config = OscarConfig.from_artifact(artifact, group_size=group_size, sink=sink, recent=recent,
                                                page_size=page_size)
        page = self.config.page_size
        if prefill_chunk % page:
            raise ValueError(f"{prefill_chunk=} must be a positive multiple of the page size {page}")
        self.artifact = artifact
        self.fingerprint = fingerprint
        self._max_batch_size = max_batch_size
        self._max_cache_len = max_cache_len
        self.prefill_chunk = prefill_chunk
        # History pages one sequence can need, and BF16 pages (sink + recent window + the page
        # being demoted), never more than the sequence itself can fill.
        self.history_slots = max(1, (max_cache_len - self.config.sink - self.config.recent) // page)
        per_seq_bf16 = min((self.config.sink + self.config.recent) // page + 1, -(-max_cache_len // page) + 1)
        self.num_bf16_pages = 1 + max_batch_size * per_seq_bf16  # page 0: the allocator's scratch page
        self.num_int2_pages = 1 + max_batch_size * self.history_slots
        self.k_rotation = torch.from_numpy(np.ascontiguousarray(artifact.k_rotation, np.float32))
        self.v_rotation = torch.from_numpy(np.ascontiguousarray(artifact.v_rotation, np.float32))
        self.pools: OscarTorchCache | None = None
        super().__init__(layers=[_OscarLayer(self, i) for i in range(fingerprint.num_layers)])
        self._new_sequences()
        if device is not None:
            self._allocate(torch.device(device))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_artifact(
        cls,
        path_or_artifact: str | os.PathLike | RotationArtifact,
        model_config,
        *,
        max_batch_size: int = 1,
        max_cache_len: int = DEFAULT_MAX_CACHE_LEN,
        sink: int | None = None,
        recent: int | None = None,
        page_size: int | None = None,
        group_size: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        device: torch.device | str | None = None,
    ) -> "OscarHFCache":
        """A cache for `model_config` (a transformers LlamaConfig / Qwen3Config / ...) from a
        rotation artifact (a RotationArtifact, its .safetensors file or its directory), or from a
        directory holding the OSCAR authors' `k_rotation*.pt` + `v_rotation*.pt` (RotationZoo),
        imported on the fly by `calibration.import_rotations.read_rotation_path` (torch.load with
        weights_only=True, the same validation as the importer, clip ratios 0.96 / 0.92).

        max_batch_size: sequences per forward (all of one length); max_cache_len: tokens per
        sequence (prompt + generated). sink / recent / page_size / group_size override the
        defaults (64 / 256 / 16 / the artifact's G). device: where the pools live (default: the
        device of the first key states, allocated on the first forward).
        Raises ArtifactError (a ValueError) when the artifact is unreadable or was calibrated
        for another model shape.
        """
        _check_full_attention(model_config)
        fingerprint = model_fingerprint(model_config)
        if isinstance(path_or_artifact, RotationArtifact):
            artifact = path_or_artifact
        elif isinstance(path_or_artifact, (str, os.PathLike)):
            from calibration.import_rotations import read_rotation_path  # JAX-free: the one resolver of both runtimes

            artifact = read_rotation_path(Path(path_or_artifact), fingerprint)
        else:
            raise ValueError(f"path_or_artifact must be a path or a RotationArtifact, got {type(path_or_artifact).__name__}")
        return cls(artifact, fingerprint, max_batch_size=max_batch_size, max_cache_len=max_cache_len, sink=sink,
                   recent=recent, page_size=page_size, group_size=group_size, prefill_chunk=prefill_chunk,
                   device=device)

    def _allocate(self, device: torch.device) -> None:
        self.k_rotation = self.k_rotation.to(device)
        self.v_rotation = self.v_rotation.to(device)
        self.pools = OscarTorchCache(
            self.config, num_layers=self.fingerprint.num_layers, num_kv_heads=self.fingerprint.num_kv_heads,
            num_bf16_pages=self.num_bf16_pages, num_int2_pages=self.num_int2_pages, k_rotation=self.k_rotation,
            k_clip_ratio=self.artifact.k_clip_ratio.tolist(), v_clip_ratio=self.artifact.v_clip_ratio.tolist(),
            device=device,
        )

    def _new_sequences(self) -> None:
        self.allocator = PageAllocator(self.config, num_bf16_pages=self.num_bf16_pages,
                                       num_int2_pages=self.num_int2_pages)
        self.seq_ids: list[int] = []
        self._seen = [0] * self.fingerprint.num_layers
        self._step: _Step | None = None

    # ------------------------------------------------------------------ transformers Cache API

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by the attention module of layer `layer_idx` with this step's key / value states
        [B, Hkv, T, D] (after RoPE). Plans the step (layer 0), then returns the states unchanged,
        pending for the "oscar" attention function (`_PendingUpdate`), which writes them into the
        pools and attends."""
        num_layers = self.fingerprint.num_layers
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < num_layers:
            raise ValueError(f"layer_idx={layer_idx!r} must be in [0, {num_layers})")
        self._check_states(key_states, value_states)
        if layer_idx == 0:
            self._begin_step(key_states)
        step = self._step
        if step is None or step.updated != layer_idx:
            expected = 0 if step is None else step.updated
            raise RuntimeError(f"OscarHFCache.update for layer {layer_idx}, expected layer {expected}: layers must "
                               f"run in order, each once per forward")
        if step.attended != layer_idx:
            raise RuntimeError(_NOT_OSCAR_ATTENTION.format(layer=layer_idx - 1))
        if tuple(key_states.shape[::2]) != (step.batch, step.tokens):
            raise ValueError(f"layer {layer_idx} key states {tuple(key_states.shape)} differ from layer 0's batch "
                             f"{step.batch} and {step.tokens} tokens")
        step.updated += 1
        self._seen[layer_idx] += step.tokens
        self.layers[layer_idx].is_initialized = True
        _PENDING.set(self, layer_idx, key_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens stored for layer `layer_idx` (per sequence)."""
        return self._seen[layer_idx] if 0 <= layer_idx < len(self._seen) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._max_cache_len

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    @property
    def is_compileable(self) -> bool:
        return False  # the host plans every step (page tables, demotions)

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids) if self.seq_ids else -1

    def reset(self) -> None:
        """Forget every sequence (the pools keep their memory; the tables decide what is read)."""
        self._new_sequences()
        for layer in self.layers:
            layer.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("OscarHFCache cannot crop tokens (assisted / speculative decoding is unsupported)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("OscarHFCache does not support beam search (cache reordering)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("OscarHFCache cannot repeat a filled cache along the batch")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("OscarHFCache cannot select batch rows of a filled cache")

    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        raise NotImplementedError("OscarHFCache does not offload layers")

    def nbytes(self) -> int:
        """Bytes of the allocated pools (0 before the first forward without a device)."""
        return 0 if self.pools is None else self.pools.nbytes()

    def __repr__(self) -> str:
        c = self.config
        return (f"OscarHFCache(layers={self.fingerprint.num_layers}, kv_heads={self.fingerprint.num_kv_heads}, "
                f"head_dim={c.head_dim}, sink={c.sink}, recent={c.recent}, page={c.page_size}, G={c.group_size}, "
                f"levels={c.levels!r}, sequences={len(self.seq_ids)}, tokens={self.get_seq_length()})")

    # ------------------------------------------------------------------ planning (host)

    def _check_states(self, key_states, value_states) -> None:
        fp = self.fingerprint
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise ValueError(f"{name} must be a floating-point torch.Tensor, got "
                                 f"{getattr(x, 'dtype', type(x).__name__)}")
            if x.dim() != 4 or x.shape[1] != fp.num_kv_heads or x.shape[3] != fp.head_dim:
                raise ValueError(f"{name} must have shape [batch, {fp.num_kv_heads} kv_heads, tokens, "
                                 f"{fp.head_dim}], got {tuple(x.shape)}")
        if key_states.shape != value_states.shape:
            raise ValueError(f"key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} differ")
        if key_states.shape[0] < 1 or key_states.shape[2] < 1:
            raise ValueError(f"key_states {tuple(key_states.shape)} hold no token")

    def _begin_step(self, key_states: torch.Tensor) -> None:
        previous = self._step
        if previous is not None and previous.attended < self.fingerprint.num_layers:
            raise RuntimeError(
                f"the previous forward through this cache stopped after attending {previous.attended} of "
                f"{self.fingerprint.num_layers} layers (it raised, or the model's attention implementation is not "
                f"'oscar': model.set_attn_implementation('oscar')); call cache.reset() and start again")
        batch, _, tokens, _ = key_states.shape
        if self.pools is None:
            self._allocate(key_states.device)
        elif key_states.device != self.pools.k_bf16.device:
            raise ValueError(f"key_states are on {key_states.device} but the cache lives on {self.pools.k_bf16.device}")
        length = self.get_seq_length(0)
        if length + tokens > self._max_cache_len:
            raise ValueError(f"the sequence would grow to {length + tokens} tokens, beyond this cache's "
                             f"max_cache_len={self._max_cache_len}: create the cache with a larger max_cache_len")
        if not self.seq_ids:
            if batch > self._max_batch_size:
                raise ValueError(f"batch of {batch} sequences exceeds this cache's max_batch_size={self._max_batch_size}")
            self._step = self._plan_prefill(batch, tokens)
        else:
            if batch != len(self.seq_ids):
                raise ValueError(f"the cache holds {len(self.seq_ids)} sequences, this forward has {batch}")
            if tokens != 1:
                raise NotImplementedError(
                    f"a forward of {tokens} tokens on a filled cache: OscarHFCache prefills one prompt per "
                    f"sequence, then decodes one token per forward (call cache.reset() to start a new prompt)")
            self._step = self._plan_decode()

    def _device_plan(self, tables: dict, writes: dict, new_tokens) -> StepPlan:
        device = self.pools.k_bf16.device
        t = lambda a: torch.as_tensor(np.ascontiguousarray(a, np.int32), device=device)  # noqa: E731
        return StepPlan(
            bf16_page_table=t(tables["bf16_page_table"]), history_page_table=t(tables["history_page_table"]),
            sink_tokens=t(tables["sink_tokens"]), recent_tokens=t(tables["recent_tokens"]),
            history_tokens=t(tables["history_tokens"]), new_tokens=t(new_tokens),
            **{name: t(value) for name, value in writes.items()},
        )

    def _no_write(self, shape) -> dict[str, np.ndarray]:
        """Write destinations that write nothing (a page index past the pool)."""
        return {
            "bf16_write_page": np.full(shape, self.num_bf16_pages, np.int32),
            "bf16_write_slot": np.zeros(shape, np.int32),
            "int2_write_page": np.full(shape, self.num_int2_pages, np.int32),
            "int2_write_slot": np.zeros(shape, np.int32),
        }

    def _tables(self) -> dict[str, np.ndarray]:
        """The allocator's tables of the live sequences, cut to the slots in use (rounded up to a
        power of two, to bound kernel variants): every launch reads no more slots than it needs."""
        tables = self.allocator.tables(self.seq_ids, self.history_slots)
        page, sink_slots = self.config.page_size, self.allocator.sink_slots
        recent_pages = int(-(-tables["recent_tokens"].max() // page))
        history_pages = int(tables["history_tokens"].max() // page)
        bf16_width = min(sink_slots + next_power_of_two(recent_pages), tables["bf16_page_table"].shape[1])
        history_width = 0 if history_pages == 0 else min(next_power_of_two(history_pages), self.history_slots)
        tables["bf16_page_table"] = tables["bf16_page_table"][:, : max(bf16_width, sink_slots, 1)]
        tables["history_page_table"] = tables["history_page_table"][:, :history_width]
        return tables

    def _destination(self, seq, position: int, split) -> tuple[str, int, int]:
        """(tier, page, slot) of a prompt position in its final tier (as oscar_jax.runtime)."""
        page = self.config.page_size
        if position < split.sink_tokens:
            return "bf16", seq.sink_pages[position // page], position % page
        if position < split.recent_start:
            offset = position - split.history_start
            return "int2", seq.history_pages[offset // page], offset % page
        offset = position - split.recent_start
        return "bf16", seq.recent_pages[offset // page], offset % page

    def _plan_prefill(self, batch: int, length: int) -> _Step:
        """Admit `batch` prompts of `length` tokens and plan their chunks (oscar_jax.runtime.admit:
        a chunk reads the chunks before it in their final tiers; it attends to itself in the kernel)."""
        for _ in range(batch):  # the allocator hashes tokens only for prefix sharing, which is off here
            self.seq_ids.append(self.allocator.admit(range(length), share_prefix=False).seq_id)
        cfg, page = self.config, self.config.page_size
        split = tier_split(length, cfg)
        sequences = [self.allocator.sequences[s] for s in self.seq_ids]
        full = self.allocator.tables(self.seq_ids, self.history_slots)
        plans = []
        for start in range(0, length, self.prefill_chunk):
            chunk = min(self.prefill_chunk, length - start)
            writes = self._no_write((batch, chunk))
            for b, seq in enumerate(sequences):
                for i, position in enumerate(range(start, start + chunk)):
                    tier, page_id, slot = self._destination(seq, position, split)
                    writes[f"{tier}_write_page"][b, i], writes[f"{tier}_write_slot"][b, i] = page_id, slot
            # The prefix before this chunk, in its final tiers (chunk starts are page-aligned).
            sink = min(start, split.sink_tokens)
            history = min(max(start - split.history_start, 0), split.history_tokens)
            recent = max(start - split.recent_start, 0)
            sink_slots, recent_pages, history_pages = cfg.sink // page, -(-recent // page), history // page
            bf16_width = sink_slots + (next_power_of_two(recent_pages) if recent_pages else 0)
            history_width = 0 if history_pages == 0 else min(next_power_of_two(history_pages), self.history_slots)
            bf16_table = full["bf16_page_table"][:, : max(bf16_width, sink_slots, 1)].copy()
            bf16_table[:, sink_slots + recent_pages :] = 0
            history_table = full["history_page_table"][:, :history_width].copy()
            history_table[:, history_pages:] = 0
            tables = dict(bf16_page_table=bf16_table, history_page_table=history_table,
                          sink_tokens=np.full(batch, sink, np.int32), recent_tokens=np.full(batch, recent, np.int32),
                          history_tokens=np.full(batch, history, np.int32))
            plans.append((start, start + chunk, self._device_plan(tables, writes, np.full(batch, chunk, np.int32))))
        return _Step("prefill", batch, length, 0, plans, [])

    def _plan_decode(self) -> _Step:
        """Append one token to every sequence (oscar_jax.runtime.step): the tables hold the
        pre-demotion view (the new token included); a due demotion runs after the last layer."""
        page, sink_size = self.config.page_size, self.config.sink
        position = self.get_seq_length(0)
        demotions = [self.allocator.extend(sid, 0) for sid in self.seq_ids]
        tables = self._tables()
        writes = self._no_write((len(self.seq_ids), 1))
        for i, sid in enumerate(self.seq_ids):
            seq = self.allocator.sequences[sid]
            if position < sink_size:
                page_id, slot = seq.sink_pages[position // page], position % page
            else:
                offset = position - int(tables["sink_tokens"][i]) - int(tables["history_tokens"][i])
                page_id, slot = seq.recent_pages[offset // page], offset % page
            writes["bf16_write_page"][i, 0], writes["bf16_write_slot"][i, 0] = page_id, slot
        plan = self._device_plan(tables, writes, np.ones(len(self.seq_ids), np.int32))
        return _Step("decode", len(self.seq_ids), 1, position, [(0, 1, plan)], [d for d in demotions if d])

    def _finish_step(self) -> None:
        """After the last layer: demote the pages that left the recent window, in every layer."""
        step = self._step
        if step.demotions:
            device = self.pools.k_bf16.device
            src = torch.tensor([d.src_bf16_page for d in step.demotions], dtype=torch.int32, device=device)
            dst = torch.tensor([d.dst_int2_page for d in step.demotions], dtype=torch.int32, device=device)
            self.pools.demote(src, dst)
            for d in step.demotions:
                self.allocator.demoted(d)
            step.demotions = []

    # ------------------------------------------------------------------ attention (device)

    def _attend(self, module, layer: int, query, key, value, attention_mask, scaling, dropout, kwargs):
        step = self._step
        if step is None or step.attended != layer or step.updated != layer + 1:
            raise RuntimeError(f"oscar attention for layer {layer} out of order: the cache's update for this layer "
                               f"must come right before it")
        if getattr(module, "layer_idx", layer) != layer:
            raise RuntimeError(f"oscar attention of module layer {module.layer_idx} got layer {layer}'s key states")
        if attention_mask is not None:
            raise NotImplementedError("the oscar attention applies causality itself and takes no attention mask "
                                      "(padding and custom masks are unsupported)")
        if kwargs.get("sliding_window") is not None:
            raise NotImplementedError("the oscar attention does not support sliding-window layers")
        if dropout and getattr(module, "training", False):
            raise NotImplementedError("the oscar attention is for inference: attention dropout is unsupported")
        batch, q_heads, tokens, d = query.shape
        if (batch, tokens) != (step.batch, step.tokens) or d != self.config.head_dim:
            raise ValueError(f"query {tuple(query.shape)} does not match the step's key states "
                             f"(batch {step.batch}, {step.tokens} tokens, head_dim {self.config.head_dim})")
        if layer == 0:
            self._check_positions(kwargs.get("position_ids"), step)
        kv = self.fingerprint.num_kv_heads
        q = query.transpose(1, 2).float()
        if scaling is not None and scaling != d**-0.5:  # the kernels scale scores by 1/√D
            q = q * (scaling * math.sqrt(d))
        q = q.contiguous()  # [B, T, Hq, D]
        k = key.transpose(1, 2).float().contiguous()  # [B, T, K, D]
        v_rot = torch.einsum("btkd,kde->btke", value.transpose(1, 2).float(), self.v_rotation[layer]).contiguous()
        if step.phase == "decode":
            o = self.pools.attend(layer, q, k, v_rot, step.plans[0][2], "decode")
        else:
            o = torch.cat([
                self.pools.attend(layer, q[:, s:e].contiguous(), k[:, s:e].contiguous(), v_rot[:, s:e].contiguous(),
                                  plan, "prefill")
                for s, e, plan in step.plans
            ], dim=1)
        # o' = o·R_V (rotated value coordinates) → o = o'·R_Vᵀ, per KV head.
        o = torch.einsum("btkge,kde->btkgd", o.reshape(batch, tokens, kv, q_heads // kv, d), self.v_rotation[layer])
        step.attended += 1
        if step.attended == self.fingerprint.num_layers:
            self._finish_step()
        return o.reshape(batch, tokens, q_heads, d).to(query.dtype), None

    def _check_positions(self, position_ids, step: _Step) -> None:
        """Positions must continue the cached sequence: a padded batch (generate with an attention
        mask holding zeros) or a position offset would silently misplace tokens in the tiers."""
        if position_ids is None:
            return
        want = torch.arange(step.start, step.start + step.tokens, device=position_ids.device)
        positions = position_ids.reshape(-1, position_ids.shape[-1])
        if positions.shape[-1] != step.tokens or not bool((positions == want).all()):
            raise NotImplementedError(
                f"position_ids {positions[:, :8].tolist()}… do not continue the cache's {step.start} tokens with "
                f"{step.start}, {step.start + 1}, …: padded batches are unsupported (an attention_mask with zeros, "
                f"which generate() also infers from pad_token_id occurring in input_ids), as are position offsets; "
                f"pass equal-length prompts without padding")


_NOT_OSCAR_ATTENTION = (
    "OscarHFCache stored layer {layer}'s key/value states, but they were not attended through the 'oscar' "
    "attention implementation: call model.set_attn_implementation('oscar') (after `import oscar_torch.hf`) "
    "or load the model with attn_implementation='oscar'; then cache.reset()"
)


def oscar_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers attention function "oscar": query [B, Hq, T, D], key / value [B, Hkv, T, D]
    (this step's states, as returned by OscarHFCache.update) → (output [B, T, Hq, D], None)."""
    handle = _PENDING.take(key)
    if handle is None:
        raise RuntimeError(
            "the 'oscar' attention implementation reads and writes an OscarHFCache: pass "
            "past_key_values=OscarHFCache.from_artifact(...) (and use_cache=True) to the model / generate()"
        )
    cache, layer = handle
    return cache._attend(module, layer, query, key, value, attention_mask, scaling, dropout, kwargs)


AttentionInterface.register(ATTENTION_NAME, oscar_attention_forward)

__all__ = ["ATTENTION_NAME", "OscarHFCache", "oscar_attention_forward", "model_fingerprint", "ArtifactError"]
