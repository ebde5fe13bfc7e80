"""Offload policies: what share of a sender's decoding requests its executor takes, decided from a view
of the pairing's load. Pure code (no router, no devices), so that one class decides for both placements:

    served pairing        the router's planner (router/placement/steer.py) builds the PairView from the
                          workers' load reports and sends each new share to the sender (OffloadRatio)
    in-process executor   the worker itself (sglang_ext/worker/local_planning.py, `--offload-policy`)
                          builds it from its own measurements and sets its sender's share

    fixed       WEAVER: the rule's ratio, always
    adrenaline  Adrenaline's upper bound OB(n, B_max) (served pairings only)
    adaptive    a controller: lowers the share after the receiving worker misses its TPOT SLO,
                raises it with slack; 0 while the decoding contexts are short (min_context_tokens)
"""

from __future__ import annotations

from typing import Final

from sglang_ext.offload.planning.adaptive import Adaptive
from sglang_ext.offload.planning.adrenaline import Adrenaline, Bound, offload_bound
from sglang_ext.offload.planning.base import Decision, PairView, Policy
from sglang_ext.offload.planning.fixed import Fixed
from sglang_ext.offload.planning.spec import AdaptiveSpec, AdrenalineSpec, Rule

POLICIES: Final[dict[str, type[Policy]]] = {"fixed": Fixed, "adrenaline": Adrenaline, "adaptive": Adaptive}

__all__ = ["POLICIES", "Adaptive", "AdaptiveSpec", "Adrenaline", "AdrenalineSpec", "Bound", "Decision", "Fixed",
           "PairView", "Policy", "Rule", "make_policy", "offload_bound"]


def make_policy(rule: Rule) -> Policy:
    """The policy object for one pairing (it keeps the controller's state)."""
    return POLICIES[rule.policy](rule)
