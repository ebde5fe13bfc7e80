"""A `url:` worker's log says what changes, not what is polled: no httpx line per health check or per
proxied request, one line when an upstream goes down and one when it is back; and a launcher whose
only workers are `url:` ones prints its `ready:` line once they are up."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
import yaml
from _fake_openai import FakeOpenAI
from _router_util import Server, free_port, until, wait_for

from router.api.app import build_app
from router.config import RouterConfig
from router.core import Router
from router.upstream.pool import Upstreams
from router.upstream.spec import UpstreamSpec, url_worker


async def test_health_polls_and_requests_leave_no_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # (the router's own lines at any level: none may be per poll)
    fake = FakeOpenAI().start()
    router = Router(RouterConfig())
    await router.start()
    spec = UpstreamSpec(health_interval_s=0.03, health_failures=2)
    ups = Upstreams(router, (url_worker("w", "up-0", "up", fake.url, spec),))
    try:
        ups.start()
        router.registry.declare("up")
        w = lambda: router.registry.workers["up-0"]  # noqa: E731
        await until(lambda: w().up, 10)
        await asyncio.sleep(0.5)  # ~15 health checks
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://r") as c:
            for _ in range(3):
                r = await c.post("/v1/completions", json={"model": "up", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
        fake.healthy = False
        await until(lambda: not w().up, 10)
        await asyncio.sleep(0.5)  # ~15 failed checks while down
        fake.healthy = True
        await until(lambda: w().up, 10)
        await asyncio.sleep(0.3)
    finally:
        await ups.stop()
        await router.stop()
        fake.stop()
    names = {r.name for r in caplog.records}
    assert not {n for n in names if n.split(".")[0] in ("httpx", "httpcore")}, names
    lines = [r.getMessage() for r in caplog.records if "up-0" in r.getMessage() or fake.url in r.getMessage()]
    # registered (up), down (failed checks, with why), re-registered (up again): one line each
    assert len(lines) == 3, lines
    assert "registered" in lines[0] and "is down" in lines[1] and "503" in lines[1] and "re-registered" in lines[2]


def test_a_launcher_with_only_url_workers_says_ready(tmp_path: Path) -> None:
    fake = FakeOpenAI().start()
    port = free_port()
    cfg = {"router": {"host": "127.0.0.1", "port": port, "log_level": "info"},
           "models": [{"name": "up", "workers": [{"id": "up-0", "url": fake.url,
                                                   "upstream": {"health_interval_s": 0.2}}]}]}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cfg))
    srv = Server(["--config", str(tmp_path / "cluster.yaml")], tmp_path / "server.log", port)
    try:
        line = wait_for(lambda: next((x for x in srv.log().splitlines() if "ready:" in x), None), 60, "ready:")
        assert "ready: 1 worker(s) up; try: curl" in line, srv.log()
        assert srv.up_workers() == {"up": ["up-0"]}
        with srv.client() as c:
            assert c.post("/v1/completions", json={"model": "up", "prompt": "x", "max_tokens": 2}).status_code == 200
        assert "HTTP Request" not in srv.log()  # httpx's per-request INFO line, at log_level info
    finally:
        srv.stop()
        fake.stop()
