"""Request bodies decoded with a bound on how deeply arrays and objects nest.

Every later step (msgspec conversion, sampling and grammar code, the message to the worker) walks a
body recursively, and Python's recursion limit (~1000 frames) is shared with the server's own stack:
a body nested a few hundred levels deep used to end in a RecursionError, a 500 with a traceback.
No real request nests beyond a handful of levels (a JSON schema for constrained decoding perhaps a few
dozen), so anything deeper than MAX_DEPTH is refused as bad input.

msgspec decodes first (in C; its own recursion guard turns a body too deep for it into a
RecursionError, caught here), so the depth scan only ever sees valid JSON, where escapes and string
literals can be cut out with plain byte operations. The scan has no Python loop per byte: a 32 MiB
body of brackets takes tens of milliseconds.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import numpy as np

MAX_DEPTH: Final = 128
_CHUNK: Final = 1 << 20  # brackets per cumulative sum: bounds the scan's memory at a few MiB
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS: Final = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")  # as int8: +1 opens a level, -1 closes one


class TooDeep(ValueError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the JSON body is nested too deeply: more than {limit} levels of arrays and objects")


def _brackets(doc: bytes) -> bytes:
    """The brackets of valid JSON `doc` outside its strings, in order."""
    # In valid JSON a backslash only starts an escape; dropping the `\\` escapes first (scanning left
    # to right, each pair is one escape) leaves every remaining `\"` an escaped quote. With those gone,
    # every quote opens or closes a string: the even pieces between quotes are outside strings.
    unescaped = doc.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    return outside.translate(None, _NOT_BRACKETS)


def exceeds_depth(doc: bytes, limit: int) -> bool:
    """Whether valid JSON `doc` nests arrays/objects more than `limit` levels deep."""
    steps = np.frombuffer(_brackets(doc).translate(_STEPS), dtype=np.int8)
    level = 0
    for start in range(0, len(steps), _CHUNK):
        run = np.cumsum(steps[start:start + _CHUNK], dtype=np.int32)
        if level + int(run.max()) > limit:
            return True
        level += int(run[-1])
    return False


def decode_json(body: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The decoded body; TooDeep past `max_depth` levels, msgspec.DecodeError when malformed."""
    try:
        data = msgspec.json.decode(body)
    except RecursionError:
        raise TooDeep(max_depth) from None
    # A body cannot nest deeper than it has opening brackets: most bodies skip the scan.
    if body.count(b"[") + body.count(b"{") > max_depth and exceeds_depth(body, max_depth):
        raise TooDeep(max_depth)
    return data
