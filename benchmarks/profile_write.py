"""Where the INT2 write path's time goes on the GPU: block size, warps and the rotation's dot algorithm.

    python3 -m benchmarks.profile_write --out OUT.json

Times the Pallas `write_pages_rows` kernel (65,536 tokens × 8 KV heads × d 128, bf16 rows, the
bench_write case) over a grid of variants, each against the bytes it must move, and checks what
each variant writes against shared_math.encode of the rows rotated in float64:

- `rotation`: none (the encode alone); product (what the kernel ships: for bf16 rows, R split
  into three bf16 parts on the host, three tensor-core products); and, R passed as float32 and
  rotated in the kernel by: ieee (float32 FMAs, the product before v9), tf32x3 (three TF32
  tensor-core products), bf16x3 (R split into three bf16 parts inside every program), tf32 (one
  TF32 product: a lower bound, not accurate enough);
- `block_tokens` (rows per program; the rotation is read once per program) and `num_warps`;
- `order_statistic` of the clip threshold (shared_math.tiling.ORDER_STATISTICS): `auto` is the
  launcher's choice (tagged_max for the unrotated bf16 rows, checked_max for rotated ones).

The float32 variants are swapped in by replacing `kernels.write._rotate` and `_rotation_operand`
while tracing, with JAX's caches cleared for each (an experiment: the product's kernels are
unchanged). NOTES.md quotes the results. The first run (git 4780e57) did not clear the caches,
so its tf32x3 / bf16x3 / tf32 rows are the ieee kernel again (identical times and bytes); its
none / ieee rows by block and warps stand.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from benchmarks import bench_write, harness

ROTATIONS = ("none", "product", "ieee", "tf32x3", "bf16x3", "tf32")
SHIPPED = ("none", "product")  # run the kernel as it ships


def _rotate_variant(name: str):
    import jax.numpy as jnp
    from jax import lax

    def rotate(x, rotation_ref):
        r = rotation_ref[...].astype(jnp.float32)
        if name == "ieee":
            return jnp.dot(x, r, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        if name == "tf32x3":
            return jnp.dot(x, r, precision=lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                           preferred_element_type=jnp.float32)
        if name == "tf32":
            return jnp.dot(x, r, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
        if name == "bf16x3":  # x holds bf16 values exactly; R = hi + mid + lo to ~24 bits
            xb = x.astype(jnp.bfloat16)
            hi = r.astype(jnp.bfloat16)
            rest = r - hi.astype(jnp.float32)
            mid = rest.astype(jnp.bfloat16)
            lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
            acc = jnp.dot(xb, lo, preferred_element_type=jnp.float32)
            acc = acc + jnp.dot(xb, mid, preferred_element_type=jnp.float32)
            return acc + jnp.dot(xb, hi, preferred_element_type=jnp.float32)
        raise ValueError(name)

    return rotate


def _float32_operand(original):
    """_rotation_operand as for float32 rows: R [K, D, D] float32, whatever the rows' dtype."""
    import jax.numpy as jnp

    return lambda rotation, x_dtype: original(rotation, jnp.float32)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--rotations", default=",".join(ROTATIONS))
    parser.add_argument("--block-tokens", default="16,32,64,128")
    parser.add_argument("--num-warps", default="4,8")
    parser.add_argument("--order-statistics", default="auto",
                        help="comma-separated: auto (the launcher's choice) and/or shared_math.tiling.ORDER_STATISTICS")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from oscar_jax.kernels import codec as kcodec
    from oscar_jax.kernels import write as kwrite
    from shared_math import codec
    from shared_math.spec import CODES_PER_BYTE, clip_index as spec_clip_index

    heads, d, page, group = bench_write.KV_HEADS, bench_write.HEAD_DIM, bench_write.PAGE, 128
    clip_index = spec_clip_index(bench_write.CLIP, d)
    key = jax.random.key(args.tokens)
    rows = jax.random.normal(key, (args.tokens, heads, d), jnp.float32).astype(jnp.bfloat16)
    q, _ = jnp.linalg.qr(jax.random.normal(jax.random.fold_in(key, 1), (heads, d, d)))
    rotation = q.astype(jnp.float32)
    pages = args.tokens // page
    page_ids = jnp.asarray(np.repeat(np.random.default_rng(0).permutation(pages).astype(np.int32), page))
    slots = jnp.asarray(np.tile(np.arange(page, dtype=np.int32), pages))
    pools = (jnp.zeros((pages, heads, page, d // CODES_PER_BYTE), jnp.uint8),
             jnp.zeros((pages, heads, page, d // group), jnp.float16),
             jnp.zeros((pages, heads, page, d // group), jnp.float16))
    bytes_moved = rows.size * 2 + bench_write._int2_bytes(args.tokens, heads, d, group)

    n_check = 4096  # rows checked against float64 rotation + shared_math.encode
    x64 = np.asarray(rows[:n_check].astype(jnp.float32), np.float64)
    rotated64 = np.einsum("tkd,kde->tke", x64, np.asarray(rotation, np.float64)).astype(np.float32)
    want = {"rotated": codec.encode(rotated64, group_size=group, clip_ratio=bench_write.CLIP),
            "none": codec.encode(x64.astype(np.float32), group_size=group, clip_ratio=bench_write.CLIP)}
    results = {"environment": harness.environment(), "tokens": args.tokens, "kv_heads": heads, "head_dim": d,
               "group_size": group, "rows_dtype": "bfloat16", "bytes_moved": bytes_moved,
               "copy_bandwidth": harness.copy_bandwidth() if jax.default_backend() == "gpu" else None,
               "variants": []}
    original, original_operand = kwrite._rotate, kwrite._rotation_operand
    for name, block, warps, method in itertools.product(
            args.rotations.split(","), map(int, args.block_tokens.split(",")), map(int, args.num_warps.split(",")),
            args.order_statistics.split(",")):
        shipped = name in SHIPPED
        kwrite._rotate = original if shipped else _rotate_variant(name)
        kwrite._rotation_operand = original_operand if shipped else _float32_operand(original_operand)
        jax.clear_caches()  # the jitted launcher caches its trace by static arguments, not by _rotate
        rot = None if name == "none" else rotation
        method = kcodec.resolve_order_statistic(None if method == "auto" else method, d, clip_index, rows.dtype,
                                                rotated=rot is not None)
        kw = dict(group_size=group, clip_index=clip_index, levels="minmax", block_tokens=block, num_warps=warps,
                  order_statistic=method)
        entry = {"rotation": name, "block_tokens": block, "num_warps": warps, "order_statistic": method}
        try:
            got = jax.block_until_ready(kwrite.write_pages_rows(*pools, rows, page_ids, slots, rot, **kw))
            written = [np.asarray(p[page_ids[:n_check], :, slots[:n_check]]) for p in got]
            ref = want["none" if name == "none" else "rotated"]
            entry["codes_bytes_differing_from_f64_rotation"] = float(np.mean(written[0] != ref[0]))
            entry["scale_differing_from_f64_rotation"] = float(np.mean(written[1].view(np.uint16) != ref[1].view(np.uint16)))

            def step(i, carry, rows, page_ids, slots, rot):
                return kwrite.write_pages_rows(*carry, rows, page_ids, slots, rot, **kw)

            entry["timing"] = harness.time_jax_loop(step, pools, reps=20, operands=(rows, page_ids, slots, rot))
            entry["gb_per_s"] = bytes_moved / entry["timing"]["median_s"] / 1e9
            print(f"{name:8s} block {block:4d} warps {warps} {method:11s}: {entry['timing']['median_s'] * 1e6:8.1f} us "
                  f"{entry['gb_per_s']:7.0f} GB/s, codes differing {entry['codes_bytes_differing_from_f64_rotation']:.2e}",
                  flush=True)
        except Exception as error:  # a variant that does not lower is a result, not a crash
            entry["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            print(f"{name:8s} block {block:4d} warps {warps} {method:11s}: {entry['error']}", flush=True)
        results["variants"].append(entry)
        args.out.write_text(json.dumps(results, indent=1))
    kwrite._rotate, kwrite._rotation_operand = original, original_operand


if __name__ == "__main__":
    main()
