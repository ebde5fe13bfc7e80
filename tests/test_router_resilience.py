"""Retries with backoff, per-worker circuit breakers and admission limits (router/resilience/).

Pure parts (the backoff, the breaker's states, the token bucket) run on a fake clock; the rest runs an
in-process Router with fake workers speaking the real protocol, behind the HTTP app (httpx's ASGI
transport): no model, no processes, each test well under a second or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio
from _router_util import FakeWorker, until

from router.api.app import build_app
from router.config import ConfigError, RouterConfig, load_cluster, router_config
from router.core import NoWorker, Router
from router.limit_spec import ApiKey, ApiKeySpec, LimitSpec, SpecError, resolve_api_keys
from router.resilience.backoff import RetryPolicy
from router.resilience.breaker import BreakerPolicy, CircuitBreaker, CircuitState
from router.resilience.limiter import Limiter, Overloaded, TokenBucket
from sglang_ext.messages import ErrorOut, GenerateReq


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---- pure parts --------------------------------------------------------------------------------------
def test_backoff_grows_exponentially_within_its_cap_and_jitter() -> None:
    p = RetryPolicy(max_retries=5, backoff_s=0.1, backoff_max_s=0.5, multiplier=2.0, jitter=0.0)
    rng = random.Random(0)
    assert [round(p.delay(n, rng), 6) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    jittered = RetryPolicy(backoff_s=1.0, backoff_max_s=1.0, jitter=0.2)
    delays = [jittered.delay(1, rng) for _ in range(500)]
    assert 0.8 <= min(delays) < 0.85 and 1.15 < max(delays) <= 1.2  # spread over ±20 %
    # Only the worker's own failures are worth another attempt; a client's error would repeat.
    assert [s for s in (400, 404, 408, 413, 429, 500, 502, 503, 504) if p.retryable(s)] == [502, 503, 504]


def test_breaker_opens_after_failures_in_a_row_then_lets_one_trial_through() -> None:
    clock = Clock()
    b = CircuitBreaker("w0", BreakerPolicy(failure_threshold=3, cooldown_s=10.0), clock)
    b.failure("x")
    b.failure("x")
    b.success()  # a success in between: the count starts again
    b.failure("x")
    b.failure("x")
    assert b.state() is CircuitState.CLOSED and b.allows()
    b.failure("boom")
    assert b.state() is CircuitState.OPEN and not b.allows() and b.retry_in() == 10.0
    assert b.describe()["state"] == "open" and b.describe()["half_open_in_s"] == 10.0
    b.failure("late")  # requests in flight when it opened: no new cool-down
    clock.t += 9.9
    assert not b.allows()
    clock.t += 0.1
    assert b.state() is CircuitState.HALF_OPEN and b.allows()
    b.dispatched("trial-1")
    assert not b.allows()  # one trial at a time
    b.ended("other")  # another request's end changes nothing
    assert not b.allows()
    b.ended("trial-1")  # aborted by its client: no verdict, the next request is the trial
    assert b.allows()
    b.dispatched("trial-2")
    b.failure("still broken")
    assert b.state() is CircuitState.OPEN and b.opened == 2 and b.retry_in() == 10.0
    clock.t += 10.0
    b.dispatched("trial-3")
    clock.t += 10.0  # a trial that never reports does not hold the worker out for ever
    assert b.allows()
    b.success()
    assert b.state() is CircuitState.CLOSED and b.allows() and b.consecutive == 0


def test_breaker_failure_rate_over_a_window() -> None:
    clock = Clock()
    b = CircuitBreaker("w0", BreakerPolicy(failure_threshold=0, failure_rate=0.5, window_s=10.0, min_requests=4,
                                           cooldown_s=5.0), clock)
    def outcomes(*oks: bool) -> None:
        for ok in oks:
            b.success() if ok else b.failure("x")

    outcomes(True, False, True)
    assert b.state() is CircuitState.CLOSED  # 3 outcomes: fewer than min_requests
    clock.t += 11.0  # they leave the window
    outcomes(True, False, True)
    assert b.state() is CircuitState.CLOSED
    outcomes(False)
    assert b.state() is CircuitState.OPEN  # (at a failure) 2 of the 4 within the window failed
    b.reset()  # a new process
    assert b.state() is CircuitState.CLOSED and b.allows()
    for _ in range(3):
        b.success(counted=False)  # first outputs: proof it serves, but one outcome per request is its end
    outcomes(False, False)
    assert b.state() is CircuitState.CLOSED  # 2 outcomes, not 5
    outcomes(False, False)
    assert b.state() is CircuitState.OPEN
    off = CircuitBreaker("w1", BreakerPolicy(failure_threshold=0), clock)
    assert not off.policy.enabled


def test_token_bucket_bursts_then_refills_at_its_rate() -> None:
    clock = Clock()
    tb = TokenBucket(rate=2.0, capacity=3, clock=clock)
    for _ in range(3):
        assert tb.ready()
        tb.take()
    assert not tb.ready() and tb.wait_for() == pytest.approx(0.5) and tb.wait_for(3) == pytest.approx(1.5)
    clock.t += 0.5
    assert tb.ready()
    clock.t += 100.0
    tb.take()
    assert tb.tokens == pytest.approx(2.0)  # capped at its capacity, then one taken


async def test_limiter_queues_in_order_and_refuses_past_the_queue_or_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    lim = Limiter("model", "m", max_concurrent=1, queue_size=2, queue_timeout_s=5.0)
    first = lim.try_acquire()
    assert first is not None and lim.try_acquire() is None
    order: list[str] = []

    async def wait(name: str) -> None:
        p = await lim.acquire(loop.time() + 5.0)
        order.append(name)
        await asyncio.sleep(0.01)
        p.release()

    tasks = [asyncio.create_task(wait(n)) for n in ("b", "c")]
    await until(lambda: len(lim.waiters) == 2)
    with pytest.raises(Overloaded) as e:
        await lim.acquire(loop.time() + 5.0)
    assert e.value.reason == "queue_full" and "model 'm'" in str(e.value) and e.value.retry_after >= 1.0
    first.release()
    await asyncio.gather(*tasks)
    assert order == ["b", "c"] and lim.active == 0 and lim.hold_s is not None
    held = lim.try_acquire()
    with pytest.raises(Overloaded) as e:
        await lim.acquire(loop.time() + 0.05)
    assert e.value.reason == "timeout" and not lim.waiters
    assert held is not None
    held.release()
    held.release()  # idempotent
    assert lim.active == 0


async def test_limiter_gives_back_the_place_of_a_waiter_that_left() -> None:
    loop = asyncio.get_running_loop()
    lim = Limiter("router", "router", max_concurrent=1, queue_size=5)
    first = lim.try_acquire()
    assert first is not None
    gone = asyncio.create_task(lim.acquire(loop.time() + 5.0))
    await until(lambda: len(lim.waiters) == 1)
    gone.cancel()  # its client left while it waited
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    assert not lim.waiters and lim.active == 1
    late = asyncio.create_task(lim.acquire(loop.time() + 5.0))
    await until(lambda: len(lim.waiters) == 1)
    first.release()  # the place goes to `late` ...
    late.cancel()  # ... which is cancelled before it runs: the place comes back
    with contextlib.suppress(asyncio.CancelledError):
        await late
    assert lim.active == 0 and lim.try_acquire() is not None


async def test_a_waiter_whose_client_left_leaves_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    import router.resilience.limiter as limiter

    monkeypatch.setattr(limiter, "_POLL_S", 0.01)
    loop = asyncio.get_running_loop()
    lim = Limiter("key", "k", max_concurrent=1, queue_size=1)
    held = lim.try_acquire()
    polls = []

    async def gone() -> bool:
        polls.append(1)
        return len(polls) >= 3

    with pytest.raises(ConnectionAbortedError):
        await lim.acquire(loop.time() + 5.0, gone)
    assert len(polls) == 3 and not lim.waiters and lim.active == 1
    assert held is not None


async def test_rate_limited_waiters_go_as_tokens_come() -> None:
    loop = asyncio.get_running_loop()
    lim = Limiter("router", "router", rate_rps=20.0, burst=1, queue_size=5)
    t0 = loop.time()
    permits = await asyncio.gather(*(lim.acquire(loop.time() + 5.0) for _ in range(3)))
    assert len(permits) == 3 and loop.time() - t0 >= 0.09  # the 2nd and 3rd waited ~50 ms each
    no_queue = Limiter("router", "router", rate_rps=0.5, queue_size=0)
    assert no_queue.try_acquire() is not None
    with pytest.raises(Overloaded) as e:
        await no_queue.acquire(loop.time() + 5.0)
    assert e.value.retry_after == pytest.approx(2.0, abs=0.05)  # exact: when the next token is due


# ---- settings ----------------------------------------------------------------------------------------
def test_defaults_keep_limits_off_and_retries_small() -> None:
    c = RouterConfig()
    assert (c.max_retries, c.cb_failure_threshold, c.max_concurrent_requests, c.rate_limit_rps) == (2, 5, None, None)


def test_flags_and_their_checks() -> None:
    from sglang_ext.launch import _cluster_from_flags, _serve_parser

    p = _serve_parser()
    r = _cluster_from_flags(p.parse_args(["--max-retries", "4", "--retry-backoff", "0.1", "--cb-failure-rate", "0.5",
                                          "--cb-cooldown", "12", "--max-concurrent-requests", "64",
                                          "--rate-limit-rps", "2.5", "--queue-size", "10", "--queue-timeout", "3"]),
                            p).router
    assert (r.max_retries, r.retry_backoff_s, r.cb_failure_rate, r.cb_cooldown_s) == (4, 0.1, 0.5, 12)
    assert (r.max_concurrent_requests, r.rate_limit_rps, r.queue_size, r.queue_timeout_s) == (64, 2.5, 10, 3)
    assert "generation requests in flight at most" in p.format_help()
    for bad in (["--max-retries", "-1"], ["--cb-failure-rate", "1.5"], ["--rate-limit-burst", "4"],
                ["--retry-backoff", "3"], ["--max-concurrent-requests", "0"]):
        with pytest.raises(SystemExit):
            _cluster_from_flags(p.parse_args(bad), p)
    with pytest.raises(ConfigError, match="rate_limit_rps"):
        router_config({"rate_limit_burst": 4})
    with pytest.raises(ConfigError, match="retry_backoff_max_s"):
        router_config({"retry_backoff_s": 5})


def test_cluster_file_limits_and_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_A_KEY", "secret-a\n")
    (tmp_path / "b.key").write_text("secret-b\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
router: {{max_concurrent_requests: 100, queue_size: 5}}
models:
  - {{name: a, limits: {{max_concurrent: 4, rate_rps: 2, queue_timeout_s: 3}}}}
  - {{name: b}}
api_keys:
  - {{key_env: TEAM_A_KEY, rate_rps: 1, burst: 3}}
  - {{name: team-b, key_file: {tmp_path / "b.key"}, max_concurrent: 2}}
""")
    c = load_cluster(cfg)
    assert c.limits == {"a": LimitSpec(max_concurrent=4, rate_rps=2, queue_timeout_s=3)}
    assert [(k.name, k.secret) for k in c.api_keys] == [("TEAM_A_KEY", "secret-a"), ("team-b", "secret-b")]
    assert c.api_keys[0].limits.bucket == 3 and c.api_keys[1].limits.max_concurrent == 2
    assert "secret" not in repr(c)  # a logged Cluster never shows a key

    def refused(text: str, match: str) -> None:
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=match) as e:
            load_cluster(cfg)
        assert "secret" not in str(e.value)

    refused("models: [{name: a, limits: {burst: 3}}]", "rate_rps")
    refused("models: [{name: a, limits: {max_concurrent: 0}}]", "max_concurrent")
    refused("models: [{name: a, limits: {max_running: 3}}]", "max_running")
    refused("models: [{name: a}]\napi_keys: [{key: secret-inline}]", "key")
    refused("models: [{name: a}]\napi_keys: [{name: x}]", r"api_keys\[0\]: give exactly one of key_env")
    refused("models: [{name: a}]\napi_keys: [{name: default, key_env: TEAM_A_KEY}]", "the router's own api_key")
    refused("models: [{name: a}]\napi_keys: [{key_env: NOPE_UNSET}]", "NOPE_UNSET is unset or empty")
    refused(f"models: [{{name: a}}]\napi_keys: [{{key_file: {tmp_path / 'missing'}}}]", "cannot read the key file")
    refused("models: [{name: a}]\napi_keys: [{key_env: TEAM_A_KEY}, {key_env: TEAM_A_KEY, name: y}]",
            r"api_keys\[1\]: the key 'y' is the same as the key 'TEAM_A_KEY'")
    refused(f"models: [{{name: a}}]\napi_keys: [{{key_env: TEAM_A_KEY, name: x}}, "
            f"{{key_file: {tmp_path / 'b.key'}, name: x}}]", "name 'x' is used twice")
    with pytest.raises(SpecError, match="empty"):
        resolve_api_keys([ApiKeySpec(key_env="E")], {"E": "  "})


# ---- in-process router ---------------------------------------------------------------------------------
@dataclass
class Setup:
    router: Router
    workers: dict[str, FakeWorker]
    client: httpx.AsyncClient

    async def add(self, worker_id: str, model: str = "m") -> FakeWorker:
        w = FakeWorker(self.ctx, self.router.worker_addr, worker_id, model)
        self.workers[worker_id] = w
        await w.hello()
        await until(lambda: worker_id in self.router.registry.workers and self.router.registry.workers[worker_id].up)
        return w

    ctx: zmq.asyncio.Context


Make = Callable[..., Any]


@pytest.fixture
async def make(ctx: zmq.asyncio.Context) -> AsyncIterator[Make]:
    """make(config, workers=("w0",), headers=None, **Router kwargs) -> Setup."""
    made: list[Setup] = []

    async def _make(cfg: RouterConfig, workers: tuple[str, ...] = ("w0",), headers: dict[str, str] | None = None,
                    **kw: Any) -> Setup:
        router = Router(cfg, **kw)
        await router.start()
        transport = httpx.ASGITransport(app=build_app(router), raise_app_exceptions=False)
        client = httpx.AsyncClient(transport=transport, base_url="http://router", timeout=10, headers=headers)
        s = Setup(router, {}, client, ctx)
        made.append(s)
        for wid in workers:
            await s.add(wid)
        return s

    yield _make
    for s in made:
        await s.client.aclose()
        for w in s.workers.values():
            w.close()
        await s.router.stop()


async def recv_gen(w: FakeWorker, timeout: float = 2.0) -> GenerateReq:
    """The next GenerateReq (aborts of earlier attempts skipped)."""
    while True:
        m = await w.recv(timeout)
        if isinstance(m, GenerateReq):
            return m


async def placed(s: Setup) -> tuple[FakeWorker, GenerateReq]:
    """The worker the (one) running request went to, and what it got."""
    await until(lambda: len(s.router.requests) == 1)
    st = next(iter(s.router.requests.values()))
    w = s.workers[st.worker.worker_id]
    return w, await recv_gen(w)


async def nothing_more(w: FakeWorker, timeout: float = 0.3) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await recv_gen(w, timeout)


def no_backoff(router: Router) -> list[int]:
    """Retries without waiting; returns the attempts' numbers as they are scheduled."""
    attempts: list[int] = []
    router.resilience.backoff = lambda n: attempts.append(n) or 0.0  # type: ignore[method-assign]
    return attempts


GEN = {"model": "m", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


async def test_a_worker_error_before_any_output_is_retried_on_another_worker(make: Make) -> None:
    s = await make(RouterConfig(), workers=("w0",))
    attempts = no_backoff(s.router)
    task = asyncio.create_task(s.client.post("/generate", json=GEN))
    g = await recv_gen(s.workers["w0"])
    w1 = await s.add("w1")
    await s.workers["w0"].send(ErrorOut(rid=g.rid, message="CUDA error: an illegal memory access", status=503))
    g1 = await recv_gen(w1)  # away from the worker that failed it
    assert g1.rid == g.rid + "+retry1" and attempts == [1]
    await w1.token(g1.rid, [7, 8], finished=True)
    r = await task
    assert r.status_code == 200 and r.json()["output_ids"] == [7, 8]
    assert 'sglang_ext:request_retries_total{model_name="m"} 1.0' in (await s.client.get("/metrics")).text


@pytest.mark.parametrize("status", [400, 500])
async def test_client_errors_and_500s_are_not_retried(make: Make, status: int) -> None:
    s = await make(RouterConfig(), workers=("w0", "w1"))
    no_backoff(s.router)
    task = asyncio.create_task(s.client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}))
    w, g = await placed(s)
    await w.send(ErrorOut(rid=g.rid, message="bad input", status=status))
    r = await task
    assert r.status_code == status and r.json()["error"]["message"] == "bad input"
    for other in s.workers.values():
        await nothing_more(other)


async def test_retries_stop_at_max_retries_with_the_last_error(make: Make) -> None:
    s = await make(RouterConfig(max_retries=2, cb_failure_threshold=0), workers=("w0",))
    attempts = no_backoff(s.router)
    task = asyncio.create_task(s.client.post("/generate", json=GEN))
    rids = []
    for i in range(3):  # the first attempt and two retries, all on the only worker ("the same after backoff")
        g = await recv_gen(s.workers["w0"])
        rids.append(g.rid)
        await s.workers["w0"].send(ErrorOut(rid=g.rid, message=f"failed {i}", status=503))
    r = await task
    assert r.status_code == 503 and r.json()["error"]["message"] == "failed 2"
    assert [x.rsplit("+", 1)[-1] for x in rids[1:]] == ["retry1", "retry2"] and attempts == [1, 2]
    await nothing_more(s.workers["w0"])


async def test_retries_wait_their_backoff(make: Make) -> None:
    s = await make(RouterConfig(retry_backoff_s=0.3, retry_jitter=0.0), workers=("w0", "w1"))
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(s.client.post("/generate", json=GEN))
    w, g = await placed(s)
    other = s.workers["w1" if w.id == "w0" else "w0"]
    t0 = loop.time()
    await w.send(ErrorOut(rid=g.rid, message="gone", status=503))
    g1 = await recv_gen(other)
    assert loop.time() - t0 >= 0.28 and g1.rid.endswith("+retry1")
    await other.token(g1.rid, [1], finished=True)
    assert (await task).status_code == 200


async def test_a_worker_lost_mid_generation_restarts_a_non_streaming_request_but_never_a_stream(
        make: Make) -> None:
    """Non-streaming: the client has seen nothing, so the partial output is dropped and the request starts
    over on another worker; the response is the second attempt's alone. Streaming: the first tokens went
    out, so the stream ends with an explicit error instead."""
    s = await make(RouterConfig(heartbeat_timeout_s=0.6), workers=("w0",))
    no_backoff(s.router)
    w0 = s.workers["w0"]
    task = asyncio.create_task(s.client.post("/generate", json=GEN))
    g = await recv_gen(w0)
    w1 = await s.add("w1")
    await w0.token(g.rid, [5])  # collected by the handler, not sent: a non-streaming response is whole
    await until(lambda: s.router.requests[g.rid].delivered)
    w1.start_heartbeat()
    s.router.mark_down(s.router.registry.workers["w0"], "test: its process exited")
    g1 = await recv_gen(w1)
    await w1.token(g1.rid, [7, 8], finished=True)
    r = await task
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == [7, 8] and body["text"] == "x" and g1.rid == g.rid + "+retry1"

    stream = asyncio.create_task(s.client.post("/generate", json={**GEN, "stream": True}))
    g2 = await recv_gen(w1)
    await w1.token(g2.rid, [5])
    await until(lambda: s.router.requests[g2.rid].delivered)
    w0.start_heartbeat()  # w0 answers again: it could take a retry, but a stream has started
    await until(lambda: s.router.registry.workers["w0"].up)
    w1.stop_heartbeat()
    r = await stream
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and '"output_ids":[5]' in events[0]
    assert '"code":503' in events[-2] and "w1" in events[-2] and events[-1] == "[DONE]"
    await nothing_more(w0)


async def test_retries_off_fail_a_lost_request_with_503(make: Make) -> None:
    s = await make(RouterConfig(max_retries=0), workers=("w0",))
    task = asyncio.create_task(s.client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
    await recv_gen(s.workers["w0"])
    await s.workers["w0"].hello()  # a new process under the same id: the request is lost
    r = await task
    assert r.status_code == 503 and "w0 restarted; the request was lost" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "service_unavailable"


async def test_circuit_breaker_takes_a_failing_worker_out_until_a_trial_succeeds(make: Make) -> None:
    clock = Clock()
    s = await make(RouterConfig(max_retries=0, cb_failure_threshold=2, cb_cooldown_s=10.0), workers=())
    s.router.resilience.breakers.clock = clock  # before any breaker is made
    w0 = await s.add("w0")
    await s.add("w1")
    m = s.router.registry.models["m"]
    for i in range(2):
        task = asyncio.create_task(s.client.post("/generate", json=GEN))
        w0_state = s.router.registry.workers["w0"]
        # force the first worker, as a balancer would while it looks the least loaded
        w0_state.outstanding_tokens, s.router.registry.workers["w1"].outstanding_tokens = 0, 10_000
        g = await recv_gen(w0)
        await w0.send(ErrorOut(rid=g.rid, message=f"pair gone {i}", status=503))
        assert (await task).status_code == 503
    s.router.registry.workers["w1"].outstanding_tokens = 0
    assert {s.router.pick(m).worker_id for _ in range(5)} == {"w1"}  # open: never routed to
    text = (await s.client.get("/metrics")).text
    assert 'sglang_ext:worker_circuit_state{model_name="m",worker="w0"} 1.0' in text
    assert 'sglang_ext:worker_circuit_state{model_name="m",worker="w1"} 0.0' in text
    assert 'sglang_ext:worker_circuit_opened_total{model_name="m",worker="w0"} 1.0' in text
    info = (await s.client.get("/get_server_info")).json()
    circuit = {w["worker_id"]: w["circuit"] for w in info["models"]["m"]["workers"]}
    assert circuit["w0"]["state"] == "open" and circuit["w0"]["half_open_in_s"] == 10.0
    assert "pair gone 1" in circuit["w0"]["last_failure"] and circuit["w1"]["state"] == "closed"

    # Every up worker open: 503 with Retry-After (when the first lets a trial through).
    s.router.resilience.breakers.get("w1").failure("x")
    s.router.resilience.breakers.get("w1").failure("x")
    clock.t += 4.0
    with pytest.raises(NoWorker):
        s.router.place(m)
    r = await s.client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and r.headers["retry-after"] == "6"
    assert "held out by its circuit breaker after repeated failures (w0 open, w1 open)" in r.json()["error"]["message"]

    clock.t += 6.0  # both half-open: one trial each
    assert 'worker="w0"} 2.0' in (await s.client.get("/metrics")).text
    task = asyncio.create_task(s.client.post("/generate", json=GEN))
    w, trial = await placed(s)
    on = w.id
    assert s.router.pick(m).worker_id != on  # its trial is in flight: nothing else goes there
    await w.token(trial.rid, [3], finished=True)
    assert (await task).status_code == 200
    assert s.router.resilience.breakers.state(on) is CircuitState.CLOSED


async def test_a_new_process_starts_with_its_circuit_closed(make: Make) -> None:
    s = await make(RouterConfig(cb_failure_threshold=1), workers=("w0",))
    s.router.resilience.breakers.failure("w0", "boom")
    assert not s.router.resilience.breakers.allows("w0")
    await s.workers["w0"].hello()
    await until(lambda: s.router.resilience.breakers.allows("w0"))


async def answer(w: FakeWorker, release: asyncio.Event | None = None) -> None:
    """Answer every request with one token once `release` is set (at once without one)."""
    while True:
        g = await recv_gen(w, timeout=30)
        if release is not None:
            await release.wait()
        await w.token(g.rid, [1], finished=True)


def limiter_gauge(text: str, kind: str, limit: str, name: str) -> float:
    prefix = f'sglang_ext:admission_{kind}_reqs{{limit="{limit}",name="{name}"}} '
    line = next(x for x in text.splitlines() if x.startswith(prefix))
    return float(line[len(prefix):])


async def test_router_wide_limit_queues_then_refuses_with_429(make: Make) -> None:
    s = await make(RouterConfig(max_concurrent_requests=1, queue_size=1, queue_timeout_s=0.5))
    held = asyncio.create_task(s.client.post("/generate", json=GEN))
    g = await recv_gen(s.workers["w0"])
    queued = asyncio.create_task(s.client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}))
    await until(lambda: s.router.resilience.admission.router is not None
                and len(s.router.resilience.admission.router.waiters) == 1)
    text = (await s.client.get("/metrics")).text
    assert limiter_gauge(text, "active", "router", "router") == 1.0
    assert limiter_gauge(text, "queue", "router", "router") == 1.0

    r = await s.client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "rate_limit_exceeded", None)
    assert "the router-wide limit (1 request at once)" in err["message"] and "queue_size 1" in err["message"]
    r = await s.client.post("/generate", json=GEN)
    assert r.status_code == 429 and r.json() == {"error": {"message": r.json()["error"]["message"], "code": 429}}

    await s.workers["w0"].token(g.rid, [1], finished=True)  # the held one ends: the queued one goes
    assert (await held).status_code == 200
    g2 = await recv_gen(s.workers["w0"])
    await s.workers["w0"].token(g2.rid, [1], finished=True)
    assert (await queued).status_code == 200

    held = asyncio.create_task(s.client.post("/generate", json=GEN))
    g = await recv_gen(s.workers["w0"])
    r = await s.client.post("/generate", json=GEN)  # waits 0.5 s in the queue, then gives up
    assert r.status_code == 429 and "it waited 0.5 s (queue_timeout_s)" in r.json()["error"]["message"]
    await s.workers["w0"].token(g.rid, [1], finished=True)
    assert (await held).status_code == 200
    text = (await s.client.get("/metrics")).text
    assert 'sglang_ext:admission_rejected_total{limit="router",name="router",reason="queue_full"} 2.0' in text
    assert 'sglang_ext:admission_rejected_total{limit="router",name="router",reason="timeout"} 1.0' in text
    assert limiter_gauge(text, "active", "router", "router") == 0.0  # every place given back
    assert limiter_gauge(text, "queue", "router", "router") == 0.0
    # Health probes are not limited.
    release = asyncio.Event()
    answering = asyncio.create_task(answer(s.workers["w0"], release))
    try:
        held = asyncio.create_task(s.client.post("/generate", json=GEN))
        await until(lambda: s.router.resilience.admission.router.active == 1)  # type: ignore[union-attr]
        probe = asyncio.create_task(s.client.get("/health_generate"))
        await asyncio.sleep(0.05)
        release.set()
        assert (await probe).status_code == 200 and (await held).status_code == 200
    finally:
        answering.cancel()


async def test_a_streamed_response_holds_its_place_until_it_ends(make: Make) -> None:
    s = await make(RouterConfig(max_concurrent_requests=1, queue_size=0))
    task = asyncio.create_task(s.client.post("/generate", json={**GEN, "stream": True}))
    g = await recv_gen(s.workers["w0"])
    await s.workers["w0"].token(g.rid, [1])
    await asyncio.sleep(0.05)
    assert (await s.client.post("/generate", json=GEN)).status_code == 429  # streaming: still held
    await s.workers["w0"].token(g.rid, [2], finished=True)
    assert (await task).status_code == 200
    assert s.router.resilience.admission.router.active == 0  # type: ignore[union-attr]


async def test_per_model_limits(make: Make) -> None:
    s = await make(RouterConfig(), limits={"m": LimitSpec(max_concurrent=1, queue_size=0)})
    other = await s.add("p0", "plain")
    held = asyncio.create_task(s.client.post("/generate", json=GEN))
    g = await recv_gen(s.workers["w0"])
    r = await s.client.post("/generate", json=GEN)
    assert r.status_code == 429 and "the limit of model 'm' (1 request at once)" in r.json()["error"]["message"]
    plain = asyncio.create_task(s.client.post("/generate", json={**GEN, "model": "plain"}))  # not limited
    gp = await recv_gen(other)
    await other.token(gp.rid, [1], finished=True)
    assert (await plain).status_code == 200
    await s.workers["w0"].token(g.rid, [1], finished=True)
    assert (await held).status_code == 200


async def test_per_key_limits(make: Make) -> None:
    keys = [ApiKey("batch", "key-batch", LimitSpec(max_concurrent=1, queue_size=0)), ApiKey("web", "key-web")]
    s = await make(RouterConfig(api_key="key-primary"), api_keys=keys)
    w0 = s.workers["w0"]

    def post(key: str, body: dict[str, Any] = GEN) -> asyncio.Task[httpx.Response]:
        return asyncio.create_task(s.client.post("/generate", json=body, headers={"Authorization": f"Bearer {key}"}))

    held = post("key-batch")
    g = await recv_gen(w0)
    r = await post("key-batch")
    assert r.status_code == 429 and "the limit of key 'batch' (1 request at once)" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"
    for key in ("key-web", "key-primary"):  # other keys: their own limits (none here)
        t = post(key)
        gk = await recv_gen(w0)
        await w0.token(gk.rid, [1], finished=True)
        assert (await t).status_code == 200
    assert (await post("key-wrong")).status_code == 401
    await w0.token(g.rid, [1], finished=True)
    assert (await held).status_code == 200
    auth = {"Authorization": "Bearer key-web"}
    text = (await s.client.get("/metrics", headers=auth)).text
    assert 'sglang_ext:admission_rejected_total{limit="key",name="batch",reason="queue_full"} 1.0' in text
    info = (await s.client.get("/get_server_info", headers=auth)).text
    assert "key-batch" not in text + info and '"api_key_required":true' in info


async def test_rate_limit_says_when_to_come_back(make: Make) -> None:
    s = await make(RouterConfig(rate_limit_rps=0.5, queue_size=0))
    answering = asyncio.create_task(answer(s.workers["w0"]))
    try:
        assert (await s.client.post("/generate", json=GEN)).status_code == 200
        r = await s.client.post("/generate", json=GEN)
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert "0.5 requests/s" in r.json()["error"]["message"]
    finally:
        answering.cancel()



class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_retry_after_follows_what_holds_the_places() -> None:
    # A batch of 8 took every place of key 'batch' together; places were held 3 s each so far. 0.4 s
    # in, the next place is free in ~2.6 s (the mean over the places said 3 * 1/8 = 0.4 s: "1 s").
    loop = asyncio.get_running_loop()
    clock = _Clock()
    lim = Limiter("key", "batch", max_concurrent=8, queue_size=0, clock=clock)
    first = [lim.try_acquire() for _ in range(8)]
    clock.t += 3.0
    for p in first:
        assert p is not None
        p.release()
    assert lim.hold_s == pytest.approx(3.0) and not lim.holders
    batch = [lim.try_acquire() for _ in range(8)]
    clock.t += 0.4
    with pytest.raises(Overloaded) as e:
        await lim.acquire(clock() + 5.0)
    assert e.value.retry_after == pytest.approx(2.6)
    assert str(e.value) == ("the limit of key 'batch' (8 requests at once) is reached and no queue (queue_size 0); "
                            "try again in 3 s")
    # Holders that started apart: the soonest release is the oldest one's.
    p = batch[0]
    assert p is not None
    p.release()
    clock.t += 1.0
    assert lim.try_acquire() is not None  # a newer holder, 1 s behind the others
    assert lim.hold_s is not None and lim.hold_s < 3.0  # (the early release counted in the mean)
    assert lim.retry_after() == pytest.approx(lim.hold_s - 1.4)
    # With requests queued ahead: the k-th release, past the 8 places the second time round.
    queued = Limiter("model", "m", max_concurrent=2, queue_size=10, clock=clock)
    held = [queued.try_acquire(), queued.try_acquire()]
    clock.t += 2.0
    for h in held:
        assert h is not None
        h.release()  # mean hold 2 s
    a, b = queued.try_acquire(), queued.try_acquire()
    clock.t += 0.5
    assert a is not None and b is not None
    waiters = [asyncio.create_task(queued.acquire(loop.time() + 60)) for _ in range(3)]
    await until(lambda: len(queued.waiters) == 3)
    # ahead of a new request: 3 waiters; releases due at 1.5, 1.5 (the holders), then 3.5, 3.5 (the
    # first two waiters' holds), so the 4th release, ours, is at 3.5
    assert queued.retry_after() == pytest.approx(3.5)
    for t in waiters:
        t.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


def test_retry_after_before_any_place_came_back() -> None:
    clock = _Clock()
    lim = Limiter("router", "router", max_concurrent=1, clock=clock)
    assert lim.try_acquire() is not None
    clock.t += 0.25
    assert lim.retry_after() == pytest.approx(0.75)  # the first guess: 1 s
    clock.t += 2.25
    assert lim.retry_after() == pytest.approx(2.5)  # running 2.5 s: as long again
