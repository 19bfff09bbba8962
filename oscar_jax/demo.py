"""`make demo`: a long real-text prompt decoded through the OSCAR INT2 cache, then through BF16.

The prompt is built from held-out Wikipedia summaries (the evaluation split, never used for
calibration) and is long enough (≥ 1K tokens) that most of the cache is in the INT2 tier. On a
CPU the ops run their native XLA path (oscar_jax/xla; OSCAR_JAX_KERNELS=pallas runs the Pallas
kernels in interpret mode instead, minutes slower).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from calibration.data import wiki_documents
from oscar_jax import generate

PROMPT_TOKENS = (1000, 1024)  # ≥ 1K tokens, in at most two prefill chunks of 512
QUESTION = "\n\nIn one sentence: what is the first topic above about?"


def build_prompt(tokenizer) -> str:
    """Held-out summaries + a question, as a chat turn whose token count lies in PROMPT_TOKENS."""
    lo, hi = PROMPT_TOKENS
    text = ""
    for doc in wiki_documents("evaluation"):
        text += doc + "\n\n"
        if len(tokenizer.encode(text)) >= hi:
            break
    ids = tokenizer.encode(text)
    while True:
        prompt = tokenizer.decode(ids) + QUESTION
        count = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])))
        if count <= hi:
            assert count >= lo, f"demo prompt has {count} tokens"
            return prompt
        ids = ids[: len(ids) - (count - hi)]


def main(argv=None) -> int:
    from oscar_jax.tokenizer import load_tokenizer

    prompt = build_prompt(load_tokenizer("smollm2-135m"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompt.txt"
        path.write_text(prompt, encoding="utf-8")
        for dtype in ("int2", "bf16"):
            print(f"\n===== --kv-cache-dtype {dtype} =====", flush=True)
            rc = generate.main(["--prompt-file", str(path), "--chat", "--kv-cache-dtype", dtype, "--max-new-tokens", "40",
                                *(argv or [])])
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
