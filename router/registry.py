"""Which workers exist, which model each serves, whether it is up, and what it is carrying.

A worker is known by its ZeroMQ identity (its worker id). It is *up* from its hello until it stays
silent for the heartbeat timeout; a later hello (a restart) or load report (it was only slow) takes
it back. Requests are placed by a `Balancer` among the up workers of one model.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglang_ext.messages import LoadReport, WorkerInfo

if TYPE_CHECKING:
    from router.tracker import RequestState


@dataclass(eq=False)
class WorkerState:
    worker_id: str
    model: str
    role: str = "serve"
    info: WorkerInfo | None = None
    up: bool = False
    last_seen: float = 0.0
    load: LoadReport | None = None
    inflight: dict[str, RequestState] = field(default_factory=dict)
    outstanding_tokens: int = 0  # prompt tokens not yet prefilled + output tokens not yet generated

    def touch(self) -> None:
        self.last_seen = time.monotonic()


@dataclass
class ModelEntry:
    name: str
    workers: dict[str, WorkerState] = field(default_factory=dict)

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
    def pick(self, candidates: list[WorkerState]) -> WorkerState:
        """Choose one of `candidates` (non-empty, all up) for a new request."""


class LeastOutstandingTokens(Balancer):
    """Fewest tokens still to compute; ties go to fewer requests, then the emptier KV cache."""

    def pick(self, candidates: list[WorkerState]) -> WorkerState:
        def key(w: WorkerState) -> tuple[int, int, int]:
            kv = w.load.kv_used_tokens - w.load.kv_cached_tokens if w.load else 0
            return (w.outstanding_tokens, len(w.inflight), kv)

        return min(candidates, key=key)


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
