"""shared_math.models: model names and paths → files, and the shipped artifacts, found without a backend."""

import pytest

from shared_math.artifact import read_artifact
from shared_math.models import (DOWNLOADABLE, gguf_field, open_gguf, resolve_model_path, shipped_artifact,
                                 shipped_artifacts_dir)


def test_shipped_artifacts_are_found_by_model_name():
    root = shipped_artifacts_dir()
    assert root is not None and root.name == "artifacts" and root.parent.name == "oscar_jax"
    for name in ("smollm2-135m", "smollm2-135m-paper"):
        path = shipped_artifact(name)
        assert path == root / name
        assert read_artifact(path).model.head_dim == 64
    for name in ("no-such-model", "", "..", "smollm2-135m/../smollm2-135m"):
        assert shipped_artifact(name) is None, name


def test_resolve_model_path_names_what_is_wrong(tmp_path):
    assert resolve_model_path(tmp_path) == tmp_path  # an existing path is itself
    with pytest.raises(FileNotFoundError, match="does-not-exist.gguf"):
        resolve_model_path(str(tmp_path / "does-not-exist.gguf"))
    with pytest.raises(ValueError, match=r"unknown model 'llama-9000'.*\['gemma3-270m', 'smollm2-135m'\]"):
        resolve_model_path("llama-9000")
    assert sorted(DOWNLOADABLE) == ["gemma3-270m", "smollm2-135m"]


def _write_gguf(path, name: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_open_gguf_parses_a_file_once_and_again_when_it_changes(tmp_path):
    path = tmp_path / "model.gguf"
    _write_gguf(path, "first")
    reader = open_gguf(path)
    assert gguf_field(reader, "general.name") == "first"
    link = tmp_path / "link.gguf"
    link.symlink_to(path)
    assert open_gguf(str(path)) is reader and open_gguf(link) is reader  # one parse per file
    _write_gguf(path, "second, longer")  # another size (and mtime): parsed again
    assert gguf_field(open_gguf(path), "general.name") == "second, longer"
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file" * 8)
    for _ in range(2):  # a failed parse is not remembered, and names the path it was given
        with pytest.raises(ValueError, match=r"garbage\.gguf.*not a readable GGUF file"):
            open_gguf(garbage)
