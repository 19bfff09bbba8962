"""The four implementations of format v1 behind one numpy-in, numpy-out interface.

`shared_math` (the reference), `jax` (oscar_jax.ops / attention_ops with the Pallas kernels:
interpret mode on a CPU backend, compiled on a GPU backend), `xla` (the same public ops on their
native XLA path, oscar_jax/xla) and `torch` (oscar_torch.ops: Triton, the interpreter on CPU,
compiled on cuda). The two oscar_jax implementations are chosen with `oscar_jax.xla.use_kernels`
around each call, so each runs whatever the platform default or OSCAR_JAX_KERNELS says. Every backend receives the same numpy arrays (bfloat16 as uint16 bit
patterns) and returns numpy arrays, so a test compares bytes directly. This module (and the tests
beside it) is the only code that imports both backends.

Device: torch tensors go to cuda when OSCAR_TEST_GPU=1 and a GPU is present, else to cpu (the
root conftest sets TRITON_INTERPRET=1 and JAX_PLATFORMS=cpu unless OSCAR_TEST_GPU=1).
"""

from __future__ import annotations

import os

# Two frameworks share one GPU: JAX must not preallocate most of its memory (set before JAX starts).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import oscar_jax.attention_ops as jax_attention  # noqa: E402
import oscar_jax.ops as jax_ops  # noqa: E402
from oscar_jax.xla import use_kernels  # noqa: E402
import oscar_torch.ops as torch_ops  # noqa: E402
from parity_tests import cases  # noqa: E402
from shared_math import codec as reference  # noqa: E402

ON_GPU = os.environ.get("OSCAR_TEST_GPU") == "1"
TORCH_DEVICE = torch.device("cuda" if ON_GPU and torch.cuda.is_available() else "cpu")
JAX_KERNELS = {"jax": "pallas", "xla": "xla"}  # backend → the oscar_jax implementation it runs


# ------------------------------------------------------------------------------ conversion


def to_jax(a: np.ndarray):
    a = np.ascontiguousarray(a).reshape(np.shape(a))  # (ascontiguousarray makes a 0-d array 1-d)
    if a.dtype == np.uint16:  # bfloat16 bit patterns
        return jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.bfloat16)
    return jnp.asarray(a)


def from_jax(x) -> np.ndarray:
    if x.dtype == jnp.bfloat16:
        return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))
    return np.asarray(x)


def to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a).reshape(np.shape(a))
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(TORCH_DEVICE)
    return torch.from_numpy(a.copy()).to(TORCH_DEVICE)


def from_torch(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _query_jax(q: np.ndarray, dtype: str):
    """float32 q in the case's dtype; any other q as given (an error path's)."""
    if q.dtype != np.float32:
        return to_jax(q)
    return to_jax(q).astype(jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)


def _query_torch(q: np.ndarray, dtype: str):
    if q.dtype != np.float32:
        return to_torch(q)
    return to_torch(q).to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)


# ------------------------------------------------------------------------------ the ops


def encode(backend: str, x: np.ndarray, **kwargs):
    if backend == "shared_math":
        return reference.encode(x, **kwargs)
    if backend in JAX_KERNELS:
        with use_kernels(JAX_KERNELS[backend]):
            return tuple(from_jax(a) for a in jax_ops.encode(to_jax(x), **kwargs))
    return tuple(from_torch(a) for a in torch_ops.encode(to_torch(x), **kwargs))


def decode(backend: str, packed: np.ndarray, scale: np.ndarray, minimum: np.ndarray, *, group_size: int) -> np.ndarray:
    if backend == "shared_math":
        return reference.decode(packed, scale, minimum, group_size=group_size)
    if backend in JAX_KERNELS:
        with use_kernels(JAX_KERNELS[backend]):
            return from_jax(jax_ops.decode(to_jax(packed), to_jax(scale), to_jax(minimum), group_size=group_size))
    return from_torch(torch_ops.decode(to_torch(packed), to_torch(scale), to_torch(minimum), group_size=group_size))


def write_int2(backend: str, x: np.ndarray, rotation, **kwargs) -> tuple[np.ndarray, ...]:
    """The public write_int2 of oscar_jax or oscar_torch (no shared_math counterpart: it rotates)."""
    if backend in JAX_KERNELS:
        with use_kernels(JAX_KERNELS[backend]):
            out = jax_ops.write_int2(to_jax(x), None if rotation is None else to_jax(rotation), **kwargs)
        return tuple(from_jax(a) for a in out)
    out = torch_ops.write_int2(to_torch(x), None if rotation is None else to_torch(rotation), **kwargs)
    return tuple(from_torch(a) for a in out)


def write_pages(backend: str, pools, rows, page_ids, slots, rotation=None, **kwargs):
    """Rows float32 or bfloat16 bits (uint16); `rotation` (float32 [K, D, D]) is fused into the
    backends' write (shared_math takes rows already rotated)."""
    if backend == "shared_math":
        assert rotation is None, "shared_math.encode takes rotated rows"
        return cases.reference_scatter(pools, rows, page_ids, slots, **kwargs)
    if backend in JAX_KERNELS:
        rotation = None if rotation is None else to_jax(rotation)
        with use_kernels(JAX_KERNELS[backend]):
            out = jax_ops.write_pages(*(to_jax(p) for p in pools), to_jax(rows), to_jax(page_ids), to_jax(slots),
                                      rotation=rotation, **kwargs)
        return tuple(from_jax(a) for a in out)
    rotation = None if rotation is None else to_torch(rotation)
    tensors = tuple(to_torch(p) for p in pools)
    torch_ops.write_pages(*tensors, to_torch(rows), to_torch(page_ids), to_torch(slots), rotation=rotation, **kwargs)
    return tuple(from_torch(t) for t in tensors)


def write_bf16_pages(backend: str, pool, rows, page_ids, slots):
    if backend == "shared_math":
        return cases.reference_bf16_scatter(pool, rows, page_ids, slots)
    if backend in JAX_KERNELS:
        with use_kernels(JAX_KERNELS[backend]):
            return from_jax(jax_ops.write_bf16_pages(to_jax(pool), to_jax(rows), to_jax(page_ids), to_jax(slots)))
    tensor = to_torch(pool)
    torch_ops.write_bf16_pages(tensor, to_torch(rows), to_torch(page_ids), to_torch(slots))
    return from_torch(tensor)


def demote_pages(backend: str, bf16_pool, pools, src, dst, **kwargs):
    if backend == "shared_math":
        return cases.reference_demote(bf16_pool, pools, src, dst, **kwargs)
    if backend in JAX_KERNELS:
        with use_kernels(JAX_KERNELS[backend]):
            out = jax_ops.demote_pages(to_jax(bf16_pool), *(to_jax(p) for p in pools), to_jax(src), to_jax(dst),
                                       **kwargs)
        return tuple(from_jax(a) for a in out)
    tensors = tuple(to_torch(p) for p in pools)
    torch_ops.demote_pages(to_torch(bf16_pool), *tensors, to_torch(src), to_torch(dst), **kwargs)
    return tuple(from_torch(t) for t in tensors)


def write_cache(backend: str, case: cases.AttentionCase, cache: cases.PagedCache) -> tuple[np.ndarray, ...]:
    """Write the case's tokens into the poisoned empty pools through `backend`'s write path
    (write_bf16_pages for sink and recent rows, write_pages for history rows, K and V), and
    return the eight pools."""
    plan = cache.plan
    k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min = cache.empty_pools()
    codec = dict(group_size=case.group_size, levels=case.levels)
    k_bf16 = write_bf16_pages(backend, k_bf16, plan.bf16_rows_k, plan.bf16_page_ids, plan.bf16_slots)
    v_bf16 = write_bf16_pages(backend, v_bf16, plan.bf16_rows_v, plan.bf16_page_ids, plan.bf16_slots)
    if plan.int2_page_ids.size:
        k_codes, k_scale, k_min = write_pages(backend, (k_codes, k_scale, k_min), plan.int2_rows_k,
                                              plan.int2_page_ids, plan.int2_slots,
                                              clip_ratio=cases.DEFAULT_K_CLIP_RATIO, **codec)
        v_codes, v_scale, v_min = write_pages(backend, (v_codes, v_scale, v_min), plan.int2_rows_v,
                                              plan.int2_page_ids, plan.int2_slots,
                                              clip_ratio=cases.DEFAULT_V_CLIP_RATIO, **codec)
    return k_bf16, v_bf16, k_codes, k_scale, k_min, v_codes, v_scale, v_min


def decode_attention(backend: str, case: cases.AttentionCase, pools, tables, q: np.ndarray,
                     **overrides) -> np.ndarray:
    """The case's launch arguments, `overrides` replacing any (an error path's)."""
    kwargs = {**dict(sink_slots=case.sink_slots, group_size=case.group_size, softmax_scale=case.softmax_scale,
                     pages_per_split=case.pages_per_split, pages_per_block=case.pages_per_block), **overrides}
    if backend in JAX_KERNELS:
        with use_kernels(JAX_KERNELS[backend]):
            out = jax_attention.decode_attention(_query_jax(q, case.q_dtype), *(to_jax(a) for a in pools + tables),
                                                 **kwargs)
        return np.asarray(out)
    out = torch_ops.decode_attention(_query_torch(q, case.q_dtype), *(to_torch(a) for a in pools + tables), **kwargs)
    return from_torch(out)


def channel_key_decode_attention(backend: str, case: cases.ChannelKeyCase, pools, tables, q) -> np.ndarray:
    """Decode over format v2's per-channel key pages: the oscar_jax backends ("jax", "xla") only."""
    if backend not in JAX_KERNELS:
        raise NotImplementedError(f"backend {backend!r} does not read per-channel key pages")
    with use_kernels(JAX_KERNELS[backend]):
        out = jax_attention.decode_attention(_query_jax(q, case.q_dtype), *(to_jax(a) for a in pools + tables),
                                             sink_slots=1, group_size=case.group_size,
                                             softmax_scale=case.softmax_scale, key_layout="channel")
    return np.asarray(out)


def merge_partials(backend: str, outputs: np.ndarray, lses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """attention_ops.merge_partials of oscar_jax or oscar_torch over float32 partials."""
    if backend in JAX_KERNELS:
        return tuple(from_jax(a) for a in jax_attention.merge_partials(to_jax(outputs), to_jax(lses)))
    import oscar_torch.attention_ops as torch_attention

    return tuple(from_torch(a) for a in torch_attention.merge_partials(to_torch(outputs), to_torch(lses)))


def prefill_attention(backend: str, case: cases.PrefillCase, pools, tables, q, k_new, v_new) -> np.ndarray:
    p = case.prefix
    kwargs = dict(sink_slots=p.sink_slots, group_size=p.group_size, softmax_scale=p.softmax_scale,
                  pages_per_split=p.pages_per_split, pages_per_block=p.pages_per_block,
                  block_m=case.block_m, block_n=case.block_n)
    new_tokens = np.asarray(case.new_tokens, np.int32)
    if backend in JAX_KERNELS:
        kv = jnp.bfloat16 if case.kv_dtype == "bfloat16" else jnp.float32
        with use_kernels(JAX_KERNELS[backend]):
            out = jax_attention.prefill_attention(
                _query_jax(q, p.q_dtype), to_jax(k_new).astype(kv), to_jax(v_new).astype(kv),
                *(to_jax(a) for a in pools + tables), to_jax(new_tokens), **kwargs)
        return np.asarray(out)
    kv = torch.bfloat16 if case.kv_dtype == "bfloat16" else torch.float32
    out = torch_ops.prefill_attention(
        _query_torch(q, p.q_dtype), to_torch(k_new).to(kv), to_torch(v_new).to(kv),
        *(to_torch(a) for a in pools + tables), to_torch(new_tokens), **kwargs)
    return from_torch(out)


# ------------------------------------------------------------------------------ the encode kernels
# The two kernel sets ("jax": oscar_jax.kernels, "torch": oscar_torch.kernels) implement the same
# encode block bodies (order statistics, encode by planes); the XLA path has none of them.


def kernel_codec(backend: str):
    """The backend's kernel codec module (oscar_jax.kernels.codec or oscar_torch.kernels.codec)."""
    if backend == "jax":
        from oscar_jax.kernels import codec
    elif backend == "torch":
        from oscar_torch.kernels import codec
    else:
        raise ValueError(f"{backend!r} has no encode kernels")
    return codec


def rows_dtype_of(backend: str, dtype: str):
    """The backend's dtype named "float32" or "bfloat16" (an argument of resolve_order_statistic)."""
    return {"jax": {"float32": jnp.float32, "bfloat16": jnp.bfloat16},
            "torch": {"float32": torch.float32, "bfloat16": torch.bfloat16}}[backend][dtype]


def encode_rows(backend: str, x: np.ndarray, **kwargs) -> tuple[np.ndarray, ...]:
    """The backend's kernel launcher `encode_rows` over rows x [N, D] (float32, or bfloat16 as uint16
    bit patterns); kwargs: group_size, clip_index, levels, order_statistic, block_rows, planes."""
    kernels = kernel_codec(backend)
    if backend == "jax":
        return tuple(from_jax(a) for a in kernels.encode_rows(to_jax(x), **kwargs))
    return tuple(from_torch(a) for a in kernels.encode_rows(to_torch(x), **kwargs))


# ------------------------------------------------------------------------------ the write kernels
# The kernel sets' write launchers (oscar_jax.kernels.write, oscar_torch.kernels.write), below the
# public ops' validation: rows [T, K, D] float32 or bfloat16 (uint16 bits), pools numpy, returned.


def kernel_write(backend: str):
    """The backend's kernel write module."""
    if backend == "jax":
        from oscar_jax.kernels import write
    elif backend == "torch":
        from oscar_torch.kernels import write
    else:
        raise ValueError(f"{backend!r} has no write kernels")
    return write


def _kernel_array(backend: str, a):
    return None if a is None else (to_jax(a) if backend == "jax" else to_torch(a))


def write_int2_rows(backend: str, rows: np.ndarray, rotation, **kwargs) -> tuple[np.ndarray, ...]:
    got = kernel_write(backend).write_int2_rows(_kernel_array(backend, rows), _kernel_array(backend, rotation),
                                                **kwargs)
    return tuple(from_jax(a) if backend == "jax" else from_torch(a) for a in got)


def write_pages_rows(backend: str, pools, rows, page_ids, slots, rotation, **kwargs) -> tuple[np.ndarray, ...]:
    """The pools after the launcher wrote rows at (page_ids[t], slots[t]) (torch: in place)."""
    arrays = [_kernel_array(backend, a) for a in (*pools, rows, page_ids, slots, rotation)]
    got = kernel_write(backend).write_pages_rows(*arrays, **kwargs)
    if backend == "jax":
        return tuple(from_jax(a) for a in got)
    return tuple(from_torch(a) for a in arrays[:3])


def demote_pages_rows(backend: str, bf16_pool, pools, src, dst, **kwargs) -> tuple[np.ndarray, ...]:
    """The pools [Y, P, K, L, ·] after the launcher demoted bf16_pool[y, src[n]] into [y, dst[n]]."""
    arrays = [_kernel_array(backend, a) for a in (bf16_pool, *pools, src, dst)]
    got = kernel_write(backend).demote_pages_rows(*arrays, **kwargs)
    if backend == "jax":
        return tuple(from_jax(a) for a in got)
    return tuple(from_torch(a) for a in arrays[1:4])


def rotation_operand(backend: str, rotation: np.ndarray, rows_dtype: str) -> np.ndarray:
    """The rotation as the backend's write kernel reads it, for rows of `rows_dtype` ("float32" or
    "bfloat16"): the JAX launcher's under jit on the device (bfloat16 parts come back as uint16
    bits), the torch launcher's on the test device (int16 bits)."""
    write = kernel_write(backend)
    if backend == "jax":
        dtype = rows_dtype_of(backend, rows_dtype)
        return from_jax(jax.jit(lambda r: write._rotation_operand(r, dtype)[0])(to_jax(rotation)))
    rows = torch.zeros((1,) + rotation.shape[:1] + rotation.shape[-1:], device=TORCH_DEVICE,
                       dtype=rows_dtype_of(backend, rows_dtype))
    return from_torch(write._rotation_operand(to_torch(rotation), rows))
