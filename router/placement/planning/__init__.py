"""Offload policies for a cluster file's `offload:` entries: `make_policy` picks the class named by the entry's
`policy:`. The policies themselves are pure code in sglang_ext/offload/planning/ (the worker's in-process
executor runs the same classes, `--offload-policy`); what they decide:

    fixed       WEAVER: the entry's `ratio`, always
    adrenaline  Adrenaline's upper bound OB(n, B_max) from the executor's KV capacity and bandwidth
                share and the batch at which the sender's dense kernels turn compute-bound; the
                sender applies C1/C2 (sglang_ext/offload/conditions.py) under it
    adaptive    a controller: lowers the share after the receiving worker misses its TPOT SLO,
                raises it with slack (bounded steps, hysteresis, at most one change per interval)

A policy is a small object per pairing that turns a `PairView` (built from the registry at each
decision, so a lost event costs nothing but a late decision) into a `Decision`. The planner
(router/placement/offload.py, through steer.py) asks it on events and sends what changed to the sender (OffloadRatio).
"""

from __future__ import annotations

from sglang_ext.offload.planning import (
    Adaptive,
    Adrenaline,
    Bound,
    Decision,
    Fixed,
    PairView,
    Policy,
    make_policy,
    offload_bound,
)

__all__ = ["Adaptive", "Adrenaline", "Bound", "Decision", "Fixed", "PairView", "Policy", "make_policy",
           "offload_bound"]

