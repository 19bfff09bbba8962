"""Format v1 constants and the validated cache configuration.

Every constant of the format lives here (and in FORMAT.md); kernels receive them as static
arguments. Changing any of them, or the codec's arithmetic, is a FORMAT_VERSION bump.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

FORMAT_VERSION = 1

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
                f"metadata_dtype={self.metadata_dtype!r}: format v1 stores {METADATA_DTYPE} only"
            )

    @classmethod
    def from_artifact(cls, artifact, *, group_size: int | None = None, sink: int | None = None,
                      recent: int | None = None, page_size: int | None = None) -> "OscarConfig":
        """The cache configuration a runtime builds from a rotation artifact
        (shared_math.artifact.RotationArtifact): head_dim, codec (group size, levels) and clip
        ratios from the artifact, tiers from the arguments (None: the defaults; group_size None:
        the artifact's). The clip ratios here are layer 0's; per-layer ratios travel with the
        cache's pools, which every runtime fills from the artifact's arrays."""
        head_dim = artifact.model.head_dim
        defaults = cls(head_dim=head_dim)
        return cls(
            head_dim=head_dim,
            group_size=group_size or artifact.group_size,
            k_clip_ratio=float(artifact.k_clip_ratio[0]),
            v_clip_ratio=float(artifact.v_clip_ratio[0]),
            levels=artifact.levels,
            sink=defaults.sink if sink is None else sink,
            recent=defaults.recent if recent is None else recent,
            page_size=page_size or defaults.page_size,
        )

    @property
    def k_clip_index(self) -> int:
        return clip_index(self.k_clip_ratio, self.head_dim)

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
        return {"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OscarConfig":
        data = dict(data)
        version = data.pop("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"format_version={version!r}: this library reads version {FORMAT_VERSION}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown OscarConfig fields {unknown}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "OscarConfig":
        return cls.from_dict(json.loads(text))
