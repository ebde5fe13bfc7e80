"""Tool-call and reasoning parsers (sglang_ext/parsers): every family whole, streamed one character at a
time, with several calls in one increment and in random cuts; text around calls; malformed calls stay
text; and the tool_choice grammars accept exactly the calls their parser reads."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from sglang_ext.parsers import REASONING_PARSERS, TOOL_PARSERS, check_reasoning_parser, tool_parser_name
from sglang_ext.parsers.base import CallArgs, CallStart, Event, Parsed, Text, ToolCall, ToolParser, collect
from sglang_ext.parsers.grammar import tool_call_tag
from sglang_ext.parsers.llama3 import Llama3Parser
from sglang_ext.parsers.mistral import MistralParser
from sglang_ext.parsers.qwen25 import Qwen25Parser
from sglang_ext.parsers.reasoning import ReasoningParser, Split

WEATHER = '{"city": "Pa}ris \\"Nord\\"", "days": [1, {"x": "]"}], "unit": "c"}'
ADD = '{"a": 1, "b": 2.5}'
NAMES = frozenset({"get_weather", "add"})
CALLS = [ToolCall("get_weather", WEATHER), ToolCall("add", ADD)]

# (parser, output text, expected content, expected calls)
CASES: list[tuple[type[ToolParser], str, str, list[ToolCall]]] = [
    (Qwen25Parser,
     f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
     f'<tool_call>\n{{"name": "add", "arguments": {ADD}}}\n</tool_call> Done.',
     "Let me check.\n\n Done.", CALLS),
    (Qwen25Parser, f'<tool_call>{{"name":"add","arguments":{ADD}}}</tool_call>', "", [ToolCall("add", ADD)]),
    (Llama3Parser,
     f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "add", "arguments": {ADD}}}',
     "", CALLS),
    (Llama3Parser, f'Sure {{x}} {{"name": "add", "parameters": {ADD}}} bye', "Sure {x} bye", [ToolCall("add", ADD)]),
    (MistralParser,
     f'Hi [TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "add", "arguments": {ADD}}}]'
     " ok", "Hi  ok", CALLS),
    (MistralParser, f'[TOOL_CALLS][{{"name":"add","arguments":{ADD}}}]', "", [ToolCall("add", ADD)]),
    (MistralParser, f'See [1] [{{"name": "add", "arguments": {ADD}}}]', "See [1] ", [ToolCall("add", ADD)]),
]
MALFORMED: list[tuple[type[ToolParser], str]] = [
    (Qwen25Parser, "a <tool_call>{not json}</tool_call> b"),
    (Qwen25Parser, 'a <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),  # not an offered tool
    (Qwen25Parser, 'a <tool_call>\n{"arguments": {}, "name": "add"}'),
    (Qwen25Parser, "ends inside <tool_call>\n{\"name\": \"ad"),
    (Llama3Parser, 'x = {"a": 1}; {"name": 3}'),
    (Llama3Parser, "<|python_tag|>print('hi')"),
    (MistralParser, "[TOOL_CALLS] nothing"),
    (MistralParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": [1]}]'),
]


def stream(parser: ToolParser, pieces: list[str]) -> list[Event]:
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def cuts(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        out.append(text[i : i + n])
        i += n
    return out


def check_shape(events: list[Event]) -> None:
    """A call's first event names it; its arguments follow in order; indexes count from 0."""
    started = -1
    for e in events:
        if isinstance(e, CallStart):
            assert e.call == started + 1
            started = e.call
        elif isinstance(e, CallArgs):
            assert e.call == started and e.text


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES)
def test_whole_and_streamed(cls: type[ToolParser], text: str, content: str, calls: list[ToolCall]) -> None:
    whole = cls.parse(text, NAMES)
    assert whole == Parsed(content, calls)
    for c in whole.calls:
        json.loads(c.arguments)
    by_char = stream(cls(NAMES), list(text))
    check_shape(by_char)
    assert collect(by_char) == whole  # argument deltas concatenate to the non-streamed arguments
    assert any(isinstance(e, CallArgs) and len(e.text) == 1 for e in by_char)  # arguments really stream
    rng = random.Random(7)
    for _ in range(30):
        events = stream(cls(NAMES), cuts(text, rng))
        check_shape(events)
        assert collect(events) == whole


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES)
def test_several_calls_in_one_increment(cls: type[ToolParser], text: str, content: str,
                                        calls: list[ToolCall]) -> None:
    parser = cls(NAMES)
    first = parser.feed(text[:3])
    rest = parser.feed(text[3:])
    assert [e.name for e in rest if isinstance(e, CallStart)] == [c.name for c in calls]
    events = first + rest + parser.finish()
    check_shape(events)
    assert collect(events) == Parsed(content, calls)


@pytest.mark.parametrize(("cls", "text"), MALFORMED)
def test_malformed_stays_text(cls: type[ToolParser], text: str) -> None:
    assert cls.parse(text, NAMES) == Parsed(text, [])
    assert collect(stream(cls(NAMES), list(text))) == Parsed(text, [])


def test_held_marker_prefix_and_names() -> None:
    p = Qwen25Parser(NAMES)
    assert p.feed("Hello <tool") == [Text("Hello ")]  # could still be <tool_call>
    assert p.feed("box>") == [Text("<toolbox>")]
    assert Qwen25Parser.parse("Hi <tool_c") == Parsed("Hi <tool_c", [])
    assert Qwen25Parser.parse('<tool_call>{"name": "x", "arguments": {}}</tool_call>').calls == [ToolCall("x", "{}")]


def test_max_calls() -> None:
    text = CASES[0][1]
    one = Qwen25Parser.parse(text, NAMES, max_calls=1)
    assert one.calls == CALLS[:1]
    assert '<tool_call>\n{"name": "add"' in one.content
    assert collect(stream(Qwen25Parser(NAMES, 1), list(text))) == one
    llama = Llama3Parser.parse(CASES[2][1], NAMES, max_calls=1)
    assert llama.calls == CALLS[:1] and llama.content.startswith('; {"name": "add"')


def test_truncated_call_keeps_its_arguments() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    assert Qwen25Parser.parse(text, NAMES) == Parsed("", [ToolCall("add", '{"a": 1')])


def test_names_and_aliases() -> None:
    assert tool_parser_name("qwen") == tool_parser_name("qwen25") == "qwen25"
    assert {tool_parser_name(n) for n in TOOL_PARSERS} == {"qwen25", "llama3", "mistral"}
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        tool_parser_name("gpt")
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek-r1"}
    with pytest.raises(ValueError, match="reasoning_parser"):
        check_reasoning_parser("r1")


REASONING: list[tuple[str, bool, Split]] = [
    ("<think>\nLet me see.\n</think>\n\nThe answer.", False, Split("Let me see.", "The answer.")),
    ("No thinking here <think>x</think>", False, Split("", "No thinking here <think>x</think>")),
    ("Weighing it.</think>Yes.", True, Split("Weighing it.", "Yes.")),
    ("Still thinking <", True, Split("Still thinking <", "")),
    ("<thi", False, Split("", "<thi")),
    ("<think>a</thin", False, Split("a</thin", "")),
    ("<think> a \n b \n</think>\n c ", False, Split("a \n b", "c ")),
]


@pytest.mark.parametrize(("text", "forced", "split"), REASONING)
def test_reasoning(text: str, forced: bool, split: Split) -> None:
    assert ReasoningParser.split(text, forced) == split
    p = ReasoningParser(forced)
    parts = [p.feed(c) for c in text] + [p.finish()]
    assert Split("".join(s.reasoning for s in parts), "".join(s.content for s in parts)) == split


# ---- grammars: what the constraint allows is what the parser reads --------------------------------
SCHEMAS: dict[str, Any] = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "add": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
}


def _matcher(tag: str) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from sglang_ext.models.default_model import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(tag)), tok.eos_token_id


def _accepts(tag: str, text: str) -> bool:
    m, eos = _matcher(tag)
    return bool(m.accept_string(text) and m.accept_token(eos))


def _call(cls: type[ToolParser], *calls: tuple[str, str]) -> str:
    body = cls.call_separator.join(cls.call_begin_fmt.format(name=json.dumps(n)) + a + cls.call_end
                                   for n, a in calls)
    return cls.call_prefix + body + cls.call_suffix


@pytest.mark.parametrize("cls", [Qwen25Parser, Llama3Parser, MistralParser])
def test_tool_choice_grammars(cls: type[ToolParser]) -> None:
    good = _call(cls, ("get_weather", '{"city": "Rome"}'), ("add", '{"a": 3}'))
    assert cls.parse(good, NAMES).calls == [ToolCall("get_weather", '{"city": "Rome"}'), ToolCall("add", '{"a": 3}')]
    required = tool_call_tag(cls, SCHEMAS, "required", parallel=True)
    assert _accepts(required, good)
    assert not _accepts(required, "")  # at least one call
    assert not _accepts(required, "Hello")
    assert not _accepts(required, _call(cls, ("add", '{"a": "three"}')))  # the schema holds
    single = tool_call_tag(cls, SCHEMAS, "required", parallel=False)
    assert _accepts(single, _call(cls, ("add", '{"a": 3}')))
    assert not _accepts(single, good)
    named = tool_call_tag(cls, SCHEMAS, "add", parallel=True)
    assert _accepts(named, _call(cls, ("add", '{"a": 3}')))
    assert not _accepts(named, _call(cls, ("get_weather", '{"city": "Rome"}')))
    auto = tool_call_tag(cls, SCHEMAS, "auto", parallel=True)
    assert _accepts(auto, "Just text.")
    assert _accepts(auto, "Well " + _call(cls, ("add", '{"a": 3}')))
    assert not _accepts(auto, "Well " + _call(cls, ("add", '{"a": "x"}')))


def test_reasoning_prefix_grammar() -> None:
    call = _call(Qwen25Parser, ("add", '{"a": 3}'))
    tag = tool_call_tag(Qwen25Parser, SCHEMAS, "required", parallel=False, reasoning=False)
    assert _accepts(tag, call)
    assert _accepts(tag, "<think>hmm</think>\n\n" + call)
    forced = tool_call_tag(Qwen25Parser, SCHEMAS, "required", parallel=False, reasoning=True)
    assert _accepts(forced, "hmm</think>\n\n" + call)
    split = ReasoningParser.split("hmm</think>\n\n" + call, forced=True)
    assert split.reasoning == "hmm" and Qwen25Parser.parse(split.content).calls == [ToolCall("add", '{"a": 3}')]


def test_server_args_and_cluster_files() -> None:
    import msgspec

    from router.config import ClusterSpec, ConfigError, build_cluster
    from sglang_ext.server_args import ServerArgs

    assert ServerArgs().resolved_tool_call_parser == "qwen25"  # the embedded model's template
    assert ServerArgs(model_path="preset:llama-3-8b").resolved_tool_call_parser == "qwen25"
    assert ServerArgs(model_path="/m/llama", tool_call_parser="llama3").resolved_tool_call_parser == "llama3"
    assert ServerArgs(model_path="/m/qwen", tool_call_parser="qwen").resolved_tool_call_parser == "qwen25"
    assert ServerArgs(model_path="/m/other").resolved_tool_call_parser == ""
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerArgs(tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerArgs(reasoning_parser="think")
    spec = msgspec.convert({"models": [{"args": {"tool_call_parser": "mistral", "reasoning_parser": "qwen3"},
                                        "workers": [{}]}]}, ClusterSpec)
    (w,) = build_cluster(spec).workers
    assert (w.args.resolved_tool_call_parser, w.args.reasoning_parser) == ("mistral", "qwen3")
    bad = msgspec.convert({"models": [{"args": {"tool_call_parser": "nope"}, "workers": [{}]}]}, ClusterSpec)
    with pytest.raises(ConfigError, match="tool_call_parser"):
        build_cluster(bad)
