"""A circuit breaker per worker: a worker that keeps failing requests is taken out of placement for a
cool-down, then given one trial request, and back in on its success.

    closed ── cb_failure_threshold failures in a row, or failed share >= cb_failure_rate ──> open
    open ── cb_cooldown_s later ──> half-open: one trial request at a time
    half-open ── a success ──> closed;  a failure ──> open again (a new cool-down)

A heartbeat says a worker is alive; the breaker says whether it serves. It catches what the heartbeat
cannot: a worker that is up but fails what it gets (its KV pair broken, unreachable from the router
while its heartbeats still arrive, a device error it survives). What counts:

- a failure: a request that failed on the worker for the worker's reasons (an explicit 5xx, a send that
  could not reach it); a worker lost with requests in flight (heartbeat lapse) counts once, not once
  per request, so one crash under load does not open it by itself;
- a success: a request's first output from the worker, or its normal end there;
- neither: client errors and aborts (a trial request that ends so frees the trial for another).

A new process under the worker's id (a hello) starts closed: the breaker judged the process that is
gone, and supervision already paces restarts of one that keeps crashing.

Open -> half-open is decided when asked (`state()`), from the injected clock: there is no timer, and
tests drive it with a fake clock.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

logger = logging.getLogger(__name__)


class CircuitState(IntEnum):
    """The gauge's values (as SGLang's model gateway encodes its circuit breaker state)."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(frozen=True)
class BreakerPolicy:
    failure_threshold: int = 5  # failures in a row that open it (0: the count never does)
    failure_rate: float | None = None  # or: this failed share of the outcomes over `window_s`
    window_s: float = 60.0
    min_requests: int = 20  # outcomes in the window before the rate may open it
    cooldown_s: float = 30.0

    @property
    def enabled(self) -> bool:
        return self.failure_threshold > 0 or self.failure_rate is not None


class CircuitBreaker:
    def __init__(self, worker_id: str, policy: BreakerPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self.policy = policy
        self.clock = clock
        self._state = CircuitState.CLOSED
        self.consecutive = 0  # failures in a row while closed
        self._outcomes: deque[tuple[float, bool]] = deque()  # (when, ok) within the window, for the rate
        self.open_until = 0.0
        self.probe: str | None = None  # the rid of the half-open trial in flight
        self._probe_at = 0.0
        self.opened = 0  # times it opened
        self.last_failure = ""

    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self.clock() >= self.open_until:
            self._state = CircuitState.HALF_OPEN
            self.probe = None
            logger.info("worker %s: circuit half-open; its next request is a trial", self.worker_id)
        return self._state

    def allows(self) -> bool:
        """Whether a new request may be placed on the worker now."""
        s = self.state()
        if s is CircuitState.CLOSED:
            return True
        if s is CircuitState.OPEN:
            return False
        # Half-open: one trial at a time. A trial that never reports (its outcome lost with a router
        # bug, say) must not hold the worker out for ever: after a cool-down another may go.
        return self.probe is None or self.clock() - self._probe_at >= self.policy.cooldown_s

    def retry_in(self) -> float:
        """Seconds until the worker takes requests again (0: it does now)."""
        return max(0.0, self.open_until - self.clock()) if self.state() is CircuitState.OPEN else 0.0

    def dispatched(self, rid: str) -> None:
        """Request `rid` was placed on the worker; in half-open it is the trial."""
        if self.state() is CircuitState.HALF_OPEN and self.allows():
            self.probe, self._probe_at = rid, self.clock()

    def success(self, counted: bool = True) -> None:
        """A success; `counted`: one outcome for the failure rate (a request's first output is not
        counted there, only its end: one outcome per request, as its failure would be)."""
        s = self.state()
        if s is CircuitState.OPEN:
            return  # a request from before it opened: the trial decides
        if s is CircuitState.HALF_OPEN:
            logger.info("worker %s: circuit closed (a trial request succeeded)", self.worker_id)
            self._state, self.probe = CircuitState.CLOSED, None
            self._outcomes.clear()
        self.consecutive = 0
        if counted:
            self._note(True)

    def failure(self, why: str) -> None:
        s = self.state()
        self.last_failure = why
        if s is CircuitState.OPEN:
            return  # requests that were in flight when it opened: no longer news
        if s is CircuitState.HALF_OPEN:
            self._open(f"its trial request failed: {why}")
            return
        self.consecutive += 1
        self._note(False)
        p = self.policy
        if p.failure_threshold and self.consecutive >= p.failure_threshold:
            self._open(f"{self.consecutive} failures in a row, the last: {why}")
        elif p.failure_rate is not None and len(self._outcomes) >= p.min_requests:
            failed = sum(1 for _, ok in self._outcomes if not ok)
            if failed / len(self._outcomes) >= p.failure_rate:
                self._open(f"{failed} of its last {len(self._outcomes)} requests failed within "
                           f"{p.window_s:g} s, the last: {why}")

    def ended(self, rid: str) -> None:
        """Request `rid` ended with neither verdict (aborted, a client error): a trial frees its place."""
        if self.probe == rid:
            self.probe = None

    def reset(self) -> None:
        if self._state is not CircuitState.CLOSED:
            logger.info("worker %s: circuit closed (a new process)", self.worker_id)
        self._state, self.consecutive, self.probe = CircuitState.CLOSED, 0, None
        self._outcomes.clear()

    def describe(self) -> dict[str, Any]:
        s = self.state()
        d: dict[str, Any] = {"state": s.name.lower(), "consecutive_failures": self.consecutive, "opened": self.opened}
        if s is CircuitState.OPEN:
            d["half_open_in_s"] = round(self.retry_in(), 3)
        if self.last_failure:
            d["last_failure"] = self.last_failure
        return d

    def _note(self, ok: bool) -> None:
        if self.policy.failure_rate is None:
            return
        now = self.clock()
        self._outcomes.append((now, ok))
        while self._outcomes and now - self._outcomes[0][0] > self.policy.window_s:
            self._outcomes.popleft()

    def _open(self, why: str) -> None:
        self._state = CircuitState.OPEN
        self.open_until = self.clock() + self.policy.cooldown_s
        self.probe = None
        self.opened += 1
        self.consecutive = 0
        self._outcomes.clear()
        logger.warning("worker %s: circuit open for %g s (%s); requests go to its model's other workers",
                       self.worker_id, self.policy.cooldown_s, why)


class Breakers:
    """The breakers of all workers, made on first use; with the policy disabled, every call is a no-op."""

    def __init__(self, policy: BreakerPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.by_worker: dict[str, CircuitBreaker] = {}

    def get(self, worker_id: str) -> CircuitBreaker:
        b = self.by_worker.get(worker_id)
        if b is None:
            b = self.by_worker[worker_id] = CircuitBreaker(worker_id, self.policy, self.clock)
        return b

    def allows(self, worker_id: str) -> bool:
        b = self.by_worker.get(worker_id)
        return b is None or b.allows()

    def blocked(self, worker_ids: Iterable[str]) -> set[str]:
        return {w for w in worker_ids if not self.allows(w)}

    def retry_in(self, worker_ids: Iterable[str]) -> float:
        """Seconds until the first of these workers takes requests again."""
        waits = [self.by_worker[w].retry_in() for w in worker_ids if w in self.by_worker]
        return min(waits, default=0.0)

    def dispatched(self, worker_id: str, rid: str) -> None:
        if self.policy.enabled:
            self.get(worker_id).dispatched(rid)

    def success(self, worker_id: str, counted: bool = True) -> None:
        if self.policy.enabled:
            self.get(worker_id).success(counted)

    def failure(self, worker_id: str, why: str) -> None:
        if self.policy.enabled:
            self.get(worker_id).failure(why)

    def ended(self, worker_id: str, rid: str) -> None:
        b = self.by_worker.get(worker_id)
        if b is not None:
            b.ended(rid)

    def reset(self, worker_id: str) -> None:
        b = self.by_worker.get(worker_id)
        if b is not None:
            b.reset()

    def state(self, worker_id: str) -> CircuitState:
        b = self.by_worker.get(worker_id)
        return CircuitState.CLOSED if b is None else b.state()

    def describe(self, worker_id: str) -> dict[str, Any]:
        b = self.by_worker.get(worker_id)
        if b is None:
            return {"state": "closed", "consecutive_failures": 0, "opened": 0}
        return b.describe()
