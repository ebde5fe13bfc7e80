"""Test hooks for remote attention under the overlap loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler


def force_drop(s: Scheduler, pick: Callable[[list[Req]], list[Req]]) -> list[str]:
    """Make the executor drop (release, report as failed) the requests `pick` chooses of those
    planned while their previous step is in flight -- what a full partition does, at a chosen step.
    Returns the list the dropped requests' ids are appended to."""
    assert s.remote_sender is not None
    remote: Any = s.remote_sender.remote
    inner = remote.begin_step
    dropped: list[str] = []

    def begin_step(handles: list[int], positions: list[int]) -> list[int]:
        assert s.remote_sender is not None
        reqs = [s.remote_sender.reqs[h] for h in handles]
        in_flight = all(p == r.kv_len + 1 for r, p in zip(reqs, positions, strict=True))
        chosen = {id(r) for r in pick(reqs)} if in_flight else set()
        gone = [h for h, r in zip(handles, reqs, strict=True) if id(r) in chosen]
        for h in gone:
            dropped.append(s.remote_sender.reqs[h].rid)
            remote.executor.release(remote.guest, h)
        rest = [(h, p) for h, p in zip(handles, positions, strict=True) if h not in gone]
        return gone + inner([h for h, _ in rest], [p for _, p in rest])

    remote.begin_step = begin_step
    return dropped
