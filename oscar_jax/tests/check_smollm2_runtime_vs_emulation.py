"""OPEN INVESTIGATION (not collected by pytest: the file name does not start with test_).

SmolLM2 decoding 1K tokens of real text through OscarKVCache, against the decode-faithful tier
emulation of calibration.emulation (serving view: a one-token prompt, then decode steps).
Measured 2026-11-30 on CPU (interpret mode): max |Δlogit| 2.2, median 0.14 — far above rounding
level, already visible in the first positions, before any INT2 page exists. The runtime matches
an independent exact tier reference on a tiny random model to < 2e-3 (test_runtime.py), so the
disagreement is between this emulation and the runtime on the real model; not yet explained.
Run: JAX_PLATFORMS=cpu python -m pytest oscar_jax/tests/check_smollm2_runtime_vs_emulation.py
(~13 min on 2 cores).
"""

import numpy as np
import pytest

pytestmark = pytest.mark.slow

NUM_TOKENS = 1024
LOGIT_TOL = 0.05  # f32 kernels vs f32 emulation; what remains is rounding flips at bf16 / INT2 level boundaries


def test_decoding_1k_tokens_matches_the_tier_emulation():
    import jax.numpy as jnp

    from calibration.data import pack_tokens, wiki_documents
    from calibration.emulation import emulated_logits
    from calibration.methods import parse_method
    from calibration.passkey import ServingTiers
    from oscar_jax.generate import shipped_artifact
    from oscar_jax.loaders import load_model
    from oscar_jax.runtime import OscarRuntime
    from oscar_jax.tokenizer import load_tokenizer
    from shared_math.artifact import read_artifact

    cfg, params = load_model("smollm2-135m")
    tokenizer = load_tokenizer("smollm2-135m")
    art = read_artifact(shipped_artifact("smollm2-135m"))
    tokens = pack_tokens(wiki_documents("evaluation"), tokenizer.encode, tokenizer.eos_id, num_tokens=NUM_TOKENS)
    method = parse_method("oscar", num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          artifact=art)
    # The runtime's view: a one-token prompt (prefilled: it reads itself in float32), then every
    # token enters through a decode step — BF16 on arrival, INT2 when its page demotes.
    view = ServingTiers(method, prompt_length=1, prefill_chunk=512)
    want = np.asarray(emulated_logits(params, cfg, jnp.asarray(tokens)[None], view))[0]

    rt = OscarRuntime(params, cfg, art, max_batch=1, max_seq_len=NUM_TOKENS)
    sid, first, _ = rt.admit(tokens[:1])
    got = [np.asarray(first)]
    for t in range(1, NUM_TOKENS):
        got.append(np.asarray(rt.step([sid], [int(tokens[t])])[0]))
    got = np.array(got)
    assert rt.allocator.sequences[sid].history_pages  # most of the window ended in the INT2 tier
    err = np.abs(got - want).max(axis=-1)
    agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    assert err.max() < LOGIT_TOL, f"max |Δlogit| {err.max():.3g} at position {err.argmax()}; median {np.median(err):.3g}"
    assert agree >= 0.99, f"top-1 agreement {agree:.4f}"
