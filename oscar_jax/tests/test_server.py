"""The HTTP server as a user runs it: `python -m oscar_jax.serve` in its own process on 127.0.0.1,
driven by the `openai` client (and httpx for what the client will not send).

Two servers per module, started once: one with room for every sequence, one whose BF16 pool is
too small for eight sequences at once (preemption). The model is a tiny random-weight HF
directory with SmolLM2's tokenizer and chat template (oscar_jax.tests.serving_model), so every
file the server reads goes through the real loaders and the server compiles in seconds; the real
SmolLM2 is served by the slow test at the end.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from oscar_jax.tests.serving_model import write_tiny_model

pytestmark = pytest.mark.kernels("xla")

MODEL = "tiny"
MAX_MODEL_LEN = 256
WINDOWS = ("--oscar-sink-size", "16", "--oscar-recent-size", "32")  # prompts and outputs cross every tier
COMMON = ("--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--prefill-chunk", "64",
          "--max-num-seqs", "8", "--decode-buckets", "8", *WINDOWS)
# Mixed prompt lengths: under a page, one chunk, several chunks, INT2 history included.
LENGTHS = (3, 9, 17, 30, 47, 64, 80, 120)
STARTUP_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args, log_path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "oscar_jax.serve", "--host", "127.0.0.1",
                                      "--port", str(self.port), *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{open(log_path).read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            self.stop()
            raise RuntimeError(f"the server did not come up in {STARTUP_S} s:\n{open(log_path).read()[-3000:]}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its name and labels, e.g. 'oscar:kv_pages_used{tier="bf16"}'."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "").replace(",}", "}")
            samples[name] = float(value)
        return samples

    def idle(self, timeout=60) -> dict[str, float]:
        """Metrics once no request is running or waiting (all pages released)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["oscar:num_requests_running"] == 0 and m["oscar:num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still live after {timeout} s: {m}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    model_dir, rotations = tiny
    proc = ServerProcess(["--model", str(model_dir), "--oscar-rotation-path", str(rotations), *COMMON],
                         tmp_path_factory.mktemp("logs") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def small_pool_server(tiny, tmp_path_factory):
    """14 BF16 pages: eight sequences of up to 1 sink + 3 recent pages each cannot all decode."""
    model_dir, rotations = tiny
    proc = ServerProcess(["--model", str(model_dir), "--oscar-rotation-path", str(rotations), *COMMON,
                          "--num-bf16-pages", "14", "--num-int2-pages", "60"],
                         tmp_path_factory.mktemp("logs") / "small_pool.log")
    yield proc
    proc.stop()


def prompts(seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(100, 40000, n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def alone(tiny):
    """Greedy tokens of each prompt through OscarRuntime alone (admit, then step), 40 tokens."""
    from oscar_jax.loaders import load_model
    from oscar_jax.runtime import OscarRuntime, fingerprint
    from shared_math.artifact import read_artifact

    model_dir, rotations = tiny
    cfg, params = load_model(model_dir)
    artifact = read_artifact(rotations, expected_model=fingerprint(cfg))
    out = []
    for tokens in prompts():
        rt = OscarRuntime(params, cfg, artifact, max_batch=1, max_seq_len=MAX_MODEL_LEN, prefill_chunk=64,
                          sink=16, recent=32)
        sid, logits, _ = rt.admit(tokens)
        ids = [int(np.argmax(logits))]
        while len(ids) < 40:
            ids.append(int(np.argmax(rt.step([sid], [ids[-1]])[0])))
        out.append(ids)
    return out


def greedy_ids(srv: ServerProcess, tokens: list[int], max_tokens: int) -> tuple[list[int], str]:
    r = srv.client.completions.create(model=MODEL, prompt=tokens, max_tokens=max_tokens, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == max_tokens
    return choice.model_extra["token_ids"], choice.text


def concurrently(fn, items):
    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


# ------------------------------------------------------------------------------------------ tests


def test_models_health_and_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = server.client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    m = server.metrics()
    for name in ("oscar:num_requests_running", "oscar:num_requests_waiting", 'oscar:kv_pages_used{tier="bf16"}',
                 'oscar:kv_pages_free{tier="int2"}', "oscar:num_preemptions_total", "oscar:prefix_cache_hits_total",
                 "oscar:generation_tokens_total", "oscar:time_to_first_token_seconds_count",
                 "oscar:inter_token_latency_seconds_count", "oscar:e2e_request_latency_seconds_count"):
        assert name in m, name


def test_completions_and_chat_stream_equals_non_stream(server):
    client = server.client
    args = dict(model=MODEL, max_tokens=10, temperature=0)
    whole = client.completions.create(prompt="The capital of France is", **args)
    chunks = list(client.completions.create(prompt="The capital of France is", stream=True,
                                            stream_options={"include_usage": True}, **args))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text and streamed == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(messages=messages, **args)
    stream = list(client.chat.completions.create(messages=messages, stream=True, **args))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    # the template adds SmolLM2's default system turn and the generation prompt (~30 tokens)
    assert chat.usage.prompt_tokens > 20


def test_concurrent_greedy_requests_match_each_alone_through_the_runtime(server, alone):
    got = concurrently(lambda tokens: greedy_ids(server, tokens, 12)[0], prompts())
    for n, ids, want in zip(LENGTHS, got, alone):
        assert ids == want[:12], f"prompt of {n} tokens"
    m = server.idle()
    assert m['oscar:kv_pages_used{tier="bf16"}'] == 0 and m['oscar:kv_pages_used{tier="int2"}'] == 0


@pytest.mark.slow  # a second server process; the engine's preemption test is in the fast suite
def test_a_pool_too_small_preempts_and_every_request_completes_unchanged(small_pool_server, alone):
    srv = small_pool_server
    before = srv.metrics()["oscar:num_preemptions_total"]
    got = concurrently(lambda tokens: greedy_ids(srv, tokens, 40)[0], prompts())
    for n, ids, want in zip(LENGTHS, got, alone):
        assert ids == want, f"prompt of {n} tokens"
    m = srv.idle()
    assert m["oscar:num_preemptions_total"] > before
    assert m['oscar:kv_pages_used{tier="bf16"}'] == 0 and m['oscar:kv_pages_used{tier="int2"}'] == 0
    assert m['oscar:kv_pages_free{tier="bf16"}'] == 13  # all but the scratch page: nothing leaked


def test_a_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    before = server.metrics().get('oscar:request_success_total{finished_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": list(range(1000, 1020)), "max_tokens": MAX_MODEL_LEN - 20,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events += 1
                    if events == 2:
                        break  # leaving the block closes the connection mid-stream
    m = server.idle()
    assert m['oscar:request_success_total{finished_reason="abort"}'] == before + 1
    assert m['oscar:kv_pages_used{tier="bf16"}'] == 0 and m['oscar:kv_pages_used{tier="int2"}'] == 0
    assert greedy_ids(server, [5, 6, 7], 3)[0]  # and the server goes on serving


def test_tenants_share_no_prefix_and_one_tenant_reuses_its_own(server):
    # 100 tokens: a 16-token sink page and 3 history pages (48 tokens) are shareable, 36 recent
    tokens = [int(t) for t in np.random.default_rng(7).integers(100, 40000, 100)]

    def cached(salt):
        r = server.client.completions.create(model=MODEL, prompt=tokens, max_tokens=2, temperature=0,
                                             extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    hits = server.metrics()["oscar:prefix_cache_hits_total"]
    assert cached("alice") == 0
    assert cached("bob") == 0  # alice's pages are invisible to bob
    assert server.metrics()["oscar:prefix_cache_hits_total"] == hits
    assert cached("alice") == 64
    assert server.metrics()["oscar:prefix_cache_hits_total"] == hits + 64


BAD_INPUTS = [
    # (path, body or raw text, status, text the message must contain)
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "'nope'"),
    ("/v1/completions", '{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens=0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens=-3"),
    ("/v1/completions", {"model": MODEL, "prompt": [7] * 300}, 400, "prompt has 300 tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [7] * 250, "max_tokens": 10}, 400, "260"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature=5"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature=-1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p=1.5"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p=0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "abc"}, 422, '"abc"'),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 422, '"hot"'),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 422, '"yes"'),
    ("/v1/completions", {"model": MODEL, "prompt": 123}, 422, "123"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 422, '[1, "a"]'),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999999]}, 400, "99999999"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n=2"),
    ("/v1/completions", {"model": MODEL}, 400, "'prompt'"),
    ("/v1/completions", {"prompt": "x"}, 400, "'model'"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 422, '"hi"'),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, '"wizard"'),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 422, "5"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 3}, 400, "'messages' is empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_tokens=0"),
    ("/v1/nothing", {}, 404, "/v1/nothing"),
]


@pytest.mark.parametrize("path, body, status, needle", BAD_INPUTS, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_gets_its_status_and_a_message_naming_the_value(server, path, body, status, needle):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_the_openai_client_sees_errors_and_the_server_keeps_serving(server):
    with pytest.raises(openai.BadRequestError, match="temperature=3"):
        server.client.completions.create(model=MODEL, prompt="x", temperature=3)
    with pytest.raises(openai.NotFoundError, match="'gpt-4'"):
        server.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert server.client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(server.url + "/health").status_code == 200


def test_sampling_is_seeded_and_stop_strings_cut_the_text(server):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9, seed=123)
    a = server.client.completions.create(**args).choices[0].text
    b = server.client.completions.create(**args).choices[0].text
    assert a == b
    _, text = greedy_ids(server, [11, 12, 13], 8)
    stop = text[3:6]
    assert stop and stop in text
    r = server.client.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int2", "bf16"])
def test_the_readme_commands_serve_smollm2(tmp_path, kv_cache_dtype):
    """`python -m oscar_jax.serve` with the embedded SmolLM2 answers the README's curl and openai
    examples with either cache (one decode bucket and short chunks keep the compile time down)."""
    srv = ServerProcess(["--model", "smollm2-135m", "--kv-cache-dtype", kv_cache_dtype, "--max-model-len", "512",
                         "--max-num-seqs", "2", "--decode-buckets", "2", "--prefill-chunk", "64"],
                        tmp_path / f"smollm2_{kv_cache_dtype}.log")
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "The capital of France is",
                                                          "max_tokens": 8, "temperature": 0}, timeout=300)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"], r.text
        chat = srv.client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0)
        assert "Paris" in chat.choices[0].message.content
    finally:
        srv.stop()
