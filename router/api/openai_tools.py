"""OpenAI function calling on the request side: `tools`, `tool_choice` and `parallel_tool_calls` checked
(a 400 names the field), turned into what the worker renders (the tools, through the chat template) and
what it decodes under (tool_choice as a structural tag in the parser's own format, grammar.py).

The model's parsers come from its workers' hello (`WorkerInfo.tool_call_parser` / `reasoning_parser`,
their server arguments): the router parses the output (chat_output.py), so it must know them.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from router.api.common import quote
from router.errors import ApiError
from sglang_ext.messages import WorkerInfo
from sglang_ext.parsers import REASONING_PARSERS, TOOL_PARSERS
from sglang_ext.parsers.base import ToolParser
from sglang_ext.parsers.grammar import tool_call_tag
from sglang_ext.sampling.params import SamplingParams

_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_CONSTRAINTS: Final = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of function calling. `mode`: none, auto, required, or the name of the
    one function to call; `tools`: what the template renders (None with tool_choice none)."""

    mode: str = "none"
    tools: list[dict[str, Any]] | None = None
    functions: tuple[tuple[str, Any], ...] = ()  # (name, parameters schema or None)
    parallel: bool = True
    parser: type[ToolParser] | None = None
    reasoning: bool | None = None  # None: no reasoning parser; else whether the output starts inside

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n for n, _ in self.functions)

    @property
    def calls(self) -> bool:
        """Tool calls are parsed out of the output."""
        return self.mode != "none" and self.parser is not None


def _functions(tools: list[dict[str, Any]]) -> tuple[tuple[str, Any], ...]:
    if not tools:
        raise ApiError(400, "tools must not be empty (leave it out instead)", param="tools")
    out: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise ApiError(400, f"{where}.type must be 'function', got {quote(tool.get('type'))}", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"{where}.function must be an object with the function's name", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'; "
                           f"got {quote(name)}", param="tools")
        if name in out:
            raise ApiError(400, f"{where}.function.name {name!r} is given twice", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
        if not isinstance(fn.get("description", ""), str | None):
            raise ApiError(400, f"{where}.function.description must be a string", param="tools")
        out[name] = params
    return tuple(out.items())


def _mode(choice: Any, names: set[str], has_tools: bool) -> str:
    if choice is None:
        return "auto" if has_tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(400, f"tool_choice must be 'none', 'auto', 'required' or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}; got {quote(choice)}",
                           param="tool_choice")
        mode = choice
    else:
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                           f"'function': {{'name': ...}}}}; got {quote(choice)}", param="tool_choice")
        if has_tools and name not in names:
            raise ApiError(400, f"tool_choice.function.name {name!r} is not one of the tools", param="tool_choice")
        mode = name
    if mode != "none" and not has_tools:
        raise ApiError(400, f"tool_choice {quote(mode)} needs tools", param="tool_choice")
    return mode


def plan_tools(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool, model: str,
               info: WorkerInfo | None) -> ToolPlan:
    reasoning = REASONING_PARSERS.get(info.reasoning_parser) if info is not None else None
    functions = _functions(tools) if tools is not None else ()
    mode = _mode(choice, {n for n, _ in functions}, tools is not None)
    if mode == "none":  # as SGLang: the template does not offer tools the model may not call
        return ToolPlan(reasoning=reasoning)
    parser = TOOL_PARSERS.get(info.tool_call_parser) if info is not None and info.tool_call_parser else None
    if parser is None:
        raise ApiError(400, f"model {model!r} has no tool-call parser, so tools cannot be used with it (start its "
                       f"workers with --tool-call-parser: {', '.join(sorted(set(TOOL_PARSERS)))})", param="tools")
    return ToolPlan(mode, tools, functions, parallel, parser, reasoning)


def constrain(plan: ToolPlan, sp: SamplingParams, grammar: bool) -> SamplingParams:
    """`sp` decoding under the tool_choice's grammar. A request's own constraint (response_format, regex,
    ...) wins over `auto`'s, and is refused beside `required` or a named function. `grammar`: the
    workers compile grammars (not --grammar-backend none); without, `auto` runs unconstrained."""
    if plan.parser is None or plan.mode == "none":
        return sp
    own = [k for k in _CONSTRAINTS if getattr(sp, k) is not None]
    if plan.mode == "auto" and (own or not grammar):
        return sp
    if own:
        raise ApiError(400, f"tool_choice {quote(plan.mode)} constrains the output itself: it cannot be combined "
                       f"with {own[0]} (or response_format)", param="tool_choice")
    tag = tool_call_tag(plan.parser, dict(plan.functions), plan.mode, plan.parallel, plan.reasoning)
    return msgspec.structs.replace(sp, structural_tag=tag)


def template_calls(i: int, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """messages[i].tool_calls (an earlier assistant turn) for the template: each `function.arguments`, a
    JSON string in OpenAI's shape, as the object templates expect (a string that is not JSON stays one)."""
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].function must be an object with a name",
                           param="messages")
        fn = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(msgspec.DecodeError):
                fn["arguments"] = msgspec.json.decode(args) if args.strip() else {}
        out.append({**c, "type": c.get("type", "function"), "function": fn})
    return out
