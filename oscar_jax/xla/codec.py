"""Format v1 encode / decode of rows in plain XLA (DESIGN.md §2).

All rows at once through the Pallas kernels' block bodies (`kernels.codec.encode_block` /
`decode_block`: pure jnp, the same float32 operations in the same order as shared_math, every
compare on integer keys so XLA:CPU's flushing of subnormals cannot reach the bytes). τ, the k-th
smallest |x| of a row, is found exactly by the method with the fewest row reductions
(`shared_math.tiling.select_order_statistic`: a few max rounds at the default clip ratios, where a
sort would cost ~log2(D) passes).

Shapes: N rows, D head dim, G group size.
"""

from __future__ import annotations

import functools

import jax

from oscar_jax.kernels.codec import decode_block, encode_block, resolve_order_statistic


@functools.partial(jax.jit, static_argnames=("group_size", "clip_index", "levels", "rotated"))
def encode_rows(x, *, group_size: int, clip_index: int, levels: str, rotated: bool = False):
    """x [N, D] (float32 / bfloat16 / float16) → packed uint8 [N, D/4], scale, minimum float16
    [N, D/G], bit-identical to shared_math.encode of x's float32 values. `rotated`: the rows are
    products computed in float32 (so not bfloat16 values, whatever x's dtype was)."""
    order_statistic = resolve_order_statistic(None, x.shape[1], clip_index, x.dtype, rotated=rotated)
    return encode_block(x, group_size=group_size, clip_index=clip_index, levels=levels,
                        order_statistic=order_statistic)


@functools.partial(jax.jit, static_argnames=("group_size",))
def decode_rows(packed, scale, minimum, *, group_size: int):
    """packed uint8 [N, D/4], scale/minimum float16 [N, D/G] → float32 [N, D], x̂ = m + code·s."""
    return decode_block(packed, scale, minimum, group_size=group_size)
