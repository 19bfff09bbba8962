"""Format constants and the validated cache configuration.

Every constant of the format lives here (and in FORMAT.md); kernels receive them as static
arguments. Changing any of them, or the codec's arithmetic, is a FORMAT_VERSION bump. Version 2
adds one choice to version 1, keys quantized per channel over each history page
(`key_layout="channel"`); a configuration that does not use it is version 1, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

FORMAT_VERSION = 2  # the newest version this library reads and writes
READABLE_FORMAT_VERSIONS = (1, 2)
# How history keys are grouped for their scale and minimum: "token" (v1: groups of G channels of
# one token, as values always are) or "channel" (v2: each channel over the page's tokens, KIVI's
# key grouping, which keeps a needle's key where per-token groups lose it; calibration/HISTORY.md
# runs 14-15).
KEY_LAYOUTS = ("token", "channel")

CODE_BITS = 2  # bits per stored code
NUM_LEVELS = 1 << CODE_BITS  # 4 quantization levels
CODES_PER_BYTE = 8 // CODE_BITS  # 4 codes per byte, "quartered" packing
CODE_MASK = NUM_LEVELS - 1  # 0b11
# Not stored: how both backends' attention kernels turn a code into a bfloat16 dot operand with
# one integer op. 0x4300 is the bfloat16 bit pattern of 128.0; OR-ing a code into its mantissa
# gives exactly 128 + c·2^place (shared_math.ptx), and the kernels subtract the 128 back in the
# minimum terms.
BF16_CODE_BIAS_BITS = 0x4300
BF16_CODE_BIAS = 128.0

FP16_MAX = 65504.0  # largest finite float16: the sanitize clamp and the metadata saturation
METADATA_DTYPE = "float16"
METADATA_BYTES = 2  # float16 scale and float16 minimum
BF16_BYTES = 2

MIN_HEAD_DIM = 16
MIN_GROUP_SIZE = 16

# levels="moments": scale = mean absolute deviation × b; b ≈ sqrt(pi/2) turns a Gaussian's MAD
# into its σ, and the four levels sit at μ ± σ·{0.5, 1.5}.
MOMENTS_MAD_TO_SIGMA = 1.25
LEVELS = ("minmax", "moments")

DEFAULT_GROUP_SIZE_MAX = 128  # G = min(head_dim, 128)
DEFAULT_K_CLIP_RATIO = 0.96
DEFAULT_V_CLIP_RATIO = 0.92
DEFAULT_SINK = 64
DEFAULT_RECENT = 256
DEFAULT_PAGE_SIZE = 16
# key_layout "channel": a key page is one group per channel, so the page sets the key bits (2 + 32/page):
# 64 tokens give 2.5 bits, the groups per-channel keys were measured with (calibration/HISTORY.md run 14).
DEFAULT_CHANNEL_PAGE_SIZE = 64


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def default_group_size(head_dim: int) -> int:
    return min(head_dim, DEFAULT_GROUP_SIZE_MAX)


def clip_index(clip_ratio: float, head_dim: int) -> int:
    """The 0-based order statistic of |x| used as the clip threshold: min(floor(c·d), d−1).

    Computed once on the host; kernels receive the integer.
    """
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"{head_dim=} must be a positive integer")
    if not (isinstance(clip_ratio, (int, float)) and 0.0 < float(clip_ratio) <= 1.0):
        raise ValueError(f"{clip_ratio=} must be a number in (0, 1]")
    return min(int(math.floor(float(clip_ratio) * head_dim)), head_dim - 1)


def validate_codec_shape(head_dim: int, group_size: int) -> None:
    """Raise ValueError unless (head_dim, group_size) is a format v1 shape."""
    if not is_power_of_two(head_dim) or head_dim < MIN_HEAD_DIM:
        raise ValueError(f"{head_dim=} must be a power of two >= {MIN_HEAD_DIM}")
    if not is_power_of_two(group_size) or not MIN_GROUP_SIZE <= group_size <= head_dim:
        raise ValueError(
            f"{group_size=} must be a power of two with {MIN_GROUP_SIZE} <= group_size <= {head_dim=}"
        )


def validate_levels(levels: str) -> None:
    if levels not in LEVELS:
        raise ValueError(f"{levels=} must be one of {LEVELS}")


def validate_key_layout(key_layout: str) -> None:
    if key_layout not in KEY_LAYOUTS:
        raise ValueError(f"{key_layout=} must be one of {KEY_LAYOUTS}")


def require_token_keys(config: "OscarConfig", cache: str) -> None:
    """Refuse format v2's per-channel keys in a cache that does not store them yet."""
    if config.key_layout != "token":
        raise NotImplementedError(
            f"{cache} stores keys per token (format v1); key_layout={config.key_layout!r} (format v2) is "
            "specified in FORMAT.md with its reference in shared_math.codec.encode_channels, and no "
            "cache writes it yet")


def format_version_of(key_layout: str) -> int:
    """The oldest format version that stores `key_layout`: what a writer records, so that a v1
    configuration keeps writing v1 bytes and metadata."""
    validate_key_layout(key_layout)
    return 1 if key_layout == "token" else 2


def check_format_version(version: Any, key_layout: str) -> None:
    """Raise ValueError unless `version` is readable and can hold `key_layout`."""
    if isinstance(version, bool) or version not in READABLE_FORMAT_VERSIONS:
        raise ValueError(f"format_version={version!r}: this library reads versions {READABLE_FORMAT_VERSIONS}")
    if version < format_version_of(key_layout):
        raise ValueError(f"format_version={version} cannot hold {key_layout=} (it needs version "
                         f"{format_version_of(key_layout)})")


@dataclasses.dataclass(frozen=True)
class OscarConfig:
    """Everything that fixes the bytes of a cache: codec shape, clipping, tiers and pages."""

    head_dim: int
    group_size: int | None = None  # None → min(head_dim, 128)
    k_clip_ratio: float = DEFAULT_K_CLIP_RATIO
    v_clip_ratio: float = DEFAULT_V_CLIP_RATIO
    levels: str = "minmax"
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    page_size: int = DEFAULT_PAGE_SIZE
    metadata_dtype: str = METADATA_DTYPE
    key_layout: str = "token"  # "channel" (format v2): history keys per channel over each page

    def __post_init__(self):
        if self.group_size is None:
            object.__setattr__(self, "group_size", default_group_size(self.head_dim))
        validate_codec_shape(self.head_dim, self.group_size)
        clip_index(self.k_clip_ratio, self.head_dim)
        clip_index(self.v_clip_ratio, self.head_dim)
        validate_levels(self.levels)
        if not is_power_of_two(self.page_size):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        for name in ("sink", "recent"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0 or value % self.page_size:
                raise ValueError(
                    f"{name}={value} must be a non-negative multiple of page_size={self.page_size}"
                )
        if self.metadata_dtype != METADATA_DTYPE:
            raise NotImplementedError(
                f"metadata_dtype={self.metadata_dtype!r}: the format stores {METADATA_DTYPE} only"
            )
        validate_key_layout(self.key_layout)
        if self.key_layout == "channel":
            # A page's keys are one group per channel: the page is the group, as G is for a row.
            if self.page_size < MIN_GROUP_SIZE:
                raise ValueError(f"key_layout='channel' groups each channel over a page: page_size="
                                 f"{self.page_size} must be >= {MIN_GROUP_SIZE}")
            clip_index(self.k_clip_ratio, self.page_size)

    @classmethod
    def from_artifact(cls, artifact, *, group_size: int | None = None, sink: int | None = None,
                      recent: int | None = None, page_size: int | None = None) -> "OscarConfig":
        """The cache configuration a runtime builds from a rotation artifact
        (shared_math.artifact.RotationArtifact): head_dim, codec (group size, levels, key layout)
        and clip ratios from the artifact, tiers from the arguments (None: the defaults; for
        per-channel keys the page is the artifact's key_group, the tokens its key clips were fitted
        over, and another page_size is refused; group_size None: the artifact's). The clip ratios
        here are layer 0's; per-layer ratios travel with the cache's pools, which every runtime
        fills from the artifact's arrays."""
        head_dim = artifact.model.head_dim
        defaults = cls(head_dim=head_dim)
        if artifact.key_layout == "channel":
            if page_size not in (None, artifact.key_group):
                raise ValueError(f"page_size={page_size}: the artifact's key clip ratios were fitted over groups of "
                                 f"{artifact.key_group} tokens (codec key_group), and per-channel keys are grouped "
                                 f"over a page; use page_size={artifact.key_group} or calibrate for {page_size}")
            page_size = artifact.key_group
        return cls(
            head_dim=head_dim,
            group_size=group_size or artifact.group_size,
            k_clip_ratio=float(artifact.k_clip_ratio[0]),
            v_clip_ratio=float(artifact.v_clip_ratio[0]),
            levels=artifact.levels,
            sink=defaults.sink if sink is None else sink,
            recent=defaults.recent if recent is None else recent,
            page_size=page_size or defaults.page_size,
            key_layout=artifact.key_layout,
        )

    @property
    def format_version(self) -> int:
        return format_version_of(self.key_layout)

    @property
    def k_clip_index(self) -> int:
        return self.k_clip_index_for(self.k_clip_ratio)

    def k_clip_index_for(self, clip_ratio: float) -> int:
        """A key clip ratio's index: keys clip per token over d channels, or (key_layout "channel")
        per channel over a page's tokens."""
        return clip_index(clip_ratio, self.head_dim if self.key_layout == "token" else self.page_size)

    @property
    def v_clip_index(self) -> int:
        return clip_index(self.v_clip_ratio, self.head_dim)

    @property
    def groups_per_row(self) -> int:
        return self.head_dim // self.group_size

    @property
    def packed_row_bytes(self) -> int:
        return self.head_dim // CODES_PER_BYTE

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.key_layout == "token":
            del data["key_layout"]  # a v1 configuration serializes exactly as version 1 did
        return {"format_version": self.format_version, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OscarConfig":
        data = dict(data)
        version = data.pop("format_version", 1)
        check_format_version(version, data.get("key_layout", "token"))
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown OscarConfig fields {unknown}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "OscarConfig":
        return cls.from_dict(json.loads(text))
