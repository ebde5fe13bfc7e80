"""Hostile clients against a real launcher, over raw sockets: oversized bodies, dribbled headers and
bodies, idle and surplus connections, uploads cut short. Each is refused or closed in bounded time
while normal requests keep being served. The server runs with small limits so the tests are quick."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from _router_util import SMALL, Server, serve

HEADER_S, BODY_S, KEEP_ALIVE_S, MAX_CONN = 1.5, 2.0, 1.0, 12
GEN = {"text": "still serving", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = [*SMALL, "--log-level", "info", "--max-request-mb", "1", "--max-connections", str(MAX_CONN),
            "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S), "--keep-alive-timeout", str(KEEP_ALIVE_S)]
    with serve(tmp_path_factory.mktemp("guards"), args) as srv:
        yield srv


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closed the connection (failing after `limit`), and what it sent."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    data = read_all(sock)
    return time.monotonic() - t0, data


def status_and_json(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def generate_ok(server: Server) -> None:
    r = httpx.post(server.url + "/generate", json=GEN, timeout=60)
    assert r.status_code == 200, r.text


def test_declared_oversized_body_is_413_before_it_is_read(server: Server) -> None:
    with connect(server) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 104857600\r\n\r\n")  # 100 MB announced, not one byte sent
        took, raw = closed_after(s, 5)
    status, body = status_and_json(raw)
    assert status == 413 and "1 MiB" in body["error"]["message"]  # type: ignore[index]
    assert took < 3
    generate_ok(server)


def test_streamed_oversized_body_is_413(server: Server) -> None:
    def chunks() -> Iterator[bytes]:  # chunked, no Content-Length: counted as it arrives
        yield b'{"text": "'
        for _ in range(300):
            yield b"x" * 10_000
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and "--max-request-mb" in r.json()["error"]["message"]
    # An ordinary client that sends a large body with its length, then reads the answer.
    r = httpx.post(server.url + "/generate", content=b"y" * 3_000_000, timeout=30)
    assert r.status_code == 413
    generate_ok(server)


def test_dribbled_headers_are_cut_off(server: Server) -> None:
    with connect(server) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\n")
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < HEADER_S + 5:  # a header byte every 0.2 s: never complete
            try:
                s.sendall(b"x")
                s.settimeout(0.2)
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = True
                break
        took = time.monotonic() - t0
    assert closed and HEADER_S - 0.3 < took < HEADER_S + 8, took
    generate_ok(server)


def test_idle_connections_are_closed(server: Server) -> None:
    with connect(server) as s:  # never sends a byte
        took, raw = closed_after(s, HEADER_S + 5)
    assert raw == b"" and took < HEADER_S + 8
    with connect(server) as s:  # one request, then idle on a kept-alive connection
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        took, raw = closed_after(s, KEEP_ALIVE_S + 5)
    assert raw.startswith(b"HTTP/1.1 200") and took < KEEP_ALIVE_S + 8


def test_dribbled_body_gets_408(server: Server) -> None:
    with connect(server) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n{")
        t0 = time.monotonic()
        raw = b""
        while time.monotonic() - t0 < BODY_S + 5:
            try:
                s.sendall(b" ")
                s.settimeout(0.2)
                chunk = s.recv(4096)
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                break
            if not chunk:
                break
            raw += chunk
        took = time.monotonic() - t0
    status, body = status_and_json(raw)
    assert status == 408 and "did not arrive" in body["error"]["message"]  # type: ignore[index]
    assert BODY_S - 0.3 < took < BODY_S + 8
    generate_ok(server)


def test_connections_beyond_the_cap_get_503(server: Server) -> None:
    held = [connect(server) for _ in range(MAX_CONN)]
    try:
        time.sleep(0.2)  # all accepted
        with connect(server) as extra:
            status, body = status_and_json(closed_after(extra, 5)[1])
        assert status == 503 and "too many open connections" in body["error"]["message"]  # type: ignore[index]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    generate_ok(server)


def test_upload_cut_short_is_one_line_in_the_log(server: Server) -> None:
    before = server.log()
    with connect(server) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 5000\r\n\r\n{\"text\": \"" + b"z" * 100)
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while "client disconnected" not in server.log()[len(before):]:
        assert time.monotonic() < deadline, server.log()[len(before):]
        time.sleep(0.1)
    time.sleep(0.5)  # anything logged after it (a traceback) would be here by now
    new = server.log()[len(before):]
    assert "client disconnected during the upload of POST /generate" in new
    assert "Traceback" not in new and "internal error" not in new and "ERROR" not in new, new
    generate_ok(server)
