"""Format v1 encode / decode of rows, and format v2's per-channel key pages, in plain XLA (FORMAT.md).

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

import jax.numpy as jnp

from oscar_jax.kernels.codec import (
    decode_block,
    encode_block,
    encode_channels_block,
    resolve_order_statistic,
    unpack_block,
)


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


@functools.partial(jax.jit, static_argnames=("clip_index", "levels"))
def encode_channel_pages(x, *, clip_index: int, levels: str):
    """Format v2 key pages x [N, L, D] (L tokens) → packed uint8 [N, L, D/4], scale and minimum float16
    [N, D], bit-identical to shared_math.encode_channels of x's float32 values: each channel over the
    page's L tokens is one group (clip index over L values)."""
    order_statistic = resolve_order_statistic(None, x.shape[1], clip_index, x.dtype)
    return encode_channels_block(x, clip_index=clip_index, levels=levels, order_statistic=order_statistic)


@jax.jit
def decode_channel_pages(packed, scale, minimum):
    """packed uint8 [N, L, D/4], scale / minimum float16 [N, D] → float32 [N, L, D], x̂ = m[c] + code·s[c]."""
    num_pages, page_size, quarter = packed.shape
    codes = unpack_block(packed.reshape(-1, quarter)).reshape(num_pages, page_size, -1).astype(jnp.float32)
    return minimum.astype(jnp.float32)[:, None, :] + codes * scale.astype(jnp.float32)[:, None, :]
