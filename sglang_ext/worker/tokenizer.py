"""Tokenizer side of a worker: encode prompts, apply chat templates, stream text out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sglang_ext.sampling.params import InvalidRequest


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.eos_ids = frozenset(i for i in [self.hf.eos_token_id] if i is not None)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise InvalidRequest("this model's tokenizer has no chat template; use /v1/completions")
        try:
            # return_dict=False: a plain id list on transformers 4.x and 5.x alike.
            ids = self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        except Exception as e:  # template errors are the caller's input problem
            raise InvalidRequest(f"messages could not be formatted with the chat template: {e}") from None
        if hasattr(ids, "keys"):  # a BatchEncoding despite return_dict=False
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id])


class IncrementalDetokenizer:
    """Emits text as tokens arrive without re-decoding everything (offsets as in vLLM/SGLang):
    decode a short surrounding window and hold back output ending in an incomplete UTF-8 char."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool, stop: list[str] | None, keep_stop: bool) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.surr = 0  # window start
        self.read = 0  # tokens already turned into emitted text
        self.text = ""  # all text decided so far
        self.sent = 0  # chars of self.text already emitted
        self.stop = stop or []
        self.keep_stop = keep_stop

    def add(self, new_ids: list[int], finished: bool, matched_stop: str | None) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.surr : self.read], self.skip)
        full = self.tok.decode(self.ids[self.surr :], self.skip)
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self.surr, self.read = self.read, len(self.ids)
        limit = len(self.text)
        if matched_stop is not None:
            at = self.text.find(matched_stop)
            if at >= 0:
                limit = at + (len(matched_stop) if self.keep_stop else 0)
        elif self.stop and not finished:
            # Hold back a tail that could be the start of a stop string.
            hold = max(len(s) for s in self.stop) - 1
            limit = max(len(self.text) - hold, self.sent)
        out = self.text[self.sent : max(limit, self.sent)]
        self.sent = max(limit, self.sent)
        return out
