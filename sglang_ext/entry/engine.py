"""Offline API with the names of `sglang.Engine`.

The engine starts one worker process and talks to it over ZeroMQ with msgspec messages, exactly as
the router does, so offline and served runs share every code path below the socket.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec
import zmq

from sglang_ext.entry.outputs import expand_n
from sglang_ext.entry.outputs import merge_output as _merge
from sglang_ext.env import worker_environ
from sglang_ext.messages import (
    AbortReq,
    BatchOut,
    ErrorOut,
    FlushCacheReq,
    GenerateReq,
    LoadReport,
    ReplyOut,
    ShutdownReq,
    WorkerHello,
    WorkerInfo,
    decode_from_worker,
    encode,
)
from sglang_ext.sampling.params import InvalidRequest, SamplingParams, parse_sampling_params
from sglang_ext.server_args import ServerArgs

_STARTUP_TIMEOUT_S = 600.0


class WorkerDied(RuntimeError):
    pass


def _error(msg: ErrorOut) -> Exception:
    """The exception for a worker's error answer: 400 the request's fault, 503 the worker died
    (a fatal error: it failed every request and exited), anything else a server-side error."""
    if msg.status == 400:
        return InvalidRequest(msg.message)
    if msg.status == 503:
        return WorkerDied(msg.message)
    return RuntimeError(f"the worker failed this request ({msg.status}): {msg.message}")


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        self._dir = tempfile.mkdtemp(prefix="sglang_ext-")
        self._addr = f"ipc://{self._dir}/worker.sock"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self._addr)
        self._worker_id = f"engine-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._proc: subprocess.Popen[bytes] | None = spawn_worker(self.server_args, self._addr, self._worker_id)
        self._ids = itertools.count()
        self.load: LoadReport | None = None
        try:
            self.info: WorkerInfo = self._wait_hello()
        except BaseException:  # the worker could not start: release the socket and the process
            self.shutdown()
            raise

    # ---- lifecycle --------------------------------------------------------------------------
    def _wait_hello(self) -> WorkerInfo:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = self._recv(timeout_ms=200)
            if isinstance(msg, WorkerHello):
                return msg.info
        self.shutdown()
        raise WorkerDied("the worker did not start in time")

    def shutdown(self) -> None:
        # getattr: __del__ may run on an instance whose __init__ failed before _proc was set.
        proc: subprocess.Popen[bytes] | None = getattr(self, "_proc", None)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._send(ShutdownReq())
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._proc = None
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:  # best effort; explicit shutdown() is the contract
        with contextlib.suppress(Exception):
            self.shutdown()

    # ---- transport --------------------------------------------------------------------------
    def _send(self, msg: msgspec.Struct) -> None:
        self._sock.send_multipart([self._worker_id.encode(), encode(msg)])

    def _recv(self, timeout_ms: int) -> Any:
        if self._sock.poll(timeout_ms) == 0:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                if code == 2:  # the worker's startup-error exit: its one-line reason is in its log
                    raise WorkerDied("the worker could not start (exit code 2); its error is logged above")
                raise WorkerDied(f"the worker process exited with code {code}")
            return None
        _, buf = self._sock.recv_multipart()
        msg = decode_from_worker(buf)
        if isinstance(msg, LoadReport):
            self.load = msg
            return None
        return msg

    # ---- generation -------------------------------------------------------------------------
    def _requests(
        self, prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None, extra: dict[str, Any],
    ) -> tuple[list[GenerateReq], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("give exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and (not input_ids or isinstance(input_ids[0], int)))
        items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt or [])
        if input_ids is not None:
            items = [input_ids] if single else list(input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise InvalidRequest("sampling_params list must match the number of prompts")
        reqs: list[GenerateReq] = []
        for item, raw in zip(items, params, strict=True):
            sp = parse_sampling_params(raw)
            sp.validate()
            for child in expand_n(sp):
                kw = {"text": item} if input_ids is None else {"input_ids": list(item)}
                reqs.append(GenerateReq(rid=f"{self._worker_id}-{next(self._ids)}", sampling_params=child,
                                        **kw, **extra))
        return reqs, single and len(reqs) == 1

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        extra = {
            "return_logprob": return_logprob,
            "logprob_start_len": -1 if logprob_start_len is None else logprob_start_len,
            "top_logprobs_num": top_logprobs_num or 0,
            "return_text_in_logprobs": return_text_in_logprobs,
            "stream": stream,
        }
        reqs, single = self._requests(prompt, input_ids, sampling_params, extra)
        if stream:
            if len(reqs) != 1:
                raise InvalidRequest("stream=True takes a single prompt with n=1")
            return self._stream(reqs[0])
        results = self._run(reqs)
        return results[0] if single else results

    def _run(self, reqs: list[GenerateReq]) -> list[dict[str, Any]]:
        acc = {r.rid: {"text": "", "output_ids": [], "meta_info": {}} for r in reqs}
        pending = set(acc)
        for r in reqs:
            self._send(r)
        try:
            while pending:
                msg = self._recv(timeout_ms=1000)
                if isinstance(msg, ErrorOut) and msg.rid in pending:
                    for rid in pending - {msg.rid}:
                        self._send(AbortReq(rid=rid))
                    raise _error(msg)
                if isinstance(msg, BatchOut):
                    for o in msg.outs:
                        if o.rid not in acc:
                            continue
                        _merge(acc[o.rid], o.text_delta, o.token_ids, o.meta_info)
                        if o.finished:
                            pending.discard(o.rid)
        except BaseException:
            for rid in pending:
                with contextlib.suppress(zmq.ZMQError):
                    self._send(AbortReq(rid=rid))
            raise
        return [acc[r.rid] for r in reqs]

    def _stream(self, req: GenerateReq) -> Iterator[dict[str, Any]]:
        acc: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {}}
        self._send(req)
        done = False
        try:
            while not done:
                msg = self._recv(timeout_ms=1000)
                if isinstance(msg, ErrorOut) and msg.rid == req.rid:
                    raise _error(msg)
                if isinstance(msg, BatchOut):
                    for o in msg.outs:
                        if o.rid == req.rid:
                            _merge(acc, o.text_delta, o.token_ids, o.meta_info)
                            done = o.finished
                            yield {"text": acc["text"], "output_ids": list(acc["output_ids"]),
                                   "meta_info": dict(acc["meta_info"])}
        finally:
            if not done:
                self._send(AbortReq(rid=req.rid))

    async def async_generate(self, *args: Any, **kwargs: Any) -> Any:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.generate(*args, **kwargs))

    def flush_cache(self) -> bool:
        rid = f"flush-{next(self._ids)}"
        self._send(FlushCacheReq(rid=rid))
        while True:
            msg = self._recv(timeout_ms=1000)
            if isinstance(msg, ReplyOut) and msg.rid == rid:
                return msg.ok

    def get_server_info(self) -> dict[str, Any]:
        return {**msgspec.structs.asdict(self.info), "server_args": msgspec.to_builtins(self.server_args)}


def spawn_worker(args: ServerArgs, addr: str, worker_id: str, env: Mapping[str, str] | None = None,
                 secrets: Iterable[str] = ()) -> subprocess.Popen[bytes]:
    """Start `python -m sglang_ext.worker` connected to `addr`, with `env` added to this process's
    environment and the router's secrets taken out of it (the API key's variable, and `secrets`: the
    other variables the router reads keys from); it exits when its parent does."""
    cmd = [sys.executable, "-m", "sglang_ext.worker", addr, worker_id, msgspec.json.encode(args).decode()]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=worker_environ(env, secrets=secrets))


__all__ = ["Engine", "SamplingParams", "WorkerDied"]
