"""A cluster from a config file: two models (one with two replicas), an API key, an SLO; then worker
failure (a killed local worker, a killed remote worker) and a worker rejoining."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from _router_util import Proc, Server, free_port, serve, sse_events, start_worker, wait_for

KEY = "sekret-key"
ARGS = {"max_total_tokens": 16384, "dtype": "float32", "device": "cpu", "log_level": "warning"}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cluster")


@pytest.fixture(scope="module")
def server(tmp: Path) -> Iterator[Server]:
    port = free_port()
    cfg = {
        # No retries: these tests watch how a worker's failure reaches its clients (a non-streaming request
        # on a killed worker would otherwise start over on the other replica; tests/test_router_resilience.py).
        "router": {"host": "127.0.0.1", "port": port, "api_key": KEY, "heartbeat_timeout_s": 3.0,
                   "log_level": "warning", "max_retries": 0},
        "models": [
            {"name": "alpha", "args": ARGS, "slo": {"ttft_ms": 0.001, "tpot_ms": 0.001}},
            {"name": "beta", "replicas": 2, "args": ARGS},
        ],
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serve(tmp, ["--config", str(path)], workers=3, api_key=KEY, port=port) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def gen(c: httpx.Client, model: str, n: int = 4, **kw: object) -> httpx.Response:
    return c.post("/generate", json={"text": f"Hello {model}", "model": model,
                                     "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                                     **kw})


def served(server: Server) -> dict[str, int]:
    return {w["worker_id"]: w["num_served"] for m in server.info()["models"].values() for w in m["workers"]}


def test_api_key(server: Server) -> None:
    with httpx.Client(base_url=server.url) as bare:
        assert bare.get("/health").status_code == 200  # the one open endpoint
        for method, path in (("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("GET", "/get_model_info"), ("POST", "/v1/chat/completions")):
            r = bare.request(method, path, json={})
            assert r.status_code == 401, path
            assert "API key" in r.json()["error"]["message"]
        assert bare.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = bare.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and {m["id"] for m in r.json()["data"]} == {"alpha", "beta"}


def test_route_by_model_name(server: Server, client: httpx.Client) -> None:
    before = served(server)
    assert gen(client, "alpha").status_code == 200
    after = served(server)
    assert after["alpha-0"] == before["alpha-0"] + 1
    assert after["beta-0"] + after["beta-1"] == before["beta-0"] + before["beta-1"]
    r = client.post("/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "beta"
    assert client.get("/get_model_info", params={"model": "beta"}).json()["served_model_name"] == "beta"
    assert client.get("/get_model_info").json()["served_model_name"] == "alpha"  # the first model is the default
    assert gen(client, "gamma").status_code == 404


async def test_replicas_are_balanced(server: Server) -> None:
    before = served(server)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
        rs = await asyncio.gather(*(c.post("/generate", json={
            "text": f"balance {i}", "model": "beta",
            "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}) for i in range(8)))
    assert all(r.status_code == 200 for r in rs)
    after = served(server)
    assert after["beta-0"] - before["beta-0"] >= 2 and after["beta-1"] - before["beta-1"] >= 2


def test_slo_miss_metric(client: httpx.Client) -> None:
    gen(client, "alpha")
    text = client.get("/metrics").text
    assert 'sglang_ext:slo_miss_total{kind="ttft",model_name="alpha"}' in text
    assert 'sglang_ext:slo_miss_total{kind="tbt",model_name="alpha"}' in text


def _pid(server: Server, worker_id: str) -> int:
    for m in server.info()["models"].values():
        for w in m["workers"]:
            if w["worker_id"] == worker_id:
                return int(w["info"]["pid"])
    raise KeyError(worker_id)


def _inflight(server: Server) -> dict[str, int]:
    return {w["worker_id"]: w["inflight"] for m in server.info()["models"].values() for w in m["workers"]}


async def test_killed_worker_fails_only_its_requests(server: Server, tmp: Path) -> None:
    # Long enough that both are certainly running when the kill comes, even on a loaded machine.
    long = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=180) as c:
        def post(model: str, text: str, sp: dict[str, object]) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(c.post("/generate", json={"text": text, "model": model, "sampling_params": sp}))

        # Both replicas up first: one seen down (a heartbeat late on a loaded machine) would take both requests
        # on the other, and the test would kill a worker with nothing on it.
        for wid in ("beta-0", "beta-1"):
            await asyncio.to_thread(wait_for, lambda wid=wid: server.worker(wid)["up"], 60, f"{wid} up")
        on_beta = [post("beta", f"long {i}", long) for i in range(2)]  # one lands on each replica
        deadline = time.monotonic() + 60
        while True:  # (polled from a thread: the event loop must keep sending the requests above)
            inflight = await asyncio.to_thread(_inflight, server)
            if inflight.get("beta-0", 0) >= 1 and inflight.get("beta-1", 0) >= 1:
                break
            early = [t.result().text[:200] for t in on_beta if t.done() and not t.exception()]
            assert time.monotonic() < deadline and not any(t.done() for t in on_beta), (inflight, early)
            await asyncio.sleep(0.05)
        on_alpha = post("alpha", "alpha keeps going", {"max_new_tokens": 40, "ignore_eos": True})
        t_kill = time.monotonic()
        os.kill(await asyncio.to_thread(_pid, server, "beta-0"), signal.SIGKILL)
        done, running = await asyncio.wait(on_beta, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and len(running) == 1, "exactly one request was on the killed worker"
        failed = done.pop().result()
        assert failed.status_code == 503, failed.text
        assert time.monotonic() - t_kill < 20  # fails fast (a watched local process), never waits for a timeout
        msg = failed.json()["error"]["message"]
        assert "beta-0" in msg and "not completed" in msg
        # Only that worker's request failed: the other model finishes normally, and new requests to
        # beta go to the surviving replica (nothing is routed to the dead one) ...
        assert (await on_alpha).status_code == 200
        rs = await asyncio.gather(*(c.post("/generate", json={"text": "after", "model": "beta",
                                                              "sampling_params": {"max_new_tokens": 2}})
                                    for _ in range(4)))
        assert all(r.status_code == 200 for r in rs)
        # ... while the long request on the other replica is still being served; its client gives
        # up on it, which aborts it there.
        survivor = running.pop()
        assert not survivor.done() and (await asyncio.to_thread(_inflight, server))["beta-1"] == 1
        survivor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await survivor
    deadline = time.monotonic() + 10
    while (await asyncio.to_thread(_inflight, server))["beta-1"] != 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


def test_killed_local_worker_comes_back_by_itself(server: Server) -> None:
    """The launcher restarts the worker killed above (after a 1 s backoff); it serves again."""
    w = wait_for(lambda: (x := server.worker("beta-0"))["up"] and x, 120, "beta-0 restarted")
    assert w["restarts"] == 1 and w["state"] == "up"
    assert "worker beta-0 exited with code -9" in server.log()
    before = served(server)["beta-0"]
    assert asyncio.run(_burst(server, "beta", 6)) == [200] * 6
    assert served(server)["beta-0"] > before


async def _burst(server: Server, model: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
        rs = await asyncio.gather(*(c.post("/generate", json={
            "text": f"burst {i}", "model": model,
            "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}) for i in range(n)))
    return [r.status_code for r in rs]


def test_remote_worker_crash_detected_by_heartbeat(server: Server, tmp: Path) -> None:
    w: Proc = start_worker(tmp, server.worker_addr, "gamma-0", ["--served-model-name", "gamma"])
    try:
        deadline = time.monotonic() + 120
        while "gamma-0" not in server.up_workers().get("gamma", []):
            assert w.alive(), w.log()
            assert time.monotonic() < deadline, w.log()
            time.sleep(0.3)
        with server.client() as c, c.stream("POST", "/generate", json={
                "text": "doomed", "model": "gamma", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
            first = next(events)
            assert len(first["output_ids"]) >= 1
            os.kill(_pid(server, "gamma-0"), signal.SIGKILL)  # the worker, not its `launch worker` parent
            t_kill = time.monotonic()
            last = first
            for last in events:
                if "error" in last:
                    break
            assert "error" in last and last["error"]["code"] == 503, last
            assert "gamma-0" in last["error"]["message"] and "heartbeat" in last["error"]["message"]
            assert 2.0 < time.monotonic() - t_kill < 15.0  # the heartbeat timeout is 3 s (slack for a loaded CI)
        r = gen(c := server.client(), "gamma")
        c.close()
        assert r.status_code == 503 and "no worker of model 'gamma' is up" in r.json()["error"]["message"]
        w.p.wait(10)  # `launch worker` exits when its worker dies
    finally:
        w.stop()
    with server.client() as c:
        assert gen(c, "alpha").status_code == 200 and gen(c, "beta").status_code == 200


def test_remote_worker_rejoins_with_its_id_and_serves(server: Server, tmp: Path) -> None:
    # The remote worker that crashed above, started again by hand on "another host" with the same id.
    w = start_worker(tmp, server.worker_addr, "gamma-0", ["--served-model-name", "gamma"])
    try:
        deadline = time.monotonic() + 120
        while "gamma-0" not in server.up_workers().get("gamma", []):
            assert w.alive(), w.log()
            assert time.monotonic() < deadline, w.log()
            time.sleep(0.3)
        before = served(server)["gamma-0"]
        assert asyncio.run(_burst(server, "gamma", 6)) == [200] * 6
        assert served(server)["gamma-0"] > before
        assert server.worker("gamma-0")["restarts"] == 0  # not the launcher's: nothing supervises it
    finally:
        w.stop()
