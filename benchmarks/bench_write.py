"""The INT2 write path on the H200: prefill write (rotate + clip + quantize + pack) and demotion.

Qwen3-8B shapes (8 KV heads, d = 128). Throughput counts the bytes each kernel must move: rows
read (float32 or bf16) + codes and fp16 metadata written (+ the rotation, read once per program
and negligible); demotion reads BF16 pages and writes INT2 pages, for all 36 layers in one launch.
Correctness before timing: the pools written by Pallas and by Triton are bit-identical, and the
unrotated write equals shared_math.codec.encode on a subset of rows.
"""

from __future__ import annotations

import gc

import numpy as np

from benchmarks import harness
from shared_math import codec
from shared_math.spec import CODES_PER_BYTE

KV_HEADS, HEAD_DIM, PAGE, LAYERS = 8, 128, 64, 36
CLIP = 0.96


def _int2_bytes(tokens: int, heads: int, d: int, group: int) -> int:
    return tokens * heads * (d // CODES_PER_BYTE + 2 * 2 * (d // group))


def write_pages_case(tokens: int, group_size: int, rows_dtype: str) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    from oscar_jax import ops
    from oscar_torch import ops as torch_ops

    key = jax.random.key(tokens)
    dtype = jnp.dtype(rows_dtype)
    rows = jax.random.normal(key, (tokens, KV_HEADS, HEAD_DIM), jnp.float32).astype(dtype)
    q, _ = jnp.linalg.qr(jax.random.normal(jax.random.fold_in(key, 1), (KV_HEADS, HEAD_DIM, HEAD_DIM)))
    rotation = q.astype(jnp.float32)
    pages = tokens // PAGE
    perm = np.random.default_rng(tokens).permutation(pages).astype(np.int32)
    page_ids = jnp.asarray(np.repeat(perm, PAGE))
    slots = jnp.asarray(np.tile(np.arange(PAGE, dtype=np.int32), pages))
    shape = (pages, KV_HEADS, PAGE, HEAD_DIM // CODES_PER_BYTE)
    meta = (pages, KV_HEADS, PAGE, HEAD_DIM // group_size)
    pools = (jnp.zeros(shape, jnp.uint8), jnp.zeros(meta, jnp.float16), jnp.zeros(meta, jnp.float16))
    bytes_moved = rows.size * dtype.itemsize + _int2_bytes(tokens, KV_HEADS, HEAD_DIM, group_size)
    out = {"tokens": tokens, "group_size": group_size, "rows_dtype": rows_dtype, "bytes_moved": bytes_moved}

    kw = dict(group_size=group_size, clip_ratio=CLIP)
    result = {}
    for rotated in (False, True):
        rot = rotation if rotated else None
        got = jax.block_until_ready(ops.write_pages(*pools, rows, page_ids, slots, rotation=rot, **kw))
        tpools = tuple(torch.zeros(tuple(p.shape), dtype=t, device="cuda")
                       for p, t in zip(pools, (torch.uint8, torch.float16, torch.float16)))
        trows = torch.from_dlpack(rows)
        tpage, tslot = torch.from_dlpack(page_ids), torch.from_dlpack(slots)
        trot = torch.from_dlpack(rotation) if rotated else None
        torch_ops.write_pages(*tpools, trows, tpage, tslot, rotation=trot, **kw)
        same = all(np.array_equal(np.asarray(a).view(np.uint8), b.cpu().numpy().view(np.uint8))
                   for a, b in zip(got, tpools))
        entry = {"jax_torch_bit_identical": bool(same)}
        n = 4096  # a subset against the NumPy definition of format v1
        first = [np.asarray(p[page_ids[:n], :, slots[:n]]) for p in got]  # [n, K, ·]
        x = np.asarray(rows[:n].astype(jnp.float32), np.float64)
        if rotated:  # the rotation's float32 rounding is not pinned: count codes off the float64 one
            x = np.einsum("tkd,kde->tke", x, np.asarray(rotation, np.float64))
        want = codec.encode(x.astype(np.float32), group_size=group_size, clip_ratio=CLIP)
        if rotated:
            entry["codes_differing_from_f64_rotation"] = float(np.mean(first[0] != want[0]))
        else:
            entry["shared_math_bit_identical"] = bool(all(
                np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(first, want)))

        def step(i, carry, rows, page_ids, slots, rot):  # arrays as operands (harness.time_jax_loop)
            return ops.write_pages(*carry, rows, page_ids, slots, rotation=rot, **kw)

        entry["pallas"] = harness.time_jax_loop(step, pools, reps=20, operands=(rows, page_ids, slots, rot))
        k = torch_ops._codec_args(HEAD_DIM, group_size, CLIP, "minmax")
        rot_arg = trot if rotated else None
        entry["triton"] = harness.time_torch_graph([lambda: torch.ops.oscar.write_pages(
            *tpools, trows, tpage, tslot, rot_arg, group_size, k, "minmax")])
        for name in ("pallas", "triton"):
            entry[name]["gb_per_s"] = bytes_moved / entry[name]["median_s"] / 1e9
        result["rotated" if rotated else "unrotated"] = entry
        print(f"  write_pages T={tokens} G={group_size} {rows_dtype} rotated={rotated}: "
              f"pallas {entry['pallas']['gb_per_s']:.0f} GB/s, triton {entry['triton']['gb_per_s']:.0f} GB/s, "
              f"identical={same}", flush=True)
        del tpools
    out.update(result)
    gc.collect()
    return out


def demote_case(pages: int, group_size: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    from oscar_jax import ops
    from oscar_torch import ops as torch_ops

    key = jax.random.key(pages)
    bf16 = jax.random.normal(key, (LAYERS, 2 * pages, KV_HEADS, PAGE, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
    src = jnp.asarray(np.random.default_rng(pages).permutation(2 * pages)[:pages].astype(np.int32))
    dst = jnp.arange(pages, dtype=jnp.int32)[::-1]
    shape = (LAYERS, pages, KV_HEADS, PAGE, HEAD_DIM // CODES_PER_BYTE)
    meta = (LAYERS, pages, KV_HEADS, PAGE, HEAD_DIM // group_size)
    pools = (jnp.zeros(shape, jnp.uint8), jnp.zeros(meta, jnp.float16), jnp.zeros(meta, jnp.float16))
    kw = dict(group_size=group_size, clip_ratio=CLIP)
    got = jax.block_until_ready(ops.demote_pages(bf16, *pools, src, dst, **kw))
    tbf16 = torch.from_dlpack(bf16)
    tpools = tuple(torch.zeros(tuple(p.shape), dtype=t, device="cuda")
                   for p, t in zip(pools, (torch.uint8, torch.float16, torch.float16)))
    tsrc, tdst = torch.from_dlpack(src), torch.from_dlpack(dst)
    torch_ops.demote_pages(tbf16, *tpools, tsrc, tdst, **kw)
    same = all(np.array_equal(np.asarray(a).view(np.uint8), b.cpu().numpy().view(np.uint8))
               for a, b in zip(got, tpools))
    tokens = LAYERS * pages * PAGE
    bytes_moved = tokens * KV_HEADS * HEAD_DIM * 2 + _int2_bytes(tokens, KV_HEADS, HEAD_DIM, group_size)
    out = {"pages": pages, "layers": LAYERS, "group_size": group_size, "bytes_moved": bytes_moved,
           "jax_torch_bit_identical": bool(same)}

    def step(i, carry, bf16, src, dst):  # arrays as operands (harness.time_jax_loop)
        return ops.demote_pages(bf16, *carry, src, dst, **kw)

    out["pallas"] = harness.time_jax_loop(step, pools, reps=20, operands=(bf16, src, dst))
    k = torch_ops._codec_args(HEAD_DIM, group_size, CLIP, "minmax")
    out["triton"] = harness.time_torch_graph([lambda: torch.ops.oscar.demote_pages(
        tbf16, *tpools, tsrc, tdst, group_size, k, "minmax")])
    for name in ("pallas", "triton"):
        out[name]["gb_per_s"] = bytes_moved / out[name]["median_s"] / 1e9
    print(f"  demote {pages} pages x {LAYERS} layers G={group_size}: pallas {out['pallas']['gb_per_s']:.0f} GB/s, "
          f"triton {out['triton']['gb_per_s']:.0f} GB/s, identical={same}", flush=True)
    del tpools, tbf16
    gc.collect()
    return out
