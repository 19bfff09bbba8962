"""Split-K first-stage kernels of attention over OSCAR's paged mixed-precision KV cache.

Two kernels, one per storage tier (OSCAR_SPEC §5 "Read"), each writing a *normalised* partial
output and its log-sum-exp per (sequence, KV head, query-row block, split); a third kernel
(`merge_tier_partials`, decode) or the plain-jnp `oscar_jax.attention_ops.merge_partials`
(prefill) turns all partials into the exact softmax over the union.

* `bf16_tier_partials`: the sink and recent pages (BF16). One page table per sequence: slots
  [0, sink_slots) are the sink pages (`sink_tokens` valid tokens, filling pages in order), the
  following slots the recent pages (`recent_tokens` valid tokens, in order).
* `int2_tier_partials`: the history pages (INT2, format v1). Nothing is dequantized into a tile:
  with x̂ = m + c·s per group of `group_size` channels (m, s the fp16 minimum and scale of the group),
      q·x̂     = Σ_groups  s·(q_group · c_group) + m·Σ q_group    (K scale and min into the scores)
      Σ_n p·v̂ = Σ_n (p·s_v)·c_v + (Σ_n p·m_v)                    (V scale into the probabilities)
  so the inner products run on the raw 2-bit codes (exact in bf16 and f32), one `dot` per
  (byte chunk, bit plane): quartered packing puts channels [plane·D/4 + j, …) in bits
  2·plane … 2·plane + 1 of bytes j …, so each bit plane of a byte chunk is a contiguous run of
  channels and lies inside one group.

Both kernels handle all query rows of one KV head together (GQA: the Gq query heads of a KV head,
padded to ≥ 16 rows for `dot`; prefill: T·Gq rows), so each K/V tile is loaded once per row block.

Lowering choice: `pl.pallas_call` with the Triton lowering (`jax.experimental.pallas.triton`),
as the codec kernels. It is deprecated since jax 0.11 but compiles on the H200, has `jnp.dot`
(tensor cores for bf16, IEEE fp32 otherwise) and accepts 8-bit loads widened to int32; Mosaic
GPU has no `jnp.dot` and rejects 8-bit arithmetic (DESIGN.md §4). The kernels keep to the Triton
lowering's rules even though interpret mode would not enforce them: power-of-two value shapes,
dots with M, N, K ≥ 16, uint8 widened to int32 before shifts, static shapes with dynamic loop
trip counts, scalar reads of lengths from refs, page gathers as integer-array indexing of refs.
(The decode INT2 tier's scores with tokens on M have N = 8: XLA's Triton pads it to mma's n8 —
compiled and checked on the H200.)

Robustness: a page-table entry that does not hold a valid token is never dereferenced (its page
id is replaced by 0 before the gather), V rows and INT2 metadata of masked tokens are zeroed
(stale pool memory may hold NaN), masked scores are a finite large negative value, and a split
with no valid token writes o = 0, lse = −inf so the merge weighs it zero.

Dimension vocabulary of the shape comments: B batch, K KV heads, M query rows of one KV head,
D head dim, P pages of a pool, L page size, N tokens of one block, S splits, NB/NH table slots.

Files (the same names as oscar_torch/kernels/decode_attention/, so the two read side by side), each
kernel beside its launcher:
  common.py       the mask value, the dots, the fused multiply-add, the online-softmax steps
                  (also used by kernels.prefill_attention).
  bf16_tier.py    `bf16_tier_partials`.
  int2_planes.py  the INT2 codes as dot operands: pieces, bit planes, inline-PTX unpacking.
  int2_tier.py    `int2_tier_partials` (whole pages; tokens gathered for pages < 16 tokens).
  merge.py        `merge_tier_partials`.
The launch configuration of a decode call (splits, warps, stages, INT2 layout, register cap) is one
`shared_math.tiling.DecodeLaunch`, resolved and validated by `oscar_jax.attention_ops`.
"""

from oscar_jax.kernels.decode_attention.bf16_tier import bf16_tier_partials
from oscar_jax.kernels.decode_attention.common import (
    MASK_VALUE, MIN_DOT_DIM, cdiv, dot_nn, dot_nt, dot_tn, finalize_rows, multiply_add, online_softmax_step,
)
from oscar_jax.kernels.decode_attention.int2_tier import int2_tier_partials
from oscar_jax.kernels.decode_attention.merge import merge_tier_partials

__all__ = [
    "MASK_VALUE", "MIN_DOT_DIM", "bf16_tier_partials", "cdiv", "dot_nn", "dot_nt", "dot_tn", "finalize_rows",
    "int2_tier_partials", "merge_tier_partials", "multiply_add", "online_softmax_step",
]
