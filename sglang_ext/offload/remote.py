"""The sender's view of one executor: `RemoteAttention`, and the in-process (`local`) transport.

Every transport has the same calls. Per request: `load` (its prefilled KV, once) and `release`.
Per decode step: `begin_step` (which requests, at which positions; once, ahead of the layers), then
per layer `post` (q, k, v out) and `collect` (the output back) -- the sender runs its local rows'
attention in between, so the two overlap where the transport is asynchronous. A transport that loses its executor raises
`ExecutorLost`; the sender then takes every request back and recomputes it locally.

Overlap scheduling (`scheduler/overlap.py`) plans step t+1 (`begin_step` at positions one past the
landed length) while step t may still run on the device, and releases a request that finished at t
although it is planned into t+1. Every transport allows that: the executor orders those calls after
step t (each transport's class says how).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from sglang_ext.offload.executor import AttentionExecutor, ExecutorFull, GuestSpec


class ExecutorLost(RuntimeError):
    """The executor (or its worker) is gone or stopped answering."""


class RemoteAttention(ABC):
    executor_id: str  # reported to users as meta_info.attention_executor
    graph_capturable = False  # post/collect are pure stream operations (decode graphs may hold them)

    def __init__(self) -> None:
        self.wait_s = 0.0  # time the sender spent waiting on the executor
        self.bytes_out = 0  # q, k, v and KV loads sent
        self.bytes_in = 0  # attention outputs received
        self.staged_loads = 0  # KV loads that went GPU to GPU through the host's stage (cuda_ipc)
        self.begins = 0  # begin_step calls so far (a step's number, for results_forged)
        self.alive = True

    @abstractmethod
    def load(self, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        """Move a request's KV ([n_pages, layers, 2, P, H, D] covering `length` tokens) to the
        executor, which also sets pages aside for `reserve_tokens` tokens in all (its longest). False
        when it has no room (the request stays local)."""

    @abstractmethod
    def release(self, handle: int) -> None: ...

    @abstractmethod
    def begin_step(self, handles: list[int], positions: list[int]) -> list[int]:
        """Plan a decode step; returns the handles the executor dropped (no room to grow)."""

    @abstractmethod
    def post(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Send one layer's q, k, v ([R, H, D]) of the planned rows."""

    @abstractmethod
    def collect(self, layer: int) -> torch.Tensor:
        """That layer's attention output [R, Hq, D], on the sender's device."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.post(layer, q, k, v)
        return self.collect(layer)

    def results_forged(self, upto: int | None = None) -> bool:
        """True once a step's remote rows may have completed without the executor's results: a
        GPU-signalled transport whose watchdog raised the completion flags itself (the executor died
        mid-step), or a host that left out rows of a step already launched. Asked after a step
        landed, with `upto` = `begins` when that step was planned: their tokens are then dropped and
        the requests recomputed. Transports that raise ExecutorLost in the forward never forge."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class LocalRemote(RemoteAttention):
    """An executor in this process, on this device or another one (`cuda:1`): calls, no messages."""

    # Overlap: every call runs the executor's work on its device's current stream, in call order: a
    # plan for t+1 or a release lands behind step t's kernels there, and freed pages are only written
    # again by later work on that stream; the backend waits for its own previous plan's staging copy.

    def __init__(self, executor: AttentionExecutor, guest: str, spec: GuestSpec, executor_id: str = "local") -> None:
        super().__init__()
        self._out: torch.Tensor | None = None
        self.executor = executor
        self.guest = guest
        self.executor_id = executor_id
        executor.attach(guest, spec)

    def load(self, handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
        self._check()
        try:
            self.executor.load(self.guest, handle, kv, length, reserve_tokens=reserve_tokens)
        except ExecutorFull:
            return False
        self.bytes_out += kv.numel() * kv.element_size()
        return True

    def release(self, handle: int) -> None:
        if self.alive:
            self.executor.release(self.guest, handle)

    def begin_step(self, handles: list[int], positions: list[int]) -> list[int]:
        self._check()
        return self.executor.plan(self.guest, handles, positions)

    def post(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check()
        t0 = time.perf_counter()
        o = self.executor.attend(self.guest, layer, q, k, v)
        self._out = o.to(q.device) if o.device != q.device else o
        self.wait_s += time.perf_counter() - t0
        self.bytes_out += sum(t.numel() * t.element_size() for t in (q, k, v))
        self.bytes_in += o.numel() * o.element_size()

    def collect(self, layer: int) -> torch.Tensor:
        self._check()
        assert self._out is not None, "collect before post"
        out, self._out = self._out, None
        return out

    def _check(self) -> None:
        if not self.alive:
            raise ExecutorLost(f"executor {self.executor_id} is gone")
