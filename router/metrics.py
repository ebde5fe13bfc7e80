"""Prometheus metrics (prometheus-client), named as SGLang names them where one exists.

Each Router owns its own CollectorRegistry, so several routers in one process (tests) don't clash.
Latency histograms are per model; load gauges are per model and worker.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sglang_ext.messages import LoadReport

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        m, mw = ["model_name"], ["model_name", "worker"]
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Gap between streamed token chunks", m,
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("sglang:time_per_output_token_seconds", "(e2e - ttft) / (output tokens - 1)", m,
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("sglang:num_requests", "Finished requests by outcome", [*m, "status"], registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.gen_tokens = Counter("sglang:generation_tokens", "Generated tokens", m, registry=r)
        self.slo_miss = Counter("sglang_ext:slo_miss", "Requests that missed an SLO", [*m, "kind"], registry=r)
        self.running = Gauge("sglang:num_running_reqs", "Running requests (worker report)", mw, registry=r)
        self.waiting = Gauge("sglang:num_queue_reqs", "Waiting requests (worker report)", mw, registry=r)
        self.kv_used = Gauge("sglang_ext:kv_used_tokens", "KV tokens in use, prefix cache included", mw, registry=r)
        self.kv_cached = Gauge("sglang_ext:kv_cached_tokens", "KV tokens held by the prefix cache", mw, registry=r)
        self.kv_total = Gauge("sglang_ext:kv_total_tokens", "KV capacity in tokens", mw, registry=r)
        self.usage = Gauge("sglang:token_usage", "Fraction of KV capacity in use", mw, registry=r)
        self.step_ms = Gauge("sglang_ext:step_time_ms", "Last forward step time", mw, registry=r)
        self.inflight = Gauge("sglang_ext:router_inflight_reqs", "Requests the router waits on", mw, registry=r)
        self.up = Gauge("sglang_ext:worker_up", "1 while the worker sends heartbeats", mw, registry=r)

    def on_load(self, model: str, r: LoadReport, inflight: int) -> None:
        labels = (model, r.worker_id)
        self.running.labels(*labels).set(r.num_running)
        self.waiting.labels(*labels).set(r.num_waiting)
        self.kv_used.labels(*labels).set(r.kv_used_tokens)
        self.kv_cached.labels(*labels).set(r.kv_cached_tokens)
        self.kv_total.labels(*labels).set(r.kv_total_tokens)
        self.usage.labels(*labels).set(r.kv_used_tokens / r.kv_total_tokens if r.kv_total_tokens else 0.0)
        self.step_ms.labels(*labels).set(r.step_time_ms)
        self.inflight.labels(*labels).set(inflight)

    def render(self) -> bytes:
        return generate_latest(self.registry)
