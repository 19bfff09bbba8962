"""Host cost of re-keying a prompt's pages for prefix sharing (benchmarks/DECISIONS.md S1).

    python -m benchmarks.bench_prefix_keys --out benchmarks/results/cpu/prefix_keys.json

After every prefill chunk the runtime re-keys every sink and history page of the sequence
(`OscarRuntime._publish` → `PageAllocator._page_end_key`). For prompts of `--lengths` tokens
(Qwen3-8B serving windows: sink 64, recent 256, pages of 64) it times, on whatever CPU runs it,
one such pass over all history pages:
  * `per_prefix`: each page's key hashing every token before it (what `_page_end_key` did before
    the chain: sha256 of the namespace and tokens[:end], the tokens converted from the sequence's
    Python list each time);
  * `chained`: the allocator's keys — the first pass computes each page's link from its own
    tokens, later passes read the cached chain (what every chunk after the first costs).
Host-side code only: no device, no model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np


def per_prefix_key(namespace, tokens: list[int], end: int) -> bytes:
    """A page's key as it was before the chain: every token up to its end, hashed again."""
    h = hashlib.sha256(repr(namespace).encode())
    h.update(np.asarray(np.asarray(tokens[:end]), np.int64).tobytes())
    return h.digest()


def measure(length: int, repeats: int = 3, seed: int = 0) -> dict:
    from shared_math.allocator import PageAllocator
    from shared_math.spec import OscarConfig
    from shared_math.tiers import tier_split

    config = OscarConfig(head_dim=128, sink=64, recent=256, page_size=64)
    split = tier_split(length, config)
    alloc = PageAllocator(config, num_bf16_pages=2 + split.sink_pages + split.recent_pages,
                          num_int2_pages=2 + split.history_pages)
    tokens = np.random.default_rng(seed).integers(0, 150_000, length).tolist()
    seq = alloc.sequences[alloc.admit(tokens, share_prefix=False).seq_id]
    ends = [split.history_start + (j + 1) * config.page_size for j in range(split.history_pages)]

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    seq.page_keys.clear()
    first = best(lambda: (seq.page_keys.clear(), [alloc._page_end_key(seq, e) for e in ends]))
    cached = best(lambda: [alloc._page_end_key(seq, e) for e in ends])
    old = best(lambda: [per_prefix_key(seq.namespace, seq.tokens, e) for e in ends])
    return {"tokens": length, "history_pages": len(ends), "per_prefix_s": old, "chained_first_pass_s": first,
            "chained_cached_s": cached}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefix_keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="32768,102400", help="prompt lengths in tokens (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="JSON result file (default: print only)")
    args = p.parse_args(argv)
    from benchmarks.harness import environment

    runs = [measure(int(n)) for n in args.lengths.split(",")]
    for r in runs:
        print(f"{r['tokens']} tokens, {r['history_pages']} history pages: per prefix {r['per_prefix_s'] * 1e3:.1f} ms, "
              f"chained {r['chained_first_pass_s'] * 1e3:.2f} ms (first pass) / {r['chained_cached_s'] * 1e3:.3f} ms "
              "(cached)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": environment(), "runs": runs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
