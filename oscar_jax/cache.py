"""OscarKVCache: the paged mixed-precision cache as a pytree, behind the model's `attend` contract.

Device state (all layers stacked on a leading axis Y, so one launch demotes a page of every
layer; the KV-head axis K is never reduced over, so it can be sharded across devices):
  k_bf16, v_bf16                 bfloat16[Y, P, K, L, D]     sink and recent tiers
  k_codes, v_codes               uint8[Y, P2, K, L, D/4]     history tier (format v1 pages)
  k_scale, k_min, v_scale, v_min float16[Y, P2, K, L, D/G]
  k_rotation                     float32[Y, K, D, D]         R_K per (layer, KV head)
plus a `StepPlan`: the page tables and write destinations of the current step, prepared on the
host by `PageAllocator` (oscar_jax.runtime builds it). Values arrive already rotated (R_V is
folded into W_v and R_Vᵀ into W_o at load), so `attend` returns the attention output in rotated
value coordinates and the folded W_o undoes the rotation.

Per layer `attend`:
  q' = q·R_K (the same R_K for the query heads of one KV head); k' = k·R_K
  BF16 tier writes of this step's sink / recent positions (k', v rounded to bfloat16)
  prefill only: INT2 writes of positions that are already history (fused rotate + clip +
      quantize + pack: `ops.write_pages`)
  decode:  two-tier split-K decode attention over the tables (which include the new token)
  prefill: the chunk attends to itself in full precision and to its cached prefix through the
      tiers (the prefix tables never include the chunk)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import ops
from oscar_jax.xla import kernels as current_kernels
from oscar_jax.xla import use_kernels, use_xla
from oscar_jax.xla import write as xla_write
from shared_math.spec import CODES_PER_BYTE, OscarConfig, clip_index

_HIGHEST = jax.lax.Precision.HIGHEST
PHASES = ("prefill", "decode")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Page tables and write destinations for one step (int32; out-of-range page = no write)."""

    bf16_page_table: jax.Array  # [B, NB] sink slots, then recent slots
    history_page_table: jax.Array  # [B, NH]
    sink_tokens: jax.Array  # [B] tokens attention reads in each tier
    recent_tokens: jax.Array  # [B]
    history_tokens: jax.Array  # [B]
    new_tokens: jax.Array  # [B] valid rows of this step's chunk
    bf16_write_page: jax.Array  # [B, T]
    bf16_write_slot: jax.Array  # [B, T]
    int2_write_page: jax.Array  # [B, T]
    int2_write_slot: jax.Array  # [B, T]


def _layer_groups(clip_indices) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """((clip_index, layers), …): the layers of each clip index, what a demotion's bytes depend on."""
    return tuple((k, tuple(i for i, j in enumerate(clip_indices) if j == k)) for k in sorted(set(clip_indices)))


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OscarKVCache:
    k_bf16: jax.Array
    v_bf16: jax.Array
    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    k_rotation: jax.Array
    plan: StepPlan | None
    config: OscarConfig = _static()
    k_clip_ratio: tuple[float, ...] = _static()
    v_clip_ratio: tuple[float, ...] = _static()
    phase: str = _static(default="decode")
    interpret: bool | None = _static(default=None)
    # The implementation the ops run when interpret is None ("xla" or "pallas"), fixed when the cache
    # is created: a static field, so a jit traced for one never serves the other.
    kernels: str | None = _static(default=None)
    # Pages per split of a prefill chunk's cache partials (both tiers; None: the tiling policy of
    # shared_math.tiling.resolve_splits, one split over the whole table).
    prefill_pages_per_split: int | None = _static(default=None)
    # Query rows per block of a prefill chunk's prefix tiers (None: attention_ops' block_m).
    prefill_tier_block_m: int | None = _static(default=None)

    @classmethod
    def create(
        cls,
        config: OscarConfig,
        *,
        num_layers: int,
        num_kv_heads: int,
        num_bf16_pages: int,
        num_int2_pages: int,
        k_rotation,
        k_clip_ratio,
        v_clip_ratio,
        interpret: bool | None = None,
    ) -> "OscarKVCache":
        """Zero-filled pools. k_rotation [Y, K, D, D]; clip ratios one per layer. interpret=None: the
        ops run `oscar_jax.xla.kernels()` as it stands now (the XLA path on a CPU backend)."""
        d, page, g = config.head_dim, config.page_size, config.group_size
        k_rotation = jnp.asarray(k_rotation, jnp.float32)
        if k_rotation.shape != (num_layers, num_kv_heads, d, d):
            raise ValueError(f"k_rotation shape {k_rotation.shape} must be {(num_layers, num_kv_heads, d, d)}")
        k_clip, v_clip = (tuple(float(c) for c in np.asarray(r).reshape(-1)) for r in (k_clip_ratio, v_clip_ratio))
        if len(k_clip) != num_layers or len(v_clip) != num_layers:
            raise ValueError(f"need one clip ratio per layer ({num_layers}), got {len(k_clip)} and {len(v_clip)}")
        bf16 = (num_layers, num_bf16_pages, num_kv_heads, page, d)
        codes = (num_layers, num_int2_pages, num_kv_heads, page, d // CODES_PER_BYTE)
        meta = (num_layers, num_int2_pages, num_kv_heads, page, d // g)
        # format v2's key pages: a scale and a minimum per channel and page
        key_meta = meta if config.key_layout == "token" else (num_layers, num_int2_pages, num_kv_heads, d)
        return cls(
            k_bf16=jnp.zeros(bf16, jnp.bfloat16), v_bf16=jnp.zeros(bf16, jnp.bfloat16),
            k_codes=jnp.zeros(codes, jnp.uint8), k_scale=jnp.zeros(key_meta, jnp.float16),
            k_min=jnp.zeros(key_meta, jnp.float16),
            v_codes=jnp.zeros(codes, jnp.uint8), v_scale=jnp.zeros(meta, jnp.float16), v_min=jnp.zeros(meta, jnp.float16),
            k_rotation=k_rotation, plan=None, config=config, k_clip_ratio=k_clip, v_clip_ratio=v_clip,
            interpret=interpret, kernels=current_kernels() if interpret is None else None,
        )

    def with_plan(self, plan: StepPlan, phase: str) -> "OscarKVCache":
        if phase not in PHASES:
            raise ValueError(f"{phase=} must be one of {PHASES}")
        return dataclasses.replace(self, plan=plan, phase=phase)

    @property
    def num_layers(self) -> int:
        return self.k_bf16.shape[0]

    def layer_pools(self, layer: int) -> tuple[jax.Array, ...]:
        """(k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min) of one layer."""
        return tuple(getattr(self, name)[layer] for name in POOL_NAMES)

    def attend(self, layer, q, k, v, positions):
        """Store this step's K/V in their tiers and attend (see module docstring)."""
        del positions  # tiers and slots come from the plan; RoPE was applied by the model
        if self.plan is None:
            raise ValueError("OscarKVCache.attend needs a StepPlan: use oscar_jax.runtime")
        with use_kernels(self.kernels):
            return self._attend(layer, q, k, v)

    def _attend(self, layer, q, k, v):
        cfg, plan = self.config, self.plan
        b, t, hq, d = q.shape
        kv = k.shape[2]
        rot = self.k_rotation[layer]
        q_rot = jnp.einsum("btkgd,kde->btkge", q.astype(jnp.float32).reshape(b, t, kv, hq // kv, d), rot,
                           precision=_HIGHEST).reshape(b, t, hq, d)
        k_rot = jnp.einsum("btkd,kde->btke", k.astype(jnp.float32), rot, precision=_HIGHEST)
        v32 = v.astype(jnp.float32)
        flat = lambda x: x.reshape((b * t,) + x.shape[2:])  # noqa: E731
        # Every op takes the stacked pools and the static layer index: no layer is sliced out or
        # written back, so with the cache donated nothing is copied (oscar_jax.kernels.layered).
        at = dict(layer=layer, interpret=self.interpret)
        dst = dict(page_ids=flat(plan.bf16_write_page), slots=flat(plan.bf16_write_slot), **at)
        k_bf16 = ops.write_bf16_pages(self.k_bf16, flat(k_rot), **dst)
        v_bf16 = ops.write_bf16_pages(self.v_bf16, flat(v32), **dst)
        k_codes, k_scale, k_min, v_codes, v_scale, v_min = (getattr(self, n) for n in POOL_NAMES[2:])
        if self.phase == "prefill":
            dst = dict(page_ids=flat(plan.int2_write_page), slots=flat(plan.int2_write_slot),
                       group_size=cfg.group_size, levels=cfg.levels, **at)
            if cfg.key_layout == "channel":  # whole pages per channel (xla.write: chunks are page-aligned)
                k_codes, k_scale, k_min = xla_write.write_channel_key_pages(
                    k_codes, k_scale, k_min, k.astype(jnp.float32), plan.int2_write_page, plan.int2_write_slot, rot,
                    clip_index=cfg.k_clip_index_for(self.k_clip_ratio[layer]), levels=cfg.levels, layer=layer)
            else:
                k_codes, k_scale, k_min = ops.write_pages(k_codes, k_scale, k_min, flat(k.astype(jnp.float32)),
                                                          rotation=rot, clip_ratio=self.k_clip_ratio[layer], **dst)
            v_codes, v_scale, v_min = ops.write_pages(v_codes, v_scale, v_min, flat(v32),
                                                      clip_ratio=self.v_clip_ratio[layer], **dst)
        pools = (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min)
        tables = (plan.bf16_page_table, plan.sink_tokens, plan.recent_tokens, plan.history_page_table,
                  plan.history_tokens)
        common = dict(sink_slots=cfg.sink // cfg.page_size, group_size=cfg.group_size, softmax_scale=d**-0.5,
                      key_layout=cfg.key_layout, **at)
        # The rotated query (and the chunk's own K/V) in the model's dtype: bf16 models take the
        # tensor-core path, f32 ones IEEE float32 dots (benchmarks/DECISIONS.md P1).
        if self.phase == "decode":
            o = ops.decode_attention(q_rot[:, 0].astype(q.dtype), *pools, *tables, **common)[:, None]
        else:
            o = ops.prefill_attention(q_rot.astype(q.dtype), k_rot.astype(q.dtype), v32.astype(q.dtype), *pools,
                                      *tables, plan.new_tokens, pages_per_split=self.prefill_pages_per_split,
                                      tier_block_m=self.prefill_tier_block_m, **common)
        updates = dict(zip(POOL_NAMES, pools))
        return o.astype(q.dtype), dataclasses.replace(self, **updates)

    def demote(self, src_pages, dst_pages) -> "OscarKVCache":
        """Quantize BF16 pages src → INT2 pages dst for every layer (one launch per clip ratio)."""
        with use_kernels(self.kernels):
            return self._demote(src_pages, dst_pages)

    def _demote(self, src_pages, dst_pages) -> "OscarKVCache":
        cfg = self.config
        updates = {}
        for prefix, clips in (("k", self.k_clip_ratio), ("v", self.v_clip_ratio)):
            bf16 = getattr(self, f"{prefix}_bf16")
            pools = [getattr(self, f"{prefix}_{n}") for n in ("codes", "scale", "min")]
            pages = jnp.asarray(src_pages, jnp.int32), jnp.asarray(dst_pages, jnp.int32)
            if prefix == "k" and cfg.key_layout == "channel":  # format v2's key pages: encoded in XLA on any backend
                groups = _layer_groups([cfg.k_clip_index_for(c) for c in clips])
                pools = xla_write.demote_channel_key_pages(bf16, *pools, *pages, groups=groups, levels=cfg.levels)
                updates.update({f"{prefix}_{n}": p for n, p in zip(("codes", "scale", "min"), pools)})
                continue
            indices = [clip_index(c, cfg.head_dim) for c in clips]
            if len(set(indices)) > 1 and use_xla(self.interpret):
                # Layers grouped by clip index (what the bytes depend on): one encode per group.
                pools = xla_write.demote_layer_groups(bf16, *pools, *pages, group_size=cfg.group_size,
                                                      groups=_layer_groups(indices), levels=cfg.levels)
                updates.update({f"{prefix}_{n}": p for n, p in zip(("codes", "scale", "min"), pools)})
                continue
            for ratio in sorted(set(clips)):
                layers = [i for i, c in enumerate(clips) if c == ratio]
                if len(layers) == len(clips):  # the common case: one launch for all layers
                    pools = list(ops.demote_pages(bf16, *pools, src_pages, dst_pages, group_size=cfg.group_size,
                                                  clip_ratio=ratio, levels=cfg.levels, interpret=self.interpret))
                    continue
                for i in layers:
                    out = ops.demote_pages(bf16[i], *(p[i] for p in pools), src_pages, dst_pages,
                                           group_size=cfg.group_size, clip_ratio=ratio, levels=cfg.levels,
                                           interpret=self.interpret)
                    pools = [p.at[i].set(o) for p, o in zip(pools, out)]
            updates.update({f"{prefix}_{n}": p for n, p in zip(("codes", "scale", "min"), pools)})
        return dataclasses.replace(self, **updates)

    def nbytes(self) -> int:
        return sum(int(getattr(self, n).nbytes) for n in POOL_NAMES)


POOL_NAMES = ("k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
