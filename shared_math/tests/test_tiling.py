"""The split-K tiling policy both runtimes use by default (shared_math.tiling)."""

import pytest

from shared_math.tiling import default_pages_per_block, default_pages_per_split


@pytest.mark.parametrize("page_size,expected", [(64, 1), (16, 1), (8, 2), (4, 4), (1, 16)])
def test_pages_per_block_fills_a_dot_tile(page_size, expected):
    assert default_pages_per_block(page_size) == expected
    assert default_pages_per_block(page_size) * page_size >= 16


@pytest.mark.parametrize(
    "history_slots,pages_per_block,page_size,expected",
    [
        (2043, 1, 64, 16),  # 128K context, pages of 64: 128 splits of 16 pages (the H200 sweep's best)
        (507, 1, 64, 4),  # 32K: the 256-token floor
        (123, 1, 64, 4),  # 8K: the floor again
        (6250, 1, 16, 64),  # 100K with pages of 16: ≈ 98 splits of 1024 tokens
        (3, 4, 16, 16),  # a short table: never below the floor, never below pages_per_block
        (0, 2, 8, 32),
    ],
)
def test_pages_per_split(history_slots, pages_per_block, page_size, expected):
    got = default_pages_per_split(history_slots, pages_per_block, page_size)
    assert got == expected
    assert got & (got - 1) == 0 and got >= pages_per_block


@pytest.mark.parametrize("history_slots,page_size,sequence_heads,expected", [
    (2043, 64, 8, 16),     # 128K b1 (Hkv 8): 1,024 programs at 16 pages, 512 at 32 (measured slower)
    (2043, 64, 64, 32),    # 128K b8: 4,096 programs at 32 pages; 64 pages would pass the token cap
    (2043, 64, 256, 32),   # 128K b32: the cap
    (507, 64, 8, 4),       # 32K b1: 1,016 programs at the floor's 4 pages, 512 at 8
    (507, 64, 64, 32),     # 32K b8: 1,024 programs at 32 pages (NOTES v20: −14 % against 4)
    (507, 64, 256, 32),    # 32K b32
    (123, 64, 8, 4),       # 8K b1: 248 programs, already too few
    (123, 64, 64, 8),      # 8K b8: 1,024 programs at 8 pages, 512 at 16
    (123, 64, 256, 32),    # 8K b32: 1,024 at 32 pages
    (6250, 16, 8, 64),     # 100K, pages of 16: 1,024 tokens a split by TARGET_SPLITS, 392 programs
    (6250, 16, 256, 128),  # … 2,048 tokens (the cap) at b32
    (0, 64, 1024, 4),      # no history: the floor
])
def test_decode_split_grows_while_the_grid_stays_full(history_slots, page_size, sequence_heads, expected):
    from shared_math.tiling import (INT2_DECODE_MAX_SPLIT_TOKENS, INT2_DECODE_MIN_PROGRAMS, decode_pages_per_split,
                                    num_splits)

    got = decode_pages_per_split(history_slots, 1, page_size, sequence_heads)
    assert got == expected
    base = default_pages_per_split(history_slots, 1, page_size)
    assert got & (got - 1) == 0 and got >= base
    if got > base:  # grown: the grid it leaves is full, the next doubling's would not be or would pass the cap
        assert sequence_heads * num_splits(history_slots, got) >= INT2_DECODE_MIN_PROGRAMS
        assert got * page_size <= INT2_DECODE_MAX_SPLIT_TOKENS
    assert (sequence_heads * num_splits(history_slots, 2 * got) < INT2_DECODE_MIN_PROGRAMS
            or 2 * got * page_size > INT2_DECODE_MAX_SPLIT_TOKENS or got >= history_slots)


@pytest.mark.parametrize("batch,history_slots,pages_per_split,expected", [
    (1, 123, 4, 4),     # 8K, b1: 8 × 31 = 248 programs, under 2 per SM
    (8, 123, 4, 2),     # 8K, b8: 1984 programs
    (1, 2043, 16, 2),   # 128K, b1: 8 × 128 = 1024 programs
    (2, 31, 1, 4),      # 496 programs: one short of …
    (2, 32, 1, 2),      # … 512
    (1, 0, 4, 4),       # no history: one (empty) split per head
])
def test_decode_num_warps_follows_the_program_count(batch, history_slots, pages_per_split, expected):
    from shared_math.tiling import default_decode_num_warps

    assert default_decode_num_warps(batch, 8, history_slots, pages_per_split) == expected


@pytest.mark.parametrize("batch,bf16_slots,history_slots,bf16_split,pages_per_split,expected", [
    (1, 6, 2043, 1, 16, ((4, 2), (2, 3))),     # 128K b1: 1024 INT2 programs, 48 BF16 ones
    (1, 6, 123, 1, 4, ((4, 2), (4, 3))),       # 8K b1: 248 INT2 programs
    (8, 512, 0, 16, 16, ((2, 2), (4, 3))),     # a BF16-only cache, 32K b8: 256 BF16 programs…
    (8, 512, 0, 4, 4, ((2, 2), (4, 3))),       # … at 4 pages a split, 1024
    (16, 6, 2043, 1, 16, ((2, 2), (2, 3))),    # b16: 768 BF16 programs of one page
])
def test_decode_launch_is_per_tier(batch, bf16_slots, history_slots, bf16_split, pages_per_split, expected):
    """Rows on M (the INT2 layout of prefill, and of decode before v15): each tier's warps from its grid."""
    from shared_math.tiling import default_decode_launch

    assert default_decode_launch(batch, 8, bf16_slots, history_slots, bf16_split, pages_per_split,
                                 int2_tokens_on_m=False) == expected


@pytest.mark.parametrize("batch,history_slots,pages_per_split", [(1, 2043, 16), (1, 123, 4), (8, 2043, 16)])
def test_decode_launch_of_the_tokens_on_m_int2_tier_is_one_warp(batch, history_slots, pages_per_split):
    from shared_math.tiling import DECODE_NUM_STAGES, INT2_DECODE_NUM_WARPS, default_decode_launch, default_decode_num_warps

    bf16, int2 = default_decode_launch(batch, 8, 6, history_slots, 1, pages_per_split)
    assert int2 == (INT2_DECODE_NUM_WARPS, DECODE_NUM_STAGES) == (1, 3)
    assert bf16[0] == default_decode_num_warps(batch, 8, 6, 1)  # the BF16 tier keeps its own


@pytest.mark.parametrize("batch,history_slots,pages_per_split,page_size,expected", [
    (1, 2043, 16, 64, True),    # 128K b1: 1024 INT2 programs
    (1, 507, 4, 64, True),      # 32K b1: 1016
    (1, 123, 4, 64, False),     # 8K b1: 248, too few for one-warp programs (NOTES v16)
    (8, 123, 4, 64, True),      # 8K b8: 1984
    (8, 2043, 16, 8, False),    # pages of 8 tokens: the gather kernel keeps rows on M
    (8, 2043, 16, 16, True),
])
def test_int2_decode_takes_tokens_on_m_on_large_grids_of_whole_pages(batch, history_slots, pages_per_split,
                                                                       page_size, expected):
    from shared_math.tiling import DECODE_TWO_WARPS_MIN_PROGRAMS, int2_decode_tokens_on_m

    assert DECODE_TWO_WARPS_MIN_PROGRAMS == 512
    assert int2_decode_tokens_on_m(batch, 8, history_slots, pages_per_split, page_size) is expected


@pytest.mark.parametrize("tokens_on_m,group_size,head_dim,expected", [
    (True, 128, 128, True),     # Qwen3-8B: the dot's M is 128 / 8 = 16 rows of code pairs
    (True, 256, 256, True),
    (False, 128, 128, False),   # rows on M: the values' dot keeps them
    (True, 64, 128, False),     # two groups a row: no per-token scale to fold into p
    (True, 64, 64, False),      # SmolLM2: M = 8 < 16
])
def test_int2_decode_channels_on_m_where_scores_take_tokens_on_m(tokens_on_m, group_size, head_dim, expected):
    from shared_math.tiling import int2_decode_channels_on_m

    assert int2_decode_channels_on_m(tokens_on_m, group_size, head_dim) is expected


@pytest.mark.parametrize("heads_per_kv,rows", [(1, 8), (3, 8), (4, 8), (8, 8), (9, 16), (16, 16)])
def test_int2_decode_rows_pad_the_group_to_mma_n(heads_per_kv, rows):
    from shared_math.tiling import int2_decode_rows

    assert int2_decode_rows(heads_per_kv) == rows


@pytest.mark.parametrize("given,bf16_slots,history_slots,page_size,expected", [
    ((None, None), 6, 2043, 64, (16, 1, 1)),       # 128K: the sink + recent pages one per program
    ((None, None), 5, 1558, 64, (16, 1, 1)),       # the e2e step's 100K
    ((None, None), 1563, 0, 64, (16, 16, 1)),      # a BF16-only cache: its table holds the context
    ((None, None), 300, 4000, 64, (32, 4, 1)),     # a long recent window: ≈ 300 / TARGET_SPLITS, power of two
    ((None, None), 21, 60, 8, (32, 2, 2)),         # pages of 8: blocks of 2 pages (the dot tile), 256 tokens a split
    ((8, None), 6, 2043, 64, (8, 1, 1)),           # an explicit split is the INT2 tier's
    ((6, 2), 21, 60, 32, (6, 2, 2)),               # … of any multiple of the block
    ((8, None), 130, 0, 64, (8, 8, 1)),            # … or the BF16-only cache's
])
def test_resolve_splits(given, bf16_slots, history_slots, page_size, expected):
    from shared_math.tiling import resolve_splits

    assert resolve_splits(*given, bf16_slots, history_slots, page_size) == expected


@pytest.mark.parametrize("given,bf16_slots,history_slots,sequence_heads,expected", [
    ((None, None), 6, 2043, 64, (32, 1, 1)),       # decode, 128K b8: the INT2 split follows the batch
    ((None, None), 6, 2043, 8, (16, 1, 1)),        # … b1: unchanged
    ((None, None), 1563, 0, 256, (16, 16, 1)),     # a BF16-only cache keeps the split by length (not measured)
    ((None, None), 300, 200, 1024, (4, 4, 1)),     # a BF16 table longer than the history: likewise
    ((8, None), 6, 2043, 256, (8, 1, 1)),          # an explicit split is kept
])
def test_resolve_splits_of_a_decode_call(given, bf16_slots, history_slots, sequence_heads, expected):
    from shared_math.tiling import resolve_splits

    assert resolve_splits(*given, bf16_slots, history_slots, 64, sequence_heads) == expected


@pytest.mark.parametrize("pages_per_split,pages_per_block", [(0, 1), (-4, 1), (True, 1), (2.0, 1), (None, 0),
                                                             (None, "1")])
def test_resolve_splits_passes_bad_values_through(pages_per_split, pages_per_block):
    """A bad value reaches the backend's validation unchanged, so that its error names it."""
    from shared_math.tiling import resolve_splits

    split, bf16_split, block = resolve_splits(pages_per_split, pages_per_block, 6, 2043, 64)
    assert (split, bf16_split, block) == (pages_per_split, pages_per_split, pages_per_block)


@pytest.mark.parametrize("table_slots,page_size,block_tokens,expected", [
    (600, 16, 64, (600, 4)),  # JAX's interpreter: blocks of 64 tokens, one split
    (40, 16, 512, (64, 32)),  # torch's: the block capped by the table's next power of two
    (27, 64, 512, (32, 8)),  # the split a whole number of blocks
    (5, 4, 8, (8, 4)),  # never below default_pages_per_block (16 tokens of 4-token pages)
    (0, 16, 64, (1, 1)),  # an empty table still gets one page
])
def test_interpreted_tiling_is_one_split_of_big_blocks(table_slots, page_size, block_tokens, expected):
    from shared_math.tiling import interpreted_tiling

    assert interpreted_tiling(table_slots, page_size, block_tokens) == expected


def test_decode_launch_fits_more_programs_per_sm():
    """The Triton register cap fits 8 decode programs in one sm_90 SM's 64K registers (NOTES v11:
    6 fit uncapped at 161 registers)."""
    from shared_math.tiling import DECODE_NUM_WARPS, TRITON_INT2_MAX_REGISTERS

    registers_per_sm, warp_size = 65536, 32
    assert registers_per_sm // (TRITON_INT2_MAX_REGISTERS * warp_size * DECODE_NUM_WARPS) == 8


def test_order_statistic_choice_counts_row_reductions():
    """tagged_max (rows of bfloat16 values) and checked_max (other rows) while their max rounds
    cost fewer row reductions than bisection's BISECTION_STEPS counts; bisection beyond."""
    from shared_math import tiling
    from shared_math.spec import clip_index

    assert tiling.BISECTION_STEPS == 31  # FP16_MAX's float32 bits (0x477FE000) need 31 bits
    k = clip_index(0.96, 128)  # 122: six rounds
    assert [tiling.order_statistic_reductions(m, 128, k) for m in tiling.ORDER_STATISTICS] == [12, 31, 6, 7]
    assert tiling.select_order_statistic(128, k, rows_bf16=True) == "tagged_max"
    assert tiling.select_order_statistic(128, k, rows_bf16=False) == "checked_max"
    assert tiling.select_order_statistic(128, 128 - 30, rows_bf16=False) == "checked_max"  # 31 = 31: ties go first
    assert tiling.select_order_statistic(128, 128 - 31, rows_bf16=False) == "bisect"
    assert tiling.select_order_statistic(128, clip_index(0.5, 128), rows_bf16=True) == "bisect"
    with pytest.raises(ValueError, match="sorting"):
        tiling.order_statistic_reductions("sorting", 128, k)


def test_resolve_order_statistic_validates_an_explicit_choice():
    from shared_math.tiling import resolve_order_statistic

    assert resolve_order_statistic(None, 128, 122, rows_bf16=True, rows="bfloat16 rows") == "tagged_max"
    assert resolve_order_statistic("max_drop", 128, 122, rows_bf16=False, rows="float32 rows") == "max_drop"
    with pytest.raises(ValueError, match="tagged_max.*float32 rows"):
        resolve_order_statistic("tagged_max", 128, 122, rows_bf16=False, rows="float32 rows")
    with pytest.raises(ValueError, match="'sorting'"):
        resolve_order_statistic("sorting", 128, 122, rows_bf16=True, rows="bfloat16 rows")


@pytest.mark.parametrize("planes, head_dim, group_size, levels, rotated, expected", [
    (None, 128, 128, "minmax", False, True),  # the default: where it applies
    (None, 128, 64, "minmax", False, False),  # G < D
    (None, 128, 128, "moments", False, False),
    (None, 128, 128, "minmax", True, False),  # rows the kernel rotates
    (True, 64, 64, "minmax", False, True),
    (False, 128, 128, "minmax", False, False),
])
def test_resolve_encode_planes(planes, head_dim, group_size, levels, rotated, expected):
    from shared_math.tiling import resolve_encode_planes

    assert resolve_encode_planes(planes, head_dim, group_size, levels, rotated) is expected


def test_rotated_bf16_rows_take_planes_only_when_insisted_on():
    """bfloat16 rows the kernel rotates (the split rotation, by planes' products): planes=True takes
    them, the default does not (NOTES v25: no faster on the H200); float32 rows are refused."""
    from shared_math.tiling import resolve_encode_planes

    assert resolve_encode_planes(True, 128, 128, "minmax", rotated=True, rows_bf16=True) is True
    assert resolve_encode_planes(None, 128, 128, "minmax", rotated=True, rows_bf16=True) is False
    with pytest.raises(ValueError, match="got float32 rows"):
        resolve_encode_planes(True, 128, 128, "minmax", rotated=True, rows_bf16=False)


@pytest.mark.parametrize("planes, head_dim, group_size, levels, rotated, match", [
    (True, 128, 32, "minmax", False, "group_size=32, head_dim=128"),
    (True, 128, 128, "moments", False, "levels='moments'"),
    (True, 128, 128, "minmax", True, "with a rotation needs bfloat16 rows"),
    ("yes", 128, 128, "minmax", False, "planes='yes'"),
    (1, 128, 128, "minmax", False, "planes=1"),
])
def test_resolve_encode_planes_names_what_does_not_apply(planes, head_dim, group_size, levels, rotated, match):
    from shared_math.tiling import resolve_encode_planes

    with pytest.raises(ValueError, match=match):
        resolve_encode_planes(planes, head_dim, group_size, levels, rotated)


@pytest.mark.parametrize("rows, planes, expected", [(1, True, 4), (2, True, 4), (4, True, 4), (32, True, 32),
                                                    (2, False, 2), (1, False, 1)])
def test_planes_blocks_hold_at_least_four_rows(rows, planes, expected):
    from shared_math.tiling import planes_block_rows

    assert planes_block_rows(rows, planes) == expected


# --------------------------------------------------------------------------------------------
# DecodeLaunch: the one launch configuration both backends' attention ops resolve and pass on.
# --------------------------------------------------------------------------------------------


def _decode_launch(**overrides):
    from shared_math.tiling import resolve_decode_launch, resolve_tiling

    shape = dict(batch=8, num_kv_heads=8, head_dim=128, group_size=128, page_size=64, bf16_slots=6,
                 history_slots=2043)
    shape.update({k: overrides.pop(k) for k in list(overrides) if k in shape})
    tiling = resolve_tiling(overrides.pop("pages_per_split", None), overrides.pop("pages_per_block", None),
                            bf16_slots=shape["bf16_slots"], history_slots=shape["history_slots"],
                            page_size=shape["page_size"], sequence_heads=shape["batch"] * shape["num_kv_heads"])
    return resolve_decode_launch(**shape, tiling=tiling, **{"compiled": True, "q_dtype": "bfloat16", **overrides})


def test_decode_launch_of_the_production_call_is_the_policy():
    """Qwen3-8B heads at 128K batch 8: tokens and channels on M at one warp and 3 stages, capped where
    the backend can cap, the PTX unpacker and fmas compiled; frozen and hashable (a jit static)."""
    import dataclasses

    from shared_math.tiling import (
        BF16_TIER_NUM_STAGES, DECODE_NUM_STAGES, INT2_CHANNELS_ON_M_MAX_REGISTERS, INT2_DECODE_NUM_WARPS,
        DecodeLaunch, decode_pages_per_split,
    )

    launch = _decode_launch()
    assert launch == DecodeLaunch(
        pages_per_split=decode_pages_per_split(2043, 1, 64, 64), bf16_pages_per_split=1, pages_per_block=1,
        bf16_num_warps=4, bf16_num_stages=BF16_TIER_NUM_STAGES, int2_num_warps=INT2_DECODE_NUM_WARPS,
        int2_num_stages=DECODE_NUM_STAGES, tokens_on_m=True, channels_on_m=True,
        max_registers=INT2_CHANNELS_ON_M_MAX_REGISTERS, unpack_asm=True, fma_asm=True)
    assert hash(launch) == hash(dataclasses.replace(launch))
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.max_registers = 0
    assert _decode_launch(register_caps=False).max_registers == 0
    assert _decode_launch(compiled=False, q_dtype="float32").unpack_asm is False
    interpreted = _decode_launch(compiled=False)
    assert not interpreted.unpack_asm and not interpreted.fma_asm


def test_decode_launch_backend_rules():
    """The Triton backend's INT2 tier takes tokens on M with one group per row only, and caps its
    rows-on-M kernel; explicit warps / stages reach both tiers."""
    from shared_math.tiling import TRITON_INT2_MAX_REGISTERS

    triton_rules = dict(tokens_on_m_any_group=False, rows_on_m_max_registers=TRITON_INT2_MAX_REGISTERS, fma_asm=False)
    narrow = _decode_launch(group_size=32, **triton_rules)
    assert not narrow.tokens_on_m and narrow.max_registers == TRITON_INT2_MAX_REGISTERS and not narrow.fma_asm
    assert _decode_launch(group_size=32).tokens_on_m  # Pallas: any group size
    explicit = _decode_launch(num_warps=8, num_stages=1, max_registers=0, channels_on_m=False)
    assert (explicit.bf16_num_warps, explicit.int2_num_warps, explicit.bf16_num_stages, explicit.int2_num_stages,
            explicit.max_registers, explicit.channels_on_m) == (8, 8, 1, 1, 0, False)


@pytest.mark.parametrize("overrides,message", [
    (dict(num_warps=3), "num_warps=3 must be a power of two"),
    (dict(num_warps=0), "num_warps=0 must be an integer >= 1"),
    (dict(num_stages=0), "num_stages=0 must be an integer >= 1"),
    (dict(num_stages=True), "num_stages=True must be an integer"),
    (dict(max_registers=16), r"max_registers=16 must be 0 \(the compiler's choice\) or an integer >= 32"),
    (dict(channels_on_m=1), "channels_on_m=1 must be a bool or None"),
    (dict(channels_on_m=True, batch=1, history_slots=100), "channels_on_m=True needs the INT2 tier's tokens-on-M layout"),
    (dict(unpack_asm="yes"), "unpack_asm='yes' must be a bool or None"),
    (dict(unpack_asm=True, compiled=False), "interpret mode cannot run PTX"),
    (dict(unpack_asm=True, q_dtype="float32"), "q float32"),
    (dict(fma_asm=True, compiled=False), "fma_asm=True runs inline PTX"),
    (dict(pages_per_split=6, pages_per_block=4), "pages_per_split=6 must be a multiple of pages_per_block=4"),
    (dict(pages_per_split=4, pages_per_block=8), "pages_per_block=8 must not exceed pages_per_split=4"),
    (dict(pages_per_block=3), "pages_per_block=3 must be a power of two"),
    (dict(page_size=8, pages_per_block=1, pages_per_split=2), r"pages_per_block=1 × page size 8 must be >= 16"),
])
def test_decode_launch_names_the_bad_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        _decode_launch(**overrides)


@pytest.mark.parametrize("fields,message", [
    (dict(pages_per_split=3, bf16_pages_per_split=2, pages_per_block=2), "pages_per_split=3 must be a multiple"),
    (dict(pages_per_split=2, bf16_pages_per_split=1, pages_per_block=2), "pages_per_block=2 must not exceed"),
    (dict(pages_per_split=2, bf16_pages_per_split=2, pages_per_block=1, int2_num_warps=6), "int2_num_warps=6"),
    (dict(pages_per_split=2, bf16_pages_per_split=2, pages_per_block=1, bf16_num_stages=0), "bf16_num_stages=0"),
    (dict(pages_per_split=2, bf16_pages_per_split=2, pages_per_block=1, tokens_on_m=1), "tokens_on_m=1 must be a bool"),
    (dict(pages_per_split=2, bf16_pages_per_split=2, pages_per_block=1, channels_on_m=True), "needs tokens_on_m=True"),
    (dict(pages_per_split=2, bf16_pages_per_split=2, pages_per_block=1, max_registers=8), "max_registers=8"),
])
def test_decode_launch_checks_itself(fields, message):
    """A DecodeLaunch built by hand is checked as one resolved from a call's arguments."""
    from shared_math.tiling import DecodeLaunch

    with pytest.raises(ValueError, match=message):
        DecodeLaunch(**fields)


def test_prefill_launch_is_the_plain_tier_launch():
    from shared_math.tiling import TIER_NUM_STAGES, TIER_NUM_WARPS, prefill_launch

    launch = prefill_launch(4, 1, 1, 64, fma_asm=True)
    assert (launch.bf16_num_warps, launch.int2_num_warps, launch.bf16_num_stages, launch.int2_num_stages) == (
        TIER_NUM_WARPS, TIER_NUM_WARPS, TIER_NUM_STAGES, TIER_NUM_STAGES)
    assert not (launch.tokens_on_m or launch.channels_on_m or launch.unpack_asm or launch.max_registers)
    assert launch.fma_asm
    with pytest.raises(ValueError, match="pages_per_split=3 must be a multiple of pages_per_block=2"):
        prefill_launch(3, 2, 2, 64)


@pytest.mark.parametrize("given,bf16_slots,history_slots,page_size,expected", [
    ((None, None), 6, 2043, 64, (2043, 1, 1)),     # 128K INT2 cache: one split over the history table
    ((None, None), 6, 0, 64, (6, 6, 1)),           # a chunk with no history: the BF16 table's
    ((None, None), 1563, 0, 64, (1563, 1563, 1)),  # the BF16-only cache: its whole table
    ((None, None), 21, 61, 8, (62, 2, 2)),         # pages of 8: whole blocks of 2 pages
    ((8, None), 6, 2043, 64, (8, 1, 1)),           # an explicit split is kept
])
def test_resolve_splits_of_a_prefill_call(given, bf16_slots, history_slots, page_size, expected):
    """A prefill chunk's cache partials take one split over the whole table (DECISIONS.md P2)."""
    from shared_math.tiling import check_tiling, resolve_splits

    got = resolve_splits(*given, bf16_slots, history_slots, page_size, prefill=True)
    assert got == expected
    check_tiling(got[0], got[2], page_size)
