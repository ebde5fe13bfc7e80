"""The sender's scheduler-side part of remote attention (`RemoteSender`).

Requests are offloaded whole, when their prefill is done: the KV computed locally (prefix pages
included, so attention is entirely remote and needs no merge) is copied to the executor, the
request's own pages are freed and its prompt pages stay in the prefix cache for others. From then
on its new tokens' KV is appended on the executor. A request keeps its executor until it finishes;
if the executor drops it (no room to grow) or is lost, it is recomputed locally from its tokens,
which gives the same greedy output.

Each request is chosen once, at its first decode step. Policies `fixed` (WEAVER) and `adaptive`:
keep `ratio` of the decoding requests remote (the router moves `ratio` for `adaptive`). A step's newly
decoding requests are considered longest first (by KV tokens; ties in arrival order): moving a row
saves its attention, which grows with its context, while the exchange a remote row costs does not, so
when the share lets only some go it is the longest contexts that pay. Policy
`adrenaline` (`ob` set): a request goes out when it meets C1/C2 under the bound `ob`
(conditions.py), and `ratio` still caps the share. A router's OffloadRatio changes `ratio` and
`ob` between steps; requests already out stay out.

Adrenaline placement (`placed_only`): the executor is a prefill worker of this model, which kept the
KV of the requests the router chose there after their prefill; such a request arrives already remote
(`adopt`, under the handle the router gave it) and `choose` moves none of the local ones.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

import torch

from sglang_ext.kvcache.pool import KVPool
from sglang_ext.offload.conditions import Loads, should_offload
from sglang_ext.offload.remote import RemoteAttention
from sglang_ext.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class Offloadable(Protocol):
    """What the sender reads and sets of a scheduler's request (scheduler/request.py's Req)."""

    input_ids: list[int]
    sampling: SamplingParams
    pages: list[int]  # its KV pages in the local pool
    kv_len: int  # tokens of KV it has
    remote: int | None  # its handle on the executor, while offloaded
    offload_checked: bool  # considered for offload once, at its first decode
    attention_executor: str | None  # where its attention ran (meta_info)


R = TypeVar("R", bound=Offloadable)


def reserve_tokens(r: Offloadable, context_len: int | None = None) -> int:
    """KV tokens an executor sets pages aside for when it takes `r`: its longest (prompt and every
    new token, one more for a row planned past a stop under overlap; the context length caps it),
    so that planning its steps never needs a page -- a step is then never short of a row the sender
    already posted."""
    n = len(r.input_ids) + r.sampling.max_new_tokens + 1
    return n if context_len is None else min(n, context_len + 1)


def longest_first(candidates: Iterable[R]) -> list[R]:
    """Candidates by KV tokens, largest first; `sorted` is stable, so equal lengths keep their order
    (arrival: the scheduler's running list)."""
    return sorted(candidates, key=lambda r: r.kv_len, reverse=True)


class RemoteSender(Generic[R]):
    def __init__(self, remote: RemoteAttention, ratio: float, pool: KVPool, ob: float | None = None,
                 placed_only: bool = False) -> None:
        self.remote = remote
        self.placed_only = placed_only
        self.ratio = ratio
        self.ob = ob  # Adrenaline's OB (offloaded over local KV tokens); None: the share alone decides
        self.pool = pool
        self.active = True
        self._handles = itertools.count(1)
        self.reqs: dict[int, R] = {}  # handle -> request, while offloaded
        self.context_len: int | None = None  # the sender's (the scheduler sets it): caps reservations

    @property
    def num_remote(self) -> int:
        return len(self.reqs)

    def choose(self, decoding: Iterable[R]) -> list[R]:
        """Offload newly decoding requests, longest first, while the remote share is under `ratio`
        (and, for `adrenaline`, C1/C2 hold); returns those moved (their local pages are for the caller
        to give back)."""
        if not self.active or self.placed_only:
            return []
        decoding = list(decoding)
        total = len(decoding)
        # Adrenaline's LR: the locally decoding requests already decided (a new one joins when it stays)
        local = [r for r in decoding if r.remote is None and r.offload_checked]
        loads = [sum(r.kv_len for r in local), len(local)]
        moved: list[R] = []
        for r in longest_first(r for r in decoding if r.remote is None and not r.offload_checked):
            r.offload_checked = True
            go = self.num_remote + 1 <= self.ratio * total + 1e-9
            if go and self.ob is not None:
                state = Loads(sum(q.kv_len for q in self.reqs.values()), self.num_remote, loads[0], loads[1])
                go = should_offload(state, len(r.input_ids) + r.sampling.max_new_tokens, r.kv_len, self.ob)
            if go and self._load(r):
                moved.append(r)
            else:
                loads[0] += r.kv_len
                loads[1] += 1
        return moved

    def _load(self, r: R) -> bool:
        ps = self.pool.page_size
        n = -(-r.kv_len // ps)
        idx = torch.tensor(r.pages[:n], dtype=torch.long).to(self.pool.device, non_blocking=True)
        kv = self.pool.data.index_select(0, idx)
        handle = next(self._handles)
        if not self.remote.load(handle, kv, r.kv_len, reserve_tokens(r, self.context_len)):
            return False  # the executor is full: the request stays local
        r.remote = handle
        r.attention_executor = self.remote.executor_id
        self.reqs[handle] = r
        return True

    def adopt(self, r: R, handle: int) -> bool:
        """Adrenaline placement: `r`'s prompt KV is on the executor already (the prefill worker put it
        there under `handle`); False if this executor can take no request now."""
        if not self.active or not self.remote.alive or handle in self.reqs:
            return False
        r.remote, r.offload_checked = handle, True
        r.attention_executor = self.remote.executor_id
        self.reqs[handle] = r
        return True

    def release(self, r: R) -> None:
        """The request finished or is being recomputed: free its executor pages."""
        if r.remote is None:
            return
        self.reqs.pop(r.remote, None)
        if self.active:
            self.remote.release(r.remote)
        r.remote = None

    def begin_step(self, reqs: list[R], ahead: int = 0) -> list[R]:
        """Plan a step's remote rows (each writes position kv_len + ahead: `ahead` is 1 for a step
        planned while the one before it is still in flight); returns the requests the executor
        dropped (no room to grow), already released there."""
        by_handle: dict[int, R] = {}
        for r in reqs:
            assert r.remote is not None, "a remote row without a handle"
            by_handle[r.remote] = r
        failed = self.remote.begin_step(list(by_handle), [r.kv_len + ahead for r in reqs])
        dropped = [by_handle[h] for h in failed]
        for h in failed:
            self.reqs.pop(h, None)
            by_handle[h].remote = None
        return dropped

    def lose_executor(self, why: str) -> list[R]:
        """The executor is gone: stop offloading; every offloaded request must be recomputed."""
        logger.error("attention executor %s lost (%s): its %d request(s) are recomputed locally and new "
                     "requests stay local", self.remote.executor_id, why, len(self.reqs))
        self.active = False
        self.remote.alive = False
        lost = list(self.reqs.values())
        for r in lost:
            r.remote = None
        self.reqs.clear()
        return lost
