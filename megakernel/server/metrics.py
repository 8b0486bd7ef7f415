"""Prometheus metrics of the server (one registry per app, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for app.py)

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("megakernel_requests", "Finished requests by finish reason", lbl + ["finish_reason"],
                                registry=r)
        self.http_requests = Counter("megakernel_http_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("megakernel_prompt_tokens", "Prompt tokens of finished requests", lbl,
                                     registry=r)
        self.cached_prompt_tokens = Counter("megakernel_cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache", lbl, registry=r)
        self.generation_tokens = Counter("megakernel_generation_tokens", "Generated tokens", lbl, registry=r)
        self.preemptions = Gauge("megakernel_num_preemptions", "Preemptions since start (recompute)", lbl,
                                 registry=r)
        self.waiting = Gauge("megakernel_num_requests_waiting", "Sequences in the queue (not yet admitted)", lbl,
                             registry=r)
        self.running = Gauge("megakernel_num_requests_running", "Sequences in the running batch", lbl, registry=r)
        self.kv_usage = Gauge("megakernel_kv_cache_usage_ratio", "Fraction of KV blocks held by sequences", lbl,
                              registry=r)
        self.kv_blocks = Gauge("megakernel_kv_blocks_in_use", "KV blocks held by sequences", lbl, registry=r)
        self.kv_blocks_total = Gauge("megakernel_kv_blocks_total", "KV blocks in all pools", lbl, registry=r)
        self.prefix_hit_rate = Gauge("megakernel_prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens admitted", lbl,
                                     registry=r)
        self.ttft = Histogram("megakernel_time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("megakernel_inter_token_latency_seconds", "Time between generated tokens", lbl,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("megakernel_e2e_request_latency_seconds", "Request latency, arrival to finish", lbl,
                             buckets=E2E_BUCKETS, registry=r)
        self.step_time = Histogram("megakernel_engine_step_seconds", "Duration of one engine step", lbl,
                                   buckets=ITL_BUCKETS, registry=r)

    # called from the engine thread (prometheus_client metrics are thread-safe)
    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def inter_token(self, seconds: float, num_tokens: int) -> None:
        per = seconds / max(1, num_tokens)
        h = self.itl.labels(self.model_name)
        for _ in range(max(1, num_tokens)):
            h.observe(per)

    def step(self, seconds: float) -> None:
        self.step_time.labels(self.model_name).observe(seconds)

    def request_finished(self, reason: str, sink, out) -> None:
        import time

        m = self.model_name
        self.requests.labels(m, reason or "unknown").inc()
        self.prompt_tokens.labels(m).inc(sink.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(sink.num_tokens)
        if out is not None:
            self.cached_prompt_tokens.labels(m).inc(out.num_cached_tokens)
        self.e2e.labels(m).observe(time.monotonic() - sink.arrival)

    def render(self, snapshot) -> bytes:
        m = self.model_name
        self.waiting.labels(m).set(snapshot.num_waiting)
        self.running.labels(m).set(snapshot.num_running)
        self.kv_usage.labels(m).set(snapshot.kv_usage)
        self.kv_blocks.labels(m).set(snapshot.kv_blocks_in_use)
        self.kv_blocks_total.labels(m).set(snapshot.kv_blocks_total)
        self.prefix_hit_rate.labels(m).set(snapshot.prefix_cache_hit_rate)
        self.preemptions.labels(m).set(snapshot.num_preemptions)
        return generate_latest(self.registry)
