"""Adrenaline placement on the router: which disaggregated requests keep their KV on the prefill
worker, whose executor then runs their decode attention for the decode worker (Adrenaline).

The router decides, at placement, because it is the one party that knows both legs before either
starts: the prefill worker must know when its prefill ends whether to keep the KV, and the decode
worker must know which executor handle the request will have. A request goes there when the decode
worker's pairing (an `offload:` entry with from == to, offload.py here) is active with this very
prefill worker as its executor, and the requests already placed there, among those in flight on the
decode worker, stay within the pairing's share (its policy's ratio in force). Both legs then carry
`Disagg.executor_pairing` and a `handle` unique on the router (above the range a sender's own
offloader numbers its requests in). Everything else follows the plain PD path, and a prefill worker
whose executor is full sends the KV as usual.

Under the `adrenaline` policy the request must also meet the paper's C1/C2 (offload/conditions.py) under the
policy's OB, with the loads the router sees: KV tokens (prompt + tokens streamed so far) and counts of
the decode worker's in-flight requests, split into those placed on the executor and the others.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Final

from router.placement.base import KeptKV
from router.placement.pairing import Pairing
from router.tracker import RequestState, WorkerState
from sglang_ext.offload.conditions import Loads, should_offload

HANDLE_BASE: Final = 1 << 40  # a RemoteSender numbers the requests it moves itself from 1


class AdrenalinePlacer:
    """`pairings`: the offload strategy's, by sender (decode worker) id."""

    def __init__(self, pairings: Mapping[str, Pairing]) -> None:
        self.pairings = pairings
        self.placed: dict[str, set[str]] = {}  # offload pairing -> rids placed there (pruned lazily)
        self._handles = itertools.count(1)

    def choose(self, rid: str, prefill: WorkerState, decode: WorkerState) -> KeptKV | None:
        """Whether request `rid` (already counted in `decode.inflight`) keeps its KV on `prefill`."""
        p = self.pairings.get(decode.worker_id)
        if p is None or p.rule.from_ != p.rule.to or p.state != "active" or p.executor != prefill.worker_id:
            return None
        ratio = p.sent[0] if p.sent is not None else p.rule.start
        there = self.placed.setdefault(p.pairing_id, set())
        there.intersection_update(decode.inflight)  # finished, failed or retried ones left
        if len(there) + 1 > ratio * len(decode.inflight) + 1e-9:
            return None
        decision = getattr(p, "decision", None)
        if decision is not None and decision.ob is not None and not _meets_c1_c2(rid, there, decode, decision.ob):
            return None
        there.add(rid)
        return KeptKV(p.pairing_id, HANDLE_BASE + next(self._handles))


def _kv_tokens(st: RequestState) -> int:
    return (st.prompt_tokens or st.est_prompt_tokens) + st.completion_tokens


def _meets_c1_c2(rid: str, placed: set[str], decode: WorkerState, ob: float) -> bool:
    """Adrenaline's C1/C2 for request `rid` on `decode` (placed: those already on the executor)."""
    new = decode.inflight.get(rid)
    if new is None:
        return False
    remote = [st for r, st in decode.inflight.items() if r in placed]
    local = [st for r, st in decode.inflight.items() if r not in placed and r != rid]
    loads = Loads(sum(map(_kv_tokens, remote)), len(remote), sum(map(_kv_tokens, local)), len(local))
    return should_offload(loads, new.est_prompt_tokens + new.max_new_tokens, new.est_prompt_tokens, ob)
