"""`make demo`: a long real-text prompt decoded through the OSCAR INT2 cache, then through BF16.

The prompt is built from held-out Wikipedia summaries (the evaluation split, never used for
calibration) and is long enough (≥ 1K tokens) that most of the cache is in the INT2 tier.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from calibration.data import wiki_documents
from oscar_jax import generate

MIN_PROMPT_TOKENS = 1100


def build_prompt(tokenizer) -> str:
    docs, text = wiki_documents("evaluation"), ""
    for doc in docs:
        text += doc + "\n\n"
        if len(tokenizer.encode(text)) >= MIN_PROMPT_TOKENS:
            break
    return text + "Question: which of the topics above is the oldest? Answer:"


def main(argv=None) -> int:
    from oscar_jax.tokenizer import load_tokenizer

    prompt = build_prompt(load_tokenizer("smollm2-135m"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompt.txt"
        path.write_text(prompt, encoding="utf-8")
        for dtype in ("int2", "bf16"):
            print(f"\n===== --kv-cache-dtype {dtype} =====", flush=True)
            rc = generate.main(["--prompt-file", str(path), "--kv-cache-dtype", dtype, "--max-new-tokens", "32",
                                *(argv or [])])
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
