"""SGLang sampling parameters, validated once at the edge with messages that name the parameter."""

from __future__ import annotations

from typing import Any

import msgspec


class InvalidRequest(ValueError):
    """A request the server rejects (HTTP 400); the message names the offending parameter."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    min_new_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (as a string, as in OpenAI) -> added to its logit
    # structured output (sglang_ext/grammar): at most one; compiled by the worker
    regex: str | None = None
    json_schema: str | None = None  # a JSON schema, as a JSON string
    ebnf: str | None = None
    structural_tag: str | None = None  # JSON: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"sampling_params.{name} {why}, got {getattr(self, name)!r}")

        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if not 1 <= self.n <= 64:
            raise bad("n", "must be in [1, 64]")
        if self.min_new_tokens < 0 or self.min_new_tokens > max(self.max_new_tokens, 0):
            raise bad("min_new_tokens", "must be in [0, max_new_tokens]")
        if self.stop is not None and any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        ids = self.stop_token_ids or []
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            raise bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        for key, bias in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or (vocab_size is not None and not 0 <= int(key) < vocab_size):
                raise bad("logit_bias", f"keys must be token ids in [0, {vocab_size or 'vocab'})")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", "must be in [0, 2**63)")
        self._validate_constraint()

    def _validate_constraint(self) -> None:
        """Cheap checks only (the router has no tokenizer): the worker compiles and reports the rest."""
        given = [k for k in ("regex", "json_schema", "ebnf", "structural_tag") if getattr(self, k) is not None]
        if len(given) > 1:
            raise InvalidRequest(f"sampling_params: give at most one of regex, json_schema, ebnf and "
                                 f"structural_tag (response_format counts as json_schema); got {', '.join(given)}")
        if not given:
            return
        kind = given[0]
        text: str = getattr(self, kind)
        if not text.strip():
            raise InvalidRequest(f"sampling_params.{kind} must not be empty")
        if kind in ("json_schema", "structural_tag"):
            try:
                value = msgspec.json.decode(text)
            except msgspec.DecodeError as e:
                raise InvalidRequest(f"sampling_params.{kind} is not valid JSON: {e}") from None
            if not isinstance(value, dict | bool) or (kind == "structural_tag" and not isinstance(value, dict)):
                raise InvalidRequest(f"sampling_params.{kind} must be a JSON object, got {type(value).__name__}")


def parse_sampling_params(raw: dict[str, Any] | SamplingParams | None) -> SamplingParams:
    """Strictly convert user JSON (dict) into SamplingParams; unknown keys and wrong types are errors."""
    if isinstance(raw, SamplingParams):
        return raw
    raw = dict(raw or {})
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    if isinstance(raw.get("stop_token_ids"), int):
        raw["stop_token_ids"] = [raw["stop_token_ids"]]
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as e:
        raise InvalidRequest(f"sampling_params: {e}") from None
