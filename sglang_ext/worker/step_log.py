"""A worker's step profile in its log, for finding where serving time goes (`--step-log-interval-s S`:
one INFO line every S seconds; 0, the default: off, and nothing is measured).

    steps 412 (82.4/s, 11.6 ms mean, 41 % with a prefill, 37 % overlapped) | running 43.1 (remote 21.5)
    waiting 88.0 | rows 40.2 | tokens out 3560/s, prefill 9120/s | executor wait 6.3 % (loads 31)
    | kv 63 % mean, 98 % peak | decode-only forwards 243 x 9.8 ms at 42.0 rows of 2210 tokens

"rows" is the mean number of requests in a forward (running ones may sit a step out: no page to grow,
a swap-in on the way, or a prompt chunk that did not fit the step's token budget). Then the KV pool
("kv 63 % mean, 98 % peak": pages in use after each step, prefix cache included) and the steps without
a prefill on their own ("decode-only forwards 240 x 10.3 ms at 11.2 rows of 5930 tokens": their mean time, rows
and context a row): what a simulator's decode step is checked against in serving (bench/step_profile.py
reads these lines per point). "steps" are the worker's calls of `Scheduler.step`; rows and the decode-only
figures are per forward: a decode forward's time is the call that launched it plus any later call that
only landed it (a launched step lands one call later when the next cannot overlap it). Lines written
before 2026-12-06 (session 6), without the word "forwards", counted calls there, halving both rows and
time in phases without overlap (bench/step_profile.py then reads only their fully overlapped intervals).
Then, where the interval ran any, the forwards with a prefill chunk ("| prefill forwards 12 x 85.3 ms of
4870 tokens at 6.2 rows": the calls that launched them, which the loop runs plain, their prompt tokens
and all their rows, chunks and riding decode rows; since 2026-12-07 session 15, what a simulator's
prefill is checked against in serving; before, bench/step_profile.py estimated it from what the
decode-only forwards left). With remote attention the line ends with the steps that planned remote rows
apart from the others, e.g. "| with remote rows 380 x 10.2 ms, without 32 x 5.9 ms": what remote rows
cost a step, measured. Last, with the overlap loop, why steps in flight were not followed by an
overlapped one, by reason (since 2026-12-07; `overlap.NOT_OVERLAPPED`), e.g. "| not overlapped: rows 40,
landed 12, queue 3": each runs the next step plain, its host time not hidden (what a simulator that runs
the plain loop must add).

Means are over the steps of the interval; "executor wait" is the sender's time blocked on its
executor (plans, loads, exchanges that the host waits for) as a share of the interval.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_ext.scheduler.scheduler import Scheduler
    from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)


def make_step_log(args: ServerArgs, name: str) -> StepLog | None:
    """The worker's step log, None when `step_log_interval_s` is 0."""
    return StepLog(args.step_log_interval_s, name) if args.step_log_interval_s > 0 else None


@dataclass
class _Window:
    steps: int = 0
    wall_s: float = 0.0
    with_prefill: int = 0
    running: int = 0
    remote: int = 0
    waiting: int = 0
    tokens_out: int = 0
    prefill_tokens: int = 0
    remote_steps: int = 0  # steps that planned remote rows, and their time
    remote_wall_s: float = 0.0
    kv_used: float = 0.0  # sum over steps of the pool's used share, and its peak
    kv_peak: float = 0.0
    forwards: int = 0  # calls that launched (or ran) a forward, and their rows: "rows" is per forward
    rows: int = 0
    decode_steps: int = 0  # forwards without a prefill: their time (see StepLog.record) and rows
    decode_wall_s: float = 0.0
    decode_rows: int = 0
    decode_context: int = 0  # KV tokens those steps' rows attended over
    prefill_forwards: int = 0  # forwards with a prefill chunk: their calls' time, prompt tokens and rows
    prefill_wall_s: float = 0.0
    prefill_tokens_fwd: int = 0
    prefill_rows: int = 0
    prefill_chunks: int = 0  # ... of those rows the prompt chunks, their causal query-key pairs,
    prefill_pairs: int = 0
    riding_context: int = 0  # ... and the KV tokens the decode rows riding along attend over


class StepLog:
    def __init__(self, interval_s: float, name: str) -> None:
        self.interval_s = interval_s
        self.name = name
        self._w = _Window()
        self._t0 = time.monotonic()
        self._base: tuple[int, float, int] | None = None  # overlapped steps, executor wait, loads
        self._plain_base: dict[str, int] | None = None  # the scheduler's not_overlapped at the last line
        self._remote_rows = 0  # the scheduler's remote_forward_rows at the last step
        self._rows = 0  # ... and its forward_rows
        self._context = 0  # ... and its forward_context
        self._chunks = (0, 0, 0)  # ... and its prefill_chunks, prefill_chunk_context, prefill_pairs
        self._decode_open = False  # the last forward had no prefill: calls that only land it are its time

    def record(self, scheduler: Scheduler, wall_s: float, tokens_out: int, prefill_tokens: int) -> None:
        w = self._w
        w.steps += 1
        w.wall_s += wall_s
        w.with_prefill += prefill_tokens > 0
        remote_rows = getattr(scheduler, "remote_forward_rows", 0)
        if remote_rows > self._remote_rows:
            w.remote_steps += 1
            w.remote_wall_s += wall_s
        self._remote_rows = remote_rows
        rows = getattr(scheduler, "forward_rows", 0)
        context = getattr(scheduler, "forward_context", 0)
        chunks = (getattr(scheduler, "prefill_chunks", 0), getattr(scheduler, "prefill_chunk_context", 0),
                  getattr(scheduler, "prefill_pairs", 0))
        new_rows = max(rows - self._rows, 0)
        if new_rows:  # this call launched (or ran) a forward
            w.forwards += 1
            w.rows += new_rows
            self._decode_open = prefill_tokens == 0
            if self._decode_open:
                w.decode_steps += 1
                w.decode_rows += new_rows
                w.decode_context += max(context - self._context, 0)
            else:  # the loop runs a forward with a prefill chunk plain: the call is its time
                w.prefill_forwards += 1
                w.prefill_wall_s += wall_s
                w.prefill_tokens_fwd += prefill_tokens
                w.prefill_rows += new_rows
                n_chunks, chunk_context, pairs = (max(a - b, 0) for a, b in zip(chunks, self._chunks, strict=True))
                w.prefill_chunks += n_chunks
                w.prefill_pairs += pairs
                w.riding_context += max(context - self._context - chunk_context, 0)
        if self._decode_open and prefill_tokens == 0:
            # A decode forward's time is that of the call that launched it and of any call after it that
            # only landed it: outside the overlap loop's steady state a launched step lands one call
            # later, with no forward of its own (counting calls would halve both the time and the rows).
            w.decode_wall_s += wall_s
        self._rows, self._context, self._chunks = rows, context, chunks
        alloc = getattr(scheduler, "allocator", None)
        if alloc is not None and alloc.capacity:
            used = 1.0 - alloc.num_free / alloc.capacity
            w.kv_used += used
            w.kv_peak = max(w.kv_peak, used)
        w.running += len(scheduler.running)
        w.remote += scheduler.remote_sender.num_remote if scheduler.remote_sender is not None else 0
        w.waiting += len(scheduler.waiting)
        w.tokens_out += tokens_out
        w.prefill_tokens += prefill_tokens
        now = time.monotonic()
        if now - self._t0 >= self.interval_s:
            self._emit(scheduler, now - self._t0)
            self._t0, self._w = now, _Window()

    @staticmethod
    def _chunk_split(w: _Window) -> str:
        p, riding = w.prefill_forwards, w.prefill_rows - w.prefill_chunks
        return (f" ({w.prefill_chunks / p:.1f} chunks, {w.prefill_pairs / max(w.prefill_tokens_fwd, 1):.0f} keys a "
                f"prompt token; {riding / p:.1f} decoding at {w.riding_context / max(riding, 1):.0f} tokens)")

    def _counters(self, scheduler: Scheduler) -> tuple[int, float, int]:
        r = scheduler.remote_sender.remote if scheduler.remote_sender is not None else None
        return getattr(scheduler, "overlapped_steps", 0), r.wait_s if r else 0.0, r.staged_loads if r else 0

    def _emit(self, scheduler: Scheduler, span: float) -> None:
        w, now = self._w, self._counters(scheduler)
        base = self._base if self._base is not None else now
        self._base = now
        n = max(w.steps, 1)
        overlapped, waited, loads = now[0] - base[0], max(now[1] - base[1], 0.0), now[2] - base[2]
        split = ""
        if w.remote_steps:
            local = w.steps - w.remote_steps
            split = (f" | with remote rows {w.remote_steps} x {1e3 * w.remote_wall_s / w.remote_steps:.1f} ms, "
                     f"without {local} x {1e3 * (w.wall_s - w.remote_wall_s) / max(local, 1):.1f} ms")
        plain = getattr(scheduler, "not_overlapped", {})
        before = self._plain_base if self._plain_base is not None else plain
        self._plain_base = plain
        why = {k: v - before.get(k, 0) for k, v in plain.items() if v - before.get(k, 0) > 0}
        if why:
            split += " | not overlapped: " + ", ".join(f"{k} {v}" for k, v in why.items())
        d = max(w.decode_steps, 1)
        if w.prefill_forwards:
            p = w.prefill_forwards
            split = (f" | prefill forwards {p} x {1e3 * w.prefill_wall_s / p:.1f} ms of "
                     f"{w.prefill_tokens_fwd / p:.0f} tokens at {w.prefill_rows / p:.1f} rows") + (
                # what prices their attention: how many chunks, the keys a prompt token attends over (past
                # its chunk's start when it follows a prefix), the decode rows riding along and their context
                self._chunk_split(w) if w.prefill_chunks else "") + split
        logger.info("%s: steps %d (%.1f/s, %.1f ms mean, %.0f %% with a prefill, %.0f %% overlapped) | running %.1f "
                    "(remote %.1f) waiting %.1f | rows %.1f | tokens out %.0f/s, prefill %.0f/s | executor wait "
                    "%.1f %% (loads %d) | kv %.0f %% mean, %.0f %% peak | decode-only forwards %d x %.1f ms at "
                    "%.1f rows of %.0f tokens%s",
                    self.name, w.steps, w.steps / span, 1e3 * w.wall_s / n, 100 * w.with_prefill / n,
                    100 * overlapped / n, w.running / n, w.remote / n, w.waiting / n, w.rows / max(w.forwards, 1),
                    w.tokens_out / span,
                    w.prefill_tokens / span, 100 * waited / span, loads, 100 * w.kv_used / n, 100 * w.kv_peak,
                    w.decode_steps, 1e3 * w.decode_wall_s / d, w.decode_rows / d,
                    w.decode_context / max(w.decode_rows, 1), split)
