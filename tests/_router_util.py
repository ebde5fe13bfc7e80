"""Start and stop real servers (`python -m sglang_ext.launch`) and workers for the HTTP tests.

Every process is started in its own session and killed as a group at the end, so a failing test
never leaves a worker behind. Servers bind 127.0.0.1 on free ports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# Small KV pools keep several workers cheap on a 2-core CI machine.
SMALL = ["--max-total-tokens", "16384", "--dtype", "float32", "--device", "cpu", "--log-level", "warning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process with its output in a log file (read it with `.log()` on failure)."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
    def __init__(self, args: list[str], log_path: Path, port: int, api_key: str | None = None) -> None:
        super().__init__(["-m", "sglang_ext.launch", *args], log_path)
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
