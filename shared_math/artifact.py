"""The one reader and writer of the rotation artifact (DESIGN.md §2, FORMAT.md §Artifact).

One `.safetensors` file — no pickle — holding float32 tensors
  k_rotation, v_rotation      [L, Hkv, D, D]   orthogonal, row-vector convention (k' = k·R)
  k_eigenvalues, v_eigenvalues [L, Hkv, D]     ascending (numpy eigh order)
  k_clip_ratio, v_clip_ratio  [L]              in (0, 1]
and string metadata: format_version, model (shape fingerprint), codec (group_size, levels, and
key_layout when it is format v2's "channel"), provenance (command, data, tokens, seed, git sha, …), each JSON.
Everything is validated on write and on read; each failure raises ArtifactError naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from shared_math.spec import (
    DEFAULT_CHANNEL_PAGE_SIZE,
    KEY_LAYOUTS,
    LEVELS,
    MIN_GROUP_SIZE,
    READABLE_FORMAT_VERSIONS,
    check_format_version,
    format_version_of,
    validate_codec_shape,
)

ARTIFACT_FILENAME = "oscar_rotations.safetensors"
ORTHOGONALITY_TOLERANCE = 1e-4  # max |RᵀR − I| for float32 rotations
ROTATION_TENSORS = ("k_rotation", "v_rotation")
EIGENVALUE_TENSORS = ("k_eigenvalues", "v_eigenvalues")
CLIP_TENSORS = ("k_clip_ratio", "v_clip_ratio")
TENSOR_NAMES = ROTATION_TENSORS + EIGENVALUE_TENSORS + CLIP_TENSORS
METADATA_KEYS = ("format_version", "model", "codec", "provenance")


class ArtifactError(ValueError):
    """A rotation artifact that is missing, corrupt, inconsistent or for another model."""


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """The model shape an artifact was calibrated for."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArtifactError(f"model fingerprint {field.name}={value!r} must be a positive integer")
        if self.num_q_heads % self.num_kv_heads:
            raise ArtifactError(
                f"model fingerprint num_q_heads={self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class RotationArtifact:
    k_rotation: np.ndarray
    v_rotation: np.ndarray
    k_eigenvalues: np.ndarray
    v_eigenvalues: np.ndarray
    k_clip_ratio: np.ndarray
    v_clip_ratio: np.ndarray
    model: ModelFingerprint
    codec: dict[str, Any]  # {"group_size": G, "levels": "minmax" | "moments"[, "key_layout": "channel", "key_group": page]}
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def group_size(self) -> int:
        return int(self.codec["group_size"])

    @property
    def levels(self) -> str:
        return str(self.codec["levels"])

    @property
    def key_layout(self) -> str:
        return str(self.codec.get("key_layout", "token"))

    @property
    def key_group(self) -> int | None:
        """Per-channel keys: the tokens a key clip ratio was fitted over (the cache's page; artifacts
        written before the field: DEFAULT_CHANNEL_PAGE_SIZE, calibration's default then). None for v1."""
        if self.key_layout == "token":
            return None
        return int(self.codec.get("key_group", DEFAULT_CHANNEL_PAGE_SIZE))

    def tensors(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in TENSOR_NAMES}


def artifact_file(path: str | Path) -> Path:
    """A directory means the artifact file inside it; a file path is used as is."""
    path = Path(path)
    return path / ARTIFACT_FILENAME if path.is_dir() else path


def validate_artifact(artifact: RotationArtifact, expected_model: ModelFingerprint | None = None) -> None:
    """Raise ArtifactError for the first inconsistency found."""
    m = artifact.model
    if not isinstance(m, ModelFingerprint):
        raise ArtifactError(f"model must be a ModelFingerprint, got {type(m).__name__}")
    if expected_model is not None and m != expected_model:
        raise ArtifactError(f"artifact was calibrated for {m}, but the model is {expected_model}")
    shapes = {
        **{n: (m.num_layers, m.num_kv_heads, m.head_dim, m.head_dim) for n in ROTATION_TENSORS},
        **{n: (m.num_layers, m.num_kv_heads, m.head_dim) for n in EIGENVALUE_TENSORS},
        **{n: (m.num_layers,) for n in CLIP_TENSORS},
    }
    for name, shape in shapes.items():
        value = getattr(artifact, name)
        if not isinstance(value, np.ndarray):
            raise ArtifactError(f"{name} must be a numpy array, got {type(value).__name__}")
        if value.dtype != np.float32:
            raise ArtifactError(f"{name} must be float32, got {value.dtype}")
        if value.shape != shape:
            raise ArtifactError(f"{name} has shape {value.shape}, expected {shape} for {m}")
        if not np.all(np.isfinite(value)):
            raise ArtifactError(f"{name} has non-finite entries")
    eye = np.eye(m.head_dim)
    for name in ROTATION_TENSORS:
        r = getattr(artifact, name).astype(np.float64)
        err = np.abs(np.swapaxes(r, -1, -2) @ r - eye).max(axis=(-1, -2))
        if err.max() > ORTHOGONALITY_TOLERANCE:
            layer, head = np.unravel_index(int(err.argmax()), err.shape)
            raise ArtifactError(
                f"{name}[layer {layer}, kv head {head}] is not orthogonal: max |RᵀR − I| = "
                f"{err.max():.3g} > {ORTHOGONALITY_TOLERANCE}"
            )
    for name in EIGENVALUE_TENSORS:
        if np.any(np.diff(getattr(artifact, name), axis=-1) < 0):
            raise ArtifactError(f"{name} must be ascending along the last axis (numpy eigh order)")
    for name in CLIP_TENSORS:
        value = getattr(artifact, name)
        if np.any(value <= 0) or np.any(value > 1):
            raise ArtifactError(f"{name} must lie in (0, 1], got min {value.min()} max {value.max()}")
    codec = artifact.codec
    if not isinstance(codec, dict) or not {"group_size", "levels"} <= set(codec) <= {"group_size", "levels",
                                                                                     "key_layout", "key_group"}:
        raise ArtifactError(f"codec metadata must be {{'group_size', 'levels'[, 'key_layout', 'key_group']}}, "
                            f"got {codec!r}")
    if codec.get("key_layout", "token") not in KEY_LAYOUTS:
        raise ArtifactError(f"codec key_layout={codec['key_layout']!r} must be one of {KEY_LAYOUTS}")
    if "key_group" in codec:
        group = codec["key_group"]
        if codec.get("key_layout", "token") != "channel":
            raise ArtifactError(f"codec key_group={group!r} needs key_layout 'channel' (keys per channel)")
        if (isinstance(group, bool) or not isinstance(group, int) or group < MIN_GROUP_SIZE
                or group & (group - 1)):
            raise ArtifactError(f"codec key_group={group!r} must be a power of two >= {MIN_GROUP_SIZE}")
    try:
        validate_codec_shape(m.head_dim, codec["group_size"])
    except ValueError as e:
        raise ArtifactError(f"codec metadata: {e}") from None
    if codec["levels"] not in LEVELS:
        raise ArtifactError(f"codec levels={codec['levels']!r} must be one of {LEVELS}")
    if not isinstance(artifact.provenance, dict):
        raise ArtifactError(f"provenance must be a dict, got {type(artifact.provenance).__name__}")


def write_artifact(path: str | Path, artifact: RotationArtifact) -> Path:
    """Validate and write the artifact; `path` is a directory (created) or a file name. Returns the file."""
    from safetensors.numpy import save

    validate_artifact(artifact)
    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / ARTIFACT_FILENAME
    metadata = {
        "format_version": str(format_version_of(artifact.key_layout)),
        "model": json.dumps(dataclasses.asdict(artifact.model), sort_keys=True),
        "codec": json.dumps(artifact.codec, sort_keys=True),
        "provenance": json.dumps(artifact.provenance, sort_keys=True),
    }
    blob = save({k: np.ascontiguousarray(v) for k, v in artifact.tensors().items()}, metadata=metadata)
    path.write_bytes(_sorted_metadata(blob))
    return path


def _sorted_metadata(blob: bytes) -> bytes:
    """safetensors bytes with the header's metadata keys in sorted order. The library writes them
    in the order of a Rust hash map, which changes from run to run; sorted, the same artifact is
    the same bytes (tensor entries and data are left as written: their order is fixed)."""
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the format's alignment: the data starts on a multiple of 8
    return len(text).to_bytes(8, "little") + text + blob[8 + size :]


def _parse_json(metadata: dict[str, str], key: str, file: Path) -> Any:
    try:
        return json.loads(metadata[key])
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{file}: metadata '{key}' is not valid JSON ({e})") from None


def read_artifact(path: str | Path, expected_model: ModelFingerprint | None = None) -> RotationArtifact:
    """Read and validate an artifact (a file, or a directory holding ARTIFACT_FILENAME)."""
    from safetensors import safe_open

    file = artifact_file(path)
    if not file.is_file():
        raise ArtifactError(f"rotation artifact not found: {file}")
    try:
        with safe_open(str(file), framework="np") as f:
            metadata = f.metadata() or {}
            names = set(f.keys())
            tensors = {name: f.get_tensor(name) for name in names & set(TENSOR_NAMES)}
    except ArtifactError:
        raise
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        raise ArtifactError(f"{file} is not a readable safetensors file: {e}") from None
    missing = [name for name in TENSOR_NAMES if name not in names]
    if missing:
        raise ArtifactError(f"{file} is missing tensors {missing}")
    unexpected = sorted(names - set(TENSOR_NAMES))
    if unexpected:
        raise ArtifactError(f"{file} has unexpected tensors {unexpected}")
    missing_meta = [key for key in METADATA_KEYS if key not in metadata]
    if missing_meta:
        raise ArtifactError(f"{file} is missing metadata {missing_meta}")
    if metadata["format_version"] not in [str(v) for v in READABLE_FORMAT_VERSIONS]:
        raise ArtifactError(f"{file} has format_version={metadata['format_version']!r}; this library reads "
                            f"versions {[str(v) for v in READABLE_FORMAT_VERSIONS]}")
    model = _parse_json(metadata, "model", file)
    if not isinstance(model, dict) or set(model) != {f.name for f in dataclasses.fields(ModelFingerprint)}:
        raise ArtifactError(f"{file}: metadata 'model' must hold the model shape fingerprint, got {model!r}")
    artifact = RotationArtifact(
        **tensors,
        model=ModelFingerprint(**model),
        codec=_parse_json(metadata, "codec", file),
        provenance=_parse_json(metadata, "provenance", file),
    )
    try:
        validate_artifact(artifact, expected_model)
        check_format_version(int(metadata["format_version"]), artifact.key_layout)
    except ValueError as e:  # ArtifactError included
        raise ArtifactError(f"{file}: {e}") from None
    return artifact
