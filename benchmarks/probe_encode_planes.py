"""The encode by planes against encode_block on the GPU, both backends (NOTES v23).

    python3 -m benchmarks.probe_encode_planes --out OUT.json

Section `codec`: the codec launchers' `encode_rows` (Pallas and Triton) encode 65,536 tokens × 8
KV heads of d 128 (the bench_write shape; N(0, 1) rows, so every block takes encode_planes) as
bfloat16 and float32 rows, at the key and value clip ratios, with `planes` off (encode_block at
its shipped 16 rows a program) and on (16 / 32 / 64 rows), and a last variant where one row in 64
holds a NaN (every block falls back). Section `write`: the write kernels that can take planes —
the unrotated `write_pages_rows` (the values' prefill write) at 16 / 32 / 64 tokens a program and
`demote_pages_rows` (256 pages × 36 layers, bench_write's case) — planes off and on, at the value
clip ratio. Each variant's bytes are checked against shared_math.encode of the same rows before
it is timed; times are medians (Triton: CUDA-graph replays; Pallas codec: each call's device span
in a jax.profiler trace, harness.trace_program_seconds; Pallas writes: harness.time_jax_loop, as
bench_write), against the bytes the kernel must move and the copy bandwidth measured in the same
run. The static prediction (sm_90 SASS of the path a program runs): results/static_encode_planes_v23.txt.

Section `rotated` (NOTES v25): the page write of bf16 rows rotated in the kernel (the keys' prefill
write) with planes off and on, each variant's pools first checked bit for bit against the Pallas
planes-off pools. Section `xla` (NOTES v24): encode_planes compiled by XLA as a jnp function, outside
a kernel, against shared_math row by row.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import numpy as np

from benchmarks import harness
from shared_math.spec import CODES_PER_BYTE, DEFAULT_K_CLIP_RATIO, DEFAULT_V_CLIP_RATIO

KV_HEADS, HEAD_DIM = 8, 128
CLIP_RATIOS = {"key": DEFAULT_K_CLIP_RATIO, "value": DEFAULT_V_CLIP_RATIO}


def variants(block_rows: list[int]) -> list[dict]:
    """planes off at the shipped block, then on at each block size; plus the all-fallback case."""
    from oscar_torch.kernels.codec import DEFAULT_BLOCK_ROWS

    out = [{"planes": False, "block_rows": DEFAULT_BLOCK_ROWS, "rows": "normal"}]
    out += [{"planes": True, "block_rows": b, "rows": "normal"} for b in block_rows]
    out += [{"planes": True, "block_rows": max(block_rows), "rows": "nan_every_64"}]
    return out


def make_rows(tokens: int, kind: str, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((tokens * KV_HEADS, HEAD_DIM)).astype(np.float32)
    if kind == "nan_every_64":
        x[::64, 7] = np.nan  # one row of every block of ≤ 64: each block takes encode_block
    elif kind != "normal":
        raise ValueError(f"rows={kind!r} must be 'normal' or 'nan_every_64'")
    return x


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--block-rows", default="16,32,64")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--backends", default="pallas,triton")
    parser.add_argument("--sections", default="codec,write",
                        help="comma-separated: codec (encode_rows), write, rotated (the rotated bf16 write, "
                             "NOTES v25), xla (encode_planes compiled by XLA outside a kernel)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from shared_math import codec
    from shared_math.spec import clip_index

    results = {"environment": harness.environment(), "tokens": args.tokens, "kv_heads": KV_HEADS,
               "head_dim": HEAD_DIM, "group_size": HEAD_DIM, "copy_bandwidth": harness.copy_bandwidth(),
               "variants": []}
    copy_gb_per_s = results["copy_bandwidth"]["gb_per_s"]
    n_check = 8192  # rows checked against shared_math (the same rows, float32 values)
    codec_variants = itertools.product(
        args.backends.split(","), args.dtypes.split(","), CLIP_RATIOS.items(),
        variants([int(b) for b in args.block_rows.split(",")]))
    for backend, dtype, (tensor, ratio), variant in codec_variants if "codec" in args.sections.split(",") else ():
        rows = make_rows(args.tokens, variant["rows"])
        kw = dict(group_size=HEAD_DIM, clip_index=clip_index(ratio, HEAD_DIM), levels="minmax",
                  block_rows=variant["block_rows"], planes=variant["planes"])
        encode, values = (_pallas if backend == "pallas" else _triton)(rows, dtype, kw)
        entry = dict(variant, backend=backend, dtype=dtype, tensor=tensor, clip_ratio=ratio,
                     bytes_moved=rows.shape[0] * (HEAD_DIM * (2 if dtype == "bfloat16" else 4) + HEAD_DIM // CODES_PER_BYTE + 4))
        want = codec.encode(values[:n_check], group_size=HEAD_DIM, clip_ratio=ratio)
        entry["bytes_equal_shared_math"] = all(
            np.array_equal(g[:n_check].view(np.uint8), w.view(np.uint8)) for g, w in zip(encode(check=True), want))
        name = f"{backend:6s} {dtype:8s} {tensor:5s} planes={variant['planes']!s:5s} rows {variant['block_rows']:3d} " \
               f"{variant['rows']:12s}"
        if entry["bytes_equal_shared_math"]:
            entry["timing"] = encode(check=False)
            entry["gb_per_s"] = entry["bytes_moved"] / entry["timing"]["median_s"] / 1e9
            entry["fraction_of_copy"] = entry["gb_per_s"] / copy_gb_per_s
            print(f"{name}: {entry['timing']['median_s'] * 1e6:7.1f} us {entry['gb_per_s']:6.0f} GB/s "
                  f"({entry['fraction_of_copy']:.1%} of copy)", flush=True)
        else:
            print(f"{name}: BYTES DIFFER from shared_math, not timed", flush=True)
        results["variants"].append(entry)
        args.out.write_text(json.dumps(results, indent=1))
    if "xla" in args.sections.split(","):
        results["xla_jit"] = xla_jit_rows()
        args.out.write_text(json.dumps(results, indent=1))
    if "rotated" in args.sections.split(","):
        results["rotated_write"] = rotated_write_variants(args.tokens, args.backends.split(","), copy_gb_per_s)
        args.out.write_text(json.dumps(results, indent=1))
    if "write" in args.sections.split(","):
        results["write_kernels"] = write_kernel_variants(args.tokens, [int(b) for b in args.block_rows.split(",")],
                                                         args.backends.split(","), copy_gb_per_s)
        args.out.write_text(json.dumps(results, indent=1))


def xla_jit_rows() -> list[dict]:
    """encode_planes as a jnp function compiled by XLA (not in a Pallas kernel): the rows of
    parity_tests.cases.encode_planes_rows it calls exact whose bytes differ from shared_math's, by
    data kind and output (the v24 GPU run: XLA:GPU differs on some rows, the kernels on none)."""
    import jax
    import jax.numpy as jnp

    from oscar_jax.kernels import codec as kcodec
    from parity_tests.cases import DATA, encode_planes_rows
    from shared_math import codec
    from shared_math.spec import clip_index

    kinds = [name for name in sorted(DATA) for _ in range(8)]
    out = []
    for bf16, ratio in itertools.product((True, False), (DEFAULT_K_CLIP_RATIO, DEFAULT_V_CLIP_RATIO, 0.5)):
        x, _ = encode_planes_rows(bf16)
        planes = [jax.lax.bitcast_convert_type(jnp.asarray(p), jnp.int32) for p in np.split(x, CODES_PER_BYTE, axis=1)]
        fn = jax.jit(functools.partial(kcodec.encode_planes, clip_index=clip_index(ratio, HEAD_DIM), rows_bf16=bf16))
        *got, exact = (np.asarray(a) for a in fn(planes))
        want = codec.encode(x, group_size=HEAD_DIM, clip_ratio=ratio)
        differ = {name: [int(r) for r in np.flatnonzero(exact[:, 0] & np.any(
            g.reshape(len(x), -1).view(np.uint8) != w.reshape(len(x), -1).view(np.uint8), axis=1))]
            for name, g, w in zip(("packed", "scale", "minimum"), got, want)}
        rows = sorted(set(sum(differ.values(), [])))
        entry = {"rows_bf16": bf16, "clip_ratio": ratio, "rows_called_exact": int(exact.sum()), "differ": differ,
                 "kinds_of_differing_rows": sorted({kinds[r] if r < len(kinds) else "edge/declined" for r in rows})}
        print(f"xla jit bf16={bf16} c={ratio}: {len(rows)} of {entry['rows_called_exact']} exact rows differ "
              f"{ {k: len(v) for k, v in differ.items()} } kinds {entry['kinds_of_differing_rows']}", flush=True)
        out.append(entry)
    return out


def write_kernel_variants(tokens: int, block_rows: list[int], backends: list[str], copy_gb_per_s: float,
                          demote_pages: int = 256, layers: int | None = None) -> list[dict]:
    """write_pages_rows (unrotated bf16 rows) and demote_pages_rows with planes off / on; each
    variant's pools bit-identical to planes off's (checked against shared_math on a subset)."""
    import jax
    import jax.numpy as jnp

    from benchmarks import bench_write
    from oscar_jax.kernels import write as jax_write
    from shared_math import codec
    from shared_math.spec import clip_index

    page, ratio = bench_write.PAGE, CLIP_RATIOS["value"]
    kw = dict(group_size=HEAD_DIM, clip_index=clip_index(ratio, HEAD_DIM), levels="minmax")
    rows = jnp.asarray(make_rows(tokens, "normal").reshape(tokens, KV_HEADS, HEAD_DIM)).astype(jnp.bfloat16)
    pages = tokens // page
    page_ids = jnp.asarray(np.repeat(np.random.default_rng(1).permutation(pages).astype(np.int32), page))
    slots = jnp.asarray(np.tile(np.arange(page, dtype=np.int32), pages))
    shape, meta = (pages, KV_HEADS, page, HEAD_DIM // CODES_PER_BYTE), (pages, KV_HEADS, page, 1)
    pools = (jnp.zeros(shape, jnp.uint8), jnp.zeros(meta, jnp.float16), jnp.zeros(meta, jnp.float16))
    write_bytes = rows.size * 2 + bench_write._int2_bytes(tokens, KV_HEADS, HEAD_DIM, HEAD_DIM)
    n_check = 4096
    want = codec.encode(np.asarray(rows[:n_check].astype(jnp.float32)), group_size=HEAD_DIM, clip_ratio=ratio)
    out = []
    for backend, planes, block in [(b, False, 16) for b in backends] + [(b, True, r) for b in backends
                                                                        for r in block_rows]:
        entry = {"kernel": "write_pages_rows", "backend": backend, "planes": planes, "block_tokens": block,
                 "dtype": "bfloat16", "clip_ratio": ratio, "bytes_moved": write_bytes}
        if backend == "pallas":
            call = functools.partial(jax_write.write_pages_rows, rotation=None, block_tokens=block, planes=planes, **kw)
            got = [np.asarray(p) for p in call(*pools, rows, page_ids, slots)]

            def step(i, carry, rows, page_ids, slots):
                return call(*carry, rows, page_ids, slots)

            timing = lambda: harness.time_jax_loop(step, pools, reps=20, operands=(rows, page_ids, slots))  # noqa: E731
        else:
            got, timing = _triton_write(rows, page_ids, slots, pools, block, planes, kw)
        written = [g[np.asarray(page_ids[:n_check]), :, np.asarray(slots[:n_check])] for g in got]
        entry["bytes_equal_shared_math"] = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                               for a, b in zip(written, want))
        _time(entry, timing, copy_gb_per_s)
        out.append(entry)
    del pools, rows
    layers = bench_write.LAYERS if layers is None else layers
    demoted = demote_pages
    bf16 = jax.random.normal(jax.random.key(0), (layers, 2 * demoted, KV_HEADS, page, HEAD_DIM)).astype(jnp.bfloat16)
    src = jnp.asarray(np.random.default_rng(2).permutation(2 * demoted)[:demoted].astype(np.int32))
    dst = jnp.arange(demoted, dtype=jnp.int32)[::-1]
    shape, meta = (layers, demoted, KV_HEADS, page, HEAD_DIM // CODES_PER_BYTE), (layers, demoted, KV_HEADS, page, 1)
    pools = (jnp.zeros(shape, jnp.uint8), jnp.zeros(meta, jnp.float16), jnp.zeros(meta, jnp.float16))
    demote_tokens = layers * demoted * page
    demote_bytes = demote_tokens * KV_HEADS * HEAD_DIM * 2 + bench_write._int2_bytes(demote_tokens, KV_HEADS,
                                                                                     HEAD_DIM, HEAD_DIM)
    checked = min(4, demoted)
    want = codec.encode(np.asarray(bf16[0, src[:checked]].astype(jnp.float32)), group_size=HEAD_DIM, clip_ratio=ratio)
    for backend, planes in itertools.product(backends, (False, True)):
        entry = {"kernel": "demote_pages_rows", "backend": backend, "planes": planes, "pages": demoted,
                 "layers": layers, "clip_ratio": ratio, "bytes_moved": demote_bytes}
        if backend == "pallas":
            call = functools.partial(jax_write.demote_pages_rows, planes=planes, **kw)
            got = [np.asarray(p) for p in call(bf16, *pools, src, dst)]

            def step(i, carry, bf16, src, dst):
                return call(bf16, *carry, src, dst)

            timing = lambda: harness.time_jax_loop(step, pools, reps=20, operands=(bf16, src, dst))  # noqa: E731
        else:
            got, timing = _triton_demote(bf16, src, dst, pools, planes, kw)
        written = [g[0, np.asarray(dst[:checked])] for g in got]
        entry["bytes_equal_shared_math"] = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                               for a, b in zip(written, want))
        _time(entry, timing, copy_gb_per_s)
        out.append(entry)
    return out


def rotated_write_variants(tokens: int, backends: list[str], copy_gb_per_s: float) -> list[dict]:
    """write_pages_rows of bfloat16 rows rotated in the kernel (the keys' prefill write, clip 0.96,
    its default 64 tokens a program) with planes off and on (NOTES v25): each variant's pools
    bit-identical to the Pallas planes-off pools before it is timed (the rotation's float32 rounding
    is not pinned to shared_math; the two backends' are one another's, as the bench checks)."""
    import jax
    import jax.numpy as jnp

    from benchmarks import bench_write
    from oscar_jax.kernels import write as jax_write
    from shared_math.spec import clip_index

    page, ratio = bench_write.PAGE, CLIP_RATIOS["key"]
    kw = dict(group_size=HEAD_DIM, clip_index=clip_index(ratio, HEAD_DIM), levels="minmax")
    rows = jnp.asarray(make_rows(tokens, "normal").reshape(tokens, KV_HEADS, HEAD_DIM)).astype(jnp.bfloat16)
    rng = np.random.default_rng(3)
    rotation = jnp.asarray(np.stack([np.linalg.qr(rng.standard_normal((HEAD_DIM, HEAD_DIM)))[0]
                                     for _ in range(KV_HEADS)]).astype(np.float32))
    pages = tokens // page
    page_ids = jnp.asarray(np.repeat(rng.permutation(pages).astype(np.int32), page))
    slots = jnp.asarray(np.tile(np.arange(page, dtype=np.int32), pages))
    shape, meta = (pages, KV_HEADS, page, HEAD_DIM // CODES_PER_BYTE), (pages, KV_HEADS, page, 1)
    pools = (jnp.zeros(shape, jnp.uint8), jnp.zeros(meta, jnp.float16), jnp.zeros(meta, jnp.float16))
    write_bytes = rows.size * 2 + bench_write._int2_bytes(tokens, KV_HEADS, HEAD_DIM, HEAD_DIM)
    reference = None
    out = []
    for backend, planes in itertools.product(backends, (False, True)):
        entry = {"kernel": "write_pages_rows rotated", "backend": backend, "planes": planes, "dtype": "bfloat16",
                 "clip_ratio": ratio, "bytes_moved": write_bytes}
        if backend == "pallas":
            call = functools.partial(jax_write.write_pages_rows, planes=planes, **kw)
            got = [np.asarray(p) for p in call(*pools, rows, page_ids, slots, rotation)]

            def step(i, carry, rows, page_ids, slots, rotation):
                return call(*carry, rows, page_ids, slots, rotation)

            timing = lambda: harness.time_jax_loop(  # noqa: E731
                step, pools, reps=20, operands=(rows, page_ids, slots, rotation))
        else:
            got, timing = _triton_write(rows, page_ids, slots, pools, None, planes, kw, rotation)
        reference = got if reference is None else reference
        entry["bytes_equal_pallas_planes_off"] = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                                     for a, b in zip(got, reference))
        _time(entry, timing, copy_gb_per_s, check="bytes_equal_pallas_planes_off")
        out.append(entry)
    return out


def _time(entry: dict, timing, copy_gb_per_s: float, check: str = "bytes_equal_shared_math") -> None:
    name = " ".join(f"{entry[k]}" for k in ("kernel", "backend", "planes", "block_tokens") if k in entry)
    if not entry[check]:
        print(f"{name}: BYTES DIFFER ({check} is false), not timed", flush=True)
        return
    entry["timing"] = timing()
    entry["gb_per_s"] = entry["bytes_moved"] / entry["timing"]["median_s"] / 1e9
    entry["fraction_of_copy"] = entry["gb_per_s"] / copy_gb_per_s
    print(f"{name}: {entry['timing']['median_s'] * 1e6:8.1f} us {entry['gb_per_s']:6.0f} GB/s "
          f"({entry['fraction_of_copy']:.1%} of copy)", flush=True)


def _torch_pools(pools):
    import torch

    return tuple(torch.zeros(tuple(p.shape), dtype=t, device="cuda")
                 for p, t in zip(pools, (torch.uint8, torch.float16, torch.float16)))


def _triton_write(rows, page_ids, slots, pools, block: int | None, planes: bool, kw: dict, rotation=None):
    import torch

    from oscar_torch.kernels import write as torch_write

    tpools, trows = _torch_pools(pools), torch.from_dlpack(rows)
    tpage, tslot = torch.from_dlpack(page_ids), torch.from_dlpack(slots)
    trotation = None if rotation is None else torch.from_dlpack(rotation)
    call = functools.partial(torch_write.write_pages_rows, *tpools, trows, tpage, tslot, trotation,
                             block_tokens=block, planes=planes, **kw)
    call()
    return [p.cpu().numpy() for p in tpools], lambda: harness.time_torch_graph([call])


def _triton_demote(bf16, src, dst, pools, planes: bool, kw: dict):
    import torch

    from oscar_torch.kernels import write as torch_write

    tpools = _torch_pools(pools)
    call = functools.partial(torch_write.demote_pages_rows, torch.from_dlpack(bf16), *tpools, torch.from_dlpack(src),
                             torch.from_dlpack(dst), planes=planes, **kw)
    call()
    return [p.cpu().numpy() for p in tpools], lambda: harness.time_torch_graph([call])


def _triton(rows: np.ndarray, dtype: str, kw: dict):
    """(encode(check) → outputs as numpy, or the timing; the rows' float32 values) for Triton."""
    import torch

    from oscar_torch.kernels import codec as kcodec

    x = torch.from_numpy(rows).to(getattr(torch, dtype)).cuda()

    def encode(check: bool):
        if check:
            return [t.cpu().numpy() for t in kcodec.encode_rows(x, **kw)]
        return harness.time_torch_graph([lambda: kcodec.encode_rows(x, **kw)])

    return encode, x.float().cpu().numpy()


def _pallas(rows: np.ndarray, dtype: str, kw: dict):
    """As _triton, for the Pallas kernel: each call's device span in a profiler trace."""
    import statistics

    import jax.numpy as jnp

    from oscar_jax.kernels import codec as kcodec

    x = jnp.asarray(rows).astype(getattr(jnp, dtype))

    def encode(check: bool):
        if check:
            return [np.asarray(a) for a in kcodec.encode_rows(x, **kw)]
        spans = [span for span, _ in harness.trace_program_seconds(lambda: kcodec.encode_rows(x, **kw), 10)]
        return {"median_s": statistics.median(spans), "min_s": min(spans), "max_s": max(spans), "calls": len(spans),
                "method": harness.DEVICE_TIMING_METHOD}

    return encode, np.asarray(x.astype(jnp.float32))


if __name__ == "__main__":
    main()
