"""Compiling grammars in a bounded pool, with a size limit, a time limit and an LRU cache, so that
one client's large schemas cannot hold up another client's small constraint (issue 22: a `regex`
request waited 112 s behind four ~20 KB JSON schemas compiled one after another on one thread).

    submit(c) ─ longer than max_bytes? ──> InvalidRequest (400); nothing is queued
              ─ cached? ─────────────────> a future already done: no queue, no thread
              ─ being compiled already? ─> waits for that compilation (one compile per constraint)
              ─ queue_size of its size queued? ─> GrammarBusy (429)
              └─ queued: small ones (at most SMALL_BYTES) before large ones, each first in, first out

    threads     `workers` of them take any job, small ones first; one more takes small ones only,
                so a small constraint never waits behind large ones, however many are compiling
    supervisor  a compile running past timeout_s fails its waiters (400) and its thread is abandoned,
                replaced while at most `workers` are (so at most 2 * workers + 1 compiles ever run at
                once); a job still queued after timeout_s fails (429)

Threads, not processes: xgrammar releases the GIL for the whole of a compile (its bindings run every
compile_* call under a GIL release; measured: the interpreter's other threads kept running through a
4 s JSON-schema compile, their longest pause 48 ms), so a compiling thread costs a core, not the
interpreter, and a compiled grammar needs no pickling to come back. A compile cannot be interrupted,
so one past its time limit is abandoned rather than stopped: its thread finishes it, caches the
grammar (the same constraint sent again is then a hit) and rejoins the pool, or exits if the pool
is whole again. Replacements are bounded, so a stream of pathological constraints costs at most
`workers` extra compile threads; past that its compiles take the pool's own threads, and large
constraints fail with 429 until those end, while small ones keep their own thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, cast

from sglang_ext.sampling.params import InvalidRequest

if TYPE_CHECKING:
    from sglang_ext.grammar.backend import Constraint

logger = logging.getLogger(__name__)

G = TypeVar("G")  # what compiling gives (xgrammar's CompiledGrammar)
SMALL_BYTES: Final = 4096  # a regex or a flat schema: milliseconds to compile, on the reserved thread too


class GrammarBusy(Exception):
    """Too many constraints are waiting to compile (HTTP 429): the client may try again later."""


@dataclass(eq=False)
class _Job(Generic[G]):
    c: Constraint
    small: bool
    queued_at: float
    waiters: list[Future[G]] = field(default_factory=list)
    started_at: float = 0.0
    overdue: str | None = None  # past its time limit: its waiters (and later ones) fail with this


@dataclass(eq=False)
class _Thread:
    small_only: bool
    job: _Job[Any] | None = None  # the one it compiles
    abandoned: bool = False


# What to tell a future once the pool's lock is released: its callbacks (asyncio's among them) run
# in the thread that settles it, and must not run under the lock.
_Settle = tuple[list[Future[Any]], Any, BaseException | None]  # waiters, result, error


class CompilePool(Generic[G]):
    """Compiles constraints with `compile_fn` (called on the pool's threads); thread-safe."""

    def __init__(self, compile_fn: Callable[[Constraint], G], *, workers: int = 2, max_bytes: int = 65536,
                 timeout_s: float = 60.0, cache_size: int = 512, queue_size: int = 64) -> None:
        if workers < 1 or queue_size < 1 or not timeout_s > 0 or max_bytes < 0 or cache_size < 0:
            raise ValueError("CompilePool: workers and queue_size >= 1, timeout_s > 0, max_bytes and "
                             "cache_size >= 0")
        self._compile = compile_fn
        self.workers = workers
        self.max_bytes = max_bytes  # 0: no limit
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.queue_size = queue_size
        self._cache: OrderedDict[Constraint, G] = OrderedDict()
        self._jobs: dict[Constraint, _Job[G]] = {}  # queued or compiling, by constraint
        self._small: deque[_Job[G]] = deque()
        self._large: deque[_Job[G]] = deque()
        self._threads: list[_Thread] = []  # in the pool (abandoned ones are not)
        self._abandoned = 0
        self._cv = threading.Condition()
        # threads start with the first compile: a worker that never gets a constrained request has none
        self._started = False
        self._closed = False
        self.compiles = 0  # compilations run to their end (or error), for tests and diagnostics

    # ---- the callers' side -------------------------------------------------------------------------
    def submit(self, c: Constraint) -> Future[G]:
        """A future of `c`'s compiled grammar. Raises InvalidRequest (too long) or GrammarBusy (queue
        full) at once; the future fails with InvalidRequest (invalid, or over the time limit) or
        GrammarBusy (waited too long for a thread)."""
        size = len(c.text.encode("utf-8", "surrogatepass"))
        if self.max_bytes and size > self.max_bytes:
            raise InvalidRequest(f"sampling_params.{c.kind} is {size} bytes; this server compiles constraints of "
                                 f"at most {self.max_bytes} bytes (--grammar-max-bytes)")
        fut: Future[G] = Future()
        with self._cv:
            if self._closed:
                raise GrammarBusy("the grammar compiler is shutting down")
            if c in self._cache:
                self._cache.move_to_end(c)
                fut.set_result(self._cache[c])
                return fut
            job = self._jobs.get(c)
            if job is not None:
                if job.overdue is not None:  # still compiling past its limit: no second thread for it
                    fut.set_exception(InvalidRequest(job.overdue))
                else:
                    job.waiters.append(fut)
                return fut
            small = size <= SMALL_BYTES
            q = self._small if small else self._large
            if len(q) >= self.queue_size:  # each size its own bound: large ones never crowd small ones out
                raise GrammarBusy(f"{self.queue_size} {'small' if small else 'large'} constraints are waiting to "
                                  "compile (--grammar-compile-queue-size); try again later")
            job = _Job(c, small, time.monotonic(), [fut])
            self._jobs[c] = job
            q.append(job)
            self._start()
            self._cv.notify_all()
        return fut

    def close(self) -> None:
        """Fail what is queued and let the threads end (a compile in progress runs to its end)."""
        with self._cv:
            self._closed = True
            settle = self._drop_queued(math.inf, GrammarBusy("the grammar compiler is shutting down"))
            self._cv.notify_all()
        _settle(settle)

    @property
    def threads(self) -> int:
        """Threads in the pool (abandoned ones not counted)."""
        with self._cv:
            return len(self._threads)

    @property
    def abandoned(self) -> int:
        """Threads still finishing a compile that ran past its limit."""
        with self._cv:
            return self._abandoned

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._small) + len(self._large)

    def cached(self, c: Constraint) -> bool:
        with self._cv:
            return c in self._cache

    # ---- the pool's side (every method below runs under self._cv) ----------------------------------
    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        for _ in range(self.workers):
            self._spawn(small_only=False)
        self._spawn(small_only=True)
        threading.Thread(target=self._supervise, name="grammar-supervisor", daemon=True).start()

    def _spawn(self, small_only: bool) -> None:
        t = _Thread(small_only)
        self._threads.append(t)
        # daemon: a compile cannot be interrupted, and must not keep the process from exiting
        threading.Thread(target=self._work, args=(t,), name="grammar-small" if small_only else "grammar",
                         daemon=True).start()

    def _work(self, me: _Thread) -> None:
        while True:
            with self._cv:
                job = self._take(me)
                if job is None:
                    return
                me.job = job
                job.started_at = time.monotonic()
                self._cv.notify_all()  # the supervisor times it from now
            result: G | None = None
            error: Exception | None = None
            try:
                result = self._compile(job.c)
            except Exception as e:  # the waiters get it: InvalidRequest is the client's, anything else a 500
                error = e
            with self._cv:
                self.compiles += 1
                me.job = None
                del self._jobs[job.c]
                if error is None and self.cache_size:
                    self._cache[job.c] = cast(G, result)
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
                settle: list[_Settle] = [] if job.overdue is not None else [(job.waiters, result, error)]
                stay = self._rejoin(me) if me.abandoned else True
            _settle(settle)
            if not stay:
                return

    def _take(self, me: _Thread) -> _Job[G] | None:
        """The next job for `me` (small ones first), waiting for one; None once the pool is closed."""
        while not self._closed:
            for q in (self._small,) if me.small_only else (self._small, self._large):
                while q:
                    job = q.popleft()
                    if any(not w.done() for w in job.waiters):
                        return job
                    del self._jobs[job.c]  # every waiter gave up (cancelled): nothing to compile it for
            self._cv.wait()
        return None

    def _rejoin(self, me: _Thread) -> bool:
        """An abandoned thread finished its compile: back into the pool if its kind is short, else it ends."""
        self._abandoned -= 1
        have = sum(t.small_only == me.small_only for t in self._threads)
        if self._closed or have >= (1 if me.small_only else self.workers):
            return False
        me.abandoned = False
        self._threads.append(me)
        return True

    def _supervise(self) -> None:
        """Enforce the time limits: of compiles running, and of jobs waiting for a thread."""
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                due = [now + self.timeout_s]  # nothing to time: look again after a full limit
                settle: list[_Settle] = []
                for t in list(self._threads):
                    if t.job is not None:
                        if t.job.started_at + self.timeout_s <= now:
                            settle.append(self._abandon(t))
                        else:
                            due.append(t.job.started_at + self.timeout_s)
                settle += self._drop_queued(now - self.timeout_s, None)
                due += [q[0].queued_at + self.timeout_s for q in (self._small, self._large) if q]
                if not settle:
                    self._cv.wait(max(0.0, min(due) - now))
            _settle(settle)

    def _abandon(self, t: _Thread) -> _Settle:
        """Give up on `t`'s compile: what to tell its waiters. The job stays known (overdue) while it
        runs on, so a request for the same constraint fails at once instead of taking another thread."""
        job = t.job
        assert job is not None
        job.overdue = (f"sampling_params.{job.c.kind} did not compile within {self.timeout_s:g} s "
                       "(--grammar-compile-timeout-s)")
        t.abandoned = True
        self._threads.remove(t)
        self._abandoned += 1
        replaced = self._abandoned <= self.workers
        if replaced:
            self._spawn(t.small_only)
        logger.warning("a %s of %d characters is still compiling after %g s: its requests failed, its thread "
                       "is abandoned (%d now, %s)", job.c.kind, len(job.c.text), self.timeout_s, self._abandoned,
                       "replaced" if replaced else f"not replaced: at most {self.workers} are")
        return job.waiters, None, InvalidRequest(job.overdue)

    def _drop_queued(self, before: float, error: BaseException | None) -> list[_Settle]:
        """Take the jobs queued at `before` or earlier out (each queue is in arrival order); what to
        tell their waiters (GrammarBusy for having waited too long when `error` is None)."""
        out: list[_Settle] = []
        for q in (self._small, self._large):
            while q and q[0].queued_at <= before:
                job = q.popleft()
                del self._jobs[job.c]
                why = error or GrammarBusy(f"sampling_params.{job.c.kind} waited {self.timeout_s:g} s for a "
                                           "grammar compile thread (--grammar-compile-timeout-s); try again later")
                out.append((job.waiters, None, why))
        return out


def _settle(settle: list[_Settle]) -> None:
    for waiters, result, error in settle:
        for w in waiters:
            try:
                if error is not None:
                    w.set_exception(error)
                else:
                    w.set_result(result)
            except InvalidStateError:  # cancelled by its waiter meanwhile
                pass
