"""Public ops of oscar_jax: validate on the host, then launch a Pallas kernel (oscar_jax/kernels).

Same names and argument order as shared_math.codec and oscar_torch.ops. Every op is jittable
(validation reads only shapes and dtypes; value checks such as page-id ranges run when the ids
are concrete) and takes `interpret`: True / False run the Pallas kernels interpreted / compiled;
None (the default) runs the implementation `oscar_jax.xla.kernels()` names — the native XLA path
(oscar_jax/xla) on a CPU backend, the compiled kernels on a GPU backend, unless OSCAR_JAX_KERNELS
or `oscar_jax.xla.use_kernels` says otherwise. Both write the same bytes. Invalid arguments raise
ValueError naming the value (validation comes first, whichever implementation runs).

Sections, in order:
  codec        encode, decode                              (format v1, DESIGN.md §2)
  write path   write_int2, write_pages, write_bf16_pages, demote_pages
  attention    decode_attention, prefill_attention, merge_partials (re-exported from
               oscar_jax.attention_ops, where they are validated and launched)

Page pools (DESIGN.md §2 "Pages"): INT2 codes u8[P, K, L, D/4], scale and minimum f16[P, K, L,
D/G]; BF16 bf16[P, K, L, D] (P pages, K kv heads, L page size, D head dim, G group size). The
write ops return the updated pools; they alias their inputs, so a caller that donates the pools
to its jit (the cache's step does) updates them in place.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax.kernels.codec import decode_rows, encode_rows, resolve_interpret
from oscar_jax.kernels.layered import layer_views
from oscar_jax.kernels.write import (
    demote_pages_rows,
    write_bf16_pages_rows,
    write_int2_rows,
    write_pages_rows,
)
from oscar_jax import xla
from oscar_jax.xla import codec as xla_codec
from oscar_jax.xla import write as xla_write
from shared_math.spec import CODES_PER_BYTE, clip_index, validate_codec_shape, validate_levels

_KERNEL_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ------------------------------------------------------------------------------ validation


def _as_array(a):
    """Arrays, tracers and shape views pass through; anything else (lists, scalars) becomes a
    numpy array."""
    return a if isinstance(a, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) else np.asarray(a)


def _concrete(a) -> np.ndarray | None:
    """The values of `a` when known on the host, None under tracing."""
    return None if isinstance(a, jax.core.Tracer) else np.asarray(a)


def _is_real(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)


def _real_rows(x, name: str):
    """x as an array the kernels read (float32 / bfloat16 / float16); other real dtypes are
    converted to float32 first (on the host for numpy input, so 64-bit values round once)."""
    x = _as_array(x)
    if not _is_real(x.dtype):
        raise ValueError(f"{name} must be a real (float or integer) array, got dtype {x.dtype}")
    if jnp.dtype(x.dtype) not in _KERNEL_INPUT_DTYPES:
        x = x.astype(np.float32) if isinstance(x, np.ndarray) else x.astype(jnp.float32)
    return x


def _check_dtype(a, name: str, dtype) -> None:
    if jnp.dtype(a.dtype) != jnp.dtype(dtype):
        raise ValueError(f"{name} must be {jnp.dtype(dtype).name}, got dtype {a.dtype}")


def _check_ndim(a, name: str, ndims: tuple[int, ...], layout: str) -> None:
    if a.ndim not in ndims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(a.shape)}")


def _check_shape(a, name: str, shape: tuple[int, ...], why: str) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)} {why}")


def _index_vector(ids, name: str, length: int | None = None):
    """A 1-D integer array of page ids or slots, as int32 (checked on the host when concrete)."""
    ids = _as_array(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {ids.dtype}")
    if ids.ndim != 1 or (length is not None and ids.shape[0] != length):
        expected = "[N]" if length is None else f"[{length}] (one per token)"
        raise ValueError(f"{name} must have shape {expected}, got shape {tuple(ids.shape)}")
    return ids


def _check_range(ids, name: str, bound: int, what: str) -> None:
    values = _concrete(ids)
    if values is None or values.size == 0:
        return
    bad = (values < 0) | (values >= bound)
    if bad.any():
        raise ValueError(
            f"{name} must lie in [0, {bound}) ({what}), got {values[bad][:8].tolist()}"
        )


def _as_int32(ids):
    if isinstance(ids, np.ndarray):
        return jnp.asarray(ids.astype(np.int32))
    return ids.astype(jnp.int32)


# The Triton lowering indexes arrays of ≤ 4 GiB with 32-bit element offsets, which wrap
# (sign-extended) past 2^31 elements: only uint8 arrays of 2–4 GiB can reach that. (On the H200, a
# write to the last page of a 2.17 GB codes pool landed elsewhere.)
UNADDRESSABLE_BYTE_ARRAYS = (2**31, 2**32)  # (exclusive, inclusive] element counts of a uint8 array


def byte_array_addressable(num_bytes: int, interpret: bool | None = None) -> bool:
    """Whether the ops can index a uint8 array of `num_bytes` on the path `interpret` selects."""
    if xla.use_xla(interpret) or resolve_interpret(interpret):
        return True
    low, high = UNADDRESSABLE_BYTE_ARRAYS
    return not low < num_bytes <= high


def _check_byte_addressable(a, name: str, interpret: bool | None) -> None:
    if jnp.dtype(a.dtype).itemsize == 1 and not byte_array_addressable(math.prod(a.shape), interpret):
        raise NotImplementedError(
            f"{name} holds {math.prod(a.shape)} bytes: uint8 arrays of 2–4 GiB overflow the Triton "
            f"lowering's 32-bit offsets; use a pool below 2 GiB or above 4 GiB"
        )


def _codec_args(d: int, group_size: int, clip_ratio: float, levels: str) -> int:
    validate_codec_shape(d, group_size)
    validate_levels(levels)
    return clip_index(clip_ratio, d)


# ----------------------------------------------------------------------------------- codec


def encode(x, *, group_size: int, clip_ratio: float, levels: str = "minmax", interpret: bool | None = None):
    """Format v1 encode over arbitrary leading dimensions (bit-identical to shared_math.encode).

    Args:
      x: real array [..., D], D a power of two ≥ 16; the codec is defined on its float32 values.
      group_size: G, a power of two with 16 ≤ G ≤ D.
      clip_ratio: c in (0, 1]; clip threshold = the min(floor(c·D), D−1)-th smallest |x| of a row.
      levels: "minmax" (the paper's codec) or "moments".
    Returns:
      packed uint8[..., D/4], scale float16[..., D/G], minimum float16[..., D/G].
    """
    x = _real_rows(x, "x")
    if x.ndim < 1:
        raise ValueError(f"x must have at least one axis (rows of head_dim values), got shape {x.shape}")
    d = x.shape[-1]
    k = _codec_args(d, group_size, clip_ratio, levels)
    lead = tuple(x.shape[:-1])
    num_rows = math.prod(lead)
    _check_byte_addressable(jax.ShapeDtypeStruct(lead + (d // CODES_PER_BYTE,), jnp.uint8), "packed", interpret)
    if num_rows == 0:
        return (
            jnp.zeros(lead + (d // CODES_PER_BYTE,), jnp.uint8),
            jnp.zeros(lead + (d // group_size,), jnp.float16),
            jnp.zeros(lead + (d // group_size,), jnp.float16),
        )
    rows = jnp.reshape(x, (num_rows, d))
    if xla.use_xla(interpret):
        packed, scale, minimum = xla_codec.encode_rows(rows, group_size=group_size, clip_index=k, levels=levels)
    else:
        packed, scale, minimum = encode_rows(rows, group_size=group_size, clip_index=k, levels=levels,
                                             interpret=interpret)
    return (
        packed.reshape(lead + packed.shape[-1:]),
        scale.reshape(lead + scale.shape[-1:]),
        minimum.reshape(lead + minimum.shape[-1:]),
    )


def decode(packed, scale, minimum, *, group_size: int, interpret: bool | None = None):
    """Format v1 decode: float32[..., D] with x̂ = f32(minimum) + code·f32(scale) per group."""
    packed, scale, minimum = _as_array(packed), _as_array(scale), _as_array(minimum)
    _check_dtype(packed, "packed", jnp.uint8)
    _check_dtype(scale, "scale", jnp.float16)
    _check_dtype(minimum, "minimum", jnp.float16)
    if packed.ndim < 1:
        raise ValueError(f"packed must have at least one axis, got shape {packed.shape}")
    d = packed.shape[-1] * CODES_PER_BYTE
    validate_codec_shape(d, group_size)
    _check_byte_addressable(packed, "packed", interpret)
    lead = tuple(packed.shape[:-1])
    meta_shape = lead + (d // group_size,)
    why = f"for packed {tuple(packed.shape)} and {group_size=}"
    _check_shape(scale, "scale", meta_shape, why)
    _check_shape(minimum, "minimum", meta_shape, why)
    num_rows = math.prod(lead)
    if num_rows == 0:
        return jnp.zeros(lead + (d,), jnp.float32)
    rows = (jnp.reshape(packed, (num_rows, -1)), jnp.reshape(scale, (num_rows, -1)),
            jnp.reshape(minimum, (num_rows, -1)))
    if xla.use_xla(interpret):
        values = xla_codec.decode_rows(*rows, group_size=group_size)
    else:
        values = decode_rows(*rows, group_size=group_size, interpret=interpret)
    return values.reshape(lead + (d,))


# ------------------------------------------------------------------------------ write path


def _token_rows(rows, name: str):
    """rows [T, K, D] for the write ops."""
    rows = _real_rows(rows, name)
    _check_ndim(rows, name, (3,), "[tokens, kv_heads, head_dim]")
    return rows


def _rotation(rotation, num_heads: int, d: int):
    """None, or the per-kv-head rotation float32 [K, D, D]."""
    if rotation is None:
        return None
    rotation = _as_array(rotation)
    _check_dtype(rotation, "rotation", jnp.float32)
    _check_shape(rotation, "rotation", (num_heads, d, d), "([kv_heads, head_dim, head_dim] of the rows)")
    return rotation


def _int2_pools(codes, scale, minimum, ndims: tuple[int, ...]):
    """Validate INT2 page pools [..., P, K, L, D/4] / [..., P, K, L, D/G]; returns D."""
    codes, scale, minimum = _as_array(codes), _as_array(scale), _as_array(minimum)
    _check_dtype(codes, "codes", jnp.uint8)
    _check_dtype(scale, "scale", jnp.float16)
    _check_dtype(minimum, "minimum", jnp.float16)
    layout = " or ".join(
        {4: "[pages, kv_heads, page_size, head_dim/4]", 5: "[layers, pages, kv_heads, page_size, head_dim/4]"}[n]
        for n in ndims
    )
    _check_ndim(codes, "codes", ndims, layout)
    if tuple(scale.shape) != tuple(minimum.shape):
        raise ValueError(f"scale {tuple(scale.shape)} and minimum {tuple(minimum.shape)} must have the same shape")
    if tuple(scale.shape[:-1]) != tuple(codes.shape[:-1]):
        raise ValueError(
            f"scale and minimum {tuple(scale.shape)} must share codes' leading axes {tuple(codes.shape[:-1])}"
        )
    return codes, scale, minimum, codes.shape[-1] * CODES_PER_BYTE


def _check_metadata_width(scale, d: int, group_size: int) -> None:
    if scale.shape[-1] != d // group_size:
        raise ValueError(
            f"scale and minimum hold {scale.shape[-1]} groups per row, expected head_dim/group_size = "
            f"{d // group_size} for head_dim={d} and {group_size=}"
        )


def _check_distinct(pairs: list, name: str) -> None:
    """Reject two writes to one destination (a race on the GPU), when the ids are concrete."""
    values = [_concrete(p) for p in pairs]
    if any(v is None for v in values) or values[0].size == 0:
        return
    stacked = np.stack([v.astype(np.int64) for v in values], axis=-1)
    unique, counts = np.unique(stacked, axis=0, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{name} must be distinct, got repeated {unique[counts > 1][:8].tolist()}")


def write_int2(
    x,
    rotation,
    *,
    group_size: int,
    clip_ratio: float,
    levels: str = "minmax",
    interpret: bool | None = None,
):
    """Fused write of rows x [T, K, D]: k' = x·R[h] in float32 (R per kv head, [K, D, D] float32;
    None for values, which arrive rotated), then format v1 encode of every row.

    Returns packed uint8[T, K, D/4], scale float16[T, K, D/G], minimum float16[T, K, D/G]; the
    bytes equal shared_math.encode of the float32 rows x·R (the product computed in the kernel at
    float32 precision).
    """
    x = _token_rows(x, "x")
    num_tokens, num_heads, d = x.shape
    k = _codec_args(d, group_size, clip_ratio, levels)
    rotation = _rotation(rotation, num_heads, d)
    _check_byte_addressable(
        jax.ShapeDtypeStruct((num_tokens, num_heads, d // CODES_PER_BYTE), jnp.uint8), "packed", interpret
    )
    if num_tokens == 0:
        return (
            jnp.zeros((0, num_heads, d // CODES_PER_BYTE), jnp.uint8),
            jnp.zeros((0, num_heads, d // group_size), jnp.float16),
            jnp.zeros((0, num_heads, d // group_size), jnp.float16),
        )
    if xla.use_xla(interpret):
        return tuple(xla_write.write_int2_rows(jnp.asarray(x), rotation, group_size=group_size, clip_index=k,
                                               levels=levels))
    return tuple(
        write_int2_rows(
            jnp.asarray(x), rotation, group_size=group_size, clip_index=k, levels=levels, interpret=interpret
        )
    )


def write_pages(
    codes,
    scale,
    minimum,
    rows,
    page_ids,
    slots,
    *,
    rotation=None,
    group_size: int,
    clip_ratio: float,
    levels: str = "minmax",
    layer: int | None = None,
    interpret: bool | None = None,
):
    """Quantize rows [T, K, D] (rotated by rotation [K, D, D] float32 when given) into the INT2
    page pools at (page_ids[t], slots[t]) for every kv head; nothing else in the pools changes.

    Args:
      codes, scale, minimum: the INT2 pools u8[P, K, L, D/4], f16[P, K, L, D/G] (twice); with
        `layer` (a static int), pools of all layers [Y, P, …] of which layer `layer` is written in
        place (no slice is copied out: `kernels.layered`).
      rows: real [T, K, D]. page_ids, slots: integer [T], page in [0, P), slot in [0, L); the
        (page, slot) pairs must be distinct. Checked on the host when concrete; under tracing an
        out-of-range destination is skipped (never written).
    Returns:
      the updated (codes, scale, minimum).
    """
    codes, scale, minimum = _as_array(codes), _as_array(scale), _as_array(minimum)
    views = layer_views({"codes": codes, "scale": scale, "minimum": minimum}, layer)
    view, scale_view, _, d = _int2_pools(views["codes"], views["scale"], views["minimum"], ndims=(4,))
    num_pages, num_heads, page_size, _ = view.shape
    rows = _token_rows(rows, "rows")
    num_tokens = rows.shape[0]
    _check_shape(rows, "rows", (num_tokens, num_heads, d), "(kv_heads and head_dim of the pools)")
    k = _codec_args(d, group_size, clip_ratio, levels)
    _check_metadata_width(scale_view, d, group_size)
    rotation = _rotation(rotation, num_heads, d)
    page_ids = _index_vector(page_ids, "page_ids", num_tokens)
    slots = _index_vector(slots, "slots", num_tokens)
    _check_range(page_ids, "page_ids", num_pages, "pages in the pool")
    _check_range(slots, "slots", page_size, "the page size")
    _check_distinct([page_ids, slots], "(page_id, slot) destinations")
    _check_byte_addressable(codes, "codes", interpret)  # the whole (stacked) pool the kernel indexes
    if num_tokens == 0:
        return codes, scale, minimum
    if xla.use_xla(interpret):
        return tuple(xla_write.write_pages_rows(
            codes, scale, minimum, jnp.asarray(rows), _as_int32(page_ids), _as_int32(slots), rotation,
            group_size=group_size, clip_index=k, levels=levels, layer=layer,
        ))
    return tuple(
        write_pages_rows(
            codes,
            scale,
            minimum,
            jnp.asarray(rows),
            _as_int32(page_ids),
            _as_int32(slots),
            rotation,
            group_size=group_size,
            clip_index=k,
            levels=levels,
            interpret=interpret,
            layer=layer,
        )
    )


def write_bf16_pages(pool, rows, page_ids, slots, *, layer: int | None = None, interpret: bool | None = None):
    """Write rows [T, K, D] into the BF16 pool bf16[P, K, L, D] at (page_ids[t], slots[t])
    (float → bfloat16 round-to-nearest-even); returns the updated pool. Same id rules, and the
    same `layer` option (stacked pools [Y, P, K, L, D]), as write_pages."""
    pool = _as_array(pool)
    view = layer_views({"pool": pool}, layer)["pool"]
    _check_dtype(view, "pool", jnp.bfloat16)
    _check_ndim(view, "pool", (4,), "[pages, kv_heads, page_size, head_dim]")
    num_pages, num_heads, page_size, d = view.shape
    rows = _as_array(rows)
    if not jnp.issubdtype(rows.dtype, jnp.floating):
        raise ValueError(f"rows must be a float array, got dtype {rows.dtype}")
    _check_ndim(rows, "rows", (3,), "[tokens, kv_heads, head_dim]")
    num_tokens = rows.shape[0]
    _check_shape(rows, "rows", (num_tokens, num_heads, d), "(kv_heads and head_dim of the pool)")
    page_ids = _index_vector(page_ids, "page_ids", num_tokens)
    slots = _index_vector(slots, "slots", num_tokens)
    _check_range(page_ids, "page_ids", num_pages, "pages in the pool")
    _check_range(slots, "slots", page_size, "the page size")
    _check_distinct([page_ids, slots], "(page_id, slot) destinations")
    if num_tokens == 0:
        return pool
    if xla.use_xla(interpret):
        return xla_write.write_bf16_pages_rows(pool, jnp.asarray(rows), _as_int32(page_ids), _as_int32(slots),
                                               layer=layer)
    return write_bf16_pages_rows(
        pool, jnp.asarray(rows), _as_int32(page_ids), _as_int32(slots), interpret=interpret, layer=layer
    )


def demote_pages(
    bf16_pool,
    codes,
    scale,
    minimum,
    src_pages,
    dst_pages,
    *,
    group_size: int,
    clip_ratio: float,
    levels: str = "minmax",
    interpret: bool | None = None,
):
    """Quantize whole BF16 pages into INT2 pages: for n < N, every kv head (and every layer),
    INT2 page dst_pages[n] ← encode(BF16 page src_pages[n]). Rows are already rotated.

    Args:
      bf16_pool: bf16[P, K, L, D], or bf16[Y, P, K, L, D] with a leading layer axis (one launch
        demotes the page of all Y layers); L a power of two.
      codes, scale, minimum: the INT2 pools, with the same leading axes except their own page
        count P': u8[(Y,) P', K, L, D/4], f16[(Y,) P', K, L, D/G].
      src_pages: integer [N] in [0, P). dst_pages: integer [N] in [0, P'), distinct.
    Returns:
      the updated (codes, scale, minimum). Each demoted row has exactly the bytes of
      shared_math.encode(row.astype(float32)).
    """
    bf16_pool = _as_array(bf16_pool)
    _check_dtype(bf16_pool, "bf16_pool", jnp.bfloat16)
    _check_ndim(
        bf16_pool, "bf16_pool", (4, 5),
        "[pages, kv_heads, page_size, head_dim] or [layers, pages, kv_heads, page_size, head_dim]",
    )
    codes, scale, minimum, d = _int2_pools(codes, scale, minimum, ndims=(bf16_pool.ndim,))
    layered = bf16_pool.ndim == 5
    if not layered:
        bf16_pool, codes, scale, minimum = (a[None] for a in (bf16_pool, codes, scale, minimum))
    num_layers, num_src, num_heads, page_size, bf16_d = bf16_pool.shape
    if bf16_d != d:
        raise ValueError(f"bf16_pool head_dim={bf16_d} differs from the INT2 pools' head_dim={d}")
    if (codes.shape[0], codes.shape[2], codes.shape[3]) != (num_layers, num_heads, page_size):
        raise ValueError(
            f"codes {tuple(codes.shape)} must match bf16_pool {tuple(bf16_pool.shape)} in layers, "
            f"kv_heads and page_size"
        )
    if page_size & (page_size - 1):
        raise ValueError(f"{page_size=} of the pools must be a power of two")
    k = _codec_args(d, group_size, clip_ratio, levels)
    _check_metadata_width(scale, d, group_size)
    src_pages = _index_vector(src_pages, "src_pages")
    dst_pages = _index_vector(dst_pages, "dst_pages", src_pages.shape[0])
    _check_range(src_pages, "src_pages", num_src, "pages in bf16_pool")
    _check_range(dst_pages, "dst_pages", codes.shape[1], "pages in the INT2 pools")
    _check_distinct([dst_pages], "dst_pages")
    _check_byte_addressable(codes, "codes", interpret)
    if src_pages.shape[0] > 0 and xla.use_xla(interpret):
        codes, scale, minimum = xla_write.demote_pages_rows(
            bf16_pool, codes, scale, minimum, _as_int32(src_pages), _as_int32(dst_pages), group_size=group_size,
            clip_index=k, levels=levels,
        )
    elif src_pages.shape[0] > 0:
        codes, scale, minimum = demote_pages_rows(
            bf16_pool,
            codes,
            scale,
            minimum,
            _as_int32(src_pages),
            _as_int32(dst_pages),
            group_size=group_size,
            clip_index=k,
            levels=levels,
            interpret=interpret,
        )
    if not layered:
        codes, scale, minimum = codes[0], scale[0], minimum[0]
    return codes, scale, minimum


# ------------------------------------------------------------------------------ attention

from oscar_jax.attention_ops import decode_attention, merge_partials, prefill_attention  # noqa: E402

__all__ = [
    "encode", "decode", "write_int2", "write_pages", "write_bf16_pages", "demote_pages",
    "decode_attention", "prefill_attention", "merge_partials",
]
