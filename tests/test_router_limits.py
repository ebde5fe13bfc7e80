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


async def test_overlong_text_refused_before_the_worker(s: Setup) -> None:
    r = await s.client.post("/generate", json={"model": "m", "text": "a" * (LIMIT_CHARS + 1)})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert f"{LIMIT_CHARS + 1} characters" in msg and f"context length of {CTX} tokens" in msg
    await nothing_sent(s.worker)
    r = await s.client.post("/generate", json={"model": "m", "text": ["short", "b" * (LIMIT_CHARS + 1)]})
    assert r.status_code == 400
    await nothing_sent(s.worker)
    assert (await served(s, s.worker, "/generate", {"model": "m", "text": "a" * LIMIT_CHARS})).status_code == 200


async def test_overlong_openai_prompts_refused(s: Setup) -> None:
    r = await s.client.post("/v1/completions", json={"model": "m", "prompt": ["ok", "c" * (LIMIT_CHARS + 1)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
    # Chat: the message contents together (each alone would fit).
    half = {"role": "user", "content": "d" * (LIMIT_CHARS // 2 + 1)}
    r = await s.client.post("/v1/chat/completions", json={"model": "m", "messages": [half, half]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "characters" in r.json()["error"]["message"]
    await nothing_sent(s.worker)
    ok = await served(s, s.worker, "/v1/chat/completions", {"model": "m", "messages": [half], "max_tokens": 1})
    assert ok.status_code == 200


async def test_overlong_token_ids_refused_and_unknown_token_length_skips_the_text_check(s: Setup) -> None:
    r = await s.client.post("/generate", json={"model": "plain", "input_ids": list(range(1, CTX + 1))})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    await nothing_sent(s.plain)
    # The worker did not say how long its tokens are: it checks the text itself, after tokenizing.
    r = await served(s, s.plain, "/generate", {"model": "plain", "text": "e" * (LIMIT_CHARS * 2)})
    assert r.status_code == 200


async def test_body_over_the_limit_is_413(s: Setup) -> None:
    big = b'{"text": "' + b"f" * 20_000 + b'"}'
    r = await s.client.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-mb" in r.json()["error"]["message"]
    assert r.headers["connection"] == "close"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"text": "'
        for _ in range(40):
            yield b"g" * 1000
        yield b'"}'

    r = await s.client.post("/v1/completions", content=chunks())
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert "10 KiB" not in r.text and "MiB" in r.json()["error"]["message"]
    await nothing_sent(s.worker)
    r = await s.client.post("/generate", content=b'{"text": ', headers={"content-type": "application/json"})
    assert r.status_code == 400  # under the limit: read and judged as usual


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/generate", {"model": "m", "text": "x", "return_logprob": True, "logprob_start_len": -5},
     "logprob_start_len"),
    ("/generate", {"model": "m", "text": ["x", "y"], "logprob_start_len": [0, -2]}, "logprob_start_len"),
])
async def test_bad_fields_are_named(s: Setup, path: str, body: dict[str, object], needle: str) -> None:
    r = await s.client.post(path, json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    await nothing_sent(s.worker)


async def test_a_server_bug_is_500_not_a_client_error(s: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("bug in the balancer")

    monkeypatch.setattr(s.router, "pick", broken)
    r = await s.client.post("/generate", json={"model": "m", "text": "x"})
    assert r.status_code == 500 and "RuntimeError: bug in the balancer" in r.json()["error"]["message"]


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


def test_connection_cap_fits_the_descriptor_limit() -> None:
    import resource

    from router.http_guard import connection_cap, raise_fd_limit

    assert connection_cap(4096, 1024) == 1024 - 256  # the OS would refuse first: lowered
    assert connection_cap(100, 20_000) == 100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
        assert raise_fd_limit() == (hard if hard != resource.RLIM_INFINITY else max(512, 1 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
