"""Which newly decoding requests the sender offloads (`RemoteSender.choose`): longest contexts first, so a
share that lets only some go sends those whose attention is largest; ties keep arrival order;
Adrenaline's C1/C2 still decide each request, now in that order; a request is considered once. Fakes
stand in for the executor and the KV pool (no model runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_ext.offload.sender import RemoteSender, longest_first
from sglang_ext.sampling.params import SamplingParams

PAGE = 4


@dataclass
class Row:
    """What the sender reads and sets of a scheduler's request."""

    name: str
    kv_len: int
    max_new: int = 8
    input_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    pages: list[int] = field(default_factory=list)
    remote: int | None = None
    offload_checked: bool = False
    attention_executor: str | None = None

    def __post_init__(self) -> None:
        self.input_ids = list(range(self.kv_len))  # at its first decode its KV is its prompt
        self.sampling = SamplingParams(max_new_tokens=self.max_new)
        self.pages = list(range(-(-self.kv_len // PAGE)))


class FakeRemote:
    """An executor that takes every load until `room` requests are out."""

    executor_id = "cold-0"

    def __init__(self, room: int = 1_000) -> None:
        self.room = room
        self.loaded: list[int] = []  # KV lengths, in load order

    def load(self, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        if len(self.loaded) >= self.room:
            return False
        self.loaded.append(length)
        return True


def sender(ratio: float, ob: float | None = None, room: int = 1_000) -> RemoteSender[Any]:
    pool = SimpleNamespace(page_size=PAGE, data=torch.zeros(64, 1), device=torch.device("cpu"))
    return RemoteSender(FakeRemote(room), ratio, pool, ob)  # type: ignore[arg-type]


def names(rows: list[Row]) -> list[str]:
    return [r.name for r in rows]


def test_longest_first_is_stable() -> None:
    rows = [Row("a", 10), Row("b", 30), Row("c", 10), Row("d", 20), Row("e", 30)]
    assert names(longest_first(rows)) == ["b", "e", "d", "a", "c"]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_a_share_of_k_in_n_sends_the_k_longest(k: int) -> None:
    rows = [Row("a", 12), Row("b", 40), Row("c", 7), Row("d", 33), Row("e", 21)]  # arrival order
    off = sender(ratio=k / len(rows))
    moved = off.choose(rows)
    want = ["b", "d", "e", "a", "c"][:k]
    assert names(moved) == want and off.num_remote == k
    assert all(r.remote is not None and r.attention_executor == "cold-0" for r in moved)
    assert all(r.remote is None for r in rows if r.name not in want)
    assert all(r.offload_checked for r in rows)  # each considered once: the others stay local for good
    assert off.choose(rows) == []


def test_equal_lengths_go_in_arrival_order() -> None:
    rows = [Row("a", 16), Row("b", 16), Row("c", 16), Row("d", 16)]
    assert names(sender(ratio=0.5).choose(rows)) == ["a", "b"]


def test_requests_already_decided_count_in_the_share_but_are_not_chosen_again() -> None:
    off = sender(ratio=0.5)
    first = [Row("a", 50), Row("b", 10)]
    assert names(off.choose(first)) == ["a"]
    # a later step: two old requests (one out, one kept local) and two new ones; a share of 0.5 of
    # four lets one more go: the longer new one, though the local old one is longer still
    new = [Row("c", 20), Row("d", 30)]
    assert names(off.choose([*first, *new])) == ["d"]
    assert first[1].remote is None and new[0].remote is None


def test_an_executor_that_refuses_one_leaves_room_for_the_next() -> None:
    off = sender(ratio=1.0, room=2)
    rows = [Row("a", 8), Row("b", 40), Row("c", 24)]
    assert names(off.choose(rows)) == ["b", "c"]  # "a" was refused (the executor full): it stays local
    assert off.remote.loaded == [40, 24]  # type: ignore[attr-defined]


def test_adrenaline_conditions_decide_each_request_longest_first() -> None:
    # OB 1, nothing decided before: arrival a 5, b 3, c 7, d 2, e 4 tokens (max_new 10), considered
    # c, a, e, b, d. c: nothing local, C1/C2 fail: local (LR 7 tokens, 1 request). a: C1 15 < 7 no;
    # C2 5 < 7 but 0 + 1 < 1 no: local (12, 2). e: C2 4 < 12 and 1 < 2: out. b: C1 4 + 13 < 12 no;
    # C2 4 + 3 < 12 but 2 < 2 no: local (15, 3). d: C2 4 + 2 < 15 and 2 < 3: out.
    rows = [Row(n, t, max_new=10) for n, t in (("a", 5), ("b", 3), ("c", 7), ("d", 2), ("e", 4))]
    off = sender(ratio=1.0, ob=1.0)
    assert names(off.choose(rows)) == ["e", "d"]
    # the share still caps: with 0.2 of 5 only one may go, the first that meets C1/C2
    rows = [Row(n, t, max_new=10) for n, t in (("a", 5), ("b", 3), ("c", 7), ("d", 2), ("e", 4))]
    assert names(sender(ratio=0.2, ob=1.0).choose(rows)) == ["e"]
