"""A worker request as an OpenAI request to an upstream server, and its SSE stream back as the worker
outputs the core expects (`TokenOut`, SGLang's meta_info).

Chat requests (`messages`) go to /v1/chat/completions, texts and token ids to /v1/completions (a list of
ids is a valid OpenAI prompt); always streamed, with usage, whether or not the client streams: the core
folds the outputs for a client that does not. Sampling parameters beyond OpenAI's (top_k, min_p,
repetition_penalty, ignore_eos, regex, ...) are sent only when they differ from their defaults, so a
plain request suits a strict OpenAI server, and SGLang or vLLM take the rest.

What a plain OpenAI stream does not carry: token ids, prompt logprobs (echo), and the chunks of tool
calls and reasoning (only `content` is relayed). Token ids come when the upstream sends them with each
choice (`token_ids`, as vLLM does when asked with `return_token_ids`: the worker's
`upstream.return_token_ids`); otherwise each streamed chunk counts as one token with the id -1, so
/generate's `output_ids` from such a worker are placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from sglang_ext.messages import GenerateReq, TokenOut
from sglang_ext.sampling.params import SamplingParams

PLACEHOLDER_ID: Final = -1
_DEFAULTS: Final = SamplingParams()
# SGLang's names beyond OpenAI's; SGLang and vLLM both accept these on their OpenAI endpoints.
_EXTRAS: Final = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "skip_special_tokens", "no_stop_trim",
                  "stop_token_ids", "regex", "json_schema", "ebnf", "structural_tag")
_dec = msgspec.json.Decoder()


def request_body(req: GenerateReq, model: str, context_length: int,
                 token_ids: bool = False) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of `req` upstream; `token_ids`: ask for the sampled tokens' ids."""
    sp = req.sampling_params
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": sp.temperature, "top_p": sp.top_p}
    if token_ids:
        body["return_token_ids"] = True
    # A limit the size of the context is the router's "until the context is full" (chat without
    # max_tokens): the upstream knows the prompt's length, so it applies its own.
    if sp.max_new_tokens < context_length:
        body["max_tokens"] = sp.max_new_tokens
    for key, value in (("stop", sp.stop), ("seed", sp.seed), ("logit_bias", sp.logit_bias)):
        if value is not None:
            body[key] = value
    for key in ("presence_penalty", "frequency_penalty"):
        if getattr(sp, key) != 0.0:
            body[key] = getattr(sp, key)
    if sp.min_new_tokens:
        body["min_tokens"] = sp.min_new_tokens
    for key in _EXTRAS:
        if getattr(sp, key) != getattr(_DEFAULTS, key):
            body[key] = getattr(sp, key)
    if req.messages is not None:
        body["messages"] = req.messages
        if req.return_logprob:
            body["logprobs"] = True
            if req.top_logprobs_num:
                body["top_logprobs"] = req.top_logprobs_num
        return "/v1/chat/completions", body
    body["prompt"] = req.input_ids if req.input_ids is not None else (req.text or "")
    if req.return_logprob:
        body["logprobs"] = req.top_logprobs_num
    return "/v1/completions", body


def _triple(lp: Any, text: Any, token_id: int = PLACEHOLDER_ID) -> list[Any]:
    """An SGLang logprob entry, [logprob, token id, token text]; the id is -1 where the stream has none."""
    return [lp, token_id, text]


def _ids_for(ids: list[int] | None, n: int) -> list[int]:
    """The chunk's token ids for its n logprob entries, if they are as many; else placeholders."""
    return ids if ids is not None and len(ids) == n else [PLACEHOLDER_ID] * n


def _completion_logprobs(lp: dict[str, Any], ids: list[int] | None) -> dict[str, Any]:
    values, texts = lp.get("token_logprobs") or [], lp.get("tokens") or []
    n = min(len(values), len(texts))
    meta: dict[str, Any] = {"output_token_logprobs": [_triple(v, t, i) for v, t, i in
                                                      zip(values[:n], texts[:n], _ids_for(ids, n), strict=True)]}
    tops = lp.get("top_logprobs")
    if tops:
        meta["output_top_logprobs"] = [[_triple(v, t) for t, v in (row or {}).items()] for row in tops]
    return meta


def _chat_logprobs(lp: dict[str, Any], ids: list[int] | None) -> dict[str, Any]:
    content = lp.get("content") or []
    meta: dict[str, Any] = {"output_token_logprobs": [_triple(c.get("logprob"), c.get("token"), i) for c, i in
                                                      zip(content, _ids_for(ids, len(content)), strict=True)]}
    if any(c.get("top_logprobs") for c in content):
        meta["output_top_logprobs"] = [[_triple(t.get("logprob"), t.get("token")) for t in c.get("top_logprobs") or []]
                                       for c in content]
    return meta


class UpstreamError(Exception):
    """The upstream reported an error inside its stream."""


@dataclass
class StreamParser:
    """The SSE lines of one upstream response in, worker outputs out."""

    rid: str
    chat: bool
    finish: Any = None
    matched: Any = None
    usage: dict[str, Any] = field(default_factory=dict)
    chunks: int = 0
    tokens: int = 0  # token ids the upstream sent (0 if it sends none)
    done: bool = False

    def feed(self, line: str) -> TokenOut | None:
        """The output of one SSE line, if it has one (text or logprobs); raises UpstreamError."""
        if not line.startswith("data:") or self.done:
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = _dec.decode(data)
        except msgspec.DecodeError:
            raise UpstreamError(f"a malformed event in its stream: {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            return None
        if chunk.get("error"):
            err = chunk["error"]
            raise UpstreamError(str(err.get("message", err) if isinstance(err, dict) else err))
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return None
        c = choices[0]
        if c.get("finish_reason"):
            self.finish, self.matched = c["finish_reason"], c.get("matched_stop")
        text = ((c.get("delta") or {}).get("content") if self.chat else c.get("text")) or ""
        raw = c.get("token_ids")
        ids = [int(t) for t in raw if isinstance(t, int)] if isinstance(raw, list) else None
        lp = c.get("logprobs")
        meta = ((_chat_logprobs(lp, ids) if self.chat else _completion_logprobs(lp, ids)) if isinstance(lp, dict)
                else {})
        if not text and not meta and not ids:
            return None
        self.chunks += 1
        self.tokens += len(ids or ())
        return TokenOut(rid=self.rid, text_delta=text, token_ids=ids if ids is not None else [PLACEHOLDER_ID],
                        finished=False, meta_info=meta)

    def last(self) -> TokenOut:
        """The closing output, once the stream ended: finish reason and token counts."""
        completion = int(self.usage.get("completion_tokens") or self.tokens or self.chunks)
        if self.finish == "stop":
            reason: dict[str, Any] = {"type": "stop", "matched": self.matched}
        elif self.finish == "length":
            reason = {"type": "length", "length": completion}
        elif self.finish is None:
            reason = {"type": "abort", "message": "the upstream ended its stream without a finish reason"}
        else:  # tool_calls, content_filter, ...: finished, for the upstream's reason
            reason = {"type": "stop", "matched": None, "upstream": self.finish}
        details = self.usage.get("prompt_tokens_details") or {}
        meta = {"prompt_tokens": int(self.usage.get("prompt_tokens") or 0), "completion_tokens": completion,
                "cached_tokens": int(details.get("cached_tokens") or 0), "finish_reason": reason}
        return TokenOut(rid=self.rid, text_delta="", token_ids=[], finished=True, meta_info=meta)
