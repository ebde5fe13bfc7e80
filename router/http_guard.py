"""HTTP connection guards: a cap on open connections and deadlines for slow clients.

uvicorn's h11 protocol times out idle keep-alive connections, but it accepts every connection and
lets a request's headers and body take as long as the client likes: thousands of connections that
dribble bytes hold their file descriptors for ever, until real requests are refused by the OS. This
subclass bounds both:

    accepted ── over max_connections? ─> 503, closed
       │ request headers complete within header_timeout_s, else closed (there is no request to answer)
       │ request body complete within body_timeout_s, else 408, closed
       └─> the app; between requests the keep-alive timeout applies (uvicorn's own)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)
_FD_RESERVE: Final = 256  # descriptors kept for everything but HTTP connections (ZeroMQ, workers, logs)


@dataclass(frozen=True)
class ConnLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float


def _error_body(status: int, message: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "code": status}})  # the native API's shape


def _canned(status: int, reason: bytes, message: str) -> bytes:
    body = _error_body(status, message)
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return head % (status, reason, len(body)) + body


class GuardedH11Protocol(H11Protocol):
    limits: ClassVar[ConnLimits]

    @classmethod
    def with_limits(cls, limits: ConnLimits) -> type[GuardedH11Protocol]:
        return type("GuardedH11Protocol", (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.warning("refusing a connection from %s: %d connections are open (the limit)",
                           self._peer(), self.limits.max_connections)
            transport.write(_canned(503, b"Service Unavailable", "too many open connections; try again later"))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_timer is None:
            self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        self._track_request()

    def _track_request(self) -> None:
        their = self.conn.their_state
        if their is not h11.IDLE and self._header_timer is not None:
            self._header_timer.cancel()  # headers complete
            self._header_timer = None
        if their is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_late)
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _cancel_timers(self) -> None:
        for t in (self._header_timer, self._body_timer):
            if t is not None:
                t.cancel()
        self._header_timer = self._body_timer = None

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.debug("closing a connection from %s: no complete request headers within %g s", self._peer(),
                         self.limits.header_timeout_s)
            self.transport.close()

    def _body_late(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        logger.info("closing a connection from %s: its request body was not complete within %g s (408)",
                    self._peer(), self.limits.body_timeout_s)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            msg = f"the request body did not arrive within {self.limits.body_timeout_s:g} s"
            body = _error_body(408, msg)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            with contextlib.suppress(h11.LocalProtocolError):
                for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event) or b"")
            cycle.response_started = cycle.response_complete = True
        if cycle is not None:
            cycle.disconnected = True  # the app sees http.disconnect; its own response goes nowhere
            cycle.message_event.set()
        self.transport.close()


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to the hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(wanted: int, fd_limit: int) -> int:
    """The connection cap that the descriptor limit allows (the cap, not the OS, must be what binds)."""
    if fd_limit == resource.RLIM_INFINITY:
        return wanted
    allowed = max(16, fd_limit - _FD_RESERVE)
    if wanted > allowed:
        logger.warning("max_connections %d lowered to %d: this process may open %d files", wanted, allowed, fd_limit)
        return allowed
    return wanted
