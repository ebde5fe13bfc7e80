"""Supervision policy of the launcher's workers, without processes: the backoff doubles with each fast
crash up to its cap, a long run resets the count, and enough fast crashes in a row give up."""

from __future__ import annotations

from router.config import LocalWorker, RouterConfig
from router.core import Router
from router.procs import LocalWorkers
from router.tracker import Supervision
from sglang_ext.server_args import ServerArgs


def test_backoff_doubles_resets_after_a_long_run_and_gives_up() -> None:
    cfg = RouterConfig(restart_backoff_s=1, restart_backoff_max_s=5, restart_max_fast_crashes=5,
                       restart_fast_crash_s=60)
    router = Router(cfg)
    workers = LocalWorkers(router, (LocalWorker("w0", "m", "serve", ServerArgs()),))
    w = router.registry.expect("w0", "m")
    sup = w.supervision = Supervision()
    now = 1000.0

    def crash(ran: float) -> float:
        nonlocal now
        sup.started_at, now = now, now + ran
        workers._on_exit(w, sup, now, "exited with code 1")
        return sup.restart_at - now

    assert [crash(2) for _ in range(3)] == [1, 2, 4]
    assert crash(600) == 1 and sup.fast_crashes == 0  # it had run long enough: the count starts again
    assert [crash(2) for _ in range(4)] == [1, 2, 4, 5]  # capped at restart_backoff_max_s
    assert sup.state == "restarting" and w.describe().startswith("restarting (restart 1 in")
    crash(2)  # the fifth fast crash in a row
    assert sup.state == "gave up" and w.state == "gave up"
    assert w.describe() == ("gave up: 5 crashes in a row, each within 60 s of its start "
                            "(the last one exited with code 1)")


def test_a_configuration_error_gives_up_at_once() -> None:
    """Exit code 2 is a worker's startup configuration error (bad path, no tokenizer): no restart."""
    router = Router(RouterConfig())
    workers = LocalWorkers(router, (LocalWorker("w0", "m", "serve", ServerArgs()),))
    w = router.registry.expect("w0", "m")
    sup = w.supervision = Supervision(started_at=10.0)
    workers._on_exit(w, sup, 11.0, "exited with code 2", config_error=True)
    assert sup.state == "gave up" and sup.restarts == 0
    assert "configuration error" in w.describe()
