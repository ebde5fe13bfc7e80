"""Worker processes the launcher starts on this host: their supervision and their clean stop.

Children connect back to the router's ZeroMQ socket like any remote worker. A child that exits
(SIGKILL, OOM, a crash) is marked down at once (its requests fail with 503) and started again after
a backoff that doubles with each crash soon after a start (1 s, 2 s, 4 s, ... up to 60 s by default);
a crash after a long enough run starts the count afresh. Supervision never gives up on a crashing
worker: the launcher stays up while one of its workers is away, so it keeps trying, and says so
(/health, /readiness; one error line once the crashes in a row reach `restart_max_fast_crashes`).
Only a configuration error at a worker's first start (exit code 2: a bad model path) stops the
restarts, since every attempt would fail the same way. A worker also exits by itself when its parent
dies (it checks getppid with each heartbeat), so even a SIGKILLed launcher leaves no orphans behind.
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


def restart_delay(policy: RouterConfig, fast_crashes: int) -> float:
    """The wait before the next start: `restart_backoff_s` doubled with each fast crash in a row after
    the first, capped at `restart_backoff_max_s` (so a worker that never stays up costs one start a
    minute, by default, not a busy loop)."""
    exponent = min(max(0, fast_crashes - 1), 62)  # 2.0 ** n overflows a float past ~1023; far past any cap
    return min(policy.restart_backoff_max_s, policy.restart_backoff_s * 2.0 ** exponent)


class LocalWorkers:
    def __init__(self, router: Router, specs: tuple[LocalWorker, ...], policy: RouterConfig | None = None,
                 secrets: tuple[str, ...] = ()) -> None:
        self.router = router
        self.specs = {s.worker_id: s for s in specs}
        self.policy = policy or router.config
        self.secrets = secrets  # variables the router reads keys from: not in a worker's environment
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        for s in self.specs.values():
            w = self.router.registry.expect(s.worker_id, s.model, s.role)
            w.supervision = Supervision()
            self._spawn(s, w.supervision)
        self._watch = asyncio.create_task(self._supervise())

    def _spawn(self, s: LocalWorker, sup: Supervision) -> None:
        # The keys stay with the router: in a child's arguments they would show in `ps`, in its
        # environment in /proc/PID/environ.
        args = dataclasses.replace(s.args, api_key=None)
        self.procs[s.worker_id] = spawn_worker(args, self.router.worker_addr, s.worker_id, dict(s.env),
                                               self.secrets)
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
        if config_error and not sup.ever_up:
            # Its arguments never worked: every restart would fail the same way. (Once up, the same exit
            # is more likely something it needs gone for a while, a model directory on a network mount:
            # restarted like any crash.)
            sup.state = "gave up"
            sup.gave_up_detail = f"a configuration error at startup ({how}): restarting would fail the same way"
            logger.error("worker %s: not restarting it again after %s; see its output above, fix the cause and "
                         "start it by hand: python -m sglang_ext.launch worker --router %s --worker-id %s [server "
                         "flags]", w.worker_id, sup.gave_up_detail, self.router.worker_addr, w.worker_id)
            return
        delay = restart_delay(p, sup.fast_crashes)
        sup.state, sup.restart_at = "restarting", now + delay
        if sup.fast_crashes == p.restart_max_fast_crashes:
            # Once per crash loop: the warnings below go on with each restart, this says it is a loop.
            logger.error("worker %s keeps crashing: %d crashes in a row, each within %g s of its start (the last "
                         "one %s); restarting it every %.0f s at most until it stays up; see its output above",
                         w.worker_id, sup.fast_crashes, p.restart_fast_crash_s, how, p.restart_backoff_max_s)
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
