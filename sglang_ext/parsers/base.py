"""The streaming tool-call parser every family shares: text in (any increments), events out.

A family (qwen25.py, llama3.py, mistral.py) only describes its format: the markers that open a
region of calls, what follows a marker before the first call, the key of a call's arguments, and what
may follow a call. One call is always the JSON object `{"name": NAME, KEY: ARGS}`:

    TEXT --marker--> OPEN --(open literals)--> HEADER --{"name": "f", "arguments": --> ARGS --} ...--> TAIL
      ^                 \\____ cannot match: the marker is text ___/                          |
      +--------------------- TAIL's next literal ends the region (or leads to the next HEADER) +

Every decision depends on the text seen so far and never on where an increment ended (a tail that
could still become a marker or a header is held back), so a stream cut one character at a time, or
one increment holding several calls, gives the events the whole text gives at once. The non-streamed
answer is that: `parse` feeds the whole text in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Final, NamedTuple

from sglang_ext.parsers.scan import FAIL, MORE, ObjectScan, any_literal, held_prefix, json_string, literal, skip_ws

TEXT: Final = "text"
OPEN: Final = "open"
HEADER: Final = "header"
ARGS: Final = "args"
TAIL: Final = "tail"


class Text(NamedTuple):
    """Content outside calls."""

    text: str


class CallStart(NamedTuple):
    """Call number `call` (0, 1, ... within one output) of function `name` begins; its arguments follow."""

    call: int
    name: str


class CallArgs(NamedTuple):
    """The next piece of call `call`'s arguments (JSON text, as the model writes it)."""

    call: int
    text: str


Event = Text | CallStart | CallArgs


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text


class Parsed(NamedTuple):
    content: str
    calls: list[ToolCall]


@dataclass
class ToolParser:
    """One output's parser. `names`: the functions the request offers (a call of another name stays
    text); `max_calls`: calls recognized at most (parallel_tool_calls false: 1), later ones stay text."""

    names: frozenset[str] | None = None
    max_calls: int | None = None

    # ---- the format (set by each family) ----
    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]]  # markers that open a region of calls
    kept_markers: ClassVar[tuple[str, ...]] = ()  # markers that are the call's own first character(s)
    open_literals: ClassVar[tuple[str, ...]] = ()  # after a marker, before the first call
    args_keys: ClassVar[tuple[str, ...]] = ("arguments",)
    # After a call's closing brace: (literal, next state); HEADER = another call of the region follows.
    # "" always matches: the region ends there.
    after_call: ClassVar[tuple[tuple[str, str], ...]] = ()
    # How a call is written (the grammar of constrained requests, grammar.py).
    call_prefix: ClassVar[str] = ""  # before the first call of a region
    call_separator: ClassVar[str] = ""
    call_suffix: ClassVar[str] = ""  # after the last call of a region
    call_begin_fmt: ClassVar[str]  # with {name} (a JSON string); the arguments object follows
    call_end: ClassVar[str]
    trigger: ClassVar[str]  # what starts a call in free text (auto)

    state: str = field(default=TEXT, init=False)
    buf: str = field(default="", init=False)
    pos: int = field(default=0, init=False)  # everything before is decided
    region: tuple[int, str] = field(default=(0, ""), init=False)  # where the open region's marker is
    region_calls: int = field(default=0, init=False)
    calls: int = field(default=0, init=False)
    scan: ObjectScan | None = field(default=None, init=False)
    args_sent: int = field(default=0, init=False)
    out: list[Event] = field(default_factory=list, init=False)

    # ---- use ----
    def feed(self, text: str) -> list[Event]:
        """Events for the next piece of output text."""
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """Events for what was held back, once the output ended."""
        self._run(final=True)
        return self._take()

    @classmethod
    def parse(cls, text: str, names: frozenset[str] | None = None, max_calls: int | None = None) -> Parsed:
        """A whole output at once (a non-streamed answer)."""
        p = cls(names, max_calls)
        return collect(p.feed(text) + p.finish())

    # ---- the machine ----
    def _calls_open(self) -> bool:
        return self.max_calls is None or self.calls < self.max_calls

    def _run(self, final: bool) -> None:
        step = {TEXT: self._text, OPEN: self._open, HEADER: self._header, ARGS: self._args, TAIL: self._tail}
        while step[self.state](final):
            pass

    def _text(self, final: bool) -> bool:
        buf, pos = self.buf, self.pos
        found, marker = -1, ""
        if self._calls_open():
            for m in self.starts:
                at = buf.find(m, pos)
                if at >= 0 and (found < 0 or at < found or (at == found and len(m) > len(marker))):
                    found, marker = at, m
        if found < 0:
            hold = 0 if final or not self._calls_open() else held_prefix(buf, pos, self.starts)
            self._emit_text(len(buf) - hold)
            return False
        self._emit_text(found)
        rest = buf[found:]
        if not final and any(len(m) > len(rest) and m.startswith(rest) for m in self.starts):
            return False  # a longer marker may be arriving here (`[` of `[TOOL_CALLS]`)
        self.region, self.region_calls = (found, marker), 0
        self.pos = found if marker in self.kept_markers else found + len(marker)
        self.state = OPEN
        return True

    def _open(self, final: bool) -> bool:
        pos = self.pos
        for lit in self.open_literals:
            pos = literal(self.buf, pos, lit)
            if pos < 0:
                return self._undecided(pos, final)
        self.pos, self.state = pos, HEADER
        return True

    def _header(self, final: bool) -> bool:
        buf, pos = self.buf, literal(self.buf, self.pos, "{")
        if pos >= 0:
            pos = literal(buf, pos, '"name"')
        if pos >= 0:
            pos = literal(buf, pos, ":")
        name = ""
        if pos >= 0:
            pos, name = json_string(buf, pos)
            if pos >= 0 and self.names is not None and name not in self.names:
                pos = FAIL
        for lit in (",", tuple(f'"{k}"' for k in self.args_keys), ":", "{"):
            if pos >= 0:
                pos = any_literal(buf, pos, lit) if isinstance(lit, tuple) else literal(buf, pos, lit)
        if pos < 0:
            return self._undecided(pos, final)
        self.out.append(CallStart(self.calls, name))
        self.calls += 1
        self.region_calls += 1
        self.scan = ObjectScan(pos - 1)
        self.pos = self.args_sent = pos - 1
        self.state = ARGS
        return True

    def _args(self, final: bool) -> bool:
        assert self.scan is not None
        end = self.scan.run(self.buf)
        upto = end if end >= 0 else len(self.buf)
        if upto > self.args_sent:
            self.out.append(CallArgs(self.calls - 1, self.buf[self.args_sent : upto]))
            self.pos = self.args_sent = upto
        if end < 0:
            if final:  # the output ended inside the arguments: the call stays as far as it got
                self.pos, self.state = len(self.buf), TEXT
            return False
        self.pos, self.state = end, TAIL
        return True

    def _tail(self, final: bool) -> bool:
        pos = literal(self.buf, self.pos, "}")
        if pos == FAIL:  # no closing brace: what follows is text
            self.state = TEXT
            return True
        if pos == MORE:
            return self._tail_pending(final)
        more, fallback = False, None
        for lit, nxt in self.after_call:
            if nxt == HEADER and not self._calls_open():
                continue
            if not lit:
                fallback = nxt
                continue
            end = literal(self.buf, pos, lit)
            if end >= 0:
                self.pos, self.state = end, nxt
                return True
            more = more or end == MORE
        if more:  # wait for what follows the call's brace
            return self._tail_pending(final)
        self.pos, self.state = (skip_ws(self.buf, pos), fallback) if fallback else (pos, TEXT)
        return True

    def _tail_pending(self, final: bool) -> bool:
        if final:  # only whitespace, or a start of the expected literal, is left: drop it
            self.pos, self.state = len(self.buf), TEXT
        return False

    def _undecided(self, pos: int, final: bool) -> bool:
        """OPEN/HEADER could not match (FAIL), or the text ended inside (MORE)."""
        if pos == MORE and not final:
            return False
        at, marker = self.region
        if self.region_calls:  # calls of this region stand; text resumes where the next one failed
            self.state = TEXT
            return True
        # Not a call: the marker is text, and scanning goes on after it.
        self.pos = at
        self._emit_text(at + len(marker))
        self.state = TEXT
        return True

    def _emit_text(self, upto: int) -> None:
        if upto > self.pos:
            self.out.append(Text(self.buf[self.pos : upto]))
            self.pos = upto

    def _take(self) -> list[Event]:
        out, self.out = merge(self.out), []
        # What is decided need not be kept (a long stream would otherwise rescan it).
        cut = self.region[0] if self.state in (OPEN, HEADER) and not self.region_calls else self.pos
        if cut > 0:
            self.buf = self.buf[cut:]
            self.pos -= cut
            self.args_sent -= cut
            self.region = (self.region[0] - cut, self.region[1])
            if self.scan is not None:
                self.scan.pos -= cut
        return out


def merge(events: list[Event]) -> list[Event]:
    """Adjacent text, and adjacent pieces of one call's arguments, as one event."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Text) and isinstance(last, Text):
            out[-1] = Text(last.text + e.text)
        elif isinstance(e, CallArgs) and isinstance(last, CallArgs) and last.call == e.call:
            out[-1] = CallArgs(e.call, last.text + e.text)
        elif not (isinstance(e, Text | CallArgs) and not e.text):
            out.append(e)
    return out


def collect(events: list[Event]) -> Parsed:
    """Events folded into content and whole calls."""
    text: list[str] = []
    names: list[str] = []
    args: list[list[str]] = []
    for e in events:
        if isinstance(e, Text):
            text.append(e.text)
        elif isinstance(e, CallStart):
            names.append(e.name)
            args.append([])
        else:
            args[e.call].append(e.text)
    return Parsed("".join(text), [ToolCall(n, "".join(a)) for n, a in zip(names, args, strict=True)])
