"""OscarRuntime on a model with sliding-window layers (Gemma 3's shape, tiny and random): the
global layers read the OSCAR tiers, the local layers a BF16 ring per sequence.

The reference routes the same way: the local layers to a dense BF16 cache with the window mask,
the global layers to test_runtime's TieredReference (the tiers emulated exactly, float64)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax.cache_api import DenseKVCache
from oscar_jax.model import decode_step, fold_value_rotation, prefill
from oscar_jax.runtime import OscarRuntime, fingerprint, ring_bytes
from oscar_jax.tests.test_gemma3 import TINY, _random_params
from oscar_jax.tests.test_runtime import LOGIT_TOL, TieredReference
from oscar_jax.window_cache import LayerRoutedKVCache
from shared_math.allocator import PoolExhausted
from shared_math.tests.test_artifact import make_artifact

# MQA, head_dim 64 (the codec's smallest), local and global layers interleaved; a window of 24 is
# shorter than a prefill chunk (32) and than the BF16 recent window (32), so the rings wrap.
CFG = dataclasses.replace(TINY, head_dim=64, num_layers=4, layer_types=("local", "global", "local", "global"),
                          sliding_window=24, max_seq_len=256)
WINDOWS = dict(sink=16, recent=32)
CHUNK = 32


@pytest.fixture(scope="module")
def model():
    params = _random_params(CFG, seed=3)
    art = make_artifact(fingerprint(CFG))
    # Clip ratios that differ per layer: the runtime must hand the global layers theirs.
    art = dataclasses.replace(art, k_clip_ratio=np.array([1.0, 0.9, 1.0, 0.8], np.float32),
                              v_clip_ratio=np.array([1.0, 0.85, 1.0, 0.95], np.float32))
    return params, art


def _runtime(model, **options):
    params, art = model
    return OscarRuntime(params, CFG, art, max_seq_len=256, prefill_chunk=CHUNK, **WINDOWS,
                        **{"max_batch": 1, **options})


class RoutedReference:
    """The model's cache in the reference: dense BF16 local layers, tiered global layers."""

    def __init__(self, art, config):
        self.tiers = TieredReference(art, config, layers=CFG.global_layers)
        local = DenseKVCache.create(num_layers=len(CFG.local_layers), batch=1, num_kv_heads=CFG.num_kv_heads,
                                    max_seq_len=256, head_dim=CFG.head_dim, dtype=jnp.bfloat16)
        self.cache = LayerRoutedKVCache.for_layer_types(CFG.layer_types, local_cache=local, global_cache=self.tiers)

    def greedy(self, folded, prompt, steps):
        """Logits f32 [1 + steps, V]: the prompt's last, then each greedy decode step's."""
        self.tiers.prompt_length = len(prompt)
        for start in range(0, len(prompt), CHUNK):
            chunk = jnp.asarray(prompt[start: start + CHUNK])[None]
            positions = start + jnp.arange(chunk.shape[1])[None]
            logits, self.cache = prefill(folded, CFG, chunk, self.cache, positions=positions)
        out = [np.asarray(logits[0])]
        self.tiers.phase = "decode"
        for position in range(len(prompt), len(prompt) + steps):
            token = jnp.asarray([int(np.argmax(out[-1]))])
            logits, self.cache = decode_step(folded, CFG, token, self.cache, jnp.asarray([position]))
            self.tiers.after_step(position + 1)
            out.append(np.asarray(logits[0]))
        return np.array(out)


def _greedy(rt, seq_id, first_logits, steps):
    out = [np.asarray(first_logits)]
    for _ in range(steps):
        out.append(np.asarray(rt.step([seq_id], [int(np.argmax(out[-1]))])[0]))
    return np.array(out)


def _alone(rt, prompts, steps):
    """Each prompt's greedy logits decoded with nothing else running: one after another on one
    runtime of one ring (finish empties it), so the programs compile once."""
    out = []
    for prompt in prompts:
        sid, logits, _ = rt.admit(prompt)
        out.append(_greedy(rt, sid, logits, steps))
        rt.finish(sid)
    return out


def _prompt(length, seed):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, length).astype(np.int32)


def test_runtime_matches_a_routed_tier_reference_across_ring_wraps_and_demotions(model):
    """81 prompt tokens in chunks of 32 (history written by the prefill), then 18 decode steps
    (a demotion at 96): the global layers only hold OSCAR pages, the local layers' rings wrap."""
    params, art = model
    rt = _runtime(model)
    assert rt.cache.num_layers == 2 and rt.rings.num_rings == 2 and not rt.shares_prefixes
    prompt = _prompt(81, seed=0)
    sid, logits, reused = rt.admit(prompt)
    got = _greedy(rt, sid, logits, steps=18)
    want = RoutedReference(art, rt.config).greedy(fold_value_rotation(params, CFG, art.v_rotation), prompt, 18)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"runtime with local layers vs routed tier reference: {err:.2e}")
    assert reused == 0 and err < LOGIT_TOL
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    rt.allocator.check_invariants()


@pytest.mark.slow  # ~30 programs compiled (batches 1, 2, 4): make test-all
def test_batched_sequences_each_read_their_own_ring(model):
    """Two prompts decoded in one padded batch equal each decoded alone; a sequence started after
    one finishes takes its ring, emptied, and decodes like it did alone. The same prompt twice
    in one namespace shares no page (the rings hold no prefix)."""
    steps, prompts = 12, (_prompt(50, seed=1), _prompt(37, seed=2))
    alone = _alone(_runtime(model), prompts, steps)

    rt = _runtime(model, max_batch=2)
    (a, la, _), (b, lb, _) = rt.admit(prompts[0]), rt.admit(prompts[1])
    got = [[np.asarray(la)], [np.asarray(lb)]]
    for _ in range(steps):
        tokens = [int(np.argmax(g[-1])) for g in got]
        logits = rt.step([b, a], tokens[::-1], batch_size=4)  # rows out of admission order, padded
        got[1].append(np.asarray(logits[0]))
        got[0].append(np.asarray(logits[1]))
    for g, want in zip(got, alone):
        np.testing.assert_allclose(np.array(g), want, rtol=0, atol=1e-4 * np.abs(want).max())

    ring = rt._ring_of[a]
    rt.finish(a)
    c, lc, reused = rt.admit(prompts[0])  # same namespace, same prompt: no page shared
    assert rt._ring_of[c] == ring and reused == 0
    got_c = _greedy(rt, c, lc, steps)
    np.testing.assert_allclose(got_c, alone[0], rtol=0, atol=1e-4 * np.abs(alone[0]).max())
    rt.allocator.check_invariants()


def test_running_out_of_rings_allocates_nothing(model):
    rt = _runtime(model)
    rt.start(_prompt(20, seed=0))
    free = rt.free_pages()
    with pytest.raises(PoolExhausted, match=r"all 1 sliding-window rings \(max_batch\) hold live sequences"):
        rt.start(_prompt(20, seed=1))
    assert rt.free_pages() == free and len(rt.allocator.sequences) == 1


def test_tensor_parallel_refuses_sliding_window_layers(model):
    params, art = model
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="does not cover sliding-window layers yet .this model has 2."):
        OscarRuntime(params, CFG, art, mesh=mesh)


def test_the_rings_cost_what_ring_bytes_says(model):
    rt = _runtime(model, max_batch=3)
    assert rt.rings.nbytes() == ring_bytes(CFG, 3, CHUNK) > 0
    assert ring_bytes(dataclasses.replace(CFG, layer_types=(), sliding_window=None), 3, CHUNK) == 0


@pytest.mark.slow  # the engine's bucketed programs compiled afresh: make test-all
def test_engine_batches_preempts_and_frees_rings(model):
    """The serving engine over such a runtime: six requests through four rings and a BF16 pool
    small enough to preempt; each request's greedy tokens are what it decodes alone, and every
    ring and page comes back. Prefix caching asked for, none happens."""
    from oscar_jax.serving.engine import Engine, EngineConfig
    from oscar_jax.serving.sampling import SamplingParams
    from oscar_jax.tests.test_engine import invariants, run

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [_prompt(n, seed=n) for n in (5, 17, 40, 33, 71, 40)]
    prompts[5] = prompts[2]  # the same prompt again, same tenant
    want = [[int(t) for t in g.argmax(-1)] for g in _alone(_runtime(model), prompts[:5], params.max_tokens - 1)]
    want.append(want[2])
    rt = _runtime(model, max_batch=4, num_bf16_pages=12, num_int2_pages=40)
    engine = Engine(rt, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4, prefill_chunk=CHUNK,
                                           enable_prefix_caching=True))
    for i, p in enumerate(prompts):
        engine.add_request(p.tolist(), params, f"r{i}")
    results = run(engine, invariants)
    for i in range(len(prompts)):
        assert results[f"r{i}"][0] == want[i], f"request {i} ({len(prompts[i])} prompt tokens)"
    assert engine.stats.preemptions >= 1 and engine.stats.prefix_hit_tokens == 0, engine.stats
    assert not rt.allocator.sequences and sorted(rt._free_rings) == [1, 2, 3, 4]
