"""HTTP connection guards: caps on open connections and deadlines for slow clients.

uvicorn's h11 protocol times out idle keep-alive connections, but it accepts every connection and
lets a request's headers and body take as long as the client likes: thousands of connections that
dribble bytes hold their file descriptors for ever, until real requests are refused by the OS. This
subclass bounds both, and one client's share of the connections:

    accepted ── over max_per_client from its address? ─> 429, lingering close (below)
       │ over max_connections in all? ─> 503, closed
       │ request headers complete within header_timeout_s, else closed (there is no request to answer)
       │ request body complete within body_timeout_s, else 408, closed
       └─> the app; between requests the keep-alive timeout applies (uvicorn's own)

An answer sent while the client is still sending its body (the app's 413) ends in a lingering close
(http_linger.py), so that the client can read it; so does the per-client 429, which is written before
the client's request arrives (a client sends its request before it reads), for at most
`max_lingering_refusals` connections at once (beyond: closed at once, as the 503 is: its point is to
give descriptors back). Refusals are logged as summaries (http_peers.py),
and every answer the guard gives itself is counted like the app's (`count`: model name, status).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.api.answers import note_answered
from router.http_linger import LingeringTransport
from router.http_peers import PeerCounts, RefusalLog, peer_key

logger = logging.getLogger(__name__)
_FD_RESERVE: Final = 256  # descriptors kept for everything but HTTP connections (ZeroMQ, workers, logs)


@dataclass(frozen=True)
class ConnLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    max_per_client: int = 1 << 30  # open connections from one client address (IPv6: one /64)
    # Lingering close after an early answer: until the client closes, or at most this long, this long
    # without a byte from it, or this many bytes discarded.
    linger_s: float = 10.0
    linger_idle_s: float = 2.0
    linger_bytes: int = 256 << 20
    # Refused connections (429) in a lingering close at most: a client over its cap may be a flood.
    max_lingering_refusals: int = 256


def _no_count(model: str, status: str) -> None:
    pass


@dataclass
class ServerGuard:
    """What the connections of one server share."""

    peers: PeerCounts = field(default_factory=PeerCounts)
    refusals: RefusalLog = field(default_factory=lambda: RefusalLog(logger))
    count: Callable[[str, str], None] = _no_count  # (model_name, status) of an answer the guard gave
    lingering_refusals: int = 0  # refused connections in their lingering close


def _error_body(status: int, message: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "code": status}})  # the native API's shape


def _canned(status: int, reason: bytes, message: str) -> bytes:
    body = _error_body(status, message)
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return head % (status, reason, len(body)) + body


class GuardedH11Protocol(H11Protocol):
    # Per server (with_limits makes a class per server).
    limits: ClassVar[ConnLimits]
    guard: ClassVar[ServerGuard]

    @classmethod
    def with_limits(cls, limits: ConnLimits,
                    count: Callable[[str, str], None] = _no_count) -> type[GuardedH11Protocol]:
        """The protocol class for one server; `count(model_name, status)` counts the guard's answers."""
        return type("GuardedH11Protocol", (cls,), {"limits": limits, "guard": ServerGuard(count=count)})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._peer_key: str | None = None  # counted in `peers` while set
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_end = self._last_read = 0.0
        self._linger_idle_s = self._linger_bytes = 0.0
        self._discarded = 0
        self._refused_linger = False  # counted in guard.lingering_refusals while set

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        self._front = LingeringTransport(transport, self._close_or_linger)
        super().connection_made(self._front)
        if self.client:
            self._peer_key = peer_key(self.client[0])
            if self.guard.peers.add(self._peer_key) > self.limits.max_per_client:
                self._refuse(429, b"Too Many Requests", f"over the per-client limit of {self.limits.max_per_client}",
                             "too many open connections from your address; close some and try again")
                return
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, b"Service Unavailable", f"over the limit of {self.limits.max_connections} open "
                         "connections", "too many open connections; try again later")
            return
        self._arm_header_timer()

    def _refuse(self, status: int, reason: bytes, why: str, message: str) -> None:
        self.guard.refusals.refused(self.loop, self._peer_key or "?", why)  # by address: ports differ
        self.guard.count("", str(status))
        self._raw.write(_canned(status, reason, message))
        lim = self.limits
        if status != 429 or self.guard.lingering_refusals >= lim.max_lingering_refusals:
            self._raw.close()  # no lingering: the point is to give the descriptor back
            return
        # Closed at once, the client's request (sent next, or already) reaches a closed socket and the
        # kernel answers it with a reset, which destroys the unread 429 (the client sees a reset or a
        # broken pipe): linger as after a 413.
        self.guard.lingering_refusals += 1
        self._refused_linger = True
        self._linger(lim.linger_s, lim.linger_idle_s, lim.linger_bytes)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._refused_linger:
            self._refused_linger = False
            self.guard.lingering_refusals -= 1
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._peer_key is not None:
            self.guard.peers.remove(self._peer_key)
            self._peer_key = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._front.lingering:
            self._discard(len(data))
            return
        if self.conn.their_state is h11.IDLE and self._header_timer is None:
            self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        self._track_request()

    def send_400_response(self, msg: str) -> None:
        self.guard.count("", "400")  # a request h11 could not parse: the app never sees it
        super().send_400_response(msg)

    def _close_or_linger(self) -> None:
        """Every close of uvicorn's comes here: linger when a complete answer went out while the client
        is still sending its request body (else the unread body turns the close into a reset)."""
        cycle = self.cycle
        if (self._front.lingering or self._raw.is_closing() or cycle is None or not cycle.response_complete
                or self.conn.their_state is not h11.SEND_BODY):
            self._raw.close()
            return
        self._linger(self.limits.linger_s, self.limits.linger_idle_s, self.limits.linger_bytes)

    def _linger(self, total_s: float, idle_s: float, max_bytes: float) -> None:
        """The answer is out: half-close, then read and discard until the client closes, or for
        `total_s` at most, `idle_s` without a byte, or `max_bytes` discarded."""
        self._front.lingering = True
        self._cancel_timers()  # no 408 for a body nobody waits for
        if self._raw.can_write_eof():
            self._raw.write_eof()  # the answer is complete: the client may stop sending
        self._raw.resume_reading()  # uvicorn may have paused reading while the app did not read
        self._last_read = now = time.monotonic()
        self._linger_end = now + total_s
        self._linger_idle_s, self._linger_bytes = idle_s, max_bytes
        self._linger_timer = self.loop.call_later(min(idle_s, total_s), self._linger_check)

    def _discard(self, n: int) -> None:
        self._last_read = time.monotonic()
        self._discarded += n
        if self._discarded > self._linger_bytes:
            self._raw.close()

    def _linger_check(self) -> None:
        # One timer for both bounds, re-armed here rather than on every read.
        now = time.monotonic()
        idle_end = self._last_read + self._linger_idle_s
        if now >= self._linger_end or now >= idle_end:
            self._linger_timer = None
            self._raw.close()
            return
        self._linger_timer = self.loop.call_later(min(self._linger_end, idle_end) - now, self._linger_check)

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
        if not self._raw.is_closing():
            logger.debug("closing a connection from %s: no complete request headers within %g s", self._peer(),
                         self.limits.header_timeout_s)
            self._raw.close()

    def _body_late(self) -> None:
        self._body_timer = None
        if self._raw.is_closing():
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
                    self._raw.write(self.conn.send(event) or b"")
            cycle.response_started = cycle.response_complete = True
            self.guard.count("", "408")
            note_answered(cycle.scope)  # the app's own answer (the client left: 499) goes uncounted
        if cycle is not None:
            cycle.disconnected = True  # the app sees http.disconnect; its own response goes nowhere
            cycle.message_event.set()
        self._raw.close()  # no lingering: this client is the slow one


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
