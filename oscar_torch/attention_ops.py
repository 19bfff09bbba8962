"""Public attention ops over OSCAR's paged mixed-precision KV cache: validate, launch, merge.

The torch twin of oscar_jax.attention_ops: same op names, argument order, layout and semantics.

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

decode_attention: one rotated query per sequence → two split-K first-stage Triton kernels (BF16
tier, INT2 tier; `oscar_torch.kernels.decode_attention`) → `merge_partials` (plain torch).
prefill_attention: a chunk of T rotated queries → the same two kernels over the cached prefix
(T·Gq query rows) + a causal full-precision kernel over the chunk itself
(`oscar_torch.kernels.prefill_attention`) → one merge.

Precision: the compute dtype of the dots is q's dtype. float32 q: IEEE float32 dots throughout;
bfloat16 q: bfloat16 dot operands (the probabilities are rounded to bfloat16 before P·V), float32
accumulation. Softmax statistics are always float32. Outputs are float32.
A sequence with no cached token (decode) gets a zero output row.
"""

from __future__ import annotations

import math

import torch

from oscar_torch import library
from oscar_torch.kernels.codec import INTERPRET_BLOCK_ROWS, default_block_rows, interpreting
from oscar_torch.kernels.decode_attention import MIN_DOT_DIM
from oscar_torch.validation import (
    check_devices,
    check_positive_float,
    check_static_int,
    check_tensor,
)
from shared_math.spec import CODES_PER_BYTE, is_power_of_two, validate_codec_shape
from shared_math.tiling import (
    TRITON_INT2_MAX_REGISTERS, DecodeLaunch, int2_decode_rows, next_power_of_two, prefill_launch,
    resolve_decode_launch, resolve_tiling,
)

DEFAULT_PAGES_PER_BLOCK = None  # → shared_math.tiling.default_pages_per_block(page size)
DEFAULT_PREFILL_BLOCK_M = 64
DEFAULT_PREFILL_BLOCK_N = 64
QUERY_DTYPES = (torch.float32, torch.bfloat16)
_INT32 = (torch.int32,)


def merge_partials(outputs: torch.Tensor, lses: torch.Tensor):
    """Exact softmax over the union of splits: o = Σ_s exp(lse_s − lse)·o_s, lse = logsumexp(lse_s).

    outputs float32[..., S, M, D] (normalised partials), lses float32[..., S, M]. Splits with
    lse = −inf (no token) weigh zero; rows where every split is empty get o = 0, lse = −inf.
    Returns (o float32[..., M, D], lse float32[..., M]).
    """
    lse_max = torch.amax(lses, dim=-2)
    lse_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    weights = torch.exp(lses - lse_max.unsqueeze(-2))  # [..., S, M], 0 for empty splits
    total = weights.sum(dim=-2)
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    o = (weights.unsqueeze(-1) * outputs).sum(dim=-3) / safe_total.unsqueeze(-1)
    lse = torch.where(total > 0, lse_max + torch.log(safe_total), torch.full_like(total, -math.inf))
    return o, lse


# --------------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------------


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
) -> tuple[int, int]:
    """Validate the cache arguments shared by decode and prefill; returns (Hkv, page size)."""
    check_static_int("group_size", group_size)
    validate_codec_shape(head_dim, group_size)  # ValueError naming head_dim / group_size
    check_tensor("k_bf16", k_bf16, dtypes=(torch.bfloat16,), shape=(None, None, None, head_dim))
    num_pages, num_kv_heads, page_size, _ = k_bf16.shape
    if num_pages < 1 or num_kv_heads < 1:
        raise ValueError(f"k_bf16 must hold at least one page and one KV head, got shape {tuple(k_bf16.shape)}")
    check_tensor("v_bf16", v_bf16, dtypes=(torch.bfloat16,), shape=tuple(k_bf16.shape))
    if not is_power_of_two(page_size):
        raise ValueError(f"page size {page_size} (k_bf16.shape[2]) must be a power of two")
    if q_heads % num_kv_heads:
        raise ValueError(f"query heads Hq={q_heads} must be a multiple of KV heads Hkv={num_kv_heads}")
    packed, groups = head_dim // CODES_PER_BYTE, head_dim // group_size
    check_tensor("k_codes", k_codes, dtypes=(torch.uint8,), shape=(None, num_kv_heads, page_size, packed))
    int2_pages = k_codes.shape[0]
    meta = (int2_pages, num_kv_heads, page_size, groups)
    check_tensor("k_scale", k_scale, dtypes=(torch.float16,), shape=meta)
    check_tensor("k_min", k_min, dtypes=(torch.float16,), shape=meta)
    check_tensor("v_codes", v_codes, dtypes=(torch.uint8,), shape=tuple(k_codes.shape))
    check_tensor("v_scale", v_scale, dtypes=(torch.float16,), shape=meta)
    check_tensor("v_min", v_min, dtypes=(torch.float16,), shape=meta)
    check_tensor("bf16_page_table", bf16_page_table, dtypes=_INT32, shape=(batch, None))
    check_tensor("history_page_table", history_page_table, dtypes=_INT32, shape=(batch, None))
    for name, lengths in (
        ("sink_tokens", sink_tokens),
        ("recent_tokens", recent_tokens),
        ("history_tokens", history_tokens),
    ):
        check_tensor(name, lengths, dtypes=_INT32, shape=(batch,))
    if history_page_table.shape[1] > 0 and int2_pages < 1:
        raise ValueError(
            f"history_page_table has {history_page_table.shape[1]} slots but the INT2 pool "
            f"k_codes {tuple(k_codes.shape)} holds no page"
        )
    check_static_int("sink_slots", sink_slots)
    if sink_slots > bf16_page_table.shape[1]:
        raise ValueError(f"{sink_slots=} exceeds the BF16 page table's {bf16_page_table.shape[1]} slots")
    check_positive_float("softmax_scale", softmax_scale)
    return num_kv_heads, page_size


def _table_slots(bf16_page_table, history_page_table) -> tuple[int, int]:
    """The two page tables' slots (0 for a malformed table, which _validate_cache names)."""
    return tuple(table.shape[1] if isinstance(table, torch.Tensor) and table.dim() == 2 else 0
                 for table in (bf16_page_table, history_page_table))


def _resolve_tiling(pages_per_split, pages_per_block, bf16_page_table, history_page_table, k_bf16, batch=None):
    """(pages_per_split, bf16_pages_per_split, pages_per_block, page size): shared_math.tiling.resolve_tiling
    (`batch` given for a decode call, whose split follows B × Hkv); interpreted, with both left to the
    default, each tier in one split of blocks of up to INTERPRET_BLOCK_ROWS tokens (see kernels.codec)."""
    pool_ok = isinstance(k_bf16, torch.Tensor) and k_bf16.dim() == 4  # a malformed pool is named by validation
    page_size = int(k_bf16.shape[2]) if pool_ok else 0
    sequence_heads = batch * int(k_bf16.shape[1]) if pool_ok and batch is not None else None
    bf16_slots, history_slots = _table_slots(bf16_page_table, history_page_table)
    return resolve_tiling(pages_per_split, pages_per_block, bf16_slots=bf16_slots, history_slots=history_slots,
                          page_size=page_size, sequence_heads=sequence_heads,
                          interpret_block_tokens=INTERPRET_BLOCK_ROWS if interpreting() else None), page_size


_CACHE_NAMES = ("k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min",
                "bf16_page_table", "sink_tokens", "recent_tokens", "history_page_table", "history_tokens")


# --------------------------------------------------------------------------------------------
# Prefix (cache) partials shared by decode and prefill.
# --------------------------------------------------------------------------------------------


def _tier_partials(q_rows, cache, *, sink_slots, group_size, softmax_scale, block_m, launch: DecodeLaunch,
                   int2_rows=None):
    """The (outputs, lses) of q_rows [B, Hkv, M, D] over each tier: BF16, then INT2 if it has slots,
    each kernel launched as `launch` says. `int2_rows` (decode, with launch.tokens_on_m): the INT2
    tier reads the first int2_rows rows in one block (q_rows holds at most that many), its scores with
    tokens on M (`shared_math.tiling.int2_decode_rows`)."""
    (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
     bf16_page_table, sink_tokens, recent_tokens, history_page_table, history_tokens) = cache
    tiers = [library.bf16_tier_partials(
        q_rows, k_bf16, v_bf16, bf16_page_table, sink_tokens, recent_tokens, sink_slots, softmax_scale,
        launch.bf16_pages_per_split, launch.pages_per_block, block_m, launch.bf16_num_warps, launch.bf16_num_stages,
    )]
    if history_page_table.shape[1] > 0:
        if int2_rows is not None:
            assert q_rows.shape[2] <= int2_rows
            block_m = int2_rows
        tiers.append(library.int2_tier_partials(
            q_rows, k_codes, k_scale, k_min, v_codes, v_scale, v_min, history_page_table, history_tokens,
            group_size, softmax_scale, launch.pages_per_split, launch.pages_per_block, block_m, launch.unpack_asm,
            launch.int2_num_warps, launch.int2_num_stages, launch.max_registers, launch.tokens_on_m,
            launch.channels_on_m,
        ))
    return tiers


def _cache_partials(q_rows, cache, **kwargs):
    """Partials of q_rows [B, Hkv, M, D] over both tiers, concatenated on the split axis."""
    tiers = _tier_partials(q_rows, cache, **kwargs)
    if len(tiers) == 1:
        return tiers[0]
    return torch.cat([o for o, _ in tiers], dim=2), torch.cat([lse for _, lse in tiers], dim=2)


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
    unpack_asm: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    channels_on_m: bool | None = None,
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
      unpack_asm: unpack the INT2 codes with inline PTX (bfloat16 q, compiled Triton on a GPU):
        the same operand bits in fewer instructions (benchmarks/DECISIONS.md D10); None → on where
        it can run (compiled, bfloat16 q), False → the compiler's unpacking.
      num_warps, num_stages: warps per program (a power of two) and software-pipelining depth of
        the page loops (≥ 1) of both tier kernels; None → each tier's own,
        `shared_math.tiling.default_decode_launch`: the INT2 tier 1 warp and 3 stages when its
        scores run with tokens on M (G ≥ D, pages of ≥ 16 tokens and ≥ 512 programs;
        `shared_math.tiling.int2_decode_tokens_on_m`, DECISIONS.md D4), else 2 warps
        once it has ≥ 512 programs, else 4; the BF16 tier likewise by its own
        programs, and 2 stages (DECISIONS.md D7, D9).
      max_registers: registers per thread the compiled INT2 tier kernel may use (Triton's maxnreg,
        ≥ 32; spills beyond it), to fit more programs per SM; None →
        `shared_math.tiling.int2_decode_max_registers`: TRITON_INT2_MAX_REGISTERS (128) for its
        rows-on-M kernel, 160 for the one-warp kernel with the tokens and channels on M (DECISIONS.md
        D6, D8), else the compiler's choice;
        0 → the compiler's choice. No effect under the Triton interpreter.
      channels_on_m: the INT2 tier's values dot as oᵀ = Vᵀ·p (channels on the dot's M, the rows on N;
        `kernels.decode_attention.int2_tier_partials`), which needs its scores with tokens on M and
        D ≥ 128 (`shared_math.tiling.int2_decode_channels_on_m`); None → on where it applies (faster:
        DECISIONS.md D5), True → on or ValueError, False → the
        values' dot with the rows on M.
    All launch keywords resolve into one `shared_math.tiling.DecodeLaunch`
    (`shared_math.tiling.resolve_decode_launch`, shared with oscar_jax), validated there.
    Returns:
      float32 [B, Hq, D].
    """
    check_tensor("q", q, dtypes=QUERY_DTYPES, shape=(None, None, None))
    batch, q_heads, head_dim = q.shape
    cache = (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
             bf16_page_table, sink_tokens, recent_tokens, history_page_table, history_tokens)
    tiling, page_size = _resolve_tiling(pages_per_split, pages_per_block, bf16_page_table, history_page_table, k_bf16,
                                        batch=batch)
    num_kv_heads, _ = _validate_cache(
        q_heads, head_dim, batch, *cache, sink_slots=sink_slots, group_size=group_size, softmax_scale=softmax_scale,
    )
    # The INT2 tier takes its scores with tokens on M with one group per row only (G ≥ D, the form
    # measured on the H200; the Pallas kernel also takes G < D); its rows-on-M kernel is capped at
    # TRITON_INT2_MAX_REGISTERS by default (DECISIONS.md D8).
    launch = resolve_decode_launch(
        batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, group_size=group_size, page_size=page_size,
        bf16_slots=bf16_page_table.shape[1], history_slots=history_page_table.shape[1], tiling=tiling,
        compiled=not interpreting(), q_dtype=str(q.dtype), num_warps=num_warps, num_stages=num_stages,
        channels_on_m=channels_on_m, max_registers=max_registers, unpack_asm=unpack_asm, fma_asm=False,
        tokens_on_m_any_group=False, rows_on_m_max_registers=TRITON_INT2_MAX_REGISTERS,
    )
    check_devices(q=q, **dict(zip(_CACHE_NAMES, cache)))
    heads_per_kv = q_heads // num_kv_heads
    rows = max(MIN_DOT_DIM, next_power_of_two(heads_per_kv))  # GQA group padded for dot's M ≥ 16
    # Unpadded: the tier kernels read rows ≥ Gq as zero queries (kdecode.partial_rows).
    q_rows = q.reshape(batch, num_kv_heads, heads_per_kv, head_dim).contiguous()
    tiers = _tier_partials(
        q_rows, cache, sink_slots=sink_slots, group_size=group_size, softmax_scale=float(softmax_scale), block_m=rows,
        launch=launch, int2_rows=int2_decode_rows(heads_per_kv) if launch.tokens_on_m else None,
    )
    # One merge kernel over both tiers' splits, reading only the Gq kept rows of the padded ones
    # (no eager concatenate + merge: benchmarks/DECISIONS.md D18).
    if len(tiers) == 1:  # no history slots: an INT2 tier of zero splits
        tiers.append((tiers[0][0][:, :, :0], tiers[0][1][:, :, :0]))
    (o_a, lse_a), (o_b, lse_b) = tiers
    o = library.merge_tier_partials(o_a, lse_a, o_b, lse_b, heads_per_kv)  # [B, Hkv, Gq, D]
    return o.reshape(batch, q_heads, head_dim)


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
    block_m: int | None = None,
    block_n: int | None = None,
):
    """Attention of a chunk of T new tokens: causal over the chunk (full precision) + the cached prefix.

    Args:
      q: float32 or bfloat16 [B, T, Hq, D], rotated queries of the chunk.
      k_new, v_new: float32 or bfloat16 (same dtype) [B, T, Hkv, D], the chunk's own rotated K/V.
      k_bf16 … history_tokens: the cache holding the prefix before the chunk (layout as in
        `decode_attention`); every chunk token sees all of it. The prefix is read through the
        tiers exactly as decode reads it (the INT2 pages through the INT2 kernel).
      new_tokens: int32 [B], valid tokens of each chunk (default: T). Rows t ≥ new_tokens[b] are 0.
      block_m, block_n: query rows / chunk keys per block (powers of two ≥ 16; capped by the chunk);
        None → DEFAULT_PREFILL_BLOCK_M / _N (interpreted: `kernels.codec.INTERPRET_BLOCK_ROWS`).
      Other keywords as in `decode_attention`.
    Returns:
      float32 [B, T, Hq, D].
    """
    check_tensor("q", q, dtypes=QUERY_DTYPES, shape=(None, None, None, None))
    batch, chunk, q_heads, head_dim = q.shape
    check_tensor("k_new", k_new, dtypes=QUERY_DTYPES, shape=(batch, chunk, None, head_dim))
    num_kv_heads = k_new.shape[2]
    check_tensor("v_new", v_new, dtypes=(k_new.dtype,), shape=tuple(k_new.shape))
    if chunk < 1:
        raise ValueError(f"the chunk must hold at least one token, got q of shape {tuple(q.shape)}")
    cache = (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
             bf16_page_table, sink_tokens, recent_tokens, history_page_table, history_tokens)
    tiling, page_size = _resolve_tiling(pages_per_split, pages_per_block, bf16_page_table, history_page_table, k_bf16)
    cache_kv_heads, _ = _validate_cache(
        q_heads, head_dim, batch, *cache, sink_slots=sink_slots, group_size=group_size, softmax_scale=softmax_scale,
    )
    launch = prefill_launch(*tiling, page_size)
    if num_kv_heads != cache_kv_heads:
        raise ValueError(f"k_new has {num_kv_heads} KV heads but the cache has {cache_kv_heads}")
    if new_tokens is None:
        new_tokens = torch.full((batch,), chunk, dtype=torch.int32, device=q.device)
    check_tensor("new_tokens", new_tokens, dtypes=_INT32, shape=(batch,))
    block_m = default_block_rows(DEFAULT_PREFILL_BLOCK_M) if block_m is None else block_m
    block_n = default_block_rows(DEFAULT_PREFILL_BLOCK_N) if block_n is None else block_n
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        check_static_int(name, value, power_of_two=True, minimum=MIN_DOT_DIM)
    check_devices(q=q, k_new=k_new, v_new=v_new, new_tokens=new_tokens, **dict(zip(_CACHE_NAMES, cache)))
    softmax_scale = float(softmax_scale)

    heads_per_kv = q_heads // num_kv_heads
    rows = chunk * heads_per_kv
    block_m = min(block_m, max(MIN_DOT_DIM, next_power_of_two(rows)))
    padded_rows = -(-rows // block_m) * block_m
    block_n = min(block_n, max(MIN_DOT_DIM, next_power_of_two(chunk)))
    padded_chunk = -(-chunk // block_n) * block_n

    # Rows of KV head h, token-major: r = t·Gq + g.
    q_rows = q.reshape(batch, chunk, num_kv_heads, heads_per_kv, head_dim).permute(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_dim)
    q_rows = torch.nn.functional.pad(q_rows, (0, 0, 0, padded_rows - rows)).contiguous()
    prefix_outputs, prefix_lses = _cache_partials(
        q_rows, cache, sink_slots=sink_slots, group_size=group_size, softmax_scale=softmax_scale, block_m=block_m,
        launch=launch,
    )

    chunk_dtype = torch.promote_types(q.dtype, k_new.dtype)  # the chunk stays in full precision
    k_chunk, v_chunk = (
        torch.nn.functional.pad(x.permute(0, 2, 1, 3), (0, 0, 0, padded_chunk - chunk)).to(chunk_dtype).contiguous()
        for x in (k_new, v_new)
    )  # [B, Hkv, T_pad, D]
    self_outputs, self_lses = library.causal_chunk_partials(
        q_rows.to(chunk_dtype), k_chunk, v_chunk, new_tokens, heads_per_kv, softmax_scale, block_m, block_n,
    )
    o, _ = merge_partials(
        torch.cat([prefix_outputs, self_outputs], dim=2)[..., :rows, :],
        torch.cat([prefix_lses, self_lses], dim=2)[..., :rows],
    )
    o = o.reshape(batch, num_kv_heads, chunk, heads_per_kv, head_dim).permute(0, 2, 1, 3, 4)
    o = o.reshape(batch, chunk, q_heads, head_dim)
    valid_rows = torch.arange(chunk, device=q.device)[None, :] < new_tokens[:, None]  # ragged chunks
    return torch.where(valid_rows[:, :, None, None], o, torch.zeros_like(o))
