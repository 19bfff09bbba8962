"""calibration.import_rotations: the OSCAR authors' RotationZoo files into our artifact.

Files are built here in the authors' layout (rotation/compute_kv_rotation.py: a torch.save'd dict,
int layer keys, float32 rotation [D, D] and eigenvalues [D] per layer; format_version 2 holds
[Hkv, D, D]) and must round-trip bit for bit; their Hadamard-only file must give, through our
runtime, the same logits as our own Hadamard-only method (quarot-int2); unsafe or malformed
files are refused with errors naming the problem; both runtimes accept a directory of the
authors' files through the one resolver.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from calibration.import_rotations import ZooImportError, import_zoo, main, model_path_fingerprint, read_rotation_path
from shared_math.artifact import ARTIFACT_FILENAME, ArtifactError, ModelFingerprint, read_artifact, write_artifact
from shared_math.rotation import rotation_from_covariance

MODEL = ModelFingerprint(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=16)


def authors_hadamard(n: int) -> torch.Tensor:
    """Their build_hadamard: Sylvester recursion, each level divided by √2, in float64."""
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    h = authors_hadamard(n // 2)
    return torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0) / math.sqrt(2)


def random_rotations(model: ModelFingerprint, seed: int, per_head: bool = False):
    """(rotations float64 [L, (Hkv,) D, D], ascending eigenvalues [L, (Hkv,) D]): OSCAR U·H·P of random covariances."""
    rng = np.random.default_rng(seed)
    heads = model.num_kv_heads if per_head else 1
    rots, eigs = [], []
    for _ in range(model.num_layers * heads):
        a = rng.normal(size=(64, model.head_dim)) * rng.uniform(0.1, 3.0, model.head_dim)
        r, e = rotation_from_covariance(a.T @ a, "oscar")
        rots.append(r)
        eigs.append(e)
    shape = (model.num_layers, heads) if per_head else (model.num_layers,)
    d = model.head_dim
    return np.array(rots).reshape(*shape, d, d), np.array(eigs).reshape(*shape, d)


def save_authors_file(path, rotations, eigenvalues, *, version=1, objective="qqt_r_h_pbr", str_keys=False, **extra):
    """What their add_layer / torch.save write: fp32 contiguous tensors under int layer ids."""
    layers = {}
    for layer, (r, e) in enumerate(zip(rotations, eigenvalues)):
        key = str(layer) if str_keys else layer
        layers[key] = {"layer_id": layer, "rotation": torch.as_tensor(r).float().contiguous(),
                       "eigenvalues": torch.as_tensor(e).float().contiguous()}
    state = {"format_version": version, "objective": objective,
             "source_grouping": "kv_head" if version == 2 else "layer", "layers": layers, **extra}
    torch.save(state, str(path))
    return path


def write_zoo_pair(directory, model=MODEL, seed=0, **kwargs):
    directory.mkdir(parents=True, exist_ok=True)
    k = save_authors_file(directory / "k_rotation_qqt_r_h_pbr.pt", *random_rotations(model, seed), **kwargs)
    v = save_authors_file(directory / "v_rotation_sst_r_h_pbr.pt", *random_rotations(model, seed + 1),
                          objective="sst_r_h_pbr", **{k_: v_ for k_, v_ in kwargs.items() if k_ != "objective"})
    return k, v


def write_hadamard_pair(directory, model):
    """What their write_hadamard_rotation writes: H (float32) and eigenvalues of ones for every layer."""
    directory.mkdir(parents=True, exist_ok=True)
    h = authors_hadamard(model.head_dim).float()
    ones = torch.ones(model.head_dim, dtype=torch.float32)
    for target in ("k", "v"):
        save_authors_file(directory / f"{target}_rotation_hadamard.pt", [h] * model.num_layers,
                          [ones] * model.num_layers, objective="hadamard")


def hf_config_dir(directory, model=MODEL):
    """An HF model directory with only config.json: all the importer needs for the fingerprint."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": model.num_layers,
              "num_attention_heads": model.num_q_heads, "num_key_value_heads": model.num_kv_heads,
              "hidden_size": model.num_q_heads * model.head_dim * 2, "head_dim": model.head_dim}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("str_keys", [False, True], ids=["int-keys", "str-keys"])
def test_cli_round_trips_authors_files_into_our_artifact(tmp_path, str_keys):
    k_file, v_file = write_zoo_pair(tmp_path / "zoo", str_keys=str_keys)
    model_dir = hf_config_dir(tmp_path / "model")
    out = tmp_path / "out"
    argv = ["--k-rotation", str(k_file), "--v-rotation", str(v_file), "--model-path", str(model_dir),
            "--output-dir", str(out), "--k-clip-ratio", "0.9", "--v-clip-ratio", "0.85", "--group-size", "16"]
    assert main(argv) == 0
    art = read_artifact(out, expected_model=MODEL)
    for target, seed, file in (("k", 0, k_file), ("v", 1, v_file)):
        rot, eig = random_rotations(MODEL, seed)
        want_r = np.broadcast_to(rot.astype(np.float32)[:, None], (3, 2, 16, 16))  # every KV head gets the layer's R
        np.testing.assert_array_equal(getattr(art, f"{target}_rotation"), want_r)  # no transpose: same convention
        np.testing.assert_array_equal(getattr(art, f"{target}_eigenvalues"),
                                      np.broadcast_to(eig.astype(np.float32)[:, None], (3, 2, 16)))
        source = art.provenance[f"{target}_rotation_file"]
        assert source["sha256"] == sha256(file) and source["path"] == str(file.resolve())
        assert source["format_version"] == 1 and source["objective"].endswith("_r_h_pbr")
    np.testing.assert_array_equal(art.k_clip_ratio, np.full(3, 0.9, np.float32))
    np.testing.assert_array_equal(art.v_clip_ratio, np.full(3, 0.85, np.float32))
    assert art.codec == {"group_size": 16, "levels": "minmax"}
    assert art.provenance["command"].startswith("python -m calibration.import_rotations --k-rotation ")
    assert art.provenance["model_path"] == str(model_dir)


def test_format_version_2_per_head_rotations_are_kept_per_head(tmp_path):
    rot, eig = random_rotations(MODEL, 3, per_head=True)
    k = save_authors_file(tmp_path / "k_rotation_optr.pt", rot, eig, version=2, kept_heads=[0, 1])
    v = save_authors_file(tmp_path / "v_rotation_optr.pt", rot[::-1].copy(), eig[::-1].copy(), version=2)
    art = import_zoo(k, v, MODEL)
    np.testing.assert_array_equal(art.k_rotation, rot.astype(np.float32))
    np.testing.assert_array_equal(art.v_rotation, rot[::-1].astype(np.float32))
    assert not np.array_equal(art.k_rotation[:, 0], art.k_rotation[:, 1])  # the heads really differ
    assert art.provenance["k_rotation_file"]["source_grouping"] == "kv_head"
    assert art.group_size == 16 and art.k_clip_ratio[0] == np.float32(0.96) and art.v_clip_ratio[0] == np.float32(0.92)


def test_read_rotation_path_takes_our_artifact_or_the_authors_directory(tmp_path):
    write_zoo_pair(tmp_path / "zoo")
    on_the_fly = read_rotation_path(tmp_path / "zoo", MODEL)
    assert on_the_fly.provenance["command"] == f"on-the-fly import of {tmp_path / 'zoo'}"
    written = write_artifact(tmp_path / "ours", on_the_fly)
    for path in (tmp_path / "ours", written):
        back = read_rotation_path(path, MODEL)
        for name, value in on_the_fly.tensors().items():
            np.testing.assert_array_equal(getattr(back, name), value)
    # a directory holding both: ours wins (it is what the importer wrote), and it is the copy read
    write_artifact(tmp_path / "zoo", import_zoo(*sorted((tmp_path / "zoo").glob("*.pt")), MODEL, k_clip_ratio=0.5))
    assert read_rotation_path(tmp_path / "zoo", MODEL).k_clip_ratio[0] == np.float32(0.5)


def test_model_path_resolves_like_the_rest_of_the_project(tmp_path):
    from oscar_jax.loaders import hf_config
    from oscar_jax.runtime import fingerprint

    directory = hf_config_dir(tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": 64, "intermediate_size": 96}))
    assert model_path_fingerprint(directory) == MODEL == fingerprint(hf_config(directory))  # the JAX loader agrees
    nested = tmp_path / "vlm"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 5, "num_attention_heads": 8, "hidden_size": 512}}))
    assert model_path_fingerprint(nested) == ModelFingerprint(5, 8, 8, 64)  # no KV heads given → MHA; D = hidden / heads
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        model_path_fingerprint("no-such-model")  # names go through oscar_jax.loaders.resolve_model_path


def test_resolver_and_importer_load_no_jax(tmp_path):
    """A PyTorch user (OscarHFCache.from_artifact) resolves the authors' files without JAX."""
    write_zoo_pair(tmp_path / "zoo")
    code = f"""
import sys
from calibration.import_rotations import read_rotation_path
from shared_math.artifact import ModelFingerprint
art = read_rotation_path({str(tmp_path / 'zoo')!r}, ModelFingerprint(3, 4, 2, 16))
bad = sorted(m for m in sys.modules if m.split('.')[0] in {{'jax', 'jaxlib', 'flax', 'oscar_jax'}})
print(art.k_rotation.shape, ','.join(bad))
sys.exit(1 if bad else 0)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert result.stdout.startswith("(3, 2, 16, 16)")


# ----------------------------------------------------------------------------- refusals


class NotAllowedInWeightsOnly:
    """Any class: unpickling it needs torch.load(weights_only=False)."""


def _refusal(tmp_path, mutate, model=MODEL):
    """Import a pair whose K file was built by mutate(rotations, eigenvalues, state) → message."""
    rot, eig = random_rotations(model, 0)
    layers = {i: {"layer_id": i, "rotation": torch.as_tensor(r).float(), "eigenvalues": torch.as_tensor(e).float()}
              for i, (r, e) in enumerate(zip(rot, eig))}
    state = {"format_version": 1, "objective": "qqt_r_h_pbr", "source_grouping": "layer", "layers": layers}
    mutate(state)
    k = tmp_path / "k_rotation_bad.pt"
    torch.save(state, str(k))
    v = save_authors_file(tmp_path / "v_rotation_good.pt", *random_rotations(model, 1))
    with pytest.raises(ZooImportError) as info:
        import_zoo(k, v, MODEL)
    assert str(k) in str(info.value)
    return str(info.value)


def test_refuses_a_pickle_that_needs_more_than_weights_only(tmp_path):
    message = _refusal(tmp_path, lambda s: s.update(extra=NotAllowedInWeightsOnly()))
    assert "needs an unrestricted unpickler" in message and "weights_only=False" in message
    assert "NotAllowedInWeightsOnly" in message


def test_refuses_a_missing_layer(tmp_path):
    message = _refusal(tmp_path, lambda s: s["layers"].pop(1))
    assert "missing layer(s) [1]" in message


def test_refuses_a_non_orthogonal_matrix(tmp_path):
    def skew(state):
        state["layers"][2]["rotation"][0, :] *= 1.01  # 1 % off: RᵀR − I ≈ 0.02 on one entry

    message = _refusal(tmp_path, skew)
    assert "layer 2: rotation is not orthogonal" in message and "max |RᵀR − I|" in message


def test_refuses_a_wrong_head_dim(tmp_path):
    def wider(state):
        h = authors_hadamard(32).float()
        for entry in state["layers"].values():
            entry["rotation"], entry["eigenvalues"] = h, torch.ones(32)

    message = _refusal(tmp_path, wider)
    assert "layer 0: rotation has head_dim 32 (the model's head_dim is 16)" in message


@pytest.mark.parametrize("mutate, expected", [
    (lambda s: s.update(format_version=3), "format_version=3"),
    (lambda s: s.pop("format_version"), "format_version=None"),
    (lambda s: s["layers"].update({3: s["layers"][0]}), "unexpected layer(s) [3]"),
    (lambda s: s["layers"].update({"1": s["layers"][1]}), "layer 1 appears twice"),
    (lambda s: s["layers"][0]["rotation"].__setitem__((0, 0), float("nan")), "layer 0: rotation has non-finite"),
    (lambda s: s["layers"][1].update(rotation=s["layers"][1]["rotation"].half()), "must be float32 or float64, got torch.float16"),
    (lambda s: s["layers"][1].update(rotation=s["layers"][1]["rotation"].expand(2, 16, 16)),
     "format_version 1 expects [16, 16]"),  # per-head rotations are format_version 2
    (lambda s: s["layers"][0].pop("eigenvalues"), "layer 0: no 'eigenvalues'"),
    (lambda s: s["layers"][0].update(eigenvalues=s["layers"][0]["eigenvalues"].flip(0)), "not ascending"),
    (lambda s: s["layers"][2].update(layer_id=7), "layer 2: entry says layer_id=7"),
], ids=["version", "no-version", "extra-layer", "duplicate-layer", "nan", "fp16", "per-head-in-v1", "no-eigenvalues",
        "descending-eigenvalues", "layer-id"])
def test_refuses_malformed_files_naming_the_problem(tmp_path, mutate, expected):
    assert expected in _refusal(tmp_path, mutate)


def test_refuses_per_head_rotations_for_another_head_count(tmp_path):
    rot, eig = random_rotations(ModelFingerprint(3, 4, 4, 16), 0, per_head=True)  # 4 KV heads, the model has 2
    k = save_authors_file(tmp_path / "k_rotation_x.pt", rot, eig, version=2)
    with pytest.raises(ZooImportError, match="layer 0: rotation has 4 per-head rotations \\(the model has 2 KV heads\\)"):
        import_zoo(k, k, MODEL)


def test_refuses_garbage_and_ambiguous_or_incomplete_directories(tmp_path):
    (tmp_path / "k_rotation_a.pt").write_bytes(b"not a torch file")
    save_authors_file(tmp_path / "v_rotation_a.pt", *random_rotations(MODEL, 1))
    with pytest.raises(ZooImportError, match="k_rotation_a.pt: .*not a"):
        read_rotation_path(tmp_path, MODEL)
    save_authors_file(tmp_path / "k_rotation_b.pt", *random_rotations(MODEL, 0))
    with pytest.raises(ZooImportError, match=r"several k_rotation\*\.pt files \['k_rotation_a.pt', 'k_rotation_b.pt'\]"):
        read_rotation_path(tmp_path, MODEL)
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    save_authors_file(lonely / "k_rotation_a.pt", *random_rotations(MODEL, 0))
    with pytest.raises(ZooImportError, match="holds a K rotation file but no V rotation file"):
        read_rotation_path(lonely, MODEL)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ArtifactError, match=f"neither our artifact \\({ARTIFACT_FILENAME}\\) nor"):
        read_rotation_path(empty, MODEL)
    with pytest.raises(ArtifactError, match="pass the directory holding the authors' K and V files"):
        read_rotation_path(lonely / "k_rotation_a.pt", MODEL)


def test_authors_files_for_another_model_are_refused_by_both_paths(tmp_path):
    write_zoo_pair(tmp_path / "zoo")
    other = ModelFingerprint(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ZooImportError, match=r"missing layer\(s\) \[3\]"):
        read_rotation_path(tmp_path / "zoo", other)
    model_dir = hf_config_dir(tmp_path / "model", other)
    argv = ["--k-rotation", str(tmp_path / "zoo" / "k_rotation_qqt_r_h_pbr.pt"),
            "--v-rotation", str(tmp_path / "zoo" / "v_rotation_sst_r_h_pbr.pt"),
            "--model-path", str(model_dir), "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    assert not (tmp_path / "out").exists()  # nothing written on a refusal
    assert main(argv[:-4] + ["--model-path", str(hf_config_dir(tmp_path / "m2")), "--output-dir", str(tmp_path / "o"),
                             "--group-size", "32"]) == 2  # G > D is not a format v1 codec


# ----------------------------------------------------------------------------- through the runtimes


def test_authors_hadamard_file_gives_our_hadamard_only_logits(tmp_path):
    """Their write_hadamard_rotation output, through OscarRuntime, equals our quarot-int2 method
    (calibration.methods: Hadamard K and V, default codec) bit for bit — and a different rotation
    does not, so the comparison can fail."""
    import jax

    from calibration.methods import parse_method
    from oscar_jax.model import ModelConfig, init_params
    from oscar_jax.runtime import OscarRuntime, fingerprint
    from shared_math.artifact import RotationArtifact
    from shared_math.tests.test_artifact import make_artifact
    from shared_math.tiers import tier_split

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=6,
                      num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-5, tie_embeddings=True)
    model = fingerprint(cfg)
    write_hadamard_pair(tmp_path / "zoo", model)
    theirs = read_rotation_path(tmp_path / "zoo", model)

    method = parse_method("quarot-int2", num_layers=2, num_kv_heads=2, head_dim=64)
    codec = method.quantizer
    ours = RotationArtifact(
        k_rotation=method.k_rotation, v_rotation=method.v_rotation,
        k_eigenvalues=np.ones((2, 2, 64), np.float32), v_eigenvalues=np.ones((2, 2, 64), np.float32),
        k_clip_ratio=np.asarray(codec.k_clip_ratios, np.float32), v_clip_ratio=np.asarray(codec.v_clip_ratios, np.float32),
        model=model, codec={"group_size": codec.group_size, "levels": codec.levels},
    )
    for name, value in ours.tensors().items():
        if "eigenvalues" not in name:
            np.testing.assert_array_equal(getattr(theirs, name), value, err_msg=name)
    assert theirs.codec == ours.codec

    params = init_params(cfg, jax.random.PRNGKey(1), std=0.08)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 80).astype(np.int32)
    windows = dict(sink=16, recent=32)

    def logits(artifact):
        rt = OscarRuntime(params, cfg, artifact, max_batch=1, max_seq_len=96, **windows)
        assert tier_split(len(prompt), rt.config).history_tokens > 0  # the INT2 tier is read
        sid, out, _ = rt.admit(prompt)
        got = [np.asarray(out)]
        for _ in range(3):
            got.append(np.asarray(rt.step([sid], [int(np.argmax(got[-1]))])[0]))
        return np.stack(got)

    want = logits(ours)
    np.testing.assert_array_equal(logits(theirs), want)
    assert np.abs(logits(make_artifact(model, seed=3)) - want).max() > 1e-4


def test_hf_cache_from_artifact_accepts_the_authors_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    from oscar_torch.hf import OscarHFCache

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    write_zoo_pair(tmp_path / "zoo")
    cache = OscarHFCache.from_artifact(tmp_path / "zoo", config, max_cache_len=64)
    want = read_rotation_path(tmp_path / "zoo", MODEL)
    np.testing.assert_array_equal(cache.k_rotation.numpy(), want.k_rotation)
    np.testing.assert_array_equal(cache.v_rotation.numpy(), want.v_rotation)
    assert cache.config.group_size == 16 and cache.config.k_clip_ratio == np.float32(0.96)
    config.num_hidden_layers = 2  # another model: the file's layer 2 is one too many
    with pytest.raises(ArtifactError, match=r"unexpected layer\(s\) \[2\]"):
        OscarHFCache.from_artifact(tmp_path / "zoo", config, max_cache_len=64)


def test_generate_accepts_the_authors_directory(tmp_path, monkeypatch, capsys):
    """`python -m oscar_jax.generate --oscar-rotation-path ZOO_DIR` on a tiny random model."""
    import jax

    import oscar_jax.loaders
    import oscar_jax.tokenizer
    from oscar_jax.generate import main as generate
    from oscar_jax.model import ModelConfig, init_params
    from oscar_jax.runtime import fingerprint

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=6,
                      num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-5, tie_embeddings=True)

    class Tokenizer:  # bytes → ids below the vocabulary
        eos_id = None

        def encode(self, text):
            return [b % cfg.vocab_size for b in text.encode()]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    monkeypatch.setattr(oscar_jax.loaders, "load_model", lambda _: (cfg, init_params(cfg, jax.random.PRNGKey(1), std=0.08)))
    monkeypatch.setattr(oscar_jax.tokenizer, "load_tokenizer", lambda _: Tokenizer())
    write_hadamard_pair(tmp_path / "zoo", fingerprint(cfg))
    argv = ["--prompt", "x" * 40, "--model-path", "tiny", "--oscar-rotation-path", str(tmp_path / "zoo"),
            "--oscar-sink-size", "16", "--oscar-recent-size", "16", "--max-new-tokens", "2"]
    assert generate(argv) == 0
    assert "bits/element" in capsys.readouterr().out
    (tmp_path / "zoo" / "v_rotation_hadamard.pt").unlink()
    assert generate(argv) == 2
    assert "holds a K rotation file but no V rotation file" in capsys.readouterr().err
