"""JAX's persistent compilation cache for the entry points (demo, generate, serve): compiled
programs are kept on disk, so only a machine's first run of a shape pays for compiling it (a
server's warm-up compiles every decode batch and prefill chunk shape it serves)."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from shared_math.wheel_cache import cache_dir


def use_persistent_cache() -> Path | None:
    """Keep compiled programs in jax/ of the directory that holds fetched models
    (shared_math.wheel_cache.cache_dir: $OSCAR_CACHE_DIR or ~/.cache/oscar_jax). Returns that
    directory, or None where JAX_COMPILATION_CACHE_DIR (or jax.config) already chose another
    place, or the directory cannot be created (a read-only home: programs compile every run)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return None
    path = cache_dir() / "jax"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
