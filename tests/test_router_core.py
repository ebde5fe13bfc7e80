"""The router's core in-process, with fake workers speaking the real protocol over ZeroMQ: events,
balancing, heartbeat timeouts, restarts, strict decoding. No model, so these run in well under a second each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio
from _router_util import FakeWorker, until

from router.config import RouterConfig, SloSpec
from router.core import NoWorker, Router
from router.events import (
    Event,
    FirstToken,
    LoadReported,
    RequestArrived,
    RequestFinished,
    SloMissed,
    WorkerDown,
    WorkerUp,
)
from router.registry import LeastOutstandingTokens
from router.tracker import Failure, WorkerState
from sglang_ext.messages import (
    AbortReq,
    ErrorOut,
    GenerateReq,
)
from sglang_ext.sampling.params import SamplingParams


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    r = Router(RouterConfig(heartbeat_timeout_s=0.6), slo={"m": SloSpec(ttft_ms=0.0001, tpot_ms=0.0001)})
    await r.start()
    yield r
    await r.stop()


def req(router: Router, max_new: int = 4) -> GenerateReq:
    sp = SamplingParams(max_new_tokens=max_new)
    return GenerateReq(rid=router.new_rid(), input_ids=[1, 2, 3], sampling_params=sp)


async def test_request_lifecycle_and_events(router: Router, ctx: zmq.asyncio.Context) -> None:
    events: list[Event] = []
    router.bus.on(events.append)
    sub = router.bus.subscribe(WorkerUp, RequestFinished)
    w = FakeWorker(ctx, router.worker_addr, "w0")
    try:
        await w.hello()
        w.start_heartbeat()
        await until(lambda: router.registry.models.get("m") is not None and router.registry.models["m"].up_workers)
        assert isinstance(await asyncio.wait_for(sub.get(), 1), WorkerUp)
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        got = await w.recv()
        assert isinstance(got, GenerateReq) and got.rid == r.rid
        assert router.registry.workers["w0"].outstanding_tokens == 3 + 4
        await w.token(r.rid, [5])
        await w.token(r.rid, [6, 7, 8], finished=True)
        items = [await s.next(1), await s.next(1)]
        assert [i[1].token_ids for i in items] == [[5], [6, 7, 8]]  # type: ignore[union-attr]
        assert s.finished and router.registry.workers["w0"].outstanding_tokens == 0
        fin = await asyncio.wait_for(sub.get(), 1)
        assert isinstance(fin, RequestFinished) and fin.ok and fin.completion_tokens == 4
        text = router.metrics.render().decode()  # the SLOs are far below anything reachable
        assert 'sglang_ext:slo_attainment{kind="ttft",model_name="m"} 0.0' in text
        assert 'sglang_ext:slo_attainment{kind="tpot",model_name="m"} 0.0' in text
        await until(lambda: any(isinstance(e, LoadReported) for e in events))
        kinds = {type(e) for e in events}
        assert {WorkerUp, RequestArrived, FirstToken, RequestFinished, SloMissed, LoadReported} <= kinds
        assert {e.kind for e in events if isinstance(e, SloMissed)} == {"ttft", "tbt", "tpot"}
    finally:
        sub.close()
        w.close()


async def test_error_from_worker_reaches_the_request(router: Router, ctx: zmq.asyncio.Context) -> None:
    w = FakeWorker(ctx, router.worker_addr, "w0")
    try:
        await w.hello()
        w.start_heartbeat()
        await until(lambda: "m" in router.registry.models and router.registry.models["m"].up_workers)
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        await w.recv()
        await w.send(ErrorOut(rid=r.rid, message="sampling_params.top_k bad", status=400))
        _, ev = await s.next(1)  # type: ignore[misc]
        assert ev == Failure(400, "sampling_params.top_k bad") and r.rid not in router.requests
    finally:
        w.close()


async def test_silent_worker_is_marked_down_then_taken_back(router: Router, ctx: zmq.asyncio.Context) -> None:
    downs: list[Event] = []
    router.bus.on(downs.append, WorkerDown)
    w = FakeWorker(ctx, router.worker_addr, "w0")
    try:
        await w.hello()
        w.start_heartbeat()
        await until(lambda: "m" in router.registry.models and router.registry.models["m"].up_workers)
        s = router.submit(router.registry.models["m"], [req(router)], [3])
        await w.recv()
        w.stop_heartbeat()
        t0 = time.monotonic()
        _, ev = await s.next(3)  # type: ignore[misc]
        assert isinstance(ev, Failure) and ev.status == 503 and "w0" in ev.message
        assert 0.4 < time.monotonic() - t0 < 3.0 and len(downs) == 1
        with pytest.raises(NoWorker):
            router.submit(router.registry.models["m"], [req(router)], [3])
        assert isinstance(await w.recv(), AbortReq)  # the router also tells it, in case it is only slow
        w.start_heartbeat()  # it was only slow: heartbeats take it back
        await until(lambda: router.registry.workers["w0"].up)
    finally:
        w.close()


async def test_a_request_for_a_worker_gone_unnoticed_goes_to_another(router: Router,
                                                                      ctx: zmq.asyncio.Context) -> None:
    """A worker killed moments ago is still up until its heartbeat lapses; a request the router cannot
    even send to it (nothing reached the client) is retried whole on another worker, not failed."""
    a, b = FakeWorker(ctx, router.worker_addr, "w0"), FakeWorker(ctx, router.worker_addr, "w1")
    try:
        for w in (a, b):
            await w.hello()
        await until(lambda: "m" in router.registry.models and len(router.registry.models["m"].up_workers) == 2)
        a.close()  # its connection is gone; the registry does not know yet
        await asyncio.sleep(0.1)
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3], worker=router.registry.workers["w0"])
        g = await b.recv()
        assert isinstance(g, GenerateReq) and g.rid == r.rid + "+retry1"
        await b.token(g.rid, [7], finished=True)
        _, out = await s.next(2)  # type: ignore[misc]
        assert out.token_ids == [7] and s.finished and not router.requests  # type: ignore[union-attr]
    finally:
        b.close()


async def test_restart_with_same_id_retries_lost_requests(router: Router, ctx: zmq.asyncio.Context) -> None:
    """A new process under the same id knows nothing of the requests the old one held: they are placed
    again after the retry backoff -- on it, the only worker. (With retries off they fail: 503
    naming the restart, tests/test_router_resilience.py.)"""
    w = FakeWorker(ctx, router.worker_addr, "w0")
    try:
        await w.hello()
        await until(lambda: "m" in router.registry.models and router.registry.models["m"].up_workers)
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        await w.recv()
        await w.hello()
        g = await w.recv()
        while isinstance(g, AbortReq):  # (the abort of the first attempt, sent before the hello was seen)
            g = await w.recv()
        assert isinstance(g, GenerateReq) and g.rid == r.rid + "+retry1"
        await w.token(g.rid, [7], finished=True)
        _, out = await s.next(2)  # type: ignore[misc]
        assert out.token_ids == [7] and s.finished  # type: ignore[union-attr]
        assert router.registry.workers["w0"].up and not router.registry.workers["w0"].inflight
    finally:
        w.close()


async def test_malformed_messages_are_dropped(router: Router, ctx: zmq.asyncio.Context) -> None:
    w = FakeWorker(ctx, router.worker_addr, "w0")
    try:
        await w.sock.send(b"\x93garbage")
        await w.sock.send(msgspec.msgpack.encode({"type": "hello", "info": {"worker_id": 5}}))
        await w.sock.send(msgspec.msgpack.encode({"type": "pickle", "data": b"x"}))
        await w.hello()  # the router is still listening
        await until(lambda: "m" in router.registry.models and router.registry.models["m"].up_workers)
    finally:
        w.close()


async def test_least_outstanding_tokens_spreads_load(router: Router, ctx: zmq.asyncio.Context) -> None:
    ws = [FakeWorker(ctx, router.worker_addr, f"w{i}") for i in range(2)]
    try:
        for w in ws:
            await w.hello()
        await until(lambda: "m" in router.registry.models and len(router.registry.models["m"].up_workers) == 2)
        m = router.registry.models["m"]
        big = router.submit(m, [req(router, max_new=5000)], [3])  # beyond the prefix-affinity slack
        small = [router.submit(m, [req(router, max_new=10)], [3]) for _ in range(3)]
        assert {s.states[0].worker.worker_id for s in small} == {big.states[0].worker.worker_id} ^ {"w0", "w1"}
        for s in [big, *small]:
            s.abort()
        assert all(w.outstanding_tokens == 0 for w in router.registry.workers.values())
    finally:
        for w in ws:
            w.close()


def test_prefix_aware_sticks_while_load_allows() -> None:
    from router.registry import PrefixAware

    a, b = WorkerState("a", "m", up=True), WorkerState("b", "m", up=True)
    bal = PrefixAware(slack_tokens=100)
    first = bal.pick([a, b], "t:shared system prompt")
    first.outstanding_tokens = 50  # busier, but within the slack: the shared prefix wins
    assert bal.pick([a, b], "t:shared system prompt") is first
    assert bal.pick([a, b], "t:something else") is not first
    first.outstanding_tokens = 500  # too busy: least outstanding tokens wins, and the key moves
    other = bal.pick([a, b], "t:shared system prompt")
    assert other is not first and bal.pick([a, b], "t:shared system prompt") is other


def test_balancer_prefers_fewer_tokens_then_fewer_requests() -> None:
    a, b = WorkerState("a", "m", up=True), WorkerState("b", "m", up=True)
    a.outstanding_tokens, b.outstanding_tokens = 10, 5
    assert LeastOutstandingTokens().pick([a, b]) is b
    b.outstanding_tokens = 10
    b.inflight = {"x": None}  # type: ignore[dict-item]
    assert LeastOutstandingTokens().pick([a, b]) is a


async def test_event_bus_drops_oldest_when_a_subscriber_lags() -> None:
    from router.events import EventBus

    bus = EventBus()
    sub = bus.subscribe(maxsize=2)
    for i in range(5):
        bus.publish(WorkerDown("m", f"w{i}", "test"))
    assert sub.dropped == 3
    assert [(await sub.get()).worker_id for _ in range(2)] == ["w3", "w4"]  # type: ignore[attr-defined]
    off = bus.on(lambda e: 1 / 0)  # a failing callback never breaks publishing
    bus.publish(WorkerDown("m", "w5", "test"))
    off()
    assert (await sub.get()).worker_id == "w5"  # type: ignore[attr-defined]


async def test_unknown_worker_is_asked_to_say_hello(router: Router, ctx: zmq.asyncio.Context) -> None:
    """A worker that outlived a router restart only sends load reports; the new router asks for a hello."""
    from sglang_ext.messages import HelloReq

    w = FakeWorker(ctx, router.worker_addr, "orphan")
    try:
        w.start_heartbeat()
        assert isinstance(await w.recv(), HelloReq)
        await w.hello()
        await until(lambda: "m" in router.registry.models and router.registry.models["m"].up_workers)
    finally:
        w.close()
