"""What the scheduler's members see of the loop: its queues, KV manager, policy, clock and the few
operations that move a request between queues.

Members (`member.py` and its subclasses) and the overlap loop are typed against `LoopView`, never
against `Scheduler`: `Scheduler` satisfies the protocol structurally, so nothing below
`scheduler.py` imports it and the package's modules import each other without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.kvcache.pool import KVPool
from sglang_ext.scheduler.kv_manager import KVManager
from sglang_ext.scheduler.output import DecodeFn
from sglang_ext.scheduler.policy import SchedulePolicy
from sglang_ext.scheduler.request import FinishReason, Req


class Runner(Protocol):
    """The model runner as the scheduler uses it."""

    device: torch.device
    num_pages: int
    context_len: int
    pool: KVPool

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


class LoopView(Protocol):
    """The loop's state and operations a member may use."""

    runner: Runner
    eos_ids: frozenset[int]
    decode_fn: DecodeFn | None  # token ids -> text, for stop strings
    page_size: int
    chunk: int  # prefill tokens per step
    max_running: int
    waiting: list[Req]
    running: list[Req]
    rotary: list[Req]  # home HOST: KV in host memory (preemption_mode=rotate)
    kv: KVManager
    policy: SchedulePolicy
    clock: Callable[[], float]
    # rid -> (tokens, in-logprobs, out-logprobs) reported so far
    sent: dict[str, tuple[int, int, int]]
    deficit: int  # pages by which all requests' KV exceeds the pool this iteration (0: it fits)
    prefill_tokens: int  # counters of a step profile
    remote_forward_rows: int

    def validate(self, req: Req) -> None:
        """Raise InvalidRequest if `req` cannot be served here."""
        ...

    def start_running(self, r: Req, queue: list[Req]) -> None:
        """`r` leaves `queue` (waiting or rotary) for the running batch."""
        ...

    def requeue(self, r: Req) -> None:
        """A preempted request (it holds no KV) goes back to the waiting queue's head."""
        ...

    def release_kv(self, r: Req) -> None:
        """`r` lets go of its KV wherever it lives (every member's part, then its local pages)."""
        ...

    def finish(self, r: Req, reason: FinishReason) -> None: ...

    def decode_reserve(self) -> int:
        """Pages kept free for running requests' next tokens."""
        ...

    def drop_penalties(self, r: Req) -> None: ...
