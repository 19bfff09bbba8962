"""The write path in plain XLA: fused rotate + encode, page scatters, demotion (DESIGN.md §2–3).

Same pools, destinations and bytes as `oscar_jax.kernels.write`:
  INT2 tier  codes u8[(Y,) P, K, L, D/4], scale / minimum f16[(Y,) P, K, L, D/G]
  BF16 tier  bf16[(Y,) P, K, L, D]
(Y layers, P pages, K kv heads, L page size, D head dim, G group size, T tokens, N pages to demote.)
Every row is encoded by `xla.codec.encode_rows`, all tokens and heads of a call in one program,
and scattered with `.at[...].set(mode="drop")`: a destination outside the pool (traced ids; the
public ops reject them on the host when concrete) is moved past the pool's end and dropped — never
wrapped, as a negative index would be. Inside a jit that donates the pools the scatters update
them in place (these functions donate nothing themselves: an eager caller keeps its arrays).

Key rotation, k' = k·R_K per kv head, computed as the Pallas write kernels compute it: float32
rows as one float32 product at Precision.HIGHEST; bfloat16 rows as three products with R_K's
bfloat16 parts (shared_math.rotation.split_bf16), summed smallest part first. The bytes equal
shared_math.encode of the rotated float32 rows this program computed; whether that product has the
same last bit as the kernels' depends on the summation order each compiler picks for the dot (not
part of the format: parity_tests/checks.fused_rotation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from oscar_jax.xla.codec import encode_channel_pages, encode_rows
from shared_math.rotation import split_bf16
from shared_math.spec import CODES_PER_BYTE

_HIGHEST = lax.Precision.HIGHEST


def rotate_rows(x, rotation):
    """x [T, K, D] · R [K, D, D] per kv head → float32 [T, K, D] (module docstring)."""
    if jnp.dtype(x.dtype) == jnp.bfloat16:
        parts = split_bf16(rotation.astype(jnp.float32), to_bits=lambda a: lax.bitcast_convert_type(a, jnp.int32),
                           from_bits=lambda b: lax.bitcast_convert_type(b, jnp.float32))
        # bfloat16 × bfloat16 products are exact in float32, so each part's product runs as a float32
        # dot of the same values (XLA:CPU has no bfloat16 dot with a float32 result).
        x32, acc = x.astype(jnp.float32), None
        for part in reversed(parts):  # smallest part first, as the kernels sum them
            term = jnp.einsum("tkd,kde->tke", x32, part, precision=_HIGHEST, preferred_element_type=jnp.float32)
            acc = term if acc is None else acc + term
        return acc
    return jnp.einsum("tkd,kde->tke", x.astype(jnp.float32), rotation.astype(jnp.float32), precision=_HIGHEST,
                      preferred_element_type=jnp.float32)


def _encode_tokens(x, rotation, *, group_size: int, clip_index: int, levels: str):
    """x [T, K, D] (rotated by rotation [K, D, D] unless None) → packed [T, K, D/4], scale, minimum [T, K, D/G]."""
    num_tokens, num_heads, d = x.shape
    rotated = rotation is not None
    rows = rotate_rows(x, rotation) if rotated else x
    packed, scale, minimum = encode_rows(rows.reshape(num_tokens * num_heads, d), group_size=group_size,
                                         clip_index=clip_index, levels=levels, rotated=rotated)
    return tuple(a.reshape(num_tokens, num_heads, a.shape[-1]) for a in (packed, scale, minimum))


@functools.partial(jax.jit, static_argnames=("group_size", "clip_index", "levels"))
def write_int2_rows(x, rotation, *, group_size: int, clip_index: int, levels: str):
    """x [T, K, D], rotation [K, D, D] f32 or None → packed [T, K, D/4], scale, minimum [T, K, D/G]."""
    return _encode_tokens(x, rotation, group_size=group_size, clip_index=clip_index, levels=levels)


def _scatter(pool, value, page_ids, slots, layer):
    """pool [(Y,) P, K, L, W] ← value [T, K, W] at (page_ids[t], :, slots[t]); out-of-range
    destinations (either index) are dropped."""
    num_pages, _, page_size, _ = pool.shape[-4:]
    valid = (page_ids >= 0) & (page_ids < num_pages) & (slots >= 0) & (slots < page_size)
    page_ids = jnp.where(valid, page_ids, num_pages)  # past the end: dropped, never wrapped
    slots = jnp.where(valid, slots, 0)
    index = (page_ids, slice(None), slots) if layer is None else (layer, page_ids, slice(None), slots)
    return pool.at[index].set(value.astype(pool.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("group_size", "clip_index", "levels", "layer"))
def write_pages_rows(codes, scale, minimum, x, page_ids, slots, rotation, *, group_size: int, clip_index: int,
                     levels: str, layer: int | None = None):
    """Encode x [T, K, D] (rotated by rotation [K, D, D] unless None) into the INT2 pools at
    (page_ids[t], slots[t]) (of layer `layer` of stacked pools [Y, P, …] when given); returns the
    updated (codes, scale, minimum)."""
    encoded = _encode_tokens(x, rotation, group_size=group_size, clip_index=clip_index, levels=levels)
    return tuple(_scatter(pool, value, page_ids, slots, layer) for pool, value in zip((codes, scale, minimum), encoded))


@functools.partial(jax.jit, static_argnames=("layer",))
def write_bf16_pages_rows(pool, x, page_ids, slots, *, layer: int | None = None):
    """pool [(Y,) P, K, L, D] ← x [T, K, D] rounded to bfloat16 (nearest even) at (page_ids[t], slots[t])."""
    return _scatter(pool, x, page_ids, slots, layer)


@functools.partial(jax.jit, static_argnames=("group_size", "clip_index", "levels"))
def demote_pages_rows(bf16_pool, codes, scale, minimum, src_pages, dst_pages, *, group_size: int, clip_index: int,
                      levels: str):
    """INT2 pages [y, dst_pages[n]] ← encode(BF16 pages bf16_pool[y, src_pages[n]]) for every layer y
    and kv head; pools carry the leading layer axis Y. A pair with either id out of range is skipped."""
    num_layers, num_src, num_heads, page_size, d = bf16_pool.shape
    num_dst = codes.shape[1]
    valid = (src_pages >= 0) & (src_pages < num_src) & (dst_pages >= 0) & (dst_pages < num_dst)
    rows = bf16_pool[:, jnp.where(valid, src_pages, 0)]  # [Y, N, K, L, D]
    encoded = encode_rows(rows.reshape(-1, d), group_size=group_size, clip_index=clip_index, levels=levels)
    dst = jnp.where(valid, dst_pages, num_dst)  # past the end: dropped
    shape = rows.shape[:-1]
    return tuple(pool.at[:, dst].set(value.reshape(shape + value.shape[-1:]), mode="drop")
                 for pool, value in zip((codes, scale, minimum), encoded))


def _demote_by_groups(bf16_pool, codes, scale, minimum, src_pages, dst_pages, groups, encode):
    """For each (clip_index, layers) of `groups`: the BF16 pages [layers, src_pages] encoded by
    encode(pages [NL, N, K, L, D], clip_index) → arrays shaped as the pools' [NL, N, …] entries, and
    scattered to [layers, dst_pages]; a pair with either id out of range is skipped."""
    num_src, num_dst = bf16_pool.shape[1], codes.shape[1]
    valid = (src_pages >= 0) & (src_pages < num_src) & (dst_pages >= 0) & (dst_pages < num_dst)
    src = jnp.where(valid, src_pages, 0)
    dst = jnp.where(valid, dst_pages, num_dst)  # past the end: dropped
    pools = [codes, scale, minimum]
    for clip_index, layers in groups:
        index = jnp.asarray(layers, jnp.int32)[:, None]  # [NL, 1]
        pages = bf16_pool[index, src[None, :]]  # [NL, N, K, L, D]
        pools = [pool.at[index, dst[None, :]].set(value, mode="drop")
                 for pool, value in zip(pools, encode(pages, clip_index))]
    return tuple(pools)


@functools.partial(jax.jit, static_argnames=("group_size", "groups", "levels"))
def demote_layer_groups(bf16_pool, codes, scale, minimum, src_pages, dst_pages, *, group_size: int,
                        groups: tuple[tuple[int, tuple[int, ...]], ...], levels: str):
    """`demote_pages_rows` for stacked pools whose layers encode with different clip indices:
    groups ((clip_index, layers), …) — each group's layers demoted by one encode of all their rows and
    one scatter per pool, where a loop over the layers would run one program per layer (a calibrated
    artifact's clip ratios differ layer to layer: 3 groups instead of 30 launches for SmolLM2).
    Same bytes: every row is encoded with its layer's clip index."""
    d = bf16_pool.shape[-1]

    def encode(pages, clip_index):
        encoded = encode_rows(pages.reshape(-1, d), group_size=group_size, clip_index=clip_index, levels=levels)
        return [value.reshape(pages.shape[:-1] + value.shape[-1:]) for value in encoded]

    return _demote_by_groups(bf16_pool, codes, scale, minimum, src_pages, dst_pages, groups, encode)


@functools.partial(jax.jit, static_argnames=("groups", "levels"))
def demote_channel_key_pages(bf16_pool, codes, scale, minimum, src_pages, dst_pages, *,
                             groups: tuple[tuple[int, tuple[int, ...]], ...], levels: str):
    """Format v2 key pages: INT2 pages [y, dst_pages[n]] ← encode_channels(BF16 pages
    bf16_pool[y, src_pages[n]]) for every kv head, each channel over the page's tokens; groups
    ((clip_index, layers), …) as in `demote_layer_groups`. Pools: bf16 [Y, P, K, L, D], codes
    u8[Y, P', K, L, D/4], scale / minimum f16[Y, P', K, D]. A pair with either id out of range is
    skipped."""
    page_size, d = bf16_pool.shape[-2:]

    def encode(pages, clip_index):
        encoded = encode_channel_pages(pages.reshape(-1, page_size, d), clip_index=clip_index, levels=levels)
        return [value.reshape(pages.shape[:3] + value.shape[1:]) for value in encoded]

    return _demote_by_groups(bf16_pool, codes, scale, minimum, src_pages, dst_pages, groups, encode)


@functools.partial(jax.jit, static_argnames=("clip_index", "levels", "layer"))
def write_channel_key_pages(codes, scale, minimum, x, page_ids, slots, rotation, *, clip_index: int, levels: str,
                            layer: int | None = None):
    """Format v2: a prefill chunk's keys x [B, T, K, D] (rotated by rotation [K, D, D] unless None)
    written into the INT2 key pools as whole pages. A chunk starts on a page boundary (the runtime
    prefills page-aligned chunks), so its tokens j·L … j·L + L − 1 are one page: every such page
    whose first token goes to slot 0 of a page in range is encoded per channel and written there;
    the others (BF16 tokens, padding) are skipped. Pools: codes u8[(Y,) P, K, L, D/4], scale /
    minimum f16[(Y,) P, K, D] (of layer `layer` of stacked pools when given)."""
    batch, tokens, heads, d = x.shape
    page_size, num_pages = codes.shape[-2], codes.shape[-4]
    rows = x.reshape(batch * tokens, heads, d)
    rows = (rotate_rows(rows, rotation) if rotation is not None else rows.astype(jnp.float32))
    rows = rows.reshape(batch, tokens, heads, d)
    pad = -tokens % page_size
    if pad:  # a chunk shorter than a page, or ragged: the padding pages are skipped
        rows = jnp.pad(rows, ((0, 0), (0, pad), (0, 0), (0, 0)))
        page_ids = jnp.pad(page_ids, ((0, 0), (0, pad)), constant_values=num_pages)
        slots = jnp.pad(slots, ((0, 0), (0, pad)))
    pages = rows.reshape(batch, -1, page_size, heads, d).transpose(0, 1, 3, 2, 4)  # [B, N, K, L, D]
    packed, page_scale, page_min = encode_channel_pages(pages.reshape(-1, page_size, d), clip_index=clip_index,
                                                        levels=levels)
    dest, first_slot = (a[:, ::page_size].reshape(-1) for a in (page_ids, slots))
    dest = jnp.where((dest >= 0) & (dest < num_pages) & (first_slot == 0), dest, num_pages)  # else dropped
    values = (packed.reshape(-1, heads, page_size, d // CODES_PER_BYTE), page_scale.reshape(-1, heads, d),
              page_min.reshape(-1, heads, d))
    index = (dest,) if layer is None else (layer, dest)
    return tuple(pool.at[index].set(value, mode="drop") for pool, value in zip((codes, scale, minimum), values))
