"""Offline API with the names of `sglang.Engine`.

The engine starts one worker process and talks to it over ZeroMQ with msgspec messages, exactly as
the router does, so offline and served runs share every code path below the socket.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import msgspec
import zmq

from sglang_ext.entry.outputs import expand_n
from sglang_ext.entry.outputs import merge_output as _merge
from sglang_ext.env import worker_environ
from sglang_ext.messages import (
    AbortReq,
    BatchOut,
    DetokenizeReq,
    ErrorOut,
    ExpertDistributionReq,
    FlushCacheReq,
    GenerateReq,
    LoadReport,
    ProfileReq,
    ReplyOut,
    ShutdownReq,
    TokenizeReq,
    UpdateWeightsReq,
    WorkerHello,
    WorkerInfo,
    decode_from_worker,
    encode,
)
from sglang_ext.sampling.params import InvalidRequest, SamplingParams, parse_sampling_params
from sglang_ext.server_args import ServerArgs

_STARTUP_TIMEOUT_S = 600.0
_ABORT_POLL_MS = 50


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
        # abort_request may come from another thread while one generates: the rids it names wait here
        # for the generating thread, which alone uses the socket, to send them (between polls).
        self._live: set[str] = set()
        self._aborts: collections.deque[str] = collections.deque()
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
        deadline = time.monotonic() + timeout_ms / 1000
        while True:  # short polls, to send the aborts other threads asked for
            while self._aborts:
                self._send(AbortReq(rid=self._aborts.popleft(), message="aborted by abort_request"))
            if self._sock.poll(min(_ABORT_POLL_MS, max(0, int((deadline - time.monotonic()) * 1000)))):
                break
            if time.monotonic() >= deadline:
                break
        if self._sock.poll(0) == 0:
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
        rid: str | list[str] | None = None,
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
        rids = rid if isinstance(rid, list) else [rid] * len(items) if rid is None or len(items) == 1 else None
        if rids is None or len(rids) != len(items):
            raise InvalidRequest("rid: give one request id per prompt")
        reqs: list[GenerateReq] = []
        for item, raw, base in zip(items, params, rids, strict=True):
            sp = parse_sampling_params(raw)
            sp.validate()
            samples = expand_n(sp)
            base = base or f"{self._worker_id}-{next(self._ids)}"
            for k, child in enumerate(samples):
                kw = {"text": item} if input_ids is None else {"input_ids": list(item)}
                reqs.append(GenerateReq(rid=base if len(samples) == 1 else f"{base}-{k}", sampling_params=child,
                                        **kw, **extra))
        if len({r.rid for r in reqs} | self._live) != len(reqs) + len(self._live):
            raise InvalidRequest("rid: a request id is repeated, or already in use")
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
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """As sglang.Engine.generate. `rid`: the request id (one per prompt for a list; a request of n
        samples has `rid-0` .. `rid-{n-1}`), for abort_request; default: generated (meta_info's `id`)."""
        extra = {
            "return_logprob": return_logprob,
            "logprob_start_len": -1 if logprob_start_len is None else logprob_start_len,
            "top_logprobs_num": top_logprobs_num or 0,
            "return_text_in_logprobs": return_text_in_logprobs,
            "stream": stream,
        }
        reqs, single = self._requests(prompt, input_ids, sampling_params, extra, rid)
        if stream:
            if len(reqs) != 1:
                raise InvalidRequest("stream=True takes a single prompt with n=1")
            return self._stream(reqs[0])
        results = self._run(reqs)
        return results[0] if single else results

    def _run(self, reqs: list[GenerateReq]) -> list[dict[str, Any]]:
        acc = {r.rid: {"text": "", "output_ids": [], "meta_info": {}} for r in reqs}
        pending = set(acc)
        self._live |= pending
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
        finally:
            self._live -= set(acc)
        return [acc[r.rid] for r in reqs]

    def _stream(self, req: GenerateReq) -> Iterator[dict[str, Any]]:
        acc: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {}}
        self._live.add(req.rid)
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
            self._live.discard(req.rid)
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

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort the running request `rid` (or its n samples, `rid-k`), or with `abort_all` every one.
        Safe from another thread while one generates; the generation ends with finish_reason
        {"type": "abort", ...}. An unknown rid is ignored (as in SGLang)."""
        live = list(self._live)
        self._aborts.extend(r for r in live if abort_all or r == rid
                            or (rid and r.startswith(f"{rid}-") and r[len(rid) + 1:].isdigit()))

    # ---- tokenizer, profiler, weights (answered by the worker with a ReplyOut) ---------------------
    def _ask(self, msg: Any) -> ReplyOut:
        self._send(msg)
        while True:
            got = self._recv(timeout_ms=1000)
            if isinstance(got, ErrorOut) and got.rid == msg.rid:
                raise _error(got)
            if isinstance(got, ReplyOut) and got.rid == msg.rid:
                return got

    def tokenize(self, prompt: str | list[str], add_special_tokens: bool = True) -> list[int] | list[list[int]]:
        """Token ids of a prompt (a list for a list of prompts)."""
        texts = prompt if isinstance(prompt, list) else [prompt]
        ids = [list(self._ask(TokenizeReq(rid=f"tok-{next(self._ids)}", text=t,
                                          add_special_tokens=add_special_tokens)).data["input_ids"]) for t in texts]
        return ids if isinstance(prompt, list) else ids[0]

    def detokenize(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        reply = self._ask(DetokenizeReq(rid=f"detok-{next(self._ids)}", tokens=list(tokens),
                                        skip_special_tokens=skip_special_tokens))
        return str(reply.data["text"])

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                      activities: list[str] | None = None) -> None:
        """torch.profiler over the worker's steps into `output_dir` (default $SGLANG_TORCH_PROFILER_DIR,
        else /tmp), until stop_profile, or by itself after `num_steps` steps. InvalidRequest when refused."""
        self._profile(ProfileReq(rid=f"prof-{next(self._ids)}", action="start", output_dir=output_dir or "",
                                 num_steps=num_steps, activities=list(activities or [])))

    def stop_profile(self) -> None:
        self._profile(ProfileReq(rid=f"prof-{next(self._ids)}", action="stop"))

    def _profile(self, msg: ProfileReq) -> None:
        reply = self._ask(msg)
        if not reply.ok:
            raise InvalidRequest(str(reply.data.get("error")))

    # ---- expert distribution (--expert-distribution-recorder-mode stat; worker/expert_distribution.py) ----
    def start_expert_distribution_record(self) -> None:
        """Record from now on how many tokens the router sends to each expert of each MoE layer."""
        self._record("start")

    def stop_expert_distribution_record(self) -> None:
        self._record("stop")

    def dump_expert_distribution_record(self, output_dir: str | None = None) -> list[str]:
        """Write the record (up to now while recording) into `output_dir` (default: the one given before, else
        $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp); the paths of the .pt and .json files."""
        return self._record("dump", output_dir)

    def _record(self, action: Literal["start", "stop", "dump"], output_dir: str | None = None) -> list[str]:
        """InvalidRequest when refused: a dense model, no --expert-distribution-recorder-mode, a stop unstarted."""
        reply = self._ask(ExpertDistributionReq(rid=f"experts-{next(self._ids)}", action=action,
                                                output_dir=output_dir or ""))
        if not reply.ok:
            raise InvalidRequest(str(reply.data.get("error")))
        return [str(f) for f in reply.data.get("files") or []]

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str]:
        """Reload the weights in place (requests in flight finish first); (success, message). On failure
        the old weights keep serving."""
        reply = self._ask(UpdateWeightsReq(rid=f"weights-{next(self._ids)}", model_path=model_path,
                                           load_format=load_format or ""))
        if reply.ok:
            self.info = msgspec.structs.replace(self.info, model_path=model_path)
        return reply.ok, str(reply.data.get("message", ""))

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
