"""The kernels of oscar_torch as torch custom ops (`torch.ops.oscar.*`), with fake implementations.

Each Triton launcher of oscar_torch/kernels is registered once with `torch.library.custom_op`, so
torch.compile and CUDA-graph capture see one opaque node per kernel launch (no graph break, no
tracing into Triton). The ops that update a page pool in place declare it in `mutates_args`
(functionalization then orders them correctly); the others are functional. Every op has a fake
(meta) implementation that only computes output shapes, for FakeTensor tracing.

These ops take already-validated arguments (the clip *index*, int32 ids, contiguous tensors):
call the public ops in oscar_torch.ops / oscar_torch.attention_ops, which validate first.

  oscar::encode             x [N, D]                           → packed, scale, minimum
  oscar::decode             packed [N, D/4], scale, minimum    → float32 [N, D]
  oscar::write_int2         x [T, K, D], rotation?             → packed, scale, minimum [T, K, ·]
  oscar::write_pages        mutates codes, scale, minimum      (INT2 pools [P, K, L, ·])
  oscar::write_bf16_pages   mutates pool                       (BF16 pool [P, K, L, D])
  oscar::demote_pages       mutates codes, scale, minimum      (INT2 pools [Y, P', K, L, ·])
  oscar::bf16_tier_partials, oscar::int2_tier_partials, oscar::causal_chunk_partials
                            attention partials (o [B, K, S, M, D], lse [B, K, S, M])
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from oscar_torch.kernels import codec as kcodec
from oscar_torch.kernels import decode_attention as kdecode
from oscar_torch.kernels import prefill_attention as kprefill
from oscar_torch.kernels import write as kwrite
from shared_math.spec import CODES_PER_BYTE
from shared_math.tiling import num_splits

NAMESPACE = "oscar"


def empty_int2_outputs(lead: tuple[int, ...], d: int, group_size: int, like: Tensor):
    return (
        like.new_empty(lead + (d // CODES_PER_BYTE,), dtype=torch.uint8),
        like.new_empty(lead + (d // group_size,), dtype=torch.float16),
        like.new_empty(lead + (d // group_size,), dtype=torch.float16),
    )


# ----------------------------------------------------------------------------------- codec


@torch.library.custom_op(f"{NAMESPACE}::encode", mutates_args=())
def encode(x: Tensor, group_size: int, clip_index: int, levels: str) -> tuple[Tensor, Tensor, Tensor]:
    return kcodec.encode_rows(x, group_size=group_size, clip_index=clip_index, levels=levels)


@encode.register_fake
def _(x, group_size, clip_index, levels):
    return empty_int2_outputs((x.shape[0],), x.shape[1], group_size, x)


@torch.library.custom_op(f"{NAMESPACE}::decode", mutates_args=())
def decode(packed: Tensor, scale: Tensor, minimum: Tensor, group_size: int) -> Tensor:
    return kcodec.decode_rows(packed, scale, minimum, group_size=group_size)


@decode.register_fake
def _(packed, scale, minimum, group_size):
    return packed.new_empty((packed.shape[0], packed.shape[1] * CODES_PER_BYTE), dtype=torch.float32)


# ------------------------------------------------------------------------------ write path


@torch.library.custom_op(f"{NAMESPACE}::write_int2", mutates_args=())
def write_int2(
    x: Tensor, rotation: Optional[Tensor], group_size: int, clip_index: int, levels: str
) -> tuple[Tensor, Tensor, Tensor]:
    return kwrite.write_int2_rows(x, rotation, group_size=group_size, clip_index=clip_index, levels=levels)


@write_int2.register_fake
def _(x, rotation, group_size, clip_index, levels):
    return empty_int2_outputs(tuple(x.shape[:2]), x.shape[2], group_size, x)


@torch.library.custom_op(f"{NAMESPACE}::write_pages", mutates_args=("codes", "scale", "minimum"))
def write_pages(
    codes: Tensor,
    scale: Tensor,
    minimum: Tensor,
    rows: Tensor,
    page_ids: Tensor,
    slots: Tensor,
    rotation: Optional[Tensor],
    group_size: int,
    clip_index: int,
    levels: str,
) -> None:
    kwrite.write_pages_rows(
        codes, scale, minimum, rows, page_ids, slots, rotation,
        group_size=group_size, clip_index=clip_index, levels=levels,
    )


@write_pages.register_fake
def _(codes, scale, minimum, rows, page_ids, slots, rotation, group_size, clip_index, levels):
    return None


@torch.library.custom_op(f"{NAMESPACE}::write_bf16_pages", mutates_args=("pool",))
def write_bf16_pages(pool: Tensor, rows: Tensor, page_ids: Tensor, slots: Tensor) -> None:
    kwrite.write_bf16_pages_rows(pool, rows, page_ids, slots)


@write_bf16_pages.register_fake
def _(pool, rows, page_ids, slots):
    return None


@torch.library.custom_op(f"{NAMESPACE}::demote_pages", mutates_args=("codes", "scale", "minimum"))
def demote_pages(
    bf16_pool: Tensor,
    codes: Tensor,
    scale: Tensor,
    minimum: Tensor,
    src_pages: Tensor,
    dst_pages: Tensor,
    group_size: int,
    clip_index: int,
    levels: str,
) -> None:
    kwrite.demote_pages_rows(
        bf16_pool, codes, scale, minimum, src_pages, dst_pages,
        group_size=group_size, clip_index=clip_index, levels=levels,
    )


@demote_pages.register_fake
def _(bf16_pool, codes, scale, minimum, src_pages, dst_pages, group_size, clip_index, levels):
    return None


# ------------------------------------------------------------------------------- attention


def _partials_like(q: Tensor, splits: int, block_m: int) -> tuple[Tensor, Tensor]:
    batch, heads, q_rows, d = q.shape
    rows = kdecode.partial_rows(q_rows, block_m)
    return (
        q.new_empty((batch, heads, splits, rows, d), dtype=torch.float32),
        q.new_empty((batch, heads, splits, rows), dtype=torch.float32),
    )


@torch.library.custom_op(f"{NAMESPACE}::bf16_tier_partials", mutates_args=())
def bf16_tier_partials(
    q: Tensor,
    k_bf16: Tensor,
    v_bf16: Tensor,
    page_table: Tensor,
    sink_tokens: Tensor,
    recent_tokens: Tensor,
    sink_slots: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int,
    block_m: int,
    num_warps: int = kdecode.DEFAULT_NUM_WARPS,
    num_stages: int = kdecode.DEFAULT_NUM_STAGES,
) -> tuple[Tensor, Tensor]:
    return kdecode.bf16_tier_partials(
        q, k_bf16, v_bf16, page_table, sink_tokens, recent_tokens, sink_slots=sink_slots,
        softmax_scale=softmax_scale, pages_per_split=pages_per_split, pages_per_block=pages_per_block,
        block_m=block_m, num_warps=num_warps, num_stages=num_stages,
    )


@bf16_tier_partials.register_fake
def _(q, k_bf16, v_bf16, page_table, sink_tokens, recent_tokens, sink_slots, softmax_scale,
      pages_per_split, pages_per_block, block_m, num_warps=kdecode.DEFAULT_NUM_WARPS,
      num_stages=kdecode.DEFAULT_NUM_STAGES):
    return _partials_like(q, num_splits(page_table.shape[1], pages_per_split), block_m)


@torch.library.custom_op(f"{NAMESPACE}::int2_tier_partials", mutates_args=())
def int2_tier_partials(
    q: Tensor,
    k_codes: Tensor,
    k_scale: Tensor,
    k_min: Tensor,
    v_codes: Tensor,
    v_scale: Tensor,
    v_min: Tensor,
    page_table: Tensor,
    history_tokens: Tensor,
    group_size: int,
    softmax_scale: float,
    pages_per_split: int,
    pages_per_block: int,
    block_m: int,
    unpack_asm: bool = False,
    num_warps: int = kdecode.DEFAULT_NUM_WARPS,
    num_stages: int = kdecode.DEFAULT_NUM_STAGES,
    max_registers: int = 0,
    tokens_on_m: bool = False,
    channels_on_m: bool = False,
) -> tuple[Tensor, Tensor]:
    return kdecode.int2_tier_partials(
        q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, page_table, history_tokens,
        group_size=group_size, softmax_scale=softmax_scale, pages_per_split=pages_per_split,
        pages_per_block=pages_per_block, block_m=block_m, unpack_asm=unpack_asm, num_warps=num_warps,
        num_stages=num_stages, max_registers=max_registers or None, tokens_on_m=tokens_on_m,
        channels_on_m=channels_on_m,
    )


@int2_tier_partials.register_fake
def _(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, page_table, history_tokens, group_size,
      softmax_scale, pages_per_split, pages_per_block, block_m, unpack_asm=False, num_warps=kdecode.DEFAULT_NUM_WARPS,
      num_stages=kdecode.DEFAULT_NUM_STAGES, max_registers=0, tokens_on_m=False, channels_on_m=False):
    return _partials_like(q, num_splits(page_table.shape[1], pages_per_split), block_m)


@torch.library.custom_op(f"{NAMESPACE}::merge_tier_partials", mutates_args=())
def merge_tier_partials(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor, valid_rows: int) -> Tensor:
    return kdecode.merge_tier_partials(o_a, lse_a, o_b, lse_b, valid_rows)


@merge_tier_partials.register_fake
def _(o_a, lse_a, o_b, lse_b, valid_rows):
    batch, num_kv_heads, _, _, head_dim = o_a.shape
    return o_a.new_empty((batch, num_kv_heads, valid_rows, head_dim))


@torch.library.custom_op(f"{NAMESPACE}::causal_chunk_partials", mutates_args=())
def causal_chunk_partials(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    new_tokens: Tensor,
    heads_per_kv: int,
    softmax_scale: float,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor]:
    return kprefill.causal_chunk_partials(
        q, k, v, new_tokens, heads_per_kv=heads_per_kv, softmax_scale=softmax_scale,
        block_m=block_m, block_n=block_n,
    )


@causal_chunk_partials.register_fake
def _(q, k, v, new_tokens, heads_per_kv, softmax_scale, block_m, block_n):
    return _partials_like(q, 1, block_m)
