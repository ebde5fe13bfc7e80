"""The router's side of served remote attention, without models: the cluster file's `offload:`
checks, the planner pairing fake senders with fake hosts on events (up, down, lost, refused), the
counters made monotonic from workers' cumulative figures, and strict decoding of the new messages."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from _router_util import FakeWorker, strategy, until

import router.placement.offload as planner
from router.config import ClusterSpec, ConfigError, OffloadSpec, RouterConfig, build_cluster
from router.core import Router
from router.metrics import OffloadTotals
from router.placement.offload import OffloadPlacement
from router.placement.startup import STARTUP_GRACE_S
from router.tracker import Supervision
from sglang_ext.messages import (
    ExecutorOpen,
    LoadReport,
    OffloadDirective,
    ReplyOut,
    decode_from_worker,
    decode_to_worker,
    encode,
)
from sglang_ext.messages.io import Latency, OffloadSender

GEOMETRY = {"num_layers": 4, "num_kv_heads": 4, "head_dim": 64, "num_q_heads": 8, "attn_scale": 0.125,
            "kv_dtype": "float32"}


# ---- the cluster file ------------------------------------------------------------------------------
def cluster(offload: list[dict[str, Any]], cold_args: dict[str, Any] | None = None, **hot_args: Any) -> Any:
    spec = msgspec.convert({"models": [{"name": "hot", "args": hot_args},
                                       {"name": "cold", "args": cold_args if cold_args is not None
                                        else {"executor_mem_gb": 2}},
                                       {"name": "remote-only", "replicas": 0}],
                            "offload": offload}, ClusterSpec)
    return build_cluster(spec)


def test_a_valid_offload_entry() -> None:
    c = cluster([{"from": "hot", "to": "cold", "policy": "fixed", "ratio": 0.45}])
    assert c.offload == (OffloadSpec(from_="hot", to="cold", ratio=0.45),)
    # A `to` model without local workers is checked when its workers join, not at start.
    assert cluster([{"from": "hot", "to": "remote-only", "ratio": 1.0}]).offload[0].to == "remote-only"
    # executor memory offered by one worker only is enough
    spec = msgspec.convert({"models": [{"name": "hot"}, {"name": "cold", "workers": [
        {}, {"args": {"executor_mem_gb": 1}}]}], "offload": [{"from": "hot", "to": "cold", "ratio": 0.5}]},
        ClusterSpec)
    assert build_cluster(spec).offload


@pytest.mark.parametrize(("entry", "cold_args", "hot_args", "needle"), [
    ({"from": "hott", "to": "cold", "ratio": 0.5}, None, {}, "offload[0].from: no model named 'hott'"),
    ({"from": "hot", "to": "colt", "ratio": 0.5}, None, {}, "offload[0].to: no model named 'colt'"),
    ({"from": "cold", "to": "cold", "ratio": 0.5}, None, {}, "from and to are both 'cold'"),
    ({"from": "hot", "to": "cold", "ratio": 0.5}, {}, {}, "no worker of 'cold' offers executor memory"),
    ({"from": "hot", "to": "cold", "ratio": 0.0}, None, {}, "ratio must be in (0, 1], got 0.0"),
    ({"from": "hot", "to": "cold", "ratio": 1.5}, None, {}, "ratio must be in (0, 1], got 1.5"),
    ({"from": "hot", "to": "cold", "ratio": 0.5, "policy": "weaver"}, None, {},
     "policy: 'weaver' is not one of fixed, adrenaline, adaptive"),
    ({"from": "hot", "to": "cold"}, None, {}, "offload[0].ratio: policy fixed needs a ratio"),
    ({"from": "hot", "to": "cold", "ratio": 0.5, "max_ratio": 0.8}, None, {}, "max_ratio: for policies adrenaline"),
    ({"from": "hot", "to": "cold", "ratio": 0.5, "policy": "adrenaline"}, None, {},
     "ratio: policy adrenaline derives the share from its bound; cap it with max_ratio"),
    ({"from": "hot", "to": "cold", "policy": "adrenaline", "max_ratio": 0}, None, {}, "max_ratio must be in (0, 1]"),
    ({"from": "hot", "to": "cold", "policy": "adrenaline", "adaptive": {}}, None, {},
     "offload[0].adaptive: settings of policy adaptive, but the policy is adrenaline"),
    ({"from": "hot", "to": "cold", "policy": "adaptive"}, None, {},
     "policy adaptive keeps 'cold''s P99 TPOT within its SLO: set slo: {tpot_ms: ...} on model 'cold'"),
    ({"from": "hot", "to": "cold", "ratio": 0.5}, None, {"offload_executor": "local", "offload_ratio": 0.5},
     "has an in-process executor"),
    ({"from": "hot", "to": "cold", "ratio": 0.5}, None, {"offload_transport": "local"},
     "offload_transport local is the in-process executor"),
])
def test_impossible_pairings_are_errors_at_start(entry: dict[str, Any], cold_args: dict[str, Any] | None,
                                                 hot_args: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        cluster([entry], cold_args, **hot_args)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_policies_and_their_defaults() -> None:
    from router.config import AdaptiveSpec, AdrenalineSpec

    spec = msgspec.convert({"models": [{"name": "hot"}, {"name": "cold", "args": {"executor_mem_gb": 1},
                                                         "slo": {"tpot_ms": 50}}],
                            "offload": [{"from": "hot", "to": "cold", "policy": "adaptive", "max_ratio": 0.3}]},
                           ClusterSpec)
    (o,) = build_cluster(spec).offload
    assert (o.cap, o.start, o.adaptive) == (0.3, 0.3, None)  # starts at min(0.45, max_ratio)
    assert OffloadSpec(from_="a", to="b", policy="adaptive", ratio=0.2).start == 0.2
    assert OffloadSpec(from_="a", to="b", policy="adrenaline").cap == 1.0
    assert (AdrenalineSpec().b_max, AdrenalineSpec().bandwidth_share) == (256, 0.5)
    assert AdaptiveSpec() == AdaptiveSpec(step_down=0.1, step_up=0.05, slack=0.8, interval_s=2.0)
    with pytest.raises(ConfigError, match=r"ratio must be in \(0, max_ratio 0.3\], got 0.4"):
        cluster([{"from": "hot", "to": "cold", "policy": "adaptive", "max_ratio": 0.3, "ratio": 0.4}])
    for bad in ({"b_max": 0}, {"bandwidth_share": 0}, {"bmax": 3}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"models": [{"name": "hot"}], "offload": [
                {"from": "hot", "to": "cold", "policy": "adrenaline", "adrenaline": bad}]}, ClusterSpec)


def test_offload_entries_are_strict() -> None:
    for bad in ({"from": "hot", "to": "cold", "ratio": 0.5, "ratoi": 1}, {"from": "hot", "ratio": 0.5},
                {"from": "hot", "to": "cold", "ratio": "half"}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"models": [{"name": "hot"}], "offload": [bad]}, ClusterSpec)
    with pytest.raises(ConfigError, match="already offloads"):
        cluster([{"from": "hot", "to": "cold", "ratio": 0.5}, {"from": "hot", "to": "remote-only", "ratio": 0.5}])


# ---- messages ------------------------------------------------------------------------------------------
def test_new_messages_decode_strictly() -> None:
    d = OffloadDirective(pairing="p1", executor="cold-0", store="127.0.0.1:5", ratio=0.5)
    assert decode_to_worker(encode(d)) == d
    o = ExecutorOpen(rid="r", guest="hot-0", guest_model="hot", pairing="p1", num_layers=2, num_kv_heads=2,
                     head_dim=16, page_size=4, dtype="float32", num_q_heads=4, scale=0.25, guest_device="cpu")
    assert decode_to_worker(encode(o)) == o
    raw = msgspec.msgpack.decode(encode(d))
    for bad in ({**raw, "ratioo": 1}, {**raw, "ratio": "x"}, {k: v for k, v in raw.items() if k != "pairing"}):
        with pytest.raises(msgspec.ValidationError):
            decode_to_worker(msgspec.msgpack.encode(bad))
    # a load report from a worker that predates remote attention still decodes
    old = {"type": "load", "worker_id": "w", "num_running": 0, "num_waiting": 0, "kv_used_tokens": 0,
           "kv_total_tokens": 1, "kv_cached_tokens": 0, "num_preemptions": 0, "step_time_ms": 0.0, "timestamp": 0.0}
    rep = decode_from_worker(msgspec.msgpack.encode(old))
    assert isinstance(rep, LoadReport) and rep.offload is None and rep.executor is None and rep.latency == Latency()


# ---- counters ------------------------------------------------------------------------------------------
def report(**kw: Any) -> LoadReport:
    base: dict[str, Any] = dict(worker_id="w", num_running=0, num_waiting=0, kv_used_tokens=0, kv_total_tokens=1,
                                kv_cached_tokens=0, num_preemptions=0, step_time_ms=0.0, timestamp=0.0)
    return LoadReport(**{**base, **kw})


def offloading(**kw: Any) -> LoadReport:
    """A sender's report with these figures of its offload part."""
    return report(offload=OffloadSender(**kw))


def test_counters_stay_monotonic_across_worker_restarts() -> None:
    t = OffloadTotals()
    t.observe("w", offloading(bytes_out=100, wait_s=1.5))
    t.observe("w", offloading(bytes_out=300, wait_s=2.0))
    t.restarted("w")  # its hello: a new process counts from zero
    t.observe("w", offloading(bytes_out=50, wait_s=0.5))
    assert t.total("w", "offload_bytes_out") == 350 and t.total("w", "offload_wait_s") == 2.5
    t.observe("w", offloading(bytes_out=20))  # a restart without a hello seen: the figure went down
    assert t.total("w", "offload_bytes_out") == 370
    assert t.total("other", "offload_bytes_in") == 0


# ---- the planner, with fake workers ---------------------------------------------------------------------
@pytest.fixture
async def router(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Router]:
    monkeypatch.setattr(planner, "RETRY_S", 0.2)
    r = Router(RouterConfig(heartbeat_timeout_s=0.6), offload=[OffloadSpec(from_="hot", to="cold", ratio=0.5)])
    await r.start()
    yield r
    await r.stop()


class Fleet:
    """Fake senders (model hot) and hosts (model cold, offering executor memory), closed at the end
    (an open socket would hang the context's term)."""

    def __init__(self, ctx: zmq.asyncio.Context, router: Router) -> None:
        self.ctx, self.router, self.workers = ctx, router, list[FakeWorker]()

    async def up(self, wid: str, model: str, **info: Any) -> FakeWorker:
        extra: dict[str, Any] = {"executor_mem_bytes": 1 << 30} if model == "cold" else {}
        w = FakeWorker(self.ctx, self.router.worker_addr, wid, model, **GEOMETRY, **extra, **info)
        self.workers.append(w)
        await w.hello()
        w.start_heartbeat()
        return w

    async def sender(self, wid: str) -> FakeWorker:
        return await self.up(wid, "hot")

    async def host(self, wid: str) -> FakeWorker:
        return await self.up(wid, "cold")


@pytest.fixture
async def fleet(router: Router, ctx: zmq.asyncio.Context) -> AsyncIterator[Fleet]:
    f = Fleet(ctx, router)
    yield f
    for w in f.workers:
        w.close()


async def next_of(w: FakeWorker, kind: type, timeout: float = 3.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        msg = await w.recv(max(deadline - time.monotonic(), 0.01))
        if isinstance(msg, kind):
            return msg


async def serve_open(h: FakeWorker, ok: bool = True) -> ExecutorOpen:
    o = await next_of(h, ExecutorOpen)
    data = {"store": f"127.0.0.1:{9000 + len(o.guest)}", "backend": "gloo"} if ok else {"error": "no room"}
    await h.send(ReplyOut(rid=o.rid, ok=ok, data=data))
    return o


def states(router: Router) -> dict[str, str]:
    assert strategy(router, OffloadPlacement) is not None
    return {p["from"]: p["state"] for p in strategy(router, OffloadPlacement).describe()}


async def test_pairing_on_events_and_detach_when_the_host_goes(router: Router, fleet: Fleet) -> None:
    s = await fleet.sender("hot-0")
    await until(lambda: states(router).get("hot-0", "").startswith("waiting"))  # no host yet
    h = await fleet.host("cold-0")
    o = await serve_open(h)
    assert (o.guest, o.guest_model, o.num_layers, o.num_q_heads, o.dtype) == ("hot-0", "hot", 4, 8, "float32")
    d = await next_of(s, OffloadDirective)
    assert (d.executor, d.store, d.ratio, d.detach, d.pairing) == ("cold-0", "127.0.0.1:9005", 0.5, False, o.pairing)
    await until(lambda: states(router) == {"hot-0": "active"})
    # the host falls silent: the sender detaches
    h.stop_heartbeat()
    d2 = await next_of(s, OffloadDirective)
    assert d2.detach and d2.pairing == o.pairing
    assert states(router)["hot-0"] == "detached: executor cold-0 is down"
    # it answers again (it was only slow): paired anew
    h.start_heartbeat()
    o2 = await serve_open(h)
    assert o2.pairing != o.pairing and (await next_of(s, OffloadDirective)).pairing == o2.pairing
    await until(lambda: states(router) == {"hot-0": "active"})


async def test_senders_spread_over_hosts(router: Router, fleet: Fleet) -> None:
    hosts = [await fleet.host(f"cold-{i}") for i in range(2)]
    for i in range(2):
        await fleet.sender(f"hot-{i}")
    guests = [(await serve_open(h)).guest for h in hosts]  # one each (the first would time out on a second)
    assert sorted(guests) == ["hot-0", "hot-1"]
    await until(lambda: set(states(router).values()) == {"active"})


async def test_a_refusal_or_a_lost_executor_is_tried_again(router: Router, fleet: Fleet) -> None:
    s = await fleet.sender("hot-0")
    h = await fleet.host("cold-0")
    await serve_open(h, ok=False)
    assert strategy(router, OffloadPlacement) is not None
    await until(lambda: strategy(router, OffloadPlacement).pairings["hot-0"].logged == "failed: cold-0: no room")  # type: ignore[union-attr]
    o = await serve_open(h)  # tried again on a later load report
    d = await next_of(s, OffloadDirective)
    await until(lambda: states(router)["hot-0"] == "active")
    # the sender reports that it lost that executor: paired again (on a later report)
    await s.send(msgspec.structs.replace(s.load(), offload=OffloadSender(pairing=d.pairing, state="lost")))
    o2 = await serve_open(h)
    assert o2.pairing != o.pairing
    assert (await next_of(s, OffloadDirective)).pairing == o2.pairing


async def test_a_restarted_host_pairs_its_senders_again(router: Router, fleet: Fleet) -> None:
    s = await fleet.sender("hot-0")
    h = await fleet.host("cold-0")
    o = await serve_open(h)
    await next_of(s, OffloadDirective)
    await h.hello()  # a new process under the same id: its executors are gone
    o2 = await serve_open(h)
    assert o2.pairing != o.pairing and (await next_of(s, OffloadDirective)).pairing == o2.pairing


async def test_gpus_of_one_node_pair_over_cuda_ipc(router: Router, fleet: Fleet) -> None:
    s = await fleet.up("hot-0", "hot", device="cuda:0", hostname="n1", gpu_uuid="GPU-a")
    h = await fleet.up("cold-0", "cold", device="cuda:1", hostname="n1")
    o = await next_of(h, ExecutorOpen)
    assert (o.transport, o.fallback, o.guest_gpu) == ("cuda_ipc", "torch_dist", "GPU-a")
    await h.send(ReplyOut(rid=o.rid, ok=True, data={"store": "127.0.0.1:9000", "backend": "gloo",
                                                     "transport": "cuda_ipc"}))
    assert (await next_of(s, OffloadDirective)).transport == "cuda_ipc"


async def test_gpus_of_one_node_pair_over_torch_dist_when_asked(router: Router, fleet: Fleet) -> None:
    await fleet.up("hot-0", "hot", device="cuda:0", hostname="n1", gpu_uuid="GPU-a",
                   offload_transport="torch_dist")
    h = await fleet.up("cold-0", "cold", device="cuda:1", hostname="n1")
    assert (await next_of(h, ExecutorOpen)).transport == "torch_dist"


async def test_a_forced_cuda_ipc_across_nodes_fails_at_pairing(router: Router, fleet: Fleet) -> None:
    await fleet.up("hot-0", "hot", device="cuda:0", hostname="n1", offload_transport="cuda_ipc")
    h = await fleet.up("cold-0", "cold", device="cuda:0", hostname="n2")
    await until(lambda: states(router).get("hot-0", "").startswith("failed"))
    assert states(router)["hot-0"] == ("failed: offload_transport cuda_ipc needs both workers on GPUs of one node: "
                                       "hot-0 runs on n1 and cold-0 on n2")
    with pytest.raises(TimeoutError):  # nothing was asked of the host
        await next_of(h, ExecutorOpen, timeout=0.5)


# ---- log levels while the cluster starts ----------------------------------------------------------------
def waits(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and ": waiting: " in r.getMessage()]


async def test_a_wait_for_a_host_is_quiet_while_the_cluster_starts(router: Router, fleet: Fleet,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Senders are often up before their hosts at every start: that wait is INFO, not a WARNING; once the
    startup is over and still no host came, it is logged again as a WARNING, once."""
    caplog.set_level(logging.INFO, logger="router.placement.offload")
    await fleet.sender("hot-0")
    await until(lambda: states(router).get("hot-0", "").startswith("waiting"))
    assert waits(caplog, logging.INFO) == ["offload hot-0 -> ?: waiting: no up worker of 'cold' offers executor memory"]
    await asyncio.sleep(0.5)  # tried again on each load report: still quiet, and not repeated
    assert len(waits(caplog, logging.INFO)) == 1 and waits(caplog, logging.WARNING) == []
    off = strategy(router, OffloadPlacement)
    assert off is not None
    off.quiet.born -= STARTUP_GRACE_S  # the startup is over, and no host came
    await until(lambda: len(waits(caplog, logging.WARNING)) == 1)
    await asyncio.sleep(0.5)
    assert len(waits(caplog, logging.WARNING)) == 1


async def test_a_wait_after_a_host_was_up_is_a_warning_at_once(router: Router, fleet: Fleet,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.placement.offload")
    s = await fleet.sender("hot-0")
    h = await fleet.host("cold-0")
    await serve_open(h)
    await next_of(s, OffloadDirective)
    await until(lambda: states(router) == {"hot-0": "active"})
    caplog.clear()  # (the sender may have waited at INFO before the host came: that was the startup)
    h.stop_heartbeat()  # the only host goes: well within the startup grace, but a host was up
    await until(lambda: waits(caplog, logging.WARNING) != [], timeout=5)
    assert waits(caplog, logging.INFO) == []


async def test_a_launcher_host_on_its_first_start_keeps_the_wait_quiet(router: Router) -> None:
    """Past the grace, a wait is still the startup's while one of the launcher's workers of the host model
    loads for the first time (a large model takes minutes); no longer once that worker was up or restarted."""
    off = strategy(router, OffloadPlacement)
    assert off is not None
    off.quiet.born -= STARTUP_GRACE_S
    assert off.quiet.level("cold") == logging.WARNING  # nobody is coming
    w = router.registry.expect("cold-0", "cold")
    w.supervision = Supervision(started_at=time.monotonic())
    assert off.quiet.level("cold") == logging.INFO  # loading
    w.supervision.restarts = 1
    assert off.quiet.level("cold") == logging.WARNING  # it crashed once already: no longer the startup
