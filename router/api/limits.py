"""Size limits checked before any work is done: the HTTP body, and prompts too long for the context.

The body limit is enforced as the body streams in: a Content-Length over the limit is refused before
a byte of the body is read, and a body without one (chunked) is refused as soon as its bytes pass
the limit, so the router never holds more than the limit of one request.

A prompt text is refused before the worker tokenizes it when it cannot fit the context whatever its
tokens: no token is longer than the worker's `max_token_chars` characters, so a text of more than
`context_length * max_token_chars` characters has more than `context_length` tokens.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api.common import error_body
from router.errors import ApiError
from sglang_ext.messages import GenerateReq, WorkerInfo


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit / (1 << 20):g} MiB (--max-request-mb)"


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large(limit))


class BodyLimit:
    """413 for a request body over `limit` bytes (pure ASGI, so responses stream untouched)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        # h11 has already refused a malformed Content-Length with a 400.
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            body = error_body(scope["path"], 413, _too_large(self.limit))
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                    (b"connection", b"close")]})  # the unread body makes the connection unusable
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)  # rendered by the app's ApiError handler
            return message

        await self.app(scope, counted, send)


def check_prompt_size(info: WorkerInfo | None, reqs: list[GenerateReq]) -> None:
    """400 for a prompt that cannot fit the context of the worker chosen for it."""
    if info is None:
        return
    ctx, per_token = info.context_length, info.max_token_chars
    what = "the prompt"
    for r in reqs:
        if r.input_ids is not None and len(r.input_ids) >= ctx:
            raise ApiError(400, f"{what} has {len(r.input_ids)} tokens; this model's context length is {ctx}",
                           param="input_ids")
        if per_token <= 0:
            continue  # the worker did not say how long its tokens are: it checks after tokenizing
        if r.text is not None:
            chars, param = len(r.text), "text"
        elif r.messages is not None:
            chars, param = sum(len(str(m.get("content") or "")) for m in r.messages), "messages"
        else:
            continue
        if chars > ctx * per_token:
            raise ApiError(400, f"{what} has {chars} characters: more than this model's context length of {ctx} "
                                f"tokens can hold (at most {per_token} characters per token, so {ctx * per_token} "
                                "characters at most)", param=param)
