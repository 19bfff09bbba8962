"""The rotation artifact: round trip and every validation error path."""

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from shared_math.artifact import (
    ARTIFACT_FILENAME,
    ArtifactError,
    ModelFingerprint,
    RotationArtifact,
    read_artifact,
    write_artifact,
)
from shared_math.rotation import rotation_from_covariance

MODEL = ModelFingerprint(num_layers=2, num_q_heads=6, num_kv_heads=3, head_dim=16)


def make_artifact(model=MODEL, seed=0):
    rng = np.random.default_rng(seed)
    rot = {"k": [], "v": []}
    eig = {"k": [], "v": []}
    for name in ("k", "v"):
        for _ in range(model.num_layers * model.num_kv_heads):
            a = rng.normal(size=(64, model.head_dim))
            r, e = rotation_from_covariance(a.T @ a, "oscar")
            rot[name].append(r)
            eig[name].append(e)
    shape = (model.num_layers, model.num_kv_heads)
    return RotationArtifact(
        k_rotation=np.array(rot["k"], np.float32).reshape(*shape, model.head_dim, model.head_dim),
        v_rotation=np.array(rot["v"], np.float32).reshape(*shape, model.head_dim, model.head_dim),
        k_eigenvalues=np.array(eig["k"], np.float32).reshape(*shape, model.head_dim),
        v_eigenvalues=np.array(eig["v"], np.float32).reshape(*shape, model.head_dim),
        k_clip_ratio=np.full(model.num_layers, 0.96, np.float32),
        v_clip_ratio=np.full(model.num_layers, 0.92, np.float32),
        model=model,
        codec={"group_size": 16, "levels": "minmax"},
        provenance={"command": "test", "tokens": 0},
    )


def test_round_trip_directory_and_file(tmp_path):
    art = make_artifact()
    file = write_artifact(tmp_path / "out", art)
    assert file.name == ARTIFACT_FILENAME
    for path in (tmp_path / "out", file):
        back = read_artifact(path, expected_model=MODEL)
        for name, value in art.tensors().items():
            assert np.array_equal(getattr(back, name), value)
        assert back.model == MODEL and back.codec == art.codec and back.provenance == art.provenance
    direct = write_artifact(tmp_path / "x.safetensors", art)
    assert direct == tmp_path / "x.safetensors" and read_artifact(direct).group_size == 16


def test_format_versions_by_key_layout(tmp_path):
    """A v1 artifact (keys per token) is still written as version 1 with v1's codec metadata; one for
    format v2's per-channel keys records version 2 and its layout, and both read back."""
    from safetensors import safe_open

    for layout, version, codec in (("token", "1", {"group_size": 16, "levels": "minmax"}),
                                   ("channel", "2", {"group_size": 16, "levels": "minmax", "key_layout": "channel"}),
                                   ("channel", "2", {"group_size": 16, "levels": "minmax", "key_layout": "channel",
                                                     "key_group": 32})):
        art = dataclasses.replace(make_artifact(), codec=codec)
        file = write_artifact(tmp_path / f"{layout}.safetensors", art)
        with safe_open(str(file), framework="np") as f:
            meta = f.metadata()
        assert meta["format_version"] == version and json.loads(meta["codec"]) == codec
        back = read_artifact(file)
        assert back.key_layout == layout and back.codec == codec


def test_the_same_artifact_is_the_same_bytes(tmp_path):
    """safetensors writes metadata in hash-map order; the writer sorts it, so rewriting an artifact
    (or calibrating it again, on any number of devices) gives identical files that load back."""
    art = make_artifact()
    files = [write_artifact(tmp_path / f"a{i}.safetensors", art) for i in range(6)]
    blobs = [f.read_bytes() for f in files]
    assert all(b == blobs[0] for b in blobs[1:])
    size = int.from_bytes(blobs[0][:8], "little")
    assert size % 8 == 0
    header = json.loads(blobs[0][8 : 8 + size])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    tensors = load_file(files[0])
    for name, value in art.tensors().items():
        assert np.array_equal(tensors[name], value)


def _rewrite(tmp_path, mutate_tensors=None, mutate_meta=None):
    file = write_artifact(tmp_path, make_artifact())
    tensors = load_file(str(file))
    from safetensors import safe_open

    with safe_open(str(file), framework="np") as f:
        meta = dict(f.metadata())
    if mutate_tensors:
        mutate_tensors(tensors)
    if mutate_meta:
        mutate_meta(meta)
    save_file(tensors, str(file), metadata=meta)
    return file


def _set(d, key, value):
    d[key] = value


@pytest.mark.parametrize(
    "mutate_tensors,mutate_meta,match",
    [
        (lambda t: t.pop("v_rotation"), None, r"missing tensors \['v_rotation'\]"),
        (lambda t: _set(t, "extra", np.zeros(1, np.float32)), None, r"unexpected tensors \['extra'\]"),
        (lambda t: _set(t, "k_rotation", t["k_rotation"].astype(np.float64)), None, "k_rotation must be float32"),
        (lambda t: _set(t, "k_rotation", t["k_rotation"][:1]), None, "k_rotation has shape"),
        (lambda t: t["v_eigenvalues"].__setitem__((0, 0, 0), np.nan), None, "v_eigenvalues has non-finite"),
        (lambda t: t["k_rotation"].__setitem__((1, 2, 0, 0), 3.0), None, r"k_rotation\[layer 1, kv head 2\] is not orthogonal"),
        (lambda t: _set(t, "k_eigenvalues", t["k_eigenvalues"][..., ::-1].copy()), None, "ascending"),
        (lambda t: t["v_clip_ratio"].__setitem__(0, 1.5), None, r"v_clip_ratio must lie in \(0, 1\]"),
        (None, lambda m: _set(m, "format_version", "3"), "format_version='3'"),
        (None, lambda m: _set(m, "codec", json.dumps({"group_size": 16, "levels": "minmax", "key_layout": "channel"})),
         "format_version=1 cannot hold key_layout='channel'"),
        (None, lambda m: _set(m, "codec", json.dumps({"group_size": 16, "levels": "minmax", "key_layout": "diag"})),
         "key_layout='diag'"),
        (None, lambda m: _set(m, "codec", json.dumps({"group_size": 16, "levels": "minmax", "key_group": 64})),
         "key_group=64 needs key_layout 'channel'"),
        *[(None, lambda m, g=g: (_set(m, "format_version", "2"), _set(m, "codec", json.dumps(
            {"group_size": 16, "levels": "minmax", "key_layout": "channel", "key_group": g}))),
           f"key_group={g!r} must be a power of two >= 16") for g in (24, 8, True, "64")],
        (None, lambda m: _set(m, "codec", json.dumps({"group_size": 16, "levels": "minmax", "bits": 2})),
         "codec metadata must be"),
        (None, lambda m: m.pop("provenance"), r"missing metadata \['provenance'\]"),
        (None, lambda m: _set(m, "codec", "{not json"), "'codec' is not valid JSON"),
        (None, lambda m: _set(m, "codec", json.dumps({"group_size": 12, "levels": "minmax"})), "group_size=12"),
        (None, lambda m: _set(m, "codec", json.dumps({"group_size": 16, "levels": "nf2"})), "levels='nf2'"),
        (None, lambda m: _set(m, "model", json.dumps({"num_layers": 2})), "shape fingerprint"),
        (None, lambda m: _set(m, "model", json.dumps({**dataclasses.asdict(MODEL), "num_layers": 0})), "num_layers=0"),
    ],
)
def test_every_validation_error(tmp_path, mutate_tensors, mutate_meta, match):
    file = _rewrite(tmp_path, mutate_tensors, mutate_meta)
    with pytest.raises(ArtifactError, match=match):
        read_artifact(file)


def test_missing_corrupt_and_wrong_model(tmp_path):
    with pytest.raises(ArtifactError, match="not found"):
        read_artifact(tmp_path / "nope")
    file = write_artifact(tmp_path, make_artifact())
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        read_artifact(file)
    file.write_bytes(b"\x80\x04pickle" * 10)
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        read_artifact(file)
    write_artifact(tmp_path, make_artifact())
    other = dataclasses.replace(MODEL, num_layers=30)
    with pytest.raises(ArtifactError, match="calibrated for"):
        read_artifact(tmp_path, expected_model=other)


def test_writer_validates():
    art = make_artifact()
    bad = dataclasses.replace(art, k_clip_ratio=np.zeros(2, np.float32))
    with pytest.raises(ArtifactError, match="k_clip_ratio"):
        write_artifact("/nonexistent-should-not-be-created", bad)
    with pytest.raises(ArtifactError, match="not a multiple"):
        ModelFingerprint(num_layers=1, num_q_heads=5, num_kv_heads=3, head_dim=16)
