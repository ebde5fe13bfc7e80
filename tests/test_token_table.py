"""The overlap loop's token table: each request's last sampled token on the device, in its slot. The
step launched beside a step in flight reads its input ids from the slots of its requests."""

from __future__ import annotations

import torch
from _tiny import VOCAB, greedy, make_scheduler, prompts

from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.scheduler.token_table import TokenTable


def _req(rid: str) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=4))


def test_slots_are_given_written_read_and_given_back() -> None:
    t = TokenTable(torch.device("cpu"), slots=2)
    a, b, c = _req("a"), _req("b"), _req("c")
    idx = t.index([a, b])
    assert (a.token_slot, b.token_slot) == (0, 1) and idx.tolist() == [0, 1]
    t.write(idx, torch.tensor([11, 22]))
    assert t.read(t.index([b, a])).tolist() == [22, 11]  # by request, whatever the order
    t.index([c])  # no slot free: the table doubles and keeps what it held
    assert c.token_slot in (2, 3) and t.ids.shape[0] == 4 and t.read(t.index([a, b])).tolist() == [11, 22]
    t.check()
    t.release(a)
    assert a.token_slot == -1 and 0 in t.free
    t.check()
    d = _req("d")
    t.index([d])
    assert d.token_slot == 0  # a freed slot is given again
    t.release(a)  # twice: nothing held, nothing happens
    t.check()


def test_the_step_in_flight_leaves_its_tokens_in_its_requests_slots() -> None:
    base = make_scheduler("cpu", max_total_tokens=16384)
    s = Scheduler(base.args, base.runner, base.page_size, base.eos_ids, vocab_size=VOCAB, overlap=True)
    assert s.overlap is not None
    table = s.overlap.table
    reqs = [Req(f"r{i}", p, greedy(10 + i)) for i, p in enumerate(prompts([5, 17, 9, 12]))]
    for r in reqs:
        s.add_request(r)
    seen = 0
    while s.has_work():
        s.step()
        s.check()
        launched = s.overlap.inflight
        if launched is None:
            continue
        slots = [e.req.token_slot for e in launched.entries]
        assert len(set(slots)) == len(slots) and min(slots) >= 0
        assert table.ids[slots].tolist() == launched.host.tolist()  # (on CPU the copy is the tokens)
        seen += 1
    assert seen > 0 and s.overlapped_steps > 0
    assert not table.owner and all(r.token_slot == -1 for r in reqs)  # every finish gave its slot back
