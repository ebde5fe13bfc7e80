"""Worker processes the launcher starts on this host: their supervision and their clean stop.

Children connect back to the router's ZeroMQ socket like any remote worker. A child that exits
(SIGKILL, OOM, a crash) is marked down at once (its requests fail with 503) and started again after
a backoff that doubles with each crash soon after a start (1 s, 2 s, 4 s, ... up to 30 s by default).
After several such fast crashes in a row the launcher gives up on it, with one log line; a crash after
a long enough run starts the count afresh. A worker also exits by itself when its parent dies (it
checks getppid with each heartbeat), so even a SIGKILLed launcher leaves no orphans behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import subprocess
import time

from router.config import LocalWorker, RouterConfig
from router.core import Router
from router.tracker import Supervision, WorkerState
from sglang_ext.entry.engine import spawn_worker
from sglang_ext.worker.server import EXIT_STARTUP

logger = logging.getLogger(__name__)
_POLL_S = 0.2


class LocalWorkers:
    def __init__(self, router: Router, specs: tuple[LocalWorker, ...], policy: RouterConfig | None = None) -> None:
        self.router = router
        self.specs = {s.worker_id: s for s in specs}
        self.policy = policy or router.config
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        for s in self.specs.values():
            w = self.router.registry.expect(s.worker_id, s.model, s.role)
            w.supervision = Supervision()
            self._spawn(s, w.supervision)
        self._watch = asyncio.create_task(self._supervise())

    def _spawn(self, s: LocalWorker, sup: Supervision) -> None:
        # The API key stays with the router: in a child's arguments it would show in `ps`.
        args = dataclasses.replace(s.args, api_key=None)
        self.procs[s.worker_id] = spawn_worker(args, self.router.worker_addr, s.worker_id, dict(s.env))
        sup.state, sup.started_at = "running", time.monotonic()

    def _worker(self, worker_id: str) -> tuple[WorkerState, Supervision]:
        w = self.router.registry.workers[worker_id]
        assert w.supervision is not None
        return w, w.supervision

    async def wait_ready(self, timeout: float) -> list[str]:
        """Wait until each worker has said hello or crashed before its first hello; returns the ids of
        those that crashed (they are being restarted) or are not up after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [i for i in self.specs if not (self._worker(i)[0].up or self._worker(i)[1].ever_up)]
            failed = [i for i in pending if self._worker(i)[1].last_exit]
            if len(failed) == len(pending) or time.monotonic() >= deadline:
                return pending
            await asyncio.sleep(0.1)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(_POLL_S)
            now = time.monotonic()
            for wid, spec in self.specs.items():
                w, sup = self._worker(wid)
                if sup.state == "running":
                    if w.up:
                        sup.ever_up = True
                    code = self.procs[wid].poll()
                    if code is not None:
                        self._on_exit(w, sup, now, f"exited with code {code}", config_error=code == EXIT_STARTUP)
                elif sup.state == "restarting" and now >= sup.restart_at:
                    sup.restarts += 1
                    logger.info("starting worker %s again (restart %d)", wid, sup.restarts)
                    try:
                        self._spawn(spec, sup)
                    except OSError as e:  # no memory or descriptors left for a process: a crash like any other
                        sup.started_at = now
                        self._on_exit(w, sup, now, f"could not be started ({e})")

    def _on_exit(self, w: WorkerState, sup: Supervision, now: float, how: str, config_error: bool = False) -> None:
        p = self.policy
        ran = now - sup.started_at
        sup.last_exit = how
        # A local worker that exits is down now; no need to wait for the heartbeat timeout.
        if w.up:
            self.router.mark_down(w, f"its process {how}")
        sup.fast_crashes = sup.fast_crashes + 1 if ran < p.restart_fast_crash_s else 0
        if config_error or sup.fast_crashes >= p.restart_max_fast_crashes:
            sup.state = "gave up"
            sup.gave_up_detail = (
                f"a configuration error at startup ({how}): restarting would fail the same way" if config_error
                else f"{sup.fast_crashes} crashes in a row, each within {p.restart_fast_crash_s:g} s of its start "
                     f"(the last one {how})")
            logger.error("worker %s: not restarting it again after %s; see its output above, fix the cause and "
                         "start it by hand: python -m sglang_ext.launch worker --router %s --worker-id %s [server "
                         "flags]", w.worker_id, sup.gave_up_detail, self.router.worker_addr, w.worker_id)
            return
        delay = min(p.restart_backoff_max_s, p.restart_backoff_s * 2 ** max(0, sup.fast_crashes - 1))
        sup.state, sup.restart_at = "restarting", now + delay
        logger.warning("worker %s %s after %.1f s; restarting it in %.1f s", w.worker_id, how, ran, delay)

    async def stop_supervising(self) -> None:
        """No more restarts (before the workers are told to shut down)."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    async def stop(self, grace_s: float = 10.0) -> None:
        """The router has already sent ShutdownReq; wait, then terminate, then kill."""
        await self.stop_supervising()
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
