"""Prometheus metrics of the server (vLLM's names, with the prefix `oscar:`).

Gauges are read from the engine when scraped (`collect`); histograms and counters of latency
and tokens are fed from the engine's outputs as they are delivered (`observe`). Each server owns
its registry, so two servers in one process (tests) never share series.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

# Latency buckets (seconds) spanning GPU decode steps (ms) to CPU prefills (tens of s).
disable_created_metrics()  # the *_created series only add noise to a scrape

_TTFT = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 2.5, 5.0, 10.0)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc, extra=()):
            return Gauge(f"oscar:{name}", doc, labels + list(extra), registry=r)

        def counter(name, doc, extra=()):
            return Counter(f"oscar:{name}", doc, labels + list(extra), registry=r)

        self.running = gauge("num_requests_running", "Requests holding cache pages (prefilling or decoding).")
        self.waiting = gauge("num_requests_waiting", "Requests queued for admission (preempted ones included).")
        self.pages_used = gauge("kv_pages_used", "Cache pages referenced by live sequences.", ["tier"])
        self.pages_free = gauge("kv_pages_free", "Cache pages free or reclaimable (prefix-cached, unreferenced).",
                                ["tier"])
        self.pages_cached = gauge("kv_pages_prefix_cached", "Unreferenced pages kept for prefix hits.", ["tier"])
        self.preemptions = counter("num_preemptions", "Sequences preempted (pages freed, recomputed later).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not recomputed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.ttft = Histogram("oscar:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=_TTFT, registry=r)
        self.itl = Histogram("oscar:inter_token_latency_seconds", "Time between a request's successive tokens.",
                             labels, buckets=_ITL, registry=r)
        self.e2e = Histogram("oscar:e2e_request_latency_seconds", "Arrival to the last token.", labels,
                             buckets=_E2E, registry=r)
        self.model_name = model_name
        for histogram in (self.ttft, self.itl, self.e2e):
            histogram.labels(model_name)  # a series from the first scrape on, not from the first request
        self._last_token: dict[str, float] = {}
        self._seen = {"preemptions": 0, "prefix_query_tokens": 0, "prefix_hit_tokens": 0, "prompt_tokens": 0,
                      "generation_tokens": 0}
        self._lock = threading.Lock()

    def observe(self, output, now: float | None = None) -> None:
        """Latencies of one engine output (called as outputs are delivered)."""
        now = time.monotonic() if now is None else now
        name = self.model_name
        if output.token_ids:
            last = self._last_token.get(output.request_id)
            if last is None:
                self.ttft.labels(name).observe(now - output.arrival)
            else:
                self.itl.labels(name).observe((now - last) / len(output.token_ids))
            self._last_token[output.request_id] = now
        if output.finished:
            self._last_token.pop(output.request_id, None)
            self.finished.labels(name, output.finish_reason).inc()
            self.e2e.labels(name).observe(now - output.arrival)

    def update(self, engine) -> None:
        """Gauges and counters from the engine's state (call from the engine's thread)."""
        name, stats, alloc = self.model_name, engine.stats, engine.runtime.allocator
        self.running.labels(name).set(len(engine.running))
        self.waiting.labels(name).set(len(engine.waiting))
        for tier, pool in (("bf16", alloc.bf16), ("int2", alloc.int2)):
            self.pages_used.labels(name, tier).set(int((pool.refs > 0).sum()))
            self.pages_free.labels(name, tier).set(pool.num_free)
            self.pages_cached.labels(name, tier).set(len(pool.cached))
        with self._lock:
            for field, metric in (("preemptions", self.preemptions), ("prefix_query_tokens", self.prefix_queries),
                                  ("prefix_hit_tokens", self.prefix_hits), ("prompt_tokens", self.prompt_tokens),
                                  ("generation_tokens", self.generation_tokens)):
                value = getattr(stats, field)
                metric.labels(name).inc(value - self._seen[field])
                self._seen[field] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
