"""The offload policy of an in-process executor (`--offload-executor` with `--offload-policy`), decided by
the worker itself with the router's own policy classes (sglang_ext/offload/planning/).

A served pairing's share is decided by the router from two workers' load reports (router/placement/
steer.py). With an in-process executor there is one worker: it sends and it hosts. So the view is built
from this worker's own measurements, the same figures its load report carries:

    PairView field            served pairing (the router)          in-process (here)
    sender_batch              the sender's in-flight requests      running + waiting requests
                              less those offloaded                 less those offloaded
    sender_step_ms            the sender's mean decode step        this worker's (3 s window)
    sender_context_tokens     the sender's decoding requests'      this worker's (min_context_tokens rule)
                              mean context
    host_tpot_p99_ms          the host's own requests' P99 TPOT    this worker's requests' (10 s window)
    host / sender TPOT SLO    the models' `slo: tpot_ms`           --tpot-slo-ms
    misses                    a host request over its TPOT SLO     a request of this worker's over it
    exec_used / exec_free     the host's report per pairing        the in-process executor's partition

Because the host is the worker itself, its P99 TPOT also holds what hosting costs the worker's own steps.
The policy is asked every REPLAN_S (the router hears load reports as often) and the sender's share is set
between steps, on the forward thread; requests already out stay out (as after an OffloadRatio).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Final

import msgspec

from sglang_ext.offload.planning import AdaptiveSpec, AdrenalineSpec, Decision, PairView, Policy, make_policy
from sglang_ext.offload.remote import LocalRemote
from sglang_ext.offload.sender import RemoteSender
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.stats import LatencyWindow

logger = logging.getLogger(__name__)
REPLAN_S: Final = 0.5  # as often as a served sender's load reports reach the router's planner
EXECUTOR_LOW_MEM: Final = 0.1  # free executor KV under this share: "memory low" (the offload: entry's default)
LOCAL_POLICIES: Final = ("fixed", "adaptive")  # adrenaline's bound is for served pairings (C1/C2 on the wire)


@dataclass(frozen=True)
class LocalRule:
    """What the policy reads of its rule (sglang_ext/offload/planning/spec.py's Rule), from the flags."""

    policy: str
    ratio: float  # fixed: the share; adaptive: the starting share (--offload-ratio)
    max_ratio: float = 1.0
    adaptive: AdaptiveSpec | None = None
    adrenaline: AdrenalineSpec | None = None

    @property
    def cap(self) -> float:
        return self.ratio if self.policy == "fixed" else self.max_ratio

    @property
    def start(self) -> float:
        return min(self.ratio, self.cap)


def adaptive_spec(text: str | None) -> AdaptiveSpec | None:
    """--offload-adaptive's JSON (the cluster file's `adaptive:` keys); ValueError naming the field."""
    if not text:
        return None
    try:
        return msgspec.json.decode(text, type=AdaptiveSpec)
    except msgspec.DecodeError as e:
        raise ValueError(f"offload_adaptive: {e}") from e


def local_rule(args: ServerArgs) -> LocalRule:
    if args.offload_policy not in LOCAL_POLICIES:
        raise ValueError(f"offload_policy must be one of {', '.join(LOCAL_POLICIES)} with an in-process executor, "
                         f"got {args.offload_policy!r}")
    return LocalRule(args.offload_policy, args.offload_ratio, adaptive=adaptive_spec(args.offload_adaptive))


class LocalPlanning:
    """The policy for this worker's in-process executor, asked between steps every REPLAN_S."""

    def __init__(self, args: ServerArgs, scheduler: Scheduler, tpot: LatencyWindow,
                 decode_steps: LatencyWindow) -> None:
        self.rule = local_rule(args)
        self.policy: Policy = make_policy(self.rule)
        self.scheduler = scheduler
        self.tpot, self.decode_steps = tpot, decode_steps
        self.slo_tpot_ms = args.resolved_tpot_slo_s * 1e3
        self.page_size = args.resolved_page_size
        self.every_s = REPLAN_S
        self.last = -float("inf")
        self.decision: Decision | None = None
        self.changes = 0

    @property
    def sender(self) -> RemoteSender | None:
        return self.scheduler.remote_sender

    def request_finished(self, tpot_s: float) -> None:
        """A request of this worker's finished with this mean TPOT: over the SLO is a miss (the router's
        SloMissed "tpot" of a host)."""
        if tpot_s * 1e3 > self.slo_tpot_ms:
            self.policy.note_miss("tpot")

    def view(self, now: float) -> PairView:
        off = self.sender
        s = self.scheduler.stats()
        offloaded = off.num_remote if off is not None else 0
        used = free = 0
        r = off.remote if off is not None else None
        if isinstance(r, LocalRemote):
            used = r.executor.used_tokens(r.guest)
            free = r.executor.partition.free_pages(r.guest) * self.page_size
        total = used + free
        return PairView(
            now=now, sender_batch=max(s.num_running + s.num_waiting - offloaded, 0),
            sender_kv_tokens=s.kv_total_pages * self.page_size,
            exec_used=used, exec_free=free,
            exec_low=total > 0 and free < EXECUTOR_LOW_MEM * total,
            host_tpot_p99_ms=self.tpot.p99_ms(now), host_tpot_samples=self.tpot.count(now),
            host_slo_tpot_ms=self.slo_tpot_ms, sender_step_ms=self.decode_steps.mean_ms(now),
            sender_steps=self.decode_steps.count(now), sender_slo_tpot_ms=self.slo_tpot_ms,
            sender_context_tokens=s.decode_context_tokens)

    def after_step(self, now: float | None = None) -> None:
        """Ask the policy (at most every REPLAN_S) and set the sender's share to its decision."""
        now = time.monotonic() if now is None else now
        off = self.sender
        if off is None or now - self.last < self.every_s:
            return
        self.last = now
        d = self.decision = self.policy.decide(self.view(now))
        if d.ratio != off.ratio:
            logger.info("offload share %.3f -> %.3f (%s): %s", off.ratio, d.ratio, self.rule.policy, d.why)
            off.ratio = d.ratio
            self.changes += 1
