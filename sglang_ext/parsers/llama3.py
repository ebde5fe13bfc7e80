"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: a call is the object itself, after an optional
`<|python_tag|>`, and several are separated by `;`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A `{` in ordinary text is a call only when a whole call header follows it (so the calls are read
whether or not decoding kept the `<|python_tag|>` special token).
"""

from __future__ import annotations

from typing import ClassVar

from sglang_ext.parsers.base import HEADER, TEXT, ToolParser


class Llama3Parser(ToolParser):
    name: ClassVar[str] = "llama3"
    starts: ClassVar[tuple[str, ...]] = ("<|python_tag|>", "{")
    kept_markers: ClassVar[tuple[str, ...]] = ("{",)
    args_keys: ClassVar[tuple[str, ...]] = ("parameters", "arguments")
    after_call: ClassVar[tuple[tuple[str, str], ...]] = ((";", HEADER), ("", TEXT))
    call_separator: ClassVar[str] = "; "
    call_begin_fmt: ClassVar[str] = '{{"name": {name}, "parameters": '
    call_end: ClassVar[str] = "}"
    trigger: ClassVar[str] = '{"name": '
