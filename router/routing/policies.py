"""The routing policies: each picks one of a model's up replicas for a new request.

    cache_aware      the replica that was sent the longest prefix of the prompt, while load is balanced;
                     the shortest queue when it is not (or when no replica knows enough of the prompt)
    shortest_queue   fewest requests in flight (then fewest tokens still to compute)
    round_robin      each replica in turn
    prefix_affinity  least outstanding tokens, except that a prompt whose first 128 characters (32 token
                     ids) were seen goes back to the same replica within 1024 tokens of slack (the default:
                     the router's behaviour before policies were selectable)

Load is the router's own count of a replica's requests in flight: it moves the moment a request is
placed, where a replica's load report lags by up to its period.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.registry import Balancer, PrefixAware
from router.routing.prefix import PrefixIndex
from router.routing.settings import RoutingSettings
from router.tracker import WorkerState
from sglang_ext.messages import WorkerInfo

# prefix_affinity keys on a prompt's first 128 characters (32 token ids), after the 2-character kind tag
_LEGACY_KEY_CHARS = 2 + 128
_LEGACY_KEY_IDS = 2 + 32


def queue(w: WorkerState) -> tuple[int, int, int]:
    """Shortest-queue order: requests in flight, then tokens still to compute, then requests placed so far
    (so that idle replicas take turns)."""
    return len(w.inflight), w.outstanding_tokens, w.num_served


class ShortestQueue(Balancer):
    def pick(self, candidates: list[WorkerState], prefix_key: str | None = None) -> WorkerState:
        return min(candidates, key=queue)


class RoundRobin(Balancer):
    """Each candidate in turn, in the model's replica order (a replica that is down is skipped)."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: list[WorkerState], prefix_key: str | None = None) -> WorkerState:
        w = candidates[self._turn % len(candidates)]
        self._turn += 1
        return w


class PrefixAffinity(Balancer):
    def __init__(self) -> None:
        self._inner = PrefixAware()

    def pick(self, candidates: list[WorkerState], prefix_key: str | None = None) -> WorkerState:
        if prefix_key is not None:
            prefix_key = prefix_key[:_LEGACY_KEY_IDS if prefix_key.startswith("i:") else _LEGACY_KEY_CHARS]
        return self._inner.pick(candidates, prefix_key)


@dataclass
class Decisions:
    """How cache_aware decided, counted (tests and /get_server_info read them)."""

    prefix: int = 0  # to the replica with the longest match
    balance: int = 0  # imbalanced: the shortest queue
    cold: int = 0  # no replica knew enough of the prompt: the shortest queue
    by_worker: dict[str, int] = field(default_factory=dict)


class CacheAware(Balancer):
    def __init__(self, settings: RoutingSettings) -> None:
        self.s = settings
        self.index = PrefixIndex(settings.max_prefix_chars)
        self.decisions = Decisions()
        self._seen: dict[str, WorkerInfo | None] = {}  # worker id -> the hello its index entries belong to

    def imbalanced(self, candidates: list[WorkerState]) -> bool:
        loads = [len(w.inflight) for w in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.s.balance_abs_threshold and hi > self.s.balance_rel_threshold * lo

    def pick(self, candidates: list[WorkerState], prefix_key: str | None = None) -> WorkerState:
        self._forget_restarted(candidates)
        names = self.index.names(prefix_key) if prefix_key else []
        if self.imbalanced(candidates):
            chosen, how = min(candidates, key=queue), "balance"
        else:
            chosen, how = self._by_prefix(candidates, names, len(prefix_key or ""))
        # Indexed whatever the reason it went there: that replica now caches the prompt.
        if names:
            self.index.insert(names, chosen.worker_id)
        setattr(self.decisions, how, getattr(self.decisions, how) + 1)
        self.decisions.by_worker[chosen.worker_id] = self.decisions.by_worker.get(chosen.worker_id, 0) + 1
        return chosen

    def _by_prefix(self, candidates: list[WorkerState], names: list[int], chars: int) -> tuple[WorkerState, str]:
        matched = self.index.match(names, (w.worker_id for w in candidates))
        best = max(candidates, key=lambda w: (matched[w.worker_id], tuple(-x for x in queue(w))))
        if chars and matched[best.worker_id] / chars > self.s.cache_threshold:
            return best, "prefix"
        # A new prompt: the shortest queue; between equals, the replica with the least indexed (the most
        # room left in its cache, if the replicas are alike).
        return min(candidates, key=lambda w: (*queue(w)[:2], self.index.chars(w.worker_id), w.num_served)), "cold"

    def _forget_restarted(self, candidates: list[WorkerState]) -> None:
        """A replica that said hello again (a new process, or an upstream back from down) lost its cache:
        its index entries go. A hello is a new WorkerInfo object, so identity tells."""
        for w in candidates:
            if w.worker_id in self._seen and self._seen[w.worker_id] is not w.info:
                self.index.remove(w.worker_id)
            self._seen[w.worker_id] = w.info
