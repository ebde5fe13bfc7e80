"""The scheduler's side of remote attention: requests whose KV lives on an attention executor.

Kept apart from the batching loop (`scheduler.py`): which remote rows a step plans, how a request's
KV leaves the local pool, and how a request comes back when its executor drops it or is lost (it is
recomputed from its tokens, like a preempted request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.kvcache.allocator import PageAllocator
from sglang_ext.offload.remote import RemoteAttention
from sglang_ext.offload.sender import Offloader
from sglang_ext.sampling.sampler import Sampler
from sglang_ext.scheduler.batch_builder import Entry
from sglang_ext.scheduler.kv_manager import KVManager
from sglang_ext.scheduler.request import Req, ReqStatus

logger = logging.getLogger(__name__)


class RemoteRows:
    offload: Offloader | None
    kv: KVManager
    allocator: PageAllocator
    running: list[Req]
    waiting: list[Req]
    num_preemptions: int
    forward_rows: int
    remote_forward_rows: int
    clock: Callable[[], float]
    sampler: Sampler
    runner: ModelRunner

    def _plan_remote(self, entries: list[Entry], ahead: int = 0) -> list[Entry]:
        """Tell the executor this step's remote rows (at kv_len + ahead); rows it cannot grow are
        recomputed locally. Raises ExecutorLost."""
        remote = [e.req for e in entries if e.req.remote is not None]
        if remote:
            assert self.offload is not None
            dropped = self.offload.begin_step(remote, ahead)
            for r in dropped:
                logger.info("executor full: %s is recomputed locally", r.rid)
                self._requeue(r)
            gone = {id(r) for r in dropped}
            entries = [e for e in entries if id(e.req) not in gone]
            self.remote_forward_rows += len(remote) - len(gone)
        self.forward_rows += len(entries)  # every forward's rows pass here (the step profile's "rows")
        return entries

    def _lose_executor(self, why: str) -> None:
        """The executor is gone: every request there is recomputed locally."""
        assert self.offload is not None
        for r in self.offload.lose_executor(why):
            self._requeue(r)

    def _forged(self, remote: list[Req], via: RemoteAttention | None, upto: int | None = None) -> set[int]:
        """After a step landed: the ids of its `remote` rows' requests when those rows may hold no
        executor results (the executor died mid-step and the sender's watchdog let the step through:
        `results_forged`). Their tokens must be dropped and the requests recomputed; the executor is
        given up first if it is still the one in force. Empty when the results are the executor's.
        `upto`: the transport's `begins` when the step was planned."""
        if via is None or not remote or not via.results_forged(upto):
            return set()
        if self.offload is not None and self.offload.remote is via and self.offload.active:
            self._lose_executor(f"executor {via.executor_id} died mid-step")
        return {id(r) for r in remote}

    def _drop_forged(self, r: Req) -> None:
        """A request whose landed token was forged: the device's penalty statistics counted it, so
        its slot is rebuilt from its real tokens when it samples again."""
        if r.penalty_slot >= 0:
            self.sampler.penalties.release(r.penalty_slot)
            r.penalty_slot = -1

    def set_offload(self, offload: Offloader | None) -> None:
        """Another executor, or none (a router's directive, between steps): requests still on the
        current one are released there and recomputed here."""
        old, self.offload = self.offload, offload
        if offload is not None:
            offload.context_len = self.runner.context_len
        if old is None or old is offload:
            return
        for r in list(old.reqs.values()):
            old.release(r)
            self._requeue(r)
        old.active = False

    def adopt_remote(self, r: Req, handle: int) -> bool:
        """Adrenaline placement: a request queued by `add_prefilled` (its first token in hand, no KV
        staged) whose prompt KV the prefill worker left in its executor under `handle`. It is
        admitted as a remote row (no local pages) and decodes there. False when the offloader in
        force cannot take it (the caller then lets it recompute its prompt here)."""
        if self.offload is None or not self.offload.adopt(r, handle):
            return False
        r.kv_len, r.admitted = len(r.input_ids), True
        return True

    def _admit_remote(self, r: Req) -> int:
        """Admission of an adopted request: no pages to find; it decodes with the others (0)."""
        self.waiting.remove(r)
        r.start_running(self.clock())
        self.running.append(r)
        return 0

    def _requeue(self, r: Req) -> None:
        """A remote request whose executor KV is gone: back to the queue head, recomputed. (With a
        step in flight, the overlap scheduler still lands that step's token for it.)"""
        r.remote = None
        r.pages, r.cached_pages, r.prefix_node, r.kv_len, r.admitted = [], 0, None, 0, False
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:  # adopted (Adrenaline placement) but not admitted yet
            self.waiting.remove(r)
        r.status = ReqStatus.WAITING
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, r)

    def _drop_local_kv(self, r: Req) -> None:
        """The request's KV now lives on the executor: publish its prompt pages to the prefix
        cache, free its own pages, and keep its length."""
        kv_len = r.kv_len
        self.kv.release(r, keep_in_cache=True)
        r.kv_len, r.admitted = kv_len, True

    def _release_kv(self, r: Req) -> None:
        if r.remote is not None:
            assert self.offload is not None
            self.offload.release(r)
            r.kv_len, r.admitted = 0, False
        else:
            self.kv.release(r, keep_in_cache=True)
