"""CPU probe of the torch interpreter's rotated float32 write (NOTES v22): time of a write in
16-token blocks vs the interpreted default (one block, rotated in 16-row slices), and how many
float32 products differ between 16-row and whole-block numpy products — why the slices exist.

    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.probe_interpret_write [--tokens 420]
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=420)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from oscar_torch.kernels import write as kwrite
    from shared_math.spec import clip_index

    rng = np.random.default_rng(args.seed)
    rows = torch.from_numpy(rng.standard_normal((args.tokens, args.heads, 64)).astype(np.float32))
    rotation = torch.from_numpy(np.linalg.qr(rng.standard_normal((args.heads, 64, 64)))[0].astype(np.float32))
    common = dict(group_size=32, clip_index=clip_index(0.96, 64), levels="minmax")
    outputs = {}
    for block in (16, None, 16, None):
        t0 = time.perf_counter()
        outputs[block] = kwrite.write_int2_rows(rows, rotation, **common, block_tokens=block)
        print(f"block_tokens={block}: {time.perf_counter() - t0:.2f} s", flush=True)
    same = all(torch.equal(a, b) for a, b in zip(outputs[16], outputs[None]))
    x, r = rows.numpy().transpose(1, 0, 2), rotation.numpy()
    by_16 = np.concatenate([x[:, i : i + 16] @ r for i in range(0, args.tokens, 16)], axis=1)
    print(f"default bytes equal to 16-token blocks: {same}; numpy float32 products differing between "
          f"16-row and whole-block products: {int((by_16 != x @ r).sum())} of {by_16.size}")


if __name__ == "__main__":
    main()
