"""The settings of the offload policies that no report carries (a cluster file's `offload:` entry's
`adaptive:` / `adrenaline:`, a worker's `--offload-adaptive`), and what a policy needs of its rule.

Here, below both the router and the worker, so one policy class serves a served pairing (the router's
planner) and an in-process executor (the worker's own, sglang_ext/worker/local_planning.py).
"""

from __future__ import annotations

from typing import Annotated, Protocol

import msgspec
from msgspec import Meta


class Rule(Protocol):
    """What a policy reads of its rule: router/config.py's OffloadSpec, or a worker's LocalRule."""

    @property
    def policy(self) -> str: ...

    @property
    def adaptive(self) -> AdaptiveSpec | None: ...

    @property
    def adrenaline(self) -> AdrenalineSpec | None: ...

    @property
    def cap(self) -> float:
        """The largest share the policy may give (fixed: its ratio)."""
        ...

    @property
    def start(self) -> float:
        """The share a new pairing starts with."""
        ...


class AdrenalineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Inputs of Adrenaline's bound OB(n, B_max) that no report carries
    (sglang_ext/offload/planning/adrenaline.py)."""

    # The decode batch at which the sender's dense kernels turn compute-bound. Llama-3-8B on an H200
    # (measured): a layer's GEMMs take 130 / 182 / 195 / 348 us at batch 1 / 128 / 256 / 512,
    # flat up to 256, then time grows with the batch.
    b_max: Annotated[int, Meta(ge=1)] = 256
    # The executor's HBM bandwidth share over the sender's bandwidth (same GPUs: the share of its GPU
    # the executor gets beside the host's own model; Adrenaline: 20% of the SMs reach 60% of HBM).
    bandwidth_share: Annotated[float, Meta(gt=0)] = 0.5


class AdaptiveSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The adaptive controller's steps and thresholds (sglang_ext/offload/planning/adaptive.py)."""

    step_down: Annotated[float, Meta(gt=0, le=1)] = 0.1  # lower by this after an SLO miss
    step_up: Annotated[float, Meta(gt=0, le=1)] = 0.05  # raise by this with slack
    slack: Annotated[float, Meta(gt=0, lt=1)] = 0.8  # slack: P99 TPOT below slack x SLO (between: hold)
    interval_s: Annotated[float, Meta(gt=0)] = 2.0  # at most one change per interval (time to show its effect)
    # Break-even context: while the sender's decoding requests average fewer tokens than this, the share
    # is 0 (it rises again from min_context_tokens / slack); 0 turns the rule off. A remote row costs a
    # fixed exchange per layer and saves its attention, which grows with its context. On H200s, half the
    # rows remote made the sender's step slower at 1K (0.89-0.95x, batch 48-96) and at 2K with batch 64
    # (0.83x; faster only at batch 128-256; docs/benchmarks.md); at 8K, batch 64, attention is 76 % of
    # the step (492 us a layer of 20.8 ms; issue 21), so by linear scaling ~60 % at 4K. 4096: the first
    # power of two past every measured loss, where (batch 64) attention is most of the step.
    min_context_tokens: Annotated[int, Meta(ge=0)] = 4096
