"""One request's scheduling state.

Where its KV lives is one value, `home` (`KVHome`); the scheduler dispatches on it. A LOCAL
request's KV is in device pages: `pages[:cached_pages]` belong to the prefix cache (held through
the lock on `prefix_node`), `pages[cached_pages:]` are its own, and `kv_len` tokens of `fill_ids`
have KV there. A HOST request (rotated out) has no device pages: its KV is in host pages
(`rot`). A REMOTE request's KV is on an attention executor under the handle `remote`. A STAGED
request arrived from a prefill worker with its prompt's KV, copied into pages at admission.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from sglang_ext.sampling.params import InvalidRequest, SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (or, with home HOST, the rotary one)
    RUNNING = "running"
    FINISHED = "finished"


class KVHome(enum.Enum):
    LOCAL = "local"  # device pages of this worker (or none yet)
    HOST = "host"  # rotated out to host memory (preemption_mode=rotate), waiting to be resumed
    REMOTE = "remote"  # on an attention executor (remote attention)
    STAGED = "staged"  # the prompt's KV came from a prefill worker; copied into pages at admission


def check_request(req: Req, vocab_size: int, context_len: int, max_total_tokens: int) -> None:
    """Raise InvalidRequest (its message names the field) if `req` cannot be served by a model of
    this vocabulary and context length with a KV cache of `max_total_tokens` tokens."""
    if not req.input_ids:
        raise InvalidRequest("the prompt is empty: give text or input_ids with at least one token")
    if any(not 0 <= t < vocab_size for t in req.input_ids):
        raise InvalidRequest(f"input_ids must be token ids in [0, {vocab_size})")
    req.sampling.validate(vocab_size)
    n = len(req.input_ids)
    if n >= context_len:
        raise InvalidRequest(f"the prompt has {n} tokens; this model's context length is {context_len}")
    if n + 1 > max_total_tokens:
        raise InvalidRequest(f"the prompt has {n} tokens; the KV cache holds {max_total_tokens}")
    if req.top_logprobs_num < 0 or req.top_logprobs_num > 64:
        raise InvalidRequest(f"top_logprobs_num must be in [0, 64], got {req.top_logprobs_num}")


@dataclass
class FinishReason:
    type: str  # "length" | "stop" | "abort"
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.type == "length":
            d["length"] = self.length
        elif self.type == "stop":
            d["matched"] = self.matched
        else:
            d["message"] = self.message
        return d


@dataclass(eq=False)
class RotState:
    """A request's KV rotation state (scheduler/rotary.py)."""

    host_pages: list[int] = field(default_factory=list)  # HOST: host page of each page of its KV
    host_len: int = 0  # HOST: tokens of KV in host_pages
    eager: dict[int, tuple[int, int]] = field(default_factory=dict)  # page index -> (device page, host copy)
    transfers: list[Any] = field(default_factory=list)  # its copies that may be in flight
    copy_in: Any = None  # a resumed request's swap-in: it joins batches once this has landed


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    home: KVHome = KVHome.LOCAL
    # local KV
    pages: list[int] = field(default_factory=list)
    cached_pages: int = 0
    prefix_node: Any = None
    kv_len: int = 0
    cached_tokens: int = 0  # prefix-cache hit at first admission (reported in meta_info)
    admitted: bool = False  # prefix matched and pages assigned for the current residency
    num_preemptions: int = 0
    rotations: int = 0  # times its KV went to host memory and came back (meta_info)
    rot: RotState = field(default_factory=RotState)
    # remote attention (kept by offload/sender.py's RemoteSender): the executor's handle while home is REMOTE
    remote: int | None = None
    offload_checked: bool = False  # considered for offload once, at its first decode
    attention_executor: str | None = None  # set once its attention ran remotely (meta_info)
    # timing (the scheduler's clock)
    first_token_time: float | None = None
    run_start_tokens: int = 0  # output tokens it had when its current stay in the running batch began
    last_token_time: float | None = None
    # logprobs, accumulated as SGLang returns them
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    penalty_slot: int = -1  # row of the sampler's penalty table while the request has one
    token_slot: int = -1  # row of the overlap loop's token table (token_table.py) while it has one
    grammar: Any = None  # structured output: its GrammarState (sglang_ext/grammar), advanced per kept token

    def start_running(self) -> None:
        """Joins the running batch: its stay (what lvf's victim rules count, in tokens) starts now."""
        self.status = ReqStatus.RUNNING
        self.run_start_tokens = len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without concatenating the whole sequence (decode asks every step)."""
        n = len(self.input_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.fill_ids[start:end]

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    @property
    def prefilled(self) -> bool:
        """All of fill_ids except none has KV: the next forward is a decode of the last token."""
        return self.admitted and self.kv_len == self.fill_len - 1 and len(self.output_ids) > 0

    @property
    def logprob_start(self) -> int:
        """First input position whose logprob is reported (SGLang: -1 means output logprobs only)."""
        if not self.return_logprob or self.logprob_start_len < 0:
            return len(self.input_ids)
        return min(self.logprob_start_len, len(self.input_ids))
