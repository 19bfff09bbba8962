"""Write-path kernels: fused rotate + encode, page scatters, and page demotion (DESIGN.md §2–3).

Page pools (per layer, head-major so one (page, head) block is contiguous):
  INT2 tier  codes u8[P, K, L, D/4], scale f16[P, K, L, D/G], minimum f16[P, K, L, D/G]
  BF16 tier  bf16[P, K, L, D]
(P pages, K kv heads, L page size, D head dim, G group size, T tokens, N pages to demote,
Y layers.) A destination is a (page, slot) pair per token. Pools are updated in place through
`input_output_aliases`; the update is truly in place when the caller's jit donates the pools.
Destinations outside the pool (a page id outside [0, P) or a slot outside [0, L)) are never
written: the public ops reject them on the host when the ids are concrete, and the kernels mask
them (never an out-of-bounds store) when they are traced.

Encoding is `encode_block` from codec.py, so every written row has exactly the bytes of
shared_math.encode of the same float32 row. Keys are rotated in the kernel, k' = k·R_K with
R_K [K, D, D] per kv head: float32 rows as a float32 `jnp.dot` at Precision.HIGHEST (IEEE
float32 on the GPU, never TF32); bfloat16 rows as three bfloat16 tensor-core products with R_K
split into bfloat16 parts (shared_math.rotation.split_bf16: float32-accurate and faster than the
float32 product; benchmarks/DECISIONS.md W1). Values arrive already rotated (R_V folded into W_v) and take
no rotation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from oscar_jax.kernels.codec import (
    DEFAULT_BLOCK_ROWS,
    DEFAULT_NUM_WARPS,
    block_rows_for,
    encode_block,
    encode_planes_or_block,
    load_planes,
    load_block,
    resolve_interpret,
    resolve_order_statistic,
    store_block,
)
from oscar_jax.kernels.layered import flat_pool, layer_page_base, layer_page_base_spec, per_layer_shape
from shared_math.rotation import BF16_SPLIT_PARTS, split_bf16
from shared_math.spec import CODES_PER_BYTE
from shared_math.tiling import (
    ENCODE_PLANES_BLOCK_ROWS,
    SPLIT_ROTATION_BLOCK_TOKENS,
    planes_block_rows,
    resolve_encode_planes,
)

# tl.dot needs M, N, K ≥ 16: the fused rotation runs on blocks of at least this many tokens.
MIN_DOT_ROWS = 16
INT2_ARRAYS = ("codes", "scale", "minimum")  # the three arrays of an INT2 page pool


def _alias_int2_pools(num_operands: int) -> dict[int, int]:
    """The INT2 pools are the last operands and outputs 0, 1, 2: update them in place."""
    first = num_operands - len(INT2_ARRAYS)
    return {first + i: i for i in range(len(INT2_ARRAYS))}


def _rotation_operand(rotation, x_dtype):
    """The rotation as the kernel reads it, and its BlockSpec (one kv head per program):
    bfloat16 rows take R_K split into bfloat16 parts [K, 3, D, D] (split_bf16: integer rounding,
    which XLA cannot elide); other rows take R_K itself, [K, D, D] float32."""
    if x_dtype == jnp.bfloat16:
        parts = split_bf16(
            rotation.astype(jnp.float32),
            to_bits=lambda a: lax.bitcast_convert_type(a, jnp.int32),
            from_bits=lambda b: lax.bitcast_convert_type(b, jnp.float32),
        )
        rotation = jnp.stack(parts, axis=-3).astype(jnp.bfloat16)  # exact: bfloat16 values
    block = (None,) + tuple(rotation.shape[1:])
    return rotation, pl.BlockSpec(block, lambda h, i: (h,) + (0,) * (len(block) - 1))


def _split_product(xb, rotation_ref, columns):
    """xb [R, D] bfloat16 · R_K's bfloat16 parts [3, D, D] restricted to `columns` → float32: one
    tensor-core product a part (each exact per term), summed smallest part first."""
    acc = None
    for part in reversed(range(BF16_SPLIT_PARTS)):
        term = jnp.dot(xb, rotation_ref[part, :, columns], preferred_element_type=jnp.float32)
        acc = term if acc is None else acc + term
    return acc


def _rotate(x, rotation_ref):
    """x [R, D] float32 · R_K → [R, D] float32. Parts [3, D, D] bfloat16 (x holds bfloat16
    values): three tensor-core products, each exact per term, summed smallest part first. Else
    R_K [D, D] float32: IEEE float32, no TF32."""
    if rotation_ref.dtype == jnp.bfloat16:
        return _split_product(x.astype(jnp.bfloat16), rotation_ref, slice(None))  # exact cast
    return jnp.dot(
        x,
        rotation_ref[...].astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _token_mask(block_tokens: int, num_tokens: int, grid_axis: int):
    """[R, 1] bool: which tokens of this program's block exist (None when blocks tile T)."""
    if num_tokens % block_tokens == 0:
        return None
    token = pl.program_id(grid_axis) * block_tokens + lax.broadcasted_iota(
        jnp.int32, (block_tokens, 1), 0
    )
    return token < num_tokens


def _full_spec(shape):
    """The whole array as one block (page pools: indexed inside the kernel)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _page_pool(pool, layer: int | None):
    """A pool as the scatter kernels take it (`kernels.layered`): the stacked pools as one pool of
    Y·P pages, a layer's pages found through `layer_page_base`; its BlockSpec, the whole pool."""
    pool = flat_pool(pool, layer)
    return pool, _full_spec(pool.shape)


def _token_block_rows(num_tokens: int, block_tokens: int | None, rotate: bool, x_dtype=None,
                      planes: bool = False) -> int:
    """Tokens per program. By default DEFAULT_BLOCK_ROWS, SPLIT_ROTATION_BLOCK_TOKENS for the
    split rotation of bfloat16 rows (its parts are read once per program), or
    ENCODE_PLANES_BLOCK_ROWS for rows encoded by planes."""
    if block_tokens is None:
        split = rotate and x_dtype == jnp.bfloat16
        block_tokens = (SPLIT_ROTATION_BLOCK_TOKENS if split else ENCODE_PLANES_BLOCK_ROWS if planes
                        else DEFAULT_BLOCK_ROWS)
    rows = block_rows_for(num_tokens, block_tokens)
    return max(rows, MIN_DOT_ROWS) if rotate else planes_block_rows(rows, planes)


# ------------------------------------------------------------------- fused write to dense rows


def _rotate_planes(x, rotation_ref):
    """x [R, D] (bfloat16 values) · R_K's parts [3, D, D] bfloat16, plane by plane: the rotated rows'
    four quarter planes float32 [R, Q] (plane p: columns p·Q … p·Q + Q − 1 of _rotate's product:
    _split_product of that column block)."""
    quarter = x.shape[1] // CODES_PER_BYTE
    xb = x.astype(jnp.bfloat16)  # exact
    return [_split_product(xb, rotation_ref, pl.ds(p * quarter, quarter)) for p in range(CODES_PER_BYTE)]


def _encode_token_rows(x_ref, rotation_ref, mask, planes: bool, encode_args: dict):
    """Encode a block of token rows x_ref [R, D], rotated by rotation_ref unless None, through
    codec.encode_planes_or_block: with `planes`, rotated rows come as their planes' products
    (_rotate_planes) and unrotated rows as four plane loads; the whole rows only where it falls back."""
    if rotation_ref is None:
        return encode_planes_or_block(lambda: load_planes(x_ref, mask), lambda: load_block(x_ref, mask), mask,
                                      planes=planes, rows_bf16=x_ref.dtype == jnp.bfloat16, **encode_args)
    return encode_planes_or_block(
        lambda: _rotate_planes(load_block(x_ref, mask), rotation_ref),
        lambda: _rotate(load_block(x_ref, mask).astype(jnp.float32), rotation_ref), mask,
        planes=planes, rows_bf16=False, **encode_args)  # rotated rows: float32 products


def _write_int2_kernel(
    x_ref,  # [R, D] float (tokens of one kv head)
    *refs,  # [rotation_ref (_rotation_operand)], packed_ref [R, D/4], scale_ref [R, D/G], minimum_ref [R, D/G]
    num_tokens: int,
    rotate: bool,
    encode_args: dict,
    planes: bool = False,
):
    if rotate:
        rotation_ref, packed_ref, scale_ref, minimum_ref = refs
    else:
        rotation_ref, (packed_ref, scale_ref, minimum_ref) = None, refs
    mask = _token_mask(x_ref.shape[0], num_tokens, grid_axis=1)
    packed, scale, minimum = _encode_token_rows(x_ref, rotation_ref, mask, planes, encode_args)
    store_block(packed_ref, packed, mask)
    store_block(scale_ref, scale, mask)
    store_block(minimum_ref, minimum, mask)

@functools.partial(
    jax.jit,
    static_argnames=(
        "group_size", "clip_index", "levels", "order_statistic", "block_tokens", "num_warps", "interpret", "planes",
    ),
)
def write_int2_rows(
    x,
    rotation,
    *,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str | None = None,
    block_tokens: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool | None = None,
    planes: bool | None = None,
):
    """x [T, K, D], rotation [K, D, D] f32 or None → packed [T, K, D/4], scale, minimum [T, K, D/G].
    planes: by codec.encode_planes (tiling.resolve_encode_planes: None for unrotated rows where it
    applies; True also for rotated bf16 rows, benchmarks/DECISIONS.md W5)."""
    num_tokens, num_heads, d = x.shape
    quarter, num_groups = d // CODES_PER_BYTE, d // group_size
    rotate = rotation is not None
    planes = resolve_encode_planes(planes, d, group_size, levels, rotated=rotate, rows_bf16=x.dtype == jnp.bfloat16)
    order_statistic = resolve_order_statistic(order_statistic, d, clip_index, x.dtype, rotated=rotate)
    rows = _token_block_rows(num_tokens, block_tokens, rotate, x.dtype, planes)
    encode_args = dict(
        group_size=group_size, clip_index=clip_index, levels=levels, order_statistic=order_statistic
    )
    in_specs = [pl.BlockSpec((rows, None, d), lambda h, i: (i, h, 0))]  # x: R tokens of head h
    operands = [x]
    if rotate:
        rotation, rotation_spec = _rotation_operand(rotation, x.dtype)  # R_K of head h
        in_specs.append(rotation_spec)
        operands.append(rotation)
    return pl.pallas_call(
        functools.partial(
            _write_int2_kernel, num_tokens=num_tokens, rotate=rotate, encode_args=encode_args, planes=planes
        ),
        grid=(num_heads, pl.cdiv(num_tokens, rows)),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((rows, None, quarter), lambda h, i: (i, h, 0)),  # packed
            pl.BlockSpec((rows, None, num_groups), lambda h, i: (i, h, 0)),  # scale
            pl.BlockSpec((rows, None, num_groups), lambda h, i: (i, h, 0)),  # minimum
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_tokens, num_heads, quarter), jnp.uint8),
            jax.ShapeDtypeStruct((num_tokens, num_heads, num_groups), jnp.float16),
            jax.ShapeDtypeStruct((num_tokens, num_heads, num_groups), jnp.float16),
        ],
        interpret=resolve_interpret(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"oscar_write_int2_d{d}_g{group_size}_k{clip_index}_{levels}_rot{int(rotate)}_r{rows}"
             + ("_planes" if planes else ""),
    )(*operands)


# ---------------------------------------------------------------- scatter into the page pools


def _destinations(page_ref, slot_ref, page_base_ref, mask, *, num_pages: int, pool_pages: int, page_size: int):
    """Pages of the pool and slots [R, 1] of this block's tokens, and which of them to write. A
    token's page id lies in its layer's [0, num_pages), at page_base_ref[0] of the pool's
    `pool_pages` (`kernels.layered`). Skipped tokens point at page `pool_pages` (one past the
    pool): masked on the GPU, dropped by the interpreter's scatter (a negative id would wrap
    around there)."""
    flat_mask = None if mask is None else mask.reshape(mask.shape[0])
    page = load_block(page_ref, flat_mask)[:, None]
    slot = load_block(slot_ref, flat_mask)[:, None]
    valid = (page >= 0) & (page < num_pages) & (slot >= 0) & (slot < page_size)
    if mask is not None:
        valid = valid & mask
    return jnp.where(valid, page + page_base_ref[0], pool_pages), jnp.where(valid, slot, 0), valid

def _scatter_rows(pool_ref, head, page, slot, valid, value):
    """pool_ref [P, K, L, W] ← value [R, W] at (page[r], head, slot[r], :) where valid[r]."""
    rows, width = value.shape
    column = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    shape = (rows, width)
    plgpu.store(
        pool_ref.at[
            jnp.broadcast_to(page, shape), head, jnp.broadcast_to(slot, shape), jnp.broadcast_to(column, shape)
        ],
        value,
        mask=jnp.broadcast_to(valid, shape),
    )

def _write_pages_kernel(
    x_ref,  # [R, D] float (tokens of one kv head)
    *refs,  # [rotation_ref (_rotation_operand)], page_ref [R], slot_ref [R], page_base_ref [1],
    #         3 aliased pool inputs (unused), codes_ref [Y·P, K, L, D/4], scale_ref [Y·P, K, L, D/G],
    #         minimum_ref [Y·P, K, L, D/G]
    num_tokens: int,
    num_pages: int,
    rotate: bool,
    encode_args: dict,
    planes: bool = False,
):
    rotation_ref = refs[0] if rotate else None
    page_ref, slot_ref, page_base_ref, _, _, _, codes_ref, scale_ref, minimum_ref = refs[int(rotate) :]
    pool_pages, _, page_size, _ = codes_ref.shape
    head = pl.program_id(0)
    mask = _token_mask(x_ref.shape[0], num_tokens, grid_axis=1)
    page, slot, valid = _destinations(
        page_ref, slot_ref, page_base_ref, mask, num_pages=num_pages, pool_pages=pool_pages, page_size=page_size
    )
    packed, scale, minimum = _encode_token_rows(x_ref, rotation_ref, mask, planes, encode_args)
    _scatter_rows(codes_ref, head, page, slot, valid, packed)
    _scatter_rows(scale_ref, head, page, slot, valid, scale)
    _scatter_rows(minimum_ref, head, page, slot, valid, minimum)

@functools.partial(
    jax.jit,
    static_argnames=(
        "group_size", "clip_index", "levels", "order_statistic", "block_tokens", "num_warps", "interpret", "layer",
        "planes",
    ),
)
def write_pages_rows(
    codes,
    scale,
    minimum,
    x,
    page_ids,
    slots,
    rotation,
    *,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str | None = None,
    block_tokens: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool | None = None,
    layer: int | None = None,
    planes: bool | None = None,
):
    """Encode x [T, K, D] (rotated by rotation [K, D, D] unless None) into the INT2 pools at
    (page_ids[t], slots[t]); returns the updated (codes, scale, minimum). With `layer`, the
    pools are stacked [Y, P, K, L, ·] and only layer `layer` is written (in place). planes:
    by codec.encode_planes (tiling.resolve_encode_planes: None for unrotated rows where it applies;
    True also for rotated bf16 rows, benchmarks/DECISIONS.md W5)."""
    num_tokens, num_heads, d = x.shape
    rotate = rotation is not None
    planes = resolve_encode_planes(planes, d, group_size, levels, rotated=rotate, rows_bf16=x.dtype == jnp.bfloat16)
    order_statistic = resolve_order_statistic(order_statistic, d, clip_index, x.dtype, rotated=rotate)
    rows = _token_block_rows(num_tokens, block_tokens, rotate, x.dtype, planes)
    encode_args = dict(
        group_size=group_size, clip_index=clip_index, levels=levels, order_statistic=order_statistic
    )
    in_specs = [pl.BlockSpec((rows, None, d), lambda h, i: (i, h, 0))]  # x: R tokens of head h
    operands = [x]
    if rotate:
        rotation, rotation_spec = _rotation_operand(rotation, x.dtype)  # R_K of head h
        in_specs.append(rotation_spec)
        operands.append(rotation)
    stacked_shapes = [pool.shape for pool in (codes, scale, minimum)]
    (codes, codes_spec), (scale, scale_spec), (minimum, minimum_spec) = (
        _page_pool(pool, layer) for pool in (codes, scale, minimum))
    in_specs += [
        pl.BlockSpec((rows,), lambda h, i: (i,)),  # page ids of the R tokens
        pl.BlockSpec((rows,), lambda h, i: (i,)),  # slots of the R tokens
        layer_page_base_spec(),
        codes_spec,  # codes pool (aliased to output 0)
        scale_spec,  # scale pool (aliased to output 1)
        minimum_spec,  # minimum pool (aliased to output 2)
    ]
    operands += [page_ids, slots, layer_page_base(stacked_shapes[0], layer), codes, scale, minimum]
    outputs = pl.pallas_call(
        functools.partial(
            _write_pages_kernel, num_tokens=num_tokens, num_pages=per_layer_shape(stacked_shapes[0], layer)[0],
            rotate=rotate, encode_args=encode_args, planes=planes,
        ),
        grid=(num_heads, pl.cdiv(num_tokens, rows)),
        in_specs=in_specs,
        out_specs=[codes_spec, scale_spec, minimum_spec],
        out_shape=[
            jax.ShapeDtypeStruct(codes.shape, codes.dtype),
            jax.ShapeDtypeStruct(scale.shape, scale.dtype),
            jax.ShapeDtypeStruct(minimum.shape, minimum.dtype),
        ],
        input_output_aliases=_alias_int2_pools(len(operands)),
        interpret=resolve_interpret(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"oscar_write_pages_d{d}_g{group_size}_k{clip_index}_{levels}_rot{int(rotate)}_r{rows}"
             + ("_planes" if planes else ""),
    )(*operands)
    return [out.reshape(shape) for out, shape in zip(outputs, stacked_shapes)]

def _write_bf16_pages_kernel(
    x_ref,  # [R, D] float (tokens of one kv head)
    page_ref,  # [R] int32
    slot_ref,  # [R] int32
    page_base_ref,  # [1] int32
    _pool_in_ref,  # aliased to pool_ref
    pool_ref,  # [Y·P, K, L, D] bfloat16
    *,
    num_tokens: int,
    num_pages: int,
):
    pool_pages, _, page_size, _ = pool_ref.shape
    mask = _token_mask(x_ref.shape[0], num_tokens, grid_axis=1)
    page, slot, valid = _destinations(
        page_ref, slot_ref, page_base_ref, mask, num_pages=num_pages, pool_pages=pool_pages, page_size=page_size
    )
    x = load_block(x_ref, mask).astype(pool_ref.dtype)  # round-to-nearest-even
    _scatter_rows(pool_ref, pl.program_id(0), page, slot, valid, x)

@functools.partial(jax.jit, static_argnames=("block_tokens", "num_warps", "interpret", "layer"))
def write_bf16_pages_rows(
    pool,
    x,
    page_ids,
    slots,
    *,
    block_tokens: int = DEFAULT_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool | None = None,
    layer: int | None = None,
):
    """pool [P, K, L, D] ← x [T, K, D] at (page_ids[t], slots[t]); returns the updated pool.
    With `layer`, pool is stacked [Y, P, K, L, D] and only layer `layer` is written (in place)."""
    num_tokens, num_heads, d = x.shape
    rows = _token_block_rows(num_tokens, block_tokens, rotate=False)
    stacked_shape = pool.shape
    pool, pool_spec = _page_pool(pool, layer)
    in_specs = [
        pl.BlockSpec((rows, None, d), lambda h, i: (i, h, 0)),  # x: R tokens of head h
        pl.BlockSpec((rows,), lambda h, i: (i,)),  # page ids
        pl.BlockSpec((rows,), lambda h, i: (i,)),  # slots
        layer_page_base_spec(),
        pool_spec,  # pool (aliased to the output)
    ]
    out = pl.pallas_call(
        functools.partial(_write_bf16_pages_kernel, num_tokens=num_tokens,
                          num_pages=per_layer_shape(stacked_shape, layer)[0]),
        grid=(num_heads, pl.cdiv(num_tokens, rows)),
        in_specs=in_specs,
        out_specs=pool_spec,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={len(in_specs) - 1: 0},  # the pool, the last operand
        interpret=resolve_interpret(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"oscar_write_bf16_pages_d{d}_r{rows}",
    )(x, page_ids, slots, layer_page_base(stacked_shape, layer), pool)
    return out.reshape(stacked_shape)


# ------------------------------------------------------------------------------- demotion


def _demote_pages_kernel(
    src_ref,  # [1] int32: the BF16 page to read
    dst_ref,  # [1] int32: the INT2 page to write
    bf16_ref,  # [Y, P, K, L, D] bfloat16 (whole pool)
    _codes_in, _scale_in, _minimum_in,  # aliased to the outputs
    codes_ref,  # [Y, P', K, L, D/4] uint8
    scale_ref,  # [Y, P', K, L, D/G] float16
    minimum_ref,  # [Y, P', K, L, D/G] float16
    *,
    encode_args: dict,
    planes: bool = False,
):
    layer, head = pl.program_id(0), pl.program_id(2)
    src, dst = src_ref[0], dst_ref[0]
    _, src_pages, _, page_size, d = bf16_ref.shape
    dst_pages = codes_ref.shape[1]
    valid = (src >= 0) & (src < src_pages) & (dst >= 0) & (dst < dst_pages)
    slot = lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)

    def load_columns(first: int, width: int):  # the page's rows, columns first … first + width − 1
        column = first + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        shape = (page_size, width)
        return plgpu.load(
            bf16_ref.at[
                layer, jnp.where(valid, src, 0), head, jnp.broadcast_to(slot, shape), jnp.broadcast_to(column, shape)
            ],
            mask=jnp.broadcast_to(valid, shape),
            other=0,
        ).astype(jnp.float32)  # exact widening

    quarter = d // CODES_PER_BYTE
    packed, scale, minimum = encode_planes_or_block(
        lambda: [load_columns(p * quarter, quarter) for p in range(CODES_PER_BYTE)], lambda: load_columns(0, d),
        None, planes=planes, rows_bf16=True, **encode_args)
    page = jnp.where(valid, dst, dst_pages)  # one past the pool when skipped (see _destinations)
    for pool_ref, value in ((codes_ref, packed), (scale_ref, scale), (minimum_ref, minimum)):
        width = value.shape[1]
        vshape = (page_size, width)
        column = lax.broadcasted_iota(jnp.int32, (1, width), 1)
        plgpu.store(
            pool_ref.at[
                layer, page, head, jnp.broadcast_to(slot, vshape), jnp.broadcast_to(column, vshape)
            ],
            value,
            mask=jnp.broadcast_to(valid, vshape),
        )

@functools.partial(
    jax.jit,
    static_argnames=("group_size", "clip_index", "levels", "order_statistic", "num_warps", "interpret", "planes"),
)
def demote_pages_rows(
    bf16_pool,
    codes,
    scale,
    minimum,
    src_pages,
    dst_pages,
    *,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool | None = None,
    planes: bool | None = None,
):
    """Quantize BF16 pages bf16_pool[y, src_pages[n]] into INT2 pages [y, dst_pages[n]] for every
    layer y and kv head: pools carry a leading layer axis Y (pass Y = 1 for one layer). Grid
    (Y, N, K): one program encodes the L rows of one (layer, page, head) block. planes: by
    codec.encode_planes (tiling.resolve_encode_planes: None where it applies)."""
    num_layers, _, num_heads, page_size, d = bf16_pool.shape
    planes = resolve_encode_planes(planes, d, group_size, levels)
    (num_demoted,) = src_pages.shape
    order_statistic = resolve_order_statistic(order_statistic, d, clip_index, bf16_pool.dtype)
    encode_args = dict(
        group_size=group_size, clip_index=clip_index, levels=levels, order_statistic=order_statistic
    )
    operands = (src_pages, dst_pages, bf16_pool, codes, scale, minimum)
    return pl.pallas_call(
        functools.partial(_demote_pages_kernel, encode_args=encode_args, planes=planes),
        grid=(num_layers, num_demoted, num_heads),
        in_specs=[
            pl.BlockSpec((1,), lambda y, n, h: (n,)),  # source page id of demotion n
            pl.BlockSpec((1,), lambda y, n, h: (n,)),  # destination page id of demotion n
            _full_spec(bf16_pool.shape),  # BF16 pool, read by page id
            _full_spec(codes.shape),  # codes pool (aliased to output 0)
            _full_spec(scale.shape),  # scale pool (aliased to output 1)
            _full_spec(minimum.shape),  # minimum pool (aliased to output 2)
        ],
        out_specs=[_full_spec(codes.shape), _full_spec(scale.shape), _full_spec(minimum.shape)],
        out_shape=[
            jax.ShapeDtypeStruct(codes.shape, codes.dtype),
            jax.ShapeDtypeStruct(scale.shape, scale.dtype),
            jax.ShapeDtypeStruct(minimum.shape, minimum.dtype),
        ],
        input_output_aliases=_alias_int2_pools(len(operands)),
        interpret=resolve_interpret(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"oscar_demote_pages_d{d}_g{group_size}_k{clip_index}_{levels}_l{page_size}"
             + ("_planes" if planes else ""),
    )(*operands)
