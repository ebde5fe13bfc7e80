"""The sender's watchdog over a GPU-signalled pairing across processes (cuda_ipc).

The sender's stream waits on the GPU (`cuStreamWaitValue32`) for completion flags the executor's
process raises in the sender's memory. If that process dies, the wait never ends, and neither does
the sender's next host synchronisation. The watchdog thread blocks on the pair's control channel
(a gloo receive that only the executor's goodbye or a broken connection ends: a dead process's
sockets close, so gloo errors at once) and, once the peer is gone, raises the flags itself --
they live in the sender's own memory -- again and again, so every wait already queued (step t,
and step t+1 under overlap) drains. The forward thread then sees `lost` and raises ExecutorLost:
the requests are recomputed locally.

    armed ──peer gone (or fire())──> releasing ──stop()──> stopped
      └────────────goodbye or stop()──────────────────────> stopped
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

logger = logging.getLogger(__name__)

ARMED: Final = "armed"
RELEASING: Final = "releasing"
STOPPED: Final = "stopped"


class Watchdog:
    """`wait_peer()` blocks until the peer ends: it returns None for a goodbye, or why the peer is
    gone (raising counts as gone). `release()` raises every pending completion flag (a host-side
    write on a stream of its own); it runs every `interval_s` while releasing."""

    def __init__(self, wait_peer: Callable[[], str | None], release: Callable[[], None], name: str,
                 interval_s: float = 1e-3) -> None:
        self._wait_peer = wait_peer
        self._release = release
        self.interval_s = interval_s
        self.state = ARMED
        self.lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gone = threading.Event()
        self.peer_ended = threading.Event()  # wait_peer returned: a goodbye, or the peer is gone
        self.releases = 0
        self._waiter = threading.Thread(target=self._watch, name=f"watchdog-{name}", daemon=True)
        self._releaser = threading.Thread(target=self._keep_releasing, name=f"release-{name}", daemon=True)

    def start(self) -> None:
        self._waiter.start()
        self._releaser.start()

    def fire(self, why: str) -> None:
        """The peer is gone (seen by the watchdog thread, or by the forward thread's own control
        message failing): start releasing."""
        with self._lock:
            if self.state != ARMED:
                return
            self.state, self.lost = RELEASING, why
        logger.warning("executor gone (%s): releasing the sender's pending GPU waits", why)
        self._gone.set()

    def stop(self) -> None:
        """The pairing ended: stop releasing (the sender's stream has drained) or stop watching."""
        with self._lock:
            self.state = STOPPED
        self._stop.set()
        self._gone.set()

    def join(self, timeout_s: float) -> None:
        self._releaser.join(timeout_s)

    def _watch(self) -> None:
        try:
            why = self._wait_peer()
        except Exception as e:  # a broken pair: the peer is gone
            why = f"{type(e).__name__}: {e}"
        if why is None:
            with self._lock:
                if self.state == ARMED:
                    self.state = STOPPED
            self._gone.set()
        else:
            self.fire(why)
        self.peer_ended.set()

    def _keep_releasing(self) -> None:
        self._gone.wait()
        while self.state == RELEASING:
            try:
                self._release()
                self.releases += 1
            except Exception:
                logger.exception("watchdog: raising the completion flags failed; the sender's stream may stay blocked")
                return
            if self._stop.wait(self.interval_s if self.releases < 1000 else 50 * self.interval_s):
                return
