"""The serving engine: continuous batching with chunked prefill over one OscarRuntime.

    engine.add_request(prompt_ids, SamplingParams(...), request_id="a", tenant="alice")
    while engine.has_work():
        for out in engine.step(): ...        # RequestOutput: new tokens and text of one request
    engine.abort("a")

One `step`:
  1. decode rows: every running sequence whose prompt is written decodes one token. If the pools
     cannot hold the pages this step allocates, the newest running sequence (latest arrival) is
     preempted — its pages freed, the request put back at the head of the queue — until they can.
     A preempted request is recomputed the way it was computed first: its prompt prefilled in
     the same chunks, then its generated tokens fed back one decode step each (no output until
     it catches up), so its cache holds what it held before and greedy outputs do not change (a
     recomputation by prefill would round K/V differently and can flip near-ties).
  2. prefill chunks, under the token budget `max_num_batched_tokens` less the decode rows:
     first the running sequences still prefilling (oldest first), then waiting requests admitted
     in arrival order while a slot (`max_num_seqs`) and the pages of their whole prompt are free.
     Chunks end at multiples of `prefill_chunk` (absolute positions), so a prompt is split the
     same way whatever else runs, and a long prompt takes one chunk per step while the decodes
     go on.
  3. one decode launch (the batch padded to a bucket of `decode_buckets`), one prefill launch per
     chunk (its length padded to a power of two), sampling on the device, then on the host:
     stop tokens, stop strings, max_tokens, the context limit, and incremental detokenization.

Overlap (`EngineConfig.overlap`, on by default, as SGLang's overlap scheduler and vLLM's async
scheduling): a decode launch's sampled tokens stay on the device, and the next step's launch
takes them from there (`_feed`) before the host reads them back, so the host's work of a step
runs while the device computes the next one. A request's output token therefore arrives one step
after its launch. What the host cannot know yet costs at most one row: a request whose pending
token is certainly its last (max_tokens, the context limit) is not launched again; one that
turns out to have sampled a stop token was, and that row's token is dropped. Preemption first
reads back the launch in flight. Outputs are the same, token for token, with and without overlap.

Prefix sharing goes through the runtime's allocator with the tenant as the namespace, so two
tenants never share a page. The engine is single-threaded; `oscar_jax.serving.server` drives it
from one thread.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import secrets
import time

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax.runtime import OscarRuntime
from oscar_jax.serving.sampling import SamplingParams, sample_batch, sample_on_device
from shared_math.tiers import tier_split


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 1024
    prefill_chunk: int = 512
    enable_prefix_caching: bool = True
    decode_buckets: tuple[int, ...] | None = None  # default: powers of two, then max_num_seqs
    # Launch each decode step before reading back the previous one's tokens, so the host's work
    # (scheduling, page tables, stop checks, detokenization) runs while the device computes.
    overlap: bool = True

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be ≥ 1")
        if self.max_num_batched_tokens < self.prefill_chunk + self.max_num_seqs:
            # one full chunk must fit next to a full batch of decodes, or prefill could stall
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                             f"prefill_chunk + max_num_seqs = {self.prefill_chunk + self.max_num_seqs}")
        if self.decode_buckets is not None and (not self.decode_buckets or max(self.decode_buckets) < self.max_num_seqs
                                                or min(self.decode_buckets) < 1):
            raise ValueError(f"decode_buckets={self.decode_buckets} must be positive and reach "
                             f"max_num_seqs={self.max_num_seqs}")

    @property
    def buckets(self) -> tuple[int, ...]:
        if self.decode_buckets is not None:
            return tuple(sorted(set(self.decode_buckets)))
        powers = [1 << i for i in range(self.max_num_seqs.bit_length()) if 1 << i < self.max_num_seqs]
        return tuple(powers + [self.max_num_seqs])


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str | None
    order: int  # arrival order: the newest is preempted first
    seed: int
    stop_ids: frozenset[int]
    arrival: float
    state: State = State.WAITING
    seq_id: int | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # the output text so far (stop strings and stop tokens excluded)
    sent: int = 0  # characters of `text` already returned
    cached_tokens: int = 0  # prompt tokens found in shared pages at the first admission
    admitted: bool = False
    preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]  # new token ids (a stop token included)
    text: str  # new text
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    arrival: float
    first_token_time: float | None


@dataclasses.dataclass(frozen=True)
class _Launch:
    """A decode launch: its rows (request, the request's sequence at launch, whether the row's
    token is a new output rather than a replayed one), its sampled tokens on the device, and the
    rows it fed from the launch before it (request, sequence, position, that launch's row)."""

    rows: list[tuple["Request", int, bool]]
    tokens: jax.Array
    unknown: list[tuple["Request", int, int, int]]


@jax.jit
def _feed(previous: jax.Array, previous_rows: jax.Array, host: jax.Array) -> jax.Array:
    """A decode launch's input tokens: previous[previous_rows[i]] where that row is ≥ 0, else host[i]."""
    return jnp.where(previous_rows >= 0, previous[jnp.maximum(previous_rows, 0)], host)


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """One step's wall time and the part of it spent blocked on the device's model launches; the
    rest is host work (scheduling, page tables, sampling launch, detokenization) during which the
    device waits."""

    decode_rows: int
    prefill_tokens: int
    total_s: float
    device_wait_s: float


@dataclasses.dataclass
class EngineStats:
    """Counters for the metrics endpoint (monotonic, except the gauges at the top)."""

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0


class Engine:
    def __init__(self, runtime: OscarRuntime, tokenizer=None, config: EngineConfig = EngineConfig(), *,
                 eos_id: int | None = None):
        """tokenizer: anything with decode(ids, skip_special_tokens=) (None: no text, token ids only).
        eos_id: the stop token of every request unless it sets ignore_eos (default: the tokenizer's)."""
        if config.prefill_chunk != runtime.prefill_chunk:
            raise ValueError(f"prefill_chunk={config.prefill_chunk} differs from the runtime's "
                             f"{runtime.prefill_chunk}")
        self.runtime, self.tokenizer, self.config = runtime, tokenizer, config
        self.eos_id = eos_id if eos_id is not None else getattr(tokenizer, "eos_id", None)
        self.max_model_len = runtime.max_seq_len
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._order = itertools.count()
        self._aborted: list[RequestOutput] = []
        self.last_step: StepTiming | None = None
        self._inflight: _Launch | None = None  # the decode launch whose tokens are not read back yet
        self._pending: dict[str, int] = {}  # request id → its row in `_inflight`, for rows that emit
        self._waited = 0.0

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids, sampling_params: SamplingParams, request_id: str, tenant: str | None = None,
                    *, arrival: float | None = None) -> None:
        """Queue a request. Raises ValueError (naming the value) for an empty prompt, a token id
        outside the vocabulary, a prompt plus max_tokens beyond max_model_len, a request that
        cannot fit the pools even alone, or a request id in use."""
        prompt = [int(t) for t in np.asarray(prompt_ids).reshape(-1)] if len(prompt_ids) else []
        if not prompt:
            raise ValueError("the prompt is empty: it needs at least one token")
        vocab = self.runtime.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        total = len(prompt) + sampling_params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the request "
                             f"asks for {total} ({len(prompt)} in the prompt, max_tokens={sampling_params.max_tokens})")
        bf16, int2 = self._pages_for(total)
        pools = (self.runtime.allocator.bf16.num_pages - 1, self.runtime.allocator.int2.num_pages - 1)
        if bf16 > pools[0] or int2 > pools[1]:
            raise ValueError(f"a sequence of {total} tokens needs {bf16} BF16 and {int2} INT2 pages; the cache "
                             f"holds {pools[0]} and {pools[1]}")
        seed = sampling_params.seed if sampling_params.seed is not None else secrets.randbits(63)
        stop_ids = set(sampling_params.stop_token_ids)
        if self.eos_id is not None and not sampling_params.ignore_eos:
            stop_ids.add(self.eos_id)
        request = Request(request_id, prompt, sampling_params, tenant, next(self._order), seed, frozenset(stop_ids),
                          time.monotonic() if arrival is None else arrival)
        self.requests[request_id] = request
        self.waiting.append(request)
        self.stats.prompt_tokens += len(prompt)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages; its final output (finish_reason "abort") comes with
        the next step. Returns False when the request is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.state is State.WAITING:
            self.waiting.remove(request)
        else:
            self._release(request)
        self._finish(request, "abort")
        self._aborted.append(self._output(request, [], flush=True))
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted or self._inflight)

    # ------------------------------------------------------------------ scheduling

    def _pages_for(self, length: int) -> tuple[int, int]:
        """(BF16, INT2) pages a sequence of `length` tokens holds at most (+1 BF16: a demotion's
        source and destination are held together for a moment)."""
        split = tier_split(length, self.runtime.config)
        return split.sink_pages + split.recent_pages + 1, split.history_pages

    def _bucket(self, rows: int) -> int:
        return next(b for b in self.config.buckets if b >= rows)

    def _next_chunk(self, request: Request) -> tuple[int, int]:
        start = self.runtime.prefilled(request.seq_id)
        chunk = self.config.prefill_chunk
        return start, min((start // chunk + 1) * chunk, len(request.prompt_ids))

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.state = State.WAITING
        request.preemptions += 1
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _release(self, request: Request) -> None:
        if request.seq_id is not None:
            self.runtime.finish(request.seq_id)
            request.seq_id = None
        if request in self.running:
            self.running.remove(request)

    def _admit(self, request: Request, decode_pages: tuple[int, int]) -> bool:
        """Start the prefill of a waiting request if its whole prompt fits the free pages next to
        this step's decode pages."""
        tokens = request.prompt_ids
        need = self._pages_for(len(tokens))
        free = self.runtime.free_pages()
        if any(n + d > f for n, d, f in zip(need, decode_pages, free)):
            return False
        # A recomputation shares no prefix: a prefix hit moves the chunk boundaries, and with them
        # the rounding of the recomputed K/V.
        share = self.config.enable_prefix_caching and not request.admitted
        plan = self.runtime.start(tokens, namespace=request.tenant, share_prefix=share)
        request.seq_id, request.state = plan.seq_id, State.PREFILL
        if not request.admitted:  # a recomputation is no cache query of the user's
            request.admitted, request.cached_tokens = True, plan.reused_tokens
            self.stats.prefix_query_tokens += len(tokens)
            self.stats.prefix_hit_tokens += plan.reused_tokens
        self.running.append(request)
        return True

    def _surely_ends(self, request: Request) -> bool:
        """Whether the token in flight for this request is certainly its last (max_tokens or the
        context limit), so it must not decode again."""
        return (request.request_id in self._pending
                and (len(request.output_ids) + 1 >= request.params.max_tokens
                     or request.length + 1 >= self.max_model_len))

    def _decodes(self) -> list[Request]:
        return [r for r in self.running if r.state is State.DECODE and not self._surely_ends(r)]

    def compile_feeds(self) -> None:
        """With overlap, compile `_feed` for every pair of decode buckets: a launch's tokens feed the
        next launch, at another bucket when the batch grows or shrinks. A few tiny programs, so
        that serving after warm-up compiles nothing (`serve.warmup` calls this)."""
        if not self.config.overlap:
            return
        for previous in self.config.buckets:
            tokens = jnp.zeros(previous, jnp.int32)
            for rows in self.config.buckets:
                _feed(tokens, jnp.asarray(np.full(rows, -1, np.int32)), jnp.asarray(np.zeros(rows, np.int32)))

    def _fits(self, decodes: list[Request]) -> bool:
        need = self.runtime.pages_needed([r.seq_id for r in decodes])
        return all(n <= f for n, f in zip(need, self.runtime.free_pages()))

    def step(self) -> list[RequestOutput]:
        """One scheduling round and its device work; the outputs of every request that advanced.
        With `overlap`, the decode launch's tokens are read back in the next step, after that
        step's launch: until then its outputs are pending."""
        started, self._waited = time.perf_counter(), 0.0
        outputs, self._aborted = self._aborted, []
        decodes = self._decodes()
        if decodes and self._inflight is not None and not self._fits(decodes):
            outputs += self._resolve()  # preemption needs every output known
            decodes = self._decodes()
        while decodes and not self._fits(decodes):
            victim = max(self.running, key=lambda r: r.order)
            self._preempt(victim)
            if victim in decodes:
                decodes.remove(victim)
        decode_pages = self.runtime.pages_needed([r.seq_id for r in decodes]) if decodes else (0, 0)

        budget = self.config.max_num_batched_tokens - len(decodes)
        chunks: list[tuple[Request, int, int]] = []

        def take(request) -> bool:
            nonlocal budget
            start, stop = self._next_chunk(request)
            if stop - start > budget:
                return False
            chunks.append((request, start, stop))
            budget -= stop - start
            return True

        for request in [r for r in self.running if r.state is State.PREFILL]:
            if not take(request):
                break
        else:
            while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
                if not self._admit(self.waiting[0], decode_pages):
                    break
                if not take(self.waiting.popleft()):
                    break

        launched = self._launch(decodes) if decodes else None
        if self._inflight is not None:
            outputs += self._resolve(launched)
        self._inflight = launched
        self._pending = {} if launched is None else {
            r.request_id: row for row, (r, _, emit) in enumerate(launched.rows) if emit}
        for request, start, stop in chunks:
            logits = self.runtime.prefill(request.seq_id, start, stop)
            if stop == len(request.prompt_ids):  # only a prompt's last chunk is read back: to sample
                self._wait(logits)
                request.state = State.DECODE
                if not request.output_ids:  # else a recomputation: the first token is known
                    token = sample_batch(logits[None], [request.params], [request.seed], [0])[0]
                    outputs.append(self._append(request, int(token)))
        if not self.config.overlap and self._inflight is not None:
            outputs += self._resolve()
        self.stats.steps += 1
        self.stats.running, self.stats.waiting = len(self.running), len(self.waiting)
        self.last_step = StepTiming(len(decodes), sum(stop - start for _, start, stop in chunks),
                                    time.perf_counter() - started, self._waited)
        return outputs

    def _wait(self, array):
        t = time.perf_counter()
        array.block_until_ready()
        self._waited += time.perf_counter() - t
        return array

    def _launch(self, decodes: list[Request]) -> _Launch:
        """Dispatch one decode step of `decodes` and its sampling, reading nothing back. A row is fed
        the request's first output token not yet in the cache: a known one (the newest, or one being
        replayed after a preemption), or the token the launch in flight samples for it."""
        rows = self._bucket(len(decodes))
        host = np.zeros(rows, np.int32)
        prev_rows = np.full(rows, -1, np.int32)
        emits, unknown = [], []
        for i, r in enumerate(decodes):
            n = self.runtime.length(r.seq_id) - len(r.prompt_ids)  # output tokens in the cache
            if n < len(r.output_ids):
                host[i] = r.output_ids[n]
            else:  # the launch in flight samples it
                prev_rows[i] = self._pending[r.request_id]
                unknown.append((r, r.seq_id, self.runtime.length(r.seq_id), int(prev_rows[i])))
            emits.append(n + 1 == len(r.output_ids) + (r.request_id in self._pending))
        if unknown:
            tokens = _feed(self._inflight.tokens, jnp.asarray(prev_rows), jnp.asarray(host))
            known = [None if prev_rows[i] >= 0 else int(host[i]) for i in range(len(decodes))]
        else:
            tokens, known = host[: len(decodes)], None
        logits = self.runtime.step([r.seq_id for r in decodes], tokens, batch_size=rows, known=known)
        counters = [self.runtime.length(r.seq_id) - len(r.prompt_ids) for r in decodes]  # index of the token drawn
        sampled = sample_on_device(logits, [r.params for r in decodes], [r.seed for r in decodes], counters)
        return _Launch([(r, r.seq_id, emit) for r, emit in zip(decodes, emits)], sampled, unknown)

    def _resolve(self, following: _Launch | None = None) -> list[RequestOutput]:
        """Read back the launch in flight: its new tokens become outputs, and the allocator learns
        the values that `following` (launched since) took from it on the device."""
        launch, self._inflight = self._inflight, None
        self._pending = {}
        values = np.asarray(self._wait(launch.tokens))
        live = [(seq_id, position, int(values[row])) for request, seq_id, position, row
                in (following.unknown if following is not None else ()) if request.seq_id == seq_id]
        if live:
            self.runtime.set_tokens(*zip(*live))
        outputs = []
        for row, (request, seq_id, emit) in enumerate(launch.rows):
            if emit and request.seq_id == seq_id and request.state is State.DECODE:
                outputs.append(self._append(request, int(values[row])))
        return outputs

    # ------------------------------------------------------------------ outputs

    def _append(self, request: Request, token: int) -> RequestOutput:
        now = time.monotonic()
        request.output_ids.append(token)
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        self.stats.generation_tokens += 1
        params = request.params
        reason = None
        if token in request.stop_ids:
            reason = "stop"
        elif self.tokenizer is not None:
            request.text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
            hits = [i for i in (request.text.find(s, max(0, request.sent - len(s))) for s in params.stop) if i >= 0]
            if hits:
                request.text, reason = request.text[: min(hits)], "stop"
        if reason is None and (len(request.output_ids) >= params.max_tokens
                               or request.length >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self._release(request)
            self._finish(request, reason)
        return self._output(request, [token], flush=reason is not None)

    def _finish(self, request: Request, reason: str) -> None:
        request.state, request.finish_reason = State.FINISHED, reason
        del self.requests[request.request_id]

    def _output(self, request: Request, new_ids: list[int], *, flush: bool) -> RequestOutput:
        """New text since the last output. Until the request ends, text that may be the start of a
        stop string, or an incomplete UTF-8 character, is held back."""
        ready = len(request.text)
        if not flush:
            if request.text.endswith("\ufffd"):
                ready = len(request.text.rstrip("\ufffd"))
            for stop in request.params.stop:
                for k in range(min(len(stop) - 1, ready), 0, -1):
                    if request.text[ready - k : ready] == stop[:k]:
                        ready -= k
                        break
        ready = max(ready, request.sent)
        text, request.sent = request.text[request.sent : ready], ready
        return RequestOutput(request.request_id, new_ids, text, request.state is State.FINISHED,
                             request.finish_reason, len(request.prompt_ids), len(request.output_ids),
                             request.cached_tokens, request.arrival, request.first_token_time)
