"""Per-client bookkeeping for the connection guard: open connections per client address, and refused
connections logged as a few summary lines instead of one line each.

A flood of refused connections used to log one WARNING per connection (hundreds of KB in seconds):
the log itself became the cost. `RefusalLog` logs the first refusal of a quiet period at once, then
one line per interval with how many more were refused, why, and who refused most.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from typing import Final

_MAX_PEERS_NAMED: Final = 256  # distinct addresses counted per log interval; the rest are "others"


def peer_key(host: str) -> str:
    """The address a client's connections are counted under: its IPv4 address, or its IPv6 /64 (a
    single host usually holds a whole /64, so per-address counts would not bind it)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class PeerCounts:
    """Open connections per client key."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}

    def add(self, key: str) -> int:
        """Count one more connection of `key`; returns how many it has open now."""
        n = self._open.get(key, 0) + 1
        self._open[key] = n
        return n

    def remove(self, key: str) -> None:
        n = self._open.get(key, 0) - 1
        if n > 0:
            self._open[key] = n
        else:
            self._open.pop(key, None)  # no entry left behind per address ever seen

    def open(self, key: str) -> int:
        return self._open.get(key, 0)


class RefusalLog:
    """Refused connections as at most one WARNING per `interval_s` after the first."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._window: asyncio.TimerHandle | None = None  # open while refusals are being summed up
        self._reasons: Counter[str] = Counter()
        self._peers: Counter[str] = Counter()
        self._since = 0.0

    def refused(self, loop: asyncio.AbstractEventLoop, peer: str, reason: str) -> None:
        if self._window is None:
            self.logger.warning("refusing a connection from %s: %s (further refusals are summed up every %g s)",
                                peer, reason, self.interval_s)
            self._open_window(loop)
            return
        self._reasons[reason] += 1
        if peer in self._peers or len(self._peers) < _MAX_PEERS_NAMED:
            self._peers[peer] += 1
        else:
            self._peers["others"] += 1

    def _open_window(self, loop: asyncio.AbstractEventLoop) -> None:
        self._since = time.monotonic()
        self._window = loop.call_later(self.interval_s, self._window_end, loop)

    def _window_end(self, loop: asyncio.AbstractEventLoop) -> None:
        self._window = None
        if self._flush():
            self._open_window(loop)  # still refusing: keep summing up

    def _flush(self) -> bool:
        total = sum(self._reasons.values())
        if not total:
            return False
        reasons = ", ".join(f"{why}: {n}" for why, n in self._reasons.most_common())
        peer, most = self._peers.most_common(1)[0]
        self.logger.warning("refused %d more connections in the last %.0f s (%s); most from %s (%d)", total,
                            time.monotonic() - self._since, reasons, peer, most)
        self._reasons.clear()
        self._peers.clear()
        return True
