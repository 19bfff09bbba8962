"""Save and restore an OscarRuntime's cache: pools with orbax, the allocator's state as JSON.

A snapshot taken after a long prefill can be restored into a runtime built from the same model
and artifact; decoding then resumes bit-identically. The pools are saved as global arrays, so a
tensor-parallel cache restores onto another mesh (another tp size, or one device) with its pages
resharded. A cache whose KV heads are replicated (fewer KV heads than shards) saves one copy of
each head and restores into any replication. Restoring checks the cache configuration,
the model fingerprint and every array's shape and dtype before touching the runtime.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shared_math.allocator import Demotion, Sequence
from oscar_jax.cache import POOL_NAMES

SNAPSHOT_VERSION = 2  # 2: prefix keys chained page by page (shared_math.allocator)


def _replicas(runtime) -> int:
    tp = getattr(runtime, "tp", None)
    return 1 if tp is None else tp.kv_replicas


def _pools(runtime) -> dict:
    """The pools with one copy of each KV head (a tensor-parallel cache may hold replicas)."""
    r = _replicas(runtime)
    return {name: getattr(runtime.cache, name)[:, :, ::r] if r > 1 else getattr(runtime.cache, name)
            for name in POOL_NAMES}


def _saved_shape(runtime, name: str) -> tuple[int, ...]:
    y, pages, heads, *rest = getattr(runtime.cache, name).shape
    return (y, pages, heads // _replicas(runtime), *rest)


def _describe(runtime) -> dict:
    cache = runtime.cache
    return {
        "snapshot_version": SNAPSHOT_VERSION,
        "config": runtime.config.to_dict(),
        "model": dataclasses.asdict(runtime.cfg),
        "k_clip_ratio": list(cache.k_clip_ratio),
        "v_clip_ratio": list(cache.v_clip_ratio),
        "pools": {name: [list(_saved_shape(runtime, name)), str(getattr(cache, name).dtype)] for name in POOL_NAMES},
    }


def _pool_state(pool) -> dict:
    return {"free": list(pool.free), "refs": pool.refs.tolist(),
            "cached": [[p, k.hex()] for p, k in pool.cached.items()],
            "registry": [[k.hex(), p] for k, p in pool.registry.items()]}


def _load_pool(pool, state) -> None:
    pool.free = collections.deque(int(p) for p in state["free"])
    pool.refs = np.asarray(state["refs"], np.int64)
    pool.cached = collections.OrderedDict((int(p), bytes.fromhex(k)) for p, k in state["cached"])
    pool.registry = {bytes.fromhex(k): int(p) for k, p in state["registry"]}
    pool.key_of = {p: k for k, p in pool.registry.items()}


def save_snapshot(runtime, directory: str | Path) -> Path:
    """Write `directory` (must not exist): cache/ (orbax), state.json."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists():
        raise FileExistsError(f"snapshot directory {directory} already exists")
    directory.mkdir(parents=True)
    arrays = _pools(runtime)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "cache", arrays)
    checkpointer.wait_until_finished()
    alloc = runtime.allocator
    state = {
        **_describe(runtime),
        "sequences": {str(sid): {"namespace": s.namespace, "tokens": s.tokens, "sink_pages": s.sink_pages,
                                 "history_pages": s.history_pages, "recent_pages": s.recent_pages}
                      for sid, s in alloc.sequences.items()},
        "pending": [dataclasses.asdict(d) for d in alloc._pending.values()],
        "next_id": alloc._next_id,
        "bf16_pool": _pool_state(alloc.bf16),
        "int2_pool": _pool_state(alloc.int2),
    }
    (directory / "state.json").write_text(json.dumps(state))
    return directory


def restore_snapshot(runtime, directory: str | Path) -> None:
    """Load a snapshot into a runtime built with the same model, artifact and cache sizes."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    state_file = directory / "state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"{state_file} not found: not an OSCAR snapshot")
    try:
        state = json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{state_file} is not valid JSON ({e})") from None
    expected = json.loads(json.dumps(_describe(runtime)))  # as written: tuples read back as lists
    for key, value in expected.items():
        if state.get(key) != value:
            raise ValueError(f"snapshot {key} {state.get(key)!r} does not match this runtime's {value!r}")
    # Each pool restores with the runtime's own sharding, so a snapshot taken on one mesh loads
    # onto another (a different tensor-parallel size, or one device) with its pages resharded.
    r = _replicas(runtime)
    target = {name: jax.ShapeDtypeStruct(_saved_shape(runtime, name), getattr(runtime.cache, name).dtype,
                                         sharding=getattr(runtime.cache, name).sharding if r == 1 else None)
              for name in POOL_NAMES}
    arrays = ocp.StandardCheckpointer().restore(directory / "cache", target)
    if r > 1:  # each KV head into each of its replicas, placed as the runtime's pools are
        arrays = {name: jax.jit(lambda a: jnp.repeat(a, r, axis=2),
                                out_shardings=getattr(runtime.cache, name).sharding)(a)
                  for name, a in arrays.items()}
    alloc = runtime.allocator
    alloc.sequences = {int(sid): Sequence(**s) for sid, s in state["sequences"].items()}
    alloc._pending = {d["seq_id"]: Demotion(**d) for d in state["pending"]}
    alloc._next_id = int(state["next_id"])
    _load_pool(alloc.bf16, state["bf16_pool"])
    _load_pool(alloc.int2, state["int2_pool"])
    alloc.check_invariants()
    runtime.cache = dataclasses.replace(runtime.cache, **arrays)
