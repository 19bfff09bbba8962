"""What bounds the rotated prefill write (the write path's worst case, benchmarks/NOTES.md v24):
the rotation's product alone, timed apart from the encode, at each precision Triton offers.

    python3 -m benchmarks.probe_rotated_write --out OUT.json

A Triton kernel of the write's shape (65,536 tokens x 8 KV heads x d 128, a [D, D] rotation per
head, `--block-tokens` tokens a program) computes the rotated rows x·R_K and stores only each row's
largest value (so the product cannot be elided and ~no bytes are written): float32 rows by
`input_precision` "ieee" (the shipped write's: IEEE float32 on the CUDA cores), "tf32x3" (three
TF32 tensor-core products, ~float32 accuracy) and "tf32"; bfloat16 rows by the shipped split rotation
(three exact-product bf16 dots). Before timing, each mode's full rotated rows (a second launch that
stores them) are compared with the float64 rotation: the largest error relative to the row's
largest |value|, and the fraction of INT2 codes (shared_math.codec.encode, keys' clip 0.96) that
differ from those of the float64 rotation — the measure the write bench reports. The shipped write
(oscar_torch, defaults) is timed in the same run for the split: write - product = the encode and
the stores.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.bench_write import PAGE
from shared_math.spec import CODES_PER_BYTE, DEFAULT_K_CLIP_RATIO

KV_HEADS, HEAD_DIM, CLIP = 8, 128, DEFAULT_K_CLIP_RATIO
F32_MODES = ("ieee", "tf32x3", "tf32")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from oscar_torch.kernels.write import BF16_SPLIT_PARTS_C as SPLIT_PARTS
    from oscar_torch.kernels.write import split_product

    @triton.jit
    def rotate_rows_kernel(x_ptr, rotation_ptr, out_ptr, num_tokens, NUM_HEADS: tl.constexpr, D: tl.constexpr,
                           BLOCK_TOKENS: tl.constexpr, MODE: tl.constexpr, STORE_ALL: tl.constexpr):
        head = tl.program_id(0)
        token = (tl.program_id(1) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS))[:, None]
        ok = token < num_tokens
        column = tl.arange(0, D)[None, :]
        row = tl.arange(0, D)[:, None]
        x_ptrs = x_ptr + (token * NUM_HEADS + head) * D + column
        if MODE == "bf16x3":  # the shipped split rotation: parts [K, 3, D, D] as int16 bits
            xb = tl.load(x_ptrs, mask=ok, other=0).to(tl.bfloat16, bitcast=True)
            acc = split_product(xb, rotation_ptr + head * SPLIT_PARTS * D * D + row * D + column, D, True)
        else:
            x = tl.load(x_ptrs, mask=ok, other=0)
            rotation = tl.load(rotation_ptr + head * D * D + row * D + column)
            acc = tl.dot(x, rotation, input_precision=MODE, out_dtype=tl.float32)
        if STORE_ALL:
            tl.store(out_ptr + (token * NUM_HEADS + head) * D + column, acc, mask=ok)
        else:
            tl.store(out_ptr + token * NUM_HEADS + head, tl.max(acc, axis=1)[:, None], mask=ok)

    return rotate_rows_kernel


def rotate_rows(x, operand, mode: str, block_tokens: int, store_all: bool):
    """Launch the probe kernel over rows x [T, K, D] (float32, or bfloat16 for "bf16x3") with the
    write's rotation operand (oscar_torch.kernels.write._rotation_operand): the rotated rows
    float32 [T, K, D] (store_all) or each row's largest rotated value [T, K]."""
    import torch
    import triton

    tokens, heads, d = x.shape
    out = torch.empty((tokens, heads, d) if store_all else (tokens, heads), dtype=torch.float32, device=x.device)
    x_arg = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    _kernel()[(heads, triton.cdiv(tokens, block_tokens))](
        x_arg, operand, out, tokens, NUM_HEADS=heads, D=d, BLOCK_TOKENS=block_tokens, MODE=mode,
        STORE_ALL=store_all, num_warps=4)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--block-tokens", default="16,32,64")
    parser.add_argument("--check-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    from oscar_torch import ops as torch_ops
    from oscar_torch.kernels.write import _rotation_operand
    from shared_math import codec

    tokens, n = args.tokens, args.check_tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows32 = torch.randn((tokens, KV_HEADS, HEAD_DIM), device="cuda", generator=gen)
    rotation = torch.linalg.qr(torch.randn((KV_HEADS, HEAD_DIM, HEAD_DIM), device="cuda", generator=gen))[0]
    rotation = rotation.contiguous()
    results = {"environment": harness.environment(), "tokens": tokens, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
               "clip_ratio": CLIP, "copy_bandwidth": harness.copy_bandwidth(), "products": [], "writes": []}
    rot64 = rotation.double().cpu().numpy()

    def check(out: torch.Tensor, x64: np.ndarray) -> dict:
        want = np.einsum("tkd,kde->tke", x64, rot64)
        got = out[:n].double().cpu().numpy()
        rel = np.abs(got - want).max(-1) / np.abs(want).max(-1)
        codes = codec.encode(got.astype(np.float32), group_size=HEAD_DIM, clip_ratio=CLIP)[0]
        codes64 = codec.encode(want.astype(np.float32), group_size=HEAD_DIM, clip_ratio=CLIP)[0]
        return {"max_relative_error": float(rel.max()), "codes_differing_from_f64_rotation":
                float(np.mean(np.unpackbits(codes ^ codes64).reshape(-1, 2).any(-1)))}

    for dtype in ("float32", "bfloat16"):
        x = rows32 if dtype == "float32" else rows32.to(torch.bfloat16)
        x64 = x[:n].double().cpu().numpy()
        operand = _rotation_operand(rotation, x)
        for mode in (F32_MODES if dtype == "float32" else ("bf16x3",)):
            for block in [int(b) for b in args.block_tokens.split(",")]:
                entry = {"rows_dtype": dtype, "mode": mode, "block_tokens": block}
                try:
                    entry.update(check(rotate_rows(x, operand, mode, block, store_all=True), x64))
                    entry["timing"] = harness.time_torch_graph(
                        [lambda: rotate_rows(x, operand, mode, block, store_all=False)])
                    print(f"product {dtype:8s} {mode:7s} block {block:3d}: {entry['timing']['median_s'] * 1e6:7.1f} us"
                          f"  max rel err {entry['max_relative_error']:.2e}  codes off f64 "
                          f"{entry['codes_differing_from_f64_rotation']:.2e}", flush=True)
                except Exception as err:  # noqa: BLE001 - a mode this Triton cannot compile is recorded
                    entry["error"] = f"{type(err).__name__}: {err}"[:500]
                    print(f"product {dtype:8s} {mode:7s} block {block:3d}: {entry['error'][:120]}", flush=True)
                results["products"].append(entry)
                args.out.write_text(json.dumps(results, indent=1))
        # The shipped rotated write at its defaults, same rows: write - product = encode + stores.
        pages = tokens // PAGE
        page_ids = torch.arange(pages, device="cuda", dtype=torch.int32).repeat_interleave(PAGE)
        slots = torch.arange(PAGE, device="cuda", dtype=torch.int32).repeat(pages)
        pools = tuple(torch.zeros((pages, KV_HEADS, PAGE, width), dtype=pool_dtype, device="cuda")
                      for width, pool_dtype in ((HEAD_DIM // CODES_PER_BYTE, torch.uint8), (1, torch.float16),
                                                (1, torch.float16)))
        k = torch_ops._codec_args(HEAD_DIM, HEAD_DIM, CLIP, "minmax")
        timing = harness.time_torch_graph([lambda: torch.ops.oscar.write_pages(
            *pools, x, page_ids, slots, rotation, HEAD_DIM, k, "minmax")])
        results["writes"].append({"rows_dtype": dtype, "timing": timing})
        print(f"write    {dtype:8s} shipped: {timing['median_s'] * 1e6:7.1f} us", flush=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
