"""OpenAI-compatible API: raw HTTP (format details) and the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from _router_util import SMALL, Server, serve, sse_events


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("openai"), SMALL) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(oai: openai.OpenAI, client: httpx.Client) -> None:
    ids = [m.id for m in oai.models.list().data]
    assert ids == ["default"]
    assert client.get("/v1/models/default").json()["id"] == "default"


def test_completion_matches_generate(client: httpx.Client) -> None:
    native = client.post("/generate", json={"text": "Hello there", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    r = client.post("/v1/completions", json={"model": "default", "prompt": "Hello there", "max_tokens": 6,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "default" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == native["text"] and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": native["meta_info"]["prompt_tokens"], "completion_tokens": 6,
                             "total_tokens": native["meta_info"]["prompt_tokens"] + 6}


def test_completion_token_prompts_n_and_batch(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="default", prompt=[[1, 20, 30], [1, 40]], max_tokens=3, temperature=0, n=2,
                               extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5


def test_completion_logprobs_and_echo(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="default", prompt="Echo me", max_tokens=4, temperature=0, logprobs=2,
                               echo=True, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text.startswith("Echo me")
    lp = c.logprobs
    assert lp is not None and len(lp.tokens) == r.usage.prompt_tokens + 4
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])


def test_completion_stop(oai: openai.OpenAI) -> None:
    free = oai.completions.create(model="default", prompt="Count", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = free[4:7]
    r = oai.completions.create(model="default", prompt="Count", max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert free.startswith(r.choices[0].text)


def test_completion_logit_bias(oai: openai.OpenAI) -> None:
    forced = 1000  # a plain (non-special) token of the default model's vocabulary
    r = oai.completions.create(model="default", prompt="Bias", max_tokens=4, temperature=0,
                               logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    ids = oai.completions.create(model="default", prompt="Bias", max_tokens=4, temperature=0,
                                 logit_bias={str(forced): 100}, logprobs=1, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    assert ids.choices[0].logprobs is not None and len(set(ids.choices[0].logprobs.tokens)) == 1
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oai.completions.create(model="default", prompt="Bias", max_tokens=2, logit_bias={"999999": 5})


def test_completion_stream_with_usage(oai: openai.OpenAI) -> None:
    full = oai.completions.create(model="default", prompt="Stream", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(oai.completions.create(model="default", prompt="Stream", max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_chat(oai: openai.OpenAI, client: httpx.Client) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = oai.chat.completions.create(model="default", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=2, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert len(c.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage.completion_tokens == 5
    # The chat template is the model's (ChatML for the default model): same as generating from its text
    # (whose encoding adds the leading BOS itself).
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
             "<|im_start|>assistant\n"
    native = client.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).json()
    assert native["meta_info"]["prompt_tokens"] == r.usage.prompt_tokens
    assert c.message.content == native["text"]
    # content given as parts
    parts = oai.chat.completions.create(model="default", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert parts.choices[0].message.content == c.message.content


def test_chat_stream_n(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "Go"}],
                                         max_tokens=4, temperature=0, n=2, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {0: "", 1: ""}
    roles, reasons = set(), {}
    usage = None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert roles == {0, 1} and reasons == {0: "length", 1: "length"}
    assert texts[0] == texts[1] != ""
    assert usage is not None and usage.completion_tokens == 8


def test_chat_stream_raw_format(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}) as r:
        events = list(sse_events(r.iter_lines()))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**8}, 400, "context length"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 5000}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n must"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [1.5, 2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ("/v1/completions", {"prompt": [list(range(1, 2000)) * 3]}, 400, "context length"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "narrator", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
])
def test_openai_errors(client: httpx.Client, path: str, body: dict[str, object], status: int, needle: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and {"message", "type", "param", "code"} <= set(err)


def test_openai_client_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="nope"):
        oai.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=-5)
    r = oai.completions.create(model="default", prompt="fine", max_tokens=2)
    assert r.choices[0].text is not None
