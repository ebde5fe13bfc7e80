"""The router's side of prefill/decode disaggregation in-process, with fake workers speaking the real
protocol: the pair is opened on worker events, a request goes to the prefill worker and the decode
worker and comes back as one, and failures before the first token are retried while failures after it
are explicit. No model: each test runs in about a second."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio
from _router_util import FakeWorker, until

from router.config import RouterConfig
from router.core import Router
from router.tracker import Failure
from sglang_ext.messages import (
    AbortReq,
    ErrorOut,
    GenerateReq,
    KVPairClose,
    KVPairConnect,
    KVPairOpen,
    ReplyOut,
)
from sglang_ext.sampling.params import SamplingParams


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    r = Router(RouterConfig(heartbeat_timeout_s=0.6))
    await r.start()
    yield r
    await r.stop()


async def recv(w: FakeWorker, typ: type) -> Any:
    """The next message of type `typ` (others are skipped)."""
    while True:
        m = await w.recv()
        if isinstance(m, typ):
            return m


def pairs(router: Router) -> list[dict[str, Any]]:
    """The KV pairs as /get_server_info shows them."""
    return router.describe_placement()["disaggregation"]


async def paired(router: Router, ctx: zmq.asyncio.Context) -> tuple[FakeWorker, FakeWorker]:
    p = FakeWorker(ctx, router.worker_addr, "p", disaggregation_mode="prefill", hostname="node-a", gpu_uuid="GPU-p",
                   pid=4242)
    d = FakeWorker(ctx, router.worker_addr, "d", disaggregation_mode="decode")
    for w in (p, d):
        await w.hello()
        w.start_heartbeat()
    opened = await recv(d, KVPairOpen)
    assert opened.peer == "p" and opened.peer_device == "cpu"
    # what the decode worker needs to choose cuda_ipc (GPUs of one node, two processes)
    assert (opened.peer_host, opened.peer_gpu, opened.peer_pid) == ("node-a", "GPU-p", 4242)
    await d.send(ReplyOut(rid=opened.rid, ok=True, data={"store": "127.0.0.1:1234", "backend": "gloo"}))
    conn = await recv(p, KVPairConnect)
    assert (conn.peer, conn.store, conn.pairing, conn.backend) == ("d", "127.0.0.1:1234", opened.pairing, "gloo")
    await until(lambda: pairs(router) and pairs(router)[0]["state"] == "active")
    assert pairs(router)[0]["backend"] == "gloo"
    assert router.registry.workers["p"].role == "prefill" and router.registry.workers["d"].role == "decode"
    return p, d


def req(router: Router, max_new: int = 4, stream: bool = False) -> GenerateReq:
    sp = SamplingParams(max_new_tokens=max_new)
    return GenerateReq(rid=router.new_rid(), input_ids=[1, 2, 3], sampling_params=sp, stream=stream)


async def test_a_request_goes_to_both_and_comes_back_as_one(router: Router, ctx: zmq.asyncio.Context) -> None:
    p, d = await paired(router, ctx)
    try:
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        gp, gd = await recv(p, GenerateReq), await recv(d, GenerateReq)
        assert router.registry.workers["p"].outstanding_tokens == 3 + 4  # the prefill worker's until handed
        assert gp.rid == gd.rid == r.rid and gp.disagg.room == gd.disagg.room
        assert (gp.disagg.role, gd.disagg.role) == ("prefill", "decode")
        # the decode worker's output may overtake the prefill worker's first token: held back
        await d.token(r.rid, [6])
        await p.token(r.rid, [5])
        await d.token(r.rid, [7, 8], finished=True)
        items = [(await s.next(1))[1] for _ in range(3)]  # type: ignore[index]
        assert [i.token_ids for i in items] == [[5], [6], [7, 8]]
        assert all(i.meta_info["prefill_worker"] == "p" and i.meta_info["decode_worker"] == "d" for i in items)
        assert s.finished and not router.requests
        assert all(not router.registry.workers[w].inflight and router.registry.workers[w].outstanding_tokens == 0
                   for w in ("p", "d"))
    finally:
        p.close()
        d.close()


async def test_failures_before_the_first_token_are_retried(router: Router, ctx: zmq.asyncio.Context) -> None:
    """The prefill worker cannot send (a broken pair): the request is placed again, whole, on an up
    worker, and the pair is out of placement until it is opened again. A prefill worker that goes
    silent: the same, once it is marked down."""
    p, d = await paired(router, ctx)
    try:
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        await recv(p, GenerateReq)
        await recv(d, GenerateReq)
        await p.send(ErrorOut(rid=r.rid, message="cannot send KV over pairing x", status=503))
        assert (await recv(d, AbortReq)).rid == r.rid
        assert pairs(router)[0]["state"].startswith("failed: cannot send KV")
        retried = [router.requests[k] for k in router.requests]
        assert len(retried) == 1 and retried[0].rid == r.rid + "+retry1" and retried[0].decode is None
        g = await recv(p, GenerateReq)  # away from the suspect: the side the prefill worker could not reach
        assert g.rid == r.rid + "+retry1" and g.disagg is None
        await p.token(g.rid, [5, 6], finished=True)
        _, out = await s.next(1)  # type: ignore[misc]
        assert out.token_ids == [5, 6] and s.finished and "prefill_worker" not in out.meta_info
    finally:
        p.close()
        d.close()


async def test_prefill_worker_down_before_its_first_token(router: Router, ctx: zmq.asyncio.Context) -> None:
    p, d = await paired(router, ctx)
    try:
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        await recv(p, GenerateReq)
        await recv(d, GenerateReq)
        p.stop_heartbeat()  # marked down after the heartbeat timeout: retried on the decode worker, whole
        assert (await recv(d, AbortReq)).rid == r.rid
        g = await recv(d, GenerateReq)
        assert g.rid == r.rid + "+retry1" and g.disagg is None
        await d.token(g.rid, [5], finished=True)
        _, out = await s.next(2)  # type: ignore[misc]
        assert out.token_ids == [5] and s.finished
        assert pairs(router)[0]["state"] == "down"
    finally:
        p.close()
        d.close()


async def test_decode_worker_down_after_the_first_token_fails_explicitly(router: Router,
                                                                        ctx: zmq.asyncio.Context) -> None:
    p, d = await paired(router, ctx)
    try:
        r = req(router, max_new=50, stream=True)  # streamed: its client has tokens, it cannot start over
        s = router.submit(router.registry.models["m"], [r], [3])
        await recv(p, GenerateReq)
        await recv(d, GenerateReq)
        await p.token(r.rid, [5])
        await d.token(r.rid, [6])
        assert [(await s.next(1))[1].token_ids for _ in range(2)] == [[5], [6]]  # type: ignore[index]
        d.stop_heartbeat()
        _, ev = await s.next(3)  # type: ignore[misc]
        assert isinstance(ev, Failure) and ev.status == 503 and "worker d of model m went down" in ev.message
        assert not router.requests
        # the prefill worker alone serves the model whole now
        r2 = req(router)
        s2 = router.submit(router.registry.models["m"], [r2], [3])
        g = await recv(p, GenerateReq)
        assert g.rid == r2.rid and g.disagg is None
        await p.token(r2.rid, [1], finished=True)
        assert (await s2.next(1))[1].token_ids == [1]  # type: ignore[index,union-attr]
    finally:
        p.close()
        d.close()


async def test_client_abort_reaches_both_workers(router: Router, ctx: zmq.asyncio.Context) -> None:
    p, d = await paired(router, ctx)
    try:
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        await recv(p, GenerateReq)
        await recv(d, GenerateReq)
        s.abort()
        assert (await recv(p, AbortReq)).rid == r.rid
        assert (await recv(d, AbortReq)).rid == r.rid
        assert not router.requests and not router.registry.workers["d"].inflight
    finally:
        p.close()
        d.close()


async def test_done_at_the_first_token_drops_it_on_the_decode_worker(router: Router,
                                                                      ctx: zmq.asyncio.Context) -> None:
    p, d = await paired(router, ctx)
    try:
        r = req(router, max_new=1)
        s = router.submit(router.registry.models["m"], [r], [3])
        await recv(p, GenerateReq)
        await recv(d, GenerateReq)
        await p.token(r.rid, [5], finished=True)
        _, out = await s.next(1)  # type: ignore[misc]
        assert out.token_ids == [5] and out.meta_info["decode_worker"] is None and s.finished
        assert (await recv(d, AbortReq)).rid == r.rid
    finally:
        p.close()
        d.close()


async def test_kv_that_never_came_is_retried_away_from_the_prefill_worker(router: Router,
                                                                         ctx: zmq.asyncio.Context) -> None:
    p, d = await paired(router, ctx)
    try:
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        await recv(p, GenerateReq)
        await recv(d, GenerateReq)
        await d.send(ErrorOut(rid=r.rid, message="the prefill worker's KV never arrived", status=503))
        assert (await recv(p, AbortReq)).rid == r.rid
        g = await recv(d, GenerateReq)
        assert g.rid == r.rid + "+retry1" and g.disagg is None
        await d.token(g.rid, [5], finished=True)
        assert (await s.next(1))[1].token_ids == [5] and s.finished  # type: ignore[index,union-attr]
    finally:
        p.close()
        d.close()


async def test_kv_lost_after_the_first_token_resumes_on_the_decode_worker(router: Router,
                                                                          ctx: zmq.asyncio.Context) -> None:
    """The first token went out, then the KV never came: the decode worker gets the request again with
    that first token (it recomputes the prompt) and the client's stream goes on; once only."""
    p, d = await paired(router, ctx)
    try:
        r = req(router, max_new=3)
        s = router.submit(router.registry.models["m"], [r], [3])
        await recv(p, GenerateReq)
        await recv(d, GenerateReq)
        await p.token(r.rid, [5])
        assert (await s.next(1))[1].token_ids == [5]  # type: ignore[index,union-attr]
        await d.send(ErrorOut(rid=r.rid, message="the prefill worker's KV for this request never arrived",
                              status=503))
        assert (await recv(d, AbortReq)).rid == r.rid
        g = await recv(d, GenerateReq)
        assert g.rid == r.rid + "+resume" and g.disagg.first_token == 5 and g.disagg.role == "decode"
        await d.token(g.rid, [6])
        await d.send(ErrorOut(rid=g.rid, message="lost again", status=503))  # no second resume
        _, out = await s.next(1)  # type: ignore[misc]
        assert out.token_ids == [6] and out.meta_info["decode_worker"] == "d"
        _, ev = await s.next(1)  # type: ignore[misc]
        assert ev == Failure(503, "lost again") and not router.requests
    finally:
        p.close()
        d.close()


async def test_a_decode_worker_that_left_unnoticed_is_retried_around(router: Router,
                                                                      ctx: zmq.asyncio.Context) -> None:
    """The decode worker's socket is gone but the router still counts it up: the request placed on its
    pair is retried whole on the prefill worker (when the send to it fails, or at the latest when the
    heartbeat times out), before anything reached the client."""
    p, d = await paired(router, ctx)
    try:
        d.close()
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        assert (await recv(p, GenerateReq)).disagg is not None
        g = await recv(p, GenerateReq)  # (an AbortReq of the first attempt is skipped)
        assert g.rid == r.rid + "+retry1" and g.disagg is None
        await p.token(g.rid, [5], finished=True)
        assert (await s.next(1))[1].token_ids == [5] and s.finished  # type: ignore[index,union-attr]
    finally:
        p.close()


async def test_decode_worker_told_when_its_prefill_worker_is_down(router: Router, ctx: zmq.asyncio.Context) -> None:
    """A prefill worker that stops answering (hung, its sockets open) after a first token: its decode
    partner is told to give up on its KV (KVPairClose); the decode worker's 503 then resumes the
    request there."""
    p, d = await paired(router, ctx)
    try:
        r = req(router)
        s = router.submit(router.registry.models["m"], [r], [3])
        gd = (await recv(p, GenerateReq), await recv(d, GenerateReq))[1]
        await p.token(r.rid, [5])
        assert (await s.next(1))[1].token_ids == [5]  # type: ignore[index,union-attr]
        p.stop_heartbeat()
        closed = await recv(d, KVPairClose)
        assert closed.pairing == gd.disagg.pairing
        await d.send(ErrorOut(rid=r.rid, message="the prefill worker's KV never arrived (p is down)", status=503))
        g = await recv(d, GenerateReq)
        assert g.rid == r.rid + "+resume" and g.disagg.first_token == 5
    finally:
        p.close()
        d.close()
