"""What the router tracks: each worker's state (`WorkerState`), each request's (`RequestState`), and a
`Submission`: the sub-requests of one HTTP request. Workers and requests refer to each other (a worker's
in-flight requests, a request's worker), so both live here.

Every sub-request (a prompt of a batch, a sample of n) is one worker request with its own rid; they
share one queue, tagged with their index, so an HTTP handler waits on a single queue whatever the
shape of the request. A failure (worker down, bad input) arrives on the same queue as tokens do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang_ext.messages import GenerateReq, LoadReport, TokenOut, WorkerInfo


@dataclass(frozen=True)
class Failure:
    status: int
    message: str


@dataclass(frozen=True)
class Restart:
    """A non-streaming sub-request starts over on another attempt (its worker failed): what was
    collected of it so far is void. Never sent once a stream has output (router/resilience/)."""

    reason: str


Item = tuple[int, TokenOut | Failure | Restart]


@dataclass
class Supervision:
    """A worker this launcher started, as a process (`procs.LocalWorkers` keeps it up to date)."""

    state: str = "running"  # running | restarting | gave up (a configuration error at its first start only)
    restarts: int = 0
    fast_crashes: int = 0  # crashes in a row, each soon after its start
    ever_up: bool = False
    last_exit: str = ""  # how its last process ended: "exited with code -9", "could not be started (...)"
    started_at: float = 0.0  # monotonic
    restart_at: float = 0.0  # monotonic, while restarting
    gave_up_detail: str = ""


@dataclass(eq=False)
class WorkerState:
    worker_id: str
    model: str
    role: str = "serve"
    info: WorkerInfo | None = None
    up: bool = False
    last_seen: float = 0.0
    load: LoadReport | None = None
    inflight: dict[str, RequestState] = field(default_factory=dict)
    outstanding_tokens: int = 0  # prompt tokens not yet prefilled + output tokens not yet generated
    num_served: int = 0  # requests placed here since the router started
    supervision: Supervision | None = None  # only for workers the launcher started

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    @property
    def state(self) -> str:
        """up | starting | restarting | gave up | down | not connected."""
        sup = self.supervision
        if self.up:
            return "up"
        if sup is None:
            return "down" if self.info is not None else "not connected"
        if sup.state == "running":
            # Heard from since this process started, but silent now (hung): down; else still starting.
            return "down" if self.last_seen > sup.started_at else "starting"
        return sup.state

    def describe(self) -> str:
        """The state in words, for /health and logs: what a person needs to know about this worker."""
        state, sup = self.state, self.supervision
        if sup is None or state in ("up", "down"):
            return state
        if state == "starting":
            return f"starting (restart {sup.restarts})" if sup.restarts else "starting"
        if state == "restarting":
            wait = max(0.0, sup.restart_at - time.monotonic())
            loop = f", {sup.fast_crashes} crashes in a row" if sup.fast_crashes > 1 else ""
            return f"restarting (restart {sup.restarts + 1} in {wait:.1f} s; it {sup.last_exit}{loop})"
        return f"gave up: {sup.gave_up_detail}"


@dataclass(eq=False)
class RequestState:
    rid: str
    index: int
    model: str
    worker: WorkerState
    sink: asyncio.Queue[Item]
    max_new_tokens: int
    est_prompt_tokens: int
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    charged: int = 0  # this request's share of worker.outstanding_tokens
    tbt_missed: bool = False
    done: bool = False
    req: GenerateReq | None = None  # as the client gave it (a retry sends it again)
    retries: int = 0
    delivered: bool = False  # something of it reached the client's queue (then only a non-stream is retried)
    restarted: bool = False  # retried after output was collected (its first token's metrics were counted)
    # disaggregated: `worker` is the prefill worker until the first token came (`handed`), then the decode one
    prefill: WorkerState | None = None
    decode: WorkerState | None = None
    pairing: str = ""
    handed: bool = False
    early: list[TokenOut] = field(default_factory=list)  # the decode worker's, come before the first token
    pd_meta: dict[str, Any] = field(default_factory=dict)  # meta_info the prefill worker knows best
    first_token_id: int = -1  # the prefill worker's first token, once handed
    resumed: bool = False  # its KV never came: the decode worker recomputes the prompt

    def remaining_tokens(self) -> int:
        prefill = 0 if self.first_token is not None else (self.prompt_tokens or self.est_prompt_tokens)
        return prefill + max(0, self.max_new_tokens - self.completion_tokens)

    def move_to(self, worker: WorkerState) -> None:
        """The request is now `worker`'s to finish (the hand-off to the decode worker)."""
        self.worker.outstanding_tokens -= self.charged
        self.charged = 0
        self.worker = worker
        self.recharge()

    def recharge(self) -> None:
        """Bring the worker's outstanding-token count in line with this request's progress."""
        new = 0 if self.done else self.remaining_tokens()
        self.worker.outstanding_tokens += new - self.charged
        self.charged = new


class Submission:
    """The router-side handle of one HTTP request: its sub-requests and their shared event queue."""

    def __init__(self, states: list[RequestState], sink: asyncio.Queue[Item],
                 abort: Callable[[RequestState], None]) -> None:
        self.states = states
        self.sink = sink
        self._abort = abort

    @property
    def finished(self) -> bool:
        return all(s.done for s in self.states)

    async def next(self, timeout: float | None = None) -> Item | None:
        """The next event, or None after `timeout` seconds without one."""
        if timeout is None:
            return await self.sink.get()
        try:
            return await asyncio.wait_for(self.sink.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def abort(self) -> None:
        """Abort every sub-request still running (client gone, or a sibling failed)."""
        for s in self.states:
            if not s.done:
                self._abort(s)
