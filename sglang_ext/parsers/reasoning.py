"""Reasoning parsers for `<think>` models: the text between `<think>` and `</think>` is reasoning
(`reasoning_content`), the rest content.

`qwen3`: reasoning only when the output starts with `<think>` (Qwen3 with thinking off writes none).
`deepseek-r1` / `qwen3-thinking`: the chat template already opened the block, so the output starts
inside it: everything up to `</think>` is reasoning, and all of it when `</think>` never comes.
Whitespace right after either tag, and right before `</think>`, is dropped. Like the tool parsers,
decisions wait for the text that settles them, so any cut of the stream gives the same two texts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, NamedTuple

from sglang_ext.parsers.scan import held_prefix, skip_ws

START: Final = "<think>"
END: Final = "</think>"
_BEFORE, _IN, _AFTER = "before", "in", "after"


class Split(NamedTuple):
    reasoning: str
    content: str


@dataclass
class ReasoningParser:
    forced: bool = False  # the output starts inside the reasoning block
    state: str = field(default=_BEFORE, init=False)
    buf: str = field(default="", init=False)
    skip: bool = field(default=False, init=False)  # drop whitespace next (after a tag)

    def __post_init__(self) -> None:
        if self.forced:
            self.state, self.skip = _IN, True

    def feed(self, text: str) -> Split:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> Split:
        return self._run(final=True)

    @classmethod
    def split(cls, text: str, forced: bool = False) -> Split:
        p = cls(forced)
        a, b = p.feed(text), p.finish()
        return Split(a.reasoning + b.reasoning, a.content + b.content)

    def _run(self, final: bool) -> Split:
        reasoning, content = "", ""
        while True:
            if self.skip:
                at = skip_ws(self.buf, 0)
                self.buf = self.buf[at:]
                if not self.buf and not final:
                    break
                self.skip = False
            if self.state == _BEFORE:
                head = self.buf
                if head.startswith(START):
                    self.buf, self.state, self.skip = head[len(START):], _IN, True
                    continue
                if START.startswith(head) and not final:
                    break  # still could be the start tag
                self.state = _AFTER
            if self.state == _IN:
                at = self.buf.find(END)
                if at >= 0:
                    reasoning += self.buf[:at].rstrip()
                    self.buf, self.state, self.skip = self.buf[at + len(END):], _AFTER, True
                    continue
                upto = len(self.buf) - (0 if final else held_prefix(self.buf, 0, (END,)))
                if not final:  # whitespace before `</think>` is dropped: hold it until text follows
                    upto = len(self.buf[:upto].rstrip())
                reasoning += self.buf[:upto]
                self.buf = self.buf[upto:]
                break
            content += self.buf
            self.buf = ""
            break
        return Split(reasoning, content)
