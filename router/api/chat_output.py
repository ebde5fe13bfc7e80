"""One chat choice's output as OpenAI shapes it: `<think>` reasoning apart (`reasoning_content`), tool
calls apart (`tool_calls`), the rest `content`. Whole (a message) or streamed (deltas): both run the same
parsers, so a stream's pieces add up to the message. Without parsers the text passes through untouched.

Streamed, a call is a first delta with `index`, `id`, `type` and `function.name` (arguments ""), then
deltas with pieces of `function.arguments`; several calls in one increment come as several deltas.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from router.api.openai_tools import ToolPlan
from sglang_ext.parsers.base import CallArgs, CallStart, Event, Text, ToolParser
from sglang_ext.parsers.reasoning import ReasoningParser

Delta = dict[str, Any]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChoiceOutput:
    plan: ToolPlan
    reasoning: ReasoningParser | None = field(init=False)
    tools: ToolParser | None = field(init=False)
    ids: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        p = self.plan
        self.reasoning = ReasoningParser(p.reasoning) if p.reasoning is not None else None
        self.tools = p.parser(p.names, None if p.parallel else 1) if p.calls and p.parser is not None else None

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's `tool_calls` for an output that stopped by itself after making calls."""
        return "tool_calls" if reason == "stop" and self.called else reason

    # ---- streamed ----
    def deltas(self, text: str, final: bool) -> list[Delta]:
        """The deltas for the next piece of text (`final`: the output ended, release what was held)."""
        if self.reasoning is None and self.tools is None:
            return [{"content": text}] if text else []
        out: list[Delta] = []
        content = text
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if final:
                end = self.reasoning.finish()
                split = type(split)(split.reasoning + end.reasoning, split.content + end.content)
            if split.reasoning:
                out.append({"reasoning_content": split.reasoning})
            content = split.content
        if self.tools is None:
            return out + ([{"content": content}] if content else [])
        events = self.tools.feed(content) + (self.tools.finish() if final else [])
        return out + [self._delta(e) for e in events]

    def _delta(self, e: Event) -> Delta:
        if isinstance(e, Text):
            return {"content": e.text}
        if isinstance(e, CallStart):
            self.ids.append(call_id())
            return {"tool_calls": [{"index": e.call, "id": self.ids[-1], "type": "function",
                                    "function": {"name": e.name, "arguments": ""}}]}
        assert isinstance(e, CallArgs)
        return {"tool_calls": [{"index": e.call, "function": {"arguments": e.text}}]}

    # ---- whole ----
    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed message: the whole text through the same parsers, the deltas folded."""
        if self.reasoning is None and self.tools is None:
            return {"role": "assistant", "content": text}
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        for d in self.deltas(text, final=True):
            reasoning.append(d.get("reasoning_content", ""))
            content.append(d.get("content", ""))
            for c in d.get("tool_calls", ()):
                if "id" in c:
                    calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
                else:
                    calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        text_out = "".join(content)
        msg: dict[str, Any] = {"role": "assistant", "content": None if calls and not text_out.strip() else text_out}
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(reasoning) or None
        if calls:
            msg["tool_calls"] = calls
        return msg
