"""OpenAI function calling and reasoning through the router with the embedded model (its own text is
gibberish, so the grammars carry the calls), through the real `openai` client: `required` and named
tool_choice give calls whose arguments validate against the schema, streamed and not; `none` gives
text; an earlier call and its result render through the template; bad tool specs are 400s naming the
field; and `--reasoning-parser qwen3` splits `<think>` text from content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from _router_util import SMALL, Server, serve

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"], "additionalProperties": False,
}
ADD: dict[str, Any] = {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"], "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function",
     "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add_one", "description": "n + 1", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add_one": ADD}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("tools"), SMALL) as srv:
        yield srv


@pytest.fixture
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _stream(oai: openai.OpenAI, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None, list[Any]]:
    """(content, calls, finish_reason, tool-call deltas) of a streamed chat completion."""
    content, calls, reason, deltas = "", list[dict[str, Any]](), None, []
    for chunk in oai.chat.completions.create(model="default", stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                deltas.append(d)
                if d.id is not None:
                    assert d.index == len(calls) and d.type == "function" and d.function.arguments == ""
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
            reason = ch.finish_reason or reason
    return content, calls, reason, deltas


def test_required_calls_validate(oai: openai.OpenAI) -> None:
    for seed in range(3):
        r = oai.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1
        assert calls[0].type == "function" and calls[0].id.startswith("call_")
        _valid(calls[0].function.name, calls[0].function.arguments)


def test_required_streamed_matches_whole(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
                          "parallel_tool_calls": False, "max_tokens": 200}
    whole = oai.chat.completions.create(model="default", **kw).choices[0]
    content, calls, reason, deltas = _stream(oai, **kw)
    assert reason == "tool_calls" and len(calls) == 1 and len(deltas) > 2  # arguments came in pieces
    assert whole.message.tool_calls is not None
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert (whole.message.content or "") == content.strip() == ""
    _valid(calls[0]["name"], calls[0]["arguments"])


def test_named_function(oai: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "add_one"}}
    r = oai.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                    temperature=0.8, seed=3, max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls is not None and len(calls) == 1
    assert calls[0].function.name == "add_one"
    _valid("add_one", calls[0].function.arguments)
    _, scalls, reason, _ = _stream(oai, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                    temperature=0.8, seed=3, max_tokens=200)
    assert reason == "tool_calls" and [c["name"] for c in scalls] == ["add_one"]
    _valid("add_one", scalls[0]["arguments"])


def test_parallel_calls(oai: openai.OpenAI) -> None:
    """Parallel calls allowed: every call made validates (the model decides how many)."""
    r = oai.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                    temperature=1.0, seed=11, max_tokens=400, n=2)
    for choice in r.choices:
        assert choice.message.tool_calls
        if choice.finish_reason == "tool_calls":
            for c in choice.message.tool_calls:
                _valid(c.function.name, c.function.arguments)


def test_none_and_auto_give_text(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                    max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.message.tool_calls is None and isinstance(c.message.content, str) and c.finish_reason == "length"
    plain = oai.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content == c.message.content  # none: tools are not rendered
    auto = oai.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=16,
                                       temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in auto.choices[0].message.tool_calls or []:
        _valid(call.function.name, call.function.arguments)


def test_tool_result_round_trip(oai: openai.OpenAI, server: Server) -> None:
    history: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    r = oai.chat.completions.create(model="default", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None
    # The template rendered the call and its result: the prompt is longer than without them.
    short = oai.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                        max_tokens=1)
    assert r.usage is not None and short.usage is not None
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 20
    with_tools = oai.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert with_tools.usage is not None and with_tools.usage.prompt_tokens > short.usage.prompt_tokens + 50


@pytest.mark.parametrize(("body", "needle"), [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": []}, "tools must not be empty"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages[0].tool_calls[0].function"),
])
def test_bad_tool_specs(server: Server, body: dict[str, Any], needle: str) -> None:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"], r.text
        assert c.get("/health").status_code == 200


# ---- reasoning -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("reasoning"), [*SMALL, "--reasoning-parser", "qwen3"]) as srv:
        yield srv


def test_reasoning_content(thinker: Server) -> None:
    oai = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0)
    regex = r"<think>\n[a-z]{3,8}\n</think>\n\n[a-z]{3,8}"
    kw: dict[str, Any] = {"model": "default", "messages": MESSAGES, "temperature": 0, "max_tokens": 64,
                          "extra_body": {"regex": regex}}
    msg = oai.chat.completions.create(**kw).choices[0].message
    reasoning = msg.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and reasoning.isalpha() and msg.content and msg.content.isalpha(), msg
    got_r, got_c = "", ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            got_r += getattr(ch.delta, "reasoning_content", None) or ""
            got_c += ch.delta.content or ""
    assert (got_r, got_c) == (reasoning, msg.content)
    # no <think> block: all content
    plain = oai.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8,
                                        extra_body={"regex": "[a-z]{3,8}"}).choices[0].message
    assert plain.content and plain.reasoning_content is None  # type: ignore[attr-defined]


def test_reasoning_with_tool_call(thinker: Server) -> None:
    """Reasoning, then a call (the output forced by a regex: `auto` leaves the request's own constraint)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "celsius": false}}\n</tool_call>'
    regex = r"<think>\nhmm\n</think>\n\n" + "".join("\\" + c if c in "{}[]().*+?|^$\\" else c for c in call)
    with httpx.Client(base_url=thinker.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "regex": regex,
                                                 "max_tokens": 120, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == "hmm" and msg["content"] is None
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]] == [
        ("get_weather", {"city": "Rome", "celsius": False})]
