"""Supervision policy of the launcher's workers, without processes: the backoff doubles with each fast
crash up to its cap, a long run resets it, and restarts never stop (a crash loop is logged once as an
error); only a configuration error at a worker's first start is given up on."""

from __future__ import annotations

import logging

import pytest

from router.config import LocalWorker, RouterConfig
from router.core import Router
from router.procs import LocalWorkers, restart_delay
from router.tracker import Supervision, WorkerState
from sglang_ext.server_args import ServerArgs


def supervised(cfg: RouterConfig | None = None) -> tuple[LocalWorkers, WorkerState, Supervision]:
    router = Router(cfg or RouterConfig())
    workers = LocalWorkers(router, (LocalWorker("w0", "m", "serve", ServerArgs()),))
    w = router.registry.expect("w0", "m")
    sup = w.supervision = Supervision()
    return workers, w, sup


def test_backoff_doubles_to_its_cap_resets_after_a_long_run_and_never_gives_up(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = RouterConfig(restart_backoff_s=1, restart_backoff_max_s=60, restart_max_fast_crashes=5,
                       restart_fast_crash_s=60)
    workers, w, sup = supervised(cfg)
    now = 1000.0

    def crash(ran: float) -> float:
        nonlocal now
        sup.started_at, now = now, now + ran
        workers._on_exit(w, sup, now, "exited with code 1")
        assert sup.state == "restarting"
        return sup.restart_at - now

    assert [crash(2) for _ in range(3)] == [1, 2, 4]
    assert crash(600) == 1 and sup.fast_crashes == 0  # it had run long enough: the count starts again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="router.procs"):
        delays = [crash(2) for _ in range(12)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60]  # capped at restart_backoff_max_s, for ever
    assert w.state == "restarting"
    assert w.describe().startswith("restarting (restart 1 in") and w.describe().endswith(
        "it exited with code 1, 12 crashes in a row)")
    # one error for the loop (at restart_max_fast_crashes), a warning for each restart
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["worker w0 keeps crashing: 5 crashes in a row, each within 60 s of its start (the last one "
                      "exited with code 1); restarting it every 60 s at most until it stays up; see its output above"]
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 12
    assert crash(600) == 1 and sup.fast_crashes == 0  # up long enough at last: back to the first step


def test_the_delay_stays_finite_whatever_the_count() -> None:
    cfg = RouterConfig(restart_backoff_s=1, restart_backoff_max_s=60)
    assert [restart_delay(cfg, n) for n in (0, 1, 2, 7, 8, 5000)] == [1, 1, 2, 60, 60, 60]


def test_a_configuration_error_at_the_first_start_gives_up_at_once() -> None:
    """Exit code 2 is a worker's startup configuration error (bad path, no tokenizer): no restart."""
    workers, w, sup = supervised()
    sup.started_at = 10.0
    workers._on_exit(w, sup, 11.0, "exited with code 2", config_error=True)
    assert sup.state == "gave up" and sup.restarts == 0
    assert "configuration error" in w.describe()


def test_a_configuration_error_after_the_worker_was_up_is_restarted() -> None:
    """Its arguments worked before: what it needs is likely away for a while (a network mount)."""
    workers, w, sup = supervised(RouterConfig(restart_backoff_s=1))
    sup.started_at, sup.ever_up = 10.0, True
    workers._on_exit(w, sup, 11.0, "exited with code 2", config_error=True)
    assert sup.state == "restarting" and sup.restart_at == 12.0
