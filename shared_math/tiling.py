"""Tiling policy of the decode / prefill attention kernels (split-K) and the fused write, and the
encode kernels' choice of order statistic for the clip threshold, shared by both runtimes.

Not part of format v1 (it changes no byte); one module so that the Pallas and Triton kernels run
the same tiling by default and the parity backend is timed like for like.

The split-K defaults (about TARGET_SPLITS splits, one page per inner iteration) trade parallel
programs against partial outputs to write and merge ([B, Hkv, S, 16, D] float32). Every default
here names its measurement in benchmarks/DECISIONS.md (rows D1–D18, W1–W5, C1).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from shared_math.float_bits import FP16_MAX_BITS
from shared_math.ptx import BYTES_PER_PAIR
from shared_math.spec import CODES_PER_BYTE

CHANNELS_PER_PAIR_ROW = CODES_PER_BYTE * BYTES_PER_PAIR  # channels a row of 16-bit code pairs holds

TARGET_SPLITS = 128  # splits of the longer page table (INT2 history, or BF16 in a BF16-only cache), about
MIN_TOKENS_PER_SPLIT = 256  # … but no split shorter than this
MIN_DOT_DIM = 16  # M, N, K of a tensor-core dot tile: a block holds at least this many tokens
MERGE_BLOCK_SPLITS = 32  # splits per load of the decode merge kernels …
MERGE_BLOCK_D = 32  # … and columns per merge program: [32, 32] float32 = 4 KB per load; D / 32
#                     programs per kept row, so a batch-1 merge fills more than 32 SMs

# The attention kernels keep scores in base-2 units (softmax scale × log2 e), so that every
# exponential of the online softmax is an exp2: on the GPU one MUFU.EX2, where Pallas's jnp.exp
# lowers to libdevice's accurate __nv_expf, several instructions per element (DECISIONS.md D12).
# The partials' log-sum-exp stays a natural log: lse = (m + log2 l)·ln 2.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def base2_score_scale(softmax_scale: float) -> float:
    """The factor the attention kernels multiply raw q·k by: the softmax scale in base-2 units."""
    return float(softmax_scale) * LOG2E


def next_power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def default_pages_per_block(page_size: int) -> int:
    """Pages per inner iteration: one whole page when it fills a dot tile, else enough pages
    for MIN_DOT_DIM tokens."""
    return max(1, MIN_DOT_DIM // page_size) if isinstance(page_size, int) and page_size > 0 else 1


def default_pages_per_split(table_slots: int, pages_per_block: int, page_size: int) -> int:
    """≈ table_slots / TARGET_SPLITS and ≥ MIN_TOKENS_PER_SPLIT tokens: a power of two
    ≥ pages_per_block. `table_slots` is the longer of a sequence's two page tables: the history
    table in an OSCAR cache, the BF16 table in a cache with no INT2 tier (the BF16 baseline,
    DECISIONS.md D3)."""
    floor = -(-MIN_TOKENS_PER_SPLIT // max(page_size, 1))
    return max(pages_per_block, next_power_of_two(max(floor, -(-table_slots // TARGET_SPLITS))))


# A decode call's INT2 tier with many sequences takes fewer, longer splits: each split costs a
# program's prologue and a partial row to write and merge, worth paying only while the grid needs
# the programs to fill the SMs. The split doubles from default_pages_per_split's while B × Hkv ×
# splits stays ≥ INT2_DECODE_MIN_PROGRAMS (≈ one wave of one-warp programs at 8 per SM on the H200's
# 132) and the split ≤ INT2_DECODE_MAX_SPLIT_TOKENS. Longer splits win at batch 8 and 32; at batch 1
# they leave the grid too few programs (DECISIONS.md D2).
INT2_DECODE_MIN_PROGRAMS = 1024
INT2_DECODE_MAX_SPLIT_TOKENS = 2048


def decode_pages_per_split(history_slots: int, pages_per_block: int, page_size: int, sequence_heads: int) -> int:
    """The INT2 tier's split of a decode call over `sequence_heads` = B × Hkv (sequence, KV head)
    pairs: default_pages_per_split's, doubled while the grid keeps ≥ INT2_DECODE_MIN_PROGRAMS
    programs and a split ≤ INT2_DECODE_MAX_SPLIT_TOKENS tokens."""
    split = default_pages_per_split(history_slots, pages_per_block, page_size)
    while (split < history_slots and 2 * split * page_size <= INT2_DECODE_MAX_SPLIT_TOKENS
           and sequence_heads * num_splits(history_slots, 2 * split) >= INT2_DECODE_MIN_PROGRAMS):
        split *= 2
    return split


def interpreted_tiling(table_slots: int, page_size: int, block_tokens: int) -> tuple[int, int]:
    """(pages_per_split, pages_per_block) of an interpreted (CPU) call whose tiling is left to the
    default: one split of blocks of up to `block_tokens` tokens (never smaller than
    default_pages_per_block, never more pages than the table's next power of two). An interpreter
    pays per program and per inner iteration, not per byte, so the GPU's many small programs are
    its slowest tiling; each runtime picks `block_tokens` against its interpreter's compile cost
    (oscar_jax.kernels.codec.INTERPRET_BLOCK_TOKENS, oscar_torch.kernels.codec.INTERPRET_BLOCK_ROWS)."""
    slots = max(table_slots, 1)
    pages_per_block = max(default_pages_per_block(page_size),
                          min(next_power_of_two(slots), max(1, block_tokens // page_size)))
    return pages_per_block * -(-slots // pages_per_block), pages_per_block


def bf16_tier_pages_per_split(bf16_slots: int, history_slots: int, pages_per_split: int, pages_per_block: int) -> int:
    """Pages per program of the BF16 tier. Without an INT2 tier it holds the context and takes the
    cache's split (`pages_per_split`). Beside an INT2 tier its table holds only the sink and recent
    pages (5 at the defaults with pages of 64): ≈ bf16_slots / TARGET_SPLITS with no token floor, so
    those few pages are read by parallel programs instead of one serial chain of them
    (DECISIONS.md D3)."""
    if history_slots == 0:
        return pages_per_split
    return max(pages_per_block, next_power_of_two(-(-bf16_slots // TARGET_SPLITS)))


def whole_table_pages_per_split(table_slots: int, pages_per_block: int) -> int:
    """One split over a whole page table: its slots rounded up to whole blocks."""
    return max(1, -(-table_slots // pages_per_block)) * pages_per_block


def resolve_splits(pages_per_split, pages_per_block, bf16_slots: int, history_slots: int,
                   page_size: int, sequence_heads: int | None = None, prefill: bool = False) -> tuple:
    """(pages_per_split, bf16_pages_per_split, pages_per_block) of a decode / prefill call, the
    defaults filled in for None: the block from the page size, the split from the longer page
    table — for a prefill call (`prefill`) one split over the whole table: a chunk's row blocks
    already fill the grid, and splits by the table only size partials to write and merge
    (DECISIONS.md P2); for a decode call with an INT2 tier (`sequence_heads` = B × Hkv given) by
    decode_pages_per_split — the BF16 tier's split by bf16_tier_pages_per_split. Values that are
    not positive integers are passed through untouched for the backend's validation to name."""
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(page_size)
    given = (pages_per_block,) if pages_per_split is None else (pages_per_block, pages_per_split)
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1 for x in given):
        return pages_per_split, pages_per_split, pages_per_block
    if pages_per_split is None and prefill:
        pages_per_split = whole_table_pages_per_split(max(bf16_slots, history_slots), pages_per_block)
    elif pages_per_split is None and sequence_heads and history_slots and history_slots >= bf16_slots:
        pages_per_split = decode_pages_per_split(history_slots, pages_per_block, page_size, sequence_heads)
    elif pages_per_split is None:
        pages_per_split = default_pages_per_split(max(bf16_slots, history_slots), pages_per_block, page_size)
    return (pages_per_split, bf16_tier_pages_per_split(bf16_slots, history_slots, pages_per_split, pages_per_block),
            pages_per_block)


# Tokens per program of the fused write when it rotates bfloat16 rows (three bf16 products per
# block, the parts read once per program): enough tokens to amortise splitting R, few enough to keep
# the program's registers (DECISIONS.md W1).
SPLIT_ROTATION_BLOCK_TOKENS = 64

# Launch of the decode tier kernels, both backends, with rows on the dots' M (the BF16 tier; the INT2
# tier where it cannot take tokens on M): 3 pipeline stages, and 2 warps per program once the tier
# has enough programs (B × Hkv × splits) to fill the SMs with them, else 4. The batched kernel is
# latency-bound: 2-warp programs, more of them per SM, keep more loads in flight; a grid under ~2
# programs an SM needs wider ones (DECISIONS.md D7).
DECODE_NUM_WARPS = 2
DECODE_FEW_PROGRAMS_NUM_WARPS = 4
DECODE_TWO_WARPS_MIN_PROGRAMS = 512  # ≈ 4 per SM on the H200's 132
DECODE_NUM_STAGES = 3


# The INT2 tier's decode scores with the tokens on the dot's M ([L, rows], the codes as its A
# operand) and the GQA rows on its N, padded to INT2_DECODE_MIN_ROWS (mma's n8) instead of 16, in
# one-warp programs: fewer instructions per (token, KV head) — no cross-warp reductions, q's
# fragments reused over a page's tokens. Only on a grid of at least DECODE_TWO_WARPS_MIN_PROGRAMS
# INT2 programs, though: one-warp programs leave a smaller grid's SMs short of warps
# (DECISIONS.md D4).
INT2_DECODE_MIN_ROWS = 8
INT2_DECODE_NUM_WARPS = 1


def int2_decode_tokens_on_m(batch: int, num_kv_heads: int, history_slots: int, pages_per_split: int,
                            page_size: int) -> bool:
    """Whether a decode call's INT2 tier takes its scores with tokens on M in one-warp programs:
    whole pages of ≥ MIN_DOT_DIM tokens and a grid of ≥ DECODE_TWO_WARPS_MIN_PROGRAMS programs;
    otherwise rows on M at default_decode_num_warps."""
    programs = batch * num_kv_heads * num_splits(history_slots, pages_per_split)
    return page_size >= MIN_DOT_DIM and programs >= DECODE_TWO_WARPS_MIN_PROGRAMS


# The INT2 tier's values dot transposed, oᵀ = Vᵀ·(p·s_v): the channels on the dot's M (head_dim /
# (CODES_PER_BYTE · BYTES_PER_PAIR) rows of 16-bit code pairs, read by ldmatrix.trans) and the query
# rows on N, where the scores run with tokens on M: fewer instructions a page and fewer registers
# than the rows on M (DECISIONS.md D5).
def int2_decode_channels_on_m(tokens_on_m: bool, group_size: int, head_dim: int) -> bool:
    """Whether the INT2 tier's values dot can run with the channels on M (`channels_on_m`): its
    scores with tokens on M, one group per row (G ≥ D) and a dot M of head_dim / 8 ≥ MIN_DOT_DIM."""
    return bool(tokens_on_m) and group_size >= head_dim and head_dim // CHANNELS_PER_PAIR_ROW >= MIN_DOT_DIM


def int2_decode_rows(heads_per_kv: int) -> int:
    """Query rows of the INT2 tier's decode programs: the GQA group padded to a power of two ≥
    INT2_DECODE_MIN_ROWS (the rows of the other kernels pad to MIN_DOT_DIM)."""
    return max(INT2_DECODE_MIN_ROWS, next_power_of_two(heads_per_kv))


# The BF16 tier's kernel streams bf16 pages near copy bandwidth and is slower at 3 stages than at 2
# (DECISIONS.md D9).
BF16_TIER_NUM_STAGES = 2


def num_splits(table_slots: int, pages_per_split: int) -> int:
    """Splits a tier's page table is cut into (at least one, so every tier writes a partial)."""
    return max(1, math.ceil(table_slots / pages_per_split))


def default_decode_num_warps(batch: int, num_kv_heads: int, table_slots: int, pages_per_split: int) -> int:
    """Warps per decode program of a tier with `table_slots` page slots per sequence: DECODE_NUM_WARPS
    from DECODE_TWO_WARPS_MIN_PROGRAMS programs, else DECODE_FEW_PROGRAMS_NUM_WARPS (a small grid
    needs wider programs to fill the SMs)."""
    programs = batch * num_kv_heads * num_splits(table_slots, pages_per_split)
    return DECODE_NUM_WARPS if programs >= DECODE_TWO_WARPS_MIN_PROGRAMS else DECODE_FEW_PROGRAMS_NUM_WARPS


def default_decode_launch(batch: int, num_kv_heads: int, bf16_slots: int, history_slots: int,
                          bf16_pages_per_split: int, pages_per_split: int, *,
                          int2_tokens_on_m: bool = True) -> tuple[tuple[int, int], tuple[int, int]]:
    """(num_warps, num_stages) of the BF16 tier's kernel and of the INT2 tier's: the BF16 tier's
    warps from its program count (its slots over its split) and BF16_TIER_NUM_STAGES; the INT2
    tier's DECODE_NUM_STAGES and, with its scores on tokens × rows (`int2_tokens_on_m`),
    INT2_DECODE_NUM_WARPS, else warps from its own program count."""
    int2_warps = (INT2_DECODE_NUM_WARPS if int2_tokens_on_m
                  else default_decode_num_warps(batch, num_kv_heads, history_slots, pages_per_split))
    return ((default_decode_num_warps(batch, num_kv_heads, bf16_slots, bf16_pages_per_split), BF16_TIER_NUM_STAGES),
            (int2_warps, DECODE_NUM_STAGES))


# Triton's maxnreg for its rows-on-M INT2 tier kernel: 128 registers fit 8 two-warp programs an SM
# instead of 6, at the price of a few spilled bytes (DECISIONS.md D8). The Pallas kernel is not
# capped in that layout (not measured capped); its register use came down from the source instead
# (each plane unpacked next to its MMA).
TRITON_INT2_MAX_REGISTERS = 128
# The INT2 tier kernel with its scores and values' dot transposed (tokens and channels on M), both
# backends: XLA's compile of the Pallas kernel holds more registers uncapped than the Triton
# backend's kernel, so fewer one-warp programs fit an SM; capped at 160 both fit 12 (outputs
# bit-identical), and both run faster for it (DECISIONS.md D6). Pallas takes the cap only where the
# user opts in (`oscar_jax.kernels.register_cap`, a patch of a private JAX function): its
# resolve_decode_launch call passes register_caps=False otherwise.
INT2_CHANNELS_ON_M_MAX_REGISTERS = 160
MIN_MAX_REGISTERS = 32  # a cap below it leaves a kernel little but spills


def int2_decode_max_registers(tokens_on_m: bool, channels_on_m: bool, rows_on_m: int) -> int:
    """The INT2 tier kernel's default register cap (0: the compiler's choice): with the tokens and
    channels on M INT2_CHANNELS_ON_M_MAX_REGISTERS, with the tokens on M only the compiler's choice,
    with the rows on M the backend's `rows_on_m` (Triton: TRITON_INT2_MAX_REGISTERS; Pallas: 0, not
    measured capped)."""
    if tokens_on_m:
        return INT2_CHANNELS_ON_M_MAX_REGISTERS if channels_on_m else 0
    return rows_on_m


def check_max_registers(max_registers) -> int:
    """A register cap as both backends take it: 0 (the compiler's choice) or an integer ≥ 32."""
    if isinstance(max_registers, bool) or not isinstance(max_registers, int) or not (
            max_registers == 0 or max_registers >= MIN_MAX_REGISTERS):
        raise ValueError(f"max_registers={max_registers!r} must be 0 (the compiler's choice) or an integer "
                         f">= {MIN_MAX_REGISTERS}")
    return int(max_registers)


# A tier kernel's launch where no policy applies (prefill's cache partials, a launcher's default).
TIER_NUM_WARPS = 4
TIER_NUM_STAGES = 2


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value, *, minimum: int = 0, power_of_two: bool = False) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two")


def _check_flag(name: str, value, *, optional: bool = False, strict: bool = True) -> None:
    """A bool (`strict`: of type bool, else also 0 / 1), or None where `optional`."""
    ok = isinstance(value, bool) if strict else value in (True, False)
    if not ok and not (optional and value is None):
        raise ValueError(f"{name}={value!r} must be a bool{' or None' if optional else ''}")


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """How the tier kernels of one attention call are launched: one object for both backends, built
    by `resolve_decode_launch` (decode) or `prefill_launch` and checked here, so that the kernels'
    launchers take it as it is. Hashable: a static argument of a jitted function.

    pages_per_split       pages a program of the tier that holds the context (the INT2 tier, or the
                          BF16 tier of a cache without one), a multiple of pages_per_block
    bf16_pages_per_split  pages a program of the BF16 tier (bf16_tier_pages_per_split), ditto
    pages_per_block       pages an inner iteration of both tiers (a power of two)
    bf16_num_warps, bf16_num_stages, int2_num_warps, int2_num_stages
                          each tier kernel's Triton launch (warps a power of two, stages ≥ 1)
    tokens_on_m           the INT2 tier's scores as [page tokens, rows], its rows int2_decode_rows (D4)
    channels_on_m         … and its values' dot as oᵀ = Vᵀ·p (needs tokens_on_m; D5)
    max_registers         the INT2 tier kernel's register cap, 0: the compiler's choice (D6, D8)
    unpack_asm            the INT2 codes unpacked by inline PTX (compiled kernels, bfloat16 q; D10)
    fma_asm               the INT2 loop's multiply-adds as inline-PTX fmas (compiled Pallas; D14)
    """

    pages_per_split: int
    bf16_pages_per_split: int
    pages_per_block: int
    bf16_num_warps: int = TIER_NUM_WARPS
    bf16_num_stages: int = TIER_NUM_STAGES
    int2_num_warps: int = TIER_NUM_WARPS
    int2_num_stages: int = TIER_NUM_STAGES
    tokens_on_m: bool = False
    channels_on_m: bool = False
    max_registers: int = 0
    unpack_asm: bool = False
    fma_asm: bool = False

    def __post_init__(self):
        _check_int("pages_per_block", self.pages_per_block, minimum=1, power_of_two=True)
        for name in ("pages_per_split", "bf16_pages_per_split"):
            split = getattr(self, name)
            _check_int(name, split, minimum=1)
            if self.pages_per_block > split:
                raise ValueError(f"pages_per_block={self.pages_per_block} must not exceed {name}={split}")
            if split % self.pages_per_block:
                raise ValueError(f"{name}={split} must be a multiple of pages_per_block={self.pages_per_block}")
        for name in ("bf16_num_warps", "int2_num_warps"):
            _check_int(name, getattr(self, name), minimum=1, power_of_two=True)
        for name in ("bf16_num_stages", "int2_num_stages"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("tokens_on_m", "channels_on_m", "unpack_asm", "fma_asm"):
            _check_flag(name, getattr(self, name))
        check_max_registers(self.max_registers)
        if self.channels_on_m and not self.tokens_on_m:
            raise ValueError("channels_on_m=True needs tokens_on_m=True (the values' dot transposed takes the "
                             "scores with the tokens on M)")


def check_tiling(pages_per_split, pages_per_block, page_size: int) -> None:
    """The user's pages_per_split / pages_per_block (after resolve_splits): a ValueError naming the
    first bad one. A block holds at least MIN_DOT_DIM tokens (a dot tile)."""
    _check_int("pages_per_block", pages_per_block, minimum=1, power_of_two=True)
    _check_int("pages_per_split", pages_per_split, minimum=1)
    if pages_per_block > pages_per_split:
        raise ValueError(f"{pages_per_block=} must not exceed {pages_per_split=}")
    if pages_per_split % pages_per_block:
        raise ValueError(f"{pages_per_split=} must be a multiple of {pages_per_block=}")
    if pages_per_block * page_size < MIN_DOT_DIM:
        raise ValueError(f"{pages_per_block=} × page size {page_size} must be >= {MIN_DOT_DIM} tokens (dot tile)")


def resolve_tiling(pages_per_split, pages_per_block, *, bf16_slots: int, history_slots: int, page_size: int,
                   sequence_heads: int | None = None, interpret_block_tokens: int | None = None,
                   prefill: bool = False) -> tuple:
    """(pages_per_split, bf16_pages_per_split, pages_per_block) of a call, the defaults filled in by
    resolve_splits (`sequence_heads` = B × Hkv for a decode call; `prefill` for a prefill call). `interpret_block_tokens` (an
    interpreted call): with both left to the default, interpreted_tiling's one split of blocks of up
    to that many tokens. Bad values pass through for check_tiling to name."""
    if interpret_block_tokens and pages_per_split is None and pages_per_block is None and page_size > 0:
        pages_per_split, pages_per_block = interpreted_tiling(
            max(bf16_slots, history_slots), page_size, interpret_block_tokens)
    return resolve_splits(pages_per_split, pages_per_block, bf16_slots, history_slots, page_size, sequence_heads,
                          prefill)


def prefill_launch(pages_per_split: int, bf16_pages_per_split: int, pages_per_block: int, page_size: int, *,
                   fma_asm: bool = False) -> DecodeLaunch:
    """The launch of a prefill call's cache partials: its tiling (checked), both tiers at
    TIER_NUM_WARPS / TIER_NUM_STAGES, the INT2 tier with its rows on M, uncapped."""
    check_tiling(pages_per_split, pages_per_block, page_size)
    return DecodeLaunch(int(pages_per_split), int(bf16_pages_per_split), int(pages_per_block), fma_asm=bool(fma_asm))


def resolve_decode_launch(
    *, batch: int, num_kv_heads: int, head_dim: int, group_size: int, page_size: int, bf16_slots: int,
    history_slots: int, tiling: tuple, compiled: bool, q_dtype: str, num_warps=None, num_stages=None,
    channels_on_m=None, max_registers=None, unpack_asm=None, fma_asm=None, tokens_on_m_any_group: bool = True,
    rows_on_m_max_registers: int = 0, register_caps: bool = True,
) -> DecodeLaunch:
    """The DecodeLaunch of a decode call, both backends: `tiling` = resolve_tiling's (checked here),
    each knob the caller's or, for None, this module's policy (DECISIONS.md D4–D10, D14):

      num_warps, num_stages  both tiers' when given (warps a power of two, stages ≥ 1); else
                             default_decode_launch's, by each tier's program count and layout
      tokens_on_m            int2_decode_tokens_on_m (and G ≥ D unless `tokens_on_m_any_group`)
      channels_on_m          None → where int2_decode_channels_on_m applies; True where it does not
                             is a ValueError
      max_registers          None → int2_decode_max_registers (rows on M: `rows_on_m_max_registers`),
                             0 without `register_caps` (a backend that cannot cap now)
      unpack_asm             None → compiled with bfloat16 q (`q_dtype`, the query dtype's name);
                             True elsewhere is a ValueError (an interpreter cannot run PTX)
      fma_asm                None → compiled; True interpreted is a ValueError
    """
    pages_per_split, bf16_pages_per_split, pages_per_block = tiling
    check_tiling(pages_per_split, pages_per_block, page_size)
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None:
            _check_int(name, value, minimum=1, power_of_two=name == "num_warps")
    _check_flag("channels_on_m", channels_on_m, optional=True)
    for name, value in (("unpack_asm", unpack_asm), ("fma_asm", fma_asm)):
        _check_flag(name, value, optional=True, strict=False)
    if max_registers is not None:
        check_max_registers(max_registers)
    interpret = not compiled
    q_bf16 = "bfloat16" in str(q_dtype)
    if unpack_asm is None:
        unpack_asm = compiled and q_bf16
    if unpack_asm and (interpret or not q_bf16):
        raise ValueError(f"unpack_asm=True runs inline PTX on bfloat16 queries on the GPU; got q {q_dtype} and "
                         f"interpret={interpret} (interpret mode cannot run PTX)")
    if fma_asm is None:
        fma_asm = compiled
    if fma_asm and interpret:
        raise ValueError("fma_asm=True runs inline PTX on the GPU; interpret mode cannot run PTX (interpret=True)")
    tokens_on_m = (tokens_on_m_any_group or group_size >= head_dim) and int2_decode_tokens_on_m(
        batch, num_kv_heads, history_slots, pages_per_split, page_size)
    channels_applies = int2_decode_channels_on_m(tokens_on_m, group_size, head_dim)
    if channels_on_m is None:
        channels_on_m = channels_applies
    if channels_on_m and not channels_applies:
        raise ValueError("channels_on_m=True needs the INT2 tier's tokens-on-M layout with one group per row (pages "
                         f"of >= {MIN_DOT_DIM} tokens, a grid of >= {DECODE_TWO_WARPS_MIN_PROGRAMS} programs, "
                         f"G >= D >= {MIN_DOT_DIM * CHANNELS_PER_PAIR_ROW}); this call has {group_size=}, "
                         f"{head_dim=}, {batch=}")
    if max_registers is None:
        max_registers = (int2_decode_max_registers(tokens_on_m, channels_on_m, rows_on_m=rows_on_m_max_registers)
                         if register_caps else 0)
    (bf16_warps, bf16_stages), (int2_warps, int2_stages) = default_decode_launch(
        batch, num_kv_heads, bf16_slots, history_slots, bf16_pages_per_split, pages_per_split,
        int2_tokens_on_m=tokens_on_m)
    if num_warps is not None:
        bf16_warps = int2_warps = int(num_warps)
    if num_stages is not None:
        bf16_stages = int2_stages = int(num_stages)
    return DecodeLaunch(
        pages_per_split=int(pages_per_split), bf16_pages_per_split=int(bf16_pages_per_split),
        pages_per_block=int(pages_per_block), bf16_num_warps=bf16_warps, bf16_num_stages=bf16_stages,
        int2_num_warps=int2_warps, int2_num_stages=int2_stages, tokens_on_m=bool(tokens_on_m),
        channels_on_m=bool(channels_on_m), max_registers=int(max_registers), unpack_asm=bool(unpack_asm),
        fma_asm=bool(fma_asm))


# The clip threshold τ (the k-th smallest |x| of a row, exact; shared_math.codec.clip_rows) is found
# in the encode kernels without a sort, on the int32 bit patterns of |x|, by one of:
#   max_drop     d − k rounds of a row max and a count of its copies (any rows);
#   bisect       BISECTION_STEPS counts over the candidate patterns (any rows);
#   tagged_max   d − k rounds of a row max over keys |x| bits | column, unique, so no count is
#                needed: for rows that hold bfloat16 values, whose low BF16_DROPPED_BITS are free;
#   checked_max  d − k rounds of a row max over distinct values and one count that proves no tie
#                hid among the largest; a block where one did redoes τ by max_drop (for float32
#                rows, e.g. rotated keys, where ties are rare; bfloat16 rows tie often).
ORDER_STATISTICS = ("max_drop", "bisect", "tagged_max", "checked_max")
# Bisection over the candidates 0 … FP16_MAX_BITS halves the interval each step: ceil(log2(
# FP16_MAX_BITS + 1)) steps leave one candidate.
BISECTION_STEPS = FP16_MAX_BITS.bit_length()


def order_statistic_reductions(method: str, head_dim: int, clip_index: int) -> int:
    """Row reductions a method spends on τ (checked_max: without its rare fallback)."""
    rounds = head_dim - clip_index
    costs = {"max_drop": 2 * rounds, "bisect": BISECTION_STEPS, "tagged_max": rounds, "checked_max": rounds + 1}
    if method not in costs:
        raise ValueError(f"order_statistic={method!r} must be one of {ORDER_STATISTICS}")
    return costs[method]


def select_order_statistic(head_dim: int, clip_index: int, rows_bf16: bool) -> str:
    """The exact method for τ with the fewest row reductions. `rows_bf16`: the encoded rows hold
    bfloat16 values (bfloat16 input, not rotated in the kernel), so tagged_max applies."""
    candidates = ("tagged_max", "bisect") if rows_bf16 else ("checked_max", "bisect")
    return min(candidates, key=lambda m: order_statistic_reductions(m, head_dim, clip_index))


def encode_planes_applies(head_dim: int, group_size: int, levels: str) -> bool:
    """Whether the kernels' `encode_planes` (the encode's common case, rows read as their four
    quarter planes; DECISIONS.md W3) can encode these rows: one group a row, min/max levels."""
    return levels == "minmax" and group_size == head_dim


# Rows (tokens) per program of the encode by planes: the codec's encode_rows and the unrotated
# write; the fastest of 16 / 32 / 64 rows in both backends (DECISIONS.md W4).
ENCODE_PLANES_BLOCK_ROWS = 32
# ... and at least 4: at 2 rows a program the Triton lowering's layout of the [2, Q] planes spills
# (sm_90; 1 row and 4 to 64 rows do not). Extra rows are masked.
ENCODE_PLANES_MIN_BLOCK_ROWS = 4


def planes_block_rows(rows: int, planes: bool) -> int:
    """A launch's rows a program (a power of two) as encode_planes takes them."""
    return max(rows, ENCODE_PLANES_MIN_BLOCK_ROWS) if planes else rows


def resolve_encode_planes(planes: bool | None, head_dim: int, group_size: int, levels: str,
                          rotated: bool = False, rows_bf16: bool = False) -> bool:
    """The launchers' `planes`: None (the default) takes encode_planes wherever it applies to rows
    the kernel does not rotate — faster than encode_block and the same bytes (DECISIONS.md W3) —;
    True insists (check_encode_planes' ValueError where it does not apply), and also takes it for
    bfloat16 rows the kernel rotates (the split rotation by columns: the same bytes, faster in one
    backend and slower in the other, so not the default: DECISIONS.md W5); False never takes it."""
    if planes is None:
        return encode_planes_applies(head_dim, group_size, levels) and not rotated
    if not isinstance(planes, bool):
        raise ValueError(f"planes={planes!r} must be None (where it applies), True or False")
    if planes:
        check_encode_planes(head_dim, group_size, levels, rotated, rows_bf16)
    return planes


def check_encode_planes(head_dim: int, group_size: int, levels: str, rotated: bool = False,
                        rows_bf16: bool = False) -> None:
    """The launchers' check of `planes=True`: a ValueError naming what does not apply. Rows the
    kernel rotates take planes only as bfloat16 rows: their split rotation's products are computed
    plane by plane (four column blocks of R_K); float32 rows' IEEE product is one [R, D] product."""
    if not encode_planes_applies(head_dim, group_size, levels):
        raise ValueError(f"planes=True needs group_size == head_dim and levels='minmax', got "
                         f"{group_size=}, {head_dim=}, {levels=}")
    if rotated and not rows_bf16:
        raise ValueError("planes=True with a rotation needs bfloat16 rows (the split rotation, computed "
                         "plane by plane); got float32 rows: pass rotation=None or bfloat16 rows")


def resolve_order_statistic(order_statistic: str | None, head_dim: int, clip_index: int, *, rows_bf16: bool,
                            rows: str) -> str:
    """The encode launchers' order statistic: `None` picks select_order_statistic's; an explicit
    one is validated. `rows` describes the encoded rows for the error message."""
    if order_statistic is None:
        return select_order_statistic(head_dim, clip_index, rows_bf16)
    if order_statistic not in ORDER_STATISTICS:
        raise ValueError(f"{order_statistic=} must be one of {ORDER_STATISTICS}")
    if order_statistic == "tagged_max" and not rows_bf16:
        raise ValueError(f"order_statistic='tagged_max' needs rows of bfloat16 values, got {rows}")
    return order_statistic
