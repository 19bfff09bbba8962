"""The codec's encode by planes against encode_block on the GPU, both backends (NOTES v23).

    python3 -m benchmarks.probe_encode_planes --out OUT.json

The codec launchers' `encode_rows` (Pallas and Triton) encode 65,536 tokens × 8 KV heads of d 128 (the bench_write shape; N(0, 1) rows, so every block
takes encode_planes) as bfloat16 and float32 rows, at the key and value clip ratios, with
`planes` off (encode_block at its shipped 16 rows a program) and on (16 / 32 / 64 rows), and a
last variant where one row in 64 holds a NaN (every block falls back). Each variant's bytes are
checked against shared_math.encode of the same rows before it is timed; times are medians (Triton:
CUDA-graph replays; Pallas: each call's device span in a jax.profiler trace, harness.
trace_program_seconds), against the bytes the kernel must move and the copy bandwidth measured in
the same run.
The static prediction (sm_90 SASS of the path a program runs): results/static_encode_planes_v23.txt.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from benchmarks import harness

KV_HEADS, HEAD_DIM = 8, 128
CLIP_RATIOS = {"key": 0.96, "value": 0.92}


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
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from shared_math import codec
    from shared_math.spec import clip_index

    results = {"environment": harness.environment(), "tokens": args.tokens, "kv_heads": KV_HEADS,
               "head_dim": HEAD_DIM, "group_size": HEAD_DIM, "copy_bandwidth": harness.copy_bandwidth(),
               "variants": []}
    copy_gb_per_s = results["copy_bandwidth"]["gb_per_s"]
    n_check = 8192  # rows checked against shared_math (the same rows, float32 values)
    for backend, dtype, (tensor, ratio), variant in itertools.product(
            args.backends.split(","), args.dtypes.split(","), CLIP_RATIOS.items(),
            variants([int(b) for b in args.block_rows.split(",")])):
        rows = make_rows(args.tokens, variant["rows"])
        kw = dict(group_size=HEAD_DIM, clip_index=clip_index(ratio, HEAD_DIM), levels="minmax",
                  block_rows=variant["block_rows"], planes=variant["planes"])
        encode, values = (_pallas if backend == "pallas" else _triton)(rows, dtype, kw)
        entry = dict(variant, backend=backend, dtype=dtype, tensor=tensor, clip_ratio=ratio,
                     bytes_moved=rows.shape[0] * (HEAD_DIM * (2 if dtype == "bfloat16" else 4) + HEAD_DIM // 4 + 4))
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
