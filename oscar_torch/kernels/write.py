"""Write-path kernels: fused rotate + encode, page scatters, and page demotion (DESIGN.md §2–3).

Page pools (per layer, head-major so one (page, head) block is contiguous):
  INT2 tier  codes u8[P, K, L, D/4], scale f16[P, K, L, D/G], minimum f16[P, K, L, D/G]
  BF16 tier  bf16[P, K, L, D]
(P pages, K kv heads, L page size, D head dim, G group size, T tokens, N pages to demote,
Y layers.) A destination is a (page, slot) pair per token. The pools are updated in place (the
kernels store into them); the public ops in oscar_torch.ops reach these launchers through torch
custom ops (oscar_torch.library) that declare the mutation.
Destinations outside the pool (a page id outside [0, P) or a slot outside [0, L)) are never
written: the public ops reject them on the host in eager mode, and the kernels mask them (never an
out-of-bounds store) when the ids are not checked (torch.compile, CUDA graphs).

Encoding is `encode_block` from codec.py, so every written row has exactly the bytes of
shared_math.encode of the same float32 row. Keys are rotated in the kernel, k' = k·R_K with
R_K [K, D, D] per kv head: float32 rows as a float32 `tl.dot` with input_precision="ieee"
(never TF32); bfloat16 rows as three bfloat16 tensor-core products with R_K split into bfloat16
parts (shared_math.rotation.split_bf16; the interpreter, whose bf16 dots are wrong, multiplies
the same bfloat16 values as float32). Values arrive already rotated and take no rotation. BF16
rows are rounded to bfloat16 with integer round-to-nearest-even (`bf16_bits_rne`), never a cast
(the interpreter truncates).
Same kernels, same names and same order as oscar_jax/kernels/write.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_torch.kernels.codec import (
    CODES_PER_BYTE_C,
    DEFAULT_BLOCK_ROWS,
    DEFAULT_NUM_WARPS,
    bf16_bits_rne,
    block_rows_for,
    default_block_rows,
    encode_block,
    encode_loaded_rows,
    encode_planes,
    interpreting,
    kernel_view,
    load_rows_f32,
    resolve_order_statistic,
    widen_bf16_bits,
)
from oscar_torch.kernels.decode_attention import dot_f32, dot_operand
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


BF16_SPLIT_PARTS_C = tl.constexpr(BF16_SPLIT_PARTS)


def _token_block_rows(num_tokens: int, block_tokens: int | None, rotate: bool, x_dtype=None,
                      planes: bool = False) -> int:
    """Tokens per program. By default DEFAULT_BLOCK_ROWS, SPLIT_ROTATION_BLOCK_TOKENS for the
    split rotation of bfloat16 rows (its parts are read once per program), or
    ENCODE_PLANES_BLOCK_ROWS for rows encoded by planes; interpreted, INTERPRET_BLOCK_ROWS (float32
    rows rotated in slices: _rotation_rows), but the split rotation keeps its block."""
    if block_tokens is None:
        split = rotate and x_dtype == torch.bfloat16
        block_tokens = (SPLIT_ROTATION_BLOCK_TOKENS if split else ENCODE_PLANES_BLOCK_ROWS if planes
                        else DEFAULT_BLOCK_ROWS)
        block_tokens = block_tokens if split else default_block_rows(block_tokens)
    rows = block_rows_for(num_tokens, block_tokens)
    return max(rows, MIN_DOT_ROWS) if rotate else planes_block_rows(rows, planes)


def _rotation_rows(block_rows: int) -> int:
    """Rows per product of the fused float32 rotation. Compiled: the whole block (one dot).
    Interpreted: DEFAULT_BLOCK_ROWS-row slices of the block, one batched product — the interpreter's
    float32 product (numpy's sgemm) rounds with the operand's rows, so a 512-row product moves an fp16
    scale or minimum by an ulp against 16-row blocks (which the tiny-model HF test's 1e-3 logit bound against its
    float64 emulation does not absorb), while slices of 16 give the 16-row blocks' bytes and leave
    the encode its big block (benchmarks/DECISIONS.md C2)."""
    return min(block_rows, DEFAULT_BLOCK_ROWS) if interpreting() else block_rows


def _rotation_operand(rotation: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The rotation as the kernel reads it: bfloat16 rows take R_K split into bfloat16 parts
    [K, 3, D, D] (as int16 bits); other rows take R_K [K, D, D] float32. Without a rotation,
    any pointer (never read)."""
    if rotation is None:
        return x
    if x.dtype == torch.bfloat16:
        parts = split_bf16(
            rotation.float(), to_bits=lambda a: a.view(torch.int32), from_bits=lambda b: b.view(torch.float32)
        )
        return torch.stack(parts, dim=-3).to(torch.bfloat16).view(torch.int16)  # exact: bf16 values
    return rotation


@triton.jit
def _bf16_part(ptrs, TENSOR_CORES: tl.constexpr):
    """A [D, D] part of the split rotation (int16 bits) as a dot operand."""
    if TENSOR_CORES:
        return tl.load(ptrs).to(tl.bfloat16, bitcast=True)
    else:  # the interpreter: the same values, float32 dots (a constexpr branch: both return)
        return widen_bf16_bits(tl.load(ptrs))


@triton.jit
def split_product(xb, part, D: tl.constexpr, TENSOR_CORES: tl.constexpr):
    """xb [R, D] bfloat16 · R_K's bf16 parts at `part` (pointers [D, C] into the first part's columns,
    the parts D·D elements apart; int16 bits) → float32 [R, C]: one exact-product dot a part, summed
    smallest part first."""
    acc = dot_f32(xb, _bf16_part(part + (BF16_SPLIT_PARTS_C - 1) * D * D, TENSOR_CORES), True, TENSOR_CORES)
    for i in tl.static_range(2, BF16_SPLIT_PARTS_C + 1):
        acc = acc + dot_f32(xb, _bf16_part(part + (BF16_SPLIT_PARTS_C - i) * D * D, TENSOR_CORES), True,
                            TENSOR_CORES)
    return acc


@triton.jit
def _load_token_rows(
    x_ptr,  # [T, K, D] float32 / float16, or bfloat16 as int16
    rotation_ptr,  # _rotation_operand: [K, 3, D, D] bf16 parts as int16 for bf16 rows, else [K, D, D] f32
    head,
    num_tokens,
    NUM_HEADS: tl.constexpr,
    D: tl.constexpr,
    ROTATE: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    ROTATION_ROWS: tl.constexpr,
):
    """This program's tokens of kv head `head` as float32 [R, D] (rotated when ROTATE, float32 rows
    in products of ROTATION_ROWS rows: _rotation_rows), their indices [R, 1] and which of them
    exist [R, 1]."""
    token = (tl.program_id(1) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS))[:, None]  # [R, 1]
    token_ok = token < num_tokens
    column = tl.arange(0, D)[None, :]
    x = load_rows_f32(x_ptr + (token * NUM_HEADS + head) * D + column, token_ok, INPUT_BF16)
    if ROTATE:
        row = tl.arange(0, D)[:, None]
        if INPUT_BF16:  # hi, mid, lo of R_K: exact-product dots
            part = rotation_ptr + head * BF16_SPLIT_PARTS_C * D * D + row * D + column
            x = split_product(dot_operand(x, True, TENSOR_CORES), part, D, TENSOR_CORES)  # exact cast
        else:
            rotation = tl.load(rotation_ptr + head * D * D + row * D + column)  # [D, D] R_K of head
            if ROTATION_ROWS == BLOCK_TOKENS:
                x = tl.dot(x, rotation, input_precision="ieee")  # IEEE float32, no TF32
            else:  # interpreted: one product per slice of ROTATION_ROWS rows
                SLICES: tl.constexpr = BLOCK_TOKENS // ROTATION_ROWS
                slices = tl.reshape(x, (SLICES, ROTATION_ROWS, D))
                x = tl.reshape(tl.dot(slices, tl.broadcast_to(rotation[None, :, :], (SLICES, D, D)),
                                      input_precision="ieee"), (BLOCK_TOKENS, D))
    return x, token, token_ok


@triton.jit
def _rotated_plane_bits(xb, part, D: tl.constexpr, TENSOR_CORES: tl.constexpr):
    """One quarter plane of the split rotation's product, as float32 bits (int32 [R, Q]): split_product
    of the column block `part` [D, Q] (_load_token_rows' product, column block by column block)."""
    return split_product(xb, part, D, TENSOR_CORES).to(tl.int32, bitcast=True)


@triton.jit
def _encode_token_rows(
    x_ptr, rotation_ptr, head, num_tokens,
    NUM_HEADS: tl.constexpr,
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
    ROTATE: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    ROTATION_ROWS: tl.constexpr,
    PLANES: tl.constexpr,
):
    """Encode this program's tokens of kv head `head`: rotated (_load_token_rows) and encode_block,
    or by planes with PLANES — rotated bf16 rows as their planes' products (_rotated_plane_bits;
    the launchers refuse PLANES for rotated float32 rows), unrotated rows through
    codec.encode_loaded_rows. Returns packed, scale, minimum, the tokens [R, 1] and which exist."""
    if PLANES and ROTATE:
        QUARTER: tl.constexpr = D // CODES_PER_BYTE_C
        token = (tl.program_id(1) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS))[:, None]  # [R, 1]
        token_ok = token < num_tokens
        x = load_rows_f32(x_ptr + (token * NUM_HEADS + head) * D + tl.arange(0, D)[None, :], token_ok, INPUT_BF16)
        xb = dot_operand(x, True, TENSOR_CORES)  # exact: x holds bfloat16 values
        part = rotation_ptr + head * BF16_SPLIT_PARTS_C * D * D + tl.arange(0, D)[:, None] * D \
            + tl.arange(0, QUARTER)[None, :]  # columns 0 … Q − 1 of the parts
        packed, scale, minimum, exact = encode_planes(
            _rotated_plane_bits(xb, part, D, TENSOR_CORES), _rotated_plane_bits(xb, part + QUARTER, D, TENSOR_CORES),
            _rotated_plane_bits(xb, part + 2 * QUARTER, D, TENSOR_CORES),
            _rotated_plane_bits(xb, part + 3 * QUARTER, D, TENSOR_CORES), CLIP_INDEX, False)
        if tl.min((exact | ~token_ok).to(tl.int32)) == 0:  # a row needs encode_block: the whole product
            x, token, token_ok = _load_token_rows(x_ptr, rotation_ptr, head, num_tokens, NUM_HEADS, D, ROTATE,
                                                  INPUT_BF16, BLOCK_TOKENS, TENSOR_CORES, ROTATION_ROWS)
            packed, scale, minimum = encode_block(x, GROUP_SIZE, CLIP_INDEX, LEVELS, ORDER_STATISTIC)
    elif PLANES:
        token = (tl.program_id(1) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS))[:, None]  # [R, 1]
        token_ok = token < num_tokens
        packed, scale, minimum = encode_loaded_rows(x_ptr + (token * NUM_HEADS + head) * D, token_ok, D, GROUP_SIZE,
                                                    CLIP_INDEX, LEVELS, ORDER_STATISTIC, INPUT_BF16, True)
    else:
        x, token, token_ok = _load_token_rows(x_ptr, rotation_ptr, head, num_tokens, NUM_HEADS, D, ROTATE, INPUT_BF16,
                                              BLOCK_TOKENS, TENSOR_CORES, ROTATION_ROWS)
        packed, scale, minimum = encode_block(x, GROUP_SIZE, CLIP_INDEX, LEVELS, ORDER_STATISTIC)
    return packed, scale, minimum, token, token_ok


@triton.jit
def _store_rows(ptr, page, head, slot, valid, value, NUM_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """pool [P, K, L, W] ← value [R, W] at (page[r], head, slot[r], :) where valid[r]."""
    WIDTH: tl.constexpr = value.shape[1]
    row_start = ((page.to(tl.int64) * NUM_HEADS + head) * PAGE_SIZE + slot) * WIDTH  # [R, 1]
    tl.store(ptr + row_start + tl.arange(0, WIDTH)[None, :], value, mask=valid)


# ------------------------------------------------------------------- fused write to dense rows


@triton.jit
def _write_int2_kernel(
    x_ptr,  # [T, K, D] float
    rotation_ptr,  # _rotation_operand (unused unless ROTATE)
    packed_ptr,  # [T, K, D/4] uint8
    scale_ptr,  # [T, K, D/G] float16
    minimum_ptr,  # [T, K, D/G] float16
    num_tokens,
    NUM_HEADS: tl.constexpr,
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
    ROTATE: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    ROTATION_ROWS: tl.constexpr,
    PLANES: tl.constexpr = False,
):
    head = tl.program_id(0)
    packed, scale, minimum, token, token_ok = _encode_token_rows(
        x_ptr, rotation_ptr, head, num_tokens, NUM_HEADS, D, GROUP_SIZE, CLIP_INDEX, LEVELS, ORDER_STATISTIC, ROTATE,
        INPUT_BF16, BLOCK_TOKENS, TENSOR_CORES, ROTATION_ROWS, PLANES,
    )
    # Dense outputs [T, K, W] are pools with T pages of one slot.
    _store_rows(packed_ptr, token, head, 0, token_ok, packed.to(tl.uint8), NUM_HEADS, 1)
    _store_rows(scale_ptr, token, head, 0, token_ok, scale, NUM_HEADS, 1)
    _store_rows(minimum_ptr, token, head, 0, token_ok, minimum, NUM_HEADS, 1)


def _encode_constants(d: int, group_size: int, clip_index: int, levels: str, order_statistic: str | None,
                      rows_dtype: torch.dtype, rotated: bool, planes: bool):
    """The launch's encode constexprs; `planes` as resolved by tiling.resolve_encode_planes."""
    order_statistic = resolve_order_statistic(order_statistic, d, clip_index, rows_dtype, rotated)
    return dict(
        D=d, GROUP_SIZE=group_size, CLIP_INDEX=clip_index, LEVELS=levels, ORDER_STATISTIC=order_statistic,
        PLANES=planes,
    )


def write_int2_rows(
    x: torch.Tensor,
    rotation: torch.Tensor | None,
    *,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str | None = None,
    block_tokens: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    planes: bool | None = None,
):
    """x [T, K, D], rotation [K, D, D] f32 or None → packed [T, K, D/4], scale, minimum [T, K, D/G].
    planes: by codec.encode_planes (tiling.resolve_encode_planes: None for unrotated rows where it
    applies; True also for rotated bf16 rows, benchmarks/DECISIONS.md W5)."""
    num_tokens, num_heads, d = x.shape
    rotate = rotation is not None
    planes = resolve_encode_planes(planes, d, group_size, levels, rotated=rotate,
                                   rows_bf16=x.dtype == torch.bfloat16)
    rows = _token_block_rows(num_tokens, block_tokens, rotate, x.dtype, planes)
    packed = torch.empty((num_tokens, num_heads, d // CODES_PER_BYTE), dtype=torch.uint8, device=x.device)
    scale = torch.empty((num_tokens, num_heads, d // group_size), dtype=torch.float16, device=x.device)
    minimum = torch.empty_like(scale)
    _write_int2_kernel[(num_heads, triton.cdiv(num_tokens, rows))](
        kernel_view(x), _rotation_operand(rotation, x), packed, scale, minimum, num_tokens,
        NUM_HEADS=num_heads, ROTATE=rotate, INPUT_BF16=x.dtype == torch.bfloat16, BLOCK_TOKENS=rows,
        TENSOR_CORES=not interpreting(), ROTATION_ROWS=_rotation_rows(rows),
        **_encode_constants(d, group_size, clip_index, levels, order_statistic, x.dtype, rotate, planes),
        num_warps=num_warps,
    )
    return packed, scale, minimum


# ---------------------------------------------------------------- scatter into the page pools


@triton.jit
def _destinations(page_ids_ptr, slots_ptr, token, token_ok, NUM_PAGES, PAGE_SIZE: tl.constexpr):
    """Page ids and slots [R, 1] of this block's tokens, and which of them to write. Skipped
    tokens point at page 0 / slot 0 and are masked (never an out-of-bounds address)."""
    page = tl.load(page_ids_ptr + token, mask=token_ok, other=0)
    slot = tl.load(slots_ptr + token, mask=token_ok, other=0)
    valid = token_ok & (page >= 0) & (page < NUM_PAGES) & (slot >= 0) & (slot < PAGE_SIZE)
    return tl.where(valid, page, 0), tl.where(valid, slot, 0), valid


@triton.jit
def _write_pages_kernel(
    x_ptr,  # [T, K, D] float
    rotation_ptr,  # _rotation_operand (unused unless ROTATE)
    page_ids_ptr,  # [T] int32
    slots_ptr,  # [T] int32
    codes_ptr,  # [P, K, L, D/4] uint8 (updated in place)
    scale_ptr,  # [P, K, L, D/G] float16
    minimum_ptr,  # [P, K, L, D/G] float16
    num_tokens,
    num_pages,
    NUM_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
    ROTATE: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    ROTATION_ROWS: tl.constexpr,
    PLANES: tl.constexpr = False,
):
    head = tl.program_id(0)
    packed, scale, minimum, token, token_ok = _encode_token_rows(
        x_ptr, rotation_ptr, head, num_tokens, NUM_HEADS, D, GROUP_SIZE, CLIP_INDEX, LEVELS, ORDER_STATISTIC, ROTATE,
        INPUT_BF16, BLOCK_TOKENS, TENSOR_CORES, ROTATION_ROWS, PLANES,
    )
    page, slot, valid = _destinations(page_ids_ptr, slots_ptr, token, token_ok, num_pages, PAGE_SIZE)
    _store_rows(codes_ptr, page, head, slot, valid, packed.to(tl.uint8), NUM_HEADS, PAGE_SIZE)
    _store_rows(scale_ptr, page, head, slot, valid, scale, NUM_HEADS, PAGE_SIZE)
    _store_rows(minimum_ptr, page, head, slot, valid, minimum, NUM_HEADS, PAGE_SIZE)


def write_pages_rows(
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    x: torch.Tensor,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    rotation: torch.Tensor | None,
    *,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str | None = None,
    block_tokens: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    planes: bool | None = None,
) -> None:
    """Encode x [T, K, D] (rotated by rotation [K, D, D] unless None) into the INT2 pools at
    (page_ids[t], slots[t]) (int32 [T]), in place. planes: by codec.encode_planes
    (tiling.resolve_encode_planes: None for unrotated rows where it applies; True also for rotated
    bf16 rows, benchmarks/DECISIONS.md W5)."""
    num_tokens, num_heads, d = x.shape
    num_pages, _, page_size, _ = codes.shape
    rotate = rotation is not None
    planes = resolve_encode_planes(planes, d, group_size, levels, rotated=rotate,
                                   rows_bf16=x.dtype == torch.bfloat16)
    rows = _token_block_rows(num_tokens, block_tokens, rotate, x.dtype, planes)
    _write_pages_kernel[(num_heads, triton.cdiv(num_tokens, rows))](
        kernel_view(x), _rotation_operand(rotation, x), page_ids, slots, codes, scale, minimum,
        num_tokens, num_pages,
        NUM_HEADS=num_heads, PAGE_SIZE=page_size, ROTATE=rotate, INPUT_BF16=x.dtype == torch.bfloat16,
        TENSOR_CORES=not interpreting(), ROTATION_ROWS=_rotation_rows(rows),
        BLOCK_TOKENS=rows, **_encode_constants(d, group_size, clip_index, levels, order_statistic, x.dtype, rotate,
                                               planes),
        num_warps=num_warps,
    )


@triton.jit
def _write_bf16_pages_kernel(
    x_ptr,  # [T, K, D] float32 / float16, or bfloat16 as int16
    page_ids_ptr,  # [T] int32
    slots_ptr,  # [T] int32
    pool_ptr,  # [P, K, L, D] bfloat16 as int16 (updated in place)
    num_tokens,
    num_pages,
    NUM_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    D: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
):
    head = tl.program_id(0)
    token = (tl.program_id(1) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS))[:, None]  # [R, 1]
    token_ok = token < num_tokens
    page, slot, valid = _destinations(page_ids_ptr, slots_ptr, token, token_ok, num_pages, PAGE_SIZE)
    ptrs = x_ptr + (token * NUM_HEADS + head) * D + tl.arange(0, D)[None, :]
    if INPUT_BF16:
        bits = tl.load(ptrs, mask=token_ok, other=0)  # already bfloat16: copy the bits
    else:
        bits = bf16_bits_rne(tl.load(ptrs, mask=token_ok, other=0).to(tl.float32))
    _store_rows(pool_ptr, page, head, slot, valid, bits, NUM_HEADS, PAGE_SIZE)


def write_bf16_pages_rows(
    pool: torch.Tensor,
    x: torch.Tensor,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    *,
    block_tokens: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> None:
    """pool [P, K, L, D] bf16 ← x [T, K, D] at (page_ids[t], slots[t]), in place; block_tokens None →
    DEFAULT_BLOCK_ROWS (interpreted: INTERPRET_BLOCK_ROWS)."""
    num_tokens, num_heads, d = x.shape
    num_pages, _, page_size, _ = pool.shape
    rows = _token_block_rows(num_tokens, block_tokens, rotate=False)
    _write_bf16_pages_kernel[(num_heads, triton.cdiv(num_tokens, rows))](
        kernel_view(x), page_ids, slots, pool.view(torch.int16), num_tokens, num_pages,
        NUM_HEADS=num_heads, PAGE_SIZE=page_size, D=d, INPUT_BF16=x.dtype == torch.bfloat16,
        BLOCK_TOKENS=rows, num_warps=num_warps,
    )


# ------------------------------------------------------------------------------- demotion


@triton.jit
def _demote_pages_kernel(
    src_pages_ptr,  # [N] int32: the BF16 pages to read
    dst_pages_ptr,  # [N] int32: the INT2 pages to write
    bf16_ptr,  # [Y, P, K, L, D] bfloat16 as int16
    codes_ptr,  # [Y, P', K, L, D/4] uint8 (updated in place)
    scale_ptr,  # [Y, P', K, L, D/G] float16
    minimum_ptr,  # [Y, P', K, L, D/G] float16
    src_pool_pages,
    dst_pool_pages,
    NUM_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    LEVELS: tl.constexpr,
    ORDER_STATISTIC: tl.constexpr,
    PLANES: tl.constexpr = False,
):
    layer, n, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src = tl.load(src_pages_ptr + n)
    dst = tl.load(dst_pages_ptr + n)
    valid = (src >= 0) & (src < src_pool_pages) & (dst >= 0) & (dst < dst_pool_pages)
    slot = tl.arange(0, PAGE_SIZE)[:, None]  # [L, 1]
    # Pages of all layers in one pool: layer y's page p is page y·P + p of a [Y·P, K, L, ·] pool.
    src_page = layer.to(tl.int64) * src_pool_pages + tl.where(valid, src, 0)
    dst_page = layer.to(tl.int64) * dst_pool_pages + tl.where(valid, dst, 0)
    row_start = ((src_page * NUM_HEADS + head) * PAGE_SIZE + slot) * D
    valid_rows = (slot >= 0) & valid  # [L, 1]
    packed, scale, minimum = encode_loaded_rows(bf16_ptr + row_start, valid_rows, D, GROUP_SIZE, CLIP_INDEX, LEVELS,
                                                ORDER_STATISTIC, True, PLANES)  # bf16: widened exactly
    _store_rows(codes_ptr, dst_page, head, slot, valid_rows, packed.to(tl.uint8), NUM_HEADS, PAGE_SIZE)
    _store_rows(scale_ptr, dst_page, head, slot, valid_rows, scale, NUM_HEADS, PAGE_SIZE)
    _store_rows(minimum_ptr, dst_page, head, slot, valid_rows, minimum, NUM_HEADS, PAGE_SIZE)


def demote_pages_rows(
    bf16_pool: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    *,
    group_size: int,
    clip_index: int,
    levels: str,
    order_statistic: str | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    planes: bool | None = None,
) -> None:
    """Quantize BF16 pages bf16_pool[y, src_pages[n]] into INT2 pages [y, dst_pages[n]] for every
    layer y and kv head, in place: pools carry a leading layer axis Y (Y = 1 for one layer).
    Grid (Y, N, K): one program encodes the L rows of one (layer, page, head) block. planes: by
    codec.encode_planes (tiling.resolve_encode_planes: None where it applies)."""
    num_layers, src_pool_pages, num_heads, page_size, d = bf16_pool.shape
    (num_demoted,) = src_pages.shape
    planes = resolve_encode_planes(planes, d, group_size, levels)
    _demote_pages_kernel[(num_layers, num_demoted, num_heads)](
        src_pages, dst_pages, bf16_pool.view(torch.int16), codes, scale, minimum,
        src_pool_pages, codes.shape[1],
        NUM_HEADS=num_heads, PAGE_SIZE=page_size,
        **_encode_constants(d, group_size, clip_index, levels, order_statistic, bf16_pool.dtype, False, planes),
        num_warps=num_warps,
    )

