"""SGLang's `/generate` request: single or batch, text or token ids, expanded into worker requests.

Shapes follow SGLang: `text: str` or `input_ids: list[int]` is one prompt (a dict comes back, or a
list of n dicts when n > 1); a list of them is a batch (a list comes back, n per prompt, prompt-major).
Per-prompt fields (`sampling_params`, `return_logprob`, ...) may be one value or one per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

from router.api.answers import note_model
from router.api.common import convert, quote
from router.api.sampling import estimate_tokens, make_sampling_params
from router.errors import ApiError
from router.registry import ModelEntry, Registry
from sglang_ext.entry.outputs import expand_n
from sglang_ext.messages import GenerateReq

# SGLang fields this server accepts only when unset (null / false / empty).
_UNSET_ONLY: Final = ("image_data", "video_data", "audio_data", "input_embeds", "lora_path", "session_params",
                      "custom_logit_processor", "return_hidden_states", "bootstrap_host", "bootstrap_port",
                      "bootstrap_room", "data_parallel_rank", "modalities", "token_ids_logprob",
                      "return_routed_experts", "priority", "extra_key")
_IGNORED: Final = ("log_metrics", "no_logs", "stream_options", "background", "routed_dp_rank")


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # list[int] or list[list[int]]; checked below
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    model: str | None = None  # extension: which served model (default: the first)


@dataclass
class GeneratePlan:
    model: ModelEntry
    reqs: list[GenerateReq]
    est_tokens: list[int]
    single: bool  # one prompt, n=1: answer with a dict, not a list
    stream: bool


def resolve_model(registry: Registry, name: str | None) -> ModelEntry:
    m = registry.resolve(name)
    if m is None:
        known = ", ".join(sorted(registry.models)) or "none yet"
        if name:
            raise ApiError(404, f"model {quote(name)} is not served here (served: {known})", param="model",
                           code="model_not_found")
        raise ApiError(503, "no model is registered yet; wait for a worker to start")
    note_model(m.name)  # the model_name of this request's answer in sglang:num_requests_total
    return m


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ApiError(400, f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value
    return [value] * n


def _check_ids(ids: Any, name: str) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, f"{name} must be a list of token ids (integers)", param="input_ids")
    return ids


def parse_generate(data: dict[str, Any], registry: Registry, new_rid: Any) -> GeneratePlan:
    for key in _IGNORED:
        data.pop(key, None)
    for key in _UNSET_ONLY:
        value = data.pop(key, None)
        if value not in (None, False, "", [], {}):
            raise ApiError(400, f"{key} is not supported by this server", param=key)
    body: GenerateBody = convert(data, GenerateBody)
    model = resolve_model(registry, body.model)
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids")
    prompts: list[dict[str, Any]]
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [{"text": t} for t in texts]
        est = [estimate_tokens(t) for t in texts]
    else:
        ids = body.input_ids or []
        batch = bool(ids) and isinstance(ids[0], list)
        if batch:
            seqs = [_check_ids(x, f"input_ids[{i}]") for i, x in enumerate(ids)]
        else:
            seqs = [_check_ids(ids, "input_ids")]
        prompts = [{"input_ids": s} for s in seqs]
        est = [len(s) for s in seqs]
    if not prompts:
        raise ApiError(400, "the batch is empty: give at least one prompt")
    n = len(prompts)
    raw_sp = _per_prompt(body.sampling_params, n, "sampling_params")
    want_lp = _per_prompt(body.return_logprob, n, "return_logprob")
    start = _per_prompt(body.logprob_start_len, n, "logprob_start_len")
    for v in start:
        if v < -1:
            raise ApiError(400, f"logprob_start_len must be >= 0, or -1 for no prompt logprobs; got {v}",
                           param="logprob_start_len")
    top = _per_prompt(body.top_logprobs_num, n, "top_logprobs_num")
    rids = _per_prompt(body.rid, n, "rid") if body.rid is not None else [None] * n
    reqs: list[GenerateReq] = []
    ests: list[int] = []
    for i in range(n):
        where = f"sampling_params[{i}]" if isinstance(body.sampling_params, list) else "sampling_params"
        sp = make_sampling_params(raw_sp[i], model, where)
        samples = expand_n(sp)
        base = rids[i] or new_rid()
        for k, child in enumerate(samples):
            rid = base if len(samples) == 1 else f"{base}-{k}"
            reqs.append(GenerateReq(
                rid=rid, sampling_params=child, return_logprob=want_lp[i], logprob_start_len=start[i],
                top_logprobs_num=top[i], return_text_in_logprobs=body.return_text_in_logprobs,
                stream=body.stream, **prompts[i],
            ))
            ests.append(est[i])
    return GeneratePlan(model, reqs, ests, single=not batch and len(reqs) == 1, stream=body.stream)
