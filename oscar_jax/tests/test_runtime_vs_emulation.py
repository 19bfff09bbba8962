"""SmolLM2 and Gemma 3 decoding real text through OscarRuntime against the decode-faithful tier
emulation that calibration.evaluate and calibration.passkey score (QUALITY.md's figures).

NUM_TOKENS of Wikipedia text (evaluation split) enter OscarRuntime (on CPU the ops' native XLA
path, oscar_jax/xla; the figures below were measured with the Pallas kernels in interpret mode, whose
bytes are the same) as a one-token prompt and then one decode step per token; calibration.emulation computes
the logits every step should produce in one teacher-forced pass (calibration.passkey.ServingTiers:
the same one-token prompt, then decode). Twenty pages are demoted to INT2 on the way.

Root cause of the disagreement this file used to record as an open investigation (max |Δlogit|
2.2, median 0.14 over 1024 tokens), two parts:
1. Demotion timing (a real semantic difference, fixed in calibration.methods): the runtime attends
   before it demotes the page an append makes due (shared_math.allocator keeps the pre-demotion
   view; oscar_torch does the same), so query t reads the history of tier_split(t); the emulation
   used tier_split(t + 1) and read that page through INT2 one step early. At the demoting steps
   the median |Δlogit| was 0.30 with the old view and is 0.07 with the fixed one (520 tokens).
2. What remains is not a bug but the rounding noise floor of a bf16 + INT2 cache on a 30-layer
   model: the two paths compute the same float32 quantities in different XLA programs (one token
   vs the whole window), which differ by ~1 ulp; a few such values sit on a bfloat16 rounding
   boundary (layer 0, position 1: one key element; layer 7: one value element, which alone moves
   that layer's attention output by 5e-4 for every later query), later INT2 codes and clip
   thresholds flip the same way, and 30 layers amplify it. Perturbing only the emulation's
   embedding table by one float32 ulp moves the emulation's own logits just as far (520 tokens:
   median 0.034 before the first demotion, 0.089 after, max 0.60), while the float32 forward
   without a cache moves by 1e-4.

Hence the tolerance is measured, not guessed: the test perturbs the emulation by one ulp and
requires the runtime's disagreement to stay within twice that noise floor — median and 99th
percentile of the per-position max |Δlogit|, top-1 disagreement rate (at least 1% allowed), and
the median at the demoting steps alone against the floor's INT2-regime median (the statistic the
timing bug fails; the test checks that the old timing does fail it).

Measured 640 tokens (20 demoted pages), CPU 2 cores, interpret mode: 129 s for the whole test.
Runtime vs emulation: max |Δlogit| 1.24 (position 567), median 0.049, 99th percentile 0.50,
median at the demoting steps 0.092, top-1 agreement 0.9953. One-ulp noise floor: max 1.24, median
0.048, 99th percentile 0.69, INT2-regime median 0.103, top-1 agreement 0.9891. Old timing at the
demoting steps: median 0.31 (limit 0.21). At 1024 tokens (243 s) the runtime passes too (max 1.69,
median 0.118, top-1 0.9932; floor max 1.77, median 0.104), but the floor grows with length and
the old timing's 0.356 is then barely above its limit 0.347, hence NUM_TOKENS = 640.

Gemma 3 270M (BOS + 639 tokens; 3 global layers in the OSCAR tiers, 15 sliding-window layers in
the runtime's BF16 rings; XLA path, 126 s): max 4.32, median 0.080, 99th percentile 1.76, median
at the demoting steps 0.44, top-1 agreement 0.989; one-ulp floor max 4.98, median 0.089, 99th
percentile 2.04, INT2-regime median 0.53, top-1 0.984. Its floor is too high for the old timing
(median 0.75 at the demoting steps) to fall outside twice the floor, so for Gemma the test asks
only that the runtime sits closer to the right timing than to the old one.
"""

import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow

NUM_TOKENS = 640  # 20 demoted pages (sink 64, recent 256, page 16); the noise floor grows with length
NOISE_FACTOR = 2.0  # the runtime may disagree at most twice as much as a one-ulp perturbation does
ULP = 2.0**-23  # relative size of the embedding perturbation that measures the noise floor


def _per_position_err(a, b):
    return np.abs(a - b).max(axis=-1)


class _DemoteBeforeAttending:
    """The emulation's old (wrong) timing: query t ≥ 1 reads the history of tier_split(t + 1)."""

    def __init__(self, view):
        self.view, self.name = view, view.name
        self.k_rotation, self.v_rotation = view.k_rotation, view.v_rotation
        self.quantize_keys, self.quantize_values = view.quantize_keys, view.quantize_values

    def history_intervals(self, length):
        iv = self.view.history_intervals(length)
        windows = self.view.method.windows
        end = iv.k_end.copy()
        for t in range(1, length):
            first, count = windows.history_counts(t + 1)
            end[t] = first + count if count else iv.k_start[t]
        return iv._replace(k_end=end, v_end=end.copy())


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_decoding_matches_the_tier_emulation_within_its_rounding_noise(model):
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
    from shared_math.tiers import demotes_on_append

    t0 = time.time()
    cfg, params = load_model(model)
    tokenizer = load_tokenizer(model)
    art = read_artifact(shipped_artifact(model))
    # A BOS-adding tokenizer (Gemma's): one BOS, then the text, as calibration.evaluate's windows.
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
    text = pack_tokens(wiki_documents("evaluation"), lambda doc: tokenizer.encode(doc, add_bos=False),
                       tokenizer.eos_id, num_tokens=NUM_TOKENS - len(bos))
    tokens = np.concatenate([np.asarray(bos, np.int32), text])
    method = parse_method("oscar", num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          artifact=art)
    # The runtime's view: a one-token prompt (prefilled: it reads itself in float32), then every
    # token enters through a decode step — BF16 on arrival, INT2 after its page demotes.
    view = ServingTiers(method, prompt_length=1, prefill_chunk=512)
    window = jnp.asarray(tokens)[None]
    want = np.asarray(emulated_logits(params, cfg, window, view))[0]
    # The noise floor: the same emulation with its embedding table moved by about one ulp.
    embed = np.asarray(params["embed"], np.float32)
    noise = np.random.default_rng(0).standard_normal(embed.shape).astype(np.float32)
    nudged = dict(params, embed=jnp.asarray(embed * (np.float32(1) + np.float32(ULP) * noise)))
    floor_logits = np.asarray(emulated_logits(nudged, cfg, window, view))[0]
    floor = _per_position_err(want, floor_logits)
    floor_agree = float(np.mean(floor_logits.argmax(-1) == want.argmax(-1)))
    del floor_logits

    demoting = np.array([t for t in range(1, NUM_TOKENS) if demotes_on_append(t, method.windows.config())])
    int2 = np.arange(demoting[0], NUM_TOKENS)  # positions that read an INT2 tier
    old_timing = np.asarray(emulated_logits(params, cfg, window, _DemoteBeforeAttending(view), rows=demoting))[0]

    rt = OscarRuntime(params, cfg, art, max_batch=1, max_seq_len=NUM_TOKENS)
    sid, first, _ = rt.admit(tokens[:1])
    got = [np.asarray(first)]
    for t in range(1, NUM_TOKENS):
        got.append(np.asarray(rt.step([sid], [int(tokens[t])])[0]))
    got = np.array(got)
    seconds = time.time() - t0

    assert len(demoting) == len(rt.allocator.sequences[sid].history_pages) >= 20
    err = _per_position_err(got, want)
    early = _per_position_err(got[demoting], old_timing)
    agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    stats = {
        "seconds": round(seconds), "max": err.max(), "argmax": int(err.argmax()), "median": np.median(err),
        "q99": np.quantile(err, 0.99), "median_at_demotions": np.median(err[demoting]), "top1": agree,
        "floor_top1": floor_agree, "floor_max": floor.max(), "floor_median": np.median(floor),
        "floor_q99": np.quantile(floor, 0.99),
        "floor_median_int2": np.median(floor[int2]), "old_timing_median_at_demotions": np.median(early),
    }
    print({k: round(float(v), 4) for k, v in stats.items()})
    assert 1 - agree <= max(NOISE_FACTOR * (1 - floor_agree), 0.01), stats
    assert np.median(err) <= NOISE_FACTOR * np.median(floor), stats
    assert np.quantile(err, 0.99) <= NOISE_FACTOR * np.quantile(floor, 0.99), stats
    # The demoting steps: with the right timing they are as noisy as any INT2-regime step; the
    # emulation with the old timing (demote before attending) is far outside (the tolerance sees it).
    limit = NOISE_FACTOR * np.median(floor[int2])
    assert np.median(err[demoting]) <= limit, stats
    assert np.median(err[demoting]) < np.median(early), stats
    if model == "smollm2-135m":  # Gemma's floor hides the old timing (module docstring)
        assert np.median(early) > limit, stats
