"""The HTTP app in-process (httpx's ASGI transport) over a Router with fake workers: size limits that
refuse work before it reaches a worker, input checks, server errors, and /metrics read at scrape time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import zmq.asyncio
from _router_util import FakeWorker, until

from router.api.app import build_app
from router.config import RouterConfig
from router.core import Router
from sglang_ext.messages import GenerateReq

CTX, PER_TOKEN = 256, 4  # the fake model: 256 tokens of context, tokens of at most 4 characters
LIMIT_CHARS = CTX * PER_TOKEN


@dataclass
class Setup:
    router: Router
    worker: FakeWorker  # model "m": says how long its tokens are
    plain: FakeWorker  # model "plain": does not (max_token_chars 0)
    client: httpx.AsyncClient


@pytest.fixture
async def s() -> AsyncIterator[Setup]:
    router = Router(RouterConfig(max_request_mb=0.01))  # 10 KiB
    await router.start()
    ctx = zmq.asyncio.Context()
    w = FakeWorker(ctx, router.worker_addr, "w0", "m", context_length=CTX, max_token_chars=PER_TOKEN)
    plain = FakeWorker(ctx, router.worker_addr, "p0", "plain", context_length=CTX)
    await w.hello()
    await plain.hello()
    await until(lambda: sum(w.up for w in router.registry.workers.values()) == 2)
    transport = httpx.ASGITransport(app=build_app(router), raise_app_exceptions=False)
    client = httpx.AsyncClient(transport=transport, base_url="http://router", timeout=10)
    try:
        yield Setup(router, w, plain, client)
    finally:
        await client.aclose()
        w.close()
        plain.close()
        await router.stop()
        ctx.term()


async def nothing_sent(w: FakeWorker) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await w.recv(timeout=0.3)


async def served(s: Setup, w: FakeWorker, path: str, body: dict[str, object]) -> httpx.Response:
    """Post a request that must reach `w`; `w` finishes it with one token."""
    task = asyncio.create_task(s.client.post(path, json=body))
    got = await w.recv()
    assert isinstance(got, GenerateReq)
    await w.token(got.rid, [5], finished=True)
    return await task


async def test_gauges_are_current_at_scrape_time(s: Setup) -> None:
    # No load report arrives during this test: the gauges must come from the router's own state.
    task = asyncio.create_task(s.client.post("/generate", json={"model": "m", "text": "x"}))
    got = await s.worker.recv()
    assert isinstance(got, GenerateReq)
    text = (await s.client.get("/metrics")).text
    assert 'sglang_ext:router_inflight_reqs{model_name="m",worker="w0"} 1.0' in text
    assert 'sglang_ext:worker_up{model_name="m",worker="w0"} 1.0' in text
    await s.worker.token(got.rid, [5], finished=True)
    assert (await task).status_code == 200
    info = (await s.client.get("/get_server_info")).json()
    text = (await s.client.get("/metrics")).text
    assert info["models"]["m"]["workers"][0]["inflight"] == 0
    assert 'sglang_ext:router_inflight_reqs{model_name="m",worker="w0"} 0.0' in text
    s.router.mark_down(s.router.registry.workers["w0"], "test")
    text = (await s.client.get("/metrics")).text
    assert 'sglang_ext:worker_up{model_name="m",worker="w0"} 0.0' in text
