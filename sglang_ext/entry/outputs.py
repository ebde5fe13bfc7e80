"""Helpers shared by every client of the workers (the offline Engine and the router).

Workers stream deltas (`TokenOut`); clients fold them into SGLang's cumulative result dicts, and
expand `n > 1` into `n` single-sample requests (a worker only takes n=1).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from sglang_ext.sampling.params import SamplingParams

# meta_info keys whose per-message values are appended, not replaced.
LOGPROB_KEYS: Final = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")


def new_result() -> dict[str, Any]:
    return {"text": "", "output_ids": [], "meta_info": {}}


def merge_output(acc: dict[str, Any], text: str, ids: list[int], meta: dict[str, Any]) -> None:
    """Fold one delta into `acc` (a `new_result()` dict); logprob lists accumulate."""
    acc["text"] += text
    acc["output_ids"].extend(ids)
    old = acc["meta_info"]
    for key in LOGPROB_KEYS:
        if key in meta:
            meta[key] = old.get(key, []) + meta[key]
    old.update(meta)


def expand_n(sp: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per sample; sample k of a seeded request uses seed + k (reproducible, distinct)."""
    return [
        msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + k) for k in range(sp.n)
    ]
