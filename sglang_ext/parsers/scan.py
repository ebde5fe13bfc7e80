"""Prefix matching over text that is still arriving: each matcher answers the end of its match, MORE
(the text ends inside something that could still match) or FAIL (it cannot match, whatever follows).

The streaming parsers decide only on what these answer, never on where an increment ended, so
their result is the same however the text is cut.
"""

from __future__ import annotations

import json
from typing import Final

MORE: Final = -1
FAIL: Final = -2
_WS: Final = " \t\r\n"


def skip_ws(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in _WS:
        pos += 1
    return pos


def literal(buf: str, pos: int, text: str) -> int:
    """`text` after optional whitespace at `pos`."""
    pos = skip_ws(buf, pos)
    rest = buf[pos : pos + len(text)]
    if rest == text:
        return pos + len(text)
    return MORE if text.startswith(rest) and pos + len(rest) == len(buf) else FAIL


def any_literal(buf: str, pos: int, texts: tuple[str, ...]) -> int:
    """The first of `texts` that matches; MORE while any still could."""
    more = False
    for t in texts:
        end = literal(buf, pos, t)
        if end >= 0:
            return end
        more = more or end == MORE
    return MORE if more else FAIL


def json_string(buf: str, pos: int) -> tuple[int, str]:
    """A JSON string after optional whitespace: (end, its value)."""
    pos = skip_ws(buf, pos)
    if pos == len(buf):
        return MORE, ""
    if buf[pos] != '"':
        return FAIL, ""
    i = pos + 1
    while i < len(buf):
        c = buf[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            try:
                return i + 1, json.loads(buf[pos : i + 1])
            except ValueError:
                return FAIL, ""
        if c == "\n":
            return FAIL, ""
        i += 1
    return MORE, ""


def held_prefix(buf: str, start: int, markers: tuple[str, ...]) -> int:
    """How many characters at the end of buf[start:] could begin one of `markers` (held back as text
    until the next characters say whether they do)."""
    longest = 0
    tail_len = len(buf) - start
    for m in markers:
        for k in range(min(len(m) - 1, tail_len), longest, -1):
            if buf.endswith(m[:k]):
                longest = k
                break
    return longest


class ObjectScan:
    """Finds where a JSON object ends, resuming where the previous call stopped: strings (with their
    escapes) are skipped and brackets counted. What lies inside is not validated: like OpenAI's, a
    call's arguments are the text the model wrote (a constrained request's always parse)."""

    __slots__ = ("depth", "escape", "in_string", "pos")

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escape = False

    def run(self, buf: str) -> int:
        """The end (one past the closing brace) once seen, else MORE."""
        i = self.pos
        n = len(buf)
        while i < n:
            c = buf[i]
            i += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return MORE
