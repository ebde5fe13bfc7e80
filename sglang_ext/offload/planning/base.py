"""What a policy sees of a pairing (`PairView`) and what it decides (`Decision`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

from sglang_ext.offload.planning.spec import Rule


@dataclass(frozen=True)
class PairView:
    """One pairing as the registry shows it now (figures from the latest load reports)."""

    now: float  # monotonic seconds
    sender_batch: int  # the sender's requests the router waits on, less those on the executor
    sender_kv_tokens: int  # the sender's own KV capacity (tokens)
    exec_used: int = 0  # executor KV tokens the pairing holds
    exec_free: int = 0  # executor KV tokens it could still get
    exec_low: bool = False  # free executor KV under the entry's executor_low_mem share
    host_tpot_p99_ms: float = 0.0  # the receiving worker's own requests, over a recent window
    host_tpot_samples: int = 0
    host_slo_tpot_ms: float | None = None  # the receiving model's `slo: tpot_ms`
    # A prefill worker hosting the executor (Adrenaline placement) decodes nothing: its latency is TTFT.
    host_prefill: bool = False
    host_ttft_p99_ms: float = 0.0  # first tokens it computed, over the same window
    host_ttft_samples: int = 0
    host_slo_ttft_ms: float | None = None  # the receiving model's `slo: ttft_ms`
    # The sender's own decode steps (mean, recent window): a larger share grows its batch and its steps.
    sender_step_ms: float = 0.0
    sender_steps: int = 0
    sender_slo_tpot_ms: float | None = None  # the sending model's `slo: tpot_ms`
    # Mean context (tokens) of the sender's decoding requests, offloaded ones included; 0: unknown (none
    # decoding, or a worker that does not report it)
    sender_context_tokens: float = 0.0


class Decision(NamedTuple):
    ratio: float  # the share of the sender's decoding requests that may go out now
    bound: float  # the policy's upper bound on that share
    ob: float | None  # adrenaline: OB (offloaded over local KV tokens) for the sender's C1/C2
    why: str

    def wire(self, cap: float) -> tuple[float, float]:
        """(ratio, bound) for the sender: adrenaline sends its cap and OB (C1/C2 decide per
        request); the others send the share."""
        return (cap, self.ob) if self.ob is not None else (self.ratio, 0.0)


class Policy(ABC):
    name: str

    def __init__(self, rule: Rule) -> None:
        self.rule = rule

    @abstractmethod
    def decide(self, view: PairView) -> Decision:
        """The decision for this view; may update the policy's own state (the controller's)."""

    def note_miss(self, kind: str) -> None:  # noqa: B027 - only the controller listens
        """The receiving worker missed its SLO (a request's token gap, or its executor memory ran low)."""
