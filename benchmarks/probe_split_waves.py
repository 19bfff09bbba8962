"""Decode attention at split-K lengths around the default: does filling the GPU's waves pay?

The default split (shared_math.tiling.default_pages_per_split, a power of two) gives the 128K
batch-1 INT2 tier 2043 pages / 16 = 128 splits × 8 KV heads = 1024 programs. The Pallas kernel at
2 warps holds 152 registers, so 6 programs fit on an SM: 792 on the H200's 132, and the last 232
programs run as a second, thin wave. Splits of 21 pages (98 splits, 784 programs) would run in one
wave; splits of 8 in 2.6. This times the INT2 kernels of both backends at such splits (each checked
against the reference first, by bench_decode.run_config, with the BF16 baselines of the same run) at
the shapes where the waves differ: 128K b1 and b8, 32K b1, and the e2e benchmark's 100K b1 (1558
pages). Each config is written as it finishes, so a run cut by its time limit keeps what it timed.

    PYTHONPATH=. python3 -m benchmarks.probe_split_waves --out probe_split_waves.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (context, batch): pages per split to time besides the default
SPLITS = {
    (131072, 1): (8, 11, 12, 20, 21, 22, 24, 32),
    (32768, 1): (3, 5, 6, 8),  # 507 pages: 127 splits of 4 (1016 programs) vs 85 of 6 (680)
    (100032, 1): (8, 10, 12, 13, 20, 24),
    (131072, 8): (12, 14, 15, 17, 18, 20, 21),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from benchmarks import bench_decode, harness

    result = {"environment": harness.environment(), "configs": []}
    for (context, batch), splits in SPLITS.items():
        tuning = [dict(pages_per_split=p) for p in splits]
        config = bench_decode.run_config(context, batch, 128, tuning=tuning, triton_tuning=tuning)
        result["configs"].append(config)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
