"""The sender's side of offload planning: Adrenaline's per-request conditions C1/C2 against
hand-computed cases, a planner's live ratio update (OffloadRatio) changing which new requests go
remote on a paired worker (those already out stay out), and the TPOT window load reports carry."""

from __future__ import annotations

from typing import Any

import pytest
from test_offload_worker import PROMPTS, hosted, make, open_for, run, sent

from sglang_ext.messages import OffloadDirective, OffloadRatio, decode_to_worker, encode
from sglang_ext.offload.conditions import Loads, c1, c2, should_offload
from sglang_ext.worker.stats import LatencyWindow


# ---- C1 / C2 ----------------------------------------------------------------------------------------
def test_c1_the_request_at_its_longest_fits_the_bound() -> None:
    # offloaded 100 tokens, local 1000 tokens, OB 0.5: budget 500 offloaded tokens
    loads = Loads(attn_used=100, num_remote=2, decode_used=1000, num_local=4)
    assert c1(loads, req_max_tokens=399, ob=0.5)  # 100 + 399 = 499 < 500
    assert not c1(loads, req_max_tokens=400, ob=0.5)  # 500 < 500 is false: strict, as in the paper
    assert not c1(Loads(0, 0, 0, 0), req_max_tokens=1, ob=10.0)  # nothing local: nothing goes out


def test_c2_the_request_now_fits_and_the_count_stays_in_bound() -> None:
    loads = Loads(attn_used=100, num_remote=1, decode_used=1000, num_local=4)
    # tokens: 100 + 399 < 500; count: 1 + 1 = 2 < 4 * 0.5 = 2 is false
    assert not c2(loads, req_used_tokens=399, ob=0.5)
    assert c2(loads, req_used_tokens=399, ob=0.6)  # 2 < 2.4; tokens: 499 < 600
    assert not c2(loads, req_used_tokens=500, ob=0.6)  # 600 < 600 is false
    assert c2(Loads(100, 0, 1000, 4), req_used_tokens=399, ob=0.5)  # 1 < 2


def test_should_offload_is_c1_or_c2() -> None:
    loads = Loads(attn_used=0, num_remote=0, decode_used=100, num_local=3)
    assert should_offload(loads, req_max_tokens=40, req_used_tokens=40, ob=0.5)  # C1: 40 < 50
    assert should_offload(loads, req_max_tokens=80, req_used_tokens=20, ob=0.5)  # C2: 20 < 50, 1 < 1.5
    assert not should_offload(loads, req_max_tokens=80, req_used_tokens=60, ob=0.5)  # neither
    assert not should_offload(Loads(0, 1, 100, 3), req_max_tokens=80, req_used_tokens=20, ob=0.5)  # 2 < 1.5 no


# ---- live ratio updates on a paired worker -----------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return run(make("ref-0"), "a")[0]


def test_a_ratio_update_changes_which_new_requests_go_remote(reference: list[list[int]]) -> None:
    host = make("cold-0", executor_mem_gb=0.02)
    sender = make("hot-0")
    d = open_for(sender, host)
    # a planned policy may pair at ratio 0: the pairing is up, no new request goes out
    sender.handle(OffloadDirective(**{**_fields(d), "policy": "adaptive", "ratio": 0.0}))
    assert sent(sender.load_report()).ratio == 0.0
    rep = hosted(host.load_report())
    assert rep.free_tokens["p1"] > 0 and rep.pairing_tokens == {"p1": 0}
    outs, where = run(sender, "b")
    assert outs == reference and where == [None] * len(PROMPTS)
    assert sent(sender.load_report()).state == "active" and sent(sender.load_report()).ratio == 0.0
    # ratio 1: every new request goes out
    sender.handle(OffloadRatio(pairing="p1", ratio=1.0))
    held: list[tuple[int, int]] = []
    outs, where = run(sender, "c", each=lambda w: held.append(
        (hosted(host.load_report()).pairing_tokens["p1"], hosted(host.load_report()).free_tokens["p1"])))
    assert outs == reference and where == ["cold-0"] * len(PROMPTS)
    assert max(u for u, _ in held) > 0 and min(f for _, f in held) < rep.free_tokens["p1"]
    # an update for another pairing (a stale one) and a bad one are ignored
    sender.handle(OffloadRatio(pairing="p0", ratio=0.0))
    sender.handle(OffloadRatio(pairing="p1", ratio=1.5))
    assert sender.scheduler.remote_sender is not None and sender.scheduler.remote_sender.ratio == 1.0
    # lowered mid-generation: requests already out stay out and finish there, new ones stay local
    lowered: list[int] = []

    def lower(w: Any) -> None:
        if not lowered and w.scheduler.remote_sender.num_remote == len(PROMPTS):
            w.handle(OffloadRatio(pairing="p1", ratio=0.0))
            lowered.append(w.scheduler.remote_sender.num_remote)

    outs, where = run(sender, "d", each=lower)
    assert lowered and outs == reference and where == ["cold-0"] * len(PROMPTS)
    outs, where = run(sender, "e")
    assert outs == reference and where == [None] * len(PROMPTS)
    sender.remote_control.close(sender.scheduler)


def test_adrenaline_conditions_pick_the_rows_on_a_worker(reference: list[list[int]]) -> None:
    host = make("cold-1", executor_mem_gb=0.02)
    sender = make("hot-1")
    d = open_for(sender, host)
    # OB 0: C1/C2 never hold, whatever the share cap
    sender.handle(OffloadDirective(**{**_fields(d), "policy": "adrenaline", "ratio": 1.0, "bound": 0.0}))
    outs, where = run(sender, "f")
    assert outs == reference and where == [None] * len(PROMPTS)
    # OB 1 (prompts of 5, 3, 7, 2 and 4 tokens, decided at their first decode with kv_len = the
    # prompt, longest first: 7, 5, 4, 3, 2): the 7 stays (nothing local yet); the 5: C1 15 < 7 no,
    # C2 5 < 7 but 1 < 1 no; the 4: C2 4 < 12 and 1 < 2: out; the 3: C2 4 + 3 < 12 but 2 < 2 no;
    # the 2: C2 4 + 2 < 15 and 2 < 3: out. So the last two prompts go out.
    sender.handle(OffloadRatio(pairing="p1", ratio=1.0, bound=1.0))
    assert sent(sender.load_report()).bound == 1.0
    outs, where = run(sender, "g")
    assert outs == reference and where == [None, None, None, "cold-1", "cold-1"]
    sender.remote_control.close(sender.scheduler)


def _fields(d: OffloadDirective) -> dict[str, Any]:
    return {f: getattr(d, f) for f in d.__struct_fields__}


def test_the_ratio_message_decodes_strictly() -> None:
    m = OffloadRatio(pairing="p", ratio=0.25, bound=0.5)
    assert decode_to_worker(encode(m)) == m
    import msgspec

    raw = msgspec.msgpack.decode(encode(m))
    for bad in ({**raw, "ratioo": 1}, {**raw, "ratio": "x"}, {k: v for k, v in raw.items() if k != "ratio"}):
        with pytest.raises(msgspec.ValidationError):
            decode_to_worker(msgspec.msgpack.encode(bad))


def test_a_workers_report_says_how_long_its_decoding_requests_are() -> None:
    """What `adaptive` compares with min_context_tokens: the mean prompt + output tokens of the
    requests decoding when the report is made (PROMPTS: 2 to 7 tokens, 10 new ones each)."""
    w = make("ctx-0")
    seen: list[float] = []
    run(w, "h", each=lambda w: seen.append(w.load_report().decode_context_tokens))
    decoding = [x for x in seen if x > 0]
    assert decoding and all(3 <= x <= 7 + 10 for x in decoding)
    assert max(decoding) > min(decoding)  # the requests grow as they decode
    assert w.load_report().decode_context_tokens == 0.0  # all done: nothing decoding


# ---- the TPOT window -----------------------------------------------------------------------------------
def test_tpot_p99_over_a_recent_window() -> None:
    w = LatencyWindow(window_s=10.0)
    assert w.p99_ms(now=0.0) == 0.0 and w.count(now=0.0) == 0
    for i in range(100):
        w.add((i + 1) / 1000, now=float(i) / 100)  # 1 ms ... 100 ms, all within the first second
    assert w.count(now=1.0) == 100 and w.p99_ms(now=1.0) == pytest.approx(99.0)
    w.add(0.5, now=5.0)
    assert w.p99_ms(now=5.0) == pytest.approx(100.0)  # nearest rank of 101: the 100th
    assert w.count(now=11.0) == 1 and w.p99_ms(now=11.0) == pytest.approx(500.0)  # the old ones aged out
