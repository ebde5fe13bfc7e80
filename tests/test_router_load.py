"""Load: 256 concurrent streaming requests complete without errors, and the KV cache drains after."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from _router_util import SMALL, Server, serve

N_REQUESTS = 256
MAX_NEW = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("load"), SMALL) as srv:
        yield srv


async def _one(c: httpx.AsyncClient, i: int) -> tuple[int, int]:
    body = {"text": f"Request number {i} says", "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.7, "seed": i, "ignore_eos": True}}
    last = None
    done = False
    async with c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data:"):
                last = json.loads(line[5:])
                assert "error" not in last, last
    assert done and last is not None
    return len(last["output_ids"]), last["meta_info"]["completion_tokens"]


def _worker_load(server: Server) -> dict[str, int]:
    w = server.info()["models"]["default"]["workers"][0]
    return {**w["load"], "inflight": w["inflight"]}


async def test_256_concurrent_streams_then_kv_drains(server: Server) -> None:
    limits = httpx.Limits(max_connections=N_REQUESTS + 8, max_keepalive_connections=N_REQUESTS + 8)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=server.url, timeout=240, limits=limits) as c:
        results = await asyncio.wait_for(asyncio.gather(*(_one(c, i) for i in range(N_REQUESTS))), 240)
    elapsed = time.monotonic() - t0
    assert results == [(MAX_NEW, MAX_NEW)] * N_REQUESTS, f"after {elapsed:.1f} s"

    # KV in use by requests returns to zero (the prefix cache may keep finished prefixes) ...
    deadline = time.monotonic() + 15
    load = _worker_load(server)
    while time.monotonic() < deadline:
        load = _worker_load(server)
        if (load["num_running"], load["num_waiting"], load["inflight"]) == (0, 0, 0) and \
                load["kv_used_tokens"] == load["kv_cached_tokens"]:
            break
        await asyncio.sleep(0.3)
    else:
        raise AssertionError(f"KV did not drain: {load}")
    # ... and to exactly zero once that cache is flushed.
    async with httpx.AsyncClient(base_url=server.url) as c:
        assert (await c.post("/flush_cache")).status_code == 200
    deadline = time.monotonic() + 5
    while _worker_load(server)["kv_used_tokens"] != 0:
        assert time.monotonic() < deadline, _worker_load(server)
        await asyncio.sleep(0.3)
    async with httpx.AsyncClient(base_url=server.url) as c:
        metrics = (await c.get("/metrics")).text
    assert 'sglang_ext:kv_used_tokens{model_name="default",worker="default-0"} 0.0' in metrics
    assert f'sglang:num_requests_total{{model_name="default",status="ok"}} {float(N_REQUESTS)}' in metrics
