"""Worker processes the launcher starts on this host, and their clean stop.

Children connect back to the router's ZeroMQ socket like any remote worker. A worker also exits by
itself when its parent dies (it checks getppid with each heartbeat), so even a SIGKILLed launcher
leaves no orphans behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time

from router.config import LocalWorker
from router.core import Router
from sglang_ext.entry.engine import spawn_worker

logger = logging.getLogger(__name__)


class LocalWorkers:
    def __init__(self, router: Router, specs: tuple[LocalWorker, ...]) -> None:
        self.router = router
        self.specs = specs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        for s in self.specs:
            self.router.registry.expect(s.worker_id, s.model, s.role)
            self.procs[s.worker_id] = spawn_worker(s.args, self.router.worker_addr, s.worker_id)
        self._watch = asyncio.create_task(self._watch_exits())

    async def wait_ready(self, timeout: float) -> list[str]:
        """Wait until every worker said hello; returns the ids of those that died or timed out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = [i for i in self.procs if self.router.registry.workers[i].info is None]
            dead = [i for i in pending if self.procs[i].poll() is not None]
            if len(dead) == len(pending):
                return dead
            await asyncio.sleep(0.1)
        return [i for i in self.procs if self.router.registry.workers[i].info is None]

    async def _watch_exits(self) -> None:
        # A local worker that exits is down now; no need to wait for the heartbeat timeout.
        reported: set[str] = set()
        while True:
            await asyncio.sleep(0.2)
            for wid, p in self.procs.items():
                code = p.poll()
                if code is None or wid in reported:
                    if code is None:
                        reported.discard(wid)
                    continue
                reported.add(wid)
                w = self.router.registry.workers.get(wid)
                if w is not None and w.up:
                    self.router.mark_down(w, f"its process exited with code {code}")
                else:
                    logger.warning("worker %s exited with code %s", wid, code)

    async def stop(self, grace_s: float = 10.0) -> None:
        """The router has already sent ShutdownReq; wait, then terminate, then kill."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for wid, p in self.procs.items():
            w = self.router.registry.workers.get(wid)
            if p.poll() is None and (w is None or not w.up):
                p.terminate()  # still starting (or hung): it got no ShutdownReq
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5.0
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
