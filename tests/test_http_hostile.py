"""Hostile clients against the HTTP edge, over real sockets to an in-process server (the router's own
uvicorn config and protocol, in a thread; no worker process): deeply nested JSON, bodies too large
for the limit sent by clients that read the answer only after sending, huge bad inputs, connection
floods from one address, and the request counter seeing every answer."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
import uvicorn
import uvloop
import zmq.asyncio
from _router_util import FakeWorker, until

from router.api.app import build_app
from router.api.json_body import MAX_DEPTH, exceeds_depth
from router.config import RouterConfig
from router.core import Router
from router.http_guard import GuardedH11Protocol
from router.http_peers import RefusalLog
from router.server import bind_http, uvicorn_config
from sglang_ext.messages import GenerateReq

LIMIT_MB, MAX_CONN, PER_CLIENT, BODY_S = 1, 40, 6, 1.0
GUARD_LOG = "router.http_guard"


class LiveServer:
    """The router's HTTP server on a free port, run by its own event loop in a thread."""

    def __init__(self, cfg: RouterConfig, models: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self.models = models
        self.sock = bind_http("127.0.0.1", 0)
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._up = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.server: uvicorn.Server | None = None

    def _run(self) -> None:
        uvloop.run(self._main())

    async def _main(self) -> None:
        router = Router(self.cfg)
        await router.start()
        for name in self.models:  # served, with no worker up: requests get as far as placement
            router.registry.declare(name)
        self.server = uvicorn.Server(uvicorn_config(router, 1 << 20))
        task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        self._up.set()
        try:
            await task
        finally:
            await router.stop()

    def __enter__(self) -> LiveServer:
        self._thread.start()
        assert self._up.wait(30), "server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.should_exit = True
        self._thread.join(15)
        self.sock.close()

    @property
    def protocol(self) -> type[GuardedH11Protocol]:
        assert self.server is not None
        cls = self.server.config.http
        assert isinstance(cls, type) and issubclass(cls, GuardedH11Protocol)
        return cls

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST as urllib does: the whole body first, then the answer."""
        req = urllib.request.Request(self.url + path, data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return int(r.status), r.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return int(r.status), r.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def open_connections(self) -> int:
        assert self.server is not None
        return len(self.server.server_state.connections)

    def settled_connections(self) -> int:
        """Open connections once those of earlier tests are gone."""
        deadline = time.monotonic() + 15
        while (n := self.open_connections()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return n

    def requests_total(self) -> dict[tuple[str, str], float]:
        """sglang:num_requests_total by (model_name, status)."""
        text = self.get("/metrics")[1].decode()
        out = {}
        for m in re.finditer(r'^sglang:num_requests_total\{model_name="([^"]*)",status="([^"]*)"\} (\S+)$', text,
                             re.MULTILINE):
            out[(m[1], m[2])] = float(m[3])
        return out


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    cfg = RouterConfig(max_request_mb=LIMIT_MB, max_connections=MAX_CONN, max_connections_per_client=PER_CLIENT,
                       header_timeout_s=3.0, body_timeout_s=BODY_S)
    with LiveServer(cfg, models=("m",)) as srv:
        yield srv


def connect(server: LiveServer, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source`: any 127.x.y.z is this host, as a different client address."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", server.port))
    return s


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):  # a reset raises here: the test fails on it
        out += chunk
    return out


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def text_of(depth: int) -> bytes:
    return b'{"text": ' + nested(depth).encode() + b"}"


def error_message(raw: bytes) -> str:
    return str(json.loads(raw)["error"]["message"])


# ---- 1. nesting depth ---------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "template"), [
    ("/generate", '{"text": %s}'),
    ("/generate", '{"text": "x", "sampling_params": {"json_schema": %s}}'),
    ("/v1/completions", '{"model": "m", "prompt": %s}'),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                             '"response_format": {"type": "json_schema", "json_schema": {"schema": {"a": %s}}}}'),
])
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 600, 50_000])
def test_deep_json_is_a_400(server: LiveServer, path: str, template: str, depth: int) -> None:
    status, body = server.post(path, (template % nested(depth)).encode())
    assert status == 400, body[:300]
    assert "nested too deeply" in error_message(body) and str(MAX_DEPTH) in error_message(body)


def test_nesting_within_the_limit_is_judged_as_usual(server: LiveServer) -> None:
    status, body = server.post("/generate", text_of(MAX_DEPTH - 2))
    assert status == 400 and "nested too deeply" not in error_message(body)  # a type error, named as before


def test_depth_scan_ignores_brackets_in_strings() -> None:
    assert not exceeds_depth(json.dumps({"a": "[" * 500, "b": ["]]]{{{\"\\"]}).encode(), 2)
    assert exceeds_depth(json.dumps({"a": [["x"]]}).encode(), 2)
    assert not exceeds_depth(json.dumps([[]] * 1000).encode(), 2)
    chain = json.dumps({"k": nested(5)[:5] + "\\" + nested(5)[5:]})  # escapes and brackets in one string
    assert not exceeds_depth(chain.encode(), 1)


# ---- 2. a 413 that clients read -------------------------------------------------------------------

def test_413_reaches_a_client_that_sends_its_whole_body_first(server: LiveServer) -> None:
    big = b'{"text": "' + b"x" * (12 << 20) + b'"}'  # 12 MiB against 1 MiB: still sending at the 413
    for _ in range(3):  # was a "connection reset" (most runs); must never be one
        status, body = server.post("/generate", big)
        assert status == 413 and "--max-request-mb" in error_message(body)


def test_413_then_the_rest_of_the_body_is_drained_not_reset(server: LiveServer) -> None:
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 8388608\r\n\r\n")
        for _ in range(64):  # all 8 MiB, in pieces, before reading anything
            s.sendall(b"y" * (128 << 10))
        raw = read_until_closed(s)
    assert status_of(raw) == 413 and b"connection: close" in raw.lower()


def test_lingering_is_bounded(server: LiveServer) -> None:
    # A client that announces a huge body, sends a little, then neither sends more nor closes: it gets
    # its 413 at once, and the server lets go of the connection after the idle bound.
    lim = server.protocol.limits
    before = server.settled_connections()
    with connect(server) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 104857600\r\n\r\n" + b"z" * 1000)
        t0 = time.monotonic()
        assert status_of(read_until_closed(s)) == 413  # the answer, then end of stream (a half-close)
        assert server.open_connections() == before + 1  # still read from
        while server.open_connections() > before:
            assert time.monotonic() - t0 < lim.linger_idle_s + 3, "lingered past its bound"
            time.sleep(0.05)
    assert time.monotonic() - t0 > lim.linger_idle_s - 0.5


# ---- 3. error messages don't echo huge inputs -----------------------------------------------------

@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"model": "q" * 900_000, "text": "hi"}),  # unknown model: its name is quoted
    ("/v1/chat/completions", {"model": "q" * 900_000, "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "w" * 900_000, "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "t" * 900_000}}),
])
def test_error_bodies_clip_echoed_input(server: LiveServer, path: str, body: dict[str, object]) -> None:
    status, raw = server.post(path, json.dumps(body).encode())
    assert 400 <= status < 500 and len(raw) < 2000, (status, len(raw))
    msg = error_message(raw)
    assert "... (900000 characters)" in msg


def test_long_paths_are_clipped_in_404s(server: LiveServer) -> None:
    status, raw = server.get("/" + "p" * 8000)
    assert status == 404 and len(raw) < 1000 and "(8001 characters)" in error_message(raw)


def test_messages_are_capped_whatever_quotes_input() -> None:
    from router.api.common import error_body
    from router.errors import MAX_MESSAGE_CHARS, ApiError

    e = ApiError(400, "library says: " + "v" * 100_000)
    assert len(e.message) < MAX_MESSAGE_CHARS + 40 and e.message.endswith("(100014 characters)")
    assert len(error_body("/v1/x", 500, "w" * 50_000)) < MAX_MESSAGE_CHARS + 200


# ---- 4. every answer counted ----------------------------------------------------------------------

def grew(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def test_router_answers_are_counted_by_status(server: LiveServer) -> None:
    before = server.requests_total()
    assert server.post("/generate", b'{"text": ')[0] == 400  # malformed
    assert server.post("/generate", text_of(5000))[0] == 400  # too deep (was a 500)
    assert server.post("/v1/completions", b'{"prompt": 7}')[0] == 400  # wrong type
    assert server.post("/generate", b'{"text": "x"}')[0] == 503  # no worker up: refused before the core
    assert server.get("/nowhere")[0] == 404
    assert server.post("/generate", b"x" * (2 << 20))[0] == 413
    assert server.get("/metrics")[0] == 200  # a scrape is no request to serve: not counted
    assert grew(before, server.requests_total()) == {("", "400"): 3, ("m", "503"): 1, ("", "404"): 1,
                                                       ("", "413"): 1}


def test_body_timeout_and_unparsable_requests_are_counted_once(server: LiveServer) -> None:
    before = server.requests_total()
    with connect(server) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")  # then nothing
        assert status_of(read_until_closed(s)) == 408
    with connect(server) as s:
        s.sendall(b"GARBAGE\r\n\r\n")
        assert status_of(read_until_closed(s)) == 400
    time.sleep(0.2)  # the app's own end of the timed-out request (it sees a disconnect)
    assert grew(before, server.requests_total()) == {("", "408"): 1, ("", "400"): 1}


# ---- 5. one client cannot hold every connection -----------------------------------------------------

def test_per_client_cap_leaves_room_for_others(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    server.settled_connections()
    before = server.requests_total()
    held = [connect(server) for _ in range(PER_CLIENT)]  # half-open: never a byte
    try:
        time.sleep(0.2)
        with connect(server) as extra:
            raw = read_until_closed(extra)
        assert status_of(raw) == 429 and "from your address" in raw.decode()
        with connect(server, "127.0.0.2") as other:  # another client is served meanwhile
            other.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert status_of(read_until_closed(other)) == 200
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert server.get("/metrics")[0] == 200  # the first client again, once it let go
    assert grew(before, server.requests_total()) == {("", "429"): 1}


def test_a_refused_client_reads_its_429(server: LiveServer) -> None:
    """The 429 is sent whole and the connection closed gracefully (as the 413's): a client that sends its
    request after the refusal was written, as every client does, still reads the answer, never a reset
    or a broken pipe, every time."""
    server.settled_connections()
    held = [connect(server, "127.0.3.1") for _ in range(PER_CLIENT)]
    body = b'{"text": "' + b"x" * 200_000 + b'"}'
    request = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    try:
        time.sleep(0.2)
        for i in range(10):
            with connect(server, "127.0.3.1") as s:
                time.sleep(0.05 if i % 2 else 0.0)  # the refusal is (or may not yet be) written and closed
                s.sendall(request)
                raw = read_until_closed(s)
            assert status_of(raw) == 429 and b"from your address" in raw, raw[:200]
        # urllib, as a client library reads it: an HTTPError 429 with its body, not a URLError
        for _ in range(5):
            req = urllib.request.Request(server.url + "/generate", data=body)
            with pytest.raises(urllib.error.HTTPError) as e:
                _urlopen_from(req, "127.0.3.1")
            assert e.value.code == 429 and b"from your address" in e.value.read()
        guard = server.protocol.guard
        deadline = time.monotonic() + 10
        while guard.lingering_refusals and time.monotonic() < deadline:  # each closed when its client did
            time.sleep(0.05)
        assert guard.lingering_refusals == 0
    finally:
        for s in held:
            s.close()


def _urlopen_from(req: urllib.request.Request, source: str) -> None:
    """urlopen with the connection bound to `source` (another client address)."""
    import http.client

    class Conn(http.client.HTTPConnection):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, source_address=(source, 0), **kw)  # type: ignore[arg-type]

    class Handler(urllib.request.HTTPHandler):
        def http_open(self, r: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(Conn, r)

    urllib.request.build_opener(Handler).open(req, timeout=30).close()


def test_refusals_are_logged_as_summaries(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, GUARD_LOG)
    server.settled_connections()
    refusals = server.protocol.guard.refusals = RefusalLog(logging.getLogger(GUARD_LOG), interval_s=1.0)
    # Fill the whole budget from several addresses (each under its own cap), then flood from another.
    held = [connect(server, f"127.0.1.{i // PER_CLIENT}") for i in range(MAX_CONN)]
    try:
        time.sleep(0.3)
        for _ in range(150):
            with connect(server, "127.0.2.1") as s:
                assert status_of(read_until_closed(s)) == 503
        time.sleep(refusals.interval_s + 1)
    finally:
        for s in held:
            s.close()
    lines = [r.getMessage() for r in caplog.records if r.name == GUARD_LOG and "refus" in r.getMessage()]
    assert 1 <= len(lines) <= 3, lines  # was 150 lines
    assert any("149 more" in line and "127.0.2.1 (149)" in line for line in lines), lines
    time.sleep(0.3)
    assert server.get("/metrics")[0] == 200


async def test_core_counted_requests_are_not_counted_again(ctx: zmq.asyncio.Context,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # In process, with a fake worker: requests the core finished are counted by it, once; those that
    # fail before it (a bug's 500, a prompt over the context) by the edge, with their model.
    router = Router(RouterConfig())
    await router.start()
    w = FakeWorker(ctx, router.worker_addr, "w0", "m", context_length=64, max_token_chars=4)
    await w.hello()
    await until(lambda: any(x.up for x in router.registry.workers.values()))
    transport = httpx.ASGITransport(app=build_app(router), raise_app_exceptions=False)
    client = httpx.AsyncClient(transport=transport, base_url="http://router", timeout=10)

    def counts() -> dict[tuple[str, str], float]:
        return {(s.labels["model_name"], s.labels["status"]): s.value
                for metric in router.metrics.registry.collect() if metric.name == "sglang:num_requests"
                for s in metric.samples if s.name.endswith("_total")}

    async def answered(body: dict[str, object], worker_does: Callable[[str], Awaitable[None]]) -> int:
        task = asyncio.create_task(client.post("/v1/completions", json=body))
        got = await w.recv()
        assert isinstance(got, GenerateReq)
        await worker_does(got.rid)
        return (await task).status_code

    try:
        before = counts()
        assert await answered({"model": "m", "prompt": "x", "max_tokens": 1},
                              lambda rid: w.token(rid, [5], finished=True)) == 200

        async def worker_dies(rid: str) -> None:
            router.mark_down(router.registry.workers["w0"], "test")

        assert await answered({"model": "m", "prompt": "x", "max_tokens": 1}, worker_dies) == 503
        await w.hello()
        await until(lambda: router.registry.workers["w0"].up)
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "y" * 1000})).status_code == 400

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("bug in the balancer")

        monkeypatch.setattr(router, "place", broken)
        one = {"model": "m", "text": "x", "sampling_params": {"max_new_tokens": 1}}
        assert (await client.post("/generate", json=one)).status_code == 500
        assert grew(before, counts()) == {("m", "ok"): 1, ("m", "503"): 1, ("m", "400"): 1, ("m", "500"): 1}
    finally:
        await client.aclose()
        w.close()
        await router.stop()
