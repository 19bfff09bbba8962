"""The entry points' persistent compilation cache: where it goes, and when it is left alone."""

import jax
import pytest

from oscar_jax.compile_cache import use_persistent_cache


@pytest.fixture
def no_cache_chosen(monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_programs_go_to_the_oscar_cache_dir(no_cache_chosen, monkeypatch, tmp_path):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    assert use_persistent_cache() == tmp_path / "jax"
    assert (tmp_path / "jax").is_dir() and jax.config.jax_compilation_cache_dir == str(tmp_path / "jax")


def test_a_cache_the_user_chose_is_kept(no_cache_chosen, monkeypatch, tmp_path):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/else")
    assert use_persistent_cache() is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert use_persistent_cache() is None and jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")


def test_an_unwritable_cache_dir_compiles_every_run(no_cache_chosen, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "file"))
    assert use_persistent_cache() is None and jax.config.jax_compilation_cache_dir is None
