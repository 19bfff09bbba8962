"""Decode attention at Qwen3-8B shapes on the H200: OSCAR INT2 mixed tiers vs the BF16 baselines.

Per (context, batch), one layer: 32 query heads, 8 KV heads, d = 128, pages of 64 tokens, sink 64 +
recent 256 tokens in BF16, the rest of the context in INT2 pages (format v1, group `--group-size`)
scattered over the pool in random order (as an allocator leaves them). Variants:
  oscar_int2_pallas   oscar_jax.ops.decode_attention (Pallas, Triton lowering), bf16 query
  oscar_int2_triton   oscar_torch.attention_ops.decode_attention (Triton), same buffers via DLPack
  bf16_paged_pallas   our BF16 paged path: the same kernels with the whole context in the BF16 tier
  cudnn_bf16          torch SDPA, cuDNN backend, called as users call it for decode: q [B, 32, 1, 128],
                      contiguous BF16 K/V [B, 8, S, 128], `enable_gqa=True`
  flash2_bf16         torch SDPA, FlashAttention-2 backend, the same call
  cudnn_bf16_rows_as_queries, flash2_bf16_rows_as_queries
                      the same backends given the 4 query heads of a KV head as 4 query rows of
                      that head (q [B, 8, 4, 128], no GQA flag): a form no decode user writes, which
                      launches about one program per (sequence, KV head); kept to show the difference
Every BF16 variant counts as a baseline (`BF16_VARIANTS`): the summary's speed-up is over the fastest.
Every variant is first checked against float32 attention over the (dequantized) cache of sequences 0
and B−1; a variant that fails is reported and not timed.

FlashInfer's BF16 decode is not among the baselines: its wheel (flashinfer-python 0.7.2.post1) is
62 MB before its dependencies (apache-tvm-ffi, nvidia-cutlass-dsl, cuda-tile, nccl4py), over the
64 MiB a device run may carry, and the older releases (0.2-0.4) on PyPI are source distributions only.
"""

from __future__ import annotations

import functools
import gc
import math

import numpy as np

from benchmarks import harness
from shared_math.spec import CODES_PER_BYTE

QWEN3_8B = dict(q_heads=32, kv_heads=8, head_dim=128)
PAGE = 64
SINK, RECENT = 64, 256
CONTEXTS = (8192, 32768, 131072)
BATCHES = (1, 8, 32)
REL_TOL = 2e-2  # bf16 query and bf16 probabilities before P·V (METHOD: bf16 operands 1e-3 … 1e-2)
INT2_DEFAULTS = ("oscar_int2_pallas", "oscar_int2_triton")  # the default launch of each backend
SDPA_FORMS = {"decode": "", "rows_as_queries": "_rows_as_queries"}  # form → variant-name suffix
BF16_VARIANTS = ("cudnn_bf16", "flash2_bf16", "bf16_paged_pallas") + tuple(
    f"{b}{SDPA_FORMS['rows_as_queries']}" for b in ("cudnn_bf16", "flash2_bf16"))


def sdpa_query(q, kv_heads: int, form: str):
    """(query, extra SDPA keywords) for torch SDPA over K/V [B, Hkv, S, d], from q [B, Hq, d].

    "decode": q [B, Hq, 1, d] with `enable_gqa=True`, the call a decode user writes (query head h
    reads KV head h // (Hq / Hkv), the grouping of format v1's GQA). "rows_as_queries": the Hq / Hkv
    query heads of a KV head as that head's query rows, q [B, Hkv, Hq / Hkv, d]."""
    batch, hq, d = q.shape
    if form == "decode":
        return q.reshape(batch, hq, 1, d), {"enable_gqa": True}
    if form == "rows_as_queries":
        return q.reshape(batch, kv_heads, hq // kv_heads, d), {}
    raise ValueError(f"unknown SDPA form {form!r}; choose from {sorted(SDPA_FORMS)}")


def int2_bytes_read(batch: int, context: int, kv_heads: int, head_dim: int, group_size: int) -> dict:
    """Bytes the INT2 mixed-tier kernels must read: codes + fp16 scale/min for history tokens,
    BF16 K/V for the sink and recent tokens (queries and outputs are negligible)."""
    history = context - SINK - RECENT
    per_int2_token = 2 * (head_dim // CODES_PER_BYTE + 2 * 2 * (head_dim // group_size))  # K and V
    per_bf16_token = 2 * head_dim * 2
    total = batch * kv_heads * (history * per_int2_token + (SINK + RECENT) * per_bf16_token)
    return {"total": total, "history_tokens": history, "int2_bytes_per_token_head": per_int2_token}


def bf16_bytes_read(batch: int, context: int, kv_heads: int, head_dim: int) -> int:
    return batch * kv_heads * context * 2 * head_dim * 2


# ------------------------------------------------------------------------------ references


def _reference(q, keys, values):
    """float32 attention of q [Hq, D] over keys/values [S, K, D] (GQA), HIGHEST precision."""
    import jax
    import jax.numpy as jnp

    hq, d = q.shape
    kv = keys.shape[1]
    qg = q.astype(jnp.float32).reshape(kv, hq // kv, d)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("kgd,skd->kgs", qg, keys, precision=hi) * d**-0.5
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("kgs,skd->kgd", p, values, precision=hi).reshape(hq, d)


# ------------------------------------------------------------------------------ INT2 cache


def build_int2_cache(key, batch, context, copies, group_size, kv_heads, head_dim):
    """Random INT2 + BF16 pools holding `copies` independent caches of `batch` sequences."""
    import jax
    import jax.numpy as jnp

    history_pages = (context - SINK - RECENT) // PAGE
    bf16_slots = (SINK + RECENT) // PAGE
    int2_pages = copies * batch * history_pages
    bf16_pages = copies * batch * bf16_slots
    keys = jax.random.split(key, 8)
    groups = head_dim // group_size
    codes_shape = (int2_pages, kv_heads, PAGE, head_dim // CODES_PER_BYTE)
    meta_shape = (int2_pages, kv_heads, PAGE, groups)

    def scale(k):
        return jax.random.uniform(k, meta_shape, jnp.float32, 0.02, 0.12).astype(jnp.float16)

    def minimum(k):
        return (-1.5 * jax.random.uniform(k, meta_shape, jnp.float32, 0.02, 0.12)).astype(jnp.float16)

    bf16_shape = (bf16_pages, kv_heads, PAGE, head_dim)
    pools = dict(
        k_bf16=(0.1 * jax.random.normal(keys[0], bf16_shape, jnp.float32)).astype(jnp.bfloat16),
        v_bf16=(0.1 * jax.random.normal(keys[1], bf16_shape, jnp.float32)).astype(jnp.bfloat16),
        k_codes=jax.random.bits(keys[2], codes_shape, jnp.uint8),
        k_scale=scale(keys[3]), k_min=minimum(keys[4]),
        v_codes=jax.random.bits(keys[5], codes_shape, jnp.uint8),
        v_scale=scale(keys[6]), v_min=minimum(keys[7]),
    )
    rng = np.random.default_rng(context * 131 + batch)
    history_tables = rng.permutation(int2_pages).astype(np.int32).reshape(copies, batch, history_pages)
    bf16_tables = rng.permutation(bf16_pages).astype(np.int32).reshape(copies, batch, bf16_slots)
    lengths = dict(
        sink_tokens=np.full((batch,), SINK, np.int32),
        recent_tokens=np.full((batch,), RECENT, np.int32),
        history_tokens=np.full((batch,), context - SINK - RECENT, np.int32),
    )
    return pools, bf16_tables, history_tables, lengths


def dequantized_sequence(pools, bf16_table, history_table, group_size):
    """(keys, values) float32 [S, K, D] of one sequence: BF16 tiers then the decoded history."""
    import jax.numpy as jnp

    from oscar_jax import ops

    def gather(pool, table):  # [n, K, L, ·] → [n·L, K, ·]
        x = pool[jnp.asarray(table)]
        return x.transpose(0, 2, 1, 3).reshape((-1,) + x.shape[1:2] + x.shape[3:])

    out = []
    for prefix in ("k", "v"):
        hi = gather(pools[f"{prefix}_bf16"], bf16_table).astype(jnp.float32)
        lo = ops.decode(*(gather(pools[f"{prefix}_{n}"], history_table) for n in ("codes", "scale", "min")),
                        group_size=group_size)
        out.append(jnp.concatenate([hi, lo], axis=0))
    return out


# ------------------------------------------------------------------------------ variants


def run_config(context: int, batch: int, group_size: int, seed: int = 0, tuning: list | None = None,
               triton_tuning: list | None = None, on_variant=None) -> dict:
    """One (context, batch): every variant checked, then timed. `tuning` / `triton_tuning` are extra
    keyword sets for oscar_jax.ops.decode_attention / oscar_torch's, timed as extra variants.
    `on_variant(result)` is called after each variant with the config so far, so a run stopped by a
    time limit still leaves what it measured."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from oscar_jax import ops
    from oscar_torch import attention_ops as torch_attention

    hq, kv, d = QWEN3_8B["q_heads"], QWEN3_8B["kv_heads"], QWEN3_8B["head_dim"]
    scale = d**-0.5
    int2_read = int2_bytes_read(batch, context, kv, d, group_size)
    bf16_read = bf16_bytes_read(batch, context, kv, d)
    result = {"context": context, "batch": batch, "group_size": group_size, "q_heads": hq, "kv_heads": kv,
              "head_dim": d, "page_size": PAGE, "sink": SINK, "recent": RECENT,
              "int2_bytes_read": int2_read["total"], "bf16_bytes_read": bf16_read, "variants": {}}
    key = jax.random.key(seed)
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, hq, d), jnp.float32).astype(jnp.bfloat16)
    check_rows = sorted({0, batch - 1})

    def record(name, bytes_read, timing, err):
        entry = {"rel_error": err, "passed": bool(err <= REL_TOL), "bytes_read": bytes_read}
        if timing is not None:
            entry.update(timing, gb_per_s=bytes_read / timing["median_s"] / 1e9)
        result["variants"][name] = entry
        if on_variant is not None:
            on_variant(result)
        t = f"{timing['median_s'] * 1e6:9.1f} us {entry['gb_per_s']:7.0f} GB/s" if timing else "   (not timed)"
        if timing and "queued_median_s" in timing:  # JAX, a short call: device span reported, host-timed kept
            t += (f"  (device busy {timing['busy_median_s'] * 1e6:.1f} us; host-timed "
                  f"{timing['queued_median_s'] * 1e6:.1f} us)")
        elif timing and "wall_median_s" in timing:  # JAX: one program's wall time a call, fixed cost included
            t += f"  (one program: {timing['wall_median_s'] * 1e6:.1f} us)"
        print(f"  {name:24s} ctx {context:6d} b {batch:2d}: err {err:.2e} {t}", flush=True)

    # ---- INT2 mixed tiers (Pallas and Triton read the same device buffers) ----
    copies = harness.copies_to_defeat_l2(int2_read["total"])
    pools, bf16_tables, history_tables, lengths = build_int2_cache(
        jax.random.fold_in(key, 2), batch, context, copies, group_size, kv, d)
    names = ("k_bf16", "v_bf16", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
    pool_args = tuple(pools[n] for n in names)
    bf16_tables_j, history_tables_j = jnp.asarray(bf16_tables), jnp.asarray(history_tables)
    lengths_j = {n: jnp.asarray(v) for n, v in lengths.items()}
    common = dict(sink_slots=SINK // PAGE, group_size=group_size, softmax_scale=scale)
    refs = {}
    for b in check_rows:
        keys_b, values_b = dequantized_sequence(pools, bf16_tables[0, b], history_tables[0, b], group_size)
        refs[b] = np.asarray(_reference(q[b], keys_b, values_b))
        del keys_b, values_b

    # Arrays reach jitted code as arguments, never by closure (harness.time_jax_loop: why).
    int2_operands = (pool_args, bf16_tables_j, history_tables_j, lengths_j)

    def jax_int2(q_, c, operands, **tiling):
        pools_, bf16_t, history_t, lens = operands
        return ops.decode_attention(q_, *pools_, bf16_t[c], lens["sink_tokens"], lens["recent_tokens"],
                                    history_t[c], lens["history_tokens"], **common, **tiling)

    def check(out):
        return max(harness.relative_error(np.asarray(out)[b], refs[b]) for b in check_rows)

    def time_jax_variant(fn, operands):
        def step(i, q_, operands):
            o = fn(q_, i % copies, operands)
            return (q_.astype(jnp.float32) + 0.0 * o).astype(q_.dtype)  # serial dependency, same values

        return harness.time_jax_loop(step, q, reps=max(32, 2 * copies), operands=(operands,))

    variants = [("oscar_int2_pallas", {})] + [(f"oscar_int2_pallas[{t}]", t) for t in (tuning or [])]
    for name, tiling in variants:
        try:
            fn = functools.partial(jax_int2, **tiling)
            err = check(jax.jit(lambda q_, operands, fn=fn: fn(q_, 0, operands))(q, int2_operands))
            timing = time_jax_variant(fn, int2_operands) if err <= REL_TOL else None
        except Exception as e:  # noqa: BLE001 - a failing tiling is recorded, not fatal
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            result["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            continue
        record(name, int2_read["total"], timing, err)

    tq = torch.from_dlpack(q)
    tpools = tuple(torch.from_dlpack(p) for p in pool_args)
    t_bf16_tables = torch.from_dlpack(bf16_tables_j)
    t_history_tables = torch.from_dlpack(history_tables_j)
    t_lengths = {n: torch.from_dlpack(v) for n, v in lengths_j.items()}

    def torch_int2(c, **tiling):
        return torch_attention.decode_attention(
            tq, *tpools, t_bf16_tables[c], t_lengths["sink_tokens"], t_lengths["recent_tokens"],
            t_history_tables[c], t_lengths["history_tokens"], **common, **tiling)

    triton_variants = [("oscar_int2_triton", {})] + [(f"oscar_int2_triton[{t}]", t) for t in (triton_tuning or [])]
    for name, tiling in triton_variants:
        try:
            err = check(torch_int2(0, **tiling).cpu().numpy())
            timing = (harness.time_torch_graph([lambda c=c: torch_int2(c, **tiling) for c in range(copies)])
                      if err <= REL_TOL else None)
        except Exception as e:  # noqa: BLE001 - a failing tiling is recorded, not fatal
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            result["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            continue
        record(name, int2_read["total"], timing, err)
    del tpools, t_bf16_tables, t_history_tables, pools, pool_args
    gc.collect()
    torch.cuda.empty_cache()

    # ---- BF16 baselines: contiguous K/V for SDPA, the same values paged for our BF16 path ----
    copies = harness.copies_to_defeat_l2(bf16_read)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_shape = (batch, kv, context, d)
    ks = [torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.5 for _ in range(copies)]
    vs = [torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    refs = {b: np.asarray(_reference(q[b], jnp.asarray(ks[0][b].transpose(0, 1).float().cpu().numpy()),
                                     jnp.asarray(vs[0][b].transpose(0, 1).float().cpu().numpy())))
            for b in check_rows}
    sdpa_variants = [(f"{name}{suffix}", backend, form)
                     for form, suffix in SDPA_FORMS.items()
                     for name, backend in (("cudnn_bf16", SDPBackend.CUDNN_ATTENTION),
                                           ("flash2_bf16", SDPBackend.FLASH_ATTENTION))]
    for name, backend, form in sdpa_variants:
        q_sdpa, gqa = sdpa_query(tq, kv, form)

        def sdpa(c, backend=backend, q_sdpa=q_sdpa, gqa=gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q_sdpa, ks[c], vs[c], scale=scale, **gqa)
        try:
            out = sdpa(0).reshape(batch, hq, d).float().cpu().numpy()
            err = check(out)
            timing = harness.time_torch_graph([lambda c=c: sdpa(c) for c in range(copies)]) if err <= REL_TOL else None
        except Exception as e:  # noqa: BLE001 - a backend the build lacks is recorded
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            result["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            continue
        record(name, bf16_read, timing, err)

    # Our BF16 paged path: page p of copy c, sequence b holds tokens [64p, 64p + 64).
    pages_per_seq = context // PAGE

    def paged(x):  # [B, K, S, D] → [B·S/L, K, L, D]
        return x.view(batch, kv, pages_per_seq, PAGE, d).permute(0, 2, 1, 3, 4).reshape(-1, kv, PAGE, d)

    k_pool = jnp.asarray(jax.dlpack.from_dlpack(torch.cat([paged(k) for k in ks])))
    v_pool = jnp.asarray(jax.dlpack.from_dlpack(torch.cat([paged(v) for v in vs])))
    del ks, vs
    gc.collect()
    torch.cuda.empty_cache()
    tables = jnp.arange(copies * batch * pages_per_seq, dtype=jnp.int32).reshape(copies, batch, pages_per_seq)
    empty_codes = jnp.zeros((1, kv, PAGE, d // CODES_PER_BYTE), jnp.uint8)
    empty_meta = jnp.zeros((1, kv, PAGE, d // group_size), jnp.float16)
    split = max(1, 2 ** math.ceil(math.log2(max(1, pages_per_seq // 32))))

    bf16_operands = (k_pool, v_pool, tables)

    def jax_bf16(q_, c, operands):
        k_pool_, v_pool_, tables_ = operands
        return ops.decode_attention(
            q_, k_pool_, v_pool_, empty_codes, empty_meta, empty_meta, empty_codes, empty_meta, empty_meta,
            tables_[c], jnp.full((batch,), SINK, jnp.int32), jnp.full((batch,), context - SINK, jnp.int32),
            jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch,), jnp.int32),
            **common, pages_per_split=split)

    err = check(jax.jit(lambda q_, operands: jax_bf16(q_, 0, operands))(q, bf16_operands))
    timing = time_jax_variant(jax_bf16, bf16_operands) if err <= REL_TOL else None
    record("bf16_paged_pallas", bf16_read, timing, err)
    del k_pool, v_pool
    gc.collect()
    return result
