"""OpenAI request bodies (typed, strict on types) and their translation to SGLang sampling params.

Unknown keys are ignored, as OpenAI-compatible servers do (clients add new fields freely); the
known ones must have the right types. SGLang's extensions (top_k, min_p, ignore_eos, ...) are
accepted, as SGLang's OpenAI server accepts them.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from router.api.common import quote
from router.api.openai_tools import template_calls
from router.api.sampling import check_max_tokens, make_sampling_params
from router.errors import ApiError
from router.registry import ModelEntry
from sglang_ext.sampling.params import SamplingParams

_MAX_LOGPROBS_COMPLETIONS = 5
_MAX_TOP_LOGPROBS_CHAT = 20
CHAT_ROLES: Final = ("system", "developer", "user", "assistant", "tool", "function")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stop_token_ids: list[int] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # str, list[str], list[int] or list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to that call


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


def sampling_params(body: _Common, model: ModelEntry, max_tokens: int | None, default_max: int) -> SamplingParams:
    if not 1 <= body.n <= 64:
        raise ApiError(400, f"n must be in [1, 64], got {body.n}", param="n")
    n_tokens = default_max if max_tokens is None else max_tokens
    check_max_tokens(n_tokens, model, "max_tokens")
    raw: dict[str, Any] = {
        "max_new_tokens": n_tokens, "temperature": body.temperature, "top_p": body.top_p, "n": body.n,
        "stop": body.stop, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty, "seed": body.seed, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "min_new_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos, "skip_special_tokens": body.skip_special_tokens,
        "no_stop_trim": body.no_stop_trim, "stop_token_ids": body.stop_token_ids,
        "logit_bias": body.logit_bias, "regex": body.regex, "json_schema": body.json_schema, "ebnf": body.ebnf,
        "structural_tag": body.structural_tag,
    }
    fmt = response_format(body.response_format)
    if fmt is not None:
        key, text = fmt
        if raw[key] is not None:
            raise ApiError(400, f"give response_format or {key}, not both", param="response_format")
        raw[key] = text
    return make_sampling_params(raw, model, "")


def response_format(rf: dict[str, Any] | None) -> tuple[str, str] | None:
    """OpenAI's `response_format` as a constraint, as SGLang maps it: json_object -> any JSON object,
    json_schema -> its `schema`, structural_tag -> the object itself; text -> none."""
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return "json_schema", msgspec.json.encode(schema).decode()
    if kind == "structural_tag":
        return "structural_tag", msgspec.json.encode(rf).decode()
    raise ApiError(400, f"response_format type must be text, json_object, json_schema or structural_tag; "
                   f"got {quote(kind)}", param="response_format")


def completion_prompts(prompt: str | list[Any]) -> list[dict[str, Any]]:
    """The prompts of a completion request as worker-request fields (`text` or `input_ids`)."""
    if isinstance(prompt, str):
        return [{"text": prompt}]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [{"text": p} for p in prompt]
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [{"input_ids": list(prompt)}]
    if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return [{"input_ids": list(p)} for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids, or a list of such lists",
                   param="prompt")


def check_completion(body: CompletionRequest) -> None:
    if body.logprobs is not None and not 0 <= body.logprobs <= _MAX_LOGPROBS_COMPLETIONS:
        raise ApiError(400, f"logprobs must be in [0, {_MAX_LOGPROBS_COMPLETIONS}], got {body.logprobs}",
                       param="logprobs")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of other than n is not supported", param="best_of")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")


def chat_messages(body: ChatRequest) -> list[dict[str, Any]]:
    """Messages for the chat template: content parts joined into text (images are refused); earlier tool
    calls and tool answers kept for the template."""
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= _MAX_TOP_LOGPROBS_CHAT:
            raise ApiError(400, f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS_CHAT}]", param="top_logprobs")
        if not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    out = []
    for i, m in enumerate(body.messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {quote(m.role)}",
                           param="messages")
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = template_calls(i, m.tool_calls)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
