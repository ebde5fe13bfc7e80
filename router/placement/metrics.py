"""Every planning decision as Prometheus series, at scrape time, per live pairing."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.placement.pairing import Pairing

_LABELS = ["model_name", "worker", "executor", "policy"]


class PlanningMetrics(Collector):
    def __init__(self, pairings: Mapping[str, Pairing]) -> None:
        self.pairings = pairings

    def collect(self) -> Iterator[Metric]:
        ratio = GaugeMetricFamily("sglang_ext:offload_ratio", "Share of the sender's decoding requests its policy "
                                  "lets go to the executor now", labels=_LABELS)
        bound = GaugeMetricFamily("sglang_ext:offload_bound", "The policy's upper bound on that share (fixed: the "
                                  "ratio; adrenaline: OB / (1 + OB); adaptive: max_ratio)", labels=_LABELS)
        updates = CounterMetricFamily("sglang_ext:offload_ratio_updates", "Live ratio updates sent to the sender",
                                      labels=_LABELS)
        for p in list(self.pairings.values()):
            if p.state != "active" or p.decision is None:
                continue
            labels = [p.rule.from_, p.sender, p.executor, p.rule.policy]
            ratio.add_metric(labels, p.decision.ratio)
            bound.add_metric(labels, p.decision.bound)
            updates.add_metric(labels, p.updates)
        yield from (ratio, bound, updates)
