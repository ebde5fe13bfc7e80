"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming too).

Both generation endpoints share one path: parse -> plan -> submit -> either collect every choice
(`Render.choice`) or stream (`Render.chunks` per worker output, one SSE loop for both).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from starlette.responses import Response

from router.api.chat_output import ChoiceOutput
from router.api.common import DONE, EventStream, SSEResponse, convert, error_type, json_response, read_json, sse
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
from router.api.openai_tools import ToolPlan, constrain, plan_tools
from router.api.sampling import estimate_tokens
from router.core import Router
from router.errors import ApiError
from router.registry import ModelEntry
from sglang_ext.entry.outputs import expand_n
from sglang_ext.messages import GenerateReq, TokenOut
from sglang_ext.sampling.params import SamplingParams

Choice = dict[str, Any]


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


class Render(ABC):
    """How one endpoint turns worker outputs into OpenAI choices."""

    object: ClassVar[str]  # of a full response
    chunk_object: ClassVar[str]  # of a streamed chunk

    @abstractmethod
    def choice(self, i: int, result: dict[str, Any]) -> Choice:
        """Choice `i` of a full response, from its SGLang result dict."""

    @abstractmethod
    def chunks(self, i: int, out: TokenOut, first: bool) -> list[Choice]:
        """The streamed choices for one output of choice `i` (`first`: its first output)."""


@dataclass
class CompletionRender(Render):
    body: CompletionRequest
    prompt_of: list[dict[str, Any]]  # the prompt of each choice (n per prompt)
    offsets: dict[int, int] = field(default_factory=dict)  # text offset of each streamed choice
    object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"

    def _echo(self, i: int, meta: dict[str, Any]) -> str:
        prompt = self.prompt_of[i]
        if "text" in prompt:
            return str(prompt["text"])
        return "".join(e[2] or "" for e in meta.get("input_token_logprobs", []) if len(e) > 2)

    def _logprobs(self, meta: dict[str, Any], offset: int, echo: bool) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        top = bool(self.body.logprobs)
        toks = meta.get("output_token_logprobs", [])
        tops = meta.get("output_top_logprobs") if top else None
        if echo:
            toks = meta.get("input_token_logprobs", []) + toks
            tops = (meta.get("input_top_logprobs", []) + (tops or [])) if top else None
        return completion_logprobs(toks, tops, offset)

    def choice(self, i: int, result: dict[str, Any]) -> Choice:
        meta = result["meta_info"]
        echo = self._echo(i, meta) if self.body.echo else ""
        reason, matched = finish(meta)
        return {"index": i, "text": echo + result["text"], "logprobs": self._logprobs(meta, 0, self.body.echo),
                "finish_reason": reason, "matched_stop": matched}

    def chunks(self, i: int, out: TokenOut, first: bool) -> list[Choice]:
        meta = out.meta_info
        text = (self._echo(i, meta) if first and self.body.echo else "") + out.text_delta
        lp = self._logprobs(meta, self.offsets.get(i, 0), echo=False)
        self.offsets[i] = self.offsets.get(i, 0) + len(text)
        reason, matched = finish(meta)
        if not (text or reason or lp):
            return []
        choice: Choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
        if reason:
            choice["matched_stop"] = matched
        return [choice]


@dataclass
class ChatRender(Render):
    body: ChatRequest
    plan: ToolPlan = field(default_factory=ToolPlan)
    outputs: dict[int, ChoiceOutput] = field(default_factory=dict)  # each streamed choice's parsers
    object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    def _logprobs(self, meta: dict[str, Any]) -> dict[str, Any] | None:
        if not self.body.logprobs or not meta.get("output_token_logprobs"):
            return None
        tops = meta.get("output_top_logprobs") if self.body.top_logprobs else None
        return chat_logprobs(meta["output_token_logprobs"], tops)

    def choice(self, i: int, result: dict[str, Any]) -> Choice:
        meta = result["meta_info"]
        lp = None
        if self.body.logprobs:
            tops = meta.get("output_top_logprobs") if self.body.top_logprobs else None
            lp = chat_logprobs(meta.get("output_token_logprobs", []), tops)
        reason, matched = finish(meta)
        out = ChoiceOutput(self.plan)
        message = out.message(result["text"])
        return {"index": i, "message": message, "logprobs": lp, "finish_reason": out.finish_reason(reason),
                "matched_stop": matched}

    def chunks(self, i: int, out: TokenOut, first: bool) -> list[Choice]:
        out_choices: list[Choice] = []
        if first:
            out_choices.append({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None})
        parsed = self.outputs.setdefault(i, ChoiceOutput(self.plan))
        reason, matched = finish(out.meta_info)
        deltas = parsed.deltas(out.text_delta, final=out.finished)
        lp = self._logprobs(out.meta_info)
        if lp and not deltas:
            deltas = [{"content": ""}]
        for k, delta in enumerate(deltas):
            out_choices.append({"index": i, "delta": delta, "logprobs": lp if k == 0 else None,
                                "finish_reason": None})
        if reason:
            out_choices.append({"index": i, "delta": {}, "logprobs": None,
                                "finish_reason": parsed.finish_reason(reason), "matched_stop": matched})
        return out_choices


_WORKER_FIELD = re.compile(r"sampling_params\.(regex|json_schema|ebnf|structural_tag)\b")


def client_field(e: ApiError, body: CompletionRequest | ChatRequest) -> ApiError:
    """A worker names a constraint it cannot compile (or will not: too large, queue full) as the native
    API's `sampling_params.json_schema`; an OpenAI client sent `response_format` (or the bare extension
    field, `json_schema`, `regex`, ...): the error names the field the client sent."""
    m = _WORKER_FIELD.match(e.message)
    if m is None:
        return e
    kind = m[1]
    name, param = kind, kind
    if getattr(body, kind) is None and body.response_format is not None:  # it came from response_format
        param = "response_format"
        name = "response_format.json_schema.schema" if body.response_format.get("type") == "json_schema" else param
    return ApiError(e.status, name + e.message[m.end():], param=param, code=e.code, headers=e.headers)


async def _respond(router: Router, request: Request, plan: GeneratePlan, render: Render, id_prefix: str,
                   n: int, include_usage: bool, body: CompletionRequest | ChatRequest) -> Response:
    await router.resilience.admission.admit(request, plan.model.name)  # 429 when over a limit
    sub = submit(router, plan)
    head = {"id": new_id(id_prefix), "object": render.object, "created": now_s(), "model": plan.model.name}
    if not plan.stream:
        try:
            results = await collect(sub, request)
        except ApiError as e:
            raise client_field(e, body) from None
        return json_response({**head, "choices": [render.choice(i, r) for i, r in enumerate(results)],
                              "usage": usage([r["meta_info"] for r in results], n)})
    events = EventStream(sub)
    try:
        first = await events.next(request)  # errors before the first token keep their HTTP status
    except ApiError as e:
        raise client_field(e, body) from None
    head["object"] = render.chunk_object
    return SSEResponse(_stream(events, first, head, render, n if include_usage else 0), on_close=sub.abort)


async def _stream(events: EventStream, first: tuple[int, TokenOut] | None, head: dict[str, Any], render: Render,
                  usage_n: int) -> AsyncIterator[bytes]:
    metas: dict[int, dict[str, Any]] = {}
    item = first
    try:
        while item is not None:
            i, out = item
            for choice in render.chunks(i, out, i not in metas):
                yield sse({**head, "choices": [choice]})
            metas[i] = out.meta_info
            item = await events.next()
        if usage_n:
            yield sse({**head, "choices": [], "usage": usage([metas[i] for i in sorted(metas)], usage_n)})
    except ApiError as e:
        # The status is already sent, so a late error travels as an event.
        yield sse({"error": {"message": e.message, "type": error_type(e.status), "code": e.status}})
    yield DONE


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

    @api.post("/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = convert(await read_json(request), CompletionRequest)
        check_completion(body)
        model = resolve_model(router.registry, body.model)
        sp = sampling_params(body, model, body.max_tokens, 16)
        prompts = completion_prompts(body.prompt)
        plan = _plan(router, model, prompts, sp, body.stream, body.logprobs is not None or body.echo,
                     body.logprobs or 0, 0 if body.echo else -1)
        render = CompletionRender(body, [p for p in prompts for _ in range(body.n)])
        return await _respond(router, request, plan, render, "cmpl", body.n, _include_usage(body), body)

    @api.post("/chat/completions")
    async def chat(request: Request) -> Response:
        body: ChatRequest = convert(await read_json(request), ChatRequest)
        model = resolve_model(router.registry, body.model)
        messages = chat_messages(body)
        info = model.info
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, model.name, info)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # No limit given: generate until the context is full, as SGLang does.
        sp = sampling_params(body, model, limit, info.context_length if info else 128)
        sp = constrain(tools, sp, grammar=info is None or info.grammar_backend != "none")
        prompt: dict[str, Any] = {"messages": messages}
        if tools.tools is not None:
            prompt["tools"] = tools.tools
        plan = _plan(router, model, [prompt], sp, body.stream, body.logprobs, body.top_logprobs or 0)
        return await _respond(router, request, plan, ChatRender(body, tools), "chatcmpl", body.n,
                              _include_usage(body), body)

    return api


def _include_usage(body: CompletionRequest | ChatRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
