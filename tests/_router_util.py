"""Start and stop real servers (`python -m sglang_ext.launch`) and workers for the HTTP tests; and a
fake worker (`FakeWorker`) that speaks the real protocol to an in-process Router, for tests without a model.

Every process is started in its own session and killed as a group at the end, so a failing test
never leaves a worker behind. Servers bind 127.0.0.1 on free ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import msgspec
import zmq
import zmq.asyncio

if TYPE_CHECKING:
    from router.core import Router
    from router.placement.base import PlacementStrategy

    S = TypeVar("S", bound=PlacementStrategy)

from sglang_ext.messages import BatchOut, LoadReport, TokenOut, WorkerHello, WorkerInfo, decode_to_worker, encode

ROOT = Path(__file__).resolve().parent.parent
# Small KV pools keep several workers cheap on a 2-core CI machine.
SMALL = ["--max-total-tokens", "16384", "--dtype", "float32", "--device", "cpu", "--log-level", "warning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process with its output in a log file (read it with `.log()` on failure)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.p.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM and wait; whatever is left of the process group is SIGKILLed."""
        self.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(5)
        self._log.close()
        return self.p.returncode


class Server(Proc):
    def __init__(self, args: list[str], log_path: Path, port: int, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(["-m", "sglang_ext.launch", *args], log_path, env)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 120.0), **kw)

    def info(self) -> dict[str, Any]:
        with self.client() as c:
            r = c.get("/get_server_info")
            r.raise_for_status()
            return r.json()

    def up_workers(self) -> dict[str, list[str]]:
        return {name: [w["worker_id"] for w in m["workers"] if w["up"]] for name, m in self.info()["models"].items()}

    def wait_workers(self, n: int, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"server exited early:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if sum(len(v) for v in self.up_workers().values()) >= n:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"{n} workers not up after {timeout} s:\n{self.log()}")

    @property
    def worker_addr(self) -> str:
        return str(self.info()["worker_addr"])

    def worker(self, worker_id: str) -> dict[str, Any]:
        """The worker's entry in /get_server_info."""
        for m in self.info()["models"].values():
            for w in m["workers"]:
                if w["worker_id"] == worker_id:
                    return dict(w)
        raise KeyError(worker_id)


@contextlib.contextmanager
def serve(tmp: Path, args: list[str], workers: int = 1, api_key: str | None = None, name: str = "server",
          port: int | None = None) -> Iterator[Server]:
    """A launcher with `args`; with `--config`, give the file's `port` (and `api_key`) here too."""
    extra: list[str] = []
    if port is None:
        port = free_port()
        extra = ["--port", str(port), *(["--api-key", api_key] if api_key else [])]
    srv = Server([*args, *extra], tmp / f"{name}.log", port, api_key)
    try:
        srv.wait_workers(workers)
        yield srv
    finally:
        srv.stop()


def start_worker(tmp: Path, router_addr: str, worker_id: str, extra: list[str] | None = None) -> Proc:
    return Proc(["-m", "sglang_ext.launch", "worker", "--router", router_addr, "--worker-id", worker_id,
                 *SMALL, *(extra or [])], tmp / f"worker-{worker_id}-{time.monotonic_ns()}.log")


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """JSON payloads of an SSE stream up to `data: [DONE]` (which must come)."""
    import json

    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("stream ended without data: [DONE]")


def wait_for(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    """Poll until `cond()` is truthy (returned); fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            value = cond()
            if value:
                return value
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(poll)


# ---- in-process router tests: a fake worker ---------------------------------------------------------
def info(worker_id: str, model: str = "m", **overrides: Any) -> WorkerInfo:
    fields: dict[str, Any] = dict(
        worker_id=worker_id, model_name=model, model_path=f"/models/{model}", architecture="Llama",
        context_length=4096, vocab_size=2048, max_total_tokens=8192, page_size=16, device="cpu", dtype="float32",
        attention_backend="torch", has_tokenizer=True, chat_template=True, pid=os.getpid())
    return WorkerInfo(**{**fields, **overrides})


class FakeWorker:
    """A DEALER with the worker's identity; the test decides what it says and when."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, worker_id: str, model: str = "m",
                 **info_overrides: Any) -> None:
        self.id = worker_id
        self.model = model
        self.info_overrides = info_overrides
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.beat: asyncio.Task[None] | None = None

    async def send(self, msg: msgspec.Struct) -> None:
        await self.sock.send(encode(msg))

    async def hello(self) -> None:
        await self.send(WorkerHello(info=info(self.id, self.model, **self.info_overrides)))

    def load(self) -> LoadReport:
        return LoadReport(worker_id=self.id, num_running=0, num_waiting=0, kv_used_tokens=0, kv_total_tokens=8192,
                          kv_cached_tokens=0, num_preemptions=0, step_time_ms=1.0, timestamp=time.time())

    def start_heartbeat(self) -> None:
        async def loop() -> None:
            while True:
                await self.send(self.load())
                await asyncio.sleep(0.1)

        self.beat = asyncio.create_task(loop())

    def stop_heartbeat(self) -> None:
        if self.beat:
            self.beat.cancel()

    async def recv(self, timeout: float = 2.0) -> object:
        return decode_to_worker(await asyncio.wait_for(self.sock.recv(), timeout))

    async def token(self, rid: str, ids: list[int], finished: bool = False) -> None:
        meta = {"prompt_tokens": 3, "completion_tokens": len(ids),
                "finish_reason": {"type": "length", "length": len(ids)} if finished else None}
        await self.send(BatchOut(outs=[TokenOut(rid=rid, text_delta="x", token_ids=ids, finished=finished,
                                                meta_info=meta)]))

    def close(self) -> None:
        self.stop_heartbeat()
        self.sock.close(0)


async def until(cond: Callable[[], Any], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def strategy(router: Router, kind: type[S]) -> S | None:
    """The router's running placement strategy of that class, if any (the core itself asks only
    `PlacementStrategy`'s methods)."""
    return next((s for s in router.strategies if isinstance(s, kind)), None)
