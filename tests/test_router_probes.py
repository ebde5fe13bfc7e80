"""GET /health and GET /readiness in-process (httpx's ASGI transport), over a router whose registry and
placement strategies are set by hand: the launcher's workers in each supervision state, a model served
only by workers that join by themselves, a PD pair and an offload pairing in each of their states.

/health keeps SGLang's answer while all is up (200, empty) and while nothing is (503); in between it
stays 200 (something serves) and says what is away. /readiness is 200 only when every configured
worker, model and pairing is up, else 503 listing what is not. Neither needs the API key."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from _router_util import info, strategy

from router.api.app import build_app
from router.config import OffloadSpec, RouterConfig
from router.core import Router
from router.events import LoadReported, WorkerDown, WorkerUp
from router.placement.base import PlacementStrategy
from router.placement.offload import OffloadPlacement
from router.placement.pairing import Pairing
from router.placement.pd import KVPair, PDPlacement
from router.tracker import Supervision, WorkerState

KEY = "probe-key"


def cluster() -> Router:
    """The launcher's workers, all starting: model `m`'s prefill worker m-p and decode worker m-d (one KV
    pair), `hot`'s hot-0, which offloads to `cold`'s cold-0 (one offload pairing). Model `remote` is
    declared, and served only by workers that join by themselves."""
    r = Router(RouterConfig(api_key=KEY), offload=[OffloadSpec(from_="hot", to="cold", ratio=0.5)])
    for name in ("m", "hot", "cold", "remote"):
        r.registry.declare(name)
    for wid, model, role in (("m-p", "m", "prefill"), ("m-d", "m", "decode"), ("hot-0", "hot", "serve"),
                             ("cold-0", "cold", "serve")):
        r.registry.expect(wid, model, role).supervision = Supervision(started_at=1.0)
    return r


def up(r: Router, wid: str, model: str, **kw: Any) -> WorkerState:
    w, _ = r.registry.register(info(wid, model, **kw))
    return w


def all_up(r: Router) -> None:
    up(r, "m-p", "m", disaggregation_mode="prefill")
    up(r, "m-d", "m", disaggregation_mode="decode")
    up(r, "hot-0", "hot")
    up(r, "cold-0", "cold", executor_mem_bytes=1 << 30)
    up(r, "remote-x", "remote")  # joined by itself
    pd, off = strategy(r, PDPlacement), strategy(r, OffloadPlacement)
    assert pd is not None and off is not None
    pd.pairs[("m-p", "m-d")] = KVPair("m-p", "m-d", pairing="kv1", state="active")
    off.pairings["hot-0"] = Pairing("hot-0", off.rules["hot"], executor="cold-0", pairing_id="o1", state="active")


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    yield cluster()


@pytest.fixture
async def client(router: Router) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:  # no API key
        yield c


async def test_health_keeps_sglangs_answers_and_says_what_is_away(router: Router, client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("no worker is up: m-p starting")
    all_up(router)
    r = await client.get("/health")
    assert (r.status_code, r.content) == (200, b"")  # a healthy cluster: as before, as SGLang
    # a worker of the launcher's crashed: the rest serves (200), and /health says which is away
    w = router.registry.workers["hot-0"]
    w.up = False
    assert w.supervision is not None
    w.supervision.state, w.supervision.last_exit, w.supervision.restart_at = "restarting", "exited with code -9", 0.0
    w.supervision.fast_crashes = 3
    r = await client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "degraded"
    (away,) = body["workers"]
    assert (away["worker_id"], away["model"], away["role"]) == ("hot-0", "hot", "serve")
    assert away["state"] == "restarting (restart 1 in 0.0 s; it exited with code -9, 3 crashes in a row)"
    assert "hot-0 restarting" in body["message"]
    # a worker that joined by itself and left (scaled in) is no one's concern here
    w.up = True
    router.registry.workers["remote-x"].up = False
    assert (await client.get("/health")).content == b""


async def test_readiness_waits_for_every_worker_model_and_pairing(router: Router, client: httpx.AsyncClient) -> None:
    r = await client.get("/readiness")  # everything is starting
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "not ready" and body["error"]["code"] == 503
    assert {w["worker_id"]: w["state"] for w in body["workers"]} == {
        "m-p": "starting", "m-d": "starting", "hot-0": "starting", "cold-0": "starting"}
    assert {m["model"]: m["state"] for m in body["models"]} == {
        "m": "no worker is up", "hot": "no worker is up", "cold": "no worker is up", "remote": "no worker has joined"}
    assert body["pairings"] == [
        {"kind": "disaggregation", "prefill": "m-p", "decode": "m-d", "state": "not opened"},
        {"kind": "offload", "from": "hot-0", "executor": None, "to_model": "cold", "state": "not paired"}]
    assert body["checked"] == {"workers": 4, "models": 4, "pairings": 2}
    assert body["error"]["message"].startswith("not ready: worker m-p starting; ")

    all_up(router)
    r = await client.get("/readiness")
    assert r.status_code == 200 and r.json() == {"status": "ready",
                                                 "checked": {"workers": 4, "models": 4, "pairings": 2}}

    # every worker up, but the KV pair broke: not ready, and only the pair is named
    pd = strategy(router, PDPlacement)
    assert pd is not None
    pd.pairs[("m-p", "m-d")].state = "failed: m-d: no answer in 10 s"
    body = (await client.get("/readiness")).json()
    assert (body["workers"], body["models"]) == ([], [])
    assert body["pairings"] == [{"kind": "disaggregation", "prefill": "m-p", "decode": "m-d",
                                 "state": "failed: m-d: no answer in 10 s"}]
    assert "KV pair m-p -> m-d failed: m-d: no answer in 10 s" in body["error"]["message"]
    pd.pairs[("m-p", "m-d")].state = "active"

    # the offload pairing waits for its executor (the host was given up on: a bad path at its first start)
    off = strategy(router, OffloadPlacement)
    assert off is not None
    off.pairings["hot-0"].state = "detached: executor cold-0 is down"
    cold = router.registry.workers["cold-0"]
    cold.up = False
    assert cold.supervision is not None
    cold.supervision.state, cold.supervision.gave_up_detail = "gave up", "a configuration error at startup (...)"
    r = await client.get("/readiness")
    assert r.status_code == 503
    body = r.json()
    assert [(w["worker_id"], w["state"]) for w in body["workers"]] == [
        ("cold-0", "gave up: a configuration error at startup (...)")]
    assert body["models"] == [{"model": "cold", "state": "no worker is up"}]
    assert [(p["from"], p["state"]) for p in body["pairings"]] == [("hot-0", "detached: executor cold-0 is down")]

    # a worker that joined by itself and left is not waited for while its model has another one up
    off.pairings["hot-0"].state, cold.up = "active", True
    up(router, "remote-y", "remote")
    router.registry.workers["remote-x"].up = False
    assert (await client.get("/readiness")).status_code == 200


async def test_the_probes_need_no_api_key(router: Router, client: httpx.AsyncClient) -> None:
    all_up(router)
    assert (await client.get("/readiness")).status_code == 200
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/get_server_info")).status_code == 401


async def test_readiness_asks_each_strategy_through_the_interface(router: Router, client: httpx.AsyncClient) -> None:
    """Readiness knows no placement class: a strategy it never heard of is asked `expected_links` like
    the PD and offload ones, and a link of it that is not active keeps the launcher unready."""

    class Mirror(PlacementStrategy):
        info_key = "mirror"
        state = "mirroring"

        def on_worker_up(self, ev: WorkerUp) -> None: ...
        def on_worker_down(self, ev: WorkerDown) -> None: ...
        def on_load_report(self, ev: LoadReported) -> None: ...
        def describe(self) -> list[dict[str, Any]]: return []
        def close(self) -> None: ...

        def expected_links(self, configured: Sequence[WorkerState]) -> list[dict[str, Any]]:
            return [{"kind": "mirror", "from": w.worker_id, "state": self.state}
                    for w in configured if w.model == "cold"]

    all_up(router)
    mirror = Mirror()
    router.strategies.append(mirror)
    r = await client.get("/readiness")
    assert r.status_code == 503
    body = r.json()
    assert body["pairings"] == [{"kind": "mirror", "from": "cold-0", "state": "mirroring"}]
    assert body["checked"]["pairings"] == 3
    mirror.state = "active"
    assert (await client.get("/readiness")).status_code == 200
