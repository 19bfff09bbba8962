"""The serving engine on a tiny random model (the CPU XLA path): continuous batching and chunked
prefill give what each request gives alone through OscarRuntime; preemption; tenants and prefix
sharing; aborts; compiled shapes; sampling and stop conditions; the runtime's input checks."""

import jax
import numpy as np
import pytest

from oscar_jax.model import ModelConfig, init_params
from oscar_jax.runtime import OscarRuntime
from oscar_jax.serving.engine import Engine, EngineConfig
from oscar_jax.serving.sampling import SamplingParams, sample_batch
from shared_math.allocator import PoolExhausted
from shared_math.artifact import ModelFingerprint
from shared_math.tests.test_artifact import make_artifact

pytestmark = pytest.mark.kernels("xla")

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=6,
                  num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-5, tie_embeddings=False)
WINDOWS = dict(sink=16, recent=32)  # small windows: prompts and outputs cross every tier
CHUNK = 32
MAX_LEN = 192
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Mixed lengths: one token, under a page, a page + 1, several chunks, with and without history.
PROMPT_LENGTHS = (1, 5, 17, 40, 71, 100, 33, 129)


@pytest.fixture(scope="module")
def model():
    params = init_params(CFG, jax.random.PRNGKey(3), std=0.3)
    # logits ×10: greedy choices sit far from ties that batching could flip
    params["lm_head"] = params["lm_head"] * 10
    return params, make_artifact(ModelFingerprint(2, 6, 2, 64))


def runtime(model, **kw):
    params, art = model
    kw = dict(dict(max_batch=8, max_seq_len=MAX_LEN, prefill_chunk=CHUNK, **WINDOWS), **kw)
    return OscarRuntime(params, CFG, art, **kw)


def prompt(n, salt=0):
    return [int(t) for t in (np.arange(n) * 7 + 3 * n + salt) % CFG.vocab_size]


def alone(model, tokens, max_tokens):
    """Greedy tokens of one prompt through OscarRuntime.admit / step, nothing else running."""
    rt = runtime(model, max_batch=1)
    sid, logits, _ = rt.admit(tokens)
    out = [int(np.argmax(logits))]
    while len(out) < max_tokens:
        out.append(int(np.argmax(rt.step([sid], [out[-1]])[0])))
    return out


@pytest.fixture(scope="module")
def references(model):
    return {n: alone(model, prompt(n), GREEDY.max_tokens) for n in PROMPT_LENGTHS}


def run(engine, check=None):
    """Step until idle: {request_id: (token ids, final output)}."""
    got, final = {}, {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                final[out.request_id] = out
        if check is not None:
            check(engine)
    return {r: (got.get(r, []), final[r]) for r in final}


def invariants(engine):
    engine.runtime.allocator.check_invariants()


def test_continuous_batching_matches_each_request_alone(model, references):
    engine = Engine(runtime(model), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4,
                                                       prefill_chunk=CHUNK))
    for i, n in enumerate(PROMPT_LENGTHS):
        engine.add_request(prompt(n), GREEDY, f"r{i}")
    results = run(engine, invariants)
    for i, n in enumerate(PROMPT_LENGTHS):
        tokens, final = results[f"r{i}"]
        assert tokens == references[n], f"prompt of {n} tokens"
        assert final.finish_reason == "length" and final.completion_tokens == GREEDY.max_tokens
    assert not engine.runtime.allocator.sequences  # every page released
    assert engine.stats.preemptions == 0


def tokens_known(engine):
    """After every step each live sequence holds its prompt and outputs, every value known."""
    sequences = engine.runtime.allocator.sequences
    for r in engine.running:
        tokens = sequences[r.seq_id].tokens
        assert tokens == (r.prompt_ids + r.output_ids)[: len(tokens)], r.request_id


@pytest.mark.parametrize("overlap", [False, True])
def test_decodes_crossing_demotions_match_each_request_alone(model, overlap):
    # Outputs of 70 tokens cross the recent window's demotions; prompts join while others decode,
    # so launches mix rows fed from the device with rows fed from the host.
    engine = Engine(runtime(model), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4,
                                                       prefill_chunk=CHUNK, overlap=overlap))
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    lengths = (64, 3, 40, 17)
    for i, n in enumerate(lengths):
        engine.add_request(prompt(n, i), params, f"r{i}")
    results = run(engine, tokens_known)
    for i, n in enumerate(lengths):
        assert results[f"r{i}"][0] == alone(model, prompt(n, i), params.max_tokens), f"prompt of {n} tokens"
    assert not engine.runtime.allocator.sequences


@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_prompt_never_stalls_running_decodes(model, overlap):
    engine = Engine(runtime(model), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4,
                                                       prefill_chunk=CHUNK, overlap=overlap))
    engine.add_request(prompt(3), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), "short")
    engine.step()  # the short prompt is written and decoding
    engine.add_request(prompt(150), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "long")
    steps_with_short = 0
    while engine.requests.get("long") is not None and engine.requests["long"].output_ids == []:
        outputs = {o.request_id: o for o in engine.step()}
        assert engine.last_step.decode_rows == 1 and engine.last_step.prefill_tokens > 0
        # with overlap a decode's token is read back one step later: none in the first step
        if not (overlap and steps_with_short == 0):
            assert "short" in outputs, "a prefill step left the running decode out"
        steps_with_short += 1
    assert steps_with_short >= 150 // CHUNK  # the prompt took several chunks, one per step


def test_only_a_prompts_last_chunk_is_waited_on(model, references, monkeypatch):
    """A chunk before the prompt's last has no token to sample: its step does not block on it (the
    device keeps the launch queued); the outputs are unchanged."""
    engine = Engine(runtime(model), None, EngineConfig(max_num_seqs=2, max_num_batched_tokens=CHUNK + 2,
                                                       prefill_chunk=CHUNK))
    launched, waited = [], []
    prefill, wait = engine.runtime.prefill, engine._wait
    monkeypatch.setattr(engine.runtime, "prefill",
                        lambda seq_id, start, stop: launched.append((start, stop)) or prefill(seq_id, start, stop))
    monkeypatch.setattr(engine, "_wait", lambda array: waited.append(array.shape) or wait(array))
    n = 100  # chunks [0, 32) [32, 64) [64, 96) [96, 100)
    engine.add_request(prompt(n), GREEDY, "a")
    assert run(engine)["a"][0] == references[n]
    assert launched == [(0, 32), (32, 64), (64, 96), (96, 100)]
    vocab = (CFG.vocab_size,)
    assert waited.count(vocab) == 1  # the last chunk's logits only; the decodes' tokens are [rows]


def test_preemption_under_a_small_pool_keeps_outputs_and_invariants(model, references):
    # 12 BF16 pages: each sequence holds up to 1 sink + 3 recent pages, so four decoding together
    # run out and the newest is preempted (and recomputed) again and again.
    rt = runtime(model, num_bf16_pages=12, num_int2_pages=40)
    engine = Engine(rt, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4, prefill_chunk=CHUNK))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    lengths = (5, 17, 40, 33, 71, 9)
    for i, n in enumerate(lengths):
        engine.add_request(prompt(n), params, f"r{i}")
    results = run(engine, invariants)
    assert engine.stats.preemptions >= 1, engine.stats
    for i, n in enumerate(lengths):
        tokens, final = results[f"r{i}"]
        assert tokens == alone(model, prompt(n), params.max_tokens), f"prompt of {n} tokens"
        assert final.finish_reason == "length"
    assert not rt.allocator.sequences
    assert not rt.allocator.bf16.refs.any() and not rt.allocator.int2.refs.any()


def test_tenants_never_share_pages_and_one_tenant_reuses_its_prefix(model):
    rt = runtime(model)
    engine = Engine(rt, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4, prefill_chunk=CHUNK))
    shared = prompt(90)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request(shared, params, "a1", tenant="alice")
    run(engine)
    engine.add_request(shared, params, "b1", tenant="bob")
    engine.add_request(shared, params, "a2", tenant="alice")
    pages = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                pages.setdefault(out.request_id, out.cached_tokens)
        for request_id in ("b1", "a2"):
            request = engine.requests.get(request_id)
            if request is not None and request.seq_id is not None:
                seq = rt.allocator.sequences[request.seq_id]
                pages[request_id + "/pages"] = (set(seq.sink_pages + seq.recent_pages), set(seq.history_pages))
        if "b1/pages" in pages and "a2/pages" in pages:
            bob, alice = pages["b1/pages"], pages["a2/pages"]
            assert not bob[0] & alice[0] and not bob[1] & alice[1], "two tenants share a page"
        invariants(engine)
    assert pages["b1"] == 0  # nothing of alice's is visible to bob
    # alice's second request found her sink page and both history pages (90 = 16 + 2·16 + 42 recent)
    assert pages["a2"] == 48
    assert engine.stats.prefix_hit_tokens == pages["a2"]


def test_abort_mid_prefill_frees_pages_and_publishes_no_unwritten_page(model):
    rt = runtime(model)
    engine = Engine(rt, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4, prefill_chunk=CHUNK))
    long = prompt(150)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(long, params, "x", tenant="t")
    engine.step()  # one chunk written
    assert rt.prefilled(engine.requests["x"].seq_id) == CHUNK
    assert engine.abort("x")
    final = engine.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in final] == [("x", "abort", True)]
    assert not rt.allocator.sequences and not rt.allocator.bf16.refs.any() and not rt.allocator.int2.refs.any()
    invariants(engine)
    engine.add_request(long, params, "y", tenant="t")
    results = run(engine)
    assert results["y"][1].cached_tokens <= CHUNK  # only the written chunk can be a hit
    assert results["y"][0] == alone(model, long, params.max_tokens)
    assert not engine.abort("y") and not engine.abort("never-added")


def test_abort_mid_decode_and_while_waiting(model):
    rt = runtime(model)
    engine = Engine(rt, None, EngineConfig(max_num_seqs=1, max_num_batched_tokens=CHUNK + 1, prefill_chunk=CHUNK))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request(prompt(10), params, "running")
    engine.add_request(prompt(11), params, "waiting")
    for _ in range(3):
        engine.step()
    assert engine.requests["running"].output_ids and engine.requests["waiting"].seq_id is None
    assert engine.abort("waiting") and engine.abort("running")
    reasons = {o.request_id: o.finish_reason for o in engine.step()}
    assert reasons == {"running": "abort", "waiting": "abort"}
    assert not engine.has_work() and not rt.allocator.sequences


def test_serving_varied_lengths_compiles_only_the_buckets(model):
    """After one request per bucket and `compile_feeds`, requests of other lengths and batch sizes
    compile nothing (run alone too: no earlier test may have compiled a shape for it)."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    engine = Engine(runtime(model), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4,
                                                       prefill_chunk=CHUNK))
    # warm: every prefill bucket (16, 32) and decode bucket (1, 2, 4), greedy and sampled, and the
    # demotion of each decode bucket
    for n, batch in ((3, 1), (20, 2), (31, 4)):
        for temperature in (0.0, 0.7):
            for i in range(batch):
                engine.add_request(prompt(n, i), SamplingParams(max_tokens=3, temperature=temperature, seed=i),
                                   f"w{n}-{temperature}-{i}")
            run(engine)
        engine.runtime.compile_demotion(batch)
    # the token hand-over between decode buckets (overlap): one tiny program per pair of buckets,
    # which the warm-up requests above reach only in the order they happen to run
    engine.compile_feeds()
    warm = len(compiles)
    assert warm > 0
    rng = np.random.default_rng(0)
    for i in range(24):
        n = int(rng.integers(1, 120))
        engine.add_request(prompt(n, i), SamplingParams(max_tokens=int(rng.integers(1, 9)),
                                                        temperature=float(rng.choice([0.0, 0.8])), seed=i), f"v{i}")
    run(engine)
    assert len(compiles) == warm, f"{len(compiles) - warm} compilations while serving varied requests"


def test_warmup_compiles_the_shapes_it_is_given_and_no_other(model):
    """warmup(chunk_lengths=[32]) compiles the 32-token prefill and every decode bucket: serving
    prompts made of 32-token chunks then compiles nothing, and its decode warm-up prompts did not
    compile the 16-token prefill bucket (a shorter prompt still does)."""
    from oscar_jax.serve import warmup

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    # a table width of its own: no shape is compiled already by another test of this module
    engine = Engine(runtime(model, max_seq_len=MAX_LEN - 2 * CHUNK), None,
                    EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4, prefill_chunk=CHUNK))
    said = []
    warmup(engine, chunk_lengths=[CHUNK], log=said.append)
    assert [line.split(" in ")[0] for line in said[:-1]] == [
        "[oscar] warmup: prefill chunk 32", "[oscar] warmup: decode batch 1", "[oscar] warmup: decode batch 2",
        "[oscar] warmup: decode batch 4"]
    warm = len(compiles)
    for i, n in enumerate((64, 96, 32, 64)):
        engine.add_request(prompt(n, i), SamplingParams(max_tokens=4, temperature=0.0 if i % 2 else 0.8, seed=i),
                           f"r{i}")
    run(engine)
    assert len(compiles) == warm, f"{len(compiles) - warm} compilations serving 32-token chunks after warm-up"
    engine.add_request(prompt(5), GREEDY, "short")
    run(engine)
    assert len(compiles) > warm  # the 16-token prefill bucket was left to compile


class CharTokenizer:
    """Token t is the character chr(ord('a') + t % 26)."""

    eos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_stop_tokens_and_text(model, references):
    tokens = references[40]
    text = CharTokenizer().decode(tokens)
    # no prefix caching: a hit on another request's pages would round differently than `references`
    engine = Engine(runtime(model), CharTokenizer(), EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4,
                                                                  prefill_chunk=CHUNK, enable_prefix_caching=False))
    stop = text[5:7]
    engine.add_request(prompt(40), SamplingParams(max_tokens=12, temperature=0, stop=(stop,)), "s")
    engine.add_request(prompt(40), SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(tokens[3],)), "t")
    engine.add_request(prompt(40), SamplingParams(max_tokens=12, temperature=0), "n")
    streamed = {}
    results = {}
    while engine.has_work():
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.text
            if out.finished:
                results[out.request_id] = out
    assert streamed["s"] == text[: text.find(stop)] and results["s"].finish_reason == "stop"
    assert streamed["t"] == text[:3] and results["t"].finish_reason == "stop"
    assert results["t"].completion_tokens == 4  # the stop token is generated, not shown
    assert streamed["n"] == text and results["n"].finish_reason == "length"


def test_request_checks_name_the_value(model):
    engine = Engine(runtime(model, num_bf16_pages=4, num_int2_pages=4), None,
                    EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4, prefill_chunk=CHUNK))
    with pytest.raises(ValueError, match="maximum context length is 192 tokens; the request asks for 200"):
        engine.add_request(prompt(190), SamplingParams(max_tokens=10), "long")
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 96\)"):
        engine.add_request([5, 96, -1], SamplingParams(), "vocab")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams(), "empty")
    with pytest.raises(ValueError, match="needs .* INT2 pages; the cache holds 3 and 3"):
        engine.add_request(prompt(150), SamplingParams(max_tokens=10), "big")
    engine.add_request(prompt(3), SamplingParams(), "same")
    with pytest.raises(ValueError, match="'same' is already in use"):
        engine.add_request(prompt(3), SamplingParams(), "same")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens=0"), (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(temperature=2.5), "temperature=2.5"), (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-3), "top_k=-3"), (dict(seed=-1), "seed=-1"), (dict(stop=("",)), "stop="),
    (dict(stop_token_ids=(-2,)), "stop_token_ids=\\[-2\\]"), (dict(max_tokens=2.5), "max_tokens=2.5"),
])
def test_sampling_params_name_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampler_greedy_top_k_seed_and_top_p():
    rng = np.random.default_rng(0)
    logits = jax.numpy.asarray(rng.normal(size=(4, 50)).astype(np.float32) * 3)
    argmax = np.argmax(np.asarray(logits), axis=-1)
    greedy = SamplingParams(temperature=0)
    top1 = SamplingParams(temperature=1.5, top_k=1)
    assert list(sample_batch(logits, [greedy] * 4, [0] * 4, [0] * 4)) == list(argmax)
    assert list(sample_batch(logits, [top1, greedy], [1, 2], [0, 0])) == list(argmax[:2])
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6)  # keeps the most likely token only
    assert sample_batch(logits, [tiny_p], [5], [0])[0] == argmax[0]
    free = SamplingParams(temperature=1.0)
    a = [sample_batch(logits, [free, greedy], [7, 0], [n, 0])[0] for n in range(20)]
    b = [sample_batch(logits[:1], [free], [7], [n])[0] for n in range(20)]
    assert a == b  # a seeded row draws the same tokens whatever batch it is in
    assert len(set(a)) > 1  # and temperature 1 does sample
    top3 = SamplingParams(temperature=2.0, top_k=3)
    allowed = set(np.argsort(-np.asarray(logits)[0])[:3])
    assert {int(sample_batch(logits, [top3], [s], [0])[0]) for s in range(40)} <= allowed


def test_runtime_step_rejects_repeated_unknown_and_unfinished_sequences(model):
    rt = runtime(model)
    a, _, _ = rt.admit(prompt(5))
    with pytest.raises(ValueError, match=rf"sequence {a} appears more than once"):
        rt.step([a, a], [1, 2])
    with pytest.raises(ValueError, match="unknown sequence 999"):
        rt.step([999], [1])
    plan = rt.start(prompt(100))
    with pytest.raises(ValueError, match=rf"sequence {plan.seq_id} is still prefilling \(0 of 100"):
        rt.step([a, plan.seq_id], [1, 2])
    with pytest.raises(ValueError, match=r"chunk \[16, 32\) must start at 0"):
        rt.prefill(plan.seq_id, 16, 32)
    length = rt.length(a)
    rt.finish(a)
    with pytest.raises(ValueError, match=rf"unknown sequence {a}"):
        rt.step([a], [1])
    with pytest.raises(ValueError, match=rf"unknown sequence {a}"):
        rt.finish(a)
    assert length == 5


def test_runtime_step_checks_pages_before_changing_anything(model):
    rt = runtime(model, num_bf16_pages=3, num_int2_pages=4)
    a, _, _ = rt.admit(prompt(16))  # one full sink page; the next token needs a second page
    b, _, _ = rt.admit(prompt(16, 1))
    assert rt.pages_needed([a, b]) == (2, 0) and rt.free_pages()[0] == 0
    before = (rt.length(a), rt.length(b), rt.allocator.bf16.refs.copy())
    with pytest.raises(PoolExhausted, match="needs 2 new BF16 pages and 0 are free"):
        rt.step([a, b], [1, 2])
    assert (rt.length(a), rt.length(b)) == before[:2] and np.array_equal(rt.allocator.bf16.refs, before[2])
    rt.allocator.check_invariants()


def test_overlap_gives_the_same_seeded_samples_and_stops(model):
    """Seeded temperature sampling and a stop token: with overlap a stopped request's extra
    launched row is dropped, and every output and finish reason is as without it."""

    def serve(overlap, stop_ids=()):
        engine = Engine(runtime(model), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK + 4,
                                                           prefill_chunk=CHUNK, overlap=overlap))
        for i, n in enumerate((5, 40, 17)):
            params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=11 + i,
                                    stop_token_ids=tuple(stop_ids), ignore_eos=True)
            engine.add_request(prompt(n, i), params, f"r{i}")
        results = run(engine, invariants)
        assert not engine.runtime.allocator.sequences
        return {r: (tokens, final.finish_reason) for r, (tokens, final) in results.items()}

    free = serve(False)
    assert serve(True) == free
    stop = free["r1"][0][6]  # a token r1 samples mid-way: it stops there
    stopped = serve(False, [stop])
    assert stopped["r1"][1] == "stop" and stopped["r1"][0] == free["r1"][0][: free["r1"][0].index(stop) + 1]
    assert serve(True, [stop]) == stopped
