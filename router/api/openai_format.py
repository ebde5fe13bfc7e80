"""Worker outputs (SGLang meta_info) rendered as OpenAI objects: finish reasons, logprobs, usage.

Logprob entries arrive as SGLang triples `[logprob, token_id, token_text]` (the router always asks
for the text), top logprobs as lists of such triples.
"""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def finish(meta: dict[str, Any]) -> tuple[str | None, Any]:
    """OpenAI finish_reason and SGLang's matched_stop from a meta_info."""
    reason = meta.get("finish_reason")
    if not isinstance(reason, dict):
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    if kind == "length":
        return "length", None
    return "abort", None


def _text(entry: list[Any]) -> str:
    return entry[2] if len(entry) > 2 and entry[2] is not None else ""


def completion_logprobs(tokens: list[list[Any]], tops: list[Any] | None, offset: int) -> dict[str, Any]:
    """The `logprobs` object of a completion choice; `offset` is where the text of `tokens` starts."""
    texts = [_text(t) for t in tokens]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    top = None
    if tops is not None:
        top = [None if row is None else {_text(e): e[0] for e in row} for row in tops]
    return {"tokens": texts, "token_logprobs": [t[0] for t in tokens], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokens: list[list[Any]], tops: list[Any] | None) -> dict[str, Any]:
    content = []
    for i, t in enumerate(tokens):
        text = _text(t)
        item: dict[str, Any] = {"token": text, "logprob": t[0], "bytes": list(text.encode()), "top_logprobs": []}
        if tops is not None and i < len(tops) and tops[i] is not None:
            item["top_logprobs"] = [{"token": _text(e), "logprob": e[0], "bytes": list(_text(e).encode())}
                                    for e in tops[i]]
        content.append(item)
    return {"content": content}


def usage(metas: list[dict[str, Any]], n: int) -> dict[str, int]:
    """Usage over choices: prompt tokens once per prompt (choices come n per prompt, prompt-major)."""
    prompt = sum(int(m.get("prompt_tokens", 0)) for m in metas[::n])
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas)
    cached = sum(int(m.get("cached_tokens", 0)) for m in metas[::n])
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[assignment]
    return out
