"""`ModelRouting`: the router core's Balancer, with one policy per model (its own prefix index, its own
round-robin turn), built on the model's first request from its settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.registry import Balancer
from router.routing.policies import CacheAware, PrefixAffinity, RoundRobin, ShortestQueue
from router.routing.settings import RoutingSettings
from router.tracker import WorkerState


def make_policy(s: RoutingSettings) -> Balancer:
    if s.policy == "cache_aware":
        return CacheAware(s)
    if s.policy == "shortest_queue":
        return ShortestQueue()
    if s.policy == "round_robin":
        return RoundRobin()
    if s.policy == "prefix_affinity":
        return PrefixAffinity()
    raise ValueError(f"unknown routing policy {s.policy!r}")


class ModelRouting(Balancer):
    """`default` for every model but those in `per_model` (model name -> its settings)."""

    def __init__(self, default: RoutingSettings, per_model: Mapping[str, RoutingSettings] | None = None) -> None:
        self.default = default
        self.per_model = dict(per_model or {})
        self.policies: dict[str, Balancer] = {}

    def settings(self, model: str) -> RoutingSettings:
        return self.per_model.get(model, self.default)

    def policy(self, model: str) -> Balancer:
        p = self.policies.get(model)
        if p is None:
            p = self.policies[model] = make_policy(self.settings(model))
        return p

    def pick(self, candidates: list[WorkerState], prefix_key: str | None = None) -> WorkerState:
        # The core asks for one model's replicas at a time.
        return self.policy(candidates[0].model).pick(candidates, prefix_key)

    def describe(self) -> dict[str, Any]:
        """Per model: its policy, and cache_aware's decisions so far."""
        out: dict[str, Any] = {}
        for model in sorted(set(self.per_model) | set(self.policies)):
            d: dict[str, Any] = {"policy": self.settings(model).policy}
            p = self.policies.get(model)
            if isinstance(p, CacheAware):
                dec = p.decisions
                d["decisions"] = {"prefix": dec.prefix, "balance": dec.balance, "cold": dec.cold}
                d["indexed_chars"] = {w: p.index.chars(w) for w in sorted(dec.by_worker)}
            out[model] = d
        return out
