"""One admission limit: at most `max_concurrent` requests in flight and/or `rate_rps` new requests a
second, with a bounded FIFO queue of requests waiting for room.

A request is admitted at once when nobody waits and there is room; otherwise it joins the queue if
the queue has a free place, and waits until there is room for it (first come, first served) or its
deadline passes. Over the limit with the queue full, or past the deadline, it is refused
(`Overloaded`, which the HTTP layer answers 429 with Retry-After).

Retry-After says when trying again is worth it: for a rate limit, when the bucket will hold a token
for this request behind those already waiting (exact); for a concurrency limit, an estimate from what
holds the places: each holder is expected to hold its place as long as places were recently held (an
exponentially weighted mean), so it releases it that long after it took it, less what it has held
already; the request would get the place released k-th, k being the requests ahead of it plus one
(a place released twice counts a new holder's whole mean hold the second time). A guess, but one that
follows the holders: a batch that took every place together, 0.4 s into a 3 s hold, says 2.6 s, where
the mean over the places would say 0.4 s.

The token bucket and the estimates read an injected clock; the waiting itself uses the event loop.
Single-threaded: everything runs in the router's asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final

_EWMA: Final = 0.2  # weight of the newest hold time in the mean
_FIRST_HOLD_S: Final = 1.0  # the expected hold before any place was given back
_POLL_S: Final = 0.5  # how often a waiter checks that its client is still there


class Overloaded(Exception):
    """Refused: `limit` ("router", "model" or "key") named `name` is full (`reason`: "queue_full" or
    "timeout"); try again in `retry_after` seconds."""

    def __init__(self, limit: str, name: str, reason: str, retry_after: float, detail: str) -> None:
        super().__init__(detail)
        self.limit, self.name, self.reason, self.retry_after = limit, name, reason, retry_after


class TokenBucket:
    """`rate` tokens a second, holding `capacity` at most; starts full."""

    def __init__(self, rate: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.capacity = float(capacity)
        self.clock = clock
        self.tokens = float(capacity)
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
        self._at = now

    def ready(self) -> bool:
        self._refill()
        return self.tokens >= 1.0

    def take(self) -> None:
        self._refill()
        self.tokens -= 1.0

    def wait_for(self, n: int = 1) -> float:
        """Seconds until the bucket holds `n` tokens (0: it does)."""
        self._refill()
        return max(0.0, (n - self.tokens) / self.rate)


class Permit:
    """A place under one limit; `release()` gives it back (idempotent)."""

    __slots__ = ("_at", "_limiter")

    def __init__(self, limiter: Limiter) -> None:
        self._limiter: Limiter | None = limiter
        self._at = limiter.clock()
        limiter.holders.add(self)

    def release(self) -> None:
        lim, self._limiter = self._limiter, None
        if lim is not None:
            lim.holders.discard(self)
            lim._release(lim.clock() - self._at)


class Limiter:
    def __init__(self, limit: str, name: str, max_concurrent: int | None = None, rate_rps: float | None = None,
                 burst: int = 1, queue_size: int = 0, queue_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.name = limit, name
        self.max_concurrent = max_concurrent
        self.bucket = TokenBucket(rate_rps, burst, clock) if rate_rps is not None else None
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.clock = clock
        self.active = 0  # places held
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.hold_s: float | None = None  # mean time a place is held (EWMA), for Retry-After
        self.holders: set[Permit] = set()  # the places held now (when each was taken: Retry-After)
        self.admitted = 0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def label(self) -> str:
        """What a refusal calls this limit: `the limit of key 'batch'`, `the router-wide limit`."""
        return "the router-wide limit" if self.limit == "router" else f"the limit of {self.limit} {self.name!r}"

    def _room(self) -> bool:
        if self.max_concurrent is not None and self.active >= self.max_concurrent:
            return False
        return self.bucket is None or self.bucket.ready()

    def _charge(self) -> None:
        """Count a place as taken (its Permit is made by whoever takes it)."""
        self.active += 1
        self.admitted += 1
        if self.bucket is not None:
            self.bucket.take()

    def try_acquire(self) -> Permit | None:
        """A place now, without waiting, or None (someone waits already, or there is no room)."""
        if not self.waiters and self._room():
            self._charge()
            return Permit(self)
        return None

    async def acquire(self, deadline: float, gone: Callable[[], Awaitable[bool]] | None = None) -> Permit:
        """A place, waiting in the queue until `deadline` (on `clock`) at most. `gone()` is polled
        while waiting: a client that left gives its place in the queue up (raises ConnectionAbortedError)."""
        permit = self.try_acquire()
        if permit is not None:
            return permit
        if len(self.waiters) >= self.queue_size:
            raise self._refused("queue_full", f"{len(self.waiters)} requests wait already (queue_size "
                                              f"{self.queue_size})" if self.queue_size else "no queue (queue_size 0)")
        t0 = self.clock()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self._wake()
        try:
            while not fut.done():
                left = deadline - self.clock()
                if left <= 0:
                    break
                await asyncio.wait({fut}, timeout=min(left, _POLL_S) if gone is not None else left)
                if not fut.done() and gone is not None and await gone():
                    raise ConnectionAbortedError()
        except BaseException:  # cancelled (the client left), or gone
            self._leave(fut)
            raise
        if fut.done():
            return Permit(self)  # _wake took the place for us
        self._leave(fut)
        raise self._refused("timeout", f"it waited {round(self.clock() - t0, 1):g} s (queue_timeout_s) for room")

    def _leave(self, fut: asyncio.Future[None]) -> None:
        """A waiter leaves: out of the queue, or -- if it was given a place meanwhile -- the place back."""
        if fut.done() and not fut.cancelled():
            self.active -= 1
            self._wake()
            return
        fut.cancel()
        with contextlib.suppress(ValueError):  # (already taken off by _wake: it skips done futures)
            self.waiters.remove(fut)
        self._wake()  # the head may be free to go now (a rate limit's timer was set for the old head)

    def _release(self, held_s: float) -> None:
        self.active -= 1
        self.hold_s = held_s if self.hold_s is None else (1 - _EWMA) * self.hold_s + _EWMA * held_s
        self._wake()

    def _wake(self) -> None:
        """Give places to the waiters at the head while there is room; under a rate limit, come back
        when the next token is due."""
        while self.waiters and self._room():
            fut = self.waiters.popleft()
            if fut.done():
                continue
            self._charge()  # the waiter's: it makes its Permit when it wakes (or gives the place back)
            fut.set_result(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.waiters and self.bucket is not None and (self.max_concurrent is None
                                                         or self.active < self.max_concurrent):
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.bucket.wait_for(), self._wake)

    def retry_after(self) -> float:
        """Seconds after which a new request would likely find room."""
        ahead = len(self.waiters) + 1
        waits = [0.0]
        if self.bucket is not None:
            waits.append(self.bucket.wait_for(ahead))
        if self.max_concurrent is not None and self.active >= self.max_concurrent:
            waits.append(self._place_free_in(ahead, self.max_concurrent))
        return max(waits)

    def _place_free_in(self, ahead: int, places: int) -> float:
        """Seconds until the `ahead`-th place from now is released (all `places` are held)."""
        now = self.clock()
        held = [now - p._at for p in self.holders]
        held += [0.0] * max(0, self.active - len(held))  # given to a waiter that has not woken yet
        if self.hold_s is not None:
            hold = self.hold_s
            left = sorted(max(0.0, hold - h) for h in held)
        else:
            # Before any place came back there is no mean: a first guess, and a holder that ran past
            # it is taken to hold its place as long again (the longer a request has run, the longer
            # it is likely to run on).
            left = sorted(max(_FIRST_HOLD_S - h, h) for h in held)
            hold = max(_FIRST_HOLD_S, left[-1])
        k = ahead - 1 + max(0, self.active - places)  # the releases before the one that frees our place
        turns, i = divmod(k, len(left))
        return left[i] + turns * hold

    def _refused(self, reason: str, why: str) -> Overloaded:
        what = []
        if self.max_concurrent is not None:
            what.append(f"{self.max_concurrent} request{'s' if self.max_concurrent != 1 else ''} at once")
        if self.bucket is not None:
            what.append(f"{self.bucket.rate:g} requests/s")
        retry = self.retry_after()
        return Overloaded(self.limit, self.name, reason, retry,
                          f"{self.label} ({' and '.join(what)}) is reached and {why}; "
                          f"try again in {max(1, math.ceil(retry))} s")
