"""Split-K first-stage kernels of attention over OSCAR's paged mixed-precision KV cache (Triton).

Two kernels, one per storage tier, each writing a *normalised* partial output and its
log-sum-exp per (sequence, KV head, query-row block, split); a merge turns all partials into the
exact softmax over the union (decode: `merge_tier_partials`, one kernel reading both tiers'
partials in place; prefill: `oscar_torch.attention_ops.merge_partials` in plain torch). The
same tier kernels, names and tiling as oscar_jax.kernels.decode_attention:

* `bf16_tier_partials`: the sink and recent pages (BF16). One page table per sequence: slots
  [0, sink_slots) are the sink pages (`sink_tokens` valid tokens, filling pages in order), the
  following slots the recent pages (`recent_tokens` valid tokens, in order).
* `int2_tier_partials`: the history pages (INT2, format v1), in the folded form of the Pallas
  kernel: one dot per bit plane on the raw 2-bit codes, the K scale and minimum folded into the
  scores (s·(q·c) + m·Σq) and the V scale into the probabilities, so nothing is dequantized and
  bfloat16 queries run on tensor cores. This needs every bit plane inside one group (G ≥ D/4);
  narrower groups take `_int2_tier_dequantizing_kernel`, which dequantizes each tile in
  registers (`decode_block`) and runs float32 dots. (Dequantizing every tile is the slow path: a
  [256, 128] float32 tile per K and V spills registers.)

Both kernels handle all query rows of one KV head together (GQA: the Gq query heads of a KV head,
padded to ≥ 16 rows for `tl.dot`; prefill: T·Gq rows), so each K/V tile is loaded once per row
block. Grid (B, K, row blocks × splits): Triton grids have three axes, so the JAX kernels' row
block and split axes share the last one.

Precision: `BF16_DOTS` (q in bfloat16) rounds the dot operands built in the kernel to bfloat16
(the probabilities before P·V), with float32 accumulation; otherwise every dot is IEEE float32.
On the GPU the BF16 tier's bf16 dots run on tensor cores (`TENSOR_CORES`); the Triton
interpreter computes bf16 `tl.dot` wrongly, so there the operands are rounded to bfloat16 values
with integer round-to-nearest-even and multiplied as float32 (the same products: a product of
two bfloat16 values is exact in float32). The folded INT2 kernel follows the same rules (codes
are exact in bfloat16; the probabilities scaled by the V scale are rounded to bfloat16 before
the dot, as in Pallas); the dequantizing one always uses float32 dots. BF16 pools and bfloat16 queries reach the
kernels as int16 bit patterns and are widened with integer ops (exact everywhere).

Robustness: a page-table entry that does not hold a valid token is never dereferenced (its page
id is replaced by 0 before the gather), V rows and INT2 metadata of masked tokens are zeroed
(stale pool memory may hold NaN), masked scores are a finite large negative value, and a split
with no valid token writes o = 0, lse = −inf so the merge weighs it zero. The INT2 tier with
tokens on M runs the blocks whose every token is valid (whole history pages) without masks, and
masks only the block that may hold a partial page (`_full_blocks`; benchmarks/DECISIONS.md D15).

Dimension vocabulary of the shape comments: B batch, K KV heads, M query rows of one KV head,
D head dim, P pages of a pool, L page size, N tokens of one block, S splits, NB/NH table slots.

Files (the same names as oscar_jax/kernels/decode_attention/, so the two read side by side), each
kernel beside its launcher:
  common.py             the mask value, the dots, the online-softmax steps, the query rows read and
                        the partials stored (also used by kernels.prefill_attention and kernels.write).
  bf16_tier.py          `bf16_tier_partials`.
  int2_planes.py        the INT2 codes as dot operands: bit planes, inline-PTX unpacking, factors.
  int2_tier.py          `int2_tier_partials`: the folded kernel in its three layouts.
  int2_dequantizing.py  the fallback kernel for G < D/4, launched by `int2_tier_partials`.
  merge.py              `merge_tier_partials`.
The launch configuration of a decode call (splits, warps, stages, INT2 layout, register cap) is one
`shared_math.tiling.DecodeLaunch`, resolved and validated by `oscar_torch.attention_ops`.
"""

from oscar_torch.kernels.decode_attention.bf16_tier import bf16_tier_partials
from oscar_torch.kernels.decode_attention.common import (
    DEFAULT_NUM_STAGES, DEFAULT_NUM_WARPS, MASK_VALUE, MASK_VALUE_C, MIN_DOT_DIM, dot_f32, dot_operand,
    online_softmax_step, partial_rows, store_partial,
)
from oscar_torch.kernels.decode_attention.int2_tier import int2_tier_partials
from oscar_torch.kernels.decode_attention.merge import merge_tier_partials

__all__ = [
    "DEFAULT_NUM_STAGES", "DEFAULT_NUM_WARPS", "MASK_VALUE", "MASK_VALUE_C", "MIN_DOT_DIM", "bf16_tier_partials",
    "dot_f32", "dot_operand", "int2_tier_partials", "merge_tier_partials", "online_softmax_step", "partial_rows",
    "store_partial",
]
