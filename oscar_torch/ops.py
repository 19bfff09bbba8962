"""Public ops of oscar_torch: validate on the host, then launch a Triton kernel (oscar_torch/kernels).

Same names, argument order and semantics as shared_math.codec, oscar_jax.ops and
oscar_jax.attention_ops. Every kernel launch goes through a torch custom op (oscar_torch.library),
so the ops run under torch.compile(fullgraph=True) and CUDA-graph capture; the write ops update
the page pools in place (declared to torch as mutations) and also return them, so code written
against the functional JAX API (`codes, scale, minimum = write_pages(...)`) runs unchanged.
Tensors must be contiguous and on one device: cuda, or cpu under the Triton interpreter
(TRITON_INTERPRET=1). Invalid arguments raise ValueError naming the value.

Sections, in order:
  codec        encode, decode                              (format v1, DESIGN.md §2)
  write path   write_int2, write_pages, write_bf16_pages, demote_pages
  attention    decode_attention, prefill_attention (defined in oscar_torch.attention_ops)

Page pools (DESIGN.md §2 "Pages"): INT2 codes u8[P, K, L, D/4], scale and minimum f16[P, K, L,
D/G]; BF16 bf16[P, K, L, D] (P pages, K kv heads, L page size, D head dim, G group size).
"""

from __future__ import annotations

import math

import torch

from oscar_torch import library
from oscar_torch.attention_ops import decode_attention, merge_partials, prefill_attention
from oscar_torch.validation import (
    FLOAT_DTYPES,
    check_devices,
    check_distinct,
    check_range,
    check_tensor,
    index_vector,
)
from shared_math.spec import CODES_PER_BYTE, clip_index, validate_codec_shape, validate_levels

__all__ = [
    "encode", "decode", "write_int2", "write_pages", "write_bf16_pages", "demote_pages",
    "decode_attention", "prefill_attention", "merge_partials",
]

_INT2_LAYOUT = {
    4: "[pages, kv_heads, page_size, head_dim/4]",
    5: "[layers, pages, kv_heads, page_size, head_dim/4]",
}


# ------------------------------------------------------------------------------ validation


def _real_rows(x, name: str) -> torch.Tensor:
    """x as a tensor the kernels read (float32 / bfloat16 / float16); other real dtypes (float64,
    integers) are converted to float32 first (one rounding, as numpy's astype)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool or x.is_complex() or not (x.is_floating_point() or _is_integer(x.dtype)):
        raise ValueError(f"{name} must be a real (float or integer) tensor, got dtype {str(x.dtype).removeprefix('torch.')}")
    check_tensor(name, x)  # contiguity
    return x if x.dtype in FLOAT_DTYPES else x.to(torch.float32)


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _codec_args(d: int, group_size: int, clip_ratio: float, levels: str) -> int:
    validate_codec_shape(d, group_size)
    validate_levels(levels)
    return clip_index(clip_ratio, d)


def _check_ndim(x: torch.Tensor, name: str, ndims: tuple[int, ...], layout: str) -> None:
    if x.dim() not in ndims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def _check_shape(x: torch.Tensor, name: str, shape: tuple[int, ...], why: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} {why}")


# ----------------------------------------------------------------------------------- codec


def encode(x, *, group_size: int, clip_ratio: float, levels: str = "minmax"):
    """Format v1 encode over arbitrary leading dimensions (bit-identical to shared_math.encode).

    Args:
      x: real tensor [..., D], D a power of two ≥ 16; the codec is defined on its float32 values.
      group_size: G, a power of two with 16 ≤ G ≤ D.
      clip_ratio: c in (0, 1]; clip threshold = the min(floor(c·D), D−1)-th smallest |x| of a row.
      levels: "minmax" (the paper's codec) or "moments".
    Returns:
      packed uint8[..., D/4], scale float16[..., D/G], minimum float16[..., D/G].
    """
    x = _real_rows(x, "x")
    if x.dim() < 1:
        raise ValueError(f"x must have at least one axis (rows of head_dim values), got shape {tuple(x.shape)}")
    check_devices(x=x)
    d = x.shape[-1]
    k = _codec_args(d, group_size, clip_ratio, levels)
    lead = tuple(x.shape[:-1])
    num_rows = math.prod(lead)
    if num_rows == 0:
        return library.empty_int2_outputs(lead, d, group_size, x)
    packed, scale, minimum = library.encode(x.reshape(num_rows, d), group_size, k, levels)
    return (
        packed.reshape(lead + packed.shape[-1:]),
        scale.reshape(lead + scale.shape[-1:]),
        minimum.reshape(lead + minimum.shape[-1:]),
    )


def decode(packed, scale, minimum, *, group_size: int):
    """Format v1 decode: float32[..., D] with x̂ = f32(minimum) + code·f32(scale) per group."""
    packed = check_tensor("packed", packed, dtypes=(torch.uint8,))
    scale = check_tensor("scale", scale, dtypes=(torch.float16,))
    minimum = check_tensor("minimum", minimum, dtypes=(torch.float16,))
    if packed.dim() < 1:
        raise ValueError(f"packed must have at least one axis, got shape {tuple(packed.shape)}")
    check_devices(packed=packed, scale=scale, minimum=minimum)
    d = packed.shape[-1] * CODES_PER_BYTE
    validate_codec_shape(d, group_size)
    lead = tuple(packed.shape[:-1])
    meta_shape = lead + (d // group_size,)
    why = f"for packed {tuple(packed.shape)} and {group_size=}"
    _check_shape(scale, "scale", meta_shape, why)
    _check_shape(minimum, "minimum", meta_shape, why)
    num_rows = math.prod(lead)
    if num_rows == 0:
        return packed.new_zeros(lead + (d,), dtype=torch.float32)
    values = library.decode(
        packed.reshape(num_rows, -1), scale.reshape(num_rows, -1), minimum.reshape(num_rows, -1), group_size
    )
    return values.reshape(lead + (d,))


# ------------------------------------------------------------------------------ write path


def _token_rows(rows, name: str) -> torch.Tensor:
    """rows [T, K, D] for the write ops."""
    rows = _real_rows(rows, name)
    _check_ndim(rows, name, (3,), "[tokens, kv_heads, head_dim]")
    return rows


def _rotation(rotation, num_heads: int, d: int):
    """None, or the per-kv-head rotation float32 [K, D, D]."""
    if rotation is None:
        return None
    return check_tensor(
        "rotation", rotation, dtypes=(torch.float32,), shape=(num_heads, d, d),
        layout="([kv_heads, head_dim, head_dim] of the rows)",
    )


def _int2_pools(codes, scale, minimum, ndims: tuple[int, ...]):
    """Validate INT2 page pools [..., P, K, L, D/4] / [..., P, K, L, D/G]; returns D."""
    codes = check_tensor("codes", codes, dtypes=(torch.uint8,))
    scale = check_tensor("scale", scale, dtypes=(torch.float16,))
    minimum = check_tensor("minimum", minimum, dtypes=(torch.float16,))
    _check_ndim(codes, "codes", ndims, " or ".join(_INT2_LAYOUT[n] for n in ndims))
    if tuple(scale.shape) != tuple(minimum.shape):
        raise ValueError(f"scale {tuple(scale.shape)} and minimum {tuple(minimum.shape)} must have the same shape")
    if tuple(scale.shape[:-1]) != tuple(codes.shape[:-1]):
        raise ValueError(
            f"scale and minimum {tuple(scale.shape)} must share codes' leading axes {tuple(codes.shape[:-1])}"
        )
    return codes.shape[-1] * CODES_PER_BYTE


def _check_metadata_width(scale: torch.Tensor, d: int, group_size: int) -> None:
    if scale.shape[-1] != d // group_size:
        raise ValueError(
            f"scale and minimum hold {scale.shape[-1]} groups per row, expected head_dim/group_size = "
            f"{d // group_size} for head_dim={d} and {group_size=}"
        )


def _destination_ids(page_ids, slots, num_tokens: int):
    """Type, dtype and shape of the per-token destinations; int32 copies."""
    return index_vector("page_ids", page_ids, num_tokens), index_vector("slots", slots, num_tokens)


def _check_destinations(page_ids, slots, num_pages: int, page_size: int) -> None:
    """Values of the destinations (eager mode only: they are read from the device)."""
    check_range("page_ids", page_ids, num_pages, "pages in the pool")
    check_range("slots", slots, page_size, "the page size")
    check_distinct("(page_id, slot) destinations", page_ids, slots)


def write_int2(x, rotation, *, group_size: int, clip_ratio: float, levels: str = "minmax"):
    """Fused write of rows x [T, K, D]: k' = x·R[h] in float32 (R per kv head, [K, D, D] float32;
    None for values, which arrive rotated), then format v1 encode of every row.

    Returns packed uint8[T, K, D/4], scale float16[T, K, D/G], minimum float16[T, K, D/G]; the
    bytes equal shared_math.encode of the float32 rows x·R (the product computed in the kernel at
    IEEE float32 precision, so with a rotation the bytes match up to that product's rounding).
    """
    x = _token_rows(x, "x")
    num_tokens, num_heads, d = x.shape
    k = _codec_args(d, group_size, clip_ratio, levels)
    rotation = _rotation(rotation, num_heads, d)
    check_devices(x=x, rotation=rotation)
    if num_tokens == 0:
        return library.empty_int2_outputs((0, num_heads), d, group_size, x)
    return library.write_int2(x, rotation, group_size, k, levels)


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
):
    """Quantize rows [T, K, D] (rotated by rotation [K, D, D] float32 when given) into the INT2
    page pools at (page_ids[t], slots[t]) for every kv head, in place; nothing else changes.

    Args:
      codes, scale, minimum: the INT2 pools u8[P, K, L, D/4], f16[P, K, L, D/G] (twice).
      rows: real [T, K, D]. page_ids, slots: integer [T], page in [0, P), slot in [0, L); the
        (page, slot) pairs must be distinct. Checked on the host in eager mode; under
        torch.compile an out-of-range destination is skipped (never written).
    Returns:
      the same (codes, scale, minimum) tensors, updated.
    """
    d = _int2_pools(codes, scale, minimum, ndims=(4,))
    num_pages, num_heads, page_size, _ = codes.shape
    rows = _token_rows(rows, "rows")
    num_tokens = rows.shape[0]
    _check_shape(rows, "rows", (num_tokens, num_heads, d), "(kv_heads and head_dim of the pools)")
    k = _codec_args(d, group_size, clip_ratio, levels)
    _check_metadata_width(scale, d, group_size)
    rotation = _rotation(rotation, num_heads, d)
    page_ids, slots = _destination_ids(page_ids, slots, num_tokens)
    check_devices(codes=codes, scale=scale, minimum=minimum, rows=rows, page_ids=page_ids, slots=slots,
                  rotation=rotation)
    _check_destinations(page_ids, slots, num_pages, page_size)
    if num_tokens > 0:
        library.write_pages(codes, scale, minimum, rows, page_ids, slots, rotation, group_size, k, levels)
    return codes, scale, minimum


def write_bf16_pages(pool, rows, page_ids, slots):
    """Write rows [T, K, D] into the BF16 pool bf16[P, K, L, D] at (page_ids[t], slots[t]), in
    place (float → bfloat16 round-to-nearest-even; float64 rows are rounded to float32 first);
    returns the same pool. Same id rules as write_pages."""
    pool = check_tensor("pool", pool, dtypes=(torch.bfloat16,))
    _check_ndim(pool, "pool", (4,), "[pages, kv_heads, page_size, head_dim]")
    num_pages, num_heads, page_size, d = pool.shape
    if not isinstance(rows, torch.Tensor):
        raise ValueError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if not rows.is_floating_point():
        raise ValueError(f"rows must be a float tensor, got dtype {str(rows.dtype).removeprefix('torch.')}")
    rows = _token_rows(rows, "rows")
    num_tokens = rows.shape[0]
    _check_shape(rows, "rows", (num_tokens, num_heads, d), "(kv_heads and head_dim of the pool)")
    page_ids, slots = _destination_ids(page_ids, slots, num_tokens)
    check_devices(pool=pool, rows=rows, page_ids=page_ids, slots=slots)
    _check_destinations(page_ids, slots, num_pages, page_size)
    if num_tokens > 0:
        library.write_bf16_pages(pool, rows, page_ids, slots)
    return pool


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
):
    """Quantize whole BF16 pages into INT2 pages, in place: for n < N, every kv head (and every
    layer), INT2 page dst_pages[n] ← encode(BF16 page src_pages[n]). Rows are already rotated.

    Args:
      bf16_pool: bf16[P, K, L, D], or bf16[Y, P, K, L, D] with a leading layer axis (one launch
        demotes the page of all Y layers); L a power of two.
      codes, scale, minimum: the INT2 pools, with the same leading axes except their own page
        count P': u8[(Y,) P', K, L, D/4], f16[(Y,) P', K, L, D/G].
      src_pages: integer [N] in [0, P). dst_pages: integer [N] in [0, P'), distinct.
    Returns:
      the same (codes, scale, minimum) tensors, updated. Each demoted row has exactly the bytes of
      shared_math.encode(row.astype(float32)).
    """
    bf16_pool = check_tensor("bf16_pool", bf16_pool, dtypes=(torch.bfloat16,))
    _check_ndim(
        bf16_pool, "bf16_pool", (4, 5),
        "[pages, kv_heads, page_size, head_dim] or [layers, pages, kv_heads, page_size, head_dim]",
    )
    d = _int2_pools(codes, scale, minimum, ndims=(bf16_pool.dim(),))
    layered = bf16_pool.dim() == 5
    pools = (bf16_pool, codes, scale, minimum) if layered else tuple(
        a.unsqueeze(0) for a in (bf16_pool, codes, scale, minimum)
    )
    num_layers, _, num_heads, page_size, bf16_d = pools[0].shape
    if bf16_d != d:
        raise ValueError(f"bf16_pool head_dim={bf16_d} differs from the INT2 pools' head_dim={d}")
    if (pools[1].shape[0], pools[1].shape[2], pools[1].shape[3]) != (num_layers, num_heads, page_size):
        raise ValueError(
            f"codes {tuple(codes.shape)} must match bf16_pool {tuple(bf16_pool.shape)} in layers, "
            f"kv_heads and page_size"
        )
    if page_size & (page_size - 1):
        raise ValueError(f"{page_size=} of the pools must be a power of two")
    k = _codec_args(d, group_size, clip_ratio, levels)
    _check_metadata_width(scale, d, group_size)
    src_pages = index_vector("src_pages", src_pages)
    dst_pages = index_vector("dst_pages", dst_pages, src_pages.shape[0])
    check_devices(bf16_pool=bf16_pool, codes=codes, scale=scale, minimum=minimum, src_pages=src_pages,
                  dst_pages=dst_pages)
    check_range("src_pages", src_pages, pools[0].shape[1], "pages in bf16_pool")
    check_range("dst_pages", dst_pages, pools[1].shape[1], "pages in the INT2 pools")
    check_distinct("dst_pages", dst_pages)
    if src_pages.shape[0] > 0:
        library.demote_pages(*pools, src_pages, dst_pages, group_size, k, levels)
    return codes, scale, minimum
