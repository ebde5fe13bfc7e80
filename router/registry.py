"""Which workers exist, which model each serves, whether it is up, and what it is carrying.

A worker is known by its ZeroMQ identity (its worker id). It is *up* from its hello until it stays
silent for the heartbeat timeout; a later hello (a restart) or load report (it was only slow) takes
it back. Requests are placed by a `Balancer` among the up workers of one model. A worker's own state
(`WorkerState`) is in router/tracker.py, beside its requests'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

from router.tracker import WorkerState
from sglang_ext.messages import WorkerInfo


@dataclass
class ModelEntry:
    name: str
    workers: dict[str, WorkerState] = field(default_factory=dict)
    declared: bool = False  # named by the configuration (not only by a worker that joined): /readiness waits for it

    @property
    def up_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.up]

    @property
    def info(self) -> WorkerInfo | None:
        """Facts shared by the replicas (model path, context length), from any registered one."""
        for w in sorted(self.workers.values(), key=lambda w: not w.up):
            if w.info is not None:
                return w.info
        return None


class Balancer(ABC):
    @abstractmethod
    def pick(self, candidates: list[WorkerState], prefix_key: str | None = None) -> WorkerState:
        """Choose one of `candidates` (non-empty, all up) for a new request; `prefix_key` names the
        start of its prompt (requests with equal keys likely share a cached prefix)."""


class LeastOutstandingTokens(Balancer):
    """Fewest tokens still to compute; ties go to fewer requests, then the emptier KV cache, then
    the one that was given fewer requests so far (idle replicas take turns)."""

    def pick(self, candidates: list[WorkerState], prefix_key: str | None = None) -> WorkerState:
        def key(w: WorkerState) -> tuple[int, int, int, int]:
            kv = w.load.kv_used_tokens - w.load.kv_cached_tokens if w.load else 0
            return (w.outstanding_tokens, len(w.inflight), kv, w.num_served)

        return min(candidates, key=key)


class PrefixAware(Balancer):
    """Least outstanding tokens, except that a prompt whose start was routed recently goes back to
    the same worker (its prefix cache likely holds it) while that worker is within `slack_tokens`
    of the least loaded one. Frontend programs (fork, select, multi-turn) send such prompts."""

    def __init__(self, slack_tokens: int = 1024, capacity: int = 4096) -> None:
        self.base = LeastOutstandingTokens()
        self.slack = slack_tokens
        self.capacity = capacity
        self.recent: OrderedDict[str, str] = OrderedDict()  # prefix key -> worker id, LRU order

    def pick(self, candidates: list[WorkerState], prefix_key: str | None = None) -> WorkerState:
        best = self.base.pick(candidates)
        if prefix_key is None:
            return best
        chosen = best
        wid = self.recent.get(prefix_key)
        for w in candidates:
            if w.worker_id == wid and w.outstanding_tokens <= best.outstanding_tokens + self.slack:
                chosen = w
        self.recent[prefix_key] = chosen.worker_id
        self.recent.move_to_end(prefix_key)
        if len(self.recent) > self.capacity:
            self.recent.popitem(last=False)
        return chosen


class Registry:
    def __init__(self) -> None:
        self.models: dict[str, ModelEntry] = {}
        self.workers: dict[str, WorkerState] = {}
        self._order: list[str] = []  # model names in the order first seen: the first is the default

    def expect(self, worker_id: str, model: str, role: str = "serve") -> WorkerState:
        """Declare a worker the launcher started (down until its hello), so its model is known early."""
        w = self.workers.get(worker_id)
        if w is None:
            w = WorkerState(worker_id, model, role)
            self.workers[worker_id] = w
        self._entry(model).workers[worker_id] = w
        return w

    def declare(self, model: str) -> ModelEntry:
        """Make a model known before any worker of it registers (503 until one does, not 404)."""
        entry = self._entry(model)
        entry.declared = True
        return entry

    def _entry(self, model: str) -> ModelEntry:
        if model not in self.models:
            self.models[model] = ModelEntry(model)
            self._order.append(model)
        return self.models[model]

    def register(self, info: WorkerInfo) -> tuple[WorkerState, bool]:
        """Mark a worker up from its hello; returns it and whether it was known before."""
        w = self.workers.get(info.worker_id)
        known = w is not None and w.info is not None
        if w is None:
            w = WorkerState(info.worker_id, info.model_name)
            self.workers[info.worker_id] = w
        if w.model != info.model_name:  # a worker id reused for another model
            self.models[w.model].workers.pop(w.worker_id, None)
            w.model = info.model_name
        self._entry(w.model).workers[w.worker_id] = w
        w.info = info
        if info.disaggregation_mode:  # a worker that joined by itself says its role in its hello
            w.role = info.disaggregation_mode
        elif w.role in ("prefill", "decode"):  # restarted without the mode: it serves whole requests
            w.role = "serve"
        w.up = True
        w.load = None
        w.touch()
        return w, known

    @property
    def default_model(self) -> str | None:
        return self._order[0] if self._order else None

    def resolve(self, name: str | None) -> ModelEntry | None:
        """A model by served name or by model path; None/"" means the default model."""
        if not name:
            return self.models.get(self.default_model or "")
        if name in self.models:
            return self.models[name]
        for m in self.models.values():
            if m.info is not None and m.info.model_path == name:
                return m
        return None
