"""Beyond both papers: a controller that moves the share with measured load.

It keeps the receiving worker's (the executor host's) P99 TPOT within its model's SLO while the
sender's batch grows, and the sender's own decode steps within the sender's TPOT SLO: every request the
share sends out makes the sender's batch, and so each of its steps, larger, so past some share its
running requests get their tokens slower than its SLO allows (measured on two H200s: a share of 0.9 took
the hot model's steps from 15-18 ms to 18-33 ms and its P99 TPOT to 40 ms against an SLO of 25 ms).
The sender is judged by its mean decode step over the last seconds (LoadReport.latency.decode_step_ms), not by
its requests' TPOT: an overloaded sender's TPOT also holds the time its requests waited to be admitted
or resumed, which a lower share would lengthen, not shorten (measured: steering by the sender's P99
TPOT took an overloaded decode worker's share to 0). At most once per `interval_s` (a change needs
time to show in the latency):

    missed   a request of the host's that finished over its TPOT SLO since the last look, its
             executor memory ran low, its P99 TPOT is above the SLO, or the sender's mean decode
             step is above the sender's TPOT SLO                      -> lower by step_down
    slack    no miss, the host's P99 TPOT below slack x SLO (or no samples: nothing to protect),
             the sender's decode step below slack x its SLO (or no steps, or no SLO), and the
             sender has requests to send                              -> raise by step_up
    between  hold (hysteresis: the band [slack x SLO, SLO] keeps the share still)

Offload pays only where attention is most of the sender's step, that is at long contexts: a remote row
costs a fixed exchange per layer and saves its attention, which grows with its context (measured on
H200s: at 1K tokens half the rows remote made the sender's step slower). So, judged first:

    short    the sender's decoding requests average fewer tokens than min_context_tokens
                                                                      -> 0 at once (every row loses)
    near     they average within [min_context_tokens, min_context_tokens / slack]: no raise (the share
             holds, at 0 after a fall: hysteresis, as for the latency)

No figure (nothing decoding, or a worker that does not report it) or min_context_tokens 0: no judgement.

The share stays in [0, max_ratio]; at 0 the pairing stays up and nothing new goes out.

A prefill worker hosting the executor (Adrenaline placement) decodes nothing of its own, so it has no
TPOT: there the latency kept within the SLO is the P99 TTFT of the first tokens it computes, against
the model's `slo: ttft_ms` (Adrenaline bounds the executor so that prefill keeps its TTFT).
"""

from __future__ import annotations

import math
from typing import Literal

from sglang_ext.offload.planning.base import Decision, PairView, Policy
from sglang_ext.offload.planning.spec import AdaptiveSpec, Rule


class Adaptive(Policy):
    name = "adaptive"

    def __init__(self, rule: Rule) -> None:
        super().__init__(rule)
        self.spec = rule.adaptive or AdaptiveSpec()
        self.ratio = rule.start
        self.misses: dict[str, int] = {}
        self.last_look = -math.inf
        self.why = "starting share"

    def note_miss(self, kind: str) -> None:
        self.misses[kind] = self.misses.get(kind, 0) + 1

    def decide(self, view: PairView) -> Decision:
        cap = self.rule.cap
        if view.now - self.last_look >= self.spec.interval_s:
            self.last_look = view.now
            self._look(view, cap)
        return Decision(self.ratio, cap, None, self.why)

    def _look(self, v: PairView, cap: float) -> None:
        if v.host_prefill:
            what, slo = "TTFT", v.host_slo_ttft_ms or math.inf
            p99 = v.host_ttft_p99_ms if v.host_ttft_samples else None
        else:
            what, slo = "TPOT", v.host_slo_tpot_ms or math.inf
            p99 = v.host_tpot_p99_ms if v.host_tpot_samples else None
        missed = [f"{n} {kind} miss(es)" for kind, n in sorted(self.misses.items())]
        if v.exec_low:
            missed.append("executor memory low")
        if p99 is not None and p99 > slo:
            missed.append(f"P99 {what} {p99:.1f} ms > SLO {slo:g} ms")
        own, own_slo = (v.sender_step_ms if v.sender_steps else None), v.sender_slo_tpot_ms or math.inf
        if own is not None and own > own_slo:
            missed.append(f"the sender's decode step {own:.1f} ms > its TPOT SLO {own_slo:g} ms")
        self.misses = {}
        old = self.ratio
        context = self._context(v)
        if context == "short":
            self.ratio = 0.0
            self.why = (f"{'lowered to 0' if old > 0 else 'at 0'}: contexts short ({self._mean(v)} < "
                        f"min_context_tokens {self.spec.min_context_tokens}): remote rows cost more than they save")
            return
        host_slack = p99 is None or p99 < self.spec.slack * slo
        own_slack = own is None or own < self.spec.slack * own_slo
        if missed:
            self.ratio = max(0.0, round(old - self.spec.step_down, 6))
            self.why = f"lowered: {', '.join(missed)}" if self.ratio < old else f"at 0: {', '.join(missed)}"
        elif host_slack and own_slack:
            have = "no samples" if p99 is None else f"P99 {what} {p99:.1f} ms < {self.spec.slack:g} x SLO {slo:g} ms"
            if v.sender_batch <= 0:
                self.why = f"slack ({have}), the sender has nothing to send"
            elif context == "near":
                floor = self.spec.min_context_tokens
                self.why = (f"held: contexts near break-even ({self._mean(v)} within [min_context_tokens {floor}, "
                            f"{floor / self.spec.slack:.0f}]), slack ({have})")
            elif old < cap:
                self.ratio = min(cap, round(old + self.spec.step_up, 6))
                self.why = f"raised: slack ({have})"
            else:
                self.why = f"at max_ratio: slack ({have})"
        elif not host_slack:
            assert p99 is not None
            self.why = f"held: P99 {what} {p99:.1f} ms within [{self.spec.slack:g} x SLO, SLO {slo:g} ms]"
        else:
            assert own is not None
            self.why = (f"held: the sender's decode step {own:.1f} ms within [{self.spec.slack:g} x its TPOT SLO, "
                        f"SLO {own_slo:g} ms]")

    def _context(self, v: PairView) -> Literal["short", "near"] | None:
        """`short` under min_context_tokens, `near` up to min_context_tokens / slack (the band that
        keeps the share still), None past it, with no figure, or with the rule off."""
        floor = self.spec.min_context_tokens
        if floor <= 0 or v.sender_context_tokens <= 0:  # 0: nothing decoding, or not reported
            return None
        if v.sender_context_tokens < floor:
            return "short"
        return "near" if v.sender_context_tokens < floor / self.spec.slack else None

    @staticmethod
    def _mean(v: PairView) -> str:
        return f"mean {v.sender_context_tokens:.0f} tokens per decoding request"
