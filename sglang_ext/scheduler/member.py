"""The interface between the scheduler's loop and the mechanisms installed in it.

A member is one mechanism: KV rotation to host memory (`rotary.py`), remote rows on an attention
executor (`remote_rows.py`), prefill/decode hand-off (`handoff.py`), structured output
(`grammar_rows.py`). The scheduler holds its members and calls these hooks on each of them; a
member that answers for a KV home (`home`) also admits the candidates whose KV lives there. Every
hook but `admit` defaults to doing nothing.
"""

from __future__ import annotations

from abc import ABC

from sglang_ext.scheduler.output import LoadStats
from sglang_ext.scheduler.request import KVHome, Req


class Member(ABC):  # noqa: B024 (every hook is optional)
    home: KVHome | None = None  # the KV home whose candidates this member admits

    def begin(self) -> None:  # noqa: B027
        """An iteration starts, before scheduling (land finished copies, refill budgets)."""

    def end(self) -> None:  # noqa: B027
        """This iteration's step is scheduled (and maybe in flight): spend what it left over."""

    def admit(self, r: Req, budget: int, reserve: int) -> int | None:
        """Admit candidate `r` (its home is this member's): the tokens it computes this step (0: it
        decodes with the others or waits for its KV), or None (nothing changed) if it does not fit
        now. `budget`: prefill tokens left; `reserve`: pages kept for the running decoders."""
        raise NotImplementedError(f"{type(self).__name__} admits no requests")

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
