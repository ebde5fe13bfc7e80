"""Scheduling policies: who gets KV pages next, and who gives them up.

A policy answers three questions each iteration, so the scheduler loop holds no fixed rule:
  * `candidates`: the order in which waiting requests are admitted and rotary ones resumed (the
    scheduler takes them from the head and stops at the first that does not fit);
  * `victims`: the order in which running requests are preempted when pages run out;
  * `make_room_for`: running requests to rotate out *voluntarily* so a candidate can run (only
    `lvf` does this; the others preempt only when pages run out).

`fcfs` and `lpm` are SGLang's; `wf` (waiting first) and `sf` (swapped first) are the classic swap
baselines; `lvf` is SuperInfer's RotaSched (Largest Virtual-lag-time First).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Final

from sglang_ext.kvcache.base import PrefixCache
from sglang_ext.scheduler.request import KVHome, Req, ReqStatus
from sglang_ext.server_args import ServerArgs


def by_arrival(reqs: list[Req]) -> list[Req]:
    return sorted(reqs, key=lambda r: r.arrival_time)


class SchedulePolicy(ABC):
    wants_fit = False  # `begin` needs to know whether every request's KV fits in the pool
    voluntary = False  # `make_room_for` may name victims (otherwise it is never asked)

    @abstractmethod
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        """Admission order of waiting requests (does not mutate `waiting`)."""

    def begin(self, now: float, fits: bool) -> None:  # noqa: B027 (an optional hook)
        """Once per iteration, before the other calls. `fits`: all running, rotary and waiting
        requests' KV fits in the device pool together (computed only if `wants_fit`)."""

    def tick(self, now: float) -> None:  # noqa: B027 (an optional hook)
        """Once per scheduler step (landed or overlapped), before anything else."""

    def may_rotate_for(self, head: Req, local: list[Req], now: float) -> bool:
        """Cheap and never wrong when False: `make_room_for(head, ...)` could name a victim now, so
        the step must be scheduled on landed state (the overlap loop asks)."""
        return False

    def candidates(self, waiting: list[Req], rotary: list[Req], cache: PrefixCache) -> list[Req]:
        """Admission and resume order. Default: rotary requests (already served once) first."""
        return by_arrival(rotary) + self.order(waiting, cache)

    def victims(self, running: list[Req]) -> list[Req]:
        """Preemption order when pages run out, first to go first. Default: latest arrival."""
        return sorted(running, key=lambda r: r.arrival_time, reverse=True)

    def make_room_for(self, cand: Req, running: list[Req], short_tokens: int = 1,
                      local: list[Req] | None = None) -> list[Req]:
        """Running requests (of `running`, those that may go) to rotate out, in order, so that `cand`
        can be admitted now; it lacks `short_tokens` tokens of room, and `local` (default `running`)
        are all the requests whose KV is in the pool."""
        return []


class FCFS(SchedulePolicy):
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        return by_arrival(waiting)

    def candidates(self, waiting: list[Req], rotary: list[Req], cache: PrefixCache) -> list[Req]:
        # A rotated request keeps its place, as a preempted one does in the waiting queue.
        return by_arrival(waiting + rotary)


class LongestPrefixMatch(SchedulePolicy):
    """Serve requests with the most cached tokens first (SGLang's `lpm`): hits before evictions."""

    _MAX_QUEUE: Final = 128  # past this, matching every request costs more than it saves

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        if len(waiting) > self._MAX_QUEUE:
            return FCFS().order(waiting, cache)
        hits = {id(r): cache.match_prefix(r.fill_ids[:-1]).num_tokens for r in waiting}
        return sorted(waiting, key=lambda r: (-hits[id(r)], r.arrival_time))


class WaitingFirst(FCFS):
    """`wf`: new requests are admitted before rotary ones resume (good TTFT, paused streams)."""

    def candidates(self, waiting: list[Req], rotary: list[Req], cache: PrefixCache) -> list[Req]:
        return by_arrival(waiting) + by_arrival(rotary)


class SwappedFirst(FCFS):
    """`sf`: rotary requests resume before new ones are admitted (steady TPOT, FCFS-like TTFT)."""

    def candidates(self, waiting: list[Req], rotary: list[Req], cache: PrefixCache) -> list[Req]:
        return by_arrival(rotary) + by_arrival(waiting)


class LargestVLTFirst(FCFS):
    """`lvf` (SuperInfer's RotaSched: Largest Virtual-lag-time First). Virtual lag time, in SLOs:
    positive = behind, served first; negative = ahead, may be rotated out for someone behind.

        waiting   VLT = (now - arrival) / S_B - beta_B
        running   VLT = alpha * lag                (0 before its first token)
        rotary    VLT = alpha * (lag - beta_F)     (as waiting before its first token)
        lag       = (now - first token) / S_F - (tokens since the first)

    While everything fits in the pool it is exactly FCFS. Otherwise candidates go earliest deadline
    first (`deadline`): a waiting request's is its arrival plus the TTFT SLO (so waiting requests keep
    their FCFS order), a rotary stream's is when its banked slack runs out. Ordering them by VLT
    instead kept a rotated stream out until it had spent all its slack, and then put it ahead of
    every arrival: under sustained load each rotation moved a miss from one request to the next. The
    victims are still taken largest slack (lowest VLT) first. A voluntary rotation must buy something
    (`make_room_for`), judged in seconds against `wait`, the time until running requests free the
    room the candidate lacks (their remaining tokens at the measured step time):
      * the candidate would miss its SLO without it: a waiting one's TTFT budget is shorter than
        `wait` (and not spent: a TTFT already missed is not bought back), a rotary one's slack too
        and it can still recover its mean TPOT;
      * each victim can pay: its banked slack covers twice `wait` and a few steps, it is at least one
        SLO further ahead than the candidate, and has decoded `MIN_STAY_TOKENS` since it (re)started.
    So when streams have no TPOT slack, or the pool frees room in time anyway, lvf does what FCFS
    does. With `missed_last` (`--lvf-missed-last`) candidates that have missed their SLO whatever runs
    next go behind the others, so a late head does not stop the rotations that would save those behind.
    Why the lag and not per-residency times, and the rules in full: docs/architecture.md,
    "Rotation to host memory".
    """

    wants_fit = True
    voluntary = True
    # A rotation moves a stream's whole KV both ways (~128 MB each way for a 1000-token Llama-3-8B
    # request, ~2.3 ms per direction at 55 GB/s); 16 decode steps (~160 ms on an H200) pay for it many
    # times over and are well within the slack a stream banks at ~10x its TPOT SLO.
    MIN_STAY_TOKENS: Final = 16
    # A gap between iterations longer than this is idle time or a stall, not a step.
    MAX_STEP_S: Final = 1.0
    # A victim's slack must cover the candidate's wait this many times over (its own way back needs a
    # second finish, after the one that would have made room), and STEPS_MARGIN steps for the copies.
    SLACK_FACTOR: Final = 2.0
    STEPS_MARGIN: Final = 4

    def __init__(self, ttft_slo_s: float, tpot_slo_s: float, alpha: float, beta_ttft: float,
                 beta_tpot: float, missed_last: bool = False) -> None:
        self.s_b, self.s_f = ttft_slo_s, tpot_slo_s
        self.missed_last = missed_last  # `candidates`: requests past saving behind the rest (--lvf-missed-last)
        self.alpha, self.beta_b, self.beta_f = alpha, beta_ttft, beta_tpot
        self.now = 0.0
        self.fits = True
        # per iteration: id -> (status, home, tokens, VLT); the sorts ask for the same requests many times
        self._memo: dict[int, tuple[ReqStatus, KVHome, int, float]] = {}
        self.step_s: float | None = None  # decode iteration time under pressure (EWMA); None: not measured
        self._last: float | None = None

    def tick(self, now: float) -> None:
        # Steps under pressure (overlapped ones too) time the iteration; an idle gap is not a step.
        if not self.fits and self._last is not None and 0.0 < now - self._last < self.MAX_STEP_S:
            gap = now - self._last
            self.step_s = gap if self.step_s is None else 0.8 * self.step_s + 0.2 * gap
        self._last = now

    def begin(self, now: float, fits: bool) -> None:
        self.now, self.fits = now, fits
        self._memo.clear()

    def may_rotate_for(self, head: Req, local: list[Req], now: float) -> bool:
        # make_room_for's gates at the bounds of the wait: the longest (room for all of the head's
        # KV) must exceed what the head can afford, and a victim must cover at least the shortest
        # (the first finish). A False here lets the step overlap: measured on an H200, landed-state
        # steps while a queue stood cost ~5 % of decode speed even with almost no rotations.
        if self.fits or self.step_s is None:
            return False
        self.now = now
        self._memo.clear()
        if head.home is KVHome.HOST and head.output_ids and self.vlt(head) <= 0:
            return False
        longest = self.wait_s(local, head.fill_len + 1)
        if not head.output_ids:
            budget = self.s_b - (now - head.arrival_time)
            if not 0.0 < budget < longest:
                return False
        elif self.slack_s(head) >= longest:
            return False
        floor = self.SLACK_FACTOR * self.wait_s(local, 1) + self.STEPS_MARGIN * self.step_s
        return any(self.settled(r) and self.slack_s(r) >= floor for r in local)

    def lag(self, r: Req) -> float | None:
        """Decode lag in TPOT SLOs (positive = behind); None before the first token."""
        if r.first_token_time is None or not r.output_ids:
            return None
        return (self.now - r.first_token_time) / self.s_f - (len(r.output_ids) - 1)

    def vlt(self, r: Req) -> float:
        hit = self._memo.get(id(r))
        if hit is not None and hit[0] is r.status and hit[1] is r.home and hit[2] == len(r.output_ids):
            return hit[3]
        v = self._vlt(r)
        self._memo[id(r)] = (r.status, r.home, len(r.output_ids), v)
        return v

    def _vlt(self, r: Req) -> float:
        lag = self.lag(r)
        if r.status is ReqStatus.RUNNING:
            return 0.0 if lag is None else self.alpha * lag  # still prefilling: neither ahead nor behind
        if r.home is KVHome.HOST and lag is not None:  # rotary
            return self.alpha * (lag - self.beta_f)
        return (self.now - r.arrival_time) / self.s_b - self.beta_b

    def settled(self, r: Req) -> bool:
        """Ran long enough since it last (re)started to be a voluntary victim."""
        return len(r.output_ids) - r.run_start_tokens >= self.MIN_STAY_TOKENS

    def deadline(self, r: Req) -> float:
        """When `r` misses its SLO if it does not run: its first token's deadline, or once it has
        tokens, the moment its mean TPOT would pass the SLO (now + its slack)."""
        if r.status is ReqStatus.RUNNING or not r.output_ids:
            return r.arrival_time + self.s_b
        return self.now + self.slack_s(r)

    def candidates(self, waiting: list[Req], rotary: list[Req], cache: PrefixCache) -> list[Req]:
        if self.fits:
            return super().candidates(waiting, rotary, cache)
        return sorted(waiting + rotary,
                      key=lambda r: (self.missed_last and self.missed(r), self.deadline(r), r.arrival_time))

    def missed(self, r: Req) -> bool:
        """`r` has missed its SLO whatever runs next: its first token is past the TTFT SLO, or its
        stream can no longer bring its mean TPOT back under the SLO. No rotation is made for such a
        candidate (`_worth_it`), and admission stops at the first candidate that does not fit, so at
        the head of the queue it would hold back the rotations that could save the requests behind it."""
        if r.status is ReqStatus.RUNNING:
            return False
        if not r.output_ids:
            return self.now - r.arrival_time >= self.s_b
        if self.step_s is None:
            return False
        left = r.sampling.max_new_tokens - len(r.output_ids)
        return self.slack_s(r) + left * (self.s_f - self.step_s) <= 0.0  # back now, it still ends late

    def victims(self, running: list[Req]) -> list[Req]:
        if self.fits:
            return super().victims(running)
        return sorted(running, key=lambda r: (self.vlt(r), -r.arrival_time))

    def slack_s(self, r: Req) -> float:
        """Seconds `r` could pause now and still meet its mean-TPOT SLO (negative: behind)."""
        lag = self.lag(r)
        return 0.0 if lag is None else -lag * self.s_f

    def wait_s(self, running: list[Req], short_tokens: int) -> float:
        """Seconds until running requests, finishing soonest first, free `short_tokens` tokens of KV
        (upper bound: each runs to its max_new_tokens). inf if they never would."""
        assert self.step_s is not None
        freed = 0
        for left, r in sorted(((r.sampling.max_new_tokens - len(r.output_ids), r) for r in running),
                              key=lambda x: x[0]):
            freed += r.kv_len + max(left, 0)
            if freed >= short_tokens:
                return max(left, 1) * self.step_s
        return float("inf")

    def _worth_it(self, cand: Req, wait: float) -> bool:
        """The candidate misses its SLO unless someone makes room, and room would save it."""
        assert self.step_s is not None
        if self.missed(cand):  # a TTFT already missed is not bought back, nor a stream past recovery
            return False
        if not cand.output_ids:  # no first token yet (waiting, or rotary before its first token)
            return self.s_b - (self.now - cand.arrival_time) < wait
        return self.slack_s(cand) < wait

    def make_room_for(self, cand: Req, running: list[Req], short_tokens: int = 1,
                      local: list[Req] | None = None) -> list[Req]:
        if self.fits or self.step_s is None:
            return []  # nothing binds, or no step time yet to judge by
        v = self.vlt(cand)
        if cand.home is KVHome.HOST and cand.output_ids and v <= 0:
            return []  # within its tolerance: it resumes when there is room, no one goes out for it
        wait = self.wait_s(running if local is None else local, short_tokens)
        if not self._worth_it(cand, wait):
            return []
        need = self.SLACK_FACTOR * wait + self.STEPS_MARGIN * self.step_s
        bar = min(v, 0.0) - self.alpha  # a rotation must buy at least one SLO of lag
        out = []
        for r in self.victims(running):
            vr = self.vlt(r)
            if vr >= bar:
                break  # victims are in VLT order: the rest are no further ahead
            if self.settled(r) and self.slack_s(r) >= need:
                out.append(r)
        return out


POLICIES: Final[dict[str, type[SchedulePolicy]]] = {
    "fcfs": FCFS, "lpm": LongestPrefixMatch, "wf": WaitingFirst, "sf": SwappedFirst, "lvf": LargestVLTFirst,
}


def make_policy(name: str, args: ServerArgs | None = None) -> SchedulePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown schedule policy {name!r}; known: {sorted(POLICIES)}")
    if name == "lvf":
        a = args or ServerArgs(preemption_mode="rotate")
        return LargestVLTFirst(a.resolved_ttft_slo_s, a.resolved_tpot_slo_s, a.lvf_alpha, a.lvf_beta_ttft,
                               a.lvf_beta_tpot, a.lvf_missed_last)
    return POLICIES[name]()
