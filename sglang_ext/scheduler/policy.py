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

    @abstractmethod
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        """Admission order of waiting requests (does not mutate `waiting`)."""

    def begin(self, now: float, fits: bool) -> None:  # noqa: B027 (an optional hook)
        """Once per iteration, before the other calls. `fits`: all running, rotary and waiting
        requests' KV fits in the device pool together (computed only if `wants_fit`)."""

    def candidates(self, waiting: list[Req], rotary: list[Req], cache: PrefixCache) -> list[Req]:
        """Admission and resume order. Default: rotary requests (already served once) first."""
        return by_arrival(rotary) + self.order(waiting, cache)

    def victims(self, running: list[Req]) -> list[Req]:
        """Preemption order when pages run out, first to go first. Default: latest arrival."""
        return sorted(running, key=lambda r: r.arrival_time, reverse=True)

    def make_room_for(self, cand: Req, running: list[Req]) -> list[Req]:
        """Running requests to rotate out, in order, so that `cand` can be admitted now."""
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

    While everything fits in the pool it is exactly FCFS. A voluntary rotation must buy something
    (`make_room_for`): the candidate is behind, each victim is at least one SLO further ahead than
    it, and has decoded `MIN_STAY_TOKENS` tokens since it last (re)started. Why the lag and not
    per-residency times, and the rules in full: docs/architecture.md, "Rotation to host memory".
    """

    wants_fit = True
    # A rotation moves a stream's whole KV both ways (~128 MB each way for a 1000-token Llama-3-8B
    # request, ~2.3 ms per direction at 55 GB/s); 16 decode steps (~160 ms on an H200) pay for it many
    # times over and are well within the slack a stream banks at ~10x its TPOT SLO.
    MIN_STAY_TOKENS: Final = 16

    def __init__(self, ttft_slo_s: float, tpot_slo_s: float, alpha: float, beta_ttft: float,
                 beta_tpot: float) -> None:
        self.s_b, self.s_f = ttft_slo_s, tpot_slo_s
        self.alpha, self.beta_b, self.beta_f = alpha, beta_ttft, beta_tpot
        self.now = 0.0
        self.fits = True
        # per iteration: id -> (status, home, tokens, VLT); the sorts ask for the same requests many times
        self._memo: dict[int, tuple[ReqStatus, KVHome, int, float]] = {}

    def begin(self, now: float, fits: bool) -> None:
        self.now, self.fits = now, fits
        self._memo.clear()

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

    def candidates(self, waiting: list[Req], rotary: list[Req], cache: PrefixCache) -> list[Req]:
        if self.fits:
            return super().candidates(waiting, rotary, cache)
        return sorted(waiting + rotary, key=lambda r: (-self.vlt(r), r.arrival_time))

    def victims(self, running: list[Req]) -> list[Req]:
        if self.fits:
            return super().victims(running)
        return sorted(running, key=lambda r: (self.vlt(r), -r.arrival_time))

    def make_room_for(self, cand: Req, running: list[Req]) -> list[Req]:
        if self.fits:
            return []
        v = self.vlt(cand)
        if cand.home is KVHome.HOST and cand.output_ids and v <= 0:
            return []  # within its tolerance: it resumes when there is room, no one goes out for it
        bar = min(v, 0.0) - self.alpha  # a rotation must buy at least one SLO of lag
        out = []
        for r in self.victims(running):
            vr = self.vlt(r)
            if vr >= bar:
                break  # victims are in VLT order: the rest are no further ahead
            if self.settled(r):
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
                               a.lvf_beta_tpot)
    return POLICIES[name]()
