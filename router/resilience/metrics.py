"""Prometheus series of retries, circuit breakers and admission limits, in the router's registry.

Gauges are computed when /metrics is scraped, from the same state /get_server_info shows (a
breaker's open -> half-open step happens when it is read, so a scrape sees it on time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.resilience.admission import Admission
from router.resilience.breaker import Breakers
from router.resilience.limiter import Overloaded
from router.tracker import WorkerState

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Gauges(Collector):
    def __init__(self, workers: Callable[[], Iterable[WorkerState]], breakers: Breakers,
                 admission: Admission) -> None:
        self.workers = workers
        self.breakers = breakers
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "worker"]
        state = GaugeMetricFamily("sglang_ext:worker_circuit_state", "Circuit breaker of the worker: 0 closed, "
                                  "1 open (not routed to), 2 half-open (one trial request)", labels=labels)
        opened = CounterMetricFamily("sglang_ext:worker_circuit_opened", "Times the worker's circuit opened",
                                     labels=labels)
        for w in self.workers():
            state.add_metric([w.model, w.worker_id], float(self.breakers.state(w.worker_id)))
            b = self.breakers.by_worker.get(w.worker_id)
            opened.add_metric([w.model, w.worker_id], b.opened if b is not None else 0)
        yield from (state, opened)
        scope = ["limit", "name"]
        active = GaugeMetricFamily("sglang_ext:admission_active_reqs", "Requests holding a place under an "
                                   "admission limit (limit: router, model, key)", labels=scope)
        waiting = GaugeMetricFamily("sglang_ext:admission_queue_reqs", "Requests waiting for room under an "
                                    "admission limit", labels=scope)
        for lim in self.admission.limiters():
            active.add_metric([lim.limit, lim.name], lim.active)
            waiting.add_metric([lim.limit, lim.name], len(lim.waiters))
        yield from (active, waiting)


class ResilienceMetrics:
    def __init__(self, registry: CollectorRegistry, workers: Callable[[], Iterable[WorkerState]],
                 breakers: Breakers, admission: Admission) -> None:
        r = registry
        self.retries = Counter("sglang_ext:request_retries", "Requests placed again after a worker failed them "
                               "before their client got any output", ["model_name"], registry=r)
        self.refused = Counter("sglang_ext:admission_rejected", "Requests refused with 429 by an admission limit "
                               "(reason: queue_full, timeout)", ["limit", "name", "reason"], registry=r)
        self.wait = Histogram("sglang_ext:admission_wait_seconds", "Time admitted requests waited for room under "
                              "their admission limits", buckets=_WAIT_BUCKETS, registry=r)
        r.register(_Gauges(workers, breakers, admission))
        admission.on_refused = self.on_refused
        admission.on_admitted = self.wait.observe

    def on_refused(self, e: Overloaded) -> None:
        self.refused.labels(e.limit, e.name, e.reason).inc()
