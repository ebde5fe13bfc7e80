"""`url:` workers served: a launcher whose only replicas are two fake OpenAI-compatible servers (in this
process), routed cache_aware. Requests are proxied (streamed or not, every API), requests that share a
prefix land on the same upstream, a failing health check takes an upstream out and back, an upstream
that refuses connections is taken out at once, and upstream errors reach the client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from _fake_openai import FakeOpenAI
from _router_util import Server, free_port, serve, sse_events, wait_for

SYSTEM = "You are a meticulous assistant who answers questions about the weather in short sentences. " * 4


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeOpenAI, FakeOpenAI]]:
    a, b = FakeOpenAI().start(), FakeOpenAI().start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, fakes: tuple[FakeOpenAI, FakeOpenAI]) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("upstream")
    port = free_port()
    health = {"health_interval_s": 0.2, "health_failures": 1}
    ids = {**health, "return_token_ids": True}  # a second model, the same servers asked for token ids
    cfg = {"router": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
           "models": [{"name": "up", "routing": "cache_aware",
                       "workers": [{"id": "fa", "url": fakes[0].url, "upstream": health},
                                   {"id": "fb", "url": fakes[1].url, "upstream": health}]},
                      {"name": "up-ids", "workers": [{"id": "fa-ids", "url": fakes[0].url, "upstream": ids}]}]}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serve(tmp, ["--config", str(path)], workers=3, port=port) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=30) as c:
        yield c


def counts(fakes: tuple[FakeOpenAI, FakeOpenAI]) -> tuple[int, int]:
    return len(fakes[0].received), len(fakes[1].received)


def test_completions_are_proxied(client: httpx.Client, fakes: tuple[FakeOpenAI, FakeOpenAI]) -> None:
    before = sum(counts(fakes))
    r = client.post("/v1/completions", json={"model": "up", "prompt": "Say hi", "max_tokens": 3, "temperature": 0,
                                             "top_k": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "one two three" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert sum(counts(fakes)) == before + 1
    ((path, sent),) = [x for f in fakes for x in f.received if x[1].get("prompt") == "Say hi"]
    assert path == "/v1/completions"
    assert sent["model"] == "fake-model"  # the upstream's own name, from its /v1/models
    assert sent["prompt"] == "Say hi" and sent["max_tokens"] == 3 and sent["top_k"] == 5 and sent["temperature"] == 0
    assert "min_p" not in sent  # defaults are not sent: a strict OpenAI server accepts the request


def test_streamed_chat_is_proxied(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "up", "stream": True, "messages": [{"role": "user", "content": "hello"}],
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "one two three four five six seven eight"
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finish == ["stop"]
    assert events[-1]["usage"]["completion_tokens"] == 8


def test_native_generate_streams_too(client: httpx.Client) -> None:
    with client.stream("POST", "/generate", json={"text": "abc", "stream": True,
                                                  "sampling_params": {"max_new_tokens": 4}}) as r:
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    assert events[-1]["text"] == "one two three four"
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(events) >= 4  # one event per upstream chunk, not one at the end


def test_output_ids_are_placeholders_unless_the_upstream_sends_ids(client: httpx.Client,
                                                                   fakes: tuple[FakeOpenAI, FakeOpenAI]) -> None:
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 3}}
    plain = client.post("/generate", json={**body, "model": "up"}).json()
    assert plain["output_ids"] == [-1, -1, -1]  # a plain OpenAI stream has no ids
    r = client.post("/generate", json={**body, "model": "up-ids"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == "one two three"
    assert out["output_ids"] == [fakes[0].token_id(w) for w in ("one", "two", "three")]
    assert fakes[0].received[-1][1]["return_token_ids"] is True
    assert not any("return_token_ids" in b for _, b in fakes[1].received)  # fb serves only the plain model


def test_shared_prefix_lands_on_one_upstream(client: httpx.Client, fakes: tuple[FakeOpenAI, FakeOpenAI]) -> None:
    def send(prompt: str) -> int:
        """Which fake got it."""
        before = counts(fakes)
        r = client.post("/v1/completions", json={"model": "up", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        after = counts(fakes)
        (which,) = [i for i in (0, 1) if after[i] > before[i]]
        return which

    first = send(SYSTEM + "Question 0: is it raining?")
    assert all(send(SYSTEM + f"Question {i}: will it snow?") == first for i in range(1, 6))
    # Another family of prompts starts on the other upstream (shortest queue, then the emptier index),
    # and sticks there.
    other = send("A different system prompt about cooking pasta, quite long as well. " * 6 + "Q0")
    assert other != first
    assert all(send("A different system prompt about cooking pasta, quite long as well. " * 6 + f"Q{i}") == other
               for i in range(1, 4))
    routing = client.get("/get_server_info").json()["routing"]["up"]
    assert routing["policy"] == "cache_aware" and routing["decisions"]["prefix"] >= 8


def test_a_client_that_leaves_cancels_the_upstream_request(server: Server, fakes: tuple[FakeOpenAI, FakeOpenAI]
                                                           ) -> None:
    for f in fakes:
        f.chunk_delay_s = 0.3
    try:
        with server.client(timeout=30) as c, c.stream("POST", "/v1/completions", json={
                "model": "up", "prompt": "a long answer please", "max_tokens": 40, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first event came: the request runs upstream; then the client leaves
        wait_for(lambda: sum(f.cut for f in fakes) == 1, 10, "the upstream stream cut")
        assert server.info()["num_inflight_requests"] == 0
    finally:
        for f in fakes:
            f.chunk_delay_s = 0.0


def test_upstream_error_reaches_the_client(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "up", "prompt": "FAIL400", "max_tokens": 2})
    assert r.status_code == 400
    assert "answered 400: the prompt asked for a 400" in r.json()["error"]["message"]


def test_failed_health_check_takes_an_upstream_out_and_back(server: Server, client: httpx.Client,
                                                            fakes: tuple[FakeOpenAI, FakeOpenAI]) -> None:
    a = fakes[0]
    a.healthy = False
    try:
        wait_for(lambda: server.up_workers()["up"] == ["fb"], 10, "fa marked down")
        before = counts(fakes)
        for i in range(4):
            assert client.post("/v1/completions", json={"model": "up", "prompt": f"p{i}", "max_tokens": 1}
                               ).status_code == 200
        assert counts(fakes)[0] == before[0] and counts(fakes)[1] == before[1] + 4
    finally:
        a.healthy = True
    wait_for(lambda: sorted(server.up_workers()["up"]) == ["fa", "fb"], 10, "fa back up")


def test_an_upstream_that_refuses_connections_is_out_at_once(tmp_path: Path) -> None:
    """No health period to wait for: the request that found it gone takes it out, and is retried on the
    live upstream (the client sees only 200s)."""
    live = FakeOpenAI().start()
    dead = FakeOpenAI().start()
    port = free_port()
    slow = {"health_interval_s": 30, "health_failures": 5}
    cfg = {"router": {"port": port, "log_level": "warning", "routing": "round_robin"},
           "models": [{"name": "up", "workers": [{"id": "dead", "url": dead.url, "upstream": slow},
                                                 {"id": "live", "url": live.url, "upstream": slow}]}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        with serve(tmp_path, ["--config", str(path)], workers=2, port=port) as srv, srv.client(timeout=30) as c:
            dead.stop()
            codes = [c.post("/v1/completions", json={"prompt": f"x{i}", "max_tokens": 1}).status_code
                     for i in range(4)]
            assert codes == [200] * 4, codes  # the one sent to the dead upstream was retried on the live one
            assert srv.up_workers()["up"] == ["live"]
            info = srv.worker("dead")
            assert info["state"] == "down" and info["info"]["hostname"] == dead.url
    finally:
        live.stop()
        time.sleep(0.1)
