"""`RemoteResidency`, a scheduler member: requests whose KV lives on an attention executor (home REMOTE):
remote attention's rows.

Which remote rows a step plans, how a request's KV leaves the local pool, and how a request comes
back when its executor drops it or is lost: recomputed from its tokens, like a preempted request.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from sglang_ext.offload.remote import RemoteAttention
from sglang_ext.offload.sender import RemoteSender
from sglang_ext.scheduler.batch_builder import Entry
from sglang_ext.scheduler.member import Residency
from sglang_ext.scheduler.request import KVHome, Req
from sglang_ext.scheduler.view import LoopView

logger = logging.getLogger(__name__)


class Sampled(NamedTuple):
    """A sampled step's remote rows and the transport they attended through (`RemoteResidency.transport`)."""

    remote: list[Req]
    via: RemoteAttention | None
    begins: int  # the transport's `begins` then


class RemoteResidency(Residency):
    home = KVHome.REMOTE
    pooled = False  # its KV grows on the executor; admitted without pages here

    def __init__(self, s: LoopView) -> None:
        self.s = s
        self.sender: RemoteSender | None = None

    # ---- member hooks ---------------------------------------------------------------------------
    def admit(self, r: Req, budget: int, reserve: int) -> int | None:
        """An adopted request (its KV on an executor already): no pages to find; it decodes with the
        others (0)."""
        self.s.start_running(r, self.s.waiting)
        return 0

    def release(self, r: Req) -> None:
        if r.home is KVHome.REMOTE:
            assert self.sender is not None
            self.sender.release(r)
            r.kv_len, r.admitted, r.home = 0, False, KVHome.LOCAL

    # ---- moving requests ------------------------------------------------------------------------
    def set_sender(self, sender: RemoteSender | None) -> None:
        """Another executor, or none (a router's directive, between steps): requests still on the
        current one are released there and recomputed here."""
        old, self.sender = self.sender, sender
        if sender is not None:
            sender.context_len = self.s.runner.context_len
        if old is None or old is sender:
            return
        for r in list(old.reqs.values()):
            old.release(r)
            self.requeue(r)
        old.active = False

    def adopt(self, r: Req, handle: int) -> bool:
        """Adrenaline placement: a request queued by `Handoff.add_prefilled` (its first token in hand, no
        KV staged) whose prompt KV the prefill worker left in its executor under `handle` is admitted as
        a remote row (no local pages). False when the sender in force cannot take it (the caller
        then lets it recompute its prompt here)."""
        if self.sender is None or not self.sender.adopt(r, handle):
            return False
        r.kv_len, r.admitted, r.home = len(r.input_ids), True, KVHome.REMOTE
        return True

    def choose(self, decoders: list[Req]) -> None:
        """Move the decoders the sender chooses to its executor: their prompt pages go to the
        prefix cache, their own pages are freed, and they keep their length."""
        if self.sender is None:
            return
        for r in self.sender.choose(decoders):
            kv_len = r.kv_len
            self.s.release_kv(r)  # still LOCAL here: frees its pages
            r.kv_len, r.admitted, r.home = kv_len, True, KVHome.REMOTE

    def requeue(self, r: Req) -> None:
        """A remote request whose executor KV is gone: back to the queue head, recomputed. (With a
        step in flight, that step's token for it still lands: `Overlap._take`.)"""
        s = self.s
        r.remote, r.home = None, KVHome.LOCAL
        r.pages, r.cached_pages, r.prefix_node, r.kv_len, r.admitted = [], 0, None, 0, False
        if r in s.running:
            s.running.remove(r)
        if r in s.waiting:  # adopted (Adrenaline placement) but not admitted yet
            s.waiting.remove(r)
        s.requeue(r)

    # ---- steps ----------------------------------------------------------------------------------
    def plan(self, entries: list[Entry], ahead: int = 0) -> list[Entry]:
        """Tell the executor this step's remote rows (at kv_len + ahead); rows it cannot grow are
        recomputed locally. Raises ExecutorLost."""
        remote = [e.req for e in entries if e.req.home is KVHome.REMOTE]
        if not remote:
            return entries
        assert self.sender is not None
        dropped = self.sender.begin_step(remote, ahead)
        for r in dropped:
            logger.info("executor full: %s is recomputed locally", r.rid)
            self.requeue(r)
        gone = {id(r) for r in dropped}
        self.s.remote_forward_rows += len(remote) - len(gone)
        return [e for e in entries if id(e.req) not in gone]

    def lose_executor(self, why: str) -> None:
        """The executor is gone: every request there is recomputed locally."""
        assert self.sender is not None
        for r in self.sender.lose_executor(why):
            self.requeue(r)

    def transport(self, reqs: list[Req]) -> Sampled:
        """For a step over `reqs` about to sample: its remote rows, the transport they attended
        through and its `begins` now (to check the rows' results when the step lands)."""
        remote = [r for r in reqs if r.home is KVHome.REMOTE]
        via = self.sender.remote if self.sender is not None and remote else None
        return Sampled(remote, via, via.begins if via is not None else 0)

    def forged(self, sampled: Sampled, upto: int | None = None) -> set[int]:
        """After a step landed: the ids of its remote rows' requests when those rows may hold no
        executor results (the executor died mid-step and the sender's watchdog let the step through:
        `results_forged`). Their tokens must be dropped (their penalty slots are) and the requests
        recomputed; the executor is given up first if it is still the one in force. Empty when the
        results are the executor's. `upto`: the transport's `begins` when the step was planned."""
        remote, via = sampled.remote, sampled.via
        if via is None or not remote or not via.results_forged(upto):
            return set()
        if self.sender is not None and self.sender.remote is via and self.sender.active:
            self.lose_executor(f"executor {via.executor_id} died mid-step")
        for r in remote:
            self.s.drop_penalties(r)  # the device's statistics counted a token that is dropped
        return {id(r) for r in remote}
