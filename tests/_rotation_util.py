"""Helpers for rotation tests: a fake clock, a driver that checks pages every step, and an engine
whose copies land late (as on a GPU), really copying only when they land."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _tiny import greedy, make_scheduler

from sglang_ext.kvcache.rotation import RotationEngine, Transfer
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler

PAGE = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _ix(pages: list[int]) -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.long)


class LateEngine(RotationEngine):
    """Each copy runs only when it lands: after `lag` `done` queries, or at a fence / synchronize.
    A page reused while a copy is in flight would make the copy read or write the wrong data."""

    def __init__(self, pool: Any, host: Any, lag: int = 2) -> None:
        super().__init__(pool, host)
        self.lag = lag
        self._todo: dict[int, list[Any]] = {}  # id(transfer) -> [queries left, copy]

    def _defer(self, direction: str, copy: Callable[[], None], n: int) -> Transfer:
        t = Transfer(direction, n, n * self.page_bytes, event=None)
        self._todo[id(t)] = [self.lag, copy]
        return t

    def swap_out(self, dev_pages: list[int], host_pages: list[int]) -> Transfer:
        self.bytes_out += len(dev_pages) * self.page_bytes

        def copy() -> None:
            self.host.data[_ix(host_pages)] = self.pool.data[_ix(dev_pages)]
        return self._defer("out", copy, len(dev_pages))

    def swap_in(self, host_pages: list[int], dev_pages: list[int]) -> Transfer:
        self.bytes_in += len(dev_pages) * self.page_bytes

        def copy() -> None:
            self.pool.data[_ix(dev_pages)] = self.host.data[_ix(host_pages)]
        return self._defer("in", copy, len(dev_pages))

    def _land(self, t: Transfer) -> None:
        job = self._todo.pop(id(t), None)
        if job is not None:
            job[1]()

    def done(self, t: Transfer) -> bool:
        job = self._todo.get(id(t))
        if job is None:
            return True
        job[0] -= 1
        if job[0] > 0:
            return False
        self._land(t)
        return True

    def fence(self, t: Transfer) -> None:
        self._land(t)  # the compute stream would wait for it

    def synchronize(self) -> None:
        for job in list(self._todo.values()):
            job[1]()
        self._todo.clear()


def rotating(policy: str = "lvf", host_pages: int = 512, late: int = 0, **args: Any) -> tuple[Scheduler, Clock]:
    args.setdefault("max_total_tokens", 72)
    args.setdefault("lvf_beta_ttft", 0.0)  # waiting requests press at once: more rotation in small tests
    s = make_scheduler(page_size=PAGE, preemption_mode="rotate", schedule_policy=policy,
                       kv_host_size_gb=host_pages * 2048 / 2**30, **args)
    assert s.rot is not None and s.rot.engine.page_bytes == 2048
    if late:
        s.rot.engine = LateEngine(s.runner.pool, s.rot.host, late)
    clock = Clock()
    s.clock = clock
    return s, clock


def reqs(ps: list[list[int]], max_new: int = 12, gap: float = 0.0) -> list[Req]:
    return [Req(f"r{i}", p, greedy(max_new), arrival_time=i * gap + i * 1e-6) for i, p in enumerate(ps)]


def drive(s: Scheduler, rs: list[Req], clock: Clock | None = None, dt: float = 0.02, every: int = 0,
          on_step: Callable[[int], None] | None = None, max_steps: int = 5000) -> dict[str, list[int]]:
    """Run to the end, adding one request every `every` steps (0: all at once), advancing the clock
    by `dt` per step and checking device and host pages after every step."""
    out: dict[str, list[int]] = {r.rid: [] for r in rs}
    todo = list(rs)
    for step in range(max_steps):
        if clock is not None:
            clock.t += dt
        while todo and (every == 0 or step % every == 0):
            r = todo.pop(0)
            if clock is not None:
                r.arrival_time = clock.t
            s.add_request(r)
            if every:
                break
        if not todo and not s.has_work():
            break
        for o in s.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        s.check()
        if on_step is not None:
            on_step(step)
    assert not s.has_work(), "scheduler did not finish"
    return out


def reference(ps: list[list[int]], max_new: int = 12) -> dict[str, list[int]]:
    """The same requests in an unconstrained pool."""
    s = make_scheduler(page_size=PAGE, max_total_tokens=16384)
    return drive(s, reqs(ps, max_new))
