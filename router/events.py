"""The router's event bus: what happened, published as it happens, for planners to react to.

Placement strategies (router/placement/) are called back from here (`on`) instead of polling; other
listeners subscribe: each subscriber gets its own bounded queue, so a slow one loses its oldest events
(counted in `dropped`) and never slows the request path. Publishing is synchronous and
O(subscribers); it never awaits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sglang_ext.messages import LoadReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    ts: float = field(default_factory=time.monotonic, kw_only=True)


@dataclass(frozen=True)
class RequestArrived(Event):
    rid: str
    model: str
    worker_id: str
    est_prompt_tokens: int
    max_new_tokens: int


@dataclass(frozen=True)
class FirstToken(Event):
    rid: str
    model: str
    worker_id: str
    ttft_s: float
    prompt_tokens: int


@dataclass(frozen=True)
class RequestFinished(Event):
    rid: str
    model: str
    worker_id: str
    ok: bool
    prompt_tokens: int
    completion_tokens: int
    e2e_s: float
    finish_reason: dict[str, Any] | None


@dataclass(frozen=True)
class LoadReported(Event):
    model: str
    worker_id: str
    report: LoadReport


@dataclass(frozen=True)
class SloMissed(Event):
    rid: str
    model: str
    worker_id: str
    kind: str  # "ttft" | "tbt" (one token gap over the TPOT SLO) | "tpot" (a finished request's mean)
    value_s: float
    slo_s: float


@dataclass(frozen=True)
class WorkerUp(Event):
    model: str
    worker_id: str
    role: str
    rejoined: bool
    fresh: bool = True  # a hello: a new process (or one that met a new router), holding no state of ours


@dataclass(frozen=True)
class WorkerDown(Event):
    model: str
    worker_id: str
    reason: str


@dataclass(frozen=True)
class ExecutorMemoryLow(Event):
    """A pairing's free executor KV fell under its entry's `executor_low_mem` share (published by
    the offload planner on the host's load report, once per fall)."""

    model: str  # the host's model
    worker_id: str  # the host
    sender: str
    pairing: str
    free_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class OffloadDecided(Event):
    """An offload policy's new decision for a pairing, as sent to the sender."""

    sender: str
    executor: str
    pairing: str
    policy: str
    ratio: float
    bound: float
    why: str


class Subscription:
    """An async iterator over the events of chosen types; `close()` (or `async with`) detaches it."""

    def __init__(self, bus: EventBus, types: tuple[type[Event], ...], maxsize: int) -> None:
        self._bus = bus
        self.types = types
        self.queue: asyncio.Queue[Event] = asyncio.Queue(maxsize)
        self.dropped = 0

    def _offer(self, ev: Event) -> None:
        if self.types and not isinstance(ev, self.types):
            return
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(ev)

    async def get(self) -> Event:
        return await self.queue.get()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        return await self.queue.get()

    def close(self) -> None:
        self._bus._subs.discard(self)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class EventBus:
    def __init__(self) -> None:
        self._subs: set[Subscription] = set()
        self._callbacks: list[tuple[tuple[type[Event], ...], Callable[[Event], None]]] = []

    def subscribe(self, *types: type[Event], maxsize: int = 10_000) -> Subscription:
        """Queue-based subscription; no types means every event."""
        sub = Subscription(self, types, maxsize)
        self._subs.add(sub)
        return sub

    def on(self, callback: Callable[[Event], None], *types: type[Event]) -> Callable[[], None]:
        """Synchronous callback, run inside `publish` (keep it short); returns an unsubscribe function."""
        entry = (types, callback)
        self._callbacks.append(entry)
        return lambda: self._callbacks.remove(entry) if entry in self._callbacks else None

    def publish(self, ev: Event) -> None:
        for sub in list(self._subs):
            sub._offer(ev)
        for types, cb in list(self._callbacks):
            if not types or isinstance(ev, types):
                try:
                    cb(ev)
                except Exception:  # a planner's bug must not break the request path
                    logger.exception("event callback failed on %s", type(ev).__name__)
