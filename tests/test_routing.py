"""Routing policies over one model's replicas (router/routing/): the prefix index, cache_aware's prefix
preference and balance fallback, shortest queue, round robin, and one policy per model."""

from __future__ import annotations

from typing import Any

import pytest
from _router_util import info

from router.routing.balancer import ModelRouting
from router.routing.keys import route_key
from router.routing.policies import CacheAware, PrefixAffinity, RoundRobin, ShortestQueue
from router.routing.prefix import PrefixIndex
from router.routing.settings import RoutingSettings
from router.tracker import WorkerState
from sglang_ext.messages import GenerateReq

SYSTEM = "You are a careful assistant. Answer in one sentence. " * 8  # ~430 characters shared


def workers(*ids: str, model: str = "m") -> list[WorkerState]:
    return [WorkerState(i, model, up=True, info=info(i, model)) for i in ids]


def busy(w: WorkerState, n: int) -> None:
    """`n` requests in flight on `w` (the load the policies count)."""
    w.inflight = {f"{w.worker_id}-{k}": None for k in range(n)}  # type: ignore[misc]


def cache_aware(**kw: Any) -> CacheAware:
    return CacheAware(RoutingSettings(policy="cache_aware", **kw))


# ---- the prefix index ----------------------------------------------------------------------------------
def test_index_matches_whole_blocks_of_the_longest_shared_prefix() -> None:
    idx = PrefixIndex(max_chars=4096, block_chars=4)
    idx.insert(idx.names("abcdefghijkl"), "a")
    idx.insert(idx.names("abcdXXXX"), "b")
    m = idx.match(idx.names("abcdefghZZZZ"), ["a", "b", "c"])
    assert m == {"a": 8, "b": 4, "c": 0}
    assert idx.match(idx.names("abcdefg"), ["a"]) == {"a": 4}  # a 3-character tail is not a block
    assert idx.match(idx.names("zbcdefgh"), ["a"]) == {"a": 0}  # a name stands for its whole prefix


def test_index_memory_is_bounded_and_leaves_go_first() -> None:
    idx = PrefixIndex(max_chars=40, block_chars=4)  # 10 blocks per tenant
    idx.insert(idx.names("A" * 24), "w")  # 6 blocks
    idx.insert(idx.names("B" * 24), "w")  # 6 more: 2 must go, the oldest leaves of the first prompt
    assert idx.chars("w") == 40
    assert idx.match(idx.names("A" * 24), ["w"]) == {"w": 16}  # its prefix stays, its tail went
    assert idx.match(idx.names("B" * 24), ["w"]) == {"w": 24}
    for k in range(100):
        idx.insert(idx.names(f"{k:04d}" * 6), "w")
        assert idx.chars("w") <= 40
    assert idx.match(idx.names("A" * 24), ["w"]) == {"w": 0}  # long gone
    idx.remove("w")
    assert idx.chars("w") == 0


def test_route_key_keeps_prompt_kinds_apart_and_conversations_as_prefixes() -> None:
    t = route_key(GenerateReq(rid="a", text="hi"))
    i = route_key(GenerateReq(rid="b", input_ids=[104, 105]))
    assert t == "t:hi" and i == "i:hi" and t != i  # ids are one character each
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "one"}]
    turn2 = [*turn1, {"role": "assistant", "content": "1"}, {"role": "user", "content": "two"}]
    k1, k2 = route_key(GenerateReq(rid="c", messages=turn1)), route_key(GenerateReq(rid="d", messages=turn2))
    assert k1 is not None and k2 is not None and k2.startswith(k1[:-1])
    assert route_key(GenerateReq(rid="e")) is None


# ---- cache_aware ---------------------------------------------------------------------------------------
def test_cache_aware_sends_a_shared_prefix_to_the_replica_that_has_it() -> None:
    a, b = workers("a", "b")
    ca = cache_aware(balance_abs_threshold=4)
    first = ca.pick([a, b], "t:" + SYSTEM + "question one")
    other = b if first is a else a
    busy(first, 3)  # busier, but within the balance thresholds: the cache wins
    assert ca.pick([a, b], "t:" + SYSTEM + "question two") is first
    assert ca.pick([a, b], "t:" + SYSTEM + "question three") is first
    assert ca.decisions.prefix == 2
    # A prompt nobody was sent before goes to the shortest queue.
    assert ca.pick([a, b], "t:" + "something else entirely, " * 20) is other
    assert ca.decisions.cold == 2


def test_cache_aware_falls_back_to_the_shortest_queue_when_imbalanced() -> None:
    a, b = workers("a", "b")
    ca = cache_aware(balance_abs_threshold=4, balance_rel_threshold=2.0)
    key = "t:" + SYSTEM + "q"
    first = ca.pick([a, b], key)
    other = b if first is a else a
    busy(first, 5)
    busy(other, 2)  # 5 - 2 > 4 fails: still balanced
    assert ca.pick([a, b], key) is first
    busy(first, 7)  # 7 - 2 > 4 but 7 < 2.0 * 4: relative threshold not passed yet
    busy(other, 4)
    assert ca.pick([a, b], key) is first
    busy(other, 2)  # 7 - 2 > 4 and 7 > 2.0 * 2: imbalanced
    assert ca.pick([a, b], key) is other
    assert ca.decisions.balance == 1
    # The replica it went to is now indexed too: balanced again, either may win on the full match.
    busy(first, 0)
    busy(other, 0)
    assert ca.index.match(ca.index.names(key), ["a", "b"]) == {"a": len(key) // 32 * 32, "b": len(key) // 32 * 32}


def test_cache_aware_threshold_and_cold_ties() -> None:
    a, b = workers("a", "b")
    ca = cache_aware(cache_threshold=0.9)
    shared = "t:" + SYSTEM
    first = ca.pick([a, b], shared)
    other = b if first is a else a
    # Half of the new prompt is known to `first`: below 0.9, so the shortest queue (a tie on load) ...
    # ... broken by the smaller index: `other` has nothing indexed.
    assert ca.pick([a, b], shared + "x" * len(shared)) is other
    assert ca.decisions.cold == 2


def test_cache_aware_forgets_a_replica_that_restarted() -> None:
    a, b = workers("a", "b")
    ca = cache_aware()
    key = "t:" + SYSTEM
    first = ca.pick([a, b], key)
    assert ca.index.chars(first.worker_id) > 0
    first.info = info(first.worker_id)  # a new hello: a new process with an empty cache
    ca.pick([a, b], "t:" + "z" * 64)
    assert ca.index.chars(first.worker_id) <= 64


def test_cache_aware_without_a_key_is_the_shortest_queue() -> None:
    a, b = workers("a", "b")
    busy(a, 1)
    assert cache_aware().pick([a, b], None) is b


# ---- the simple policies -------------------------------------------------------------------------------
def test_round_robin_takes_turns_in_replica_order() -> None:
    a, b, c = workers("a", "b", "c")
    rr = RoundRobin()
    busy(a, 50)  # load does not matter
    assert [rr.pick([a, b, c], "t:x").worker_id for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_shortest_queue_counts_requests_then_tokens_then_turns() -> None:
    a, b = workers("a", "b")
    sq = ShortestQueue()
    busy(a, 2)
    busy(b, 1)
    b.outstanding_tokens = 10_000
    assert sq.pick([a, b]) is b  # fewer requests, however long
    busy(a, 1)
    assert sq.pick([a, b]) is a  # equal requests: fewer tokens
    busy(a, 0)
    busy(b, 0)
    a.outstanding_tokens = b.outstanding_tokens = 0
    a.num_served, b.num_served = 3, 2
    assert sq.pick([a, b]) is b  # idle replicas take turns


def test_prefix_affinity_keys_on_the_first_128_characters() -> None:
    a, b = workers("a", "b")
    pa = PrefixAffinity()
    first = pa.pick([a, b], "t:" + "p" * 128 + "tail one")
    first.outstanding_tokens = 100  # within its slack
    assert pa.pick([a, b], "t:" + "p" * 128 + "another tail") is first


def test_one_policy_per_model() -> None:
    default = RoutingSettings(policy="round_robin")
    mr = ModelRouting(default, {"cached": RoutingSettings(policy="cache_aware")})
    a, b = workers("a", "b", model="plain")
    c, d = workers("c", "d", model="cached")
    assert [mr.pick([a, b], "t:x").worker_id for _ in range(3)] == ["a", "b", "a"]
    key = "t:" + SYSTEM
    first = mr.pick([c, d], key)
    assert all(mr.pick([c, d], key) is first for _ in range(3))
    described = mr.describe()
    assert described["plain"] == {"policy": "round_robin"}
    assert described["cached"]["policy"] == "cache_aware"
    assert described["cached"]["decisions"] == {"prefix": 3, "balance": 0, "cold": 1}


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        ModelRouting(RoutingSettings(policy="random")).pick(workers("a"), None)
