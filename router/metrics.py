"""Prometheus metrics (prometheus-client), named as SGLang names them where one exists.

Each Router owns its own CollectorRegistry, so several routers in one process (tests) don't clash.
Latency histograms and counters are per model, updated as requests progress. Per-worker gauges are
read from the registry when /metrics is scraped, so they agree with /get_server_info at that moment
(load figures are the worker's latest report, sent every 0.5 s).

Remote-attention counters come from figures each worker reports as totals over its own life;
`OffloadTotals` keeps them monotonic when a worker restarts and starts again from zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.tracker import WorkerState
from sglang_ext.messages import LoadReport
from sglang_ext.messages.io import KVTransferStats, OffloadSender, RotationStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5)
_LABELS = ["model_name", "worker"]

# name, help, value from a load report
_LOAD_GAUGES: tuple[tuple[str, str, Callable[[LoadReport], float]], ...] = (
    ("sglang:num_running_reqs", "Running requests (worker report)", lambda r: r.num_running),
    ("sglang:num_queue_reqs", "Waiting requests (worker report)", lambda r: r.num_waiting),
    ("sglang_ext:kv_used_tokens", "KV tokens in use, prefix cache included", lambda r: r.kv_used_tokens),
    ("sglang_ext:kv_cached_tokens", "KV tokens held by the prefix cache", lambda r: r.kv_cached_tokens),
    ("sglang_ext:kv_total_tokens", "KV capacity in tokens", lambda r: r.kv_total_tokens),
    ("sglang:token_usage", "Fraction of KV capacity in use",
     lambda r: r.kv_used_tokens / r.kv_total_tokens if r.kv_total_tokens else 0.0),
    ("sglang_ext:step_time_ms", "Last forward step time", lambda r: r.step_time_ms),
)


class WorkerGauges(Collector):
    """Per-worker gauges computed at scrape time from the router's registry."""

    def __init__(self, workers: Callable[[], Iterable[WorkerState]]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        workers = list(self.workers())
        for name, doc, value in _LOAD_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=_LABELS)
            for w in workers:
                if w.load is not None:
                    g.add_metric([w.model, w.worker_id], value(w.load))
            yield g
        inflight = GaugeMetricFamily("sglang_ext:router_inflight_reqs", "Requests the router waits on", labels=_LABELS)
        up = GaugeMetricFamily("sglang_ext:worker_up", "1 while the worker sends heartbeats", labels=_LABELS)
        restarts = CounterMetricFamily("sglang_ext:worker_restarts", "Restarts of a worker the launcher started",
                                       labels=_LABELS)
        for w in workers:
            labels = [w.model, w.worker_id]
            inflight.add_metric(labels, len(w.inflight))
            up.add_metric(labels, 1.0 if w.up else 0.0)
            if w.supervision is not None:
                restarts.add_metric(labels, w.supervision.restarts)
        yield from (inflight, up, restarts)


_NO_OFFLOAD, _NO_ROTATION, _NO_TRANSFERS = OffloadSender(), RotationStats(), KVTransferStats()
# The cumulative figures of a report (a worker's totals over its process's life), by the name the
# counters' totals are kept under; an absent part reads as zeros.
_COUNTERS: dict[str, Callable[[LoadReport], float]] = {
    "offload_bytes_out": lambda r: (r.offload or _NO_OFFLOAD).bytes_out,
    "offload_bytes_in": lambda r: (r.offload or _NO_OFFLOAD).bytes_in,
    "offload_wait_s": lambda r: (r.offload or _NO_OFFLOAD).wait_s,
    "kv_rotations_out": lambda r: (r.rotation or _NO_ROTATION).rotations_out,
    "kv_rotations_in": lambda r: (r.rotation or _NO_ROTATION).rotations_in,
    "kv_rotation_bytes_out": lambda r: (r.rotation or _NO_ROTATION).bytes_out,
    "kv_rotation_bytes_in": lambda r: (r.rotation or _NO_ROTATION).bytes_in,
    "kv_rotation_unhidden_iterations": lambda r: (r.rotation or _NO_ROTATION).unhidden_iterations,
    "num_preemptions": lambda r: r.num_preemptions,
    "kv_transfers_out": lambda r: (r.disagg or _NO_TRANSFERS).transfers_out,
    "kv_transfers_in": lambda r: (r.disagg or _NO_TRANSFERS).transfers_in,
    "kv_transfer_bytes_out": lambda r: (r.disagg or _NO_TRANSFERS).bytes_out,
    "kv_transfer_bytes_in": lambda r: (r.disagg or _NO_TRANSFERS).bytes_in,
}
_DISAGG_FIELDS = ("kv_transfers_out", "kv_transfers_in", "kv_transfer_bytes_out", "kv_transfer_bytes_in")


class OffloadTotals:
    """Per worker and field: what earlier processes of the worker reported, plus the latest figure."""

    def __init__(self) -> None:
        self._acc: dict[tuple[str, str], list[float]] = {}  # (worker, field) -> [earlier processes, latest]

    def observe(self, worker: str, report: LoadReport) -> None:
        for f, figure in _COUNTERS.items():
            acc = self._acc.setdefault((worker, f), [0.0, 0.0])
            value = float(figure(report))
            if value < acc[1]:  # a new process we did not see say hello
                acc[0] += acc[1]
            acc[1] = value

    def restarted(self, worker: str) -> None:
        for f in _COUNTERS:
            acc = self._acc.get((worker, f))
            if acc is not None:
                acc[0], acc[1] = acc[0] + acc[1], 0.0

    def total(self, worker: str, field: str) -> float:
        acc = self._acc.get((worker, field))
        return acc[0] + acc[1] if acc else 0.0


class OffloadMetrics(Collector):
    """Remote attention, at scrape time: senders' offloaded requests, bytes and waiting time, and
    the KV that hosting workers hold for each guest model."""

    def __init__(self, workers: Callable[[], Iterable[WorkerState]], totals: OffloadTotals) -> None:
        self.workers = workers
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        reqs = GaugeMetricFamily("sglang_ext:offloaded_reqs", "Requests whose attention and KV are on an executor",
                                 labels=_LABELS)
        nbytes = CounterMetricFamily("sglang_ext:offload_bytes", "Bytes sent to (out) and received from (in) "
                                     "executors: KV, q/k/v, outputs", labels=[*_LABELS, "direction"])
        wait = CounterMetricFamily("sglang_ext:offload_wait_seconds", "Time the sender spent waiting on executors",
                                   labels=_LABELS)
        used = GaugeMetricFamily("sglang_ext:executor_kv_used_tokens", "KV tokens an executor holds for a guest model",
                                 labels=["worker", "guest_model"])
        for w in self.workers():
            if w.load is None:
                continue
            labels = [w.model, w.worker_id]
            reqs.add_metric(labels, (w.load.offload or _NO_OFFLOAD).reqs)
            nbytes.add_metric([*labels, "out"], self.totals.total(w.worker_id, "offload_bytes_out"))
            nbytes.add_metric([*labels, "in"], self.totals.total(w.worker_id, "offload_bytes_in"))
            wait.add_metric(labels, self.totals.total(w.worker_id, "offload_wait_s"))
            for guest, tokens in sorted(w.load.executor.used_tokens.items() if w.load.executor else ()):
                used.add_metric([w.worker_id, guest], tokens)
        yield from (reqs, nbytes, wait, used)


class RotationMetrics(Collector):
    """KV rotation to host memory, at scrape time, from load reports (counters kept monotonic
    across worker restarts by the same totals as the offload counters)."""

    def __init__(self, workers: Callable[[], Iterable[WorkerState]], totals: OffloadTotals) -> None:
        self.workers = workers
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        d = [*_LABELS, "direction"]
        rotations = CounterMetricFamily("sglang_ext:kv_rotations", "Requests whose KV went to host memory (out) "
                                        "and came back (in)", labels=d)
        nbytes = CounterMetricFamily("sglang_ext:kv_rotation_bytes", "KV bytes copied to (out) and from (in) "
                                     "host memory, eager copies included", labels=d)
        unhidden = CounterMetricFamily("sglang_ext:kv_rotation_unhidden_iterations", "Scheduling iterations that "
                                       "waited for a rotation copy", labels=_LABELS)
        rotary = GaugeMetricFamily("sglang_ext:rotary_reqs", "Requests whose KV is in host memory", labels=_LABELS)
        # beside rotation: what a full pool costs without it (and with it, when the host pool is full too)
        preempted = CounterMetricFamily("sglang_ext:num_preemptions", "Requests the scheduler preempted for room: "
                                        "their KV freed, to be recomputed (a rotation to host memory is not one)",
                                        labels=_LABELS)
        used = GaugeMetricFamily("sglang_ext:kv_host_used_bytes", "Host KV pool bytes in use", labels=_LABELS)
        total = GaugeMetricFamily("sglang_ext:kv_host_total_bytes", "Host KV pool size", labels=_LABELS)
        for w in self.workers():
            if w.load is None:
                continue
            labels = [w.model, w.worker_id]
            t = self.totals.total
            for direction in ("out", "in"):
                rotations.add_metric([*labels, direction], t(w.worker_id, f"kv_rotations_{direction}"))
                nbytes.add_metric([*labels, direction], t(w.worker_id, f"kv_rotation_bytes_{direction}"))
            unhidden.add_metric(labels, t(w.worker_id, "kv_rotation_unhidden_iterations"))
            preempted.add_metric(labels, t(w.worker_id, "num_preemptions"))
            r = w.load.rotation or _NO_ROTATION
            rotary.add_metric(labels, r.rotary_reqs)
            used.add_metric(labels, r.host_used_bytes)
            total.add_metric(labels, r.host_total_bytes)
        yield from (rotations, nbytes, unhidden, preempted, rotary, used, total)


class DisaggMetrics(Collector):
    """Prefill/decode disaggregation: requests' KV sent by prefill workers (out) and received by decode
    workers (in), from load reports (kept monotonic across restarts like the offload counters)."""

    def __init__(self, workers: Callable[[], Iterable[WorkerState]], totals: OffloadTotals) -> None:
        self.workers = workers
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        n = CounterMetricFamily("sglang_ext:kv_transfers", "Requests' prompt KV sent to (out) or received from (in) "
                                "the other side of a prefill/decode pair", labels=[*_LABELS, "direction"])
        nbytes = CounterMetricFamily("sglang_ext:kv_transfer_bytes", "Bytes of those transfers",
                                     labels=[*_LABELS, "direction"])
        for w in self.workers():
            if not any(self.totals.total(w.worker_id, f) for f in _DISAGG_FIELDS):
                continue  # no series for workers that never moved KV (every worker outside disaggregation)
            labels = [w.model, w.worker_id]
            for d in ("out", "in"):
                n.add_metric([*labels, d], self.totals.total(w.worker_id, f"kv_transfers_{d}"))
                nbytes.add_metric([*labels, d], self.totals.total(w.worker_id, f"kv_transfer_bytes_{d}"))
        yield from (n, nbytes)


class SloAttainment(Collector):
    def __init__(self, counts: dict[tuple[str, str], list[int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("sglang_ext:slo_attainment", "Share of finished requests that met the model's SLO "
                              "(kind: ttft, tpot)", labels=["model_name", "kind"])
        for (model, kind), (met, checked) in sorted(self.counts.items()):
            g.add_metric([model, kind], met / checked)
        yield g


class RouterMetrics:
    def __init__(self, workers: Callable[[], Iterable[WorkerState]] = tuple) -> None:
        r = self.registry = CollectorRegistry()
        m = ["model_name"]
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Gap between streamed token chunks", m,
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("sglang:time_per_output_token_seconds", "(e2e - ttft) / (output tokens - 1)", m,
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("sglang:num_requests", "Requests answered, by outcome: ok, abort, or the HTTP "
                                "status of a failure or refusal", [*m, "status"], registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.gen_tokens = Counter("sglang:generation_tokens", "Generated tokens", m, registry=r)
        self.slo_miss = Counter("sglang_ext:slo_miss", "Requests that missed an SLO", [*m, "kind"], registry=r)
        # Attainment over finished requests: ttft = first token within the TTFT SLO, tpot = the
        # request's mean time per output token within the TPOT SLO.
        self.slo_checked = Counter("sglang_ext:slo_checked", "Finished requests checked against an SLO",
                                   [*m, "kind"], registry=r)
        self.slo_met = Counter("sglang_ext:slo_met", "Finished requests that met an SLO", [*m, "kind"], registry=r)
        self._slo: dict[tuple[str, str], list[int]] = {}  # (model, kind) -> [met, checked]
        r.register(SloAttainment(self._slo))
        r.register(WorkerGauges(workers))
        self.offload = OffloadTotals()
        r.register(OffloadMetrics(workers, self.offload))
        r.register(RotationMetrics(workers, self.offload))
        r.register(DisaggMetrics(workers, self.offload))
        self.disagg = Counter("sglang_ext:disagg_requests", "Disaggregated requests by event: placed (on a prefill "
                              "and a decode worker), handed (first token out, the rest on the decode worker), "
                              "retried (a failure before the first token), resumed (its KV never came: the "
                              "decode worker recomputed the prompt), on_executor (Adrenaline placement: its KV "
                              "stays on the prefill worker's executor)", [*m, "event"], registry=r)

    def count_answer(self, model: str, status: str) -> None:
        """A request the core never saw, answered by the HTTP edge (router/api/answers.py)."""
        self.requests.labels(model, status).inc()

    def slo_result(self, model: str, kind: str, met: bool) -> None:
        self.slo_checked.labels(model, kind).inc()
        if met:
            self.slo_met.labels(model, kind).inc()
        acc = self._slo.setdefault((model, kind), [0, 0])
        acc[0] += met
        acc[1] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
