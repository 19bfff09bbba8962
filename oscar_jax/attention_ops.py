"""Public attention ops over OSCAR's paged mixed-precision KV cache: validate, launch, merge.

Cache layout (DESIGN.md §2 "Pages"; per layer; every tier holds ROTATED K/V):
  BF16 tier  k_bf16, v_bf16                      bfloat16[P, Hkv, L, D]
  INT2 tier  k_codes, v_codes                    uint8[P2, Hkv, L, D/4]  (quartered packing)
             k_scale, k_min, v_scale, v_min      float16[P2, Hkv, L, D/G];  x̂ = min + code·scale
  per sequence b:
    bf16_page_table[b]    int32[NB]: slots [0, sink_slots) the sink pages, then the recent pages
    sink_tokens[b]        tokens valid in the sink slots (≤ S0), filling pages in order
    recent_tokens[b]      tokens valid in the recent slots, in order
    history_page_table[b] int32[NH]: the INT2 pages
    history_tokens[b]     a multiple of L
Table entries that hold no valid token may hold any value and are never dereferenced; entries
that do must be in range (they are not clamped). Token order does not matter (RoPE is applied).

decode_attention: one rotated query per sequence → two split-K first-stage Pallas kernels (BF16
tier, INT2 tier; `oscar_jax.kernels.decode_attention`) → one merge kernel reading both tiers'
partials in place (`merge_tier_partials`; equal to `merge_partials`, the plain-jnp merge).
prefill_attention: a chunk of T rotated queries → the same two kernels over the cached prefix
(T·Gq query rows) + a causal full-precision kernel over the chunk itself
(`oscar_jax.kernels.prefill_attention`) → one merge.

Precision: the compute dtype of the dots is q's dtype. float32 q: float32 (IEEE) dots throughout;
bfloat16 q: bfloat16 dot operands (the probabilities are rounded to bfloat16 before P·V), float32
accumulation. Softmax statistics are always float32. Outputs are float32.
A sequence with no cached token (decode) gets a zero output row.

With interpret=None the public ops run `oscar_jax.xla.kernels()`'s implementation: on a CPU backend
the native XLA path (`oscar_jax.xla.attention`: the same tables and pools, float32 throughout), on
a GPU backend the kernels above. Validation is the same for both and comes first.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import xla
from oscar_jax.kernels import register_cap
from oscar_jax.kernels.codec import INTERPRET_BLOCK_TOKENS, resolve_interpret
from oscar_jax.kernels.decode_attention import (
    MIN_DOT_DIM,
    bf16_tier_partials,
    int2_tier_partials,
    merge_tier_partials,
)
from oscar_jax.kernels.layered import layer_views
from oscar_jax.kernels.prefill_attention import causal_chunk_partials
from shared_math.spec import CODES_PER_BYTE, is_power_of_two, validate_codec_shape, validate_key_layout
from shared_math.tiling import (
    DecodeLaunch, int2_decode_rows, next_power_of_two, prefill_launch, resolve_decode_launch, resolve_tiling,
)

DEFAULT_PAGES_PER_BLOCK = None  # → shared_math.tiling.default_pages_per_block(page size)
DEFAULT_PREFILL_BLOCK_M = 64
DEFAULT_PREFILL_BLOCK_N = 64
QUERY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def merge_partials(outputs, lses):
    """Exact softmax over the union of splits: o = Σ_s exp(lse_s − lse)·o_s, lse = logsumexp(lse_s).

    outputs float32[..., S, M, D] (normalised partials), lses float32[..., S, M]. Splits with
    lse = −inf (no token) weigh zero; rows where every split is empty get o = 0, lse = −inf.
    Returns (o float32[..., M, D], lse float32[..., M]).
    """
    lse_max = jnp.max(lses, axis=-2)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights = jnp.exp(lses - lse_max[..., None, :])  # [..., S, M], 0 for empty splits
    total = jnp.sum(weights, axis=-2)
    o = jnp.sum(weights[..., None] * outputs, axis=-3) / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, lse_max + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return o, lse


# --------------------------------------------------------------------------------------------
# Validation (one helper, uniform messages).
# --------------------------------------------------------------------------------------------


def _check(name: str, x, shape: tuple, dtypes) -> None:
    dtypes = tuple(jnp.dtype(d) for d in (dtypes if isinstance(dtypes, tuple) else (dtypes,)))
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    mismatch = any(want is not None and got != want for got, want in zip(x.shape, shape))
    if len(x.shape) != len(shape) or mismatch:
        want = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {x.dtype}")


def _check_static_int(name: str, value, *, power_of_two: bool = False, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if power_of_two and not is_power_of_two(int(value)):
        raise ValueError(f"{name}={value!r} must be a power of two")


def _validate_cache(
    q_heads: int,
    head_dim: int,
    batch: int,
    k_bf16,
    v_bf16,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    bf16_page_table,
    sink_tokens,
    recent_tokens,
    history_page_table,
    history_tokens,
    *,
    sink_slots,
    group_size,
    softmax_scale,
    key_layout="token",
) -> tuple[int, int]:
    """Validate the cache arguments shared by decode and prefill; returns (Hkv, page size)."""
    validate_key_layout(key_layout)
    _check_static_int("group_size", group_size)
    validate_codec_shape(head_dim, group_size)  # ValueError naming head_dim / group_size
    if head_dim // CODES_PER_BYTE < MIN_DOT_DIM:
        raise NotImplementedError(
            f"{head_dim=}: the INT2 kernel dots each bit plane of D/{CODES_PER_BYTE} channels and "
            f"needs D/{CODES_PER_BYTE} >= {MIN_DOT_DIM} (head_dim >= {MIN_DOT_DIM * CODES_PER_BYTE})"
        )
    _check("k_bf16", k_bf16, (None, None, None, head_dim), jnp.bfloat16)
    num_pages, num_kv_heads, page_size, _ = k_bf16.shape
    if num_pages < 1 or num_kv_heads < 1:
        raise ValueError(
            f"k_bf16 must hold at least one page and one KV head, got shape {tuple(k_bf16.shape)}"
        )
    _check("v_bf16", v_bf16, tuple(k_bf16.shape), jnp.bfloat16)
    if not is_power_of_two(page_size):
        raise ValueError(f"page size {page_size} (k_bf16.shape[2]) must be a power of two")
    if q_heads % num_kv_heads:
        raise ValueError(f"query heads Hq={q_heads} must be a multiple of KV heads Hkv={num_kv_heads}")
    packed, groups = head_dim // CODES_PER_BYTE, head_dim // group_size
    _check("k_codes", k_codes, (None, num_kv_heads, page_size, packed), jnp.uint8)
    int2_pages = k_codes.shape[0]
    meta = (int2_pages, num_kv_heads, page_size, groups)
    key_meta = meta if key_layout == "token" else (int2_pages, num_kv_heads, head_dim)  # v2: per channel and page
    _check("k_scale", k_scale, key_meta, jnp.float16)
    _check("k_min", k_min, key_meta, jnp.float16)
    _check("v_codes", v_codes, tuple(k_codes.shape), jnp.uint8)
    _check("v_scale", v_scale, meta, jnp.float16)
    _check("v_min", v_min, meta, jnp.float16)
    _check("bf16_page_table", bf16_page_table, (batch, None), jnp.int32)
    _check("history_page_table", history_page_table, (batch, None), jnp.int32)
    for name, lengths in (
        ("sink_tokens", sink_tokens),
        ("recent_tokens", recent_tokens),
        ("history_tokens", history_tokens),
    ):
        _check(name, lengths, (batch,), jnp.int32)
    if history_page_table.shape[1] > 0 and int2_pages < 1:
        raise ValueError(
            f"history_page_table has {history_page_table.shape[1]} slots but the INT2 pool "
            f"k_codes {tuple(k_codes.shape)} holds no page"
        )
    _check_static_int("sink_slots", sink_slots)
    if sink_slots > bf16_page_table.shape[1]:
        raise ValueError(f"{sink_slots=} exceeds the BF16 page table's {bf16_page_table.shape[1]} slots")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating)) or not (
        math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"{softmax_scale=} must be a finite positive number")
    return num_kv_heads, page_size


def _table_slots(bf16_page_table, history_page_table) -> tuple[int, int]:
    """The two page tables' slots (0 for a malformed table, which _validate_cache names)."""
    return tuple(table.shape[1] if len(getattr(table, "shape", ())) == 2 else 0
                 for table in (bf16_page_table, history_page_table))


def _resolve_tiling(pages_per_split, pages_per_block, bf16_page_table, history_page_table, page_size,
                    sequence_heads=None, interpret=False, prefill=False):
    """(pages_per_split, bf16_pages_per_split, pages_per_block): shared_math.tiling.resolve_tiling
    (`sequence_heads` = B × Hkv for a decode call, `prefill` for a prefill call); interpreted, with
    both left to the default, one split of blocks of up to INTERPRET_BLOCK_TOKENS tokens
    (kernels.codec says why)."""
    bf16_slots, history_slots = _table_slots(bf16_page_table, history_page_table)
    return resolve_tiling(pages_per_split, pages_per_block, bf16_slots=bf16_slots, history_slots=history_slots,
                          page_size=page_size, sequence_heads=sequence_heads, prefill=prefill,
                          interpret_block_tokens=INTERPRET_BLOCK_TOKENS if interpret else None)


POOL_ARGUMENTS = ("k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")


def _layer_views(cache: tuple, layer):
    """The cache arguments with the eight pools replaced by shape views of layer `layer` (stacked
    pools) for validation; unchanged when layer is None."""
    if layer is None:
        return cache
    for name, pool in zip(POOL_ARGUMENTS, cache):
        if not hasattr(pool, "shape") or not hasattr(pool, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(pool).__name__}")
    views = layer_views(dict(zip(POOL_ARGUMENTS, cache)), layer)
    return tuple(views[name] for name in POOL_ARGUMENTS) + tuple(cache[len(POOL_ARGUMENTS):])


def _page_size(k_bf16) -> int:
    shape = getattr(k_bf16, "shape", ())
    return int(shape[2]) if len(shape) == 4 else 0  # a malformed pool is reported by _validate_cache


# --------------------------------------------------------------------------------------------
# Prefix (cache) partials shared by decode and prefill.
# --------------------------------------------------------------------------------------------


def _cache_partials(q_rows, cache, *, sink_slots, group_size, softmax_scale, block_m, launch: DecodeLaunch,
                   interpret, layer=None, int2_rows=None, key_layout="token"):
    """Partials of q_rows [B, Hkv, M, D], one (o, lse) per tier: the BF16 tier, then the INT2 tier
    when the history table has slots, each kernel launched as `launch` says. `int2_rows` (decode,
    with launch.tokens_on_m): the INT2 tier reads the first int2_rows rows in one block, its scores
    with tokens on M (`shared_math.tiling.int2_decode_rows`); its partials then have int2_rows rows."""
    (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
     bf16_page_table, sink_tokens, recent_tokens, history_page_table, history_tokens) = cache
    common = dict(softmax_scale=softmax_scale, pages_per_block=launch.pages_per_block, interpret=interpret,
                  layer=layer)
    tiers = [bf16_tier_partials(
        q_rows, k_bf16, v_bf16, bf16_page_table, sink_tokens, recent_tokens, sink_slots=sink_slots,
        pages_per_split=launch.bf16_pages_per_split, block_m=block_m, num_warps=launch.bf16_num_warps,
        num_stages=launch.bf16_num_stages, **common,
    )]
    if history_page_table.shape[1] > 0:
        rows = {} if int2_rows is None else dict(block_m=int2_rows, rows=int2_rows)  # q's first rows, in place
        tiers.append(int2_tier_partials(
            q_rows, k_codes, k_scale, k_min, v_codes, v_scale, v_min, history_page_table, history_tokens,
            group_size=group_size, pages_per_split=launch.pages_per_split, **{"block_m": block_m, **rows},
            num_warps=launch.int2_num_warps, num_stages=launch.int2_num_stages, unpack_asm=launch.unpack_asm,
            fma_asm=launch.fma_asm, tokens_on_m=launch.tokens_on_m, channels_on_m=launch.channels_on_m,
            max_registers=launch.max_registers, key_layout=key_layout, **common,
        ))
    return tiers


_STATIC = ("sink_slots", "group_size", "softmax_scale", "launch", "interpret", "layer", "key_layout")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_attention(q, cache, *, sink_slots, group_size, softmax_scale, launch: DecodeLaunch, interpret, layer,
                      key_layout):
    batch, q_heads, head_dim = q.shape
    num_kv_heads = cache[0].shape[-3]  # k_bf16 [(Y,) P, K, L, D]
    heads_per_kv = q_heads // num_kv_heads
    rows = max(MIN_DOT_DIM, next_power_of_two(heads_per_kv))  # GQA group padded for dot's M ≥ 16
    q_rows = q.reshape(batch, num_kv_heads, heads_per_kv, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - heads_per_kv), (0, 0)))
    tiers = _cache_partials(
        q_rows, cache, sink_slots=sink_slots, group_size=group_size, softmax_scale=softmax_scale, block_m=rows,
        launch=launch, interpret=interpret, layer=layer,
        int2_rows=int2_decode_rows(heads_per_kv) if launch.tokens_on_m else None, key_layout=key_layout,
    )
    # One merge program per kept row reads both tiers in place (the padding rows are never read):
    # [B, Hkv, S_t, rows, D] per tier → o [B, Hkv, Gq, D], no concatenation or XLA fusions between
    # the tiers and the output (benchmarks/DECISIONS.md D17).
    o = merge_tier_partials(tiers, heads_per_kv, interpret=interpret)
    return o.reshape(batch, q_heads, head_dim)


def decode_attention(
    q,
    k_bf16,
    v_bf16,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    bf16_page_table,
    sink_tokens,
    recent_tokens,
    history_page_table,
    history_tokens,
    *,
    sink_slots: int,
    group_size: int,
    softmax_scale: float,
    pages_per_split: int | None = None,
    pages_per_block: int | None = DEFAULT_PAGES_PER_BLOCK,
    num_warps: int | None = None,
    num_stages: int | None = None,
    layer: int | None = None,
    unpack_asm: bool | None = None,
    fma_asm: bool | None = None,
    interpret: bool | None = None,
    channels_on_m: bool | None = None,
    max_registers: int | None = None,
    key_layout: str = "token",
):
    """Decode attention of one rotated query per sequence over the mixed-tier paged cache.

    Args:
      q: float32 or bfloat16 [B, Hq, D], already rotated (q·R_K); query head h reads KV head
        h // (Hq / Hkv).
      k_bf16 … history_tokens: the cache of one layer (module docstring for the layout).
      sink_slots: the number of leading BF16 table slots that are sink pages (S0 / page size).
      group_size: G of the INT2 pages (format v1).
      softmax_scale: multiplies q·k (typically 1/√D).
      pages_per_split: pages of one split-K program (a multiple of pages_per_block) of the tier
        that holds the context: the INT2 tier, or the BF16 tier of a cache without one; None →
        about (the longer page table's slots) / TARGET_SPLITS, ≥ MIN_TOKENS_PER_SPLIT tokens, and
        for the INT2 tier longer while B × Hkv × splits stays ≥ 1,024 programs (a large batch needs
        fewer splits to fill the GPU; `shared_math.tiling.decode_pages_per_split`). Beside an INT2
        tier the BF16 tier (sink + recent pages) takes its own, shorter split
        (`shared_math.tiling.resolve_splits`).
      pages_per_block: pages per inner iteration (power of two, ≤ pages_per_split, × L ≥ 16);
        None → `shared_math.tiling.default_pages_per_block` (one page when L ≥ 16).
      num_warps, num_stages: Triton launch parameters of both tier kernels (GPU only); None → each
        tier's own, `shared_math.tiling.default_decode_launch`: the INT2 tier 1 warp and 3 stages
        with its scores as [page tokens, 8 query rows] (pages of ≥ 16 tokens and ≥ 512 programs:
        `shared_math.tiling.int2_decode_tokens_on_m`, benchmarks/DECISIONS.md D4), else rows on M
        and warps as the BF16 tier's; the BF16 tier 2 warps once it has ≥ 512 programs, else 4,
        and 2 stages (D7, D9).
      unpack_asm: unpack the INT2 codes with inline PTX (bfloat16 q, GPU only): the same operand
        bits in fewer instructions (benchmarks/DECISIONS.md D10); None → on
        where it can run (compiled, bfloat16 q), False → the compiler's unpacking.
      fma_asm: the INT2 tier's multiply-adds as one fma each by inline PTX (GPU only): XLA's
        compile of the kernel does not contract them (benchmarks/DECISIONS.md D14); None → on where it
        can run (compiled), False → separate multiplies and adds.
      layer: None, or a static layer index when the eight pools are stacked [Y, P, …] (all
        layers): that layer is read in place, without slicing it out (`kernels.layered`).
      interpret: True / False: the Pallas kernels in interpret mode / compiled; None → the XLA path
        on a CPU backend, compiled kernels on a GPU backend (`oscar_jax.xla.kernels`).
      channels_on_m: the INT2 tier's values dot as oᵀ = Vᵀ·p (channels on the dot's M, the rows on N;
        `kernels.decode_attention.int2_tier_partials`), which needs its scores with tokens on M, one
        group per row and D ≥ 128 (`shared_math.tiling.int2_decode_channels_on_m`); None → on where
        it applies (benchmarks/DECISIONS.md D5), True → on or
        ValueError, False → the values' dot with the rows on M.
      max_registers: registers per thread the compiled INT2 tier kernel may use (as the Triton
        backend's: XLA's compile may hold more than the kernel needs, and fewer registers fit more
        programs per SM). Pallas has no public parameter for it: a cap needs the opt-in
        `kernels.register_cap` (OSCAR_JAX_REGISTER_CAP=1, which patches JAX's private Triton
        lowering; a cap without it is a ValueError). None → opted in,
        `shared_math.tiling.int2_decode_max_registers`: 160 with the tokens and channels on M
        (benchmarks/DECISIONS.md D6), else 0; not opted
        in, 0 → the compiler's choice. No effect in interpret mode.
    All launch keywords resolve into one `shared_math.tiling.DecodeLaunch`
    (`shared_math.tiling.resolve_decode_launch`, shared with oscar_torch), validated there.
      key_layout: "token" (format v1) or "channel" (format v2: k_scale / k_min [P, Hkv, D], one per
        channel and page: the XLA path, or the Pallas INT2 tier's `_channel_key_scores`).
    Returns:
      float32 [B, Hq, D].
    """
    _check("q", q, (None, None, None), QUERY_DTYPES)
    batch, q_heads, head_dim = q.shape
    cache = (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
             bf16_page_table, sink_tokens, recent_tokens, history_page_table, history_tokens)
    views = _layer_views(cache, layer)
    pool_shape = getattr(views[0], "shape", ())  # k_bf16 [P, Hkv, L, D]; a malformed one is named below
    use_xla = xla.use_xla(interpret)
    interpret = resolve_interpret(interpret)
    page_size = _page_size(views[0])
    tiling = _resolve_tiling(
        pages_per_split, pages_per_block, bf16_page_table, history_page_table, page_size,
        sequence_heads=batch * int(pool_shape[1]) if len(pool_shape) == 4 else None, interpret=interpret)
    num_kv_heads, _ = _validate_cache(
        q_heads, head_dim, batch, *views, sink_slots=sink_slots, group_size=group_size, softmax_scale=softmax_scale,
        key_layout=key_layout,
    )
    bf16_slots, history_slots = _table_slots(bf16_page_table, history_page_table)
    # A register cap reaches a compiled kernel only through the opt-in hook (kernels.register_cap):
    # without it the default is the compiler's choice.
    launch = resolve_decode_launch(
        batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, group_size=group_size, page_size=page_size,
        bf16_slots=bf16_slots, history_slots=history_slots, tiling=tiling, compiled=not interpret,
        q_dtype=str(q.dtype), num_warps=num_warps, num_stages=num_stages, channels_on_m=channels_on_m,
        max_registers=max_registers, unpack_asm=unpack_asm, fma_asm=fma_asm, tokens_on_m_any_group=True,
        rows_on_m_max_registers=0, register_caps=register_cap.opted_in(),
    )
    if use_xla:
        from oscar_jax.xla import attention as xla_attention  # imports this module's merge_partials

        return xla_attention.decode_attention(q, cache, sink_slots=int(sink_slots), group_size=int(group_size),
                                              softmax_scale=float(softmax_scale), layer=layer, key_layout=key_layout)
    return _decode_attention(q, cache, sink_slots=int(sink_slots), group_size=int(group_size),
                             softmax_scale=float(softmax_scale), launch=launch, interpret=interpret, layer=layer,
                             key_layout=key_layout)


@functools.partial(jax.jit, static_argnames=_STATIC + ("block_m", "tier_block_m", "block_n"))
def _prefill_attention(
    q, k_new, v_new, cache, new_tokens, *, sink_slots, group_size, softmax_scale, launch: DecodeLaunch, block_m,
    tier_block_m, block_n, interpret, layer, key_layout,
):
    batch, chunk, q_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[2]
    heads_per_kv = q_heads // num_kv_heads
    rows = chunk * heads_per_kv
    block_m, tier_block_m = (min(m, max(MIN_DOT_DIM, next_power_of_two(rows))) for m in (block_m, tier_block_m))
    padded_rows = -(-rows // max(block_m, tier_block_m)) * max(block_m, tier_block_m)  # powers of two: both divide
    block_n = min(block_n, max(MIN_DOT_DIM, next_power_of_two(chunk)))
    padded_chunk = -(-chunk // block_n) * block_n

    # Rows of KV head h, token-major: r = t·Gq + g.
    q_rows = q.reshape(batch, chunk, num_kv_heads, heads_per_kv, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    prefix_tiers = _cache_partials(
        q_rows, cache, sink_slots=sink_slots, group_size=group_size, softmax_scale=softmax_scale,
        block_m=tier_block_m, launch=launch, interpret=interpret, layer=layer, key_layout=key_layout,
    )

    chunk_dtype = jnp.promote_types(q.dtype, k_new.dtype)  # the chunk stays in full precision
    chunk_padding = ((0, 0), (0, 0), (0, padded_chunk - chunk), (0, 0))
    k_chunk, v_chunk = (
        jnp.pad(x.transpose(0, 2, 1, 3), chunk_padding).astype(chunk_dtype) for x in (k_new, v_new)
    )  # [B, Hkv, T_pad, D]
    self_outputs, self_lses = causal_chunk_partials(
        q_rows.astype(chunk_dtype), k_chunk, v_chunk, new_tokens, heads_per_kv=heads_per_kv,
        softmax_scale=softmax_scale, block_m=block_m, block_n=block_n, interpret=interpret,
    )
    o, _ = merge_partials(
        jnp.concatenate([o for o, _ in prefix_tiers] + [self_outputs], axis=2)[..., :rows, :],
        jnp.concatenate([lse for _, lse in prefix_tiers] + [self_lses], axis=2)[..., :rows],
    )
    o = o.reshape(batch, num_kv_heads, chunk, heads_per_kv, head_dim).transpose(0, 2, 1, 3, 4)
    o = o.reshape(batch, chunk, q_heads, head_dim)
    valid_rows = jnp.arange(chunk)[None, :] < new_tokens[:, None]  # ragged chunks: padding rows → 0
    return jnp.where(valid_rows[:, :, None, None], o, 0.0)


def prefill_attention(
    q,
    k_new,
    v_new,
    k_bf16,
    v_bf16,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    bf16_page_table,
    sink_tokens,
    recent_tokens,
    history_page_table,
    history_tokens,
    new_tokens=None,
    *,
    sink_slots: int,
    group_size: int,
    softmax_scale: float,
    pages_per_split: int | None = None,
    pages_per_block: int | None = DEFAULT_PAGES_PER_BLOCK,
    block_m: int = DEFAULT_PREFILL_BLOCK_M,
    block_n: int = DEFAULT_PREFILL_BLOCK_N,
    tier_block_m: int | None = None,
    layer: int | None = None,
    interpret: bool | None = None,
    key_layout: str = "token",
):
    """Attention of a chunk of T new tokens: causal over the chunk (full precision) + the cached prefix.

    Args:
      q: float32 or bfloat16 [B, T, Hq, D], rotated queries of the chunk.
      k_new, v_new: float32 or bfloat16 (same dtype) [B, T, Hkv, D], the chunk's own rotated K/V.
      k_bf16 … history_tokens: the cache holding the prefix before the chunk (layout as in
        `decode_attention`); every chunk token sees all of it. The prefix is read through the
        tiers exactly as decode reads it (the INT2 pages through the INT2 kernel).
      new_tokens: int32 [B], valid tokens of each chunk (default: T). Rows t ≥ new_tokens[b] are 0.
      block_m, block_n: query rows / chunk keys per block (powers of two ≥ 16; capped by the chunk).
      tier_block_m: query rows per block of the prefix's tiers (default: block_m). Each row block
        reads and unpacks the whole prefix, so larger blocks unpack it fewer times a chunk.
      Other keywords as in `decode_attention`.
    Returns:
      float32 [B, T, Hq, D].
    """
    _check("q", q, (None, None, None, None), QUERY_DTYPES)
    batch, chunk, q_heads, head_dim = q.shape
    _check("k_new", k_new, (batch, chunk, None, head_dim), QUERY_DTYPES)
    num_kv_heads = k_new.shape[2]
    _check("v_new", v_new, tuple(k_new.shape), k_new.dtype)
    if chunk < 1:
        raise ValueError(f"the chunk must hold at least one token, got q of shape {tuple(q.shape)}")
    cache = (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
             bf16_page_table, sink_tokens, recent_tokens, history_page_table, history_tokens)
    views = _layer_views(cache, layer)
    use_xla = xla.use_xla(interpret)
    interpret = resolve_interpret(interpret)
    page_size = _page_size(views[0])
    tiling = _resolve_tiling(pages_per_split, pages_per_block, bf16_page_table, history_page_table, page_size,
                             interpret=interpret, prefill=True)
    cache_kv_heads, _ = _validate_cache(
        q_heads, head_dim, batch, *views, sink_slots=sink_slots, group_size=group_size, softmax_scale=softmax_scale,
        key_layout=key_layout,
    )
    launch = prefill_launch(*tiling, page_size, fma_asm=not interpret)  # the INT2 fmas by PTX when compiled
    if num_kv_heads != cache_kv_heads:
        raise ValueError(f"k_new has {num_kv_heads} KV heads but the cache has {cache_kv_heads}")
    if new_tokens is None:
        new_tokens = jnp.full((batch,), chunk, jnp.int32)
    _check("new_tokens", new_tokens, (batch,), jnp.int32)
    tier_block_m = block_m if tier_block_m is None else tier_block_m
    for name, value in (("block_m", block_m), ("block_n", block_n), ("tier_block_m", tier_block_m)):
        _check_static_int(name, value, power_of_two=True, minimum=MIN_DOT_DIM)
    if use_xla:
        from oscar_jax.xla import attention as xla_attention  # imports this module's merge_partials

        return xla_attention.prefill_attention(q, k_new, v_new, cache, new_tokens, sink_slots=int(sink_slots),
                                               group_size=int(group_size), softmax_scale=float(softmax_scale),
                                               layer=layer, key_layout=key_layout)
    return _prefill_attention(
        q, k_new, v_new, cache, new_tokens, sink_slots=int(sink_slots), group_size=int(group_size),
        softmax_scale=float(softmax_scale), launch=launch, block_m=int(block_m), tier_block_m=int(tier_block_m),
        block_n=int(block_n), interpret=interpret, layer=layer, key_layout=key_layout,
    )
