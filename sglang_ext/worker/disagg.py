"""A worker's part in prefill/decode disaggregation, driven by the router's messages
(docs/architecture.md, "Prefill/decode disaggregation"):

    decode worker:   KVPairOpen -> a KVReceiver thread for that prefill worker; a request
                     (disagg.role=decode) waits for its room's KV, then joins the scheduler
    prefill worker:  KVPairConnect -> a KVSender thread to that decode worker; a request
                     (disagg.role=prefill) is handed off after its first token: its pages go to the
                     sender thread and are freed once sent (Adrenaline placement: adrenaline.py)

Threads report through `events` (drained on the forward thread by `poll`) and wake the worker's loop
with `notify`; every scheduler call stays on the forward thread.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch

from sglang_ext.disagg import staged
from sglang_ext.disagg.transfer import KVArrival, KVReceiver, KVSender, SendJob
from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.messages import Disagg, ErrorOut, KVPairConnect, KVPairOpen, ReplyOut
from sglang_ext.messages.io import KVTransferStats
from sglang_ext.offload.sender import reserve_tokens
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.transport.link import open_store, pair_backend
from sglang_ext.worker.adrenaline import Placer, drop_placed

logger = logging.getLogger(__name__)
LOST_STATUS: Final = 503
ORPHAN_S: Final = 120.0  # KV that landed for a request this worker never got (or that was aborted)
CLOSE_GRACE_S: Final = 2.0  # at exit: how long pair threads get to end (a peer's Close takes a round trip)


class PairGone(RuntimeError):
    """A request names a KV pair this worker does not have (it ended, or never opened): a 503, which
    the router answers by placing the request again."""


@dataclass
class _Expect:
    req: Req
    pairing: str


class WorkerDisagg:
    def __init__(self, mode: str, runner: ModelRunner, worker_id: str) -> None:
        self.mode = mode
        self.runner = runner
        self.worker_id = worker_id
        self.address = "127.0.0.1"  # where prefill workers reach this one (the interface toward the router)
        self.events: queue.SimpleQueue[tuple[str, object, object]] = queue.SimpleQueue()
        self.posted = threading.Event()  # set with every event (settle waits on it)
        self.notify: Callable[[], None] = lambda: None
        # prefill side
        self.senders: dict[str, KVSender] = {}  # pairing -> its sender
        self.prefilling: dict[str, Disagg] = {}  # rid -> where its KV goes, until handed off
        self.sending: dict[str, tuple[str, int]] = {}  # rid -> (the decode worker, bytes), while its KV goes
        self.placer = Placer(runner.pool)  # Adrenaline placement (given its executor host by the worker)
        # decode side
        self.receivers: dict[str, KVReceiver] = {}  # pairing -> its receiver
        self.expecting: dict[tuple[str, int], _Expect] = {}  # (pairing, room) -> the request waiting
        self.arrived: dict[tuple[str, int], tuple[KVArrival, float]] = {}  # landed before its request
        self.dropped: dict[tuple[str, int], float] = {}  # aborted while its KV was on the way
        self.counts = KVTransferStats()  # the load report's part, cumulative

    def _post(self, kind: str, a: object, b: object = None) -> None:  # any thread
        self.events.put((kind, a, b))
        self.posted.set()
        self.notify()

    # ---- pairs ----------------------------------------------------------------------------------
    def open_pair(self, msg: KVPairOpen) -> ReplyOut:
        """Decode side: receive from prefill worker `msg.peer` over a new pair."""
        if msg.pairing in self.receivers:
            return ReplyOut(rid=msg.rid, ok=False, data={"error": f"pairing {msg.pairing} is open already"})
        backend, wire = pair_backend(self.runner.device, torch.device(msg.peer_device))
        stage = self._stage(msg) if backend == "nccl" else None
        if stage is not None:
            backend, wire = staged.BACKEND, torch.device("cpu")  # headers on gloo, pages as peer copies
        try:
            store, listener = open_store(self.address)
        except (OSError, RuntimeError) as e:
            return ReplyOut(rid=msg.rid, ok=False, data={"error": f"cannot open a rendezvous on {self.address}: {e}"})
        self.receivers[msg.pairing] = KVReceiver(
            msg.pairing, msg.peer, self.runner.pool.geometry, store, listener, backend, wire, self.address,
            msg.timeout_s, on_kv=lambda a: self._post("kv", a), on_end=lambda p, why: self._post("end", p, why),
            stage=stage)
        logger.info("receiving KV from prefill worker %s (pairing %s, %s)", msg.peer, msg.pairing, backend)
        return ReplyOut(rid=msg.rid, ok=True, data={"store": f"{self.address}:{store.port}", "backend": backend})

    def _stage(self, msg: KVPairOpen) -> tuple[torch.Tensor, bytes] | None:
        """A CUDA IPC stage for a pair between GPUs of one node (None: the pages go over NCCL)."""
        why = staged.ipc_unusable(self.runner.device, socket.gethostname(), os.getpid(), msg.peer_device,
                                  msg.peer_host, msg.peer_gpu, msg.peer_pid, self.runner.args.disable_pd_kv_ipc)
        if why is None:
            try:
                return staged.make_stage(self.runner.device, self.runner.pool.geometry.page_bytes)
            except (RuntimeError, ValueError) as e:  # torch.OutOfMemoryError is a RuntimeError
                why = f"no stage: {e}"
        logger.info("KV from prefill worker %s goes over NCCL, not CUDA IPC: %s", msg.peer, why)
        return None

    def connect(self, msg: KVPairConnect) -> None:
        """Prefill side: send to decode worker `msg.peer` over the pair at `msg.store`."""
        for pairing, s in list(self.senders.items()):
            if s.peer == msg.peer or pairing == msg.pairing:
                s.close()  # queued sends still go first; a broken pair fails them at once
                del self.senders[pairing]
        if msg.close:
            return
        self.senders[msg.pairing] = KVSender(msg.pairing, msg.peer, msg.store, msg.backend, self.runner.pool,
                                             msg.timeout_s, on_done=lambda rid, err: self._post("sent", rid, err))
        logger.info("sending KV to decode worker %s (pairing %s, %s)", msg.peer, msg.pairing, msg.backend)

    def close_pair(self, pairing: str) -> None:
        """Decode side: the router says the prefill side is down. Its receiver thread may be blocked on
        a hung peer, so requests waiting on it fail here (the thread, if it ever wakes, finds the
        pair gone and its KV is dropped)."""
        r = self.receivers.get(pairing)
        if r is not None:
            r.close()
            self._post("end", pairing, f"prefill worker {r.peer} is down")

    # ---- requests -------------------------------------------------------------------------------
    def expect(self, req: Req, d: Disagg) -> KVArrival | None:
        """Decode side: `req` waits for its KV; returns it if it landed already."""
        key = (d.pairing, d.room)
        got = self.arrived.pop(key, None)
        if got is not None:
            return got[0]
        if d.pairing not in self.receivers:
            raise PairGone(f"no KV pair {d.pairing} on decode worker {self.worker_id} (its prefill worker is gone)")
        self.expecting[key] = _Expect(req, d.pairing)
        return None

    def abort(self, rid: str) -> bool:
        self.prefilling.pop(rid, None)
        for key, e in list(self.expecting.items()):
            if e.req.rid == rid:
                del self.expecting[key]
                self.dropped[key] = time.monotonic()
                return True
        return False

    def hand_off(self, rid: str, first_token: int, scheduler: Scheduler) -> str | None:
        """Prefill side, after the step that gave `rid` its first token: queue its KV for the decode
        worker. Returns an error if it cannot go (the request is then aborted here)."""
        d = self.prefilling.pop(rid)
        sender = self.senders.get(d.pairing)
        if sender is None or sender.broken:
            scheduler.abort(rid, "no KV pair")
            why = sender.broken if sender is not None else "it is not connected"
            return f"prefill worker {self.worker_id} cannot send KV over pairing {d.pairing}: {why}"
        req = scheduler.handoff.hand_off(rid)
        assert req is not None
        n = len(req.input_ids)
        pages = req.pages[: -(-n // scheduler.page_size)]
        # kept here, in the executor (with pages for its longest): only the header goes
        if self.placer.place(rid, d, pages, n, reserve_tokens(req, self.runner.context_len)):
            self.sending[rid] = (sender.peer, 0)
            sender.submit(SendJob(rid, d.room, [], n, first_token, handle=d.handle))
            return None
        self.sending[rid] = (sender.peer, len(pages) * self.runner.pool.geometry.page_bytes)
        sender.submit(SendJob(rid, d.room, pages, n, first_token))
        return None

    def poll(self, scheduler: Scheduler, settle_s: float = 0.0) -> tuple[list[tuple[Req, KVArrival]], list[ErrorOut]]:
        """On the forward thread: what the threads reported. Returns the decode requests whose KV
        landed (to be started) and errors for requests that failed. With `settle_s`, waits up to that
        long for sends in flight to complete (a cache flush needs their pages back)."""
        ready, errors = self._drain(scheduler)
        deadline = time.monotonic() + settle_s
        while self.sending and (left := deadline - time.monotonic()) > 0:
            self.posted.wait(left)
            more = self._drain(scheduler)
            ready += more[0]
            errors += more[1]
        return ready, errors

    def _drain(self, scheduler: Scheduler) -> tuple[list[tuple[Req, KVArrival]], list[ErrorOut]]:
        self.posted.clear()
        ready: list[tuple[Req, KVArrival]] = []
        errors: list[ErrorOut] = []
        while not self.events.empty():
            kind, a, b = self.events.get()
            if kind == "sent":
                rid = str(a)
                peer, nbytes = self.sending.pop(rid, ("?", 0))
                scheduler.handoff.handed(rid)
                placed = self.placer.sent(rid, ok=b is None)  # kept in this worker's executor: no transfer
                if b is None:
                    if not placed:
                        self.counts.transfers_out += 1
                        self.counts.bytes_out += nbytes
                else:
                    errors.append(ErrorOut(rid=rid, message=f"the KV transfer to decode worker {peer} failed: {b}",
                                           status=LOST_STATUS))
            elif kind == "kv":
                assert isinstance(a, KVArrival)
                if not a.handle:
                    self.counts.transfers_in += 1
                    self.counts.bytes_in += a.kv.numel() * a.kv.element_size()
                if a.pairing not in self.receivers:
                    drop_placed(a.handle, scheduler)
                    continue  # the pair was closed meanwhile: its requests have failed already
                key = (a.pairing, a.room)
                if self.dropped.pop(key, None) is not None:
                    drop_placed(a.handle, scheduler)
                    continue
                e = self.expecting.pop(key, None)
                if e is None:
                    self.arrived[key] = (a, time.monotonic())
                else:
                    ready.append((e.req, a))
            elif kind == "end":
                pairing, why = str(a), str(b)
                r = self.receivers.pop(pairing, None)
                if r is None:
                    continue  # ended before (closed by the router, then its thread ended too)
                logger.info("KV pair %s from %s ended: %s", pairing, r.peer if r else "?", why)
                for key, e in list(self.expecting.items()):
                    if e.pairing == pairing:
                        del self.expecting[key]
                        errors.append(ErrorOut(rid=e.req.rid, status=LOST_STATUS, message=(
                            f"the prefill worker's KV for this request never arrived ({why})")))
        self._purge(scheduler)
        return ready, errors

    def refused(self, d: Disagg) -> None:
        """Decode side: a request refused here (a 400); its KV, if the prefill worker sends it, is dropped."""
        self.dropped[(d.pairing, d.room)] = time.monotonic()

    def _purge(self, scheduler: Scheduler) -> None:
        old = time.monotonic() - ORPHAN_S
        for key in [k for k, (_, t) in self.arrived.items() if t < old]:
            drop_placed(self.arrived.pop(key)[0].handle, scheduler)
        for key in [k for k, t in self.dropped.items() if t < old]:
            del self.dropped[key]

    def close(self, grace_s: float = CLOSE_GRACE_S) -> bool:
        """At exit: end every pair and wait up to `grace_s` for their threads. Returns True when all
        ended; False when one is still blocked in a torch.distributed wait (a receiver whose prefill
        worker stays up and silent, a send to a hung peer). Such a thread must not outlive the
        interpreter's teardown: CPython ends a daemon thread that wakes then with pthread_exit, whose
        forced unwind through torch's C++ frames (pybind11 releasing the GIL) calls std::terminate --
        `terminate called without an active exception` and SIGABRT at every PD shutdown. Nor can it
        be woken: neither dropping nor aborting a gloo group ends a receive posted on it; only the
        peer's Close or its exit does. So the caller skips the teardown when this returns False."""
        for s in self.senders.values():
            s.close()  # its thread sends Close after what is queued: the peer's receiver ends cleanly
        # A receiver ends at its prefill worker's Close (that worker stops too, in a cluster shutdown) or
        # when that worker's process goes (its sockets close).
        deadline = time.monotonic() + grace_s
        threads = [x.thread for x in self.senders.values()] + [x.thread for x in self.receivers.values()]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for r in self.receivers.values():
            r.close()
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            logger.info("KV pair threads still waiting on their peers after %.1f s: %s; exiting without "
                        "interpreter teardown", grace_s, ", ".join(stuck))
        return not stuck
