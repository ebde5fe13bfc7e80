"""The router's control plane: one ZeroMQ ROUTER socket that workers connect to, in the asyncio loop.

    HTTP handlers ── submit() ──> outbox ──> sender task ──> ROUTER ──> worker DEALERs
                 <── Submission.sink <── receive task <───────┘
    monitor task: a worker silent for `heartbeat_timeout_s` is marked down and its requests fail (503)

A request a worker fails before its client got any output is placed again, after a backoff, up to
`max_retries` times; workers whose circuit breaker is open are not placed on (router/resilience/).

Every message is a msgspec Struct, decoded strictly; a malformed one is dropped and logged.
Nothing here runs per iteration: work happens when a message, a request or a timeout arrives.
Placement over two workers (prefill/decode) and the links between workers it needs are the placement
strategies' (router/placement/): the core calls them through `PlacementStrategy` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from router.config import OffloadSpec, RouterConfig, SloSpec
from router.events import (
    EventBus,
    FirstToken,
    LoadReported,
    RequestArrived,
    RequestFinished,
    SloMissed,
    WorkerDown,
    WorkerUp,
)
from router.limit_spec import ApiKey, LimitSpec
from router.metrics import RouterMetrics
from router.placement.base import KeptKV, Placement
from router.placement.strategies import build_strategies
from router.registry import Balancer, ModelEntry, Registry
from router.resilience.hub import Resilience
from router.routing.balancer import ModelRouting
from router.routing.keys import route_key
from router.tracker import Failure, Item, RequestState, Restart, Submission, WorkerState
from sglang_ext.messages import (
    AbortReq,
    BatchOut,
    Disagg,
    ErrorOut,
    FlushCacheReq,
    GenerateReq,
    HelloReq,
    LoadReport,
    ReplyOut,
    ShutdownReq,
    TokenOut,
    WorkerHello,
    decode_from_worker,
    encode,
)

logger = logging.getLogger(__name__)
_MONITOR_PERIOD_S = 0.25
_HELLO_REQ_PERIOD_S = 2.0


def _names(rid: str, req_rid: str) -> bool:
    """Does an abort of `rid` reach the request `req_rid`: itself, or one of its n samples (`rid-k`)."""
    return req_rid == rid or (bool(rid) and req_rid.startswith(f"{rid}-") and req_rid[len(rid) + 1:].isdigit())


def prefix_key(req: GenerateReq) -> str | None:
    """The prompt as a routing key, for the balancer's policy (router/routing/keys.py)."""
    return route_key(req)


class NoWorker(RuntimeError):
    """No worker of the model is up (HTTP 503); `retry_after`: seconds until one may take requests
    again, when that is known (circuit breakers that will let a trial through)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Router:
    def __init__(self, config: RouterConfig, balancer: Balancer | None = None,
                 slo: Mapping[str, SloSpec] | None = None, offload: Sequence[OffloadSpec] = (),
                 limits: Mapping[str, LimitSpec] | None = None, api_keys: Sequence[ApiKey] = ()) -> None:
        self.config = config
        self.slo = dict(slo or {})  # per model name (the cluster file's `slo:`)
        self.registry = Registry()
        # The cluster file's per-model routing comes in `balancer` (server.py); else the router-wide one.
        self.balancer = balancer or ModelRouting(config.routing_defaults)
        self.bus = EventBus()
        self.metrics = RouterMetrics(lambda: self.registry.workers.values())
        # retries, circuit breakers, admission limits (limits: per model name, the cluster file's `limits:`)
        self.resilience = Resilience(config, self.metrics.registry, lambda: self.registry.workers.values(),
                                     limits, api_keys)
        self.requests: dict[str, RequestState] = {}
        self._replies: dict[str, asyncio.Future[ReplyOut]] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._outbox: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._hello_asked: dict[str, float] = {}  # unknown identity -> when we last asked it to say hello
        self.ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.worker_addr = ""
        self.started = time.time()
        self.strategies = build_strategies(self, offload)  # offload: the cluster file's entries
        self._unsubscribe: list[Callable[[], None]] = []
        self._rooms = itertools.count(1)  # names a request's KV transfer on its pair's wire
        # Workers reached otherwise than over the socket (`url:` workers, router/upstream/): how to send to
        # each; they answer through `receive`, and their health is their own (no heartbeats).
        self.links: dict[str, Callable[[msgspec.Struct], None]] = {}

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        sock = self.sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker errors instead of vanishing
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker may reuse its id at once
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        host, port = self.config.worker_host, self.config.worker_port
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self.worker_addr = f"tcp://{host}:{port}"
        self._tasks = [asyncio.create_task(t) for t in (self._recv_loop(), self._send_loop(), self._monitor())]
        self._unsubscribe = [self.bus.on(s.on_event, *s.events) for s in self.strategies]

    def fail_all(self, message: str, status: int = 503) -> None:
        for st in list(self.requests.values()):
            self._fail(st, status, message)

    async def stop(self, shutdown: Collection[str] = ()) -> None:
        """Fail what is running and close; workers in `shutdown` (the launcher's own) are told to
        exit. Workers that joined by themselves stay up, to rejoin the next router on this address."""
        self.fail_all("the server is shutting down")
        for unsubscribe, s in zip(self._unsubscribe, self.strategies, strict=False):
            unsubscribe()
            s.close()
        self._unsubscribe = []
        for wid in shutdown:
            w = self.registry.workers.get(wid)
            if w is not None and w.up:
                self.send(wid, ShutdownReq())
        # Let the sender drain (shutdown and abort messages) before closing the socket.
        for _ in range(20):
            if self._outbox.empty():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the last message taken may still be on its way out
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self.sock is not None:
            self.sock.close(0)
        if self.ctx is not None:
            self.ctx.term()
        self.sock = self.ctx = None

    # ---- sending ------------------------------------------------------------------------------
    def send(self, worker_id: str, msg: msgspec.Struct) -> None:
        """Queue a message; never blocks, so it is safe in `finally` blocks of cancelled handlers."""
        link = self.links.get(worker_id)
        if link is not None:
            link(msg)
            return
        self._outbox.put_nowait((worker_id, encode(msg)))

    async def _send_loop(self) -> None:
        assert self.sock is not None
        while True:
            worker_id, buf = await self._outbox.get()
            try:
                await self.sock.send_multipart([worker_id.encode(), buf])
            except zmq.ZMQError as e:
                # EHOSTUNREACH: the worker's connection is gone; its heartbeat timeout will follow.
                logger.warning("cannot send to worker %s: %s", worker_id, e)
                w = self.registry.workers.get(worker_id)
                if w is not None:
                    why = f"worker {worker_id} of model {w.model} is not connected"
                    if w.inflight:
                        self.resilience.breakers.failure(worker_id, why)
                    for st in list(w.inflight.values()):
                        if st.decode is not None and not st.handed:
                            self._pair_broken(st.pairing, why)
                        # A request that sent the client nothing goes elsewhere, whole or not: the
                        # router may pick a killed worker in the seconds before its heartbeat lapses.
                        if self._retry(st, why, suspect=worker_id):
                            continue
                        self._fail(st, 503, why)

    # ---- placement strategies -----------------------------------------------------------------
    def describe_placement(self) -> dict[str, list[dict[str, Any]]]:
        """Each strategy's links, under its `info_key` (as /get_server_info shows them)."""
        return {s.info_key: s.describe() for s in self.strategies}

    def _keep_kv(self, rid: str, prefill: WorkerState, decode: WorkerState) -> KeptKV | None:
        for s in self.strategies:
            kept = s.keep_kv(rid, prefill, decode)
            if kept is not None:
                return kept
        return None

    def _pair_broken(self, pairing: str, why: str) -> None:
        for s in self.strategies:
            s.pair_broken(pairing, why)

    # ---- requests -----------------------------------------------------------------------------
    def new_rid(self) -> str:
        return f"r-{self._prefix}-{next(self._ids)}"

    def pick(self, model: ModelEntry, prefix_key: str | None = None, avoid: Collection[str] = ()) -> WorkerState:
        """An up worker of the model for a whole request, never one whose circuit is open; those in
        `avoid` only if nothing else is up."""
        up = model.up_workers
        allowed = [w for w in up if self.resilience.breakers.allows(w.worker_id)]
        candidates = [w for w in allowed if w.worker_id not in avoid] or allowed
        if not candidates:
            if up:  # all held out by their circuit breakers: open, or half-open with a trial in flight
                b = self.resilience.breakers
                wait = max(1.0, b.retry_in(w.worker_id for w in up))
                states = ", ".join(f"{w.worker_id} {b.state(w.worker_id).name.lower().replace('_', '-')}" for w in up)
                raise NoWorker(f"every up worker of model {model.name!r} is held out by its circuit breaker after "
                               f"repeated failures ({states}); try again in {wait:.0f} s", retry_after=wait)
            raise NoWorker(f"no worker of model {model.name!r} is up; try again later")
        return self.balancer.pick(candidates, prefix_key)

    def place(self, model: ModelEntry, prefix_key: str | None = None, avoid: Collection[str] = ()) -> Placement:
        """A prefill worker and a decode worker over an active KV pair of the model, or else one worker
        (whatever its role) for the whole request; workers in `avoid` (suspects of a failure) only as a
        last resort; never workers whose circuit is open. Raises NoWorker."""
        blocked = self.resilience.breakers.blocked(model.workers)
        strict = {*avoid, *blocked} if blocked else avoid
        for s in self.strategies:
            pd = s.place(model, self.balancer, prefix_key, strict)
            if pd is not None:
                return pd
        return Placement(self.pick(model, prefix_key, avoid))

    def submit(self, model: ModelEntry, reqs: list[GenerateReq], est_prompt_tokens: list[int],
               worker: WorkerState | Placement | None = None) -> Submission:
        """Send the sub-requests of one HTTP request to one placement (they often share a prefix):
        `worker`, or the one `place` chooses."""
        if worker is None:
            placement = self.place(model, prefix_key(reqs[0]) if reqs else None)
        else:
            placement = worker if isinstance(worker, Placement) else Placement(worker)
        sink: asyncio.Queue[Item] = asyncio.Queue()
        now = time.monotonic()
        states = []
        for i, (req, est) in enumerate(zip(reqs, est_prompt_tokens, strict=True)):
            st = RequestState(req.rid, i, model.name, placement.worker, sink, req.sampling_params.max_new_tokens,
                              est, now, req=req)
            self.requests[req.rid] = st
            self._dispatch(st, placement)
            states.append(st)
        return Submission(states, sink, self._abort)

    def _dispatch(self, st: RequestState, placement: Placement) -> None:
        assert st.req is not None
        worker = st.worker = placement.worker
        st.recharge()
        req = st.req if st.req.rid == st.rid else msgspec.structs.replace(st.req, rid=st.rid)
        worker.inflight[st.rid] = st
        worker.num_served += 1
        self.resilience.breakers.dispatched(worker.worker_id, st.rid)
        d = placement.decode
        if d is None:
            self.send(worker.worker_id, req)
        else:
            # Both at once: the decode worker tokenizes and waits while the prefill worker computes.
            room = next(self._rooms)
            st.prefill, st.decode, st.pairing = worker, d, placement.pairing
            d.inflight[st.rid] = st
            d.num_served += 1
            self.resilience.breakers.dispatched(d.worker_id, st.rid)
            # Adrenaline placement: its KV may stay on the prefill worker (router/placement/adrenaline.py)
            adr = self._keep_kv(st.rid, worker, d)
            for role, w in (("decode", d), ("prefill", worker)):
                self.send(w.worker_id, msgspec.structs.replace(req, disagg=Disagg(
                    role=role, pairing=placement.pairing, room=room, executor_pairing=adr.pairing if adr else "",
                    handle=adr.handle if adr else 0)))
            self.metrics.disagg.labels(st.model, "placed").inc()
            if adr is not None:
                self.metrics.disagg.labels(st.model, "on_executor").inc()
        self.bus.publish(RequestArrived(st.rid, st.model, worker.worker_id, st.est_prompt_tokens, st.max_new_tokens))

    def _retry(self, st: RequestState, why: str, suspect: str = "", fail: Failure | None = None) -> bool:
        """Place a request again from the start (under a new worker-level rid) after a backoff, away from
        `suspect` if it can, if its client got nothing of it yet: nothing delivered, or -- not streaming --
        only output the handler merely collected (discarded with a `Restart`). False if it cannot be
        retried. If no worker can take it by the last retry, it fails with `fail` (default: 503, `why`)."""
        if st.done or st.req is None or st.retries >= self.resilience.retry.max_retries:
            return False
        if st.delivered and st.req.stream:
            return False  # streamed: the client has tokens of it
        old = st.rid
        for w in {st.prefill, st.decode, st.worker}:
            if w is not None:
                w.inflight.pop(old, None)
                if w.up:
                    self.send(w.worker_id, AbortReq(rid=old))
        st.worker.outstanding_tokens -= st.charged
        if st.decode is not None:
            self.metrics.disagg.labels(st.model, "retried").inc()
        st.charged = 0
        st.prefill = st.decode = None
        st.pairing, st.handed, st.early, st.pd_meta = "", False, [], {}
        if st.delivered:  # collected, never sent: the handler drops what it has of this sub-request
            st.sink.put_nowait((st.index, Restart(why)))
            st.restarted, st.delivered = True, False
            st.first_token = st.last_token = st.prompt_tokens = None
            st.completion_tokens, st.first_token_id, st.resumed = 0, -1, False
        self._renumber(st)
        delay = self.resilience.backoff(st.retries)
        logger.warning("request %s: %s; retrying it from the start as %s in %.2f s", old, why, st.rid, delay)
        asyncio.get_running_loop().call_later(delay, self._redispatch, st, suspect,
                                              fail or Failure(503, f"{why}; the request was not completed"))
        return True

    def _renumber(self, st: RequestState) -> None:
        assert st.req is not None
        self.requests.pop(st.rid, None)
        st.retries += 1
        st.rid = f"{st.req.rid}+retry{st.retries}"
        self.requests[st.rid] = st

    def _redispatch(self, st: RequestState, suspect: str, fail: Failure) -> None:
        """A retry's backoff is over: place it, or wait again if no worker can take it now (the suspect
        may be back by then), or fail it after the last retry."""
        if st.done or st.req is None:
            return  # aborted or failed while it waited
        model = self.registry.models.get(st.model)
        try:
            placement = self.place(model, prefix_key(st.req), (suspect,)) if model is not None else None
        except NoWorker:
            placement = None
        if placement is None:
            if st.retries >= self.resilience.retry.max_retries:
                self._fail(st, fail.status, fail.message)
                return
            self._renumber(st)
            asyncio.get_running_loop().call_later(self.resilience.backoff(st.retries), self._redispatch, st,
                                                  suspect, fail)
            return
        logger.info("request %s placed on %s", st.rid,
                    "+".join(w.worker_id for w in (placement.worker, placement.decode) if w is not None))
        self.resilience.metrics.retries.labels(st.model).inc()
        self._dispatch(st, placement)

    def _resume(self, st: RequestState, ident: str, why: str) -> bool:
        """The first token went out but the prompt's KV never reached the decode worker (the prefill
        worker died or the pair broke meanwhile): the decode worker continues from the first token,
        recomputing the prompt itself (a new worker-level rid, `RID+resume`). Once only."""
        d = st.decode
        if st.resumed or st.done or st.req is None or d is None or not d.up or st.first_token_id < 0:
            return False
        old = st.rid
        self.send(d.worker_id, AbortReq(rid=old))  # if it still waits for that KV
        self.requests.pop(old, None)
        d.inflight.pop(old, None)
        st.resumed = True
        st.rid = f"{old}+resume"
        self.requests[st.rid] = st
        d.inflight[st.rid] = st
        self.metrics.disagg.labels(st.model, "resumed").inc()
        logger.warning("request %s: %s: %s; %s recomputes its prompt and continues as %s", old, ident, why,
                       d.worker_id, st.rid)
        self.send(d.worker_id, msgspec.structs.replace(st.req, rid=st.rid, disagg=Disagg(
            role="decode", pairing="", room=0, first_token=st.first_token_id)))
        return True

    def _abort(self, st: RequestState, reason: dict[str, Any] | None = None) -> None:
        if st.done:
            return
        self.send(st.worker.worker_id, AbortReq(rid=st.rid))
        if st.decode is not None and not st.handed:
            self.send(st.decode.worker_id, AbortReq(rid=st.rid))  # it waits for the KV
        reason = reason or {"type": "abort", "message": "client aborted"}
        self._close(st, ok=False, status="abort", finish_reason=reason)

    def abort_requests(self, rid: str = "", abort_all: bool = False, model: str | None = None,
                       message: str = "aborted by /abort_request") -> int:
        """Abort running requests: those whose client rid is `rid` (a request of n samples too: its
        `rid-k`), or with `abort_all` every one (of `model` when given). Each ends as if its worker had
        aborted it: the client gets a last output with finish_reason {"type": "abort", "message": ...}.
        How many were aborted (0 for an unknown rid, which is no error: SGLang's no-op)."""
        hits = [st for st in self.requests.values() if not st.done and st.req is not None
                and (abort_all or _names(rid, st.req.rid))
                and (model is None or st.model == model)]
        for st in hits:
            reason = {"type": "abort", "message": message}
            meta = {"id": st.rid, "prompt_tokens": st.prompt_tokens or 0, "completion_tokens": st.completion_tokens,
                    "cached_tokens": 0, "finish_reason": reason, "e2e_latency": time.monotonic() - st.arrival}
            self._abort(st, reason)
            st.sink.put_nowait((st.index, TokenOut(rid=st.rid, text_delta="", token_ids=[], finished=True,
                                                   meta_info=meta)))
        return len(hits)

    def _close(self, st: RequestState, ok: bool, status: str, finish_reason: dict[str, Any] | None) -> None:
        st.done = True
        st.recharge()
        if ok:
            self.resilience.breakers.success(st.worker.worker_id)
        else:
            for w in (st.worker, st.prefill, st.decode):
                if w is not None:
                    self.resilience.breakers.ended(w.worker_id, st.rid)  # a trial that ended with no verdict
        self.requests.pop(st.rid, None)
        st.worker.inflight.pop(st.rid, None)
        for w in (st.prefill, st.decode):
            if w is not None:
                w.inflight.pop(st.rid, None)
        now = time.monotonic()
        e2e = now - st.arrival
        self.metrics.requests.labels(st.model, status).inc()
        if ok:
            self.metrics.e2e.labels(st.model).observe(e2e)
            if st.first_token is not None and st.completion_tokens > 1:
                self.metrics.tpot.labels(st.model).observe((now - st.first_token) / (st.completion_tokens - 1))
            self.metrics.prompt_tokens.labels(st.model).inc(st.prompt_tokens or 0)
            self._slo_attainment(st, now)
        self.bus.publish(RequestFinished(st.rid, st.model, st.worker.worker_id, ok, st.prompt_tokens or 0,
                                         st.completion_tokens, e2e, finish_reason))

    def _fail(self, st: RequestState, status: int, message: str) -> None:
        if st.done:
            return
        if st.decode is not None and not st.handed:  # the other worker of the pair still holds it
            for w in (st.worker, st.decode):
                if w.up:
                    self.send(w.worker_id, AbortReq(rid=st.rid))
        self._close(st, ok=False, status=str(status), finish_reason={"type": "abort", "message": message})
        st.sink.put_nowait((st.index, Failure(status, message)))

    async def request_reply(self, worker: WorkerState, make: Any, timeout: float = 10.0) -> ReplyOut | None:
        """Send `make(rid)` (flush cache, tokenize) and wait for the worker's ReplyOut."""
        rid = self.new_rid()
        fut: asyncio.Future[ReplyOut] = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        self.send(worker.worker_id, make(rid))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._replies.pop(rid, None)

    async def flush_cache(self) -> tuple[bool, str]:
        workers = [w for w in self.registry.workers.values() if w.up]
        replies = await asyncio.gather(*(self.request_reply(w, lambda rid: FlushCacheReq(rid=rid)) for w in workers))
        bad = [w.worker_id for w, r in zip(workers, replies, strict=True) if r is None or not r.ok]
        if bad:
            return False, f"cache not flushed on {', '.join(bad)}: requests are still running there"
        return True, f"Cache flushed on {len(workers)} worker(s)."

    # ---- receiving ----------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident = bytes(frames[0].buffer).decode(errors="replace")
            try:
                msg = decode_from_worker(frames[1].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as e:
                logger.warning("dropping a malformed message from %s: %s", ident, e)
                continue
            try:
                self._handle(ident, msg)
            except Exception:  # one bad message must not stop the router
                logger.exception("error handling %s from %s", type(msg).__name__, ident)

    def receive(self, ident: str, msg: Any) -> None:
        """A message from a worker on a link (`self.links`), handled as if it came over the socket."""
        try:
            self._handle(ident, msg)
        except Exception:
            logger.exception("error handling %s from %s", type(msg).__name__, ident)

    def _handle(self, ident: str, msg: Any) -> None:
        if isinstance(msg, BatchOut):
            self._touch(ident)
            for out in msg.outs:
                self._on_token(ident, out)
        elif isinstance(msg, LoadReport):
            self._on_load(ident, msg)
        elif isinstance(msg, ErrorOut):
            self._touch(ident)
            reply = self._replies.get(msg.rid)
            if reply is not None and not reply.done():  # a request_reply refused (a bad /tokenize input)
                reply.set_result(ReplyOut(rid=msg.rid, ok=False, data={"error": msg.message, "status": msg.status}))
                return
            st = self.requests.get(msg.rid)
            if st is None:
                return
            if st.decode is not None and st.handed and msg.status == 503 and self._resume(st, ident, msg.message):
                return
            failed = Failure(msg.status, msg.message)
            if st.decode is not None and not st.handed and msg.status >= 500:
                # The pair or one of its workers failed before anything reached the client.
                self._pair_broken(st.pairing, msg.message)
                # Each side reports what it saw of the other (a send that failed, KV that never came).
                assert st.prefill is not None
                other = st.decode.worker_id if ident == st.prefill.worker_id else st.prefill.worker_id
                if self._retry(st, f"{ident}: {msg.message}", suspect=other, fail=failed):
                    return
            elif st.decode is None and msg.status >= 500:
                self.resilience.breakers.failure(ident, msg.message)
                if self.resilience.retry.retryable(msg.status) and self._retry(
                        st, f"{ident}: {msg.message}", suspect=ident, fail=failed):
                    return
            self._fail(st, msg.status, msg.message)
        elif isinstance(msg, ReplyOut):
            self._touch(ident)
            fut = self._replies.get(msg.rid)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, WorkerHello):
            self._on_hello(ident, msg)

    def _touch(self, ident: str) -> None:
        w = self.registry.workers.get(ident)
        if w is not None:
            w.touch()

    def _on_hello(self, ident: str, msg: WorkerHello) -> None:
        if msg.info.worker_id != ident:
            logger.warning("worker identity %r says it is %r; using the identity", ident, msg.info.worker_id)
            msg = WorkerHello(info=msgspec.structs.replace(msg.info, worker_id=ident))
        old = self.registry.workers.get(ident)
        if old is not None and old.inflight:
            # A restart faster than the heartbeat timeout: the new process knows none of these.
            for st in list(old.inflight.values()):
                why = f"worker {ident} restarted; the request was lost"
                if not self._retry(st, why, suspect=ident, fail=Failure(503, why)):
                    self._fail(st, 503, why)
        self._hello_asked.pop(ident, None)
        self.metrics.offload.restarted(ident)  # a new process: its cumulative counters start again
        w, known = self.registry.register(msg.info)
        self.resilience.breakers.reset(ident)  # a new process: the breaker judged the one that is gone
        logger.info("worker %s (%s, model %s, pid %d) %s", ident, w.info.device if w.info else "?", w.model,
                    msg.info.pid, "re-registered" if known else "registered")
        self.bus.publish(WorkerUp(w.model, ident, w.role, known))

    def _on_load(self, ident: str, r: LoadReport) -> None:
        w = self.registry.workers.get(ident)
        if w is None or w.info is None:
            # Alive but unknown: this router (re)started after the worker's hello. Ask for another.
            now = time.monotonic()
            if now - self._hello_asked.get(ident, -_HELLO_REQ_PERIOD_S) >= _HELLO_REQ_PERIOD_S:
                self._hello_asked[ident] = now
                self.send(ident, HelloReq())
            return
        w.touch()
        w.load = r
        self.metrics.offload.observe(ident, r)
        if not w.up:
            w.up = True  # it was only slow: take it back
            logger.info("worker %s is responding again", ident)
            self.bus.publish(WorkerUp(w.model, ident, w.role, True, fresh=False))
        self.bus.publish(LoadReported(w.model, ident, r))

    def _on_token(self, ident: str, out: TokenOut) -> None:
        st = self.requests.get(out.rid)
        if st is None:
            return  # aborted or failed already
        if st.decode is None:
            self._deliver(st, out)
            return
        assert st.prefill is not None
        meta = out.meta_info
        first = False
        if not st.handed:
            if ident != st.prefill.worker_id:
                if ident == st.decode.worker_id:
                    st.early.append(out)  # it overtook the prefill worker's first token
                return
            st.pd_meta = {k: meta[k] for k in ("cached_tokens", "ttft") if k in meta}
            if out.finished:  # done at its first token (or failed there): the decode worker drops it
                self.send(st.decode.worker_id, AbortReq(rid=st.rid))
                st.decode.inflight.pop(st.rid, None)
            first = bool(out.token_ids) and not out.finished
        elif ident != st.decode.worker_id:
            return
        else:
            meta.update(st.pd_meta)  # the decode worker's own would describe its half
        meta["prefill_worker"] = st.prefill.worker_id
        meta["decode_worker"] = st.decode.worker_id if first or st.handed else None
        self._deliver(st, out)
        if first and not st.done:
            st.handed = True
            st.first_token_id = out.token_ids[0]
            self.metrics.disagg.labels(st.model, "handed").inc()
            st.prefill.inflight.pop(st.rid, None)
            st.move_to(st.decode)
            early, st.early = st.early, []
            for e in early:
                self._on_token(st.decode.worker_id, e)

    def _deliver(self, st: RequestState, out: TokenOut) -> None:
        now = time.monotonic()
        meta = out.meta_info
        if st.prompt_tokens is None and "prompt_tokens" in meta:
            st.prompt_tokens = int(meta["prompt_tokens"])
        slo = self.slo.get(st.model)
        if out.token_ids:
            if st.first_token is None:
                st.first_token = now
                self.resilience.breakers.success(st.worker.worker_id, counted=False)  # it serves (its end counts)
                ttft = now - st.arrival
                if not st.restarted:  # (a restarted request's first token was counted already)
                    self.metrics.ttft.labels(st.model).observe(ttft)
                    self.bus.publish(FirstToken(st.rid, st.model, st.worker.worker_id, ttft, st.prompt_tokens or 0))
                    if slo is not None and slo.ttft_ms is not None and ttft * 1e3 > slo.ttft_ms:
                        self._slo_miss(st, "ttft", ttft, slo.ttft_ms / 1e3)
            elif st.last_token is not None:
                gap = now - st.last_token
                self.metrics.itl.labels(st.model).observe(gap)
                if (slo is not None and slo.tpot_ms is not None and not st.tbt_missed
                        and gap * 1e3 > slo.tpot_ms):
                    st.tbt_missed = True
                    self._slo_miss(st, "tbt", gap, slo.tpot_ms / 1e3)
            st.last_token = now
            st.completion_tokens += len(out.token_ids)
            self.metrics.gen_tokens.labels(st.model).inc(len(out.token_ids))
        st.sink.put_nowait((st.index, out))
        st.delivered = True
        if out.finished:
            reason = meta.get("finish_reason")
            self._close(st, ok=True, status="ok", finish_reason=reason if isinstance(reason, dict) else None)
        else:
            st.recharge()

    def _slo_attainment(self, st: RequestState, now: float) -> None:
        slo = self.slo.get(st.model)
        if slo is None:
            return
        if slo.ttft_ms is not None:
            first = st.first_token
            self.metrics.slo_result(st.model, "ttft", first is not None and (first - st.arrival) * 1e3 <= slo.ttft_ms)
        if slo.tpot_ms is not None and st.first_token is not None and st.completion_tokens > 1:
            tpot = (now - st.first_token) / (st.completion_tokens - 1)
            self.metrics.slo_result(st.model, "tpot", tpot * 1e3 <= slo.tpot_ms)
            if tpot * 1e3 > slo.tpot_ms:
                # The SLO as it is defined (a request's mean time per output token): what the adaptive
                # offload controller steers by. A single gap over it ("tbt", above) is only a warning --
                # a prefill step of the worker's own makes one, offload or not.
                self._slo_miss(st, "tpot", tpot, slo.tpot_ms / 1e3)

    def _slo_miss(self, st: RequestState, kind: str, value: float, slo: float) -> None:
        self.metrics.slo_miss.labels(st.model, kind).inc()
        self.bus.publish(SloMissed(st.rid, st.model, st.worker.worker_id, kind, value, slo))

    # ---- health -------------------------------------------------------------------------------
    async def _monitor(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        while True:
            await asyncio.sleep(_MONITOR_PERIOD_S)
            now = time.monotonic()
            for w in list(self.registry.workers.values()):
                if w.up and now - w.last_seen > timeout and w.worker_id not in self.links:
                    self.mark_down(w, f"no heartbeat for {now - w.last_seen:.1f} s")

    def mark_down(self, w: WorkerState, reason: str) -> None:
        w.up = False
        logger.warning("worker %s of model %s is down: %s", w.worker_id, w.model, reason)
        if w.inflight:  # once, however many requests it held: one crash under load is one failure
            self.resilience.breakers.failure(w.worker_id, f"went down ({reason})")
        for st in list(w.inflight.values()):
            why = f"worker {w.worker_id} of model {w.model} went down ({reason})"
            self.send(w.worker_id, AbortReq(rid=st.rid))  # in case it is alive but slow
            if self._retry(st, why, suspect=w.worker_id):
                continue
            self._fail(st, 503, f"{why}; the request was not completed")
        self.bus.publish(WorkerDown(w.model, w.worker_id, reason))
