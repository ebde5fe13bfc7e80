"""Turn client sampling parameters into validated `SamplingParams`, with errors that name the field.

SGLang clients (the frontend among them) send keys this engine does not implement (`stop_regex`,
`custom_params`, ...) set to null or empty; those are dropped. Set to a value, they are a 400, never
ignored. Constraints (`regex`, `json_schema`, `ebnf`, `structural_tag`) pass through: the worker
compiles them (and answers a 400 naming the problem if one does not compile).
"""

from __future__ import annotations

from typing import Any, Final

from router.errors import ApiError
from router.registry import ModelEntry
from sglang_ext.sampling.params import InvalidRequest, SamplingParams, parse_sampling_params

UNSUPPORTED: Final = ("stop_regex", "custom_params", "lora_path", "stream_interval")


def make_sampling_params(raw: Any, model: ModelEntry, where: str = "sampling_params") -> SamplingParams:
    """`where` prefixes field names in messages ("sampling_params[1]"); "" names them bare (OpenAI)."""

    def name(key: str) -> str:
        return f"{where}.{key}" if where else key

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where or 'sampling parameters'} must be an object, got {type(raw).__name__}")
    clean = {k: v for k, v in raw.items() if v is not None}
    if "sampling_seed" in clean:  # SGLang's name for the seed
        clean.setdefault("seed", clean.pop("sampling_seed"))
    for key in UNSUPPORTED:
        value = clean.pop(key, None)
        if value not in (None, "", [], {}, ()):
            raise ApiError(400, f"{name(key)} is not supported by this server", param=key)
    try:
        sp = parse_sampling_params(clean)
        info = model.info
        sp.validate(info.vocab_size if info else None)
    except InvalidRequest as e:
        msg = str(e).replace("sampling_params.", name(""), 1).replace("sampling_params:", f"{where or 'request'}:", 1)
        raise ApiError(400, msg) from None
    check_max_tokens(sp.max_new_tokens, model, name("max_new_tokens"))
    return sp


def check_max_tokens(n: int, model: ModelEntry, name: str) -> None:
    info = model.info
    if n < 0:
        raise ApiError(400, f"{name} must be >= 0, got {n}", param=name)
    if info is not None and n > info.context_length:
        raise ApiError(400, f"{name} is {n}, more than this model's context length ({info.context_length})",
                       param=name)


def estimate_tokens(text: str) -> int:
    """Prompt length before the worker tokenizes it, for load balancing only."""
    return len(text) // 4 + 1
