"""One sender's remote-attention pairing with an executor, as the offload strategy keeps it: the host, the
state, and its policy's latest decision (router/placement/planning/)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Final

from router.config import OffloadSpec
from router.placement.planning import Decision, Policy, make_policy

RETRY_S: Final = 2.0


@dataclass
class Pairing:
    sender: str
    rule: OffloadSpec
    executor: str = ""
    pairing_id: str = ""
    state: str = "waiting"  # waiting: ... | opening | active | detached: ... | lost | failed: ... | sender down
    last_try: float = -RETRY_S
    task: asyncio.Task[None] | None = None
    logged: str = ""  # the last state logged (a retry that fails the same way is not logged again)
    logged_level: int = 0  # its level: a wait logged at INFO during startup is logged again as a WARNING after
    transport: str = ""  # the data plane the host serves (torch_dist | cuda_ipc)
    # planning (router/placement/steer.py): the entry's policy, its latest decision, what was sent
    policy: Policy = field(init=False)
    decision: Decision | None = None
    sent: tuple[float, float] | None = None  # (ratio, bound) in the directive or the latest OffloadRatio
    sent_at: float = 0.0
    updates: int = 0  # OffloadRatio messages sent
    exec_low: bool = False

    def __post_init__(self) -> None:
        self.policy = make_policy(self.rule)

    def describe(self) -> dict[str, Any]:
        d = self.decision
        return {"from": self.sender, "from_model": self.rule.from_, "executor": self.executor or None,
                "to_model": self.rule.to, "policy": self.rule.policy,
                "ratio": d.ratio if d else self.rule.start, "bound": d.bound if d else self.rule.cap,
                "ob": d.ob if d else None, "why": d.why if d else None, "updates": self.updates,
                "executor_memory_low": self.exec_low,
                "state": self.state, "pairing": self.pairing_id or None, "transport": self.transport or None,
                "placement": "prefill" if self.rule.from_ == self.rule.to else "weaver"}
