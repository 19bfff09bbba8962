"""Import the OSCAR authors' published rotations (RotationZoo) into our rotation artifact.

    python -m calibration.import_rotations --k-rotation K.pt --v-rotation V.pt --model-path M \
        --output-dir DIR [--k-clip-ratio 0.96 --v-clip-ratio 0.92 --group-size G]

The authors' format (FutureMLS-Lab/OSCAR, `rotation/compute_kv_rotation.py`: `empty_result`,
`add_layer`, `write_hadamard_rotation`): one `torch.save`d dict per target, K and V in separate
files (`k_rotation_qqt_r_h_pbr.pt`, `v_rotation_sst_r_h_pbr.pt` in the RotationZoo; their server's
default names, `srt/mem_cache/oscar_rotation_paths.py`):
    {"format_version": 1, "objective": str, "source_grouping": "layer",
     "layers": {layer_id: {"layer_id": int, "rotation": float32 [D, D], "eigenvalues": float32 [D]}}}
Layer ids are ints (their loader also accepts their str forms); the authors' Qwen3-8B and
Qwen3-4B-Thinking files on their repository's branches have exactly this layout. format_version 2
is their open PR #20 ("per-(layer, KV head) rotations (`format_version: 2`) … dispatch is on
`rotation.dim()`", from its description: its writer was not in the stored snapshot); the one v2
writer we could read (an "OptR" calibration script, repository not identified) stores
`[Hkv, D, D]` rotations, `source_grouping: "kv_head"`, per-layer `[D]` eigenvalues and extra keys.
Here v2 takes `[Hkv, D, D]` or `[D, D]` rotations and `[D]` or `[Hkv, D]` eigenvalues; extra keys
are ignored. Clip ratios are not in the files: their server takes them from
SGLANG_OSCAR_{K,V}_CLIP_RATIO, so they are flags here (defaults 0.96 / 0.92).

Convention: row vectors, `k' = k·R`, exactly ours (DESIGN.md §3), so matrices are copied without a
transpose. Their runtime applies `tensor @ R` to q and k (`_apply_oscar_rotation`,
`srt/layers/attention/quantized_kv_prefill.py`), `o @ R_v.T` to the attention output
(`srt/layers/attention/triton_backend.py`), and their fused write kernel computes
`tl.dot(k_tile, R_tile)` with R indexed [in, out] (`QuantKernel/oscar_rotation_clip_int2_kv.py`);
their calibration composes `R = U·H·P` with U's columns the eigenvectors (`compose_rotation`,
`r_h_pbr`) — the same U·H·P as shared_math.rotation.

Safety: files are read with `torch.load(weights_only=True)` only. A file that needs an unrestricted
unpickler (arbitrary classes, which can run code) is refused, never retried without the
restriction. Everything in it is validated: version, layers 0..L−1 for the model and no others,
shapes, dtypes, finiteness, orthogonality within the artifact's tolerance, ascending eigenvalues;
each error names the file, the layer and the problem. A per-layer rotation is broadcast to every KV
head. The result goes through shared_math.artifact's one writer (which validates it again), with
provenance naming the source files and their SHA-256.

`read_rotation_path` is the one resolver both runtimes call for `--oscar-rotation-path` /
`OscarHFCache.from_artifact`: our artifact (file or directory), or a directory holding the authors'
two files, imported in memory with the same validation. It imports neither JAX nor a backend, and
torch only to read `.pt` files.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from shared_math.artifact import (
    ARTIFACT_FILENAME,
    ORTHOGONALITY_TOLERANCE,
    ArtifactError,
    ModelFingerprint,
    RotationArtifact,
    read_artifact,
    validate_artifact,
    write_artifact,
)
from shared_math.spec import DEFAULT_K_CLIP_RATIO, DEFAULT_V_CLIP_RATIO, default_group_size

ZOO_FORMAT_VERSIONS = (1, 2)  # 1: [D, D] per layer (released); 2: [Hkv, D, D] or [D, D] per layer (PR #20)
K_PATTERN, V_PATTERN = "k_rotation*.pt", "v_rotation*.pt"
SOURCE = "OSCAR authors' rotation files (FutureMLS-Lab/OSCAR rotation/compute_kv_rotation.py format)"


class ZooImportError(ArtifactError):
    """An authors' rotation file that is unsafe, unreadable, malformed or for another model."""


@dataclasses.dataclass(frozen=True, eq=False)
class ZooRotations:
    """One validated authors' file, broadcast to our layout."""

    rotation: np.ndarray  # float32 [L, Hkv, D, D]
    eigenvalues: np.ndarray  # float32 [L, Hkv, D], ascending
    source: dict[str, Any]  # path, sha256, format_version, objective, source_grouping


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _torch_load_weights_only(data: bytes, file: Path):
    import pickle

    import torch  # only here: resolving our own artifact never needs torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's restricted unpickler failed; its own reason follows "WeightsUnpickler error:".
        text = str(e)
        detail = text.split("WeightsUnpickler error:", 1)[-1].strip().split("\n")[0].strip() or type(e).__name__
        if "global" in detail.lower():  # a class or function to import: only an unrestricted unpickler runs it
            raise ZooImportError(
                f"{file}: refused: the file needs an unrestricted unpickler (torch.load(weights_only=False)), "
                f"which can run arbitrary code; only tensors, dicts, lists, numbers and strings are accepted "
                f"({detail})"
            ) from None
        raise ZooImportError(f"{file}: refused: not a torch.save file that torch.load(weights_only=True) can "
                             f"read ({detail})") from None
    except Exception as e:  # truncated zip, not a torch file, …: torch raises many types
        raise ZooImportError(f"{file}: not a readable torch.save file ({type(e).__name__}: {e})") from None


def _layer_ids(layers: dict, file: Path, num_layers: int) -> dict[int, Any]:
    """{int layer id: entry}, keys given as ints or as their str forms (the authors' loader takes both)."""
    by_id: dict[int, Any] = {}
    for key, entry in layers.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise ZooImportError(f"{file}: layer key {key!r} must be an int layer id")
        try:
            layer = int(key)
        except ValueError:
            raise ZooImportError(f"{file}: layer key {key!r} is not an integer layer id") from None
        if isinstance(key, str) and key != str(layer):
            raise ZooImportError(f"{file}: layer key {key!r} is not a canonical integer layer id")
        if layer in by_id:
            raise ZooImportError(f"{file}: layer {layer} appears twice (as {layer} and {str(layer)!r})")
        by_id[layer] = entry
    expected = set(range(num_layers))
    missing, extra = sorted(expected - set(by_id)), sorted(set(by_id) - expected)
    if missing:
        raise ZooImportError(f"{file}: missing layer(s) {missing} (the model has layers 0..{num_layers - 1})")
    if extra:
        raise ZooImportError(f"{file}: unexpected layer(s) {extra}: the model has {num_layers} layers "
                             f"(a file for another model?)")
    return by_id


def _float_array(value, what: str) -> np.ndarray:
    import torch

    if not isinstance(value, torch.Tensor):
        raise ZooImportError(f"{what} must be a tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_quantized:
        raise ZooImportError(f"{what} must be a dense tensor, got layout {value.layout}")
    if value.dtype not in (torch.float32, torch.float64):  # the authors save float32 (add_layer)
        raise ZooImportError(f"{what} must be float32 or float64, got {value.dtype}")
    return value.detach().cpu().numpy().astype(np.float32)


def read_zoo_file(path: str | os.PathLike, model: ModelFingerprint, *, target: str) -> ZooRotations:
    """Read and validate one authors' file (`target` "k" or "v", for messages) for `model`."""
    file = Path(path)
    if not file.is_file():
        raise ZooImportError(f"{target.upper()} rotation file not found: {file}")
    data = file.read_bytes()  # hash exactly the bytes that are parsed
    state = _torch_load_weights_only(data, file)
    if not isinstance(state, dict):
        raise ZooImportError(f"{file}: top level must be a dict, got {type(state).__name__}")
    version = state.get("format_version")
    if isinstance(version, bool) or version not in ZOO_FORMAT_VERSIONS:
        raise ZooImportError(f"{file}: format_version={version!r}; supported: {list(ZOO_FORMAT_VERSIONS)}")
    for key in ("objective", "source_grouping"):
        if key in state and not isinstance(state[key], str):
            raise ZooImportError(f"{file}: '{key}' must be a string, got {type(state[key]).__name__}")
    layers = state.get("layers")
    if not isinstance(layers, dict):
        raise ZooImportError(f"{file}: 'layers' must be a dict of layer id → entry, got {type(layers).__name__}")
    d, hkv = model.head_dim, model.num_kv_heads
    rotations = np.empty((model.num_layers, hkv, d, d), np.float32)
    eigenvalues = np.empty((model.num_layers, hkv, d), np.float32)
    eye = np.eye(d)
    for layer, entry in sorted(_layer_ids(layers, file, model.num_layers).items()):
        where = f"{file}: layer {layer}"
        if not isinstance(entry, dict):
            raise ZooImportError(f"{where}: entry must be a dict, got {type(entry).__name__}")
        if "layer_id" in entry and (type(entry["layer_id"]) is not int or entry["layer_id"] != layer):
            raise ZooImportError(f"{where}: entry says layer_id={entry['layer_id']!r}")
        for key in ("rotation", "eigenvalues"):
            if key not in entry or entry[key] is None:
                raise ZooImportError(f"{where}: no '{key}'")
        r = _float_array(entry["rotation"], f"{where}: rotation")
        allowed = [(d, d)] + ([(hkv, d, d)] if version == 2 else [])
        if r.shape not in allowed:
            if r.ndim >= 2 and r.shape[-2:] != (d, d):
                problem = f"head_dim {r.shape[-1]} (the model's head_dim is {d})"
            elif r.ndim == 3 and version == 2:
                problem = f"{r.shape[0]} per-head rotations (the model has {hkv} KV heads)"
            else:
                problem = f"shape {tuple(r.shape)}"
            raise ZooImportError(f"{where}: rotation has {problem}; format_version {version} expects "
                                 f"{' or '.join(str(list(s)) for s in allowed)}")
        if not np.all(np.isfinite(r)):
            raise ZooImportError(f"{where}: rotation has non-finite entries")
        r64 = r.astype(np.float64)
        err = np.abs(np.swapaxes(r64, -1, -2) @ r64 - eye).reshape(-1, d * d).max(axis=-1)
        if err.max() > ORTHOGONALITY_TOLERANCE:
            head = f", kv head {int(err.argmax())}" if r.ndim == 3 else ""
            raise ZooImportError(f"{where}{head}: rotation is not orthogonal: max |RᵀR − I| = {err.max():.3g} "
                                 f"> {ORTHOGONALITY_TOLERANCE}")
        e = _float_array(entry["eigenvalues"], f"{where}: eigenvalues")
        if e.shape not in ((d,), (hkv, d)) or (e.shape == (hkv, d) and version != 2):
            raise ZooImportError(f"{where}: eigenvalues have shape {tuple(e.shape)}, expected [{d}]"
                                 + (f" or [{hkv}, {d}]" if version == 2 else ""))
        if not np.all(np.isfinite(e)):
            raise ZooImportError(f"{where}: eigenvalues have non-finite entries")
        if np.any(np.diff(e, axis=-1) < 0):  # torch/numpy eigh order; anything else is not their output
            raise ZooImportError(f"{where}: eigenvalues are not ascending (eigh order)")
        rotations[layer] = r  # a per-layer [D, D] rotation broadcasts to every KV head
        eigenvalues[layer] = np.broadcast_to(e, (hkv, d))
    source = {
        "path": str(file.resolve()),
        "sha256": _sha256(data),
        "format_version": version,
        "objective": state.get("objective"),
        "source_grouping": state.get("source_grouping"),
    }
    return ZooRotations(rotations, eigenvalues, source)


def import_zoo(
    k_path: str | os.PathLike,
    v_path: str | os.PathLike,
    model: ModelFingerprint,
    *,
    k_clip_ratio: float = DEFAULT_K_CLIP_RATIO,
    v_clip_ratio: float = DEFAULT_V_CLIP_RATIO,
    group_size: int | None = None,
    command: str | None = None,
) -> RotationArtifact:
    """Our validated RotationArtifact from the authors' K and V files (nothing is written)."""
    if not isinstance(model, ModelFingerprint):
        raise TypeError(f"model must be a ModelFingerprint, got {type(model).__name__}")
    k = read_zoo_file(k_path, model, target="k")
    v = read_zoo_file(v_path, model, target="v")
    group = default_group_size(model.head_dim) if group_size is None else group_size
    clips = {}
    for name, value in (("k_clip_ratio", k_clip_ratio), ("v_clip_ratio", v_clip_ratio)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ZooImportError(f"{name}={value!r} must be a number in (0, 1]")
        clips[name] = np.full(model.num_layers, value, np.float32)
    artifact = RotationArtifact(
        k_rotation=k.rotation,
        v_rotation=v.rotation,
        k_eigenvalues=k.eigenvalues,
        v_eigenvalues=v.eigenvalues,
        **clips,
        model=model,
        codec={"group_size": group, "levels": "minmax"},  # the authors' codec: min/max levels
        provenance={
            "command": command or "calibration.import_rotations.import_zoo(...)",
            "source": SOURCE,
            "k_rotation_file": k.source,
            "v_rotation_file": v.source,
            "clip_ratios": "not in the source files; given to the importer (the authors' server reads "
                           "SGLANG_OSCAR_{K,V}_CLIP_RATIO)",
        },
    )
    try:
        validate_artifact(artifact, model)
    except ArtifactError as e:
        raise ZooImportError(f"importing {k_path}, {v_path}: {e}") from None
    return artifact


def find_zoo_files(directory: str | os.PathLike) -> tuple[Path, Path] | None:
    """(K file, V file) when `directory` holds the authors' pair; None when it holds neither.
    Several candidates for one target are ambiguous and refused."""
    directory = Path(directory)
    found = []
    for pattern in (K_PATTERN, V_PATTERN):
        matches = sorted(p for p in directory.glob(pattern) if p.is_file())
        if len(matches) > 1:
            raise ZooImportError(
                f"{directory} holds several {pattern} files {[p.name for p in matches]}; pick one pair with "
                f"python -m calibration.import_rotations --k-rotation … --v-rotation …"
            )
        found.append(matches[0] if matches else None)
    if found == [None, None]:
        return None
    if None in found:
        missing = "V" if found[1] is None else "K"
        raise ZooImportError(f"{directory} holds a {('K', 'V')[found[0] is None]} rotation file but no "
                             f"{missing} rotation file ({V_PATTERN if missing == 'V' else K_PATTERN})")
    return found[0], found[1]


def read_rotation_path(
    path: str | os.PathLike,
    expected_model: ModelFingerprint,
    *,
    k_clip_ratio: float = DEFAULT_K_CLIP_RATIO,
    v_clip_ratio: float = DEFAULT_V_CLIP_RATIO,
    group_size: int | None = None,
) -> RotationArtifact:
    """The artifact at `path`: our artifact (its .safetensors file or a directory holding it) or a
    directory holding the authors' `k_rotation*.pt` + `v_rotation*.pt`, imported in memory with the
    given clip ratios / group size (defaults 0.96 / 0.92 / min(D, 128)). Our artifact wins when a
    directory holds both (the importer's output). Raises ArtifactError (ZooImportError for the
    authors' files) naming the problem."""
    path = Path(path)
    if path.suffix == ".pt":
        raise ArtifactError(f"{path}: pass the directory holding the authors' K and V files, or convert them "
                            f"with python -m calibration.import_rotations --k-rotation … --v-rotation …")
    if not path.is_dir() or (path / ARTIFACT_FILENAME).is_file():
        return read_artifact(path, expected_model=expected_model)
    pair = find_zoo_files(path)
    if pair is None:
        raise ArtifactError(f"{path} holds neither our artifact ({ARTIFACT_FILENAME}) nor the OSCAR authors' "
                            f"rotation files ({K_PATTERN} and {V_PATTERN})")
    return import_zoo(*pair, expected_model, k_clip_ratio=k_clip_ratio, v_clip_ratio=v_clip_ratio,
                      group_size=group_size, command=f"on-the-fly import of {path}")


def _hf_dir_fingerprint(directory: Path) -> ModelFingerprint:
    """Shape fingerprint from an HF config.json: the same fields as oscar_torch.hf.model_fingerprint
    and oscar_jax.loaders.hf_config, read without importing either backend."""
    file = directory / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: cannot read the model config ({e})") from None
    cfg = (raw.get("text_config") or raw) if isinstance(raw, dict) else raw  # composite configs nest the decoder
    try:
        q_heads = int(cfg["num_attention_heads"])
        return ModelFingerprint(
            num_layers=int(cfg["num_hidden_layers"]),
            num_q_heads=q_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or q_heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // q_heads),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{file}: not a decoder config with the attention shape ({e!r})") from None


def model_path_fingerprint(name_or_path: str | os.PathLike) -> ModelFingerprint:
    """The model shape fingerprint our artifacts carry, for a model named as everywhere in the project
    (`smollm2-135m`, a .gguf file, or an HF directory). An HF directory needs only its config.json
    (no JAX); a name or a GGUF goes through oscar_jax.loaders."""
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return _hf_dir_fingerprint(path)
    from oscar_jax.loaders import gguf_config, hf_config, open_gguf, resolve_model_path  # noqa: PLC0415

    resolved = resolve_model_path(text)
    cfg = hf_config(resolved) if resolved.is_dir() else gguf_config(open_gguf(resolved), resolved)
    return ModelFingerprint(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m calibration.import_rotations",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k-rotation", type=Path, required=True, help="the authors' K file (k_rotation_*.pt)")
    p.add_argument("--v-rotation", type=Path, required=True, help="the authors' V file (v_rotation_*.pt)")
    p.add_argument("--model-path", required=True, help="smollm2-135m, a .gguf file, or an HF directory")
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--k-clip-ratio", type=float, default=DEFAULT_K_CLIP_RATIO)
    p.add_argument("--v-clip-ratio", type=float, default=DEFAULT_V_CLIP_RATIO)
    p.add_argument("--group-size", type=int, default=None, help="default min(head_dim, 128)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python -m calibration.import_rotations " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        model = model_path_fingerprint(args.model_path)
        artifact = import_zoo(args.k_rotation, args.v_rotation, model, k_clip_ratio=args.k_clip_ratio,
                              v_clip_ratio=args.v_clip_ratio, group_size=args.group_size, command=command)
        artifact.provenance["model_path"] = args.model_path
        file = write_artifact(args.output_dir, artifact)
    except (ValueError, OSError, NotImplementedError) as e:  # ArtifactError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {file} ({model}; G={artifact.group_size}, clip K {args.k_clip_ratio} V {args.v_clip_ratio})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
