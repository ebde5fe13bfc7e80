"""A tiny OpenAI-compatible server for tests of `url:` workers: FastAPI/uvicorn on 127.0.0.1 (a free
port) in a thread of the test process. It streams a fixed reply word by word, records what it was sent,
and can be made unhealthy or to fail a request."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from _router_util import free_port
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse


class FakeOpenAI:
    def __init__(self, model_id: str = "fake-model", reply: str = "one two three four five six seven eight",
                 chunk_delay_s: float = 0.0) -> None:
        self.model_id = model_id
        self.words = reply.split()
        self.chunk_delay_s = chunk_delay_s
        self.healthy = True
        self.received: list[tuple[str, dict[str, Any]]] = []  # (path, body) of each generation request
        self.cut = 0  # streams that ended before their last event (the client went away)
        self.auth: set[str] = set()  # the Authorization headers of its health checks
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> FakeOpenAI:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake OpenAI server did not start"
            time.sleep(0.02)
        return self

    def token_id(self, word: str) -> int:
        """The id this server gives a word of its reply (its vocabulary is its reply's words)."""
        return 1000 + self.words.index(word)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health(request: Request) -> Response:
            self.auth.add(request.headers.get("authorization", ""))
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model",
                                                             "max_model_len": 4096}]})

        @app.post("/flush_cache")
        async def flush() -> Response:
            return Response("flushed")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate("/v1/completions", await request.json())

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._generate("/v1/chat/completions", await request.json())

        return app

    async def _generate(self, path: str, body: dict[str, Any]) -> Response:
        self.received.append((path, body))
        prompt = json.dumps(body.get("prompt", body.get("messages")))
        if "FAIL400" in prompt:
            return JSONResponse({"object": "error", "message": "the prompt asked for a 400", "code": 400},
                                status_code=400)
        if body.get("model") != self.model_id:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}}, status_code=404)
        assert body.get("stream") is True, "the router always streams from an upstream"
        limit = body.get("max_tokens", len(self.words))
        words = [self.words[i % len(self.words)] for i in range(limit)]
        chat = path.endswith("chat/completions")

        def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
            obj = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "model": self.model_id,
                   "choices": [choice] if choice else [], "usage": usage}
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        async def events() -> AsyncIterator[bytes]:
            done = False
            try:
                async for part in body_events():
                    yield part
                done = True
            finally:
                self.cut += not done

        async def body_events() -> AsyncIterator[bytes]:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            for i, w in enumerate(words):
                await asyncio.sleep(self.chunk_delay_s)
                text = w if i == 0 else " " + w
                last = i == len(words) - 1
                reason = ("length" if limit < len(self.words) else "stop") if last else None
                choice: dict[str, Any] = ({"index": 0, "delta": {"content": text}, "finish_reason": reason} if chat
                                          else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
                if body.get("return_token_ids"):  # as vLLM: the ids of the chunk's tokens
                    choice["token_ids"] = [self.token_id(w)]
                yield chunk(choice)
            yield chunk(None, {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(words),
                               "total_tokens": len(prompt) // 4 + len(words),
                               "prompt_tokens_details": {"cached_tokens": 3}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
