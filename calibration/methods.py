"""The KV-cache methods the quality evaluation compares, each defined by the bytes it would store.

A method answers four questions for a window of T tokens decoded one token at a time:
  rotations   R_K [L, Hkv, D, D] or None: keys are stored as k·R_K and queries are rotated the
              same way (q·R_K), so scores are unchanged up to quantization; R_V [L, Hkv, D, D] or
              None: folded into W_v / W_o (oscar_jax.model.fold_value_rotation), as the runtime does.
  quantizers  `quantize_keys(layer, x)` / `quantize_values(layer, x)`: x float32 [B, T, Hkv, D]
              (rotated, already rounded to bfloat16 — the cache stores BF16 before it demotes)
              → the dequantized float32 values attention reads for those tokens.
  tiers       `history_intervals(T)`: for every query position t, the key positions [start, end)
              that decoding at t reads through the quantizer (one interval for K, one for V);
              every other position ≤ t is read from BF16.
  bytes       `kv_bytes(L, num_kv_heads, head_dim)`: bytes of K and of V one layer stores for a
              sequence of L tokens (codes, fp16 metadata, BF16 tiers, residual buffers), counted
              at rest after the L-th token. Rotations are per-model constants, not per-token
              storage, and are not counted. bits/element = 8·(K + V bytes) / (2·L·Hkv·D).

The methods and their source configurations (`parse_method` builds them from a spec string
`name[:key=value[:key=value…]]`, e.g. `oscar:windows=0/0`, `kivi2:group=64`):

  bf16        The reference: every K/V row stored in bfloat16, nothing quantized. 16 bits.
  naive-int2  Per-token symmetric INT2, no rotation, no clipping: per group of G channels
              (default G = head_dim, i.e. one group per token-head row) s = f16(max|x| / 1.5) and
              the four levels are {−1.5, −0.5, +0.5, +1.5}·s (so ±max|x| and ±max|x|/3, symmetric
              about zero); code = nearest level. Stores D/4 code bytes + one fp16 scale per group.
              Keeps OSCAR's BF16 windows (sink 64, recent 256) by default so that it differs from
              quarot-int2 only in rotation and quantizer; `naive-int2:windows=0/0` drops them
              (that leaves only the ≤ 16-token page that has not been demoted yet in BF16).
  quarot-int2 QuaRot's KV treatment (Ashkboos et al. 2024, github.com/spcl/QuaRot): a normalised
              Walsh–Hadamard rotation of every K and V head (keys after RoPE, online; values folded
              into W_v / W_o), then per-token asymmetric quantization of each head row. Here the
              quantizer is format v1's INT2 codec with exactly the codec of the `oscar` method in
              the same run (group size, clip ratios per layer, levels — from the artifact when
              one is given, else the format defaults G = min(D, 128), c_K 0.96, c_V 0.92,
              min/max levels) and OSCAR's windows (64/256), so quarot-int2 vs oscar isolates the
              rotation. QuaRot itself keeps no BF16 windows and its CLI default KV clip ratio is
              1.0 (a range scale, not an order statistic): `quarot-int2:clip=1/1:windows=0/0`.
  kivi2       KIVI (Liu et al. 2024, github.com/jy-yuan/KIVI, models/llama_kivi.py): no rotation;
              keys quantized per channel over groups of G = 32 consecutive tokens, values per
              token over groups of G = 32 channels; asymmetric min/max 2-bit with fp16 scale and
              minimum per group; a full-precision residual of R = 128 tokens (the paper's
              published G = 32, R = 128). Decode-faithful tiers follow KIVI's decode step: keys
              accumulate in the residual and all R are quantized together once it holds R (after
              that step's attention), so query t reads keys [0, R·⌊t/R⌋) quantized; values keep
              the newest R tokens plus the new one in full precision, so query t reads values
              [0, t − R) quantized. No sink. The residual is BF16 here (KIVI keeps fp16), and the
              quantizer is format v1's min/max codec with clip ratio 1 (no clip) on rows of G
              values, which rounds to the nearest level exactly like KIVI's (x − mn)/scale.
              At G = 32 it stores 3 bits per quantized element (2 + 32 bits of metadata / 32);
              `kivi2:group=64` (values: one group per row at D = 64) is the matched-bits variant.
  oscar       OSCAR_SPEC: the artifact's rotations R_K = U_Q·H·P, R_V = U_S·H·P per (layer, KV head),
              its per-layer clip ratios and its codec (group size, levels); sink 64 and recent 256
              tokens in BF16, page 16 (DESIGN.md §2 defaults). Options override windows, clip,
              levels, group; `artifact=DIR` reads another artifact (no ':' in DIR), to
              compare artifacts on the same windows or samples. `levels=K/V` (e.g.
              `minmax/moments`) gives keys and values their own levels: an experiment, since
              format v1 stores one codec per artifact.
              `salient=N` (`observe=W`, default 32): an experiment — N history tokens per (layer,
              KV head) kept in BF16 for the answer, chosen at the end of the prompt SnapKV-style
              from the attention mass of the prompt's last W queries (`salient_positions`);
              emulated only by `calibration.passkey` in prefill mode with the whole prompt at once
              (the selection exists only once the prompt has ended: the prompt reads history as
              today, the answer steps read the salient tokens in BF16). Counted in the bytes as
              BF16 rows *on top of* their INT2 codes (the pages keep their layout) plus a
              SALIENT_INDEX_BITS position index per token and (layer, KV head). With
              `keys=channel` they are chosen over the values' history and replace both copies.
              `keys=channel` (`kgroup=G`, default 64; `krot=artifact|none|eigen|hadamard`, default artifact): an
              experiment — keys quantized per channel over groups of G consecutive history tokens
              (KIVI's key codec, `quantize_key_channels`: min/max INT2, fp16 scale and minimum per
              (group, channel); clip 1 with a format-v1 artifact, as in runs 14-15; with an artifact
              calibrated for per-channel keys — codec `key_layout "channel"`, `python -m calibration
              --key-layout channel` — its per-layer key clip ratios (or `clip=`'s), each over a
              channel's G values of a group: k = min(⌊c·G⌋, G − 1)), groups aligned on the history's start (the sink's
              end) and made of whole pages (G a multiple of the page size); values exactly as the
              default (R_V, per-token codec, fitted clip); the same BF16 windows. krot=artifact
              rotates keys (and queries) by the artifact's R_K = U·H·P first, krot=none not at all,
              krot=eigen by U alone (R_K·(H·P)ᵀ, P from the stored key eigenvalues), krot=hadamard
              by H·P alone. `keys=` defaults to the artifact's key layout (`token` for format v1);
              `keys=token` with a per-channel artifact is refused (its key clips are over groups).
              Causality: a history key is read quantized only once its whole group is in the
              history (query t: keys [S0, S0 + G·⌊H_t/G⌋)); the history's trailing partial group
              (0–3 pages at G = 64) is read and counted as BF16 keys. Bytes: per whole group and
              channel G/4 code bytes + 4 (the same 2.5 bits per quantized key element as a
              per-token row at G = D = 64), every other key as a BF16 row.
  int4        Reference point: per-token asymmetric INT4 (16 uniform levels between the group's
              min and max, round to nearest, fp16 scale and minimum per group; G = head_dim by
              default, i.e. 4 + 32/64 = 4.5 bits at D = 64), no rotation, OSCAR's windows.
              `int4:windows=0/0` is plain INT4 per token-head, the upper reference a user would pick.
  turboquant  TurboQuant as vLLM serves it (`--kv-cache-dtype turboquant_<preset>`; read from
              vllm/model_executor/layers/quantization/turboquant/{config,centroids}.py,
              vllm/v1/attention/backends/turboquant_attn.py and
              vllm/v1/attention/ops/triton_turboquant_store.py of github.com/vllm-project/vllm; the
              method is Zandieh et al., "TurboQuant", arXiv:2504.19874, ICLR 2026, and vLLM's
              docstring credits DRIVE/EDEN and HIGGS for the same rotation + scalar grid):
                keys    rotated by the normalised Walsh–Hadamard matrix (vLLM: the same H for every
                        layer and head, no random signs — "sign flips do not improve Lloyd-Max
                        quantization"; `rotation=random` uses a Haar-random orthogonal matrix per
                        (layer, KV head) from `seed`, the paper's random rotation), the unit vector
                        k·H/‖k‖ quantized per coordinate to the nearest of the 2^b Lloyd-Max
                        centroids of N(0, 1/D) (`lloyd_max_gaussian`, solved exactly here; vLLM
                        integrates numerically), ‖k‖ stored in fp16; "_nc" (norm correction):
                        the centroid vector is renormalised to unit length before scaling by ‖k‖.
                        Queries are rotated the same way; scores are computed in rotated space.
                        b = 8 (k8v4): keys stored as FP8 e4m3, no rotation.
                values  not rotated; per token-head asymmetric uniform b-bit: scale = (max − min)
                        /(2^b − 1) (floor 1e-8), code = ⌊(v − min)/scale + 0.5⌋ clamped, scale and
                        min stored in fp16 and read back as fp16.
                tiers   no BF16 windows: vLLM writes a decode step's K/V into the quantized cache
                        before the attention kernel reads it, so query t reads positions 0..t
                        (itself included) dequantized. vLLM always keeps the first 2 and last 2
                        attention layers unquantized (`get_boundary_skip_layers`, unioned into
                        kv_cache_dtype_skip_layers whenever a turboquant dtype is set; "GSM8K
                        drops ~30 points on Qwen3-4B without it"): `skip=N` (default 2, capped at
                        half the layers); those layers store BF16 unrotated K/V.
                bytes   per token-head slot: ⌈D·b_K/8⌉ + 2 (fp16 norm) key bytes (D for FP8 keys),
                        ⌈D·b_V/8⌉ + 4 (fp16 scale, min) value bytes, the slot rounded up to an even
                        size (slot_size_aligned; the pad byte is counted with V). The boundary
                        layers' BF16 bytes are included, so `kv_bytes` is the mean over layers.
              Presets (`preset=NAME`, default 3bit_nc): vLLM's TQ_PRESETS — `3bit_nc` (3-bit keys,
              3-bit values: 3.375 bits in a quantized layer at D = 64), `k3v4_nc`, `4bit_nc`,
              `k8v4` — and `k3v2_nc`, 3-bit keys with 2-bit values (2.5 code bits, 2.875 with
              metadata at D = 64). vLLM ships no 2.5-bit preset: its value path packs only 3 or 4
              bits. The TurboQuant paper's own 2.5-bit setting splits channels into outliers at 3
              bits and the rest at 2 with two TurboQuant instances; k3v2_nc is the nearest
              configuration in vLLM's codec (3-bit-key/2-bit-value is also what several
              third-party TurboQuant caches offer as their smallest preset).

Window options (`windows=S0/W`, `page=N`) use shared_math.tiers, so the tier of every position
is exactly the runtime's: a page of the recent window is demoted when the window reaches
W + page tokens, *after* that step's attention (shared_math.allocator keeps the pre-demotion view
until the step has attended), so query t reads the history of `tier_split(t)` and the new token
t in BF16. `windows=0/0` therefore still holds the up to page newest tokens in BF16 while
attending (the runtime's granularity); `windows=0/0:page=1` quantizes every earlier token (the
page size must be a power of two).

Every BF16 tier holds *rotated* K/V rounded to bfloat16 (as OscarKVCache stores them), so a
rotated method differs from `bf16` by rounding even where nothing is quantized yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Protocol

import numpy as np

from shared_math.codec import decode, decode_channels, encode, encode_channels
from shared_math.hadamard import hadamard_matrix
from shared_math.rotation import bit_reversal_permutation
from shared_math.spec import (
    BF16_BYTES,
    CODES_PER_BYTE,
    DEFAULT_CHANNEL_PAGE_SIZE,
    DEFAULT_K_CLIP_RATIO,
    DEFAULT_PAGE_SIZE,
    DEFAULT_RECENT,
    DEFAULT_SINK,
    DEFAULT_V_CLIP_RATIO,
    FP16_MAX,
    KEY_LAYOUTS,
    LEVELS,
    METADATA_BYTES,
    MIN_GROUP_SIZE,
    OscarConfig,
    clip_index,
    default_group_size,
    is_power_of_two,
    validate_codec_shape,
)
from shared_math.tiers import tier_split

METHOD_NAMES = ("bf16", "naive-int2", "quarot-int2", "kivi2", "oscar", "int4", "turboquant")
DEFAULT_METHODS = ("bf16", "naive-int2", "quarot-int2", "kivi2", "oscar", "int4")
KIVI_GROUP_SIZE = 32  # KIVI's published group size (tokens per key group, channels per value group)
KIVI_RESIDUAL = 128  # KIVI's published full-precision residual length
BF16_BITS = 8 * BF16_BYTES
DEFAULT_SALIENT_WINDOW = 32  # observation window of `salient=N`: the prompt's last W queries (the question)
SALIENT_INDEX_BITS = 32  # position index stored per salient token and (layer, KV head): a conservative cost
KEY_ROTATIONS = ("artifact", "none", "eigen", "hadamard")  # `oscar:krot=` (keys=channel only): the artifact's
# R_K = U·H·P, no key rotation, U alone (the artifact's eigenbasis, R_K·(H·P)ᵀ) or H·P alone (no U)
# `oscar:kgroup=` with a v1 artifact: tokens per per-channel key group, the format's default page for
# per-channel keys (4 emulated pages of 16); a per-channel artifact fixes its own (codec key_group).
DEFAULT_KEY_GROUP = DEFAULT_CHANNEL_PAGE_SIZE


class HistoryIntervals(NamedTuple):
    """Per query position t (int64 [T] each): keys in [k_start[t], k_end[t]) and values in
    [v_start[t], v_end[t]) are read through the quantizer; every other position ≤ t from BF16.

    raw_start (optional, [T]): positions ≥ raw_start[t] are read unrounded (float32) — a prefill
    chunk attending to itself; it must not overlap the history intervals. None: no such region.
    """

    k_start: np.ndarray
    k_end: np.ndarray
    v_start: np.ndarray
    v_end: np.ndarray
    raw_start: np.ndarray | None = None

    def any_history(self) -> bool:
        return bool(np.any(self.k_end > self.k_start) or np.any(self.v_end > self.v_start))


class KVMethod(Protocol):
    name: str
    k_rotation: np.ndarray | None
    v_rotation: np.ndarray | None

    def quantize_keys(self, layer: int, x: np.ndarray) -> np.ndarray: ...
    def quantize_values(self, layer: int, x: np.ndarray) -> np.ndarray: ...
    def history_intervals(self, length: int) -> HistoryIntervals: ...
    def at_rest_history(self, length: int) -> tuple[int, int, int, int]: ...
    def kv_bytes(self, length: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]: ...
    def describe(self) -> dict[str, Any]: ...


def bits_per_element(method: KVMethod, length: int, num_kv_heads: int, head_dim: int) -> float:
    """8 × stored K and V bytes / (2 · length · Hkv · D) — the same for every layer."""
    if length < 1:
        raise ValueError(f"{length=} must be positive")
    k_bytes, v_bytes = method.kv_bytes(length, num_kv_heads, head_dim)
    return 8.0 * (k_bytes + v_bytes) / (2 * length * num_kv_heads * head_dim)


# ---------------------------------------------------------------------------------------------
# Row quantizers: float32 [..., D] → dequantized float32 [..., D], and the bytes of one row.


def _f16(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16)


@dataclasses.dataclass(frozen=True)
class FormatV1Codec:
    """Format v1's INT2 codec (shared_math.codec): clip per row, 4 levels per group of G channels."""

    group_size: int
    k_clip_ratios: tuple[float, ...]  # one per layer
    v_clip_ratios: tuple[float, ...]
    levels: str = "minmax"
    value_levels: str | None = None  # None: the values use `levels` too (one codec, as format v1)

    def __post_init__(self):
        for levels in (self.levels, self.value_levels or self.levels):
            if levels not in LEVELS:
                raise ValueError(f"levels={levels!r} must be one of {LEVELS}")
        for ratio in self.k_clip_ratios + self.v_clip_ratios:
            clip_index(float(ratio), 16)

    def quantize(self, x: np.ndarray, clip_ratio: float, levels: str | None = None) -> np.ndarray:
        g = self.group_size
        levels = levels or self.levels
        return decode(*encode(x, group_size=g, clip_ratio=float(clip_ratio), levels=levels), group_size=g)

    def quantize_keys(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self.quantize(x, self.k_clip_ratios[layer], self.levels)

    def quantize_values(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self.quantize(x, self.v_clip_ratios[layer], self.value_levels or self.levels)

    def row_bytes(self, head_dim: int) -> int:
        validate_codec_shape(head_dim, self.group_size)
        return head_dim // CODES_PER_BYTE + 2 * (head_dim // self.group_size) * METADATA_BYTES

    def describe(self) -> dict[str, Any]:
        ks, vs = sorted(set(self.k_clip_ratios)), sorted(set(self.v_clip_ratios))
        levels = self.levels if self.value_levels in (None, self.levels) else f"{self.levels}/{self.value_levels}"
        return {"codec": "format v1 INT2", "group_size": self.group_size, "levels": levels,
                "k_clip_ratio": ks[0] if len(ks) == 1 else list(self.k_clip_ratios),
                "v_clip_ratio": vs[0] if len(vs) == 1 else list(self.v_clip_ratios)}


@dataclasses.dataclass(frozen=True)
class SymmetricInt2:
    """Naive symmetric 4-level quantizer: s = f16(max|x| / 1.5) per group, levels (j − 1.5)·s."""

    group_size: int

    def quantize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        d = x.shape[-1]
        groups = x.reshape(x.shape[:-1] + (d // self.group_size, self.group_size))
        scale = _f16(np.abs(groups).max(axis=-1, keepdims=True) / np.float32(1.5)).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1))
        codes = np.clip(np.floor(groups / safe + np.float32(2.0)), 0, 3)  # nearest of (j − 1.5)·s
        return ((codes - np.float32(1.5)) * scale).reshape(x.shape).astype(np.float32)

    quantize_keys = quantize_values = lambda self, layer, x: self.quantize(x)  # noqa: E731

    def row_bytes(self, head_dim: int) -> int:
        validate_codec_shape(head_dim, self.group_size)
        return head_dim // CODES_PER_BYTE + (head_dim // self.group_size) * METADATA_BYTES

    def describe(self) -> dict[str, Any]:
        return {"codec": "symmetric INT2, levels {-1.5,-0.5,0.5,1.5}*f16(absmax/1.5)",
                "group_size": self.group_size, "clip": None}


@dataclasses.dataclass(frozen=True)
class AsymmetricInt:
    """Uniform asymmetric quantizer with 2^bits levels: scale = f16((hi − lo)/(2^bits − 1)),
    minimum = f16(lo) per group, code = round((x − minimum)/scale) clamped."""

    bits: int
    group_size: int

    def quantize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        d = x.shape[-1]
        top = np.float32((1 << self.bits) - 1)
        groups = x.reshape(x.shape[:-1] + (d // self.group_size, self.group_size))
        lo, hi = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
        scale = _f16((hi - lo) / top).astype(np.float32)
        minimum = _f16(lo).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1))
        codes = np.clip(np.rint((groups - minimum) / safe), 0, top)
        return (minimum + codes * scale).reshape(x.shape).astype(np.float32)

    quantize_keys = quantize_values = lambda self, layer, x: self.quantize(x)  # noqa: E731

    def row_bytes(self, head_dim: int) -> int:
        if head_dim % self.group_size or (head_dim * self.bits) % 8:
            raise ValueError(f"{head_dim=} must be a multiple of group_size={self.group_size} and hold whole bytes")
        return head_dim * self.bits // 8 + 2 * (head_dim // self.group_size) * METADATA_BYTES

    def describe(self) -> dict[str, Any]:
        return {"codec": f"asymmetric INT{self.bits} min/max, fp16 scale+minimum", "group_size": self.group_size,
                "clip": None}


def _minmax_rows(x: np.ndarray, group_size: int) -> np.ndarray:
    """Format v1's min/max INT2 codec with clip ratio 1 on groups of G values of each row (KIVI's
    asymmetric 2-bit: fp16 scale and minimum per group, nearest of 4 uniform levels)."""
    return decode(*encode(x, group_size=group_size, clip_ratio=1.0, levels="minmax"), group_size=group_size)


def quantize_key_channels(x: np.ndarray, group_size: int, start: int = 0, clip_ratio: float = 1.0) -> np.ndarray:
    """KIVI's key codec, format v2's key pages: per channel over consecutive groups of G tokens from
    position `start` (`shared_math.codec.encode_channels`, min/max levels; clip ratio 1 — KIVI's and
    runs 14-15's — unless given, then over each channel's G values of a group).

    x float32 [B, T, Hkv, D] → the dequantized keys [B, T, Hkv, D]. Positions before `start` and
    those of a trailing partial group are returned unchanged."""
    x = np.asarray(x, np.float32)
    b, t, h, d = x.shape
    start = min(start, t)
    full = ((t - start) // group_size) * group_size
    out = x.copy()
    if full:
        pages = x[:, start:start + full].reshape(b, full // group_size, group_size, h, d).transpose(0, 1, 3, 2, 4)
        decoded = decode_channels(*encode_channels(pages, clip_ratio=clip_ratio, levels="minmax"))  # [B, T/G, Hkv, G, D]
        out[:, start:start + full] = decoded.transpose(0, 1, 3, 2, 4).reshape(b, full, h, d)
    return out


def key_channel_bytes(length: int, quantized: int, group_size: int, head_dim: int) -> int:
    """Key bytes of one KV head for `length` tokens of which `quantized` (a multiple of G) are stored
    per channel in groups of G tokens — per group and channel G/4 code bytes and an fp16 scale and
    minimum — and the rest as BF16 rows."""
    assert quantized % group_size == 0 and 0 <= quantized <= length
    group_bytes = group_size // CODES_PER_BYTE + 2 * METADATA_BYTES
    return (quantized // group_size) * head_dim * group_bytes + (length - quantized) * head_dim * BF16_BYTES


# ---------------------------------------------------------------------------------------------
# Methods


@dataclasses.dataclass(frozen=True)
class Windows:
    """OSCAR-style BF16 windows: sink S0 tokens, recent W tokens, demotion by pages."""

    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    page_size: int = DEFAULT_PAGE_SIZE

    def __post_init__(self):
        OscarConfig(head_dim=16, sink=self.sink, recent=self.recent, page_size=self.page_size)  # validates

    def config(self) -> OscarConfig:
        return OscarConfig(head_dim=16, sink=self.sink, recent=self.recent, page_size=self.page_size)

    def history_counts(self, length: int) -> tuple[int, int]:
        """(first history position, history tokens) of a sequence of `length` tokens."""
        split = tier_split(length, self.config())
        return split.history_start, split.history_tokens


@dataclasses.dataclass(frozen=True, eq=False)
class TieredMethod:
    """Sink + history + recent tiers (OSCAR's layout); history rows through a row quantizer.

    quantizer None means nothing is ever quantized (the BF16 reference)."""

    name: str
    family: str
    quantizer: FormatV1Codec | SymmetricInt2 | AsymmetricInt | None
    windows: Windows = Windows()
    k_rotation: np.ndarray | None = None  # [L, Hkv, D, D]
    v_rotation: np.ndarray | None = None
    rotation: str = "none"
    source: str = ""
    salient: int = 0  # history tokens per (layer, KV head) kept in BF16 for the answer (0: none)
    salient_window: int = DEFAULT_SALIENT_WINDOW  # W: the prompt's last W queries choose them
    key_group: int = 0  # > 0: keys per channel over groups of this many history tokens (`keys=channel`)
    key_clip: tuple[float, ...] | None = None  # per-layer clip ratios of those keys (None: clip 1)

    def __post_init__(self):
        if self.salient < 0 or self.salient_window < 1:
            raise ValueError(f"salient={self.salient} must be ≥ 0 and observe={self.salient_window} ≥ 1")
        if self.salient and self.quantizer is None:
            raise ValueError("salient tokens need a quantized history")
        if self.key_group:
            g, page = self.key_group, self.windows.page_size
            if not is_power_of_two(g) or g < MIN_GROUP_SIZE or g % page:
                raise ValueError(f"kgroup={g} must be a power of two ≥ {MIN_GROUP_SIZE} and a multiple of "
                                 f"page={page} (key groups are whole history pages)")
            if self.quantizer is None:
                raise ValueError("keys=channel needs a quantized history")

    def _key_history(self, first: int, count: int) -> tuple[int, int]:
        """[start, end) of the keys read quantized when the history is [first, first + count):
        with `key_group`, only whole groups (aligned on the history's start) are quantized."""
        if not self.key_group:
            return first, first + count
        return first, first + (count // self.key_group) * self.key_group

    def quantize_keys(self, layer: int, x: np.ndarray) -> np.ndarray:
        if self.key_group:  # KIVI's per-channel codec on groups that start where the history starts
            clip = 1.0 if self.key_clip is None else self.key_clip[layer]
            return quantize_key_channels(x, self.key_group, start=self.windows.sink, clip_ratio=clip)
        return self.quantizer.quantize_keys(layer, x)

    def quantize_values(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self.quantizer.quantize_values(layer, x)

    def history_intervals(self, length: int) -> HistoryIntervals:
        start = np.zeros(length, np.int64)
        end = np.zeros(length, np.int64)
        k_end = np.zeros(length, np.int64)
        if self.quantizer is not None:
            for t in range(length):
                # Decoding t appends token t and attends before the page this append makes due is
                # demoted (the runtime's order), so query t reads the history of the first t tokens.
                first, count = self.windows.history_counts(t)
                start[t], end[t] = first, first + count
                k_end[t] = self._key_history(first, count)[1]
        return HistoryIntervals(start, k_end, start.copy(), end)

    def at_rest_history(self, length: int) -> tuple[int, int, int, int]:
        """(K start, K end, V start, V end) of the history a sequence of `length` tokens stores."""
        if self.quantizer is None:
            return 0, 0, 0, 0
        first, count = self.windows.history_counts(length)
        return (*self._key_history(first, count), first, first + count)

    def kv_bytes(self, length: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
        if self.quantizer is None:
            per_side = length * head_dim * BF16_BYTES
            return per_side * num_kv_heads, per_side * num_kv_heads
        first, history = self.windows.history_counts(length)
        per_side = (length - history) * head_dim * BF16_BYTES + history * self.quantizer.row_bytes(head_dim)
        # salient tokens: a BF16 K and V row each on top of the codes, and one position index
        # (shared by K and V: half its bytes counted on each side)
        per_side += min(self.salient, history) * (head_dim * BF16_BYTES + SALIENT_INDEX_BITS // 16)
        if not self.key_group:
            return per_side * num_kv_heads, per_side * num_kv_heads
        # keys per channel: the whole groups of the history as codes + fp16 scale and minimum per
        # (group, channel); every other key (sink, recent, the history's partial group) as BF16
        start, end = self._key_history(first, history)
        k = key_channel_bytes(length, end - start, self.key_group, head_dim)
        k += min(self.salient, end - start) * (head_dim * BF16_BYTES + SALIENT_INDEX_BITS // 16)
        return k * num_kv_heads, per_side * num_kv_heads

    def describe(self) -> dict[str, Any]:
        out = {"family": self.family, "rotation": self.rotation, "source": self.source}
        if self.quantizer is None:
            out.update(storage="bfloat16 for every token", windows=None)
        else:
            out.update(self.quantizer.describe())
            out["windows"] = {"sink": self.windows.sink, "recent": self.windows.recent,
                              "page_size": self.windows.page_size}
        if self.key_group:
            out["keys"] = (f"per channel over groups of {self.key_group} tokens aligned on the history's start "
                           f"(KIVI's codec: min/max INT2, {'clip 1' if self.key_clip is None else 'the artifact clips'}, "
                           "fp16 scale+minimum per group and channel); a "
                           "history key is read quantized once its whole group is in the history, BF16 until then")
            out["k_clip_ratio"] = 1.0 if self.key_clip is None else list(self.key_clip)
            if self.k_rotation is None:
                out["rotation"] = "values: artifact R_V per layer and KV head; keys: none"
        if self.salient:
            out["salient"] = {"tokens": self.salient, "observe": self.salient_window,
                              "index_bits": SALIENT_INDEX_BITS,
                              "selection": "per (layer, KV head) at the end of the prompt: top tokens of the "
                                           "history by the attention mass of the prompt's last `observe` queries "
                                           "(summed over the KV head's query heads), kept in BF16 for the answer"}
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class KiviMethod:
    """KIVI-2: keys per channel over groups of G tokens, values per token, residual of R tokens."""

    name: str
    group_size: int = KIVI_GROUP_SIZE
    residual: int = KIVI_RESIDUAL
    family: str = "kivi2"
    k_rotation: None = None
    v_rotation: None = None

    def __post_init__(self):
        g, r = self.group_size, self.residual
        if not is_power_of_two(g) or g < 16:
            raise ValueError(f"kivi group_size={g} must be a power of two ≥ 16 (format v1 codec rows)")
        if r < g or r % g:
            raise ValueError(f"kivi residual={r} must be a positive multiple of group_size={g}")

    def quantize_keys(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Per channel over consecutive groups of G tokens from position 0; x [B, T, Hkv, D].

        Tokens of a trailing partial group are returned unchanged (KIVI never quantizes them:
        the residual flushes R tokens at a time and R is a multiple of G)."""
        return quantize_key_channels(x, self.group_size)

    def quantize_values(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Per token over groups of G channels; x [..., D]."""
        x = np.asarray(x, np.float32)
        if x.shape[-1] < self.group_size:
            raise ValueError(f"head_dim={x.shape[-1]} is smaller than kivi group_size={self.group_size}")
        return _minmax_rows(x, self.group_size)

    def history_intervals(self, length: int) -> HistoryIntervals:
        t = np.arange(length, dtype=np.int64)
        zeros = np.zeros(length, np.int64)
        k_end = (t // self.residual) * self.residual  # flushed before step t's attention
        v_end = np.maximum(0, t - self.residual)  # the residual holds R + 1 values during attention
        return HistoryIntervals(zeros, k_end, zeros.copy(), v_end)

    def at_rest_history(self, length: int) -> tuple[int, int, int, int]:
        """After token `length`: every full residual of keys flushed; all but R values quantized."""
        return 0, (length // self.residual) * self.residual, 0, max(0, length - self.residual)

    def kv_bytes(self, length: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
        g, r = self.group_size, self.residual
        if head_dim % g:
            raise ValueError(f"{head_dim=} must be a multiple of kivi group_size={g}")
        k_quant = (length // r) * r  # at rest after token `length`: every full residual flushed
        k = key_channel_bytes(length, k_quant, g, head_dim)
        v_quant = max(0, length - r)
        v_row = head_dim // CODES_PER_BYTE + 2 * (head_dim // g) * METADATA_BYTES
        v = v_quant * v_row + (length - v_quant) * head_dim * BF16_BYTES
        return k * num_kv_heads, v * num_kv_heads

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "rotation": "none", "group_size": self.group_size,
                "residual": self.residual, "windows": None,
                "codec": "asymmetric INT2 min/max (format v1 codec, clip 1), fp16 scale+minimum",
                "keys": f"per channel over groups of {self.group_size} tokens",
                "values": f"per token over groups of {self.group_size} channels",
                "source": "KIVI (Liu et al. 2024), published G=32, R=128; no sink"}


# ---------------------------------------------------------------------------------------------
# TurboQuant (vLLM's turboquant_* KV cache dtypes)

TURBOQUANT_PRESETS = {  # name: (key bits, value bits, norm correction); vLLM's TQ_PRESETS + k3v2_nc
    "3bit_nc": (3, 3, True),
    "k3v4_nc": (3, 4, True),
    "4bit_nc": (4, 4, True),
    "k8v4": (8, 4, False),
    "k3v2_nc": (3, 2, True),
}
TURBOQUANT_DEFAULT_PRESET = "3bit_nc"
TURBOQUANT_BOUNDARY_LAYERS = 2  # vLLM keeps the first and last 2 attention layers unquantized
TURBOQUANT_FP8_KEY_BITS = 8
TURBOQUANT_NORM_BYTES = 2  # fp16 ‖k‖
TURBOQUANT_VALUE_META_BYTES = 4  # fp16 scale + fp16 minimum
TURBOQUANT_MIN_SCALE = 1e-8


def _normal_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


@functools.lru_cache(maxsize=16)
def lloyd_max_gaussian(bits: int, tol: float = 1e-12, max_iter: int = 100_000) -> tuple[np.ndarray, np.ndarray]:
    """The Lloyd-Max (MSE-optimal) scalar quantizer of N(0, 1) with 2^bits levels.

    Returns (centroids float64 [2^bits], boundaries float64 [2^bits − 1]), ascending; boundaries are
    the midpoints of neighbouring centroids. Each centroid is the conditional mean of its cell,
    (φ(a) − φ(b)) / (Φ(b) − Φ(a)) in closed form. Scale by σ for N(0, σ²) (vLLM: σ = 1/√D).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"{bits=} must be in [1, 8]")
    n = 1 << bits
    c = np.linspace(-3.0, 3.0, n)
    for _ in range(max_iter):
        b = (c[:-1] + c[1:]) / 2
        edges = np.concatenate([[-np.inf], b, [np.inf]])
        pdf = np.where(np.isfinite(edges), _normal_pdf(np.where(np.isfinite(edges), edges, 0.0)), 0.0)
        new = (pdf[:-1] - pdf[1:]) / np.diff(_normal_cdf(edges))
        done = np.max(np.abs(new - c)) < tol
        c = new
        if done:
            break
    else:
        raise RuntimeError(f"Lloyd-Max for {bits=} did not converge in {max_iter} iterations")
    c = (c - c[::-1]) / 2  # exactly symmetric
    return c, (c[:-1] + c[1:]) / 2


@dataclasses.dataclass(frozen=True)
class TurboQuantKeys:
    """Keys of a TurboQuant layer, rows already rotated: ‖k‖ in fp16 and each coordinate of k/‖k‖ as
    the index of its nearest Lloyd-Max centroid of N(0, 1/D); FP8 e4m3 when bits = 8."""

    bits: int
    norm_correction: bool

    def quantize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        if self.bits == TURBOQUANT_FP8_KEY_BITS:
            import ml_dtypes

            return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        d = x.shape[-1]
        centroids, boundaries = (a / math.sqrt(d) for a in lloyd_max_gaussian(self.bits))
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        unit = x / np.where(norm > 0, norm, np.float32(1))
        codes = np.searchsorted(boundaries.astype(np.float32), unit, side="right")  # #{boundaries ≤ y}
        y = centroids.astype(np.float32)[codes]
        if self.norm_correction:
            y_norm = np.linalg.norm(y, axis=-1, keepdims=True)
            y = y / np.where(y_norm > 0, y_norm, np.float32(1))
        return (_f16(norm).astype(np.float32) * y).astype(np.float32)

    def row_bytes(self, head_dim: int) -> int:
        if self.bits == TURBOQUANT_FP8_KEY_BITS:
            return head_dim
        return -(-head_dim * self.bits // 8) + TURBOQUANT_NORM_BYTES


@dataclasses.dataclass(frozen=True)
class TurboQuantValues:
    """Values of a TurboQuant layer: per row, 2^bits uniform levels from min to max (fp16 scale and
    minimum), code = ⌊(v − min)/scale + 0.5⌋ — vLLM's _store_quantized_value."""

    bits: int

    def quantize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        top = np.float32((1 << self.bits) - 1)
        lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
        scale = np.maximum((hi - lo) / top, np.float32(TURBOQUANT_MIN_SCALE))
        codes = np.clip(np.floor((x - lo) / scale + np.float32(0.5)), 0, top)
        return (_f16(lo).astype(np.float32) + codes * _f16(scale).astype(np.float32)).astype(np.float32)

    def row_bytes(self, head_dim: int) -> int:
        return -(-head_dim * self.bits // 8) + TURBOQUANT_VALUE_META_BYTES


def turboquant_boundary_layers(num_layers: int, n: int = TURBOQUANT_BOUNDARY_LAYERS) -> frozenset[int]:
    """vLLM's get_boundary_skip_layers for a dense model: the first n and last n layers, n ≤ L // 2."""
    if n <= 0 or num_layers <= 0:
        return frozenset()
    n = min(n, num_layers // 2)
    return frozenset(range(n)) | frozenset(range(num_layers - n, num_layers))


def _haar_rotations(num_layers: int, num_kv_heads: int, head_dim: int, seed: int) -> np.ndarray:
    """Haar-random orthogonal matrices [L, Hkv, D, D] (QR of a Gaussian matrix, signs fixed by diag R)."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((num_layers, num_kv_heads, head_dim, head_dim)))
    signs = np.sign(np.diagonal(r, axis1=-2, axis2=-1))
    return (q * np.where(signs == 0, 1.0, signs)[..., None, :]).astype(np.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class TurboQuantMethod:
    """vLLM's TurboQuant KV cache: every token quantized on write, boundary layers in BF16."""

    name: str
    preset: str
    keys: TurboQuantKeys
    values: TurboQuantValues
    num_layers: int
    skip_layers: frozenset[int]
    k_rotation: np.ndarray | None  # [L, Hkv, D, D]; identity on skipped layers
    rotation: str = "hadamard"
    family: str = "turboquant"
    v_rotation: None = None

    def quantize_keys(self, layer: int, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float32) if layer in self.skip_layers else self.keys.quantize(x)

    def quantize_values(self, layer: int, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float32) if layer in self.skip_layers else self.values.quantize(x)

    def history_intervals(self, length: int) -> HistoryIntervals:
        zeros = np.zeros(length, np.int64)
        end = np.arange(1, length + 1, dtype=np.int64)  # the new token is stored before it is read
        return HistoryIntervals(zeros, end, zeros.copy(), end.copy())

    def at_rest_history(self, length: int) -> tuple[int, int, int, int]:
        return 0, length, 0, length

    def slot_bytes(self, head_dim: int) -> tuple[int, int]:
        """(key, value) bytes of one token-head slot of a quantized layer; the even-size pad goes to V."""
        k, v = self.keys.row_bytes(head_dim), self.values.row_bytes(head_dim)
        return k, v + (k + v) % 2

    def kv_bytes(self, length: int, num_kv_heads: int, head_dim: int) -> tuple[float, float]:
        """Mean over layers of the K and V bytes one layer stores (boundary layers store BF16)."""
        k_row, v_row = self.slot_bytes(head_dim)
        bf16_row = head_dim * BF16_BYTES
        skipped = len(self.skip_layers)
        quantized = self.num_layers - skipped

        def mean(row):
            return length * num_kv_heads * (quantized * row + skipped * bf16_row) / self.num_layers

        return mean(k_row), mean(v_row)

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "preset": f"turboquant_{self.preset}", "rotation": self.rotation,
                "key_bits": self.keys.bits, "value_bits": self.values.bits,
                "norm_correction": self.keys.norm_correction, "windows": None,
                "skip_layers": sorted(self.skip_layers),
                "codec": ("keys: FP8 e4m3" if self.keys.bits == TURBOQUANT_FP8_KEY_BITS else
                          f"keys: rotation + {self.keys.bits}-bit Lloyd-Max of N(0,1/D) on k/|k|, fp16 |k|")
                         + f"; values: {self.values.bits}-bit uniform min/max per token-head, fp16 scale+min",
                "source": "vLLM turboquant_* KV cache dtypes (TurboQuant, Zandieh et al., arXiv:2504.19874)"}


# ---------------------------------------------------------------------------------------------
# Spec parsing

_OPTIONS = {
    "bf16": set(),
    "naive-int2": {"windows", "page", "group"},
    "int4": {"windows", "page", "group"},
    "quarot-int2": {"windows", "page", "group", "clip", "levels"},
    "oscar": {"windows", "page", "group", "clip", "levels", "artifact", "salient", "observe", "keys", "kgroup",
              "krot"},
    "kivi2": {"group", "residual"},
    "turboquant": {"preset", "skip", "rotation", "seed"},
}


def _pair(text: str, kind, key: str):
    parts = text.split("/")
    if len(parts) != 2:
        raise ValueError(f"method option {key}={text!r} must be two values 'a/b'")
    try:
        return kind(parts[0]), kind(parts[1])
    except ValueError:
        raise ValueError(f"method option {key}={text!r}: not two {kind.__name__} values") from None


def _int(text: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"method option {key}={text!r} must be an integer") from None


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'oscar:windows=0/0:levels=moments' → ('oscar', {'windows': '0/0', 'levels': 'moments'})."""
    name, *items = spec.strip().split(":")
    if name not in _OPTIONS:
        raise ValueError(f"unknown method {name!r} in {spec!r}: known methods are {list(METHOD_NAMES)}")
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ValueError(f"method option {item!r} in {spec!r} must be key=value")
        if key not in _OPTIONS[name]:
            raise ValueError(f"method {name!r} has no option {key!r} (options: {sorted(_OPTIONS[name]) or 'none'})")
        options[key] = value
    return name, options


def parse_method_list(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise ValueError("--methods names no method")
    if len(set(specs)) != len(specs):
        raise ValueError(f"--methods lists a method twice: {specs}")
    for spec in specs:
        parse_spec(spec)
    return specs


def _windows(options: dict[str, str]) -> Windows:
    sink, recent = _pair(options["windows"], int, "windows") if "windows" in options else (DEFAULT_SINK, DEFAULT_RECENT)
    page = _int(options["page"], "page") if "page" in options else DEFAULT_PAGE_SIZE
    return Windows(sink, recent, page)


def _hadamard_rotations(num_layers: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
    h = hadamard_matrix(head_dim, np.float32)
    return np.broadcast_to(h, (num_layers, num_kv_heads, head_dim, head_dim)).copy()


def hadamard_permutations(k_eigenvalues: np.ndarray) -> np.ndarray:
    """H·P per (layer, KV head), float64 [L, Hkv, D, D]: the normalised Hadamard times the bit-reversal
    placement of that head's key eigenvalues (ascending, as the artifact stores them) — R_K without U."""
    eig = np.asarray(k_eigenvalues, np.float64)
    h = hadamard_matrix(eig.shape[-1])
    out = np.empty(eig.shape + (eig.shape[-1],))
    for index in np.ndindex(*eig.shape[:-1]):
        out[index] = h @ bit_reversal_permutation(eig[index])
    return out


def key_rotations(artifact, krot: str) -> np.ndarray | None:
    """The key rotation of `oscar:keys=channel:krot=…`, float32 [L, Hkv, D, D] (None for krot=none).

    artifact: R_K = U·H·P as stored; eigen: U = R_K·(H·P)ᵀ, the eigenbasis of the artifact's key
    calibration target (H·P orthogonal, P from the stored eigenvalues as at calibration), computed
    in float64; hadamard: H·P alone."""
    if krot == "none":
        return None
    if krot == "artifact":
        return np.asarray(artifact.k_rotation, np.float32)
    hp = hadamard_permutations(artifact.k_eigenvalues)
    if krot == "hadamard":
        return hp.astype(np.float32)
    if krot == "eigen":
        r = np.asarray(artifact.k_rotation, np.float64)
        return (r @ np.swapaxes(hp, -1, -2)).astype(np.float32)
    raise ValueError(f"krot={krot!r} must be one of {list(KEY_ROTATIONS)}")


_KEY_ROTATION_NAMES = {"eigen": "U of R_K = U·H·P", "hadamard": "H·P of R_K (no U)"}  # describe()'s words


def _codec_from(options, artifact, num_layers: int, head_dim: int) -> FormatV1Codec:
    if artifact is not None:
        group, levels = artifact.group_size, artifact.levels
        k_clip = tuple(float(c) for c in artifact.k_clip_ratio)
        v_clip = tuple(float(c) for c in artifact.v_clip_ratio)
    else:
        group, levels = default_group_size(head_dim), "minmax"
        k_clip, v_clip = (DEFAULT_K_CLIP_RATIO,) * num_layers, (DEFAULT_V_CLIP_RATIO,) * num_layers
    if "group" in options:
        group = _int(options["group"], "group")
    value_levels = None
    if "levels" in options:  # one for both, or keys/values ("minmax/moments")
        levels, value_levels = _pair(options["levels"], str, "levels") if "/" in options["levels"] \
            else (options["levels"], None)
    if "clip" in options:
        kc, vc = _pair(options["clip"], float, "clip")
        k_clip, v_clip = (kc,) * num_layers, (vc,) * num_layers
    validate_codec_shape(head_dim, group)
    return FormatV1Codec(group, k_clip, v_clip, levels, value_levels)


def _turboquant(spec: str, options: dict[str, str], num_layers: int, num_kv_heads: int,
                head_dim: int) -> TurboQuantMethod:
    preset = options.get("preset", TURBOQUANT_DEFAULT_PRESET)
    if preset not in TURBOQUANT_PRESETS:
        raise ValueError(f"turboquant preset={preset!r} must be one of {list(TURBOQUANT_PRESETS)}")
    key_bits, value_bits, norm_correction = TURBOQUANT_PRESETS[preset]
    skip = _int(options.get("skip", str(TURBOQUANT_BOUNDARY_LAYERS)), "skip")
    if skip < 0:
        raise ValueError(f"turboquant skip={skip} must be ≥ 0")
    rotation = options.get("rotation", "hadamard")
    if rotation not in ("hadamard", "random"):
        raise ValueError(f"turboquant rotation={rotation!r} must be 'hadamard' or 'random'")
    if "seed" in options and rotation != "random":
        raise ValueError("turboquant seed= applies only to rotation=random")
    if (head_dim * value_bits) % 8 or (key_bits != TURBOQUANT_FP8_KEY_BITS and (head_dim * key_bits) % 8):
        raise ValueError(f"turboquant_{preset} needs {head_dim=} to pack into whole bytes")
    skipped = turboquant_boundary_layers(num_layers, skip)
    if key_bits == TURBOQUANT_FP8_KEY_BITS:
        k_rotation, rotation = None, "none (FP8 keys)"
    else:
        if rotation == "hadamard":
            k_rotation = _hadamard_rotations(num_layers, num_kv_heads, head_dim)
        else:
            k_rotation = _haar_rotations(num_layers, num_kv_heads, head_dim, _int(options.get("seed", "0"), "seed"))
        for layer in skipped:
            k_rotation[layer] = np.eye(head_dim, dtype=np.float32)
    return TurboQuantMethod(spec, preset, TurboQuantKeys(key_bits, norm_correction), TurboQuantValues(value_bits),
                            num_layers, skipped, k_rotation, rotation)


def parse_method(spec: str, *, num_layers: int, num_kv_heads: int, head_dim: int, artifact=None,
                 load_artifact=None) -> KVMethod:
    """Build a method from its spec; `artifact` (a RotationArtifact) is required by 'oscar'.
    `oscar:artifact=DIR` uses the artifact in DIR instead (loaded by `load_artifact(DIR)`, which
    validates it against the model), so artifacts can be compared on the same windows or samples."""
    name, options = parse_spec(spec)
    if "artifact" in options:
        if load_artifact is None:
            raise ValueError(f"method {spec!r}: this command cannot load another artifact")
        artifact = load_artifact(options["artifact"])
    if name == "bf16":
        return TieredMethod(spec, name, None, source="no quantization: the BF16 cache")
    if name == "kivi2":
        return KiviMethod(spec, group_size=_int(options.get("group", str(KIVI_GROUP_SIZE)), "group"),
                          residual=_int(options.get("residual", str(KIVI_RESIDUAL)), "residual"))
    if name == "turboquant":
        return _turboquant(spec, options, num_layers, num_kv_heads, head_dim)
    windows = _windows(options)
    if name in ("naive-int2", "int4"):
        group = _int(options["group"], "group") if "group" in options else head_dim
        if name == "naive-int2":
            validate_codec_shape(head_dim, group)
            quantizer = SymmetricInt2(group)
            source = "per-token symmetric INT2, no rotation, no clip"
        else:
            if group < 1 or head_dim % group:
                raise ValueError(f"int4 group={group} must divide {head_dim=}")
            quantizer = AsymmetricInt(4, group)
            source = "per-token asymmetric INT4 reference point, no rotation"
        return TieredMethod(spec, name, quantizer, windows, source=source)
    codec = _codec_from(options, artifact, num_layers, head_dim)
    if name == "quarot-int2":
        rot = _hadamard_rotations(num_layers, num_kv_heads, head_dim)
        return TieredMethod(spec, name, codec, windows, rot, rot, rotation="hadamard (K and V)",
                            source="QuaRot-style Hadamard rotation; codec and windows of the oscar method")
    if artifact is None:
        raise ValueError(f"method {spec!r} needs a calibration artifact (--artifact DIR)")
    salient = _int(options.get("salient", "0"), "salient")
    observe = _int(options.get("observe", str(DEFAULT_SALIENT_WINDOW)), "observe")
    if "observe" in options and not salient:
        raise ValueError(f"method {spec!r}: observe= applies only with salient=N > 0")
    keys = options.get("keys", artifact.key_layout)
    if keys == "token" and artifact.key_layout == "channel":
        raise ValueError(f"method {spec!r}: keys=token with an artifact calibrated for per-channel keys "
                         "(its key clip ratios are over a channel's group of tokens)")
    if keys not in KEY_LAYOUTS:
        raise ValueError(f"method {spec!r}: keys={keys!r} must be one of {list(KEY_LAYOUTS)}")
    if keys != "channel" and ("kgroup" in options or "krot" in options):
        raise ValueError(f"method {spec!r}: kgroup= and krot= apply only with keys=channel")
    # An artifact calibrated for per-channel keys fixes the group its key clips were fitted over.
    default_group = artifact.key_group if artifact.key_layout == "channel" else DEFAULT_KEY_GROUP
    key_group = _int(options.get("kgroup", str(default_group)), "kgroup") if keys == "channel" else 0
    if key_group and artifact.key_layout == "channel" and key_group != artifact.key_group:
        raise ValueError(f"method {spec!r}: kgroup={key_group} with an artifact whose key clip ratios were fitted "
                         f"over groups of {artifact.key_group} tokens (codec key_group)")
    krot = options.get("krot", "artifact")
    if krot not in KEY_ROTATIONS:
        raise ValueError(f"method {spec!r}: krot={krot!r} must be one of {list(KEY_ROTATIONS)}")
    k_rotation = key_rotations(artifact, krot) if key_group else np.asarray(artifact.k_rotation, np.float32)
    rotation = "artifact (R_K, R_V per layer and KV head)"
    if key_group and krot in _KEY_ROTATION_NAMES:
        rotation = (f"values: artifact R_V per layer and KV head; keys: {_KEY_ROTATION_NAMES[krot]} "
                    "per layer and KV head")
    return TieredMethod(spec, name, codec, windows, k_rotation,
                        np.asarray(artifact.v_rotation, np.float32), rotation=rotation,
                        source="OSCAR: artifact rotations, clip ratios and codec", salient=salient,
                        salient_window=observe, key_group=key_group,
                        key_clip=codec.k_clip_ratios if key_group and artifact.key_layout == "channel" else None)


def salient_positions(q_window: np.ndarray, keys: np.ndarray, candidates: tuple[int, int], n: int) -> np.ndarray:
    """The `salient=N` selection of one layer: int64 [B, Hkv, min(n, end − start)] positions, each
    row ascending.

    q_window float32 [B, W, Hq, D]: the queries of the prompt's last W positions P − W..P − 1
    (rotated like the keys); keys [B, P, Hkv, D]: the prompt's keys as the cache holds them (BF16).
    Float32 math: each window row's causal softmax over keys 0..its position, summed over the
    rows and the Hq / Hkv query heads of each KV head; the top n positions of [start, end) by
    that mass (ties: the earlier position)."""
    b, w, hq, d = q_window.shape
    p, kv = keys.shape[1], keys.shape[2]
    start, end = candidates
    if not 0 <= start <= end <= p or w > p:
        raise ValueError(f"candidates {candidates} / window {w} must lie within the prompt's {p} tokens")
    n = min(n, end - start)
    if n <= 0:
        return np.zeros((b, kv, 0), np.int64)
    import jax
    import jax.numpy as jnp

    q = jnp.asarray(q_window, jnp.float32).reshape(b, w, kv, hq // kv, d)
    scores = jnp.einsum("bwkgd,bskd->bkgws", q, jnp.asarray(keys, jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * np.float32(d**-0.5)
    causal = np.arange(p)[None, :] <= np.arange(p - w, p)[:, None]  # [W, P]
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    mass = np.asarray(probs.sum(axis=(2, 3)))[:, :, start:end]  # [B, Hkv, end − start]
    order = np.argsort(-mass, axis=-1, kind="stable")[:, :, :n]
    return np.sort(order, axis=-1).astype(np.int64) + start
