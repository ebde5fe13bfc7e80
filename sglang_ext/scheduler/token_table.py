"""The overlap loop's token table, a scheduler member: each request's last sampled token on the device.

Like mini-sglang's token pool (one column of it): a request gets a slot, a row of `ids`, the first time
a launched step samples for it. A launched step writes its sampled ids into its requests' slots, and
the decode step launched beside it gathers its input ids from the slots of its own requests, so step
t+1 is built without t's tokens on the host and whatever its rows are. Reads and writes are queued on
the device in launch order, so a slot freed at a finish (`release`) and given to another request
later is written only after every read of the old one.
"""

from __future__ import annotations

import torch

from sglang_ext.scheduler.member import Member
from sglang_ext.scheduler.request import Req


class TokenTable(Member):
    def __init__(self, device: torch.device, slots: int = 256) -> None:
        self.device = device
        self.ids = torch.zeros(slots, dtype=torch.int64, device=device)
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: lowest slot first
        self.owner: dict[int, Req] = {}  # slot -> the request holding it

    def index(self, reqs: list[Req]) -> torch.Tensor:
        """The slots of `reqs` as an index on the device (a request without one gets one)."""
        for r in reqs:
            if r.token_slot < 0:
                if not self.free:
                    self._grow()
                r.token_slot = self.free.pop()
                self.owner[r.token_slot] = r
        return torch.tensor([r.token_slot for r in reqs], dtype=torch.int64).to(self.device, non_blocking=True)

    def write(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens just sampled for the requests of `index` (queued on the device)."""
        self.ids.index_copy_(0, index, tokens)

    def read(self, index: torch.Tensor) -> torch.Tensor:
        """The last sampled token of each request of `index`: the next decode step's input ids."""
        return self.ids.index_select(0, index)

    def _grow(self) -> None:
        n = self.ids.shape[0]
        ids = torch.zeros(2 * n, dtype=torch.int64, device=self.device)
        ids[:n].copy_(self.ids)
        self.ids = ids
        self.free = list(range(2 * n - 1, n - 1, -1))

    # ---- member hooks ---------------------------------------------------------------------------
    def release(self, r: Req) -> None:
        """Its slot goes back at a finish, an abort, a preemption or a move to an executor (it gets
        one again when a launched step next samples for it)."""
        if r.token_slot >= 0:
            del self.owner[r.token_slot]
            self.free.append(r.token_slot)
            r.token_slot = -1

    def check(self) -> None:
        """Every slot is free or held by exactly the request that names it."""
        assert len(self.free) + len(self.owner) == self.ids.shape[0], "token table slots leaked"
        assert not set(self.free) & set(self.owner), "a token table slot is free and held"
        for slot, r in self.owner.items():
            assert r.token_slot == slot, f"{r.rid} holds token slot {slot} but names {r.token_slot}"
