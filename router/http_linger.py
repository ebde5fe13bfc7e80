"""The transport uvicorn's h11 protocol and its request cycles write to, with a close() that may linger.

When the server answers before the request body is in (413 for a body over the limit), closing the
socket at once leaves the rest of the body unread in the kernel, and Linux then answers with a TCP
reset, which can destroy the answer before the client reads it (urllib reports "connection reset";
curl happens to win the race). A lingering close instead half-closes (the client sees the answer
end), reads and discards whatever the client still sends, and closes when the client does, or at a
bound on time or bytes (nginx's "lingering close").

uvicorn closes the transport from several places (the end of a response that must close the
connection, errors, shutdown); routing them all through `close()` here lets the protocol decide in one
place. Everything else goes straight to the real transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any


class LingeringTransport(asyncio.Transport):
    def __init__(self, raw: asyncio.Transport, on_close: Callable[[], None]) -> None:
        super().__init__()
        self.raw = raw
        self.lingering = False  # set by the protocol: the answer is out, the connection is only read from
        self._on_close = on_close

    def close(self) -> None:
        self._on_close()

    def is_closing(self) -> bool:
        # While lingering the connection serves nothing more: uvicorn must treat it as closing (no
        # keep-alive timer, no next request).
        return self.lingering or self.raw.is_closing()

    # Plain delegation.
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.raw.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.raw.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.raw.get_protocol()

    def is_reading(self) -> bool:
        return self.raw.is_reading()

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.raw.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self.raw.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.raw.get_write_buffer_limits()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.raw.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.raw.writelines(list_of_data)

    def write_eof(self) -> None:
        self.raw.write_eof()

    def can_write_eof(self) -> bool:
        return self.raw.can_write_eof()

    def abort(self) -> None:
        self.raw.abort()
