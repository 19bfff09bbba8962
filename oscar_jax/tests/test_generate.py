"""`python -m oscar_jax.generate`: the KV bytes it reports, and (slow) Gemma 3 270M through the
OSCAR cache end to end."""

import re

import numpy as np
import pytest

from oscar_jax import generate
from oscar_jax.model import MODEL_CONFIGS
from shared_math.spec import OscarConfig


def test_kv_bytes_counts_sliding_window_layers_as_bf16_windows_in_both_caches():
    """Gemma 3 270M at 131,072 tokens, by hand: 15 local layers × 512 tokens × K and V × 256 × 2
    bytes in both; 3 global layers × 131,072 tokens in BF16, or 64 + 256 BF16 tokens and the
    rest INT2 rows of 64 code bytes + 2 groups × (scale, min) × 2 bytes = 72 bytes."""
    cfg = MODEL_CONFIGS["gemma3-270m"]
    config = OscarConfig(head_dim=256, group_size=128)
    n = 131072
    windows = 15 * 512 * 2 * 256 * 2
    bf16, ours = generate.kv_bytes(cfg, config, n)
    assert bf16 == windows + 3 * n * 2 * 256 * 2
    assert ours == windows + 3 * 2 * ((64 + 256) * 256 * 2 + (n - 64 - 256) * 72)
    short_bf16, short_ours = generate.kv_bytes(cfg, config, 100)  # shorter than the window, all BF16
    assert short_bf16 == short_ours == 18 * 100 * 2 * 256 * 2
    llama = MODEL_CONFIGS["smollm2-135m"]  # no local layers: every layer in the OSCAR tiers
    assert generate.kv_bytes(llama, OscarConfig(head_dim=64), 4096)[0] == 30 * 3 * 4096 * 2 * 64 * 2


@pytest.mark.slow
def test_gemma3_generates_through_the_oscar_cache(tmp_path, capsys):
    """A 1,100-token prompt (history in INT2 in the 3 global layers), greedy: text comes out and
    the report names the tiers and the windows."""
    from calibration.data import wiki_documents

    prompt = tmp_path / "doc.txt"
    prompt.write_text(" ".join(wiki_documents("evaluation"))[:5000], encoding="utf-8")
    assert generate.main(["--model", "gemma3-270m", "--prompt-file", str(prompt), "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    text, report = out.split("\n\n[oscar] tokens:")
    assert text.strip(), out
    tokens = re.search(r"^ (\d+) prompt \+ (\d+) generated = \d+ \(sink 64, INT2 history (\d+), BF16 recent (\d+)\)",
                       report)
    prompt_len, generated, history, recent = map(int, tokens.groups())
    assert prompt_len > 1000 and generated == 6 and history > 0 and history % 16 == 0 and 256 <= recent < 272
    assert "the 15 sliding-window layers keep 512 BF16 tokens each in both" in report
    bf16, ours = map(float, re.search(r"BF16 ([\d.]+) MiB, OSCAR ([\d.]+) MiB", report).groups())
    assert 1 < bf16 / ours < 7, report
    assert np.isfinite(float(re.search(r"decode ([\d.]+) tok/s", report).group(1)))
