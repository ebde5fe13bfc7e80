"""The interface between the scheduler's loop and the mechanisms installed in it.

A member is one mechanism: local device pages (`local.py`), KV rotation to host memory
(`rotary.py`), remote rows on an attention executor (`remote_residency.py`), prefill/decode hand-off
(`handoff.py`), structured output (`grammar_rows.py`). The scheduler holds its members and asks each
of them the same questions (`Member`: may this request run now, are copies in flight, may a victim
be parked rather than recomputed, ...); every answer defaults to "nothing to do here". A member that
answers for a KV home is a `Residency`: it admits the candidates whose KV lives there and says
whether their KV takes pages of this worker's pool. The loop asks; it never tests a home itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from sglang_ext.scheduler.output import LoadStats
from sglang_ext.scheduler.request import KVHome, Req


class Member(ABC):  # noqa: B024 (every hook is optional)
    wants_deficit = False  # reads the loop's `deficit` (computed each iteration only if someone does)

    def begin(self) -> None:  # noqa: B027
        """An iteration starts, before scheduling (land finished copies, refill budgets)."""

    def end(self) -> None:  # noqa: B027
        """This iteration's step is scheduled (and maybe in flight): spend what it left over."""

    def release(self, r: Req) -> None:  # noqa: B027
        """`r` lets go of its KV (finish, abort, preemption, a move to an executor): give back what
        this member holds for it. Called before its local pages are freed."""

    def needs_landed_state(self, reqs: list[Req]) -> bool:
        """A decode step over `reqs` must be scheduled and landed without a step in flight (its
        decisions need every token landed)."""
        return False

    def busy(self) -> bool:
        """Work in flight that keeps the prefix cache from being flushed."""
        return False

    def holders(self) -> list[Req]:
        """Requests outside the queues that hold device pages (for the page-ownership check)."""
        return []

    def check(self) -> None:  # noqa: B027
        """Assert this member's own accounting (tests call this between steps)."""

    def stats(self, s: LoadStats) -> None:  # noqa: B027
        """Fill this member's fields of the load report."""

    # ---- the loop's questions -------------------------------------------------------------------
    def ready(self, r: Req) -> bool:
        """Running request `r` may join this step's batch (no copy of its KV is still on the way)."""
        return True

    def copies_in_flight(self) -> bool:
        """Copies are in flight whose pages come free when they land: wait rather than preempt."""
        return False

    def pages_coming(self) -> int:
        """Device pages that copies in flight give back when they land."""
        return 0

    def fence_arrivals(self) -> bool:
        """Nothing else can run: let the next step wait on the device for KV on its way in; True if
        any was."""
        return False

    def park(self, r: Req) -> bool:
        """Running request `r` must give up its pages: keep its KV elsewhere (it left the running
        batch) instead of recomputing it; False (nothing changed) if this member does not."""
        return False

    def make_room_for(self, cand: Req, protect: set[int]) -> bool:
        """Candidate `cand` does not fit: move running requests (not those in `protect`, by id) out
        voluntarily so it may; True if any went."""
        return False


class Residency(Member):
    """A member that answers for one KV home: where the KV of the requests of that home lives."""

    home: KVHome
    pooled = True  # its requests' KV takes (or, once admitted, will take) pages of this worker's pool

    @abstractmethod
    def admit(self, r: Req, budget: int, reserve: int) -> int | None:
        """Admit candidate `r` (its home is this one): the tokens it computes this step (0: it
        decodes with the others or waits for its KV), or None (nothing changed) if it does not fit
        now. `budget`: prefill tokens left; `reserve`: pages kept for the running decoders."""

    def may_admit(self, r: Req) -> bool:
        """Candidate `r` may be tried now (False: skipped this iteration, the queue goes on)."""
        return True

    def first_pages(self, r: Req) -> int | None:
        """Pages of the pool candidate `r`'s admission needs at least, counting its cached prefix as
        lent (never more than `admit` asks); None when it needs none or is skipped. The overlap loop
        keeps overlapping while the head candidate's do not fit."""
        return None
