"""Qwen 2.5 and Qwen 3 (and the embedded default model): each call in its own tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with text allowed around and between calls.
"""

from __future__ import annotations

from typing import ClassVar

from sglang_ext.parsers.base import TEXT, ToolParser


class Qwen25Parser(ToolParser):
    name: ClassVar[str] = "qwen25"
    starts: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    after_call: ClassVar[tuple[tuple[str, str], ...]] = (("</tool_call>", TEXT),)
    call_separator: ClassVar[str] = "\n"
    call_begin_fmt: ClassVar[str] = '<tool_call>\n{{"name": {name}, "arguments": '
    call_end: ClassVar[str] = "}\n</tool_call>"
    trigger: ClassVar[str] = "<tool_call>"
