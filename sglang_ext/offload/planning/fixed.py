"""WEAVER's policy: the entry's ratio, whatever the load (the paper's default is 0.45)."""

from __future__ import annotations

from sglang_ext.offload.planning.base import Decision, PairView, Policy


class Fixed(Policy):
    name = "fixed"

    def decide(self, view: PairView) -> Decision:
        r = self.rule.cap
        return Decision(r, r, None, "fixed ratio")
