"""Tensor parallelism over a `jax.sharding.Mesh` axis "tp": the model, the OSCAR cache, the steps.

Layout (Megatron-style, as vLLM / tpu-inference shard a decoder; the names are model.py's):
  attention   wqkv columns and wo rows by query head, each shard holding whole KV heads and the
              query heads that read them; one psum after wo
  MLP         w_gate, w_up by columns, w_down by rows (column- then row-parallel); one psum
  vocabulary  embed rows and lm_head columns by vocabulary; one psum of the embedding and one
              all-gather of the logits per step
  cache       every pool [Y, P, K, L, X] by KV head (axis 2), k_rotation [Y, K, D, D] by KV
              head: each shard's pages hold its heads only. Page tables and token counts are
              replicated: the host-side PageAllocator plans one step for all shards, and a page
              id means the same page on every shard
  norms       replicated
So a step runs 2 all-reduces per layer, 1 for the embedding and 1 all-gather; the cache ops
(Pallas kernels on GPU, oscar_jax/xla on CPU) run per shard on its heads inside one
`jax.shard_map` over the whole model step, as tpu-inference's `sharded_paged_attention` wraps
its kernel (lengths and page tables replicated, pools and q sharded by KV head).

Fewer KV heads than shards (K < tp, tp a multiple of K): every KV head is replicated tp/K times,
as tpu-inference does, so each shard owns one copy of the KV head its query heads read. The
cache then stores each head tp/K times: the pools take tp/K × the bytes of the unreplicated
cache in total, and each device holds as many bytes as one KV head's pages (not K/tp of them).
Other ratios are refused with an error naming both numbers.

Multi-host: call `initialize_distributed` in every process before anything else touches JAX;
`jax.devices()` then lists every host's devices and `make_mesh` spans them. Every process runs
the same program on the same inputs (the allocator is deterministic), one process per host.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oscar_jax.cache import POOL_NAMES, OscarKVCache, StepPlan
from oscar_jax.model import ModelConfig, Params, _causal_layer_jit, decode_step, fuse_qkv, prefill

TP_AXIS = "tp"

# Specs by weight name (model.py's params layout). Leading axes of stacked arrays are None.
_PARAM_SPECS = {
    "embed": P(TP_AXIS, None),  # [V, H] by vocabulary
    "lm_head": P(None, TP_AXIS),  # [H, V] by vocabulary
    "final_norm": P(), "attn_norm": P(), "mlp_norm": P(), "q_norm": P(), "k_norm": P(),
    "wqkv": P(None, TP_AXIS), "wq": P(None, TP_AXIS), "wk": P(None, TP_AXIS), "wv": P(None, TP_AXIS),
    "wo": P(TP_AXIS, None),  # rows by query head: row-parallel
    "w_gate": P(None, TP_AXIS), "w_up": P(None, TP_AXIS),  # column-parallel
    "w_down": P(TP_AXIS, None),  # row-parallel
}
POOL_SPEC = P(None, None, TP_AXIS)  # [Y, P, K, L, X]: by KV head
ROTATION_SPEC = P(None, TP_AXIS)  # [Y, K, D, D]


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """`jax.distributed.initialize` from the arguments, else from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID (or a cluster JAX detects: SLURM, Open MPI, ...).
    Returns whether it initialised; with no arguments and no JAX_COORDINATOR_ADDRESS it does
    nothing (one process)."""
    if coordinator_address is None and num_processes is None and process_id is None:
        if "JAX_COORDINATOR_ADDRESS" not in os.environ:
            return False
        num_processes = _env_int("JAX_NUM_PROCESSES")
        process_id = _env_int("JAX_PROCESS_ID")
    else:
        check_distributed_flags(coordinator_address, num_processes, process_id)
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"{process_id=} must be in [0, {num_processes=})")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


def check_distributed_flags(coordinator_address: str | None, num_processes: int | None,
                            process_id: int | None) -> None:
    """Raises ValueError unless the three are all None (one process, or the environment's
    variables) or all given, with 0 <= process_id < num_processes."""
    given = (coordinator_address, num_processes, process_id)
    if all(v is None for v in given):
        return
    if None in given:
        raise ValueError(f"multi-host needs all of {coordinator_address=}, {num_processes=}, {process_id=}")
    if num_processes < 1:
        raise ValueError(f"{num_processes=} must be at least 1")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"{process_id=} must be in [0, {num_processes=})")


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-host flags every entry point takes (`oscar_jax.generate`, `oscar_jax.serve`);
    `initialize_from_args` acts on them."""
    multi = parser.add_argument_group("multi-host (one process per host; default: JAX_COORDINATOR_ADDRESS, "
                                      "JAX_NUM_PROCESSES, JAX_PROCESS_ID when set)")
    multi.add_argument("--coordinator-address", help="host:port of process 0")
    multi.add_argument("--num-processes", type=int)
    multi.add_argument("--process-id", type=int)


def validate_distributed_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (exit 2, the message naming the flags) on a partial or out-of-range set."""
    try:
        check_distributed_flags(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as e:
        parser.error(f"--coordinator-address, --num-processes, --process-id: {e}")


def initialize_from_args(args: argparse.Namespace) -> bool:
    """initialize_distributed from the flags of add_distributed_arguments; call it before
    anything else touches JAX's backends."""
    return initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A 1-D mesh with axis "tp" over the first `tensor_parallel_size` devices (all hosts')."""
    devices = jax.devices() if devices is None else list(devices)
    if not isinstance(tensor_parallel_size, (int, np.integer)) or tensor_parallel_size < 1:
        raise ValueError(f"{tensor_parallel_size=} must be a positive integer")
    if tensor_parallel_size > len(devices):
        kind = devices[0].platform if devices else "no"
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} devices, "
                         f"but {len(devices)} {kind} devices are present")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,))


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How one model is split over a mesh. Hashable: the sharded steps take it as a static argument.

    cfg: the model the shards run together (its KV heads replicated `kv_replicas` times when the
    model has fewer KV heads than shards); local: one shard's part of it.
    """

    mesh: Mesh
    cfg: ModelConfig
    local: ModelConfig
    kv_replicas: int

    @classmethod
    def plan(cls, cfg: ModelConfig, mesh: Mesh) -> "TensorParallel":
        if mesh.axis_names != (TP_AXIS,):
            raise ValueError(f"the mesh must have the single axis {TP_AXIS!r}, not {mesh.axis_names}")
        tp = mesh.shape[TP_AXIS]
        for name in ("num_q_heads", "intermediate_size", "vocab_size"):
            if getattr(cfg, name) % tp:
                raise ValueError(f"{name}={getattr(cfg, name)} is not divisible by tensor_parallel_size={tp}")
        kv = cfg.num_kv_heads
        if kv % tp == 0:
            replicas = 1
        elif tp % kv == 0:
            replicas = tp // kv
        else:
            raise ValueError(f"num_kv_heads={kv} and tensor_parallel_size={tp}: one must divide the other "
                             "(KV heads are split across shards, or replicated when fewer)")
        full = dataclasses.replace(cfg, num_kv_heads=kv * replicas)
        local = dataclasses.replace(full, num_q_heads=cfg.num_q_heads // tp, num_kv_heads=full.num_kv_heads // tp,
                                    intermediate_size=cfg.intermediate_size // tp, vocab_size=cfg.vocab_size // tp)
        return cls(mesh, full, local, replicas)

    @property
    def size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # ------------------------------------------------------------------ placement

    def put(self, x, spec: P = P()) -> jax.Array:
        """A host array placed on the mesh (each process supplies its devices' parts, so this
        works across hosts as long as every process passes the same values)."""
        if isinstance(x, jax.Array) and jax.process_count() == 1:
            return jax.device_put(x, self.sharding(spec))  # device to devices, no host copy
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, self.sharding(spec), lambda index: host[index])

    def replicate_kv(self, rows, axis: int):
        """Repeat each KV head `kv_replicas` times along `axis` (head h → heads h·r … h·r + r − 1)."""
        return rows if self.kv_replicas == 1 else np.repeat(np.asarray(rows), self.kv_replicas, axis=axis)

    def shard_params(self, params: Params, *, fuse: bool = True) -> Params:
        """Value-rotation-folded, unfused params → the sharded (by default fused) params the steps
        take. Unfused, wq / wk / wv are sharded by columns as they are."""
        h, d, r = self.cfg.hidden_size, self.cfg.head_dim, self.kv_replicas
        layers = []
        for layer in params["layers"]:
            layer = dict(layer)
            if r > 1:  # the replicated KV heads' projections (k_norm acts per head: shared)
                for name in ("wk", "wv"):
                    w = np.asarray(layer[name])
                    layer[name] = self.replicate_kv(w.reshape(h, -1, d), axis=1).reshape(h, -1)
            layers.append(layer)
        params = dict(params, layers=layers)
        if fuse:
            params = fuse_qkv(params, shards=self.size)
        return jax.tree_util.tree_map_with_path(lambda path, w: self.put(w, _param_spec(path)), params)

    def gather_layer(self, layer: Params, device) -> Params:
        """One layer of `shard_params(..., fuse=False)` whole on `device`, as the model has it
        (each replicated KV head's projections once): an exact copy of the unsharded weights."""
        whole = {name: jax.device_put(w, device) for name, w in layer.items()}
        if self.kv_replicas > 1:
            h, d, r = self.cfg.hidden_size, self.cfg.head_dim, self.kv_replicas
            for name in ("wk", "wv"):
                whole[name] = whole[name].reshape(h, -1, d)[:, ::r].reshape(h, -1)
        return whole

    def create_cache(self, config, *, num_bf16_pages: int, num_int2_pages: int, k_rotation, k_clip_ratio,
                     v_clip_ratio, interpret: bool | None = None) -> OscarKVCache:
        """OscarKVCache.create with every pool allocated sharded (never whole on one device)."""
        rotation = self.put(self.replicate_kv(np.asarray(k_rotation, np.float32), axis=1), ROTATION_SPEC)

        def make(rotation):
            return OscarKVCache.create(
                config, num_layers=self.cfg.num_layers, num_kv_heads=self.cfg.num_kv_heads,
                num_bf16_pages=num_bf16_pages, num_int2_pages=num_int2_pages, k_rotation=rotation,
                k_clip_ratio=k_clip_ratio, v_clip_ratio=v_clip_ratio, interpret=interpret)

        shardings = jax.tree_util.tree_map(self.sharding, cache_specs(jax.eval_shape(make, rotation)))
        return jax.jit(make, out_shardings=shardings)(rotation)

    # ------------------------------------------------------------------ steps

    def prefill(self, params, cfg, tokens, cache, positions, lengths):
        """The runtime's prefill step (same arguments as oscar_jax.runtime._prefill)."""
        tokens, positions, lengths, cache = self._inputs(tokens, positions, lengths, cache)
        return _prefill_step(params, tokens, cache, positions, lengths, tp=self)

    def decode(self, params, cfg, tokens, cache, positions):
        """The runtime's decode step (same arguments as oscar_jax.runtime._decode)."""
        tokens, positions, cache = self._inputs(tokens, positions, cache)
        return _decode_step(params, tokens, cache, positions, tp=self)

    def demote(self, cache, src, dst):
        src, dst = self._inputs(src, dst)
        return _demote_step(cache, src, dst, tp=self)

    def _inputs(self, *args):
        """Host-planned inputs as replicated global arrays. One process: as they are (jit moves
        them); several: placed explicitly, since a jit over other hosts' devices takes only
        global arrays."""
        if jax.process_count() == 1:
            return args

        def place(x):
            return x if isinstance(x, jax.Array) and x.sharding.device_set == set(self.mesh.devices.flat) \
                else self.put(x)

        out = []
        for a in args:
            if isinstance(a, OscarKVCache) and a.plan is not None:
                a = dataclasses.replace(a, plan=jax.tree_util.tree_map(place, a.plan))
            out.append(a if isinstance(a, OscarKVCache) else place(a))
        return out


def iter_layer_activations(params: Params, tp: TensorParallel, tokens, *, positions=None):
    """model.iter_layer_activations for weights split over a mesh (calibration's forward pass of
    a model larger than one device): `params` from `tp.shard_params(..., fuse=False)`; yields
    (layer, LayerActivations) with the model's own KV heads (replicas dropped).

    The activations are the bits one device computes, so calibration writes the one-device
    artifact: each layer's weights are gathered onto the mesh's first device (a copy, no
    arithmetic) and run there by model.py's one-device layer program; only one layer's weights
    are whole at a time. A sharded forward pass could not promise that: its all-reduces add W_o's
    and W_down's per-shard partial products in another order than one GEMM does, and even a
    column shard is a narrower GEMM that XLA may block, and so round, differently."""
    if not params["embed"].is_fully_addressable:
        raise NotImplementedError(f"calibration runs in one process; the mesh spans {jax.process_count()} "
                                  "processes (a layer is gathered onto one device of this process)")
    device = tp.mesh.devices.flat[0]
    tokens = np.asarray(tokens, np.int32)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape) if positions is None \
        else np.asarray(positions, np.int32)
    cfg = dataclasses.replace(tp.cfg, num_kv_heads=tp.cfg.num_kv_heads // tp.kv_replicas)
    x = jax.device_put(_embedding_rows(params["embed"], tokens), device)
    positions = jax.device_put(positions, device)
    for index, layer in enumerate(params["layers"]):
        x, acts = _causal_layer_jit(tp.gather_layer(layer, device), cfg, x, positions)
        yield index, acts


def _embedding_rows(table: jax.Array, tokens: np.ndarray) -> np.ndarray:
    """table[tokens] of a table split by rows (vocabulary), copied from the shards that hold them."""
    rows = np.zeros(tokens.shape + table.shape[1:], table.dtype)
    for shard in table.addressable_shards:
        lo = shard.index[0].start or 0
        here = (tokens >= lo) & (tokens < lo + shard.data.shape[0])
        rows[here] = np.asarray(jnp.take(shard.data, tokens[here] - lo, axis=0))  # on the shard's device
    return rows


def _param_spec(path) -> P:
    name = path[-1].key
    if name not in _PARAM_SPECS:
        raise ValueError(f"no tensor-parallel layout for weight {name!r}")
    return _PARAM_SPECS[name]


def param_specs(params: Params):
    return jax.tree_util.tree_map_with_path(lambda path, _: _param_spec(path), params)


def cache_specs(cache: OscarKVCache) -> OscarKVCache:
    """The cache's pytree with a PartitionSpec per array: pools by KV head, plan replicated."""
    plan = None if cache.plan is None else jax.tree_util.tree_map(lambda _: P(), cache.plan)
    return dataclasses.replace(cache, plan=plan, k_rotation=ROTATION_SPEC, **{n: POOL_SPEC for n in POOL_NAMES})


def _shard_map(tp: TensorParallel, body, in_specs, out_specs):
    """jax.shard_map of `body` over the tp axis. in_specs: one PartitionSpec per array (a full
    tree, not a prefix). Zero-size arrays (a BF16-only plan's history table [B, 0]) are made
    inside instead of passed in: XLA's CPU compiler crashes on a zero-size parameter of a
    multi-device program (jax 0.11.2)."""

    def call(*args):
        leaves, treedef = jax.tree_util.tree_flatten(args)
        specs = jax.tree_util.tree_leaves(in_specs, is_leaf=lambda x: isinstance(x, P))
        assert len(specs) == len(leaves), "in_specs must give every array its PartitionSpec"
        kept = [i for i, x in enumerate(leaves) if x.size]

        def inner(*arrays):
            full = [jnp.zeros(x.shape, x.dtype) for x in leaves]
            for i, a in zip(kept, arrays):
                full[i] = a
            return body(*jax.tree_util.tree_unflatten(treedef, full))

        # check_vma off: the Pallas calls inside have no varying-axes rule; the specs are checked
        # by the tests instead (pages per shard equal the tp-1 pages of the same heads).
        return jax.shard_map(inner, mesh=tp.mesh, in_specs=tuple(specs[i] for i in kept), out_specs=out_specs,
                             check_vma=False)(*(leaves[i] for i in kept))

    return call


@functools.partial(jax.jit, static_argnames="tp", donate_argnames="cache")
def _prefill_step(params, tokens, cache, positions, lengths, *, tp: TensorParallel):
    def body(params, tokens, cache, positions, lengths):
        return prefill(params, tp.local, tokens, cache, positions=positions, lengths=lengths, tp_axis=TP_AXIS)

    specs = cache_specs(cache)
    return _shard_map(tp, body, (param_specs(params), P(), specs, P(), P()), (P(), specs))(
        params, tokens, cache, positions, lengths)


@functools.partial(jax.jit, static_argnames="tp", donate_argnames="cache")
def _decode_step(params, tokens, cache, positions, *, tp: TensorParallel):
    def body(params, tokens, cache, positions):
        return decode_step(params, tp.local, tokens, cache, positions, tp_axis=TP_AXIS)

    specs = cache_specs(cache)
    return _shard_map(tp, body, (param_specs(params), P(), specs, P()), (P(), specs))(
        params, tokens, cache, positions)


@functools.partial(jax.jit, static_argnames="tp", donate_argnames="cache")
def _demote_step(cache, src, dst, *, tp: TensorParallel):
    specs = cache_specs(cache)
    return _shard_map(tp, lambda cache, src, dst: cache.demote(src, dst), (specs, P(), P()), specs)(cache, src, dst)


def shard_pages(cache: OscarKVCache, name: str) -> list[np.ndarray]:
    """One pool's pages as each device holds them (its KV heads), in mesh order."""
    array = getattr(cache, name)
    return [np.asarray(s.data) for s in sorted(array.addressable_shards, key=lambda s: s.index[2].start or 0)]


__all__ = ["TP_AXIS", "TensorParallel", "add_distributed_arguments", "initialize_distributed", "initialize_from_args",
           "validate_distributed_arguments", "make_mesh", "param_specs", "cache_specs",
           "shard_pages"]
