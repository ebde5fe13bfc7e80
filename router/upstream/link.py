"""`UpstreamLink`: one `url:` worker as the core sees a worker.

    core.send(worker id, msg) -> link.handle(msg)     GenerateReq: a streamed HTTP request upstream
                                                      AbortReq: that request's task is cancelled (the
                                                      connection closes; SGLang then aborts it)
                                                      FlushCacheReq: POST /flush_cache, answered
    link -> core.receive(worker id, msg)              WorkerHello, BatchOut, ErrorOut, ReplyOut

Health: GET `health_path` every `health_interval_s`. The first success says hello (the upstream's model
and context length from GET /v1/models), which makes the worker up; `health_failures` failures in a row
mark it down (its requests fail with 503, nothing more is routed to it), and the next success brings it
back with a new hello. A request that cannot connect marks it down at once: the router should not wait
a health period to stop sending requests to a server that refuses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, Final, Protocol

import httpx
import msgspec

from router.registry import Registry
from router.tracker import WorkerState
from router.upstream.openai import StreamParser, UpstreamError, request_body
from router.upstream.spec import UrlWorker
from sglang_ext.messages import (
    AbortReq,
    BatchOut,
    ErrorOut,
    FlushCacheReq,
    GenerateReq,
    ReplyOut,
    WorkerHello,
    WorkerInfo,
)

logger = logging.getLogger(__name__)
DEFAULT_CONTEXT: Final = 131072  # an upstream that says nothing of its context: the router's checks stay out of the way
_ERROR_BODY_BYTES: Final = 4096


class UpstreamHost(Protocol):
    """The router core as a link sees it."""

    @property
    def registry(self) -> Registry: ...

    @property
    def links(self) -> dict[str, Callable[[msgspec.Struct], None]]:
        """Worker id -> how messages for it are sent instead of the socket."""

    def receive(self, ident: str, msg: Any) -> None:
        """A message from a worker, as if it came over the socket."""

    def mark_down(self, w: WorkerState, reason: str) -> None: ...


class UpstreamLink:
    def __init__(self, host: UpstreamHost, w: UrlWorker, client: httpx.AsyncClient) -> None:
        self.host = host
        self.w = w
        self.client = client
        self.headers = {"Authorization": f"Bearer {w.api_key}"} if w.api_key else {}
        self.model_id = w.spec.model or w.model  # what requests name upstream (discovered at hello)
        self.context_length = w.spec.context_length or DEFAULT_CONTEXT
        self.failures = 0
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._health: asyncio.Task[None] | None = None
        self._down_logged = False

    @property
    def state(self) -> WorkerState:
        return self.host.registry.workers[self.w.worker_id]

    def start(self) -> None:
        self.host.registry.expect(self.w.worker_id, self.w.model)
        self.host.links[self.w.worker_id] = self.handle
        self._health = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        self.host.links.pop(self.w.worker_id, None)
        tasks = [t for t in (self._health, *self.tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.tasks.clear()

    # ---- from the core ------------------------------------------------------------------------
    def handle(self, msg: msgspec.Struct) -> None:
        """Never blocks (the core sends from `finally` blocks too): work goes to a task."""
        if isinstance(msg, GenerateReq):
            self.tasks[msg.rid] = asyncio.create_task(self._generate(msg))
        elif isinstance(msg, AbortReq):
            task = self.tasks.pop(msg.rid, None)
            if task is not None:
                task.cancel()
        elif isinstance(msg, FlushCacheReq):
            self.tasks[f"flush:{msg.rid}"] = asyncio.create_task(self._flush(msg.rid))
        # Anything else (offload, KV pairs, shutdown) is for workers the router runs.

    # ---- requests -----------------------------------------------------------------------------
    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.w.spec.timeout_s, connect=self.w.spec.health_timeout_s)

    async def _generate(self, req: GenerateReq) -> None:
        path, body = request_body(req, self.model_id, self.context_length, self.w.spec.return_token_ids)
        parser = StreamParser(req.rid, chat=req.messages is not None)
        where = f"upstream {self.w.url}"
        try:
            async with self.client.stream("POST", self.w.url + path, json=body, headers=self.headers,
                                          timeout=self._timeout()) as resp:
                if resp.status_code != 200:
                    status, message = await _error_of(resp)
                    self._send(ErrorOut(rid=req.rid, message=f"{where} answered {resp.status_code}: {message}",
                                        status=status))
                    return
                async for line in resp.aiter_lines():
                    out = parser.feed(line)
                    if out is not None:
                        self._send(BatchOut(outs=[out]))
            if not parser.done and parser.finish is None:
                raise UpstreamError("it closed the stream before the end")
            self._send(BatchOut(outs=[parser.last()]))
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self._unreachable(f"cannot connect ({type(e).__name__}: {e})")
            self._send(ErrorOut(rid=req.rid, message=f"{where} cannot be reached: {e}", status=503))
        except (httpx.HTTPError, UpstreamError) as e:
            self._send(ErrorOut(rid=req.rid, message=f"{where}: {type(e).__name__}: {e}", status=502))
        except Exception as e:  # a bug: the request must still end (its client waits on it)
            logger.exception("upstream %s: request %s failed", self.w.url, req.rid)
            self._send(ErrorOut(rid=req.rid, message=f"{where}: internal error: {type(e).__name__}: {e}", status=500))
        finally:
            self.tasks.pop(req.rid, None)

    async def _flush(self, rid: str) -> None:
        ok, why = False, ""
        try:
            r = await self.client.post(self.w.url + "/flush_cache", headers=self.headers, timeout=self._timeout())
            ok, why = r.status_code == 200, f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            why = str(e)
        finally:
            self.tasks.pop(f"flush:{rid}", None)
        self._send(ReplyOut(rid=rid, ok=ok, data={} if ok else {"error": why}))

    def _send(self, msg: msgspec.Struct) -> None:
        self.host.receive(self.w.worker_id, msg)

    def _unreachable(self, why: str) -> None:
        self.failures = max(self.failures, self.w.spec.health_failures)  # up again only after a good check
        w = self.state
        if w.up:
            self.host.mark_down(w, f"upstream {self.w.url}: {why}")

    # ---- health -------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            try:
                await self._check()
            except Exception:  # a bug here must not end the checks (the worker would never come back)
                logger.exception("upstream %s: health check failed", self.w.url)
            await asyncio.sleep(self.w.spec.health_interval_s)

    async def _check(self) -> None:
        why = await self._probe()
        w = self.state
        if why is None:
            self.failures, self._down_logged = 0, False
            if not w.up:
                await self._hello()
            w.touch()
            return
        self.failures += 1
        if w.up and self.failures >= self.w.spec.health_failures:
            self.host.mark_down(w, f"upstream {self.w.url}: {why}")
        elif not w.up and not self._down_logged:
            logger.warning("upstream %s (worker %s) is not healthy: %s", self.w.url, self.w.worker_id, why)
        self._down_logged = not w.up

    async def _probe(self) -> str | None:
        """None if healthy, else why not."""
        try:
            r = await self.client.get(self.w.url + self.w.spec.health_path, headers=self.headers,
                                      timeout=self.w.spec.health_timeout_s)
        except httpx.HTTPError as e:
            return f"GET {self.w.spec.health_path}: {type(e).__name__}: {e}"
        return None if r.status_code == 200 else f"GET {self.w.spec.health_path} answered {r.status_code}"

    async def _hello(self) -> None:
        """Learn the upstream's model id and context length, and register as up."""
        found = await self._discover()
        if found is not None:
            model_id, ctx = found
            self.model_id = self.w.spec.model or model_id
            self.context_length = self.w.spec.context_length or ctx or DEFAULT_CONTEXT
        info = WorkerInfo(worker_id=self.w.worker_id, model_name=self.w.model, model_path=self.model_id,
                          architecture="upstream", context_length=self.context_length, vocab_size=(1 << 31) - 1,
                          max_total_tokens=0, page_size=1, device="http", dtype="", attention_backend="",
                          has_tokenizer=True, chat_template=True, pid=os.getpid(), hostname=self.w.url)
        self._send(WorkerHello(info=info))

    async def _discover(self) -> tuple[str, int | None] | None:
        """(model id, context length) from GET /v1/models: the configured model's entry, else the first."""
        try:
            r = await self.client.get(self.w.url + "/v1/models", headers=self.headers,
                                      timeout=self.w.spec.health_timeout_s)
            data = r.json().get("data") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            logger.warning("upstream %s: GET /v1/models failed (%s); sending model %r", self.w.url, e, self.model_id)
            return None
        entries = [d for d in data or [] if isinstance(d, dict) and isinstance(d.get("id"), str)]
        if not entries:
            logger.warning("upstream %s lists no model at /v1/models; sending model %r", self.w.url, self.model_id)
            return None
        entry = next((d for d in entries if d["id"] == self.w.spec.model), entries[0])
        ctx = entry.get("max_model_len") or entry.get("context_length")
        return entry["id"], int(ctx) if isinstance(ctx, int) and ctx > 0 else None


async def _error_of(resp: httpx.Response) -> tuple[int, str]:
    """The status the client gets for an upstream error answer, and its message."""
    raw = b""
    async for part in resp.aiter_bytes():
        raw += part
        if len(raw) >= _ERROR_BODY_BYTES:
            break
    message = raw[:_ERROR_BODY_BYTES].decode(errors="replace").strip()
    with contextlib.suppress(msgspec.DecodeError):
        data = msgspec.json.decode(raw)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            message = str(err["message"])
        elif isinstance(data, dict) and isinstance(data.get("detail") or data.get("message"), str):
            message = str(data.get("detail") or data.get("message"))
    code = resp.status_code
    # The client's own mistakes keep their status; the upstream's failures are a bad gateway to it.
    return (code if 400 <= code < 500 or code == 503 else 502), message or resp.reason_phrase
