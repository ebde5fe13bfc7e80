"""SGLang-native HTTP API against a real launcher + worker (embedded default model, CPU)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from _router_util import SMALL, Server, serve, sse_events

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("native"), SMALL) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def gen(c: httpx.Client, **body: object) -> httpx.Response:
    return c.post("/generate", json=body)


def test_generate_single(client: httpx.Client) -> None:
    r = gen(client, text="The weather today", sampling_params=GREEDY)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 8 and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] > 0 and "e2e_latency" in meta and "id" in meta
    again = gen(client, text="The weather today", sampling_params=GREEDY).json()
    assert again["output_ids"] == out["output_ids"] and again["text"] == out["text"]


def test_generate_input_ids_and_batch(client: httpx.Client) -> None:
    ids = [1, 100, 200, 300]
    one = gen(client, input_ids=ids, sampling_params=GREEDY).json()
    batch = gen(client, input_ids=[ids, [1, 50, 60]], sampling_params=GREEDY).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == one["output_ids"]
    texts = gen(client, text=["a b c", "d e f", "g h i"],
                sampling_params=[{**GREEDY, "max_new_tokens": k} for k in (1, 2, 3)]).json()
    assert [len(t["output_ids"]) for t in texts] == [1, 2, 3]


def test_generate_n_returns_n(client: httpx.Client) -> None:
    out = gen(client, text="Hello", sampling_params={"max_new_tokens": 4, "n": 3, "seed": 7, "ignore_eos": True}).json()
    assert isinstance(out, list) and len(out) == 3
    assert all(len(o["output_ids"]) == 4 for o in out)
    batch = gen(client, text=["Hi", "Yo"], sampling_params={**GREEDY, "max_new_tokens": 2, "n": 2}).json()
    assert len(batch) == 4 and batch[0]["output_ids"] == batch[1]["output_ids"]  # greedy samples agree


def test_generate_stream_is_cumulative(client: httpx.Client) -> None:
    final = gen(client, text="Streaming test", sampling_params=GREEDY).json()
    with client.stream("POST", "/generate", json={"text": "Streaming test", "sampling_params": GREEDY,
                                                   "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = list(sse_events(r.iter_lines()))
    assert len(chunks) >= 2
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 8
    assert all(chunks[i + 1]["text"].startswith(chunks[i]["text"]) for i in range(len(chunks) - 1))
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[0]["meta_info"]["finish_reason"] is None


def test_generate_stream_batch_has_index(client: httpx.Client) -> None:
    with client.stream("POST", "/generate", json={"text": ["x", "y"], "sampling_params": GREEDY, "stream": True}) as r:
        chunks = list(sse_events(r.iter_lines()))
    assert {c["index"] for c in chunks} == {0, 1}
    assert all(len(c["output_ids"]) == 8 for c in chunks if c["meta_info"]["finish_reason"])


def test_logprobs(client: httpx.Client) -> None:
    out = gen(client, text="Logprob check here", sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
              top_logprobs_num=2, return_text_in_logprobs=True).json()
    meta = out["meta_info"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == meta["prompt_tokens"] and inp[0][0] is None
    assert len(outp) == 8 and [e[1] for e in outp] == out["output_ids"]
    assert all(isinstance(e[0], float) and e[0] <= 0 and isinstance(e[2], str) for e in outp)
    assert len(meta["output_top_logprobs"]) == 8 and all(len(row) == 2 for row in meta["output_top_logprobs"])
    # greedy: the chosen token is the most likely one
    assert all(row[0][1] == e[1] for row, e in zip(meta["output_top_logprobs"], outp, strict=True))


def test_prefill_only_scoring(client: httpx.Client) -> None:
    """What sgl.select sends: a batch, max_new_tokens 0, input logprobs with text."""
    out = gen(client, text=["The colour is red", "The colour is blue"],
              sampling_params={"max_new_tokens": 0, "temperature": 0}, return_logprob=True,
              return_text_in_logprobs=True, logprob_start_len=2).json()
    assert len(out) == 2
    for o in out:
        assert o["output_ids"] == [] and o["meta_info"]["completion_tokens"] == 0
        assert len(o["meta_info"]["input_token_logprobs"]) == o["meta_info"]["prompt_tokens"] - 2


def test_stop_string(client: httpx.Client) -> None:
    free = gen(client, text="Stop here", sampling_params={**GREEDY, "max_new_tokens": 12}).json()
    word = free["text"].strip().split()[1] if len(free["text"].split()) > 2 else free["text"][3:6]
    out = gen(client, text="Stop here", sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                         "stop": [word]}).json()
    assert word not in out["text"] and free["text"].startswith(out["text"])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}


def test_info_endpoints(client: httpx.Client) -> None:
    info = client.get("/get_model_info").json()
    assert info["model_path"] == "default" and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        s = client.get(path).json()
        assert s["model_path"] == "default" and s["models"]["default"]["workers"][0]["up"] is True
        assert s["context_length"] == 4096 and "version" in s
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    r = client.post("/flush_cache")
    assert r.status_code == 200 and "flushed" in r.text.lower()


def test_metrics(client: httpx.Client) -> None:
    gen(client, text="metrics", sampling_params=GREEDY)
    time.sleep(1.1)  # one load report
    text = client.get("/metrics").text
    for name in ("sglang:time_to_first_token_seconds_bucket", "sglang:e2e_request_latency_seconds_count",
                 "sglang:inter_token_latency_seconds_count", "sglang:time_per_output_token_seconds_count",
                 "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang_ext:kv_used_tokens", "sglang_ext:worker_up"):
        assert name in text, name
    assert 'model_name="default"' in text and 'worker="default-0"' in text


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"text": "x", "sampling_params": {"max_new_tokens": "ten"}}, 400, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**9}}, 400, "context length"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**30}}, 400, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ({"text": "x", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ({"text": "x", "sampling_params": {"regex": "a[0-9"}}, 400, "regex is not valid"),
    ({"text": "x", "sampling_params": {"stop_regex": "a+"}}, 400, "stop_regex"),
    ({"text": "x", "surprise": True}, 400, "surprise"),
    ({"text": 5}, 400, "text"),
    ({"sampling_params": {}}, 400, "text or input_ids"),
    ({"text": "x", "input_ids": [1]}, 400, "text or input_ids"),
    ({"input_ids": [1, "a"]}, 400, "input_ids"),
    ({"input_ids": [1, 999999]}, 400, "input_ids"),
    ({"input_ids": list(range(1, 2000)) * 3}, 400, "context length"),
    ({"text": []}, 400, "empty"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    ({"text": "x", "model": "nope"}, 404, "nope"),
    ({"text": "x", "image_data": "abc"}, 400, "image_data"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": -3}, 400, "logprob_start_len"),
])
def test_bad_requests(client: httpx.Client, body: dict[str, object], status: int, needle: str) -> None:
    r = client.post("/generate", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_malformed_bodies_and_routes(client: httpx.Client) -> None:
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = client.post("/generate", json=[1, 2])
    assert r.status_code == 400 and "object" in r.json()["error"]["message"]
    r = client.get("/no/such/route")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = client.get("/generate")
    assert r.status_code == 405
    # Still serving after all of that.
    assert gen(client, text="still alive", sampling_params=GREEDY).status_code == 200


def test_stream_error_before_first_token_keeps_status(client: httpx.Client) -> None:
    r = client.post("/generate", json={"input_ids": list(range(1, 2000)) * 3, "stream": True})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def _busy(server: Server) -> tuple[int, int, int]:
    s = server.info()
    w = s["models"]["default"]["workers"][0]
    load = w["load"]
    return load["num_running"] + load["num_waiting"], load["kv_used_tokens"] - load["kv_cached_tokens"], w["inflight"]


def _wait_idle(server: Server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    state = _busy(server)
    while time.monotonic() < deadline:
        state = _busy(server)
        if state == (0, 0, 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"not idle: (requests, active kv tokens, router inflight) = {state}")


async def test_disconnect_mid_stream_aborts(server: Server) -> None:
    long = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}
    body = {"text": "long story", "sampling_params": long, "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data:")
            if n >= 3:
                break
    await asyncio.sleep(0.5)
    await asyncio.to_thread(_wait_idle, server)


async def test_disconnect_while_waiting_aborts(server: Server) -> None:
    long = {"max_new_tokens": 3000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=1.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/generate", json={"text": "patience", "sampling_params": long})
    await asyncio.to_thread(_wait_idle, server)
