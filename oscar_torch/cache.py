"""OscarTorchCache: OSCAR's paged mixed-precision KV cache for PyTorch — buffers, updated in place.

The torch twin of oscar_jax.cache.OscarKVCache, with the same pools (DESIGN.md §2 "Pages"; all
layers stacked on a leading axis Y, so one launch demotes a page of every layer):
  k_bf16, v_bf16                 bfloat16[Y, P, K, L, D]     sink and recent tiers
  k_codes, v_codes               uint8[Y, P2, K, L, D/4]     history tier (format v1 pages)
  k_scale, k_min, v_scale, v_min float16[Y, P2, K, L, D/G]
  k_rotation                     float32[Y, K, D, D]         R_K per (layer, KV head)
A page written here is read by oscar_jax and vice versa (the bytes are the format's).

Every update is a torch custom op that declares the pool it mutates (oscar_torch.library), so a
step that calls `attend` / `demote` runs under torch.compile(fullgraph=True) and can be captured
in a CUDA graph: no host synchronisation, no value checks (a destination outside the pools is
skipped by the kernel; destinations must be distinct, as in oscar_jax under jit).

Per layer `attend(layer, q, k, v, plan, phase)`:
  q' = q·R_K (the same R_K for the query heads of one KV head); k' = k·R_K
  BF16 tier writes of this step's sink / recent positions (k', v rounded to bfloat16)
  prefill only: INT2 writes of positions that are already history (fused rotate + clip +
      quantize + pack in one kernel)
  decode:  two-tier split-K decode attention over the tables (which include the new token)
  prefill: the chunk attends to itself in full precision and to its cached prefix through the
      tiers (the prefix tables never include the chunk)
Values must arrive rotated (v·R_V): fold R_V into W_v and R_Vᵀ into W_o, or rotate explicitly;
`attend` returns the attention output in rotated value coordinates.
The page tables and write destinations of a step (`StepPlan`) are prepared by the caller.
"""

from __future__ import annotations

import dataclasses

import torch

from oscar_torch import attention_ops, library
from oscar_torch.validation import check_tensor
from shared_math.spec import CODES_PER_BYTE, OscarConfig, clip_index, require_token_keys

PHASES = ("prefill", "decode")
POOL_NAMES = ("k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Page tables and write destinations for one step (int32 tensors on the cache's device;
    a destination outside the pools = no write)."""

    bf16_page_table: torch.Tensor  # [B, NB] sink slots, then recent slots
    history_page_table: torch.Tensor  # [B, NH]
    sink_tokens: torch.Tensor  # [B] tokens attention reads in each tier
    recent_tokens: torch.Tensor  # [B]
    history_tokens: torch.Tensor  # [B]
    new_tokens: torch.Tensor  # [B] valid rows of this step's chunk
    bf16_write_page: torch.Tensor  # [B, T]
    bf16_write_slot: torch.Tensor  # [B, T]
    int2_write_page: torch.Tensor  # [B, T]
    int2_write_slot: torch.Tensor  # [B, T]


class OscarTorchCache:
    """The pools of every layer, updated in place by `attend` and `demote`."""

    def __init__(
        self,
        config: OscarConfig,
        *,
        num_layers: int,
        num_kv_heads: int,
        num_bf16_pages: int,
        num_int2_pages: int,
        k_rotation: torch.Tensor,
        k_clip_ratio,
        v_clip_ratio,
        device: torch.device | str | None = None,
    ):
        """Zero-filled pools on `device` (default: k_rotation's). k_rotation float32 [Y, K, D, D];
        clip ratios one per layer (a sequence of Y numbers, or a tensor of Y values)."""
        if not isinstance(config, OscarConfig):
            raise ValueError(f"config must be an OscarConfig, got {type(config).__name__}")
        require_token_keys(config, "OscarTorchCache")
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("num_bf16_pages", num_bf16_pages), ("num_int2_pages", num_int2_pages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        d, page, g = config.head_dim, config.page_size, config.group_size
        check_tensor("k_rotation", k_rotation, dtypes=(torch.float32,), shape=(num_layers, num_kv_heads, d, d),
                     layout="[layers, kv_heads, head_dim, head_dim]")
        device = torch.device(device) if device is not None else k_rotation.device
        k_clip, v_clip = (tuple(float(c) for c in torch.as_tensor(r, dtype=torch.float64).reshape(-1).tolist())
                          for r in (k_clip_ratio, v_clip_ratio))
        if len(k_clip) != num_layers or len(v_clip) != num_layers:
            raise ValueError(f"need one clip ratio per layer ({num_layers}), got {len(k_clip)} and {len(v_clip)}")
        self.k_clip_index = tuple(clip_index(c, d) for c in k_clip)  # ValueError naming a bad ratio
        self.v_clip_index = tuple(clip_index(c, d) for c in v_clip)
        self.config = config
        self.k_clip_ratio, self.v_clip_ratio = k_clip, v_clip
        bf16 = (num_layers, num_bf16_pages, num_kv_heads, page, d)
        codes = (num_layers, num_int2_pages, num_kv_heads, page, d // CODES_PER_BYTE)
        meta = (num_layers, num_int2_pages, num_kv_heads, page, d // g)
        self.k_bf16 = torch.zeros(bf16, dtype=torch.bfloat16, device=device)
        self.v_bf16 = torch.zeros(bf16, dtype=torch.bfloat16, device=device)
        self.k_codes = torch.zeros(codes, dtype=torch.uint8, device=device)
        self.k_scale = torch.zeros(meta, dtype=torch.float16, device=device)
        self.k_min = torch.zeros(meta, dtype=torch.float16, device=device)
        self.v_codes = torch.zeros(codes, dtype=torch.uint8, device=device)
        self.v_scale = torch.zeros(meta, dtype=torch.float16, device=device)
        self.v_min = torch.zeros(meta, dtype=torch.float16, device=device)
        self.k_rotation = k_rotation.to(device)

    @property
    def num_layers(self) -> int:
        return self.k_bf16.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_bf16.shape[2]

    def layer_pools(self, layer: int) -> tuple[torch.Tensor, ...]:
        """(k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min) of one layer: views,
        so writing into them updates the cache."""
        return tuple(getattr(self, name)[layer] for name in POOL_NAMES)

    def nbytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in POOL_NAMES)

    def _check_step(self, q, k, v, plan: StepPlan, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"{phase=} must be one of {PHASES}")
        if not isinstance(plan, StepPlan):
            raise ValueError(f"plan must be a StepPlan, got {type(plan).__name__}")
        d, kv = self.config.head_dim, self.num_kv_heads
        check_tensor("q", q, shape=(None, None, None, d), layout="[batch, tokens, q_heads, head_dim]")
        batch, tokens, q_heads, _ = q.shape
        if q_heads % kv:
            raise ValueError(f"query heads Hq={q_heads} must be a multiple of KV heads Hkv={kv}")
        check_tensor("k", k, shape=(batch, tokens, kv, d), layout="[batch, tokens, kv_heads, head_dim]")
        check_tensor("v", v, shape=(batch, tokens, kv, d), layout="[batch, tokens, kv_heads, head_dim]")
        if phase == "decode" and tokens != 1:
            raise ValueError(f"decode appends one token per sequence, got q of shape {tuple(q.shape)}")
        for name in ("bf16_write_page", "bf16_write_slot", "int2_write_page", "int2_write_slot"):
            check_tensor(f"plan.{name}", getattr(plan, name), dtypes=(torch.int32,), shape=(batch, tokens))

    def attend(self, layer: int, q, k, v, plan: StepPlan, phase: str) -> torch.Tensor:
        """Store this step's K/V in their tiers and attend (see module docstring).

        q [B, T, Hq, D], k and v [B, T, K, D] (float32 or bfloat16; v already rotated); returns the
        attention output [B, T, Hq, D] in q's dtype (rotated value coordinates).
        """
        self._check_step(q, k, v, plan, phase)
        cfg = self.config
        b, t, hq, d = q.shape
        kv = self.num_kv_heads
        rotation = self.k_rotation[layer]
        q_rot = torch.einsum("btkgd,kde->btkge", q.float().reshape(b, t, kv, hq // kv, d), rotation)
        q_rot = q_rot.reshape(b, t, hq, d).contiguous()
        k32, v32 = k.float().contiguous(), v.float().contiguous()
        k_rot = torch.einsum("btkd,kde->btke", k32, rotation).contiguous()
        flat = lambda x: x.reshape((b * t,) + tuple(x.shape[2:]))  # noqa: E731
        pools = self.layer_pools(layer)
        k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min = pools
        bf16_page, bf16_slot = flat(plan.bf16_write_page), flat(plan.bf16_write_slot)
        library.write_bf16_pages(k_bf16, flat(k_rot), bf16_page, bf16_slot)
        library.write_bf16_pages(v_bf16, flat(v32), bf16_page, bf16_slot)
        if phase == "prefill":
            int2_page, int2_slot = flat(plan.int2_write_page), flat(plan.int2_write_slot)
            library.write_pages(k_codes, k_scale, k_min, flat(k32), int2_page, int2_slot, rotation.contiguous(),
                                cfg.group_size, self.k_clip_index[layer], cfg.levels)
            library.write_pages(v_codes, v_scale, v_min, flat(v32), int2_page, int2_slot, None,
                                cfg.group_size, self.v_clip_index[layer], cfg.levels)
        tables = (plan.bf16_page_table, plan.sink_tokens, plan.recent_tokens, plan.history_page_table,
                  plan.history_tokens)
        common = dict(sink_slots=cfg.sink // cfg.page_size, group_size=cfg.group_size, softmax_scale=d**-0.5)
        if phase == "decode":
            o = attention_ops.decode_attention(q_rot[:, 0], *pools, *tables, **common)[:, None]
        else:
            o = attention_ops.prefill_attention(q_rot, k_rot, v32, *pools, *tables, plan.new_tokens, **common)
        return o.to(q.dtype)

    def demote(self, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """Quantize BF16 pages src → INT2 pages dst for every layer, in place (one launch per
        distinct clip ratio: one launch in the common case of equal ratios)."""
        for name, ids in (("src_pages", src_pages), ("dst_pages", dst_pages)):
            check_tensor(name, ids, dtypes=(torch.int32,), shape=(None,))
        if src_pages.shape != dst_pages.shape:
            raise ValueError(f"src_pages {tuple(src_pages.shape)} and dst_pages {tuple(dst_pages.shape)} must match")
        if src_pages.shape[0] == 0:
            return
        cfg = self.config
        for prefix, indices in (("k", self.k_clip_index), ("v", self.v_clip_index)):
            bf16 = getattr(self, f"{prefix}_bf16")
            pools = [getattr(self, f"{prefix}_{n}") for n in ("codes", "scale", "min")]
            for k in sorted(set(indices)):
                layers = [i for i, c in enumerate(indices) if c == k]
                if len(layers) == len(indices):  # the common case: one launch for all layers
                    library.demote_pages(bf16, *pools, src_pages, dst_pages, cfg.group_size, k, cfg.levels)
                    continue
                for i in layers:
                    library.demote_pages(bf16[i : i + 1], *(p[i : i + 1] for p in pools), src_pages, dst_pages,
                                         cfg.group_size, k, cfg.levels)
