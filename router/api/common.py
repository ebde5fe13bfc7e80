"""Pieces every endpoint shares: errors, JSON in and out, SSE, and waiting on a Submission.

Errors are raised as `ApiError` (router/errors.py, with the clipping of quoted input) and rendered by
the app: the OpenAI error object on /v1/*, and SGLang's `{"error": {"message": ...}}` elsewhere. Both
carry a message that names the problem, no longer than MAX_MESSAGE_CHARS.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.api.json_body import TooDeep, decode_json
from router.errors import ECHO_CHARS, MAX_MESSAGE_CHARS, ApiError, ClientGone, clip
from router.tracker import Failure, Restart, Submission
from sglang_ext.messages import TokenOut

logger = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
DISCONNECT_POLL_S: Final = 0.5
DONE: Final = b"data: [DONE]\n\n"


def quote(value: object) -> str:
    """A client's value for an error message: repr'd, and clipped when long."""
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"  # no repr of the whole string
    return clip(repr(value))


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status < 500:
        return "invalid_request_error"
    return "service_unavailable" if status == 503 else "internal_error"


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    message = clip(message, MAX_MESSAGE_CHARS)
    if path.startswith("/v1/") or path == "/v1":
        err = {"message": message, "type": error_type(status), "param": param, "code": code or status}
    else:
        err = {"message": message, "code": status}
    return _enc.encode({"error": err})


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


async def read_json(request: Request) -> dict[str, Any]:
    try:
        body = await request.body()
    except ClientDisconnect:
        # Not a server error: one line, no traceback (the client is gone; nobody reads the answer).
        client = request.client
        logger.info("client disconnected during the upload of %s %s (from %s)", request.method, request.url.path,
                    f"{client.host}:{client.port}" if client else "?")
        raise ClientGone() from None
    try:
        data = decode_json(body)
    except TooDeep as e:
        raise ApiError(400, str(e)) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the JSON body must be an object, got {type(data).__name__}")
    return data


def convert(data: Any, typ: type[Any]) -> Any:
    """Strict typed conversion; the message names the offending field (`$.sampling_params.top_k`)."""
    try:
        return msgspec.convert(data, typ)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}") from None


class EventStream:
    """Token outputs of a Submission in arrival order; failures become ApiError, and every way out
    other than finishing (error, client gone) aborts what is still running in the worker."""

    def __init__(self, sub: Submission, on_restart: Callable[[int], None] | None = None) -> None:
        self.sub = sub
        self.left = len(sub.states)
        self._polled = time.monotonic()
        # A non-streaming sub-request retried after some output: the consumer drops what it collected.
        self.on_restart = on_restart

    async def next(self, request: Request | None = None) -> tuple[int, TokenOut] | None:
        """The next output, or None when all sub-requests finished. With `request`, checks for a
        client disconnect every DISCONNECT_POLL_S while waiting (only before a streaming response
        starts: afterwards the server watches the connection itself)."""
        while self.left:
            if request is not None and time.monotonic() - self._polled >= DISCONNECT_POLL_S:
                # Checked on a clock, not only when idle: outputs may arrive faster than the poll.
                self._polled = time.monotonic()
                if await request.is_disconnected():
                    self.sub.abort()
                    raise ClientGone()
            item = await self.sub.next(DISCONNECT_POLL_S if request is not None else None)
            if item is None:
                continue
            idx, ev = item
            if isinstance(ev, Restart):
                if self.on_restart is not None:
                    self.on_restart(idx)
                continue
            if isinstance(ev, Failure):
                self.sub.abort()
                raise ApiError(ev.status, ev.message)
            if ev.finished:
                self.left -= 1
            return idx, ev
        return None


class SSEResponse(StreamingResponse):
    """Server-sent events that run `on_close` however the stream ends (finished, client gone)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
