"""Shared named cases of the parity suite, and the backend-free builders that turn them into data.

This module imports only numpy and shared_math, so the tests of either backend (and benchmarks)
can use it without importing the other backend; the parity tests are the only code that imports
both. Everything a backend receives is built here as numpy (bfloat16 as uint16 bit patterns),
and converted by the test's own backend helper.

Cases:
  CODEC_CASES      rows × (d, G, c): real model shapes (Qwen3-8B K=8 D=128, SmolLM2 K=3 D=64)
                   and small edges; crossed with the DATA generators and both encoders.
  WRITE_CASES      page writes and demotions: (page, slot) destinations, edges (1 token,
                   page − 1, page + 1, one page, many pages, odd counts).
  ATTENTION_CASES  decode over the paged mixed-tier cache: real GQA shapes (Qwen3-8B Gq=4,
                   SmolLM2 Gq=3) and edge lengths (1 token, page − 1, page + 1, odd, one page,
                   S0 + 1 with empty history, many INT2 pages).
  DECODE_CASES     ATTENTION_CASES and more shapes (D = 128 with G < D, bfloat16 q at D = 128,
                   a recent window of 256, blocks of 4 and 8 pages): the float64 decode test's.
  PREFILL_CASES    a chunk over a prefix cache (ragged chunks, chunks longer than a block).
  CHANNEL_KEY_CASES  decode over format v2's per-channel key pages (D 64 / 128, values' G 128 / 32,
                   float32 and bfloat16 q; NaN key metadata on the page no valid token names).
  ATTENTION_TOLERANCES  THE tolerance table of attention outputs vs the float64 reference over
                   the dequantized cache (one table for both backends, keyed by the q dtype).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from shared_math import attention as reference_attention
from shared_math.codec import decode, encode, encode_channels
from shared_math.float_bits import BF16_DROPPED_BITS, bf16_rounded_bits
from shared_math.spec import CODES_PER_BYTE, DEFAULT_K_CLIP_RATIO, DEFAULT_V_CLIP_RATIO, FP16_MAX, OscarConfig
from shared_math.tiers import tier_split

F32 = np.float32
LEVELS = ("minmax", "moments")


def seed_of(*parts) -> int:
    """A stable seed from a case's name and any extra parts."""
    return zlib.crc32("/".join(map(str, parts)).encode())


# ------------------------------------------------------------------------------ bfloat16


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), round-to-nearest-even (finite and ±inf input)."""
    bits = np.asarray(x, F32).view(np.int32)
    return (bf16_rounded_bits(bits) >> BF16_DROPPED_BITS).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) → float32 values (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << BF16_DROPPED_BITS).view(F32)


# ----------------------------------------------------------------------------- codec data


def order_statistic_rows(d: int, seed: int = 7) -> np.ndarray:
    """float32 rows of bfloat16 values (so every order statistic of the clip threshold applies,
    tagged_max included): heavy ties (few distinct magnitudes, both signs, zeros of both signs),
    the sanitize clamp (±inf, bfloat16 values above FP16_MAX), N(0, 1) rows and tie-free rows."""
    rng = np.random.default_rng(seed)
    x = (rng.integers(-4, 5, size=(24, d)) * F32(0.75)).astype(F32)
    x[0] = -0.0
    x[1, : d // 2] = -0.0
    x[2, :6] = [np.inf, -np.inf, 70144.0, -65280.0, 65280.0, 65504.0]  # 65504 rounds up to 65536
    x[3:6] = rng.standard_normal((3, d))
    x[6:9] = np.arange(d, dtype=F32) * rng.choice([-1, 1], size=(3, d)).astype(F32)  # distinct magnitudes
    return bf16_values(bf16_bits(x))


def checked_max_rows(ties: bool) -> np.ndarray:
    """40 float32 rows of d 128 (N(0, 1), tie-free); with `ties`, row 17 holds three copies of its
    largest |x|, so checked_max's block with it falls back to max_drop."""
    x = np.random.default_rng(11).standard_normal((40, 128)).astype(F32)
    if ties:
        x[17, :3] = 9.0
    return x




def random_rotations(rng, num_heads: int, d: int) -> np.ndarray:
    """float32 [K, D, D]: one random orthogonal matrix per kv head (QR of N(0, 1))."""
    q, _ = np.linalg.qr(rng.standard_normal((num_heads, d, d)))
    return q.astype(F32)


def normal_rows(rng, shape):
    return rng.standard_normal(shape).astype(F32)


def heavy_tailed_rows(rng, shape):
    """Student-t(2) with per-row scales over 6 decades: outliers and clipping at work."""
    scale = 10.0 ** rng.uniform(-3, 3, size=shape[:-1] + (1,))
    return (rng.standard_t(2, size=shape) * scale).astype(F32)


def tied_rows(rng, shape):
    """Few distinct values: ties at the clip threshold, at group min/max and at thresholds."""
    x = rng.integers(-3, 4, size=shape).astype(F32) * F32(0.5)
    flat = x.reshape(-1, shape[-1])
    flat[0] = F32(0.25)  # constant row
    if len(flat) > 1:
        flat[1] = F32(0)  # all +0
    if len(flat) > 2:
        flat[2] = F32(-0.0)  # all −0 (one sign per group: unambiguous)
    if len(flat) > 3:
        flat[3] = np.repeat(rng.standard_normal(2).astype(F32), shape[-1] // 2)  # two plateaus
    return x


def special_rows(rng, shape):
    """NaN, ±Inf, huge, ±FP16_MAX and the f16 rounding edge, subnormals, tiny and zero."""
    specials = np.array(
        [np.nan, np.inf, -np.inf, 1e38, -1e38, FP16_MAX, -FP16_MAX, 65519.0, 65520.0, -65536.0,
         1e-40, -1e-40, 1e-45, -1e-45, 1.17e-38, 6e-8, -6e-8, 3e-5, 0.0, 1.0, -1.0],
        F32,
    )
    x = normal_rows(rng, shape)
    mask = rng.random(shape) < 0.3
    x[mask] = rng.choice(specials, size=int(mask.sum()))
    flat = x.reshape(-1, shape[-1])
    flat[0] = F32(1e-40)  # an all-subnormal row
    if len(flat) > 1:
        flat[1] = np.where(np.arange(shape[-1]) % 2, F32(np.inf), F32(np.nan))
    flat[-1, ::3] = F32(-0.0)  # both zeros in one group (FORMAT.md pins lo = −0, hi = +0)
    flat[-1, 1::3] = F32(0.0)
    return x


def tiny_rows(rng, shape):
    """Subnormals and the smallest normals, both signs (flush-to-zero hazards)."""
    x = normal_rows(rng, shape) * F32(2.0**-126)
    flat = x.reshape(-1, shape[-1])
    flat[0, ::2] = -flat[0, ::2] * F32(1e-3)
    if len(flat) > 1:
        flat[1] = F32(1e-40) * rng.choice([-1, 1], shape[-1]).astype(F32)
    return x


DATA = {
    "random": normal_rows, "heavy": heavy_tailed_rows, "ties": tied_rows, "special": special_rows,
    "tiny": tiny_rows,
}


def encode_planes_rows(bf16: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rows of d 128 (as float32; bfloat16 values when `bf16`) and, per row, whether
    encode_planes must take it (N(0, 1) and heavy-tailed rows, tie-free in float32): every DATA
    kind, the order-statistic edge rows, and rows that each break one of its conditions."""
    rng = np.random.default_rng(23)
    kinds = [DATA[name](rng, (8, 128)) for name in sorted(DATA)] + [order_statistic_rows(128)]
    x = np.concatenate(kinds).astype(F32)
    declined = np.zeros((16, 128), F32) + rng.standard_normal((16, 128)).astype(F32)
    declined[0, 5] = np.nan
    declined[1, 9] = np.inf
    declined[2, 3] = -70000.0  # |x| > FP16_MAX
    declined[3] = np.abs(declined[3]) + 0.5  # no sign bit set
    declined[4] = -np.abs(declined[4]) - 0.5  # no sign bit clear
    declined[5, :125] = 0.0  # τ = 0 at c = 0.96
    if not bf16:
        declined[6, :3] = 7.0  # ties among the largest |x|: checked_max's test fails
    takes = np.ones(len(declined), bool)
    takes[:6 if bf16 else 7] = False
    x = np.concatenate([x, declined])
    ordinary = np.concatenate([np.repeat([name in ("heavy", "random") for name in sorted(DATA)], 8),
                               np.zeros(len(kinds[-1]), bool)])
    fine = np.concatenate([ordinary, takes])
    special = np.isnan(x).any(-1) | (np.abs(x) > FP16_MAX).any(-1)
    if bf16:
        x = bf16_values(bf16_bits(x))
    return x, fine & ~special


@dataclasses.dataclass(frozen=True)
class CodecCase:
    name: str
    lead: tuple[int, ...]  # leading shape of the rows, e.g. (tokens, kv_heads)
    head_dim: int
    group_size: int
    clip_ratio: float

    def rows(self, data: str) -> np.ndarray:
        rng = np.random.default_rng(seed_of(self.name, data))
        return DATA[data](rng, self.lead + (self.head_dim,))


CODEC_CASES = (
    CodecCase("qwen3_8b_k", (19, 8), 128, 128, DEFAULT_K_CLIP_RATIO),  # K=8, D=128, G=128
    CodecCase("smollm2_v", (21, 3), 64, 64, DEFAULT_V_CLIP_RATIO),  # K=3, D=64
    CodecCase("d128_g32_half_clip", (5,), 128, 32, 0.5),  # bisection order statistic
    CodecCase("d64_g16_noclip", (3, 2), 64, 16, 1.0),
    CodecCase("d16_one_row", (1,), 16, 16, 0.9),
)


# ------------------------------------------------------------------------------ write cases


@dataclasses.dataclass(frozen=True)
class WriteCase:
    """Tokens scattered into INT2 / BF16 pools of `num_pages` pages, and pages demoted."""

    name: str
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    page_size: int
    num_pages: int
    clip_ratio: float
    num_layers: int = 1  # demotion: pools with a leading layer axis when > 1

    def destinations(self) -> tuple[np.ndarray, np.ndarray]:
        """Distinct shuffled (page, slot) pairs, int32 [T] each."""
        rng = np.random.default_rng(seed_of(self.name, "destinations"))
        flat = rng.choice(self.num_pages * self.page_size, size=self.num_tokens, replace=False)
        return (flat // self.page_size).astype(np.int32), (flat % self.page_size).astype(np.int32)

    def rows(self, data: str = "heavy") -> np.ndarray:
        """Rotated float32 rows [T, K, D]."""
        rng = np.random.default_rng(seed_of(self.name, data, "rows"))
        return DATA[data](rng, (self.num_tokens, self.num_kv_heads, self.head_dim))

    def rotation(self) -> np.ndarray:
        """A random orthogonal R_K per kv head, float32 [K, D, D] (for the fused key rotation)."""
        rng = np.random.default_rng(seed_of(self.name, "rotation"))
        q, _ = np.linalg.qr(rng.standard_normal((self.num_kv_heads, self.head_dim, self.head_dim)))
        return q.astype(F32)

    def int2_pools(self, layers: bool = False):
        """Pools filled with random bytes (a sentinel pattern: any stray write shows)."""
        rng = np.random.default_rng(seed_of(self.name, "pools"))
        lead = ((self.num_layers,) if layers else ()) + (self.num_pages, self.num_kv_heads, self.page_size)
        codes = rng.integers(0, 256, size=lead + (self.head_dim // CODES_PER_BYTE,), dtype=np.uint8)
        meta = lead + (self.head_dim // self.group_size,)
        scale = rng.integers(0, 2**15, size=meta, dtype=np.uint16).view(np.float16)
        minimum = rng.integers(0, 2**15, size=meta, dtype=np.uint16).view(np.float16)
        return codes, scale, minimum

    def bf16_pool(self, layers: bool = False) -> np.ndarray:
        """A BF16 pool (uint16 bit patterns) of heavy-tailed bf16 values, [(Y,) P, K, L, D]."""
        rng = np.random.default_rng(seed_of(self.name, "bf16_pool"))
        lead = ((self.num_layers,) if layers else ()) + (self.num_pages, self.num_kv_heads, self.page_size)
        return bf16_bits(heavy_tailed_rows(rng, lead + (self.head_dim,)))

    def demotions(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) page ids: about half the pages, distinct destinations, shuffled."""
        rng = np.random.default_rng(seed_of(self.name, "demotions"))
        n = max(1, self.num_pages // 2)
        return (rng.choice(self.num_pages, n, replace=False).astype(np.int32),
                rng.choice(self.num_pages, n, replace=False).astype(np.int32))


WRITE_CASES = (
    WriteCase("one_token", 1, 2, 64, 32, 16, 2, 0.96),
    WriteCase("page_minus_1", 15, 3, 64, 64, 16, 1, 0.92),  # SmolLM2 K, D
    WriteCase("page_plus_1", 17, 2, 128, 128, 16, 3, 0.96, num_layers=2),
    WriteCase("one_page", 16, 1, 128, 64, 16, 1, 0.92),
    WriteCase("many_pages_odd", 77, 2, 64, 16, 16, 9, 0.96, num_layers=3),
    WriteCase("qwen3_8b_shape", 33, 8, 128, 128, 16, 4, 0.96),  # K=8, D=128
)


def sentinel_int2_pools(rng, num_pages, num_heads, page_size, d, group_size, layers=()):
    """INT2 pools filled with random bytes (a sentinel pattern: any stray write shows)."""
    lead = tuple(layers) + (num_pages, num_heads, page_size)
    codes = rng.integers(0, 256, size=lead + (d // 4,), dtype=np.uint8)
    scale = rng.integers(0, 2**15, size=lead + (d // group_size,), dtype=np.uint16).view(np.float16)
    minimum = rng.integers(0, 2**16, size=lead + (d // group_size,), dtype=np.uint16).view(np.float16)
    return codes, scale, minimum


def destinations(rng, num_tokens, num_pages, page_size):
    flat = rng.permutation(num_pages * page_size)[:num_tokens]
    return (flat // page_size).astype(np.int32), (flat % page_size).astype(np.int32)


def expected_pools(pools, encoded, page_ids, slots):
    """The pools after writing encoded rows [T, K, ...] at (page_ids[t], slots[t])."""
    out = [np.array(p, copy=True) for p in pools]
    for pool, value in zip(out, encoded):
        pool[page_ids, :, slots] = np.asarray(value)
    return out


def reference_scatter(pools, rows, page_ids, slots, *, group_size, clip_ratio, levels):
    """shared_math's write_pages: encode rows [T, K, D] and scatter into copies of the pools."""
    codes, scale, minimum = (p.copy() for p in pools)
    packed, s, m = encode(rows, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    codes[page_ids, :, slots] = packed
    scale[page_ids, :, slots] = s
    minimum[page_ids, :, slots] = m
    return codes, scale, minimum


def reference_demote(bf16_pool, pools, src, dst, *, group_size, clip_ratio, levels):
    """shared_math's demote_pages on pools [(Y,) P, K, L, ·]: INT2 page dst[n] ← encode(BF16 page src[n])."""
    codes, scale, minimum = (p.copy() for p in pools)
    values = bf16_values(bf16_pool)
    packed, s, m = encode(values[..., src, :, :, :], group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    codes[..., dst, :, :, :] = packed
    scale[..., dst, :, :, :] = s
    minimum[..., dst, :, :, :] = m
    return codes, scale, minimum


def reference_bf16_scatter(pool, rows, page_ids, slots):
    """shared_math-side write_bf16_pages: round rows to bfloat16 (RNE) and scatter (uint16 bits)."""
    pool = pool.copy()
    pool[page_ids, :, slots] = bf16_bits(rows)
    return pool


# -------------------------------------------------------------------------- attention cases

ATTENTION_TOLERANCES = {
    # THE tolerance table of attention outputs, |out − ref| ≤ atol + rtol·|ref|, ref = float64
    # attention over the *dequantized* cache (shared_math.attention.mixed_tier_decode_attention),
    # keyed by the dtype of q (= the dots' compute dtype); every implementation's attention tests read
    # it. Its derivation: K/V entries N(0, 1),
    # scores with std ~3 (query spread 3).
    #   float32: IEEE float32 dots over ≤ D products and online softmax over a few hundred tokens:
    #     score error ≈ 2⁻²⁴·Σ|q_i k_i|·scale ≈ 1e-6 → atol = rtol = 2e-5 (≥ 5× the measured max
    #     of either backend; a wiring bug shows up as O(0.1–1)).
    #   bfloat16: the probabilities (and, in Pallas's INT2 tier, p·scale_v) are rounded to bf16
    #     before P·V, relative error ≤ 2⁻⁸ each: |Δo| ≲ 2⁻⁸·max|v| ≈ 1.8e-2 → atol 2e-2.
    "float32": dict(atol=2e-5, rtol=2e-5),
    "bfloat16": dict(atol=2e-2, rtol=0.0),
}

BF16_QUIET_NAN = np.uint16(0x7FC0)  # the canonical quiet bfloat16 NaN
POISON_PAGE = 0  # NaN-filled; unused table entries point here and must never be read


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    name: str
    head_dim: int
    group_size: int
    num_kv_heads: int
    heads_per_kv: int
    lengths: tuple[int, ...]  # cached tokens of each sequence in the batch
    q_dtype: str = "float32"
    recent: int = 32  # recent window W (small, so a few hundred tokens reach the INT2 tier)
    sink: int = 64
    page_size: int = 16
    pages_per_split: int = 4
    pages_per_block: int = 1
    levels: str = "minmax"

    @property
    def config(self) -> OscarConfig:
        return OscarConfig(head_dim=self.head_dim, group_size=self.group_size, sink=self.sink,
                           recent=self.recent, page_size=self.page_size, levels=self.levels)

    @property
    def sink_slots(self) -> int:
        return self.sink // self.page_size

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def query(self) -> np.ndarray:
        """Rotated queries float32 [B, Hq, D] (bf16-exact when q_dtype is bfloat16); spread 3
        sharpens the softmax so a few tokens dominate, as in real models."""
        rng = np.random.default_rng(seed_of(self.name, "q"))
        q = 3.0 * rng.standard_normal((len(self.lengths), self.num_kv_heads * self.heads_per_kv, self.head_dim))
        q = q.astype(F32)
        return bf16_values(bf16_bits(q)) if self.q_dtype == "bfloat16" else q


ATTENTION_CASES = (
    # Qwen3-8B: 8 KV heads, D = 128, GQA 4 (32 q heads); lengths: 1 token, S0 + 1 (empty
    # history), and one with INT2 history (64 sink + 11 history pages + 33 recent).
    AttentionCase("qwen3_8b", 128, 128, 8, 4, (1, 65, 273)),
    # SmolLM2-135M: 3 KV heads, D = 64, GQA 3; odd lengths and many INT2 pages, in splits of 6
    # pages (a split need not be a power of two).
    AttentionCase("smollm2", 64, 64, 3, 3, (337, 97), pages_per_split=6, pages_per_block=2),
    # Edges: page − 1, page + 1, one page (all sink), many pages, G = 32, GQA 1, bfloat16 q.
    AttentionCase("edges_bf16", 64, 32, 2, 1, (15, 17, 16, 201), q_dtype="bfloat16"),
    AttentionCase("gqa8_moments_g16", 64, 16, 1, 8, (129, 63), levels="moments", pages_per_split=2),
)

# The decode attention test of every backend against the float64 reference (test_ops_attention.py):
# ATTENTION_CASES and the shapes they lack (oscar_jax's former decode list): D = 128 with G = 64,
# 32 and 16 (G < D/4: a byte's four codes in four groups), bfloat16 q at D = 128 and at G = D, a
# batch of 5, lengths shorter than S0 (63), exactly S0 (64) and past 400, a recent window of
# 256, splits of 16 pages in blocks of 4, blocks of 8, a split of 3 pages. That list's (D 64, G 32,
# Hkv 3, Gq 3, lengths 337, 5, 65, 200, blocks of 2) is not here: each of its shapes is one of
# ATTENTION_CASES' (D 64 with G 32 and a sequence shorter than a page: edges_bf16; Gq 3, blocks
# of 2 and 337 tokens: smollm2; float32 q with G < D: gqa8_moments_g16).
DECODE_CASES = ATTENTION_CASES + (
    AttentionCase("d128_blocks_batch5", 128, 128, 2, 4, (1, 63, 65, 321, 337), pages_per_split=16,
                  pages_per_block=4),
    AttentionCase("d128_g32_split3", 128, 32, 1, 1, (321, 64, 1), pages_per_split=3),
    AttentionCase("d128_g64_bf16_blocks", 128, 64, 2, 3, (337, 1, 100), q_dtype="bfloat16", pages_per_split=16,
                  pages_per_block=4),
    AttentionCase("recent256_bf16_blocks8", 64, 64, 1, 4, (63, 337), q_dtype="bfloat16", recent=256,
                  pages_per_split=8, pages_per_block=8),
    AttentionCase("d128_g16_blocks", 128, 16, 3, 4, (129, 401), pages_per_split=16, pages_per_block=4),
)


@dataclasses.dataclass
class SequenceTiers:
    """One sequence's tiers as the reference consumes them (float32 views of the stored values)."""

    sink: tuple[np.ndarray, np.ndarray]  # k, v float32 [S_sink, K, D] (bf16-exact)
    history: tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]  # (codes, scale, min) for K and V
    recent: tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass
class WritePlan:
    """The rotated rows of every cached token and where each lands (what a backend must write)."""

    bf16_rows_k: np.ndarray  # float32 [Tb, K, D] sink + recent tokens of all sequences
    bf16_rows_v: np.ndarray
    bf16_page_ids: np.ndarray  # int32 [Tb]
    bf16_slots: np.ndarray
    int2_rows_k: np.ndarray  # float32 [Ti, K, D] history tokens of all sequences
    int2_rows_v: np.ndarray
    int2_page_ids: np.ndarray  # int32 [Ti]
    int2_slots: np.ndarray


@dataclasses.dataclass
class PagedCache:
    """The 13 cache arguments of decode_attention as numpy (bf16 pools as uint16 bit patterns),
    plus the tiers for the reference and the write plan that produces the pools."""

    k_bf16: np.ndarray  # uint16 [P, K, L, D]
    v_bf16: np.ndarray
    k_codes: np.ndarray  # uint8 [P2, K, L, D/4]
    k_scale: np.ndarray  # float16 [P2, K, L, D/G]
    k_min: np.ndarray
    v_codes: np.ndarray
    v_scale: np.ndarray
    v_min: np.ndarray
    bf16_page_table: np.ndarray  # int32 [B, NB]
    sink_tokens: np.ndarray  # int32 [B]
    recent_tokens: np.ndarray
    history_page_table: np.ndarray  # int32 [B, NH]
    history_tokens: np.ndarray
    sequences: list[SequenceTiers]
    plan: WritePlan
    poison: tuple[np.ndarray, ...] = ()  # the eight pools before any token was written

    POOLS = ("k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
    TABLES = ("bf16_page_table", "sink_tokens", "recent_tokens", "history_page_table", "history_tokens")

    def pools(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, n) for n in self.POOLS)

    def tables(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, n) for n in self.TABLES)

    def empty_pools(self) -> tuple[np.ndarray, ...]:
        """The poisoned pools before any write: what a backend starts from to write the cache."""
        return tuple(a.copy() for a in self.poison)


def build_cache(case: AttentionCase, spare_pages: int = 2) -> PagedCache:
    """A poisoned, shuffled paged cache holding `case.lengths` tokens (tiers per shared_math),
    seeded by the case's name: `build_paged_cache` of the case's shapes."""
    return build_paged_cache(np.random.default_rng(seed_of(case.name, "cache")), case.lengths, config=case.config,
                             num_kv_heads=case.num_kv_heads, spare_pages=spare_pages)


def build_paged_cache(rng: np.random.Generator, lengths, *, config: OscarConfig, num_kv_heads: int,
                      spare_pages: int = 2, shape_for_lengths=None) -> PagedCache:
    """A poisoned, shuffled paged cache holding sequences of the given lengths (tiers per shared_math),
    its data drawn from `rng`: the one cache generator of every backend's attention tests.

    Poison: page 0 and spare pages hold NaN (bf16 and metadata) and random codes, the unused rows
    of partly filled pages too, and unused page-table entries point at page 0: a kernel that
    reads a token that is not valid turns the output into NaN. Page ids are shuffled. Table widths
    and pool sizes fit `lengths`, or `shape_for_lengths` (same batch, each ≥ the matching length) to
    keep the array shapes fixed while the lengths vary.
    """
    d, g, kh, page = config.head_dim, config.group_size, num_kv_heads, config.page_size
    sink_slots = config.sink // page
    splits = [tier_split(int(n), config) for n in lengths]
    sizing = splits if shape_for_lengths is None else [tier_split(int(n), config) for n in shape_for_lengths]
    batch, groups, packed = len(splits), d // g, d // CODES_PER_BYTE
    bf16_slots = sink_slots + max(s.recent_pages for s in sizing) + 1  # one slot always unused
    history_slots = max(s.history_pages for s in sizing) + 1
    bf16_pages = 1 + sum(s.bf16_pages for s in sizing) + spare_pages
    int2_pages = 1 + sum(s.history_pages for s in sizing) + spare_pages

    nan_bits = BF16_QUIET_NAN
    k_bf16 = np.full((bf16_pages, kh, page, d), nan_bits, np.uint16)
    v_bf16 = k_bf16.copy()
    codes_shape = (int2_pages, kh, page, packed)
    k_codes = rng.integers(0, 256, codes_shape, dtype=np.uint8)
    v_codes = rng.integers(0, 256, codes_shape, dtype=np.uint8)
    meta = [np.full(codes_shape[:-1] + (groups,), np.nan, np.float16) for _ in range(4)]
    poison = tuple(a.copy() for a in (k_bf16, v_bf16, k_codes, meta[0], meta[1], v_codes, meta[2], meta[3]))
    bf16_table = np.full((batch, bf16_slots), POISON_PAGE, np.int32)
    history_table = np.full((batch, history_slots), POISON_PAGE, np.int32)
    free_bf16 = list(rng.permutation(np.arange(1, bf16_pages)))
    free_int2 = list(rng.permutation(np.arange(1, int2_pages)))

    plan = {key: [] for key in ("bk", "bv", "bp", "bs", "ik", "iv", "ip", "is")}
    k_clip = DEFAULT_K_CLIP_RATIO
    v_clip = DEFAULT_V_CLIP_RATIO
    sequences = []
    for b, split in enumerate(splits):
        k = rng.standard_normal((split.length, kh, d)).astype(F32)
        v = rng.standard_normal((split.length, kh, d)).astype(F32)
        tiers = {}
        for name, start, count, first_slot in (
            ("sink", 0, split.sink_tokens, 0),
            ("recent", split.recent_start, split.recent_tokens, sink_slots),
        ):
            k_bits, v_bits = bf16_bits(k[start : start + count]), bf16_bits(v[start : start + count])
            for j in range(0, count, page):
                pid = free_bf16.pop()
                bf16_table[b, first_slot + j // page] = pid
                rows = min(page, count - j)
                k_bf16[pid, :, :rows] = k_bits[j : j + rows].transpose(1, 0, 2)
                v_bf16[pid, :, :rows] = v_bits[j : j + rows].transpose(1, 0, 2)
                plan["bp"] += [pid] * rows
                plan["bs"] += list(range(rows))
            plan["bk"].append(k[start : start + count])
            plan["bv"].append(v[start : start + count])
            tiers[name] = (bf16_values(k_bits), bf16_values(v_bits))
        hist = slice(split.history_start, split.recent_start)
        k_q = encode(k[hist], group_size=g, clip_ratio=k_clip, levels=config.levels)
        v_q = encode(v[hist], group_size=g, clip_ratio=v_clip, levels=config.levels)
        for j in range(split.history_pages):
            pid = free_int2.pop()
            history_table[b, j] = pid
            rows = slice(j * page, (j + 1) * page)
            k_codes[pid], v_codes[pid] = k_q[0][rows].transpose(1, 0, 2), v_q[0][rows].transpose(1, 0, 2)
            for pool, value in zip(meta, (k_q[1], k_q[2], v_q[1], v_q[2])):
                pool[pid] = value[rows].transpose(1, 0, 2)
            plan["ip"] += [pid] * page
            plan["is"] += list(range(page))
        plan["ik"].append(k[hist])
        plan["iv"].append(v[hist])
        sequences.append(SequenceTiers(tiers["sink"], (k_q, v_q), tiers["recent"]))

    def rows(key):
        return np.concatenate(plan[key]).astype(F32) if plan[key] else np.zeros((0, kh, d), F32)

    write_plan = WritePlan(
        rows("bk"), rows("bv"), np.asarray(plan["bp"], np.int32), np.asarray(plan["bs"], np.int32),
        rows("ik"), rows("iv"), np.asarray(plan["ip"], np.int32), np.asarray(plan["is"], np.int32),
    )
    lengths_of = lambda attr: np.asarray([getattr(s, attr) for s in splits], np.int32)  # noqa: E731
    cache = PagedCache(
        k_bf16, v_bf16, k_codes, meta[0], meta[1], v_codes, meta[2], meta[3],
        bf16_table, lengths_of("sink_tokens"), lengths_of("recent_tokens"), history_table,
        lengths_of("history_tokens"), sequences, write_plan, poison,
    )
    return cache


def reference_decode(case: AttentionCase, cache: PagedCache, q: np.ndarray) -> np.ndarray:
    """float64 [B, Hq, D]: split-K attention over the dequantized cache (shared_math)."""
    q = np.asarray(q, np.float64)
    return np.stack([
        reference_attention.mixed_tier_decode_attention(
            q[b], sink=tiers.sink, history=tiers.history, recent=tiers.recent,
            group_size=case.group_size, softmax_scale=case.softmax_scale,
        )
        for b, tiers in enumerate(cache.sequences)
    ])


def cut_history(cache: PagedCache, tokens: int, page_size: int) -> PagedCache:
    """`cache` with the last `tokens` (0 < tokens < L) history tokens of every sequence that has
    history dropped from history_tokens and from the reference's tiers, so that its last INT2 page
    is partly valid. A well-formed cache holds whole pages; the kernels run such a page as their
    masked block. The dropped rows hold real codes, so a kernel that read them would differ."""
    assert 0 < tokens < page_size
    history_tokens = cache.history_tokens.copy()
    sequences = []
    for b, tiers in enumerate(cache.sequences):
        keep = max(int(history_tokens[b]) - tokens, 0)
        history_tokens[b] = keep
        history = tuple(tuple(array[:keep] for array in side) for side in tiers.history)
        sequences.append(dataclasses.replace(tiers, history=history))
    return dataclasses.replace(cache, history_tokens=history_tokens, sequences=sequences)


# bf16 queries build the INT2 code operand as 128 + c·factor (shared_math.ptx) and cancel the 128 in Σ p·m_v. Over
# zero-mean values the output is ~10⁻² while a page's biased dot is ~10 × Σ p, so the kernels must
# cancel page by page: adding Σ p·m_v once per split loses ~3 % relative error at 128K (DECISIONS.md
# D13). This case is exact but for that float32 rounding:
# q = 0 (every p = 1) and one bf16 V scale, so p·s_v is exact in bf16 and a page's sums of
# s·integers fit float32's 24 bits, while a split's biased sum over 128 pages does not.
BIAS_CANCELLATION_CASE = AttentionCase(
    "bias_cancellation", 128, 128, 1, 4, (64 + 128 * 16 + 32,), q_dtype="bfloat16", pages_per_split=128)
BIAS_CANCELLATION_TOLERANCE = 1e-5  # relative error in norm; the per-split version: 4.3e-4 (CPU)


def bias_cancellation_cache() -> PagedCache:
    """`build_cache(BIAS_CANCELLATION_CASE)` with every written V scale one bf16 value s and every V
    minimum −1.5·s (values s·(c − 1.5): zero mean), in the pools and in the reference's tiers."""
    cache = build_cache(BIAS_CANCELLATION_CASE)
    v_scale = float(bf16_values(bf16_bits(np.float32(0.1))))  # 8 significant bits: exact in fp16 too
    v_min = -1.5 * v_scale
    for b, tiers in enumerate(cache.sequences):
        pages = cache.history_page_table[b, : -(-int(cache.history_tokens[b]) // BIAS_CANCELLATION_CASE.page_size)]
        cache.v_scale[pages] = v_scale
        cache.v_min[pages] = v_min
        k_q, (v_codes, scale, minimum) = tiers.history
        tiers.history = (k_q, (v_codes, np.full_like(scale, v_scale), np.full_like(minimum, v_min)))
    return cache


def dequantized_cache(case: AttentionCase, tiers: SequenceTiers) -> tuple[np.ndarray, np.ndarray]:
    """All cached K and V of one sequence, [S, K, D] float64 (sink ‖ history ‖ recent)."""
    return dequantized_tiers(tiers, case.group_size)


def dequantized_tiers(tiers: SequenceTiers, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """dequantized_cache of a sequence's tiers, the group size given."""
    k_hist = decode(*tiers.history[0], group_size=group_size)
    v_hist = decode(*tiers.history[1], group_size=group_size)
    k = np.concatenate([tiers.sink[0], k_hist, tiers.recent[0]]).astype(np.float64)
    v = np.concatenate([tiers.sink[1], v_hist, tiers.recent[1]]).astype(np.float64)
    return k, v


# ------------------------------------------------------------- format v2: per-channel key pages


@dataclasses.dataclass(frozen=True)
class ChannelKeyCase:
    """A format-v2 cache (FORMAT.md § Format v2): keys of history pages per channel and page
    (shared_math.codec.encode_channels), values as v1 (G = group_size), pages of 16 tokens."""

    name: str
    head_dim: int
    group_size: int  # the values' group
    q_dtype: str = "float32"
    page_size: int = 16

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5


CHANNEL_KEY_CASES = (
    ChannelKeyCase("v2_d64", 64, 64),
    ChannelKeyCase("v2_d128_bf16", 128, 128, "bfloat16"),
    ChannelKeyCase("v2_d128_g32_bf16", 128, 32, "bfloat16"),
)


def channel_key_cache(case: ChannelKeyCase):
    """(pools, tables, q) as numpy (BF16 pages as bit patterns): sequence 0 with a sink page, three
    history pages of keys spread 0.3–4 across channels (a per-token scale would drown the small
    channels) and a part-filled recent window; sequence 1 with no history, its history slots naming
    page 0, whose key metadata is NaN and must never be read for a valid token; q of 6 heads over 2
    KV heads (GQA 3), spread 3."""
    rng = np.random.default_rng(seed_of("channel_keys", case.name))
    d, page, kv, num_bf16, num_int2 = case.head_dim, case.page_size, 2, 8, 9
    k_bf16, v_bf16 = (bf16_bits(rng.standard_normal((num_bf16, kv, page, d)).astype(np.float32)) for _ in range(2))
    k_bf16[7] = v_bf16[7] = BF16_QUIET_NAN  # a page no table names a valid row of
    history_k = rng.standard_normal((num_int2, kv, page, d)).astype(np.float32) * np.linspace(0.3, 4, d,
                                                                                               dtype=np.float32)
    history_v = rng.standard_normal((num_int2, page, kv, d)).astype(np.float32)
    k_codes, k_scale, k_min = encode_channels(history_k, clip_ratio=0.96)  # [P, K, L, D/4], [P, K, D]
    k_scale[POISON_PAGE] = k_min[POISON_PAGE] = np.nan
    v_codes, v_scale, v_min = (a.transpose(0, 2, 1, 3) for a in encode(history_v, group_size=case.group_size,
                                                                            clip_ratio=0.92))
    tables = (np.array([[0, 2, 4], [6, 7, 7]], np.int32), np.array([16, 9], np.int32), np.array([21, 0], np.int32),
              np.array([[3, 5, 1], [POISON_PAGE] * 3], np.int32), np.array([48, 0], np.int32))
    q = 3 * rng.standard_normal((2, 6, d)).astype(np.float32)
    if case.q_dtype == "bfloat16":
        q = bf16_values(bf16_bits(q))
    return (k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min), tables, q


def reference_channel_key_decode(case: ChannelKeyCase, pools, tables, q) -> np.ndarray:
    """The float64 reference (shared_math.attention, key_layout "channel") per sequence."""
    k_bf16, v_bf16 = (bf16_values(p) for p in pools[:2])
    k_codes, k_scale, k_min, v_codes, v_scale, v_min = pools[2:]
    bf16_table, sink_tokens, recent_tokens, history_table, history_tokens = tables
    out = []
    for b in range(q.shape[0]):
        sink = tuple(p[bf16_table[b, 0]].transpose(1, 0, 2)[: sink_tokens[b]] for p in (k_bf16, v_bf16))
        recent = tuple(np.concatenate([p[r].transpose(1, 0, 2) for r in bf16_table[b, 1:]])[: recent_tokens[b]]
                       for p in (k_bf16, v_bf16))
        pages = history_table[b, : history_tokens[b] // case.page_size]
        k_hist = (k_codes[pages], k_scale[pages], k_min[pages])
        v_hist = tuple(a[pages].transpose(0, 2, 1, 3).reshape((-1,) + a.shape[1:2] + a.shape[3:])
                       for a in (v_codes, v_scale, v_min))  # token-major [S, K, …]
        out.append(reference_attention.mixed_tier_decode_attention(
            q[b], sink=sink, history=(k_hist, v_hist), recent=recent, group_size=case.group_size,
            softmax_scale=case.softmax_scale, key_layout="channel"))
    return np.stack(out)


def assert_close(actual, expected, q_dtype: str) -> float:
    """Assert against ATTENTION_TOLERANCES[q_dtype]; returns the max abs error."""
    actual = np.asarray(actual, np.float64)
    assert np.all(np.isfinite(actual)), "non-finite output: a masked (poisoned) token was read"
    np.testing.assert_allclose(actual, expected, **ATTENTION_TOLERANCES[q_dtype])
    return float(np.max(np.abs(actual - expected)))


def assert_same_bits(actual, expected, what: str = "") -> None:
    """Bitwise equality (NaN-safe, sign-of-zero-sensitive) of numpy arrays of one dtype."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a = actual.view(f"u{actual.itemsize}")
    e = expected.view(f"u{expected.itemsize}")
    if not np.array_equal(a, e):
        bad = np.argwhere(a != e)
        idx = tuple(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {actual.size} differ; first at {idx}: {actual[idx]!r} vs {expected[idx]!r}"
        )


# ---------------------------------------------------------------------------- prefill cases


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    """A chunk of `chunk` new tokens (new_tokens valid per sequence) over the prefix cache of
    `prefix` (an AttentionCase whose lengths are the cached prefix lengths)."""

    name: str
    prefix: AttentionCase
    chunk: int
    new_tokens: tuple[int, ...]
    kv_dtype: str = "float32"
    block_m: int = 64
    block_n: int = 64

    def chunk_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rotated q [B, T, Hq, D], k_new, v_new [B, T, K, D] float32 (bf16-exact for bf16 dtypes)."""
        p = self.prefix
        rng = np.random.default_rng(seed_of(self.name, "chunk"))
        batch = len(p.lengths)
        q = (3.0 * rng.standard_normal((batch, self.chunk, p.num_kv_heads * p.heads_per_kv, p.head_dim))).astype(F32)
        k = rng.standard_normal((batch, self.chunk, p.num_kv_heads, p.head_dim)).astype(F32)
        v = rng.standard_normal((batch, self.chunk, p.num_kv_heads, p.head_dim)).astype(F32)
        if p.q_dtype == "bfloat16":
            q = bf16_values(bf16_bits(q))
        if self.kv_dtype == "bfloat16":
            k, v = bf16_values(bf16_bits(k)), bf16_values(bf16_bits(v))
        return q, k, v


# Prefix lengths 0, 1, S0 − 1 (63), S0 + 1, past 300; ragged chunks (a row of 1 token); chunks longer
# than a block (block_m 32, 16); bfloat16 q with float32 and with bfloat16 K/V; D = 128 with G = D
# and G = D/2; blocks of 1 and 2 pages: oscar_jax's former prefill list folded into these (its
# ragged D 128 chunk into qwen3_8b_prefill, its D 128 G 64 chunk of 70 into d128_g64_blocks_prefill;
# its bfloat16 D 64 chunks' shapes are smollm2_bf16_prefill's, blocks_prefill's and one_token_prefill's).
PREFILL_CASES = (
    PrefillCase("qwen3_8b_prefill",
                AttentionCase("qwen3_8b_prefix", 128, 128, 8, 4, (0, 63, 337), pages_per_block=2), 19, (19, 7, 1)),
    PrefillCase("smollm2_bf16_prefill",
                AttentionCase("smollm2_prefix", 64, 64, 3, 3, (65, 150), q_dtype="bfloat16"), 16, (16, 16),
                kv_dtype="float32"),
    PrefillCase("one_token_prefill", AttentionCase("edge_prefix", 64, 32, 2, 1, (17,)), 1, (1,),
                block_m=16, block_n=16),
    PrefillCase("blocks_prefill", AttentionCase("blocks_prefix", 64, 16, 1, 4, (100,), q_dtype="bfloat16"),
                37, (37,), kv_dtype="bfloat16", block_m=32, block_n=16),
    PrefillCase("d128_g64_blocks_prefill",
                AttentionCase("d128_g64_prefix", 128, 64, 1, 1, (1, 200), pages_per_block=2), 70, (70, 9),
                block_m=32, block_n=16),
)


def reference_prefill(case: PrefillCase, cache: PagedCache, q, k_new, v_new) -> np.ndarray:
    """float64 [B, T, Hq, D]: each valid chunk token over (dequantized prefix ‖ chunk up to
    itself), one-pass softmax; rows t ≥ new_tokens[b] are 0 (as the op promises)."""
    q, k_new, v_new = (np.asarray(a, np.float64) for a in (q, k_new, v_new))
    out = np.zeros(q.shape)
    for b, tiers in enumerate(cache.sequences):
        k_prefix, v_prefix = dequantized_cache(case.prefix, tiers)
        for t in range(case.new_tokens[b]):
            k = np.concatenate([k_prefix, k_new[b, : t + 1]])
            v = np.concatenate([v_prefix, v_new[b, : t + 1]])
            out[b, t] = reference_attention.softmax_attention(q[b, t], k, v, softmax_scale=case.prefix.softmax_scale)
    return out
