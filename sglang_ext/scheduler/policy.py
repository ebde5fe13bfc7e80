"""Waiting-queue orderings. Later issues add SLO-driven policies (e.g. lvf) here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Final

from sglang_ext.kvcache.base import PrefixCache
from sglang_ext.scheduler.request import Req


class SchedulePolicy(ABC):
    @abstractmethod
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        """Admission order for this iteration (does not mutate `waiting`)."""


class FCFS(SchedulePolicy):
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        return sorted(waiting, key=lambda r: r.arrival_time)


class LongestPrefixMatch(SchedulePolicy):
    """Serve requests with the most cached tokens first (SGLang's `lpm`): hits before evictions."""

    _MAX_QUEUE: Final = 128  # past this, matching every request costs more than it saves

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        if len(waiting) > self._MAX_QUEUE:
            return FCFS().order(waiting, cache)
        hits = {id(r): cache.match_prefix(r.fill_ids[:-1]).num_tokens for r in waiting}
        return sorted(waiting, key=lambda r: (-hits[id(r)], r.arrival_time))


POLICIES: Final[dict[str, type[SchedulePolicy]]] = {"fcfs": FCFS, "lpm": LongestPrefixMatch}


def make_policy(name: str) -> SchedulePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown schedule policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()
