"""Offload planning in the router: Adrenaline's bound OB(n, B_max) against hand-computed cases, the
adaptive controller driven by synthetic views, and the planner on events with fake workers (live
ratio updates sent on load reports and arrivals, a lost update sent again, executor memory low,
decisions visible in /get_server_info's offload section and in metrics)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq.asyncio
from _router_util import FakeWorker, strategy, until
from test_offload_router import Fleet, next_of, serve_open

import router.placement.steer as steer
from router.config import AdaptiveSpec, AdrenalineSpec, OffloadSpec, RouterConfig, SloSpec
from router.core import Router
from router.events import ExecutorMemoryLow, OffloadDecided, SloMissed
from router.placement.offload import OffloadPlacement
from router.placement.planning import Adaptive, Adrenaline, PairView, offload_bound
from sglang_ext.messages import GenerateReq, OffloadDirective, OffloadRatio
from sglang_ext.messages.io import ExecutorKV, Latency, OffloadSender


# ---- OB(n, B_max) ----------------------------------------------------------------------------------------
def test_offload_bound_hand_computed() -> None:
    # executor 8000 tokens, decode 16000: memory 0.5; bandwidth 0.5; dense 256 / 64 - 1 = 3
    b = offload_bound(1, 8000, 16000, 0.5, 256, 64)
    assert (b.ob, b.memory, b.bandwidth, b.dense) == (0.5, 0.5, 0.5, 3.0)
    assert offload_bound(1, 4000, 16000, 0.5, 256, 64).ob == 0.25  # memory binds
    assert offload_bound(1, 32000, 16000, 1.0, 256, 200).ob == pytest.approx(0.28)  # dense: 256 / 200 - 1
    assert offload_bound(1, 32000, 16000, 1.0, 256, 256).ob == 0.0  # compute-bound already: nothing to gain
    assert offload_bound(1, 32000, 16000, 1.0, 256, 300).ob == 0.0  # never negative
    assert offload_bound(1, 32000, 16000, 0.75, 256, 0).dense == math.inf  # no batch: dense does not bind
    assert offload_bound(2, 4000, 16000, 0.25, 256, 64).ob == 0.5  # n executors: n x memory, n x bandwidth
    assert offload_bound(1, 4000, 0, 1.0, 256, 1).ob == 0.0  # a sender that reports no KV: nothing


def test_adrenaline_policy_turns_the_bound_into_a_share() -> None:
    rule = OffloadSpec(from_="hot", to="cold", policy="adrenaline", max_ratio=0.3,
                       adrenaline=AdrenalineSpec(b_max=8, bandwidth_share=1.0))
    d = Adrenaline(rule).decide(PairView(now=0, sender_batch=2, sender_kv_tokens=1000, exec_used=200, exec_free=300))
    # memory 500 / 1000 = 0.5, bandwidth 1, dense 8 / 2 - 1 = 3: OB 0.5, a share of 0.5 / 1.5, capped at 0.3
    assert d.ob == 0.5 and d.ratio == d.bound == 0.3 and d.wire(rule.cap) == (0.3, 0.5)
    assert d.why == "OB 0.5 = min(memory 0.5, bandwidth 1, dense 3)"


# ---- the adaptive controller -------------------------------------------------------------------------------
def view(now: float, p99: float | None, batch: int = 4, **kw: Any) -> PairView:
    return PairView(now=now, sender_batch=batch, sender_kv_tokens=8192, host_tpot_p99_ms=p99 or 0.0,
                    host_tpot_samples=0 if p99 is None else 20, host_slo_tpot_ms=50.0, **kw)


def controller(**kw: Any) -> Adaptive:
    return Adaptive(OffloadSpec(from_="hot", to="cold", policy="adaptive", max_ratio=0.6, **kw))


def test_the_controller_lowers_the_ratio_after_slo_misses() -> None:
    c = controller()
    assert c.ratio == 0.45  # WEAVER's default, under max_ratio
    assert c.decide(view(0.0, 70.0)).ratio == pytest.approx(0.35)  # P99 70 ms > SLO 50 ms
    assert "P99 TPOT 70.0 ms > SLO 50 ms" in c.why
    assert c.decide(view(1.0, 70.0)).ratio == pytest.approx(0.35)  # one change per interval (2 s)
    assert c.decide(view(2.0, 70.0)).ratio == pytest.approx(0.25)
    c.note_miss("tpot")  # a request finished over the SLO, while the P99 is fine
    assert c.decide(view(4.0, 30.0)).ratio == pytest.approx(0.15) and "1 tpot miss(es)" in c.why
    assert c.decide(view(6.0, 30.0, exec_low=True)).ratio == pytest.approx(0.05)  # executor memory low
    assert c.decide(view(8.0, 90.0)).ratio == 0.0
    assert c.decide(view(10.0, 90.0)).ratio == 0.0 and c.why.startswith("at 0")  # clamped


def test_with_a_prefill_host_the_controller_keeps_its_ttft() -> None:
    """Adrenaline placement: the executor's host is a prefill worker, which decodes nothing (no TPOT);
    the controller keeps its P99 TTFT within the model's TTFT SLO instead."""
    c = controller(ratio=0.3)

    def pv(now: float, ttft: float | None, tpot: float | None = None) -> PairView:
        return PairView(now=now, sender_batch=4, sender_kv_tokens=8192, host_prefill=True,
                        host_tpot_p99_ms=tpot or 0.0, host_tpot_samples=0 if tpot is None else 20,
                        host_slo_tpot_ms=50.0, host_ttft_p99_ms=ttft or 0.0,
                        host_ttft_samples=0 if ttft is None else 20, host_slo_ttft_ms=1000.0)

    assert c.decide(pv(0.0, 1500.0)).ratio == pytest.approx(0.2)  # TTFT 1.5 s > SLO 1 s: lowered
    assert "P99 TTFT 1500.0 ms > SLO 1000 ms" in c.why
    assert c.decide(pv(2.0, 900.0, tpot=10.0)).ratio == pytest.approx(0.2)  # within [0.8, 1] x SLO: held
    assert c.why.startswith("held: P99 TTFT 900.0 ms")  # the host's TPOT (were there any) plays no part
    assert c.decide(pv(4.0, 300.0, tpot=90.0)).ratio == pytest.approx(0.25)  # slack: raised
    assert "P99 TTFT 300.0 ms < 0.8 x SLO 1000 ms" in c.why


def test_the_controller_keeps_the_senders_own_tpot_within_its_slo() -> None:
    """A larger share grows the sender's batch and its steps: the sender's mean decode step over the
    sending model's TPOT SLO lowers the share, within [slack x SLO, SLO] holds it, below raises it."""
    c = controller(ratio=0.5)

    def own(now: float, p99: float | None, slo: float | None = 25.0) -> PairView:
        return view(now, 10.0, sender_step_ms=p99 or 0.0, sender_steps=0 if p99 is None else 200,
                    sender_slo_tpot_ms=slo)

    assert c.decide(own(0.0, 40.0)).ratio == pytest.approx(0.4)  # the host has slack, the sender not
    assert "the sender's decode step 40.0 ms > its TPOT SLO 25 ms" in c.why
    assert c.decide(own(2.0, 22.0)).ratio == pytest.approx(0.4)  # 20 <= 22 <= 25: held
    assert c.why.startswith("held: the sender's decode step 22.0 ms")
    assert c.decide(own(4.0, 15.0)).ratio == pytest.approx(0.45)  # slack on both sides: raised
    assert c.decide(own(6.0, None)).ratio == pytest.approx(0.5)  # no samples of the sender's: raised
    assert c.decide(own(8.0, 90.0, slo=None)).ratio == pytest.approx(0.55)  # the sender has no SLO


def test_the_controller_raises_the_ratio_with_slack_and_holds_in_between() -> None:
    c = controller(ratio=0.1)
    assert c.decide(view(0.0, 30.0)).ratio == pytest.approx(0.15)  # 30 < 0.8 x 50
    assert c.decide(view(2.0, 45.0)).ratio == pytest.approx(0.15) and c.why.startswith("held")  # 40 <= 45 <= 50
    assert c.decide(view(4.0, None)).ratio == pytest.approx(0.2)  # no samples: nothing to protect
    assert c.decide(view(6.0, 10.0, batch=0)).ratio == pytest.approx(0.2)  # nothing to send: no raise
    t = 8.0
    for _ in range(20):
        d = c.decide(view(t, 10.0))
        t += 2.0
    assert d.ratio == 0.6 and d.bound == 0.6 and c.why.startswith("at max_ratio")  # clamped at max_ratio


def test_the_controller_follows_its_settings() -> None:
    c = controller(ratio=0.3, adaptive=AdaptiveSpec(step_down=0.2, step_up=0.01, slack=0.5, interval_s=0.5))
    assert c.decide(view(0.0, 51.0)).ratio == pytest.approx(0.1)
    assert c.decide(view(0.5, 30.0)).ratio == pytest.approx(0.1)  # 30 > 0.5 x 50: hold
    assert c.decide(view(1.0, 20.0)).ratio == pytest.approx(0.11)


def test_short_contexts_take_the_share_to_0_and_keep_it_there() -> None:
    """Remote rows cost more than their attention saves at short contexts: under min_context_tokens
    (4096 by default) the share falls to 0 at once, whatever the slack, and rises again only past
    min_context_tokens / slack (5120 at slack 0.8); within that band it holds."""
    c = controller(ratio=0.5)

    def ctx(now: float, tokens: float, p99: float = 10.0) -> PairView:
        return view(now, p99, sender_context_tokens=tokens)

    assert AdaptiveSpec().min_context_tokens == 4096
    assert c.decide(ctx(0.0, 1024.0)).ratio == 0.0
    assert c.why.startswith("lowered to 0: contexts short (mean 1024 tokens per decoding request < "
                            "min_context_tokens 4096)")
    for t in (2.0, 4.0, 6.0):  # slack on both sides, requests to send: still 0
        assert c.decide(ctx(t, 3000.0)).ratio == 0.0 and c.why.startswith("at 0: contexts short")
    # past break-even but within the band: held at 0
    assert c.decide(ctx(8.0, 4500.0)).ratio == 0.0
    assert c.why.startswith("held: contexts near break-even (mean 4500 tokens per decoding request within "
                            "[min_context_tokens 4096, 5120])")
    # long contexts: raised with slack, as before
    assert c.decide(ctx(10.0, 8192.0)).ratio == pytest.approx(0.05) and c.why.startswith("raised")
    assert c.decide(ctx(12.0, 5200.0)).ratio == pytest.approx(0.1)
    assert c.decide(ctx(14.0, 4500.0)).ratio == pytest.approx(0.1) and c.why.startswith("held: contexts near")
    # an SLO miss in the band lowers as before; short contexts take it to 0 whatever else holds
    assert c.decide(ctx(16.0, 4500.0, p99=70.0)).ratio == 0.0 and c.why.startswith("lowered: P99 TPOT")
    assert c.decide(ctx(18.0, 8192.0)).ratio == pytest.approx(0.05)
    c.note_miss("tpot")
    assert c.decide(ctx(20.0, 2048.0)).ratio == 0.0 and "contexts short" in c.why


def test_long_contexts_leave_the_controller_as_it_was() -> None:
    """Past min_context_tokens / slack the context plays no part: the latency steps of
    test_the_controller_raises_the_ratio_with_slack_and_holds_in_between, unchanged."""
    c = controller(ratio=0.1)

    def long(now: float, p99: float | None, batch: int = 4) -> PairView:
        return view(now, p99, batch=batch, sender_context_tokens=8192.0)

    assert c.decide(long(0.0, 30.0)).ratio == pytest.approx(0.15)
    assert c.decide(long(2.0, 45.0)).ratio == pytest.approx(0.15) and c.why.startswith("held: P99")
    assert c.decide(long(4.0, None)).ratio == pytest.approx(0.2)
    assert c.decide(long(6.0, 10.0, batch=0)).ratio == pytest.approx(0.2)
    assert c.decide(long(8.0, 70.0)).ratio == pytest.approx(0.1) and c.why.startswith("lowered: P99")


def test_the_context_rule_needs_a_figure_and_can_be_turned_off() -> None:
    # no figure (nothing decoding, or a worker that does not report it): no judgement
    c = controller(ratio=0.3)
    assert c.decide(view(0.0, 10.0, sender_context_tokens=0.0)).ratio == pytest.approx(0.35)
    # min_context_tokens 0: short contexts raise like any others
    c = controller(ratio=0.3, adaptive=AdaptiveSpec(min_context_tokens=0))
    assert c.decide(view(0.0, 10.0, sender_context_tokens=16.0)).ratio == pytest.approx(0.35)
    # the band follows slack: 1000 / 0.5 = 2000
    c = controller(ratio=0.3, adaptive=AdaptiveSpec(min_context_tokens=1000, slack=0.5))
    assert c.decide(view(0.0, 10.0, sender_context_tokens=1999.0)).ratio == pytest.approx(0.3)
    assert c.decide(view(2.0, 10.0, sender_context_tokens=2000.0)).ratio == pytest.approx(0.35)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"min_context_tokens": -1}, AdaptiveSpec)


# ---- the planner on events, with fake workers ------------------------------------------------------------
def planned(rule: OffloadSpec) -> Callable[[], Router]:
    return lambda: Router(RouterConfig(heartbeat_timeout_s=2.0), slo={"cold": SloSpec(ttft_ms=1000, tpot_ms=50),
                                                                      "hot": SloSpec(tpot_ms=30)},
                          offload=[rule])


@pytest.fixture
async def make_router(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[[OffloadSpec], Any]]:
    monkeypatch.setattr(steer, "RESEND_AFTER_S", 0.3)
    routers: list[Router] = []

    async def make(rule: OffloadSpec) -> Router:
        r = planned(rule)()
        await r.start()
        routers.append(r)
        return r

    yield make
    for r in routers:
        await r.stop()


def reports(w: FakeWorker, **fields: Any) -> None:
    """From now on the fake's heartbeat says `fields`."""
    base = FakeWorker.load(w)
    w.load = lambda: msgspec.structs.replace(base, **fields)  # type: ignore[method-assign]


async def ratios(w: FakeWorker, n: int, timeout: float = 5.0) -> list[OffloadRatio]:
    return [await next_of(w, OffloadRatio, timeout) for _ in range(n)]


def submit(router: Router, n: int) -> None:
    entry = router.registry.models["hot"]
    for _ in range(n):
        router.submit(entry, [GenerateReq(rid=router.new_rid(), input_ids=[1, 2, 3])], [3],
                      worker=router.registry.workers["hot-0"])


async def test_adaptive_lowers_on_slo_misses_and_raises_with_slack(make_router: Any,
                                                                   ctx: zmq.asyncio.Context) -> None:
    rule = OffloadSpec(from_="hot", to="cold", policy="adaptive", ratio=0.3, max_ratio=0.4,
                       adaptive=AdaptiveSpec(interval_s=0.01))
    router = await make_router(rule)
    decided: list[OffloadDecided] = []
    router.bus.on(lambda ev: decided.append(ev), OffloadDecided)  # type: ignore[arg-type]
    fleet = Fleet(ctx, router)
    try:
        s = await fleet.sender("hot-0")
        h = await fleet.host("cold-0")
        await serve_open(h)
        d = await next_of(s, OffloadDirective)
        assert (d.policy, d.ratio, d.bound) == ("adaptive", 0.3, 0.0)
        reports(h, latency=Latency(tpot_p99_ms=80.0, tpot_samples=20))  # the host misses its 50 ms SLO
        got = [m.ratio for m in await ratios(s, 3)]
        assert got == pytest.approx([0.2, 0.1, 0.0]) and all(m.pairing == d.pairing for m in await ratios(s, 0))
        with pytest.raises(TimeoutError):  # clamped at 0: nothing more to say
            await next_of(s, OffloadRatio, timeout=0.5)
        (p,) = strategy(router, OffloadPlacement).describe()  # type: ignore[union-attr]
        assert (p["ratio"], p["bound"], p["policy"]) == (0.0, 0.4, "adaptive") and "P99 TPOT 80.0 ms" in p["why"]
        # slack on the host, but the sender has nothing to send: held at 0
        reports(h, latency=Latency(tpot_p99_ms=20.0, tpot_samples=20))
        with pytest.raises(TimeoutError):
            await next_of(s, OffloadRatio, timeout=0.5)
        submit(router, 2)  # the sender's batch grows: raised in steps up to max_ratio
        got = [m.ratio for m in await ratios(s, 8)]
        assert got == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4])
        assert [e.ratio for e in decided][-8:] == got and decided[-1].sender == "hot-0"
        text = router.metrics.render().decode()
        labels = 'executor="cold-0",model_name="hot",policy="adaptive",worker="hot-0"'
        assert f"sglang_ext:offload_ratio{{{labels}}} 0.4" in text
        assert f"sglang_ext:offload_bound{{{labels}}} 0.4" in text
        assert f"sglang_ext:offload_ratio_updates_total{{{labels}}} 11.0" in text
        # one token gap of the host's model over the SLO is no miss of it (the host's own prefills make
        # such gaps, offload or not): held at max_ratio
        router.bus.publish(SloMissed("r-y", "cold", "cold-0", "tbt", 0.2, 0.05))
        await asyncio.sleep(0.3)
        assert decided[-1].ratio == pytest.approx(0.4)
        # a request of the host's model finished over its TPOT SLO: lowered once, then raised with slack
        router.bus.publish(SloMissed("r-x", "cold", "cold-0", "tpot", 0.2, 0.05))
        assert [m.ratio for m in await ratios(s, 3)] == pytest.approx([0.3, 0.35, 0.4])
        assert "1 tpot miss(es)" in decided[-3].why
        # the sender's own decode steps over its model's TPOT SLO (30 ms): lowered; its requests' TPOT
        # (which also holds their time waiting, overload's, not the share's) plays no part
        reports(s, latency=Latency(decode_step_ms=45.0, decode_steps=300, tpot_p99_ms=10.0, tpot_samples=20))
        assert (await next_of(s, OffloadRatio)).ratio == pytest.approx(0.3)
        assert "the sender's decode step 45.0 ms > its TPOT SLO 30 ms" in decided[-1].why
        reports(s, latency=Latency(decode_step_ms=10.0, decode_steps=300, tpot_p99_ms=900.0, tpot_samples=20))
        assert (await next_of(s, OffloadRatio)).ratio == pytest.approx(0.35)
        await ratios(s, 1)  # back at max_ratio 0.4
        # a prefill worker hosting the executor (Adrenaline placement): its first tokens' TTFT is kept
        router.registry.workers["cold-0"].role = "prefill"
        reports(h, latency=Latency(tpot_p99_ms=20.0, tpot_samples=20, ttft_p99_ms=1500.0, ttft_samples=20))
        assert (await next_of(s, OffloadRatio)).ratio == pytest.approx(0.3)
        assert "P99 TTFT 1500.0 ms > SLO 1000 ms" in decided[-1].why
    finally:
        for w in fleet.workers:
            w.close()


async def test_adaptive_sends_0_while_the_senders_contexts_are_short(make_router: Any,
                                                                     ctx: zmq.asyncio.Context) -> None:
    rule = OffloadSpec(from_="hot", to="cold", policy="adaptive", ratio=0.3, max_ratio=0.4,
                       adaptive=AdaptiveSpec(interval_s=0.01))
    router = await make_router(rule)
    fleet = Fleet(ctx, router)
    try:
        s = await fleet.sender("hot-0")
        h = await fleet.host("cold-0")
        await serve_open(h)
        assert (await next_of(s, OffloadDirective)).ratio == 0.3
        reports(h, latency=Latency(tpot_p99_ms=20.0, tpot_samples=20))  # the host has slack
        submit(router, 2)  # and the sender requests to send
        reports(s, decode_context_tokens=900.0)  # but they are short
        assert (await next_of(s, OffloadRatio)).ratio == 0.0
        (p,) = strategy(router, OffloadPlacement).describe()  # type: ignore[union-attr]
        assert p["ratio"] == 0.0 and "contexts short (mean 900 tokens per decoding request" in p["why"], p
        with pytest.raises(TimeoutError):  # it stays there
            await next_of(s, OffloadRatio, timeout=0.5)
        reports(s, decode_context_tokens=6000.0)  # long contexts: raised with slack up to max_ratio
        assert [m.ratio for m in await ratios(s, 8)] == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4])
    finally:
        for w in fleet.workers:
            w.close()


async def test_adrenaline_sends_its_bound_on_reports_and_arrivals(make_router: Any,
                                                                   ctx: zmq.asyncio.Context) -> None:
    rule = OffloadSpec(from_="hot", to="cold", policy="adrenaline", executor_low_mem=0.1,
                       adrenaline=AdrenalineSpec(b_max=4, bandwidth_share=1.0))
    router = await make_router(rule)
    low: list[ExecutorMemoryLow] = []
    router.bus.on(lambda ev: low.append(ev), ExecutorMemoryLow)  # type: ignore[arg-type]
    fleet = Fleet(ctx, router)
    try:
        s = await fleet.sender("hot-0")  # its KV: 8192 tokens
        h = await fleet.host("cold-0")
        o = await serve_open(h)
        d = await next_of(s, OffloadDirective)
        assert (d.policy, d.ratio, d.bound) == ("adrenaline", 1.0, 0.0)  # no executor figures yet: OB 0
        reports(h, executor=ExecutorKV(pairing_tokens={o.pairing: 0}, free_tokens={o.pairing: 4096}))
        (m,) = await ratios(s, 1)
        assert (m.ratio, m.bound) == (1.0, 0.5)  # memory 4096 / 8192
        submit(router, 3)  # batch 3: dense 4 / 3 - 1
        (m,) = await ratios(s, 1)
        assert m.bound == pytest.approx(1 / 3)
        (p,) = strategy(router, OffloadPlacement).describe()  # type: ignore[union-attr]
        assert p["ob"] == pytest.approx(1 / 3) and p["ratio"] == pytest.approx(0.25) and "dense 0.333" in p["why"]
        # the executor fills: memory low is published once per fall
        reports(h, executor=ExecutorKV(pairing_tokens={o.pairing: 4000}, free_tokens={o.pairing: 96}))
        await until(lambda: low)
        await until(lambda: strategy(router, OffloadPlacement).describe()[0]["executor_memory_low"])  # type: ignore[union-attr]
        assert (low[0].sender, low[0].free_tokens, low[0].total_tokens) == ("hot-0", 96, 4096) and len(low) == 1
    finally:
        for w in fleet.workers:
            w.close()


async def test_a_lost_update_is_sent_again(make_router: Any, ctx: zmq.asyncio.Context) -> None:
    router = await make_router(OffloadSpec(from_="hot", to="cold", ratio=0.5))
    fleet = Fleet(ctx, router)
    try:
        s = await fleet.sender("hot-0")
        h = await fleet.host("cold-0")
        await serve_open(h)
        d = await next_of(s, OffloadDirective)
        assert d.ratio == 0.5
        # the sender applied it: nothing more is sent
        reports(s, offload=OffloadSender(pairing=d.pairing, state="active", ratio=0.5))
        with pytest.raises(TimeoutError):
            await next_of(s, OffloadRatio, timeout=0.6)
        # it says another ratio (a decision it never got): the planner's is sent again
        reports(s, offload=OffloadSender(pairing=d.pairing, state="active", ratio=0.2))
        (m,) = await ratios(s, 1)
        assert (m.pairing, m.ratio) == (d.pairing, 0.5)
    finally:
        for w in fleet.workers:
            w.close()
