"""Mistral (v0.3 tokenizers): the calls as one JSON array after the `[TOOL_CALLS]` token,

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

The marker is a control token, which decoding skips by default: an array of calls without it counts
too (a `[` in ordinary text is a call only when a whole call header follows it).
"""

from __future__ import annotations

from typing import ClassVar

from sglang_ext.parsers.base import HEADER, TEXT, ToolParser


class MistralParser(ToolParser):
    name: ClassVar[str] = "mistral"
    starts: ClassVar[tuple[str, ...]] = ("[TOOL_CALLS]", "[")
    kept_markers: ClassVar[tuple[str, ...]] = ("[",)
    open_literals: ClassVar[tuple[str, ...]] = ("[",)
    after_call: ClassVar[tuple[tuple[str, str], ...]] = ((",", HEADER), ("]", TEXT))
    call_prefix: ClassVar[str] = "[TOOL_CALLS] ["
    call_separator: ClassVar[str] = ", "
    call_suffix: ClassVar[str] = "]"
    call_begin_fmt: ClassVar[str] = '{{"name": {name}, "arguments": '
    call_end: ClassVar[str] = "}"
    trigger: ClassVar[str] = "[TOOL_CALLS]"
