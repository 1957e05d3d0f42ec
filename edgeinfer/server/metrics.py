"""Prometheus metrics under vLLM's names, prefixed `edgeinfer:` and labelled by model_name.

The engine's own state (running and waiting requests, KV blocks, prefix-cache lookups,
preemptions, speculative drafts) is read from `AsyncEngine.stats()` when scraped; what only the
server sees (tokens per request, latencies, finish reasons) is counted as requests run. One
registry per server, no global state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
P = "edgeinfer:"

# seconds; vLLM's buckets, trimmed to what a CPU server sees
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640)
_ITL = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
_E2E = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960)


class _EngineCollector:
    def __init__(self, model: str, stats):
        self._model = model
        self._stats = stats  # () -> EngineStats | None (None while the model loads)

    def collect(self):
        s = self._stats()
        if s is None:
            return
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric([self._model], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric([self._model], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        window = (
            s.kv_window_blocks_used / s.kv_window_blocks_total if s.kv_window_blocks_total else 0.0
        )
        # a request needs room in both pools: the fuller one is the cache's usage
        yield gauge(
            "kv_cache_usage_perc", "KV-cache usage (the fuller pool), 1 = full.", max(usage, window)
        )
        yield gauge(
            "kv_window_cache_usage_perc",
            "Sliding-window layers' own KV pool usage, 1 = full (0 without such layers).",
            window,
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queried_tokens,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hit_tokens,
        )
        yield counter("num_preemptions", "Requests preempted (recomputed).", s.preemptions)
        # speculative decoding (0 when it is off), under vLLM's names
        yield counter("spec_decode_num_drafts", "Drafts verified.", s.spec_drafts)
        yield counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_proposed_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens
        )


class Metrics:
    def __init__(self, model: str, stats):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(model, stats))
        self._model = model
        r, lab = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens processed.", lab, registry=r
        )
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens generated.", lab, registry=r
        )
        self.request_success = Counter(
            P + "request_success",
            "Finished requests by finish reason.",
            [*lab, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Time to first token.",
            lab,
            buckets=_TTFT,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Time between tokens.",
            lab,
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            lab,
            buckets=_E2E,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Time waiting before the first step.",
            lab,
            buckets=_E2E,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- per sequence, as its outputs arrive ----------------------------------------------------

    def first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self._model).observe(ttft_s)

    def tokens(self, n: int, since_last_s: float | None) -> None:
        """n new tokens; since_last_s: time since the previous output of the same sequence."""
        self.generation_tokens.labels(self._model).inc(n)
        if since_last_s is not None and n:
            for _ in range(n):
                self.itl.labels(self._model).observe(since_last_s / n)

    def finished(self, reason: str, prompt_tokens: int, e2e_s: float, queue_s: float | None):
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.request_success.labels(self._model, reason).inc()
        self.e2e.labels(self._model).observe(e2e_s)
        if queue_s is not None:
            self.queue_time.labels(self._model).observe(max(0.0, queue_s))
