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
from sglang_ext.scheduler.request import Req, ReqStatus
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
    """`lvf` (SuperInfer's RotaSched). Virtual lag time, in SLOs: positive = behind, serve first;
    negative = ahead, may be rotated out for someone behind.

        waiting   VLT = (now - arrival) / S_B - beta_B
        rotary    VLT = alpha * ((now - last token) / S_F - beta_F)   (as waiting before its first token)
        running   VLT = alpha * ((now - first token) / S_F - (tokens since the first))   (0 before it)

A running request's VLT is its decode lag: how many TPOT SLOs it is behind (positive) or ahead
(negative) of one token per S_F since its first token. DESIGN.md's starting definition,
-alpha * (now - run start) / S_F, made every request that had run a moment a victim for any
waiting request: on an H200 at a load where FCFS met every SLO, lvf then rotated ~170 times per
second and collapsed. The lag keeps the meaning (negative = ahead of its SLO) but counts the slack
a stream has banked, so the victims are the streams furthest ahead, a request just brought back
(which spent its slack while away) is not sent out again at once, and a victim must be at least one
SLO ahead of the candidate it makes room for.

    While everything fits in the pool it is exactly FCFS. Otherwise candidates are taken from the
    head of the VLT order (within the pool and the rotation budget, which the scheduler enforces)
    and running requests with negative VLT below the candidate's are rotated out from the tail.
    """

    wants_fit = True

    def __init__(self, ttft_slo_s: float, tpot_slo_s: float, alpha: float, beta_ttft: float,
                 beta_tpot: float) -> None:
        self.s_b, self.s_f = ttft_slo_s, tpot_slo_s
        self.alpha, self.beta_b, self.beta_f = alpha, beta_ttft, beta_tpot
        self.now = 0.0
        self.fits = True

    def begin(self, now: float, fits: bool) -> None:
        self.now, self.fits = now, fits

    def vlt(self, r: Req) -> float:
        now = self.now
        if r.status is ReqStatus.RUNNING:
            if r.first_token_time is None or not r.output_ids:
                return 0.0  # still prefilling: neither ahead nor behind
            return self.alpha * ((now - r.first_token_time) / self.s_f - (len(r.output_ids) - 1))
        if r.status is ReqStatus.ROTARY and r.last_token_time is not None:
            return self.alpha * ((now - r.last_token_time) / self.s_f - self.beta_f)
        return (now - r.arrival_time) / self.s_b - self.beta_b

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
        bar = min(self.vlt(cand), 0.0) - self.alpha  # a rotation must buy at least one SLO of lag
        return [r for r in self.victims(running) if self.vlt(r) < bar]


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
