"""`--offload-policy adaptive` with an in-process executor (`--offload-executor local`): the router's
`Adaptive` class, run by the worker on its own measurements, sets the share of the embedded model's
worker on CPU: 0 while its decoding requests' contexts are under min_context_tokens, rising with slack
at longer ones, falling on TPOT misses; the greedy outputs stay those of a worker without an executor."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sglang_ext.messages import BatchOut, GenerateReq
from sglang_ext.offload.planning import Adaptive
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.local_planning import LocalRule, adaptive_spec
from sglang_ext.worker.worker import Worker

SHORT = [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(4)]  # 4 tokens + 12 out: contexts 5-16
LONG = [[(7 * i + j) % 200 + 3 for j in range(96)] for i in range(4)]  # 96 tokens + 12 out: 97-108
RULE = {"min_context_tokens": 64, "interval_s": 0.001, "step_up": 0.25, "step_down": 0.25}


def make(tag: str, tpot_slo_ms: float = 1e6, **kw: Any) -> Worker:
    args = ServerArgs(device="cpu", dtype="float32", page_size=4, max_total_tokens=4096, tpot_slo_ms=tpot_slo_ms,
                      **kw)
    w = Worker(args, tag)
    if w.local_planning is not None:
        w.local_planning.every_s = 0.0  # decide after every step (the served cadence is 0.5 s)
    return w


def adaptive(tag: str, **kw: Any) -> Worker:
    return make(tag, offload_executor="local", offload_ratio=0.5, offload_policy="adaptive",
                offload_adaptive=json.dumps(RULE), **kw)


WHYS: list[str] = []  # the planner's reasons, step by step, of the last run


def run(w: Worker, prompts: list[list[int]], tag: str) -> tuple[list[list[int]], list[Any], list[float]]:
    """Greedy outputs, each request's attention_executor, and the sender's share after every step (the
    planner's reasons in WHYS)."""
    WHYS.clear()
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    inbox: list[Any] = [GenerateReq(rid=f"{tag}{i}", input_ids=p, sampling_params=sp) for i, p in enumerate(prompts)]
    out: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    where: dict[str, set[Any]] = {rid: set() for rid in out}
    shares: list[float] = []
    for _ in range(300):
        for m in w.step(inbox):
            if isinstance(m, BatchOut):
                for o in m.outs:
                    out[o.rid].extend(o.token_ids)
                    where[o.rid].add(o.meta_info["attention_executor"])
        inbox = []
        off = w.scheduler.remote_sender
        shares.append(off.ratio if off is not None else -1.0)
        if w.local_planning is not None and w.local_planning.decision is not None:
            WHYS.append(w.local_planning.decision.why)
        if not w.has_work():
            break
    return list(out.values()), [sorted(where[r], key=str) for r in out], shares


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    w = make("ref-0")
    return {"short": run(w, SHORT, "s")[0], "long": run(w, LONG, "l")[0]}


def test_the_share_falls_to_0_at_short_contexts_and_rises_at_long_ones(reference: dict[str, Any]) -> None:
    w = adaptive("ad-0")
    assert w.local_planning is not None and isinstance(w.local_planning.policy, Adaptive)
    assert w.scheduler.remote_sender is not None and w.scheduler.remote_sender.ratio == 0.5  # the starting share
    outs, where, shares = run(w, SHORT, "s")
    assert outs == reference["short"]
    assert shares[0] == 0.0 and set(shares) == {0.0}  # short from the first look: at 0 at once, and held
    assert all(e == [None] for e in where)  # nothing went out
    assert WHYS[0].startswith("lowered to 0: contexts short") and "min_context_tokens 64" in WHYS[0]
    assert w.load_report().offload is not None and w.load_report().offload.ratio == 0.0  # type: ignore[union-attr]
    outs, where, shares = run(w, LONG, "l")
    assert outs == reference["long"]  # remote rows compute the same attention
    assert max(shares) > 0.25 and shares == sorted(shares)  # raised with slack, step by step (no miss)
    assert any("ad-0/local" in e for e in where)  # requests went to the in-process executor
    assert w.load_report().offload.ratio == max(shares) > 0  # type: ignore[union-attr]
    assert w.local_planning.changes >= 3


def test_tpot_misses_lower_the_share_at_long_contexts() -> None:
    w = adaptive("ad-1", tpot_slo_ms=0.001)  # every finished request misses, every decode step is over it
    _, _, shares = run(w, LONG, "l")
    # before any decode step or finished request there is nothing to protect (slack: raised); from the first
    # decode step over the SLO on, the share only falls, to 0
    top = shares.index(max(shares))
    assert shares[:top + 1] == sorted(shares[:top + 1]) and top <= 2
    assert shares[top:] == sorted(shares[top:], reverse=True) and shares[-1] == 0.0
    assert any(why.startswith("lowered: ") and "TPOT SLO" in why for why in WHYS)


def test_a_fixed_policy_keeps_its_ratio_and_no_planner_runs() -> None:
    w = make("fx-0", offload_executor="local", offload_ratio=0.5)
    assert w.local_planning is None
    _, _, shares = run(w, SHORT, "s")
    assert set(shares) == {0.5}


def test_rules_and_bad_flags() -> None:
    r = LocalRule("adaptive", 0.3, adaptive=adaptive_spec('{"min_context_tokens": 128}'))
    assert (r.cap, r.start, r.adaptive.min_context_tokens) == (1.0, 0.3, 128)  # type: ignore[union-attr]
    assert (LocalRule("fixed", 0.4).cap, LocalRule("fixed", 0.4).start) == (0.4, 0.4)
    with pytest.raises(ValueError, match=r"offload_adaptive: .*min_context_tokens"):
        adaptive_spec('{"min_context_tokens": -1}')
    with pytest.raises(ValueError, match=r"offload_adaptive: .*nope"):
        adaptive_spec('{"nope": 1}')
    base = {"device": "cpu", "offload_executor": "local", "offload_ratio": 0.5}
    with pytest.raises(ValueError, match="adrenaline is for served pairings"):
        ServerArgs(**base, offload_policy="adrenaline")
    with pytest.raises(ValueError, match="offload_policy is for an in-process executor"):
        ServerArgs(device="cpu", offload_policy="adaptive")
    with pytest.raises(ValueError, match="offload_adaptive is set but offload_policy"):
        ServerArgs(**base, offload_adaptive="{}")
    with pytest.raises(ValueError, match="offload_adaptive must be a JSON object"):
        ServerArgs(**base, offload_policy="adaptive", offload_adaptive="[1]")
    with pytest.raises(ValueError, match="min_context_tokens"):
        make("bad-0", offload_executor="local", offload_ratio=0.5, offload_policy="adaptive",
             offload_adaptive='{"min_context_tokens": -1}')
