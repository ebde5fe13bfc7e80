"""Every message the transports exchange: kinds, typed headers, one header layout, the IPC handshake.

A pair's control channel (`Link`, link.py: gloo, CPU tensors) carries headers, each an int64[8] tensor
[kind, field 1, .., field n, 0, ..]; payload tensors, when a header announces them, follow it. The
headers of remote attention (sender -> executor host) and of prefill/decode hand-offs (prefill ->
decode) share the one enum and layout, so a header read on the wrong pair fails as that, not as data.

    remote attention                          answer
    Load(handle, length, n_pages, reserve)    + KV pages [n, L, 2, P, Hkv, D]   -> Reply(1 ok | 0 full)
    LoadStaged(handle, length, n_pages, reserve)   (the first pages in the stage) -> Reply(1 | 0)
    LoadMore(handle, first, count)                 (the next pages in the stage)  -> Reply(1)
    Release(handle)
    Begin(n_rows)                             + int64 [2, n] (handles; positions) -> Reply(f) + int64 [f] dropped
    Hello(nbytes)                             + msgpack IpcHello                  -> Reply(nbytes) + msgpack IpcWelcome
    Close()                                   cuda_ipc: the host answers Bye() on Tag.WATCH once drained
    prefill/decode hand-offs
    KV(room, n_tokens, n_pages, first_token)  + KV pages
    Placed(room, n_tokens, handle, first_token)    (the KV stayed in the prefill worker's executor)
    Stage(nbytes)                             + the decode stage's IpcHandle bytes (decode -> prefill)
    KVStaged(room, n_tokens, n_pages, first_token, first, count)                  -> Reply(1)
    Close()

Both ends run the same version: kinds are numbered here only, and nothing older is understood.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import ClassVar, Final, TypeVar

import msgspec
import torch

HEADER_WORDS: Final = 8


class LinkError(RuntimeError):
    """The pair is broken: the peer closed it, died, did not answer in time, or broke the protocol."""


class ProtocolError(LinkError):
    """A header or blob that is not what this end expects (an unknown kind, a wrong size or order)."""


class Kind(IntEnum):
    REPLY = 1
    CLOSE = 2
    LOAD = 3
    LOAD_STAGED = 4
    LOAD_MORE = 5
    RELEASE = 6
    BEGIN = 7
    HELLO = 8
    BYE = 9
    KV = 10
    PLACED = 11
    STAGE = 12
    KV_STAGED = 13


class Tag(IntEnum):
    """The pair's channels: headers and control payloads, a step's q|k|v, its outputs, the watch."""

    CTRL = 0
    QKV = 1
    OUT = 2
    WATCH = 3  # cuda_ipc: only the host's Bye, or an error when the pair breaks


class Header(msgspec.Struct, frozen=True):
    kind: ClassVar[Kind]


class Reply(Header, frozen=True):
    kind = Kind.REPLY
    value: int  # 1 ok | 0 full; the number of dropped rows; a blob's bytes


class Close(Header, frozen=True):
    kind = Kind.CLOSE


class Load(Header, frozen=True):
    kind = Kind.LOAD
    handle: int
    length: int  # tokens the KV covers
    n_pages: int
    reserve: int = 0  # tokens to hold pages for (the request's longest); 0: just its KV


class LoadStaged(Header, frozen=True):
    kind = Kind.LOAD_STAGED
    handle: int
    length: int
    n_pages: int  # of the whole KV; the stage holds its first pages
    reserve: int = 0


class LoadMore(Header, frozen=True):
    kind = Kind.LOAD_MORE
    handle: int
    first: int
    count: int


class Release(Header, frozen=True):
    kind = Kind.RELEASE
    handle: int


class Begin(Header, frozen=True):
    kind = Kind.BEGIN
    n_rows: int


class Hello(Header, frozen=True):
    kind = Kind.HELLO
    nbytes: int


class Bye(Header, frozen=True):
    kind = Kind.BYE


class KV(Header, frozen=True):
    kind = Kind.KV
    room: int
    n_tokens: int
    n_pages: int
    first_token: int


class Placed(Header, frozen=True):
    kind = Kind.PLACED
    room: int
    n_tokens: int
    handle: int  # the request's handle in the prefill worker's executor
    first_token: int


class Stage(Header, frozen=True):
    kind = Kind.STAGE
    nbytes: int


class KVStaged(Header, frozen=True):
    kind = Kind.KV_STAGED
    room: int
    n_tokens: int
    n_pages: int
    first_token: int
    first: int  # this chunk's first page
    count: int


_BY_KIND: Final[dict[Kind, type[Header]]] = {
    c.kind: c for c in (Reply, Close, Load, LoadStaged, LoadMore, Release, Begin, Hello, Bye, KV, Placed, Stage,
                        KVStaged)}
assert set(_BY_KIND) == set(Kind), "every kind has its header"
assert all(len(c.__struct_fields__) < HEADER_WORDS for c in _BY_KIND.values())
H = TypeVar("H", bound=Header)


def fields(h: Header) -> tuple[int, ...]:
    return tuple(getattr(h, f) for f in h.__struct_fields__)


def pack(h: Header) -> torch.Tensor:
    """The header's int64[8] tensor: [kind, fields.., 0 ..]."""
    out = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    vals = (int(h.kind), *fields(h))
    out[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return out


def empty() -> torch.Tensor:
    """A tensor to receive a header into."""
    return torch.empty(HEADER_WORDS, dtype=torch.int64)


def unpack(t: torch.Tensor) -> Header:
    """The header in `t`; ProtocolError when it is not an int64[8] header of a known kind."""
    if t.dtype != torch.int64 or tuple(t.shape) != (HEADER_WORDS,):
        raise ProtocolError(f"a header is {HEADER_WORDS} int64, got {t.dtype} {tuple(t.shape)}")
    words = [int(x) for x in t.tolist()]
    try:
        cls = _BY_KIND[Kind(words[0])]
    except ValueError:
        raise ProtocolError(f"unknown message kind {words[0]}") from None
    n = len(cls.__struct_fields__)
    if any(words[1 + n :]):
        raise ProtocolError(f"a {cls.__name__} header has {n} field(s), got {words[1:]}")
    return cls(*words[1 : 1 + n])


def expect(h: Header, cls: type[H]) -> H:
    """`h` as a `cls`; ProtocolError when it is another message."""
    if not isinstance(h, cls):
        raise ProtocolError(f"expected {cls.__name__}, got {h!r}")
    return h


# ---- the cuda_ipc handshake --------------------------------------------------------------------------
IPC_HANDLE_BYTES: Final = 64
_HANDLE: Final = struct.Struct("<64sQQ")
MAX_BLOB: Final = 4096  # a handshake message's bytes
MAX_ROWS: Final = 1 << 16


class IpcHandle(msgspec.Struct, frozen=True):
    """What another process on the node needs to map a device buffer: the handle of the allocation that
    holds it (64 opaque bytes from cuIpcGetMemHandle), the buffer's offset in it, and its size. Travels as
    `to_bytes()` (80 bytes); never pickled."""

    handle: bytes
    offset: int
    nbytes: int

    def to_bytes(self) -> bytes:
        return _HANDLE.pack(self.handle, self.offset, self.nbytes)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "") -> IpcHandle:
        if len(data) != _HANDLE.size:
            raise ValueError(f"{what + ': ' if what else ''}an IPC handle is {_HANDLE.size} bytes, got {len(data)}")
        return cls(*_HANDLE.unpack(data))


class IpcHello(msgspec.Struct, forbid_unknown_fields=True):
    """Sender -> host: where the executor pushes outputs (`recv`) and raises `done` flags."""

    max_rows: int
    recv: bytes  # IpcHandle bytes of [max_rows, Hq * D] of the guest's dtype
    done: bytes  # IpcHandle bytes of L int32 flags
    gpu: str = ""  # the sender GPU's UUID


class IpcWelcome(msgspec.Struct, forbid_unknown_fields=True):
    """Host -> sender: where the sender pushes q|k|v (`exec_in`) and rings `doorbell`, or why not."""

    exec_in: bytes = b""  # [max_rows, (Hq + 2 Hkv) * D]
    doorbell: bytes = b""  # L int32 flags
    error: str = ""
    stage: bytes = b""  # whole guest pages, for KV loads (stage.py); empty: loads go over gloo
