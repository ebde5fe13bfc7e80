"""What of the configured cluster is not up: the answer behind GET /health and GET /readiness.

`/health` answers "does anything serve?" (200 while a worker is up); `/readiness` answers "does all of it
serve?" (200 only when everything configured is up), for orchestrators that must not send traffic to,
or count as rolled out, a launcher whose workers or pairings are still starting or gone.

Configured means what this launcher was told to run:

    workers    the launcher's own (the cluster file's, supervised here): each must be up
    models     each model the configuration names: at least one worker up, wherever it runs (a model
               served only by workers that join by themselves, `replicas: 0`, is ready once one has)
    pairings   each link a placement strategy keeps among the configured workers (PlacementStrategy.
               expected_links: each KV pair between a model's prefill and decode workers, each offload
               pairing of a sender of the cluster file's `offload:`): each must be active

A worker that joined by itself counts only toward its model: one that leaves for good (scaled in) must
not keep the launcher unready forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.core import Router
from router.tracker import WorkerState


@dataclass
class NotUp:
    """What is configured, and what of it is not up (each entry names it and gives its state in words)."""

    workers: list[dict[str, Any]] = field(default_factory=list)
    models: list[dict[str, Any]] = field(default_factory=list)
    pairings: list[dict[str, Any]] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)  # how many of each kind are configured

    @property
    def ready(self) -> bool:
        return not (self.workers or self.models or self.pairings)

    def summary(self) -> str:
        """One line: `not ready: worker m-1 restarting (...); KV pair m-0 -> m-1 down`."""
        parts = [f"worker {w['worker_id']} {w['state']}" for w in self.workers]
        parts += [f"model {m['model']}: {m['state']}" for m in self.models]
        for p in self.pairings:
            if p["kind"] == "disaggregation":
                parts.append(f"KV pair {p['prefill']} -> {p['decode']} {p['state']}")
            else:
                parts.append(f"offload pairing of {p['from']} {p['state']}")
        return "; ".join(parts)


def configured_workers(router: Router) -> list[WorkerState]:
    """The launcher's own workers (supervised here), in configuration order."""
    return [w for w in router.registry.workers.values() if w.supervision is not None]


def workers_not_up(router: Router) -> list[dict[str, Any]]:
    return [{"worker_id": w.worker_id, "model": w.model, "role": w.role, "state": w.describe()}
            for w in configured_workers(router) if not w.up]


def not_up(router: Router) -> NotUp:
    own = configured_workers(router)
    out = NotUp(workers=workers_not_up(router))
    models = [m for m in router.registry.models.values()
              if m.declared or any(w.supervision is not None for w in m.workers.values())]
    out.models = [{"model": m.name, "state": "no worker is up" if m.workers else "no worker has joined"}
                  for m in models if not m.up_workers]
    # each strategy's links among them (PD: KV pairs; offload: pairings), grouped by kind
    links = sorted((link for s in router.strategies for link in s.expected_links(own)), key=lambda x: str(x["kind"]))
    out.pairings = [p for p in links if p["state"] != "active"]
    out.checked = {"workers": len(own), "models": len(models), "pairings": len(links)}
    return out
