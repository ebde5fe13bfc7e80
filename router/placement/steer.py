"""The planner's decisions on events: each active pairing's policy is asked, and what changed goes
to the sender as an OffloadRatio (the pairing stays; new requests follow it).

    LoadReported of a sender       decide; if the sender reports another ratio/bound than the one
                                   sent RESEND_AFTER_S ago, the update was lost: send it again
    LoadReported of a host         its pairings' executor memory (ExecutorMemoryLow on a fall
                                   under the entry's executor_low_mem share), then decide
    RequestArrived / FirstToken /  the sender's batch changed: decide (adrenaline's dense bound
    RequestFinished of a sender    moves with it)
    SloMissed on a host (tpot)     a finished request of the host's model over its TPOT SLO: the
                                   controller counts a miss; decide (single token gaps, "tbt", are
                                   not misses of the SLO: a prefill step of the host's own makes one)
    ExecutorMemoryLow              decide

Every decision is built from the registry (`PairView`), never from a tally of past events, so a
dropped event only delays one. Updates of an Adrenaline bound to one pairing are at least
SEND_EVERY_S apart (a change held back goes with the next event; load reports come every 0.5 s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Final

from router.events import (
    Event,
    ExecutorMemoryLow,
    FirstToken,
    LoadReported,
    OffloadDecided,
    RequestArrived,
    RequestFinished,
    SloMissed,
)
from router.placement.base import RouterHandle
from router.placement.pairing import Pairing
from router.placement.planning import PairView
from sglang_ext.messages import LoadReport, OffloadRatio
from sglang_ext.messages.io import Latency

logger = logging.getLogger(__name__)
SEND_EVERY_S: Final = 0.2
RESEND_AFTER_S: Final = 1.5
REL_CHANGE: Final = 0.05  # an Adrenaline bound that moved less than this (relative) is not sent
EVENTS: Final = (LoadReported, RequestArrived, FirstToken, RequestFinished, SloMissed, ExecutorMemoryLow)


class Steering:
    def __init__(self, router: RouterHandle, pairings: Mapping[str, Pairing], hosts_of: set[str]) -> None:
        self.router = router
        self.pairings = pairings
        self.hosts_of = hosts_of

    def on_event(self, ev: Event) -> None:
        if isinstance(ev, LoadReported):
            if ev.model in self.hosts_of:
                self._host_report(ev.worker_id, ev.report)
            p = self.pairings.get(ev.worker_id)
            if p is not None:
                self.plan(p, ev.report)
        elif isinstance(ev, (RequestArrived, FirstToken, RequestFinished)):
            p = self.pairings.get(ev.worker_id)
            if p is not None:
                self.plan(p)
        elif isinstance(ev, SloMissed):
            if ev.kind == "tpot":
                for p in self._hosted_by(ev.worker_id):
                    p.policy.note_miss("tpot")
                    self.plan(p)
        elif isinstance(ev, ExecutorMemoryLow):
            p = self.pairings.get(ev.sender)
            if p is not None and p.pairing_id == ev.pairing:
                self.plan(p)

    def _hosted_by(self, host: str) -> list[Pairing]:
        return [p for p in self.pairings.values() if p.executor == host and p.state == "active"]

    def _host_report(self, host: str, r: LoadReport) -> None:
        ex = r.executor
        for p in self._hosted_by(host):
            used = ex.pairing_tokens.get(p.pairing_id) if ex is not None else None
            free = ex.free_tokens.get(p.pairing_id) if ex is not None else None
            if used is None or free is None:
                continue
            total = used + free
            low = total > 0 and free < p.rule.executor_low_mem * total
            if low and not p.exec_low:
                logger.warning("offload %s -> %s: executor memory low (%d of %d KV tokens free)", p.sender, host,
                               free, total)
                p.exec_low = True
                self.router.bus.publish(ExecutorMemoryLow(p.rule.to, host, p.sender, p.pairing_id, free, total))
            p.exec_low = low
            self.plan(p)

    def view(self, p: Pairing) -> PairView:
        reg = self.router.registry
        sender, host = reg.workers.get(p.sender), reg.workers.get(p.executor)
        sl = sender.load if sender is not None else None
        hl = host.load if host is not None else None
        offloaded = sl.offload.reqs if sl is not None and sl.offload is not None else 0
        kv = sl.kv_total_tokens if sl is not None else (sender.info.max_total_tokens if sender and sender.info else 0)
        hx = hl.executor if hl is not None else None
        # no report yet: zero latency and no samples
        own, hlat = (sl.latency if sl else Latency()), (hl.latency if hl else Latency())
        slo, sender_slo = self.router.slo.get(p.rule.to), self.router.slo.get(p.rule.from_)
        return PairView(
            now=time.monotonic(), sender_batch=max(len(sender.inflight) - offloaded, 0) if sender else 0,
            sender_kv_tokens=kv,
            exec_used=hx.pairing_tokens.get(p.pairing_id, 0) if hx else 0,
            exec_free=hx.free_tokens.get(p.pairing_id, 0) if hx else 0, exec_low=p.exec_low,
            host_tpot_p99_ms=hlat.tpot_p99_ms, host_tpot_samples=hlat.tpot_samples,
            host_slo_tpot_ms=slo.tpot_ms if slo is not None else None,
            host_prefill=host is not None and host.role == "prefill",
            host_ttft_p99_ms=hlat.ttft_p99_ms, host_ttft_samples=hlat.ttft_samples,
            host_slo_ttft_ms=slo.ttft_ms if slo is not None else None,
            sender_step_ms=own.decode_step_ms, sender_steps=own.decode_steps,
            sender_slo_tpot_ms=sender_slo.tpot_ms if sender_slo is not None else None,
            sender_context_tokens=sl.decode_context_tokens if sl is not None else 0.0)

    def opening(self, p: Pairing) -> tuple[float, float]:
        """The (ratio, bound) a new pairing's directive carries: the policy's decision now."""
        p.exec_low = False  # a new pairing: the host's next report says
        p.decision = p.policy.decide(self.view(p))
        p.sent = p.decision.wire(p.rule.cap)
        p.sent_at = time.monotonic()
        return p.sent

    def plan(self, p: Pairing, report: LoadReport | None = None) -> None:
        if p.state != "active":
            return
        d = p.decision = p.policy.decide(self.view(p))
        wire, now = d.wire(p.rule.cap), time.monotonic()
        o = report.offload if report is not None else None
        lost = (o is not None and o.pairing == p.pairing_id and o.state == "active" and (o.ratio, o.bound) != p.sent
                and now - p.sent_at >= RESEND_AFTER_S)
        # Only a bound that moved is held back: a new share is rare (the controller's own interval spaces them).
        held = p.sent is not None and wire[0] == p.sent[0] and now - p.sent_at < SEND_EVERY_S
        if not lost and (not _differs(wire, p.sent) or held):
            return
        self.router.send(p.sender, OffloadRatio(pairing=p.pairing_id, ratio=wire[0], bound=wire[1]))
        p.sent, p.sent_at = wire, now
        p.updates += 1
        logger.debug("offload %s -> %s (%s): ratio %.3f bound %.3f%s: %s", p.sender, p.executor, p.rule.policy,
                     wire[0], wire[1], " (resent)" if lost else "", d.why)
        self.router.bus.publish(OffloadDecided(p.sender, p.executor, p.pairing_id, p.rule.policy, d.ratio, d.bound,
                                               d.why))


def _differs(new: tuple[float, float], old: tuple[float, float] | None) -> bool:
    if old is None:
        return True
    if new[0] != old[0] or (new[1] == 0) != (old[1] == 0):
        return True
    return abs(new[1] - old[1]) > REL_CHANGE * old[1]
