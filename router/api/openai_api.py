"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming too)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from router.api.common import (
    DONE,
    ApiError,
    EventStream,
    SSEResponse,
    convert,
    error_type,
    json_response,
    read_json,
    sse,
)
from router.api.native import collect, submit
from router.api.native_protocol import GeneratePlan, resolve_model
from router.api.openai_format import chat_logprobs, completion_logprobs, finish, new_id, now_s, usage
from router.api.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    check_completion,
    completion_prompts,
    sampling_params,
)
from router.api.sampling import estimate_tokens
from router.core import Router
from router.registry import ModelEntry
from sglang_ext.entry.outputs import expand_n
from sglang_ext.messages import GenerateReq, TokenOut
from sglang_ext.sampling.params import SamplingParams


def _plan(router: Router, model: ModelEntry, prompts: list[dict[str, Any]], sp: SamplingParams, stream: bool,
          logprobs: bool, top: int, start: int = -1) -> GeneratePlan:
    reqs, est = [], []
    for p in prompts:
        e = len(p["input_ids"]) if "input_ids" in p else estimate_tokens(str(p.get("text") or p.get("messages")))
        for child in expand_n(sp):
            reqs.append(GenerateReq(rid=router.new_rid(), sampling_params=child, return_logprob=logprobs,
                                    logprob_start_len=start, top_logprobs_num=top, return_text_in_logprobs=True,
                                    stream=stream, **p))
            est.append(e)
    return GeneratePlan(model, reqs, est, single=False, stream=stream)


def _include_usage(body: CompletionRequest | ChatRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def build(router: Router) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.get("/models")
    async def models() -> Response:
        data = []
        for name, m in router.registry.models.items():
            info = m.info
            data.append({"id": name, "object": "model", "created": int(router.started), "owned_by": "sglang_ext",
                         "root": info.model_path if info else None,
                         "max_model_len": info.context_length if info else None})
        return json_response({"object": "list", "data": data})

    @api.get("/models/{name:path}")
    async def model(name: str) -> Response:
        m = resolve_model(router.registry, name)
        return json_response({"id": m.name, "object": "model", "created": int(router.started),
                              "owned_by": "sglang_ext"})

    # ---- /v1/completions ----------------------------------------------------------------------
    @api.post("/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = convert(await read_json(request), CompletionRequest)
        check_completion(body)
        model = resolve_model(router.registry, body.model)
        sp = sampling_params(body, model, body.max_tokens, 16)
        prompts = completion_prompts(body.prompt)
        want_lp = body.logprobs is not None
        plan = _plan(router, model, prompts, sp, body.stream, want_lp or body.echo, body.logprobs or 0,
                     0 if body.echo else -1)
        prompt_of = [p for p in prompts for _ in range(body.n)]
        sub = submit(router, plan)
        rid, created = new_id("cmpl"), now_s()
        if not body.stream:
            results = await collect(sub, request)
            choices = []
            for i, r in enumerate(results):
                meta = r["meta_info"]
                text, lp = r["text"], None
                echo = _echo_text(prompt_of[i], meta) if body.echo else ""
                if want_lp:
                    toks = meta.get("output_token_logprobs", [])
                    tops = meta.get("output_top_logprobs") if body.logprobs else None
                    if body.echo:
                        toks = meta.get("input_token_logprobs", []) + toks
                        tops = (meta.get("input_top_logprobs", []) + (tops or [])) if body.logprobs else None
                    lp = completion_logprobs(toks, tops, 0)
                reason, matched = finish(meta)
                choices.append({"index": i, "text": echo + text, "logprobs": lp, "finish_reason": reason,
                                "matched_stop": matched})
            return json_response({"id": rid, "object": "text_completion", "created": created, "model": model.name,
                                  "choices": choices,
                                  "usage": usage([r["meta_info"] for r in results], body.n)})
        events = EventStream(sub)
        first = await events.next(request)

        async def stream() -> AsyncIterator[bytes]:
            metas: dict[int, dict[str, Any]] = {}
            offsets: dict[int, int] = {}
            head = {"id": rid, "object": "text_completion", "created": created, "model": model.name}
            item: tuple[int, TokenOut] | None = first
            try:
                while item is not None:
                    i, out = item
                    meta = out.meta_info
                    text = out.text_delta
                    if i not in metas and body.echo:
                        text = _echo_text(prompt_of[i], meta) + text
                    metas[i] = meta
                    lp = None
                    if want_lp:
                        toks = meta.get("output_token_logprobs", [])
                        tops = meta.get("output_top_logprobs") if body.logprobs else None
                        lp = completion_logprobs(toks, tops, offsets.get(i, 0))
                    offsets[i] = offsets.get(i, 0) + len(text)
                    reason, matched = finish(meta)
                    if text or reason or lp:
                        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
                        if reason:
                            choice["matched_stop"] = matched
                        yield sse({**head, "choices": [choice]})
                    item = await events.next()
                if _include_usage(body):
                    yield _usage_chunk(head, metas, body.n)
            except ApiError as e:
                yield _error_chunk(e)
            yield DONE

        return SSEResponse(stream(), on_close=sub.abort)

    # ---- /v1/chat/completions -----------------------------------------------------------------
    @api.post("/chat/completions")
    async def chat(request: Request) -> Response:
        body: ChatRequest = convert(await read_json(request), ChatRequest)
        model = resolve_model(router.registry, body.model)
        messages = chat_messages(body)
        info = model.info
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # No limit given: generate until the context is full, as SGLang does.
        sp = sampling_params(body, model, limit, info.context_length if info else 128)
        top = body.top_logprobs or 0
        plan = _plan(router, model, [{"messages": messages}], sp, body.stream, body.logprobs, top)
        sub = submit(router, plan)
        rid, created = new_id("chatcmpl"), now_s()
        if not body.stream:
            results = await collect(sub, request)
            choices = []
            for i, r in enumerate(results):
                meta = r["meta_info"]
                lp = None
                if body.logprobs:
                    lp = chat_logprobs(meta.get("output_token_logprobs", []),
                                       meta.get("output_top_logprobs") if top else None)
                reason, matched = finish(meta)
                choices.append({"index": i, "message": {"role": "assistant", "content": r["text"]},
                                "logprobs": lp, "finish_reason": reason, "matched_stop": matched})
            return json_response({"id": rid, "object": "chat.completion", "created": created, "model": model.name,
                                  "choices": choices, "usage": usage([r["meta_info"] for r in results], body.n)})
        events = EventStream(sub)
        first = await events.next(request)

        async def stream() -> AsyncIterator[bytes]:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model.name}
            metas: dict[int, dict[str, Any]] = {}
            item: tuple[int, TokenOut] | None = first
            try:
                while item is not None:
                    i, out = item
                    meta = out.meta_info
                    if i not in metas:
                        delta = {"role": "assistant", "content": ""}
                        yield sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": None,
                                                        "finish_reason": None}]})
                    metas[i] = meta
                    lp = None
                    if body.logprobs and meta.get("output_token_logprobs"):
                        lp = chat_logprobs(meta["output_token_logprobs"],
                                           meta.get("output_top_logprobs") if top else None)
                    if out.text_delta or lp:
                        yield sse({**head, "choices": [{"index": i, "delta": {"content": out.text_delta},
                                                        "logprobs": lp, "finish_reason": None}]})
                    reason, matched = finish(meta)
                    if reason:
                        yield sse({**head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                        "finish_reason": reason, "matched_stop": matched}]})
                    item = await events.next()
                if _include_usage(body):
                    yield _usage_chunk(head, metas, body.n)
            except ApiError as e:
                yield _error_chunk(e)
            yield DONE

        return SSEResponse(stream(), on_close=sub.abort)

    return api


def _echo_text(prompt: dict[str, Any], meta: dict[str, Any]) -> str:
    if "text" in prompt:
        return str(prompt["text"])
    return "".join(e[2] or "" for e in meta.get("input_token_logprobs", []) if len(e) > 2)


def _usage_chunk(head: dict[str, Any], metas: dict[int, dict[str, Any]], n: int) -> bytes:
    """The final `usage` chunk of a stream (stream_options.include_usage)."""
    return sse({**head, "choices": [], "usage": usage([metas[i] for i in sorted(metas)], n)})


def _error_chunk(e: ApiError) -> bytes:
    """An error after the stream started: the status is already sent, so it travels as an event."""
    return sse({"error": {"message": e.message, "type": error_type(e.status), "code": e.status}})
