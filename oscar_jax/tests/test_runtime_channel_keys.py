"""OscarRuntime with format v2's per-channel key pages (an artifact whose codec says
key_layout "channel"), on the XLA path: prefill writes whole key pages, decode demotes them, and
the logits equal a float reference that quantizes each key page per channel (test_runtime's
TieredReference with its keys grouped by page); the same with the Pallas kernels (interpreted).
Tensor parallelism: test_tensor_parallel.py."""

import dataclasses

import jax
import numpy as np
import pytest

from oscar_jax.tests.test_runtime import CFG, LOGIT_TOL, TieredReference, _run_both
from shared_math.artifact import ModelFingerprint
from shared_math.codec import decode_channels, encode_channels
from shared_math.tests.test_artifact import make_artifact
from shared_math.tiers import tier_split

pytestmark = pytest.mark.kernels("xla")


class ChannelKeysReference(TieredReference):
    """TieredReference whose history keys are quantized a page at a time, each channel over the
    page's tokens (shared_math.codec.encode_channels); values as before."""

    def _page(self, rows, layer):
        """rows [L, K, D] → the page dequantized per channel, [L, K, D]."""
        pages = np.asarray(rows, np.float32).transpose(1, 0, 2)  # [K, L, D]
        encoded = encode_channels(pages, clip_ratio=float(self.k_clip[layer]), levels=self.art.levels)
        return decode_channels(*encoded).transpose(1, 0, 2)

    def attend(self, layer, q, k, v, positions):
        out, _ = super().attend(layer, q, k, v, positions)
        if self.phase == "prefill":  # the chunk's history keys, stored per row above: again per page
            kr = np.einsum("tkd,kde->tke", np.asarray(k, np.float64)[0], self.rot[layer])
            pos = [int(p) for p in np.asarray(positions)[0]]
            split, page = tier_split(self.prompt_length, self.config), self.config.page_size
            for start in range(split.history_start, split.recent_start, page):
                rows = [i for i, p in enumerate(pos) if start <= p < start + page]
                if rows:
                    assert len(rows) == page, "a history page split across chunks"
                    for i, row in zip(rows, self._page(kr[rows], layer)):
                        self.k[layer][pos[i]] = row
        return out, self

    def after_step(self, length):
        before, after = tier_split(length - 1, self.config), tier_split(length, self.config)
        sink, page = self.config.sink, self.config.page_size
        for start in range(sink + before.history_tokens, sink + after.history_tokens, page):
            for layer in range(len(self.layers)):
                keys = self._page(np.stack([self.k[layer][p] for p in range(start, start + page)]), layer)
                for j in range(page):
                    self.k[layer][start + j] = keys[j]
                    self.v[layer][start + j] = self._q(self.v[layer][start + j], layer, "v")


@pytest.fixture(scope="module")
def model():
    from oscar_jax.model import init_params

    params = init_params(CFG, jax.random.PRNGKey(1), std=0.08)
    art = make_artifact(ModelFingerprint(2, 6, 2, 64))
    art = dataclasses.replace(art, codec={**art.codec, "key_layout": "channel", "key_group": 16},
                              k_clip_ratio=np.array([1.0, 0.9], np.float32))  # per-layer clips over a page
    return params, art


def test_prefill_chunks_and_demotions_match_a_per_channel_reference(model):
    """81 prompt tokens in chunks of 32 (history pages written by the prefill), then 20 decode steps
    (a page demoted at 96): logits within test_runtime's tolerance of the per-channel reference, and
    the key pools hold one scale and minimum per channel and page."""
    params, art = model
    prompt = (np.arange(81) * 5 + 2) % CFG.vocab_size
    rt, got, want = _run_both(params, art, prompt, steps=20, prefill_chunk=32, reference=ChannelKeysReference,
                              page_size=16)  # small pages: many demotions (the layout's default page is 64)
    assert rt.config.key_layout == "channel" and rt.config.format_version == 2 and rt.config.page_size == 16
    assert rt.cache.k_scale.shape == rt.cache.k_min.shape == rt.cache.k_codes.shape[:3] + (CFG.head_dim,)
    assert rt.allocator.sequences[0].history_pages
    err = np.abs(got - want).max(axis=-1)
    assert err.max() < LOGIT_TOL, f"max logit error {err.max():.2e} at step {err.argmax()}"
    # the per-token reference (format v1 keys) is measurably elsewhere: the layout is what was read
    _, _, v1 = _run_both(params, dataclasses.replace(art, codec={k: v for k, v in art.codec.items()
                                                                 if k != "key_layout"}),
                         prompt, steps=20, prefill_chunk=32, page_size=16)
    assert np.abs(v1 - want).max() > 10 * err.max()


@pytest.mark.kernels("pallas")
def test_the_pallas_kernels_read_per_channel_key_pages(model):
    """The Pallas attention kernels (interpreted) over the same prompt and steps as the XLA test
    above: the per-channel reference's logits within the same tolerance."""
    params, art = model
    prompt = (np.arange(81) * 5 + 2) % CFG.vocab_size
    rt, got, want = _run_both(params, art, prompt, steps=6, prefill_chunk=32, reference=ChannelKeysReference,
                              page_size=16, interpret=True)
    assert rt.cache.kernels is None and rt.cache.interpret is True and rt.config.key_layout == "channel"
    assert rt.allocator.sequences[0].history_pages
    err = np.abs(got - want).max(axis=-1)
    assert err.max() < LOGIT_TOL, f"max logit error {err.max():.2e} at step {err.argmax()}"
