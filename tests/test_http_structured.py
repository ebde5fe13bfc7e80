"""Structured output through the HTTP APIs (a served embedded model, whose own text is gibberish):
`/generate` with regex / json_schema / ebnf (batches, n > 1, streaming, token-id prompts), OpenAI
`response_format` with the `openai` client, and invalid constraints as 400s that name the problem."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from _router_util import SMALL, Server, serve, sse_events

from sglang_ext.sampling.params import InvalidRequest, SamplingParams
from sglang_ext.server_args import ServerArgs

REGEX = r"[0-9]{3}-[a-z]{2,5}"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("structured"), SMALL) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_generate_regex_batch_n_and_ids(client: httpx.Client) -> None:
    r = client.post("/generate", json={
        "text": ["Code A:", "Code B:", "Code C:"],
        "sampling_params": {"regex": REGEX, "n": 2, "temperature": 1.0, "seed": 5, "max_new_tokens": 32}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out) == 6
    for o in out:
        assert re.fullmatch(REGEX, o["text"]), o["text"]
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
    ids = client.post("/generate", json={"input_ids": [1, 50, 60, 70], "sampling_params": {
        "regex": "(yes|no)", "temperature": 0}}).json()
    assert ids["text"] in ("yes", "no")


def test_generate_json_schema_and_ebnf(client: httpx.Client) -> None:
    r = client.post("/generate", json={"text": ["Person:", "Somebody:"], "sampling_params": {
        "json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 256}}).json()
    for o in r:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
    e = client.post("/generate", json={"text": "Pick:", "sampling_params": {
        "ebnf": 'root ::= "<" ("cat" | "dog") ">"', "temperature": 0}}).json()
    assert e["text"] in ("<cat>", "<dog>")


def test_generate_stream(client: httpx.Client) -> None:
    with client.stream("POST", "/generate", json={"text": "Code:", "stream": True, "sampling_params": {
            "regex": REGEX, "temperature": 0}}) as r:
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    assert re.fullmatch(REGEX, events[-1]["text"]) and events[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert all(events[-1]["text"].startswith(e["text"]) for e in events)


@pytest.mark.parametrize(("sp", "needle"), [
    ({"regex": "[0-9"}, "sampling_params.regex is not valid: Regex parsing error"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": '{"type": "objectx"}'}, "sampling_params.json_schema is not valid: Unsupported type"),
    ({"json_schema": "[1]"}, "json_schema must be a JSON object"),
    ({"ebnf": "root ::= undefined_rule"}, "sampling_params.ebnf is not valid"),
    ({"regex": "a", "json_schema": "{}"}, "at most one of regex, json_schema"),
    ({"regex": ""}, "regex must not be empty"),
])
def test_generate_invalid_constraints(client: httpx.Client, sp: dict[str, Any], needle: str) -> None:
    for body in ({"text": "x"}, {"input_ids": [1, 2, 3]}, {"text": "x", "stream": True}):
        r = client.post("/generate", json={**body, "sampling_params": sp})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
    assert client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_max_new_tokens_too_small_is_length(client: httpx.Client) -> None:
    o = client.post("/generate", json={"text": "Code:", "sampling_params": {
        "regex": "[a-z]{30}", "max_new_tokens": 2, "temperature": 0}}).json()
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert re.fullmatch("[a-z]+", o["text"])


def test_openai_chat_json_schema(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give me a person."}], temperature=0, max_tokens=256,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and content is not None
    jsonschema.validate(json.loads(content), SCHEMA)


def test_openai_json_object_completions_and_stream(oai: openai.OpenAI, client: httpx.Client) -> None:
    r = oai.completions.create(model="default", prompt="JSON:", max_tokens=256, temperature=0,
                               extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    stream = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Stream JSON."}], temperature=0, max_tokens=256,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # SGLang's extra constraint fields on the OpenAI endpoints
    r2 = client.post("/v1/completions", json={"prompt": "Code:", "regex": REGEX, "temperature": 0}).json()
    assert re.fullmatch(REGEX, r2["choices"][0]["text"])


@pytest.mark.parametrize(("body", "needle"), [
    ({"response_format": {"type": "xml"}}, "response_format type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema is not valid: Unsupported type"),
    # over --grammar-max-bytes (64 KiB): the field the client sent, not the worker's sampling_params.json_schema
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object",
                                                                            "description": "d" * 70_000}}}},
     "response_format.json_schema.schema is 70"),
    ({"json_schema": json.dumps({"type": "object", "description": "d" * 70_000})}, "json_schema is 70"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "at most one of"),
    ({"response_format": {"type": "json_object"}, "json_schema": "{}"}, "not both"),
    ({"regex": "[0-9"}, "regex is not valid"),
])
def test_openai_invalid_constraints(client: httpx.Client, body: dict[str, Any], needle: str) -> None:
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"})):
        r = client.post(path, json={**base, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error"
        assert "sampling_params" not in err["message"]  # the /generate API's name, not this one's
        if "schema is" in needle:
            assert err["param"] == ("response_format" if "response_format" in body else "json_schema")
    if "response_format" in body:  # streamed too (the error comes before the first token: a 400)
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                      **body})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_grammar_backend_none_refuses() -> None:
    from sglang_ext.messages import GenerateReq
    from sglang_ext.worker.worker import Worker

    w = Worker(ServerArgs(device="cpu", dtype="float32", max_total_tokens=1024, grammar_backend="none"))
    with pytest.raises(InvalidRequest, match="--grammar-backend none"):
        w.compile_grammar(GenerateReq(rid="x", input_ids=[1], sampling_params=SamplingParams(regex="a")))
