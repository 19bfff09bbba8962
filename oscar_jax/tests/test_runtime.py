"""OscarRuntime end to end on a tiny random model: prefill + decode across many demotions equals a
float reference that emulates the tiers exactly; batching; prefix sharing; bad input."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from oscar_jax.model import ModelConfig, decode_step, fold_value_rotation, init_params, prefill
from oscar_jax.runtime import OscarRuntime
from shared_math.artifact import ModelFingerprint
from shared_math.codec import decode, encode
from shared_math.tests.test_artifact import make_artifact
from shared_math.tiers import tier_split

# The runtime over the Pallas kernels (interpret mode on CPU); test_xla_ops runs it on the XLA path.
pytestmark = pytest.mark.kernels("pallas")

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=6,
                  num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-5, tie_embeddings=True)
WINDOWS = dict(sink=16, recent=32)  # small windows: many demotions in a short test
LOGIT_TOL = 2e-3  # f32 kernels vs f32 reference; bf16 roundings of K/V are identical on both sides


@pytest.fixture(scope="module")
def model():
    params = init_params(CFG, jax.random.PRNGKey(1), std=0.08)
    art = make_artifact(ModelFingerprint(2, 6, 2, 64))
    return params, art


class TieredReference:
    """Dense float reference of the runtime's semantics (eager, host-side state).

    prefill: the chunk attends to itself in float32; its history positions are stored quantized
    from their float32 rotated rows. decode: the new row is stored in bfloat16; attention reads
    sink/recent rows in bfloat16 and history rows dequantized; a demoted page is quantized from
    its bfloat16 rows.
    """

    def __init__(self, art, config, layers=None):
        """layers: the model layers this cache holds, in the order the model calls them (default
        all of CFG's); the artifact's rotations and clips are those layers'."""
        self.layers = list(range(CFG.num_layers)) if layers is None else list(layers)
        self.rot = np.asarray(art.k_rotation, np.float64)[self.layers]
        self.k_clip = np.asarray(art.k_clip_ratio).reshape(-1)[self.layers]
        self.v_clip = np.asarray(art.v_clip_ratio).reshape(-1)[self.layers]
        self.art, self.config = art, config
        self.k = [dict() for _ in self.layers]  # position → stored rows (K, D) f32
        self.v = [dict() for _ in self.layers]
        self.length = 0
        self.phase = "prefill"

    def _q(self, x, layer, which):
        clip = (self.k_clip if which == "k" else self.v_clip)[layer]
        g = self.art.group_size
        return decode(*encode(x.astype(np.float32), group_size=g, clip_ratio=float(clip), levels=self.art.levels),
                      group_size=g)

    def attend(self, layer, q, k, v, positions):
        q, k, v = (np.asarray(a, np.float64)[0] for a in (q, k, v))  # batch 1
        kr = np.einsum("tkd,kde->tke", k, self.rot[layer])
        kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
        qr = np.einsum("tkgd,kde->tkge", q.reshape(len(q), kv_heads, group, -1), self.rot[layer]).reshape(q.shape)
        pos = np.asarray(positions)[0]
        bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
        if self.phase == "prefill":
            # Every prompt position is stored in its final tier; a chunk reads earlier chunks as
            # stored and itself in full precision.
            split = tier_split(self.prompt_length, self.config)
            start = int(pos[0])
            prefix_k = [self.k[layer][s] for s in range(start)]
            prefix_v = [self.v[layer][s] for s in range(start)]
            keys = np.concatenate([np.array(prefix_k).reshape(start, *kr.shape[1:]), kr])
            vals = np.concatenate([np.array(prefix_v).reshape(start, *v.shape[1:]), v])
            for i, p in enumerate(pos):
                hist = split.history_start <= p < split.recent_start
                self.k[layer][p] = self._q(kr[i], layer, "k") if hist else bf16(kr[i])
                self.v[layer][p] = self._q(v[i], layer, "v") if hist else bf16(v[i])
            key_pos = np.arange(start + len(pos))
            mask = key_pos[None, :] <= pos[:, None]
        else:
            p = int(pos[0])
            self.k[layer][p], self.v[layer][p] = bf16(kr[0]), bf16(v[0])
            keys = np.stack([self.k[layer][s] for s in range(p + 1)])
            vals = np.stack([self.v[layer][s] for s in range(p + 1)])
            mask = np.ones((1, p + 1), bool)
        out = np.zeros_like(qr)
        for h in range(q.shape[1]):
            s = qr[:, h] @ keys[:, h // group].T / np.sqrt(q.shape[-1])
            s = np.where(mask, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (w / w.sum(-1, keepdims=True)) @ vals[:, h // group]
        return jnp.asarray(out[None], jnp.float32), self

    def after_step(self, length):
        """Quantize a page demoted by the step that made the sequence `length` long."""
        before, after = tier_split(length - 1, self.config), tier_split(length, self.config)
        sink = self.config.sink  # history always starts at S0
        for p in range(sink + before.history_tokens, sink + after.history_tokens):
            for layer in range(len(self.layers)):
                self.k[layer][p] = self._q(self.k[layer][p], layer, "k")
                self.v[layer][p] = self._q(self.v[layer][p], layer, "v")


def _run_both(params, art, prompt, steps, windows=WINDOWS, max_seq_len=256, prefill_chunk=512,
              reference=TieredReference, **runtime_options):
    rt = OscarRuntime(params, CFG, art, max_batch=1, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk, **windows,
                      **runtime_options)
    ref = reference(art, rt.config)
    ref.prompt_length = len(prompt)
    folded = fold_value_rotation(params, CFG, art.v_rotation)
    sid, logits, _ = rt.admit(prompt)
    for start in range(0, len(prompt), prefill_chunk):
        chunk = jnp.asarray(prompt[start : start + prefill_chunk])[None]
        positions = start + jnp.arange(chunk.shape[1])[None]
        ref_logits, _ = prefill(folded, CFG, chunk, ref, positions=positions)
    got, want = [np.asarray(logits)], [np.asarray(ref_logits[0])]
    ref.phase = "decode"
    tok = int(np.argmax(want[-1]))
    for _ in range(steps):
        position = rt.length(sid)
        got.append(np.asarray(rt.step([sid], [tok])[0]))
        lg, _ = decode_step(folded, CFG, jnp.asarray([tok]), ref, jnp.asarray([position]))
        ref.after_step(position + 1)
        want.append(np.asarray(lg[0]))
        tok = int(np.argmax(want[-1]))
    rt.allocator.check_invariants()
    return rt, np.array(got), np.array(want)


# 81: history written by the prefill, then by decode demotions; 5: history only from decode
# demotions. The others run in the full suite (each ~20 s of interpreted reference steps), 5
# included: 81's 60 steps demote pages the same way.
@pytest.mark.parametrize("prompt_len", [pytest.param(n, marks=pytest.mark.slow) for n in (5, 16, 47, 64)] + [81])
def test_prefill_and_decode_across_demotions_match_tier_reference(model, prompt_len):
    params, art = model
    prompt = (np.arange(prompt_len) * 7 + 3) % CFG.vocab_size
    rt, got, want = _run_both(params, art, prompt, steps=60)
    assert rt.allocator.sequences[0].history_pages  # the INT2 tier was used
    err = np.abs(got - want).max(axis=-1)
    assert err.max() < LOGIT_TOL, f"max logit error {err.max():.2e} at step {err.argmax()}"


@pytest.mark.parametrize("prompt_len", [47, 100])
def test_chunked_prefill_matches_tier_reference(model, prompt_len):
    """Chunks of 32: later chunks read earlier ones through the tiers (INT2 history included)."""
    params, art = model
    prompt = (np.arange(prompt_len) * 5 + 2) % CFG.vocab_size
    rt, got, want = _run_both(params, art, prompt, steps=8, prefill_chunk=32)
    err = np.abs(got - want).max(axis=-1)
    assert err.max() < LOGIT_TOL, f"max logit error {err.max():.2e} at step {err.argmax()}"


@pytest.mark.slow
@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 319, 320, 321, 336])
def test_default_windows_at_the_tier_edges(model, prompt_len):
    """Sink 64, recent 256: prompts at the tier edges, then decoding across page boundaries
    (and across the first demotion for the prompts within a page of it)."""
    params, art = model
    prompt = (np.arange(prompt_len) * 13 + 1) % CFG.vocab_size
    rt, got, want = _run_both(params, art, prompt, steps=24, windows=dict(sink=64, recent=256), max_seq_len=400)
    err = np.abs(got - want).max(axis=-1)
    assert err.max() < LOGIT_TOL, f"max logit error {err.max():.2e} at step {err.argmax()}"
    split = tier_split(prompt_len + 24, rt.config)
    assert len(rt.allocator.sequences[0].history_pages) == split.history_pages


@pytest.mark.slow
def test_batch_of_different_lengths_equals_each_alone(model):
    params, art = model
    prompts = [np.arange(9) % 50, (np.arange(70) * 5) % 90]
    alone = []
    for p in prompts:
        rt = OscarRuntime(params, CFG, art, max_batch=1, max_seq_len=256, **WINDOWS)
        sid, lg, _ = rt.admit(p)
        toks, outs = [int(np.argmax(lg))], []
        for _ in range(25):
            outs.append(np.asarray(rt.step([sid], [toks[-1]])[0]))
            toks.append(int(np.argmax(outs[-1])))
        alone.append((toks, np.array(outs)))
    rt = OscarRuntime(params, CFG, art, max_batch=2, max_seq_len=256, **WINDOWS)
    sids, toks = [], []
    for p in prompts:
        sid, lg, _ = rt.admit(p)
        sids.append(sid)
        toks.append(int(np.argmax(lg)))
    outs = []
    for _ in range(25):
        lg = np.asarray(rt.step(sids, toks))
        outs.append(lg)
        toks = [int(t) for t in lg.argmax(-1)]
    outs = np.array(outs)
    for i in range(2):
        assert np.abs(outs[:, i] - alone[i][1]).max() < LOGIT_TOL


def _history_page_bytes(rt, sid):
    """The K/V bytes of a sequence's INT2 pages, in position order: [pages][8 arrays]."""
    seq = rt.allocator.sequences[sid]
    return [[np.asarray(getattr(rt.cache, name)[:, p]) for name in ("k_codes", "k_scale", "k_min", "v_codes",
                                                                    "v_scale", "v_min")]
            for p in seq.history_pages]


@pytest.mark.slow
def test_prefix_sharing_reads_pages_identical_to_a_private_prefill(model):
    params, art = model
    first = (np.arange(150) * 3) % 90
    second = np.concatenate([first, [5, 6, 7, 8]])  # same padded bucket (256) as `first`
    shared = OscarRuntime(params, CFG, art, max_batch=3, max_seq_len=256, **WINDOWS)
    shared.admit(first, namespace="a")
    sid, lg_shared, reused = shared.admit(second, namespace="a")
    assert reused == tier_split(len(first), shared.config).recent_start > 0
    private = OscarRuntime(params, CFG, art, max_batch=2, max_seq_len=256, **WINDOWS)
    psid, lg_private, preused = private.admit(second, namespace="a")
    assert preused == 0
    # Every page the second prompt reads through sharing holds exactly the bytes its own full
    # prefill writes (K/V at a position depend only on the tokens before it).
    n = reused // 16 - shared.config.sink // 16
    for a, b in zip(_history_page_bytes(shared, sid)[:n], _history_page_bytes(private, psid)[:n]):
        for x, y in zip(a, b):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    assert np.all(np.isfinite(np.asarray(lg_shared)))
    # Another tenant never hits these pages.
    _, _, other = shared.admit(second, namespace="b")
    assert other == 0
    shared.allocator.check_invariants()


@pytest.mark.slow
def test_multi_turn_conversation_with_sharing_keeps_pages_consistent(model):
    """Each turn re-admits the whole growing conversation (the case that garbles the authors'
    system): every reused page must hold what a private prefill of that prefix would write, and
    pages of finished turns must never be overwritten while cached."""
    params, art = model
    rt = OscarRuntime(params, CFG, art, max_batch=2, max_seq_len=256, extra_pages=8, **WINDOWS)
    history = list((np.arange(40) * 5) % 90)
    snapshots = {}
    for turn in range(4):
        sid, lg, reused = rt.admit(history, namespace="chat")
        if turn:
            assert reused > 0
        for p, arrays in zip(rt.allocator.sequences[sid].history_pages, _history_page_bytes(rt, sid)):
            if p in snapshots:  # a page read again: unchanged since it was first written
                for x, y in zip(arrays, snapshots[p]):
                    assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
            snapshots[p] = arrays
        tok = int(np.argmax(lg))
        reply = []
        for _ in range(12):
            reply.append(tok)
            tok = int(np.argmax(np.asarray(rt.step([sid], [tok])[0])))
        rt.finish(sid)
        rt.allocator.check_invariants()
        history = history + reply + list((np.arange(10) * (turn + 2)) % 90)


def test_bad_input(model):
    params, art = model
    other = make_artifact(ModelFingerprint(3, 6, 2, 64))
    with pytest.raises(ValueError, match="calibrated for"):
        OscarRuntime(params, CFG, other)
    rt = OscarRuntime(params, CFG, art, max_batch=1, max_seq_len=64, **WINDOWS)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        rt.admit(np.zeros(65, np.int32))
    with pytest.raises(ValueError, match="empty prompt"):
        rt.admit([])
    sid, _, _ = rt.admit([1, 2, 3])
    with pytest.raises(ValueError, match="2 tokens for 1 sequences"):
        rt.step([sid], [1, 2])


def test_snapshot_restore_resumes_bit_identically(model, tmp_path):
    from oscar_jax.snapshot import restore_snapshot, save_snapshot

    params, art = model
    prompt = (np.arange(90) * 11) % 90
    rt = OscarRuntime(params, CFG, art, max_batch=1, max_seq_len=256, **WINDOWS)
    sid, lg, _ = rt.admit(prompt)
    save_snapshot(rt, tmp_path / "snap")
    tok, first = int(np.argmax(lg)), []
    for _ in range(20):
        out = np.asarray(rt.step([sid], [tok])[0])
        first.append(out)
        tok = int(np.argmax(out))
    fresh = OscarRuntime(params, CFG, art, max_batch=1, max_seq_len=256, **WINDOWS)
    restore_snapshot(fresh, tmp_path / "snap")
    tok, second = int(np.argmax(lg)), []
    for _ in range(20):
        out = np.asarray(fresh.step([sid], [tok])[0])
        second.append(out)
        tok = int(np.argmax(out))
    assert np.array_equal(np.array(first), np.array(second))  # bit-identical resume
    with pytest.raises(FileExistsError):
        save_snapshot(rt, tmp_path / "snap")
    other = OscarRuntime(params, CFG, art, max_batch=2, max_seq_len=256, **WINDOWS)
    with pytest.raises(ValueError, match="does not match"):
        restore_snapshot(other, tmp_path / "snap")
