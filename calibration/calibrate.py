"""Offline calibration: run a model on real text, fit per-(layer, KV head) rotations and clip ratios,
write the artifact both runtimes load, and a short report.

    python -m calibration --model-path smollm2-135m --calib-data wiki --calib-tokens 8192 --output-dir DIR

Held-out tokens (the `heldout_tokens` that follow the calibration tokens in the same split) are
used only to fit clip ratios and to report errors; they never enter the covariances.

Models with sliding-window layers (Gemma 3: ModelConfig.layer_types "local"): a local layer keeps
its window in BF16 and never reads the OSCAR cache, so statistics, rotations, clip ratios and
held-out errors are computed for the global layers only. The artifact keeps its format (every
layer present): a local layer gets the identity rotations, zero eigenvalues and clip ratio 1, and
the provenance names the unused layers (`unused_layers`, with `unused_layers_reason`).

Keys per channel (`key_layout="channel"`, format v2; FORMAT.md § Format v2): the artifact's codec
records `"key_layout": "channel"` and `"key_group"` (shared_math.artifact writes format_version 2),
and the key clip ratios (fitted or given) are over a channel's values in a group of `key_group`
tokens (default: the format's default page for per-channel keys, DEFAULT_KEY_GROUP), the page a
cache built from the artifact uses. The key
logit error then quantizes the rotated held-out keys per channel over consecutive groups of
key_group tokens (shared_math.codec.encode_channels); a trailing partial group is left unquantized.
Values are unchanged. Without it (`key_layout="token"`) everything is format v1, byte for byte.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from calibration.data import documents, pack_tokens, sequences
from calibration.methods import DEFAULT_KEY_GROUP
from calibration.fit import CLIP_GRID, causal_probabilities, key_logit_error, rotations, value_output_error
from calibration.statistics import SecondMoments, group_queries, surrogate_weights
from shared_math.artifact import ModelFingerprint, RotationArtifact, write_artifact
from shared_math.rotation import ROTATION_KINDS
from shared_math.spec import (
    DEFAULT_K_CLIP_RATIO,
    DEFAULT_V_CLIP_RATIO,
    KEY_LAYOUTS,
    LEVELS,
    MIN_GROUP_SIZE,
    clip_index,
    default_group_size,
    is_power_of_two,
    validate_codec_shape,
)

KEY_TARGETS = ("query", "key")
VALUE_TARGETS = ("attention_output", "surrogate", "value")
REPORT_KINDS = ("identity", "hadamard", "oscar")  # the per-layer error comparison of the report


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    model_path: str = "smollm2-135m"
    calib_data: str = "wiki"
    calib_tokens: int = 8192
    output_dir: str = "oscar_calibration"
    seq_len: int = 2048
    heldout_tokens: int = 1024
    group_size: int | None = None  # None → min(head_dim, 128)
    levels: str = "minmax"
    k_clip_ratio: float = DEFAULT_K_CLIP_RATIO
    v_clip_ratio: float = DEFAULT_V_CLIP_RATIO
    fit_clip: bool = False
    rotation_kind: str = "oscar"
    key_target: str = "query"
    value_target: str = "attention_output"
    per_layer: bool = False
    seed: int = 0
    progress: bool = True
    tensor_parallel_size: int = 1
    key_layout: str = "token"  # "channel": format v2's per-channel keys (key clips over key_group tokens)
    key_group: int = DEFAULT_KEY_GROUP  # tokens per per-channel key group (key_layout "channel" only)

    def __post_init__(self):
        for name, value, choices in (
            ("levels", self.levels, LEVELS),
            ("rotation_kind", self.rotation_kind, ROTATION_KINDS),
            ("key_target", self.key_target, KEY_TARGETS),
            ("value_target", self.value_target, VALUE_TARGETS),
            ("key_layout", self.key_layout, KEY_LAYOUTS),
        ):
            if value not in choices:
                raise ValueError(f"{name}={value!r} must be one of {choices}")
        for name in ("calib_tokens", "seq_len", "heldout_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        clip_index(self.k_clip_ratio, 16)
        clip_index(self.v_clip_ratio, 16)
        if self.key_layout == "channel" and (not is_power_of_two(self.key_group) or self.key_group < MIN_GROUP_SIZE):
            raise ValueError(f"key_group={self.key_group} must be a power of two >= {MIN_GROUP_SIZE}")


# How a run is carried out, not what it computes: the artifact is the same bytes whatever they
# are, so the provenance does not record them.
RUN_ONLY_OPTIONS = ("tensor_parallel_size",)
# Options a format-v1 (key_layout "token") artifact does not record, so that it stays byte for byte
# what it was before per-channel keys existed.
CHANNEL_ONLY_OPTIONS = ("key_layout", "key_group")


def recorded_options(opts: CalibrationOptions) -> dict:
    """The options an artifact's provenance records (all but RUN_ONLY_OPTIONS; the per-channel key
    options only when key_layout is "channel")."""
    skip = RUN_ONLY_OPTIONS + (CHANNEL_ONLY_OPTIONS if opts.key_layout == "token" else ())
    return {k: v for k, v in dataclasses.asdict(opts).items() if k not in skip}


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _layer_activations(params, cfg, tokens, tp=None):
    """(layer, q [T, Hq, D], k [T, Hkv, D], v, attention output [T, Hq, D]) as float64 numpy.

    tp (oscar_jax.parallel.TensorParallel, params sharded by it): the weights stay split over the
    mesh and each layer runs whole on its first device (oscar_jax.parallel.iter_layer_activations),
    so the activations, and everything computed from them here, are one device's bits: the
    artifact is the one-device artifact, byte for byte."""
    from oscar_jax.model import iter_layer_activations
    from oscar_jax.parallel import iter_layer_activations as iter_sharded

    tokens = np.asarray(tokens, np.int32)[None]
    layers = iter_layer_activations(params, cfg, tokens) if tp is None else iter_sharded(params, tp, tokens)
    for layer, acts in layers:
        yield layer, *(np.asarray(a[0], np.float64) for a in (acts.q, acts.k, acts.v, acts.attn_out))


def calibrate(opts: CalibrationOptions, command: str | None = None) -> tuple[RotationArtifact, dict]:
    """Run the whole calibration; write the artifact and report into opts.output_dir."""
    from oscar_jax.loaders import load_model
    from oscar_jax.tokenizer import load_tokenizer

    t0 = time.time()
    cfg, params = load_model(opts.model_path)
    if not is_power_of_two(cfg.head_dim):
        raise ValueError(f"head_dim={cfg.head_dim} of {opts.model_path!r} is not a power of two: "
                         "OSCAR's Hadamard rotation and format v1 need one")
    tp = None
    if opts.tensor_parallel_size > 1:
        from oscar_jax.parallel import TensorParallel, make_mesh

        tp = TensorParallel.plan(cfg, make_mesh(opts.tensor_parallel_size))
        params = tp.shard_params(params, fuse=False)
    group_size = opts.group_size or default_group_size(cfg.head_dim)
    validate_codec_shape(cfg.head_dim, group_size)
    tokenizer = load_tokenizer(opts.model_path)
    docs = documents(opts.calib_data, "calibration")
    if opts.seed:
        docs = [docs[i] for i in np.random.default_rng(opts.seed).permutation(len(docs))]
    tokens = pack_tokens(docs, tokenizer.encode, tokenizer.eos_id, num_tokens=opts.calib_tokens + opts.heldout_tokens)
    calib, heldout = tokens[: opts.calib_tokens], tokens[opts.calib_tokens :]
    seqs = list(sequences(calib, opts.seq_len))
    if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None and opts.seq_len > 1:
        # the model reads text after BOS (Gemma): every sequence starts with one, as it would in use
        seqs = [np.concatenate([[tokenizer.bos_id], s]).astype(np.int32) for s in sequences(calib, opts.seq_len - 1)]
        heldout = np.concatenate([[tokenizer.bos_id], heldout]).astype(np.int32)

    # Only the global layers read the OSCAR cache: statistics are indexed by a layer's position
    # among them (every layer, in order, for a model without sliding-window layers).
    used = list(cfg.global_layers)
    slot = {layer: i for i, layer in enumerate(used)}
    shape = (len(used), cfg.num_kv_heads, cfg.head_dim)
    moments = {name: SecondMoments(*shape) for name in ("query", "attention_output", "key", "value")}
    bar = tqdm(total=len(seqs) * cfg.num_layers, desc="calibration statistics", unit="layer", disable=not opts.progress)
    for seq in seqs:
        for layer, q, k, v, o in _layer_activations(params, cfg, seq, tp):
            bar.update()
            if layer not in slot:
                continue
            i = slot[layer]
            moments["query"].add(i, group_queries(q, cfg.num_kv_heads))
            moments["attention_output"].add(i, group_queries(o, cfg.num_kv_heads))
            moments["key"].add(i, k)
            moments["value"].add(i, v)
    bar.close()
    cov = {name: m.covariance() for name, m in moments.items()}
    if opts.value_target == "surrogate":  # its weights need the finished C_Q: a second pass
        surrogate = SecondMoments(*shape)
        for seq in tqdm(seqs, desc="surrogate C_S (second pass)", disable=not opts.progress):
            for layer, _, k, v, _ in _layer_activations(params, cfg, seq, tp):
                if layer in slot:
                    surrogate.add(slot[layer], v, weights=surrogate_weights(k, cov["query"][slot[layer]]))
        cov["surrogate"] = surrogate.covariance()

    k_rot, k_eig = rotations(cov[opts.key_target], opts.rotation_kind, opts.per_layer)
    v_rot, v_eig = rotations(cov[opts.value_target], opts.rotation_kind, opts.per_layer)
    report_rot = {kind: (rotations(cov[opts.key_target], kind, opts.per_layer)[0],
                         rotations(cov[opts.value_target], kind, opts.per_layer)[0]) for kind in REPORT_KINDS}
    report_rot[opts.rotation_kind] = (k_rot, v_rot)

    # Held-out errors: clip fitting (optional) and the per-layer report (global layers only).
    k_clip = np.full(len(used), opts.k_clip_ratio)
    v_clip = np.full(len(used), opts.v_clip_ratio)
    codec = dict(group_size=group_size, levels=opts.levels)
    key_codec = codec  # the key error's codec: format v1's rows, or per channel over key_group tokens
    if opts.key_layout == "channel":
        key_codec = dict(codec, key_layout="channel", key_group=opts.key_group)
    errors = {kind: {"key_logit": [], "value_output": []} for kind in report_rot}
    clip_search = {"key_logit": [], "value_output": []}
    heldout_layers = [acts for acts in _layer_activations(params, cfg, heldout, tp) if acts[0] in slot]
    for layer, q, k, v, _ in tqdm(heldout_layers, desc="held-out errors", disable=not opts.progress):
        i = slot[layer]
        probs = causal_probabilities(q, k)
        if opts.fit_clip:
            k_err = [key_logit_error(q, k, k_rot[i], clip_ratio=c, **key_codec) for c in CLIP_GRID]
            v_err = [value_output_error(probs, v, v_rot[i], clip_ratio=c, **codec) for c in CLIP_GRID]
            k_clip[i], v_clip[i] = CLIP_GRID[int(np.argmin(k_err))], CLIP_GRID[int(np.argmin(v_err))]
            clip_search["key_logit"].append(k_err)
            clip_search["value_output"].append(v_err)
        for kind, (rk, rv) in report_rot.items():
            errors[kind]["key_logit"].append(key_logit_error(q, k, rk[i], clip_ratio=k_clip[i], **key_codec))
            errors[kind]["value_output"].append(
                value_output_error(probs, v, rv[i], clip_ratio=v_clip[i], **codec))
    report_eigenvalues = {"key": cov_eigs(cov[opts.key_target]), "value": cov_eigs(cov[opts.value_target])}
    if len(used) < cfg.num_layers:  # every layer in the artifact: local layers identity, clip 1
        k_rot, v_rot, k_eig, v_eig, k_clip, v_clip = (
            _all_layers(x, used, cfg.num_layers, fill) for x, fill in
            ((k_rot, "eye"), (v_rot, "eye"), (k_eig, 0.0), (v_eig, 0.0), (k_clip, 1.0), (v_clip, 1.0)))

    provenance = {
        "command": command or "calibration.calibrate(...)",
        "options": recorded_options(opts),
        "data": opts.calib_data,
        "calibration_tokens": int(len(calib)),
        "heldout_tokens": int(len(heldout)),
        "seed": opts.seed,
        "git_sha": _git_sha(),
        "model_path": opts.model_path,
    }
    if len(used) < cfg.num_layers:
        provenance["unused_layers"] = list(cfg.local_layers)
        provenance["unused_layers_reason"] = (
            f"sliding-window (local) layers: they keep a BF16 window of {cfg.sliding_window} tokens and "
            "never read the OSCAR cache; identity rotations, zero eigenvalues and clip ratio 1 stand in")
    artifact = RotationArtifact(
        k_rotation=k_rot.astype(np.float32),
        v_rotation=v_rot.astype(np.float32),
        k_eigenvalues=k_eig.astype(np.float32),
        v_eigenvalues=v_eig.astype(np.float32),
        k_clip_ratio=k_clip.astype(np.float32),
        v_clip_ratio=v_clip.astype(np.float32),
        model=ModelFingerprint(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim),
        codec=key_codec,
        provenance=provenance,
    )
    out = Path(opts.output_dir)
    file = write_artifact(out, artifact)
    report = {
        "artifact": str(file),
        "seconds": round(time.time() - t0, 1),
        "clip_grid": list(CLIP_GRID),
        "k_clip_ratio": k_clip.tolist(),
        "v_clip_ratio": v_clip.tolist(),
        "clip_search": clip_search if opts.fit_clip else None,
        "heldout_errors": errors,
        "eigenvalues": report_eigenvalues,
    }
    if len(used) < cfg.num_layers:  # the per-layer lists above follow these layers
        report["calibrated_layers"] = used
    from calibration.report import write_report

    write_report(out, report, provenance)
    return artifact, report


def _all_layers(values: np.ndarray, used: list[int], num_layers: int, fill) -> np.ndarray:
    """[len(used), ...] per-global-layer values → [num_layers, ...], `fill` elsewhere ("eye":
    identity matrices)."""
    out = np.empty((num_layers, *values.shape[1:]), values.dtype)
    out[...] = np.eye(values.shape[-1]) if fill == "eye" else fill
    out[used] = values
    return out


def cov_eigs(cov: np.ndarray) -> list:
    """Ascending eigenvalues [L][Hkv][D] of covariances, for the report."""
    return np.linalg.eigvalsh(cov).tolist()


def main_command(argv: list[str] | None = None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return "python -m calibration " + " ".join(shlex.quote(a) for a in args)
