"""What the router core knows of a placement strategy (`PlacementStrategy`), and what a strategy knows of
the core (`RouterHandle`).

The core places a request on one worker unless a strategy offers a `Placement` over two (prefill and
decode); strategies keep the links between workers that this needs (KV pairs, offload pairings) up to
date on the core's events. Neither side imports the other: the core holds a list of strategies built by
router/placement/strategies.py, and a strategy gets the core as a `RouterHandle`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import msgspec

from router.config import SloSpec
from router.events import Event, EventBus, LoadReported, WorkerDown, WorkerUp
from router.metrics import RouterMetrics
from router.registry import Balancer, ModelEntry, Registry
from router.tracker import WorkerState
from sglang_ext.messages import ReplyOut


@dataclass(frozen=True)
class Placement:
    """Where a request goes: `worker` alone, or `worker` (prefill) then `decode` over `pairing`."""

    worker: WorkerState
    decode: WorkerState | None = None
    pairing: str = ""


class KeptKV(NamedTuple):
    """A disaggregated request whose prompt KV stays in its prefill worker's executor (Adrenaline
    placement): the decode worker's offload pairing there, and the request's handle in it."""

    pairing: str
    handle: int


class RouterHandle(Protocol):
    """The router core as a strategy sees it: the registry, the event bus, the models' SLOs, the metrics
    registry, and messages to workers."""

    @property
    def registry(self) -> Registry: ...

    @property
    def bus(self) -> EventBus: ...

    @property
    def slo(self) -> Mapping[str, SloSpec]:
        """Per model name (the cluster file's `slo:`)."""

    @property
    def metrics(self) -> RouterMetrics: ...

    def send(self, worker_id: str, msg: msgspec.Struct) -> None:
        """Queue a message to a worker; never blocks."""

    def new_rid(self) -> str:
        """A router-unique id (strategies name their pairs with it)."""

    async def request_reply(self, worker: WorkerState, make: Callable[[str], msgspec.Struct],
                            timeout: float = 10.0) -> ReplyOut | None:
        """Send `make(rid)` and wait for the worker's ReplyOut (None: no answer within `timeout`)."""


class PlacementStrategy(ABC):
    """One way of placing requests over more than one worker, and the worker links it keeps.

    The core calls the event hooks from its event bus (synchronously, inside `EventBus.publish`: a hook
    is short and starts a task for anything that waits on a worker), `place` for each new request,
    `keep_kv` when it sends a disaggregated one, `pair_broken` when a request finds a pair unusable, and
    `close` when it stops; the readiness probe (router/readiness.py) asks it `expected_links`."""

    info_key: ClassVar[str]  # the key of `describe()` in /get_server_info
    # the events it is called on: the three hooks' own, and whatever `on_other` needs
    events: ClassVar[tuple[type[Event], ...]] = (WorkerUp, WorkerDown, LoadReported)

    def on_event(self, ev: Event) -> None:
        """The bus's callback: one hook per event type."""
        if isinstance(ev, WorkerUp):
            self.on_worker_up(ev)
        elif isinstance(ev, WorkerDown):
            self.on_worker_down(ev)
        elif isinstance(ev, LoadReported):
            self.on_load_report(ev)
        else:
            self.on_other(ev)

    @abstractmethod
    def on_worker_up(self, ev: WorkerUp) -> None:
        """A worker said hello (`ev.fresh`: a new process) or answers again."""

    @abstractmethod
    def on_worker_down(self, ev: WorkerDown) -> None:
        """A worker stopped sending heartbeats."""

    @abstractmethod
    def on_load_report(self, ev: LoadReported) -> None:
        """A worker's periodic report (every 0.5 s): a link that failed may be tried again."""

    def on_other(self, ev: Event) -> None:  # noqa: B027 - only strategies that listen to more override it
        """Any other event of `events` (request progress, SLO misses)."""

    def place(self, model: ModelEntry, balancer: Balancer, prefix_key: str | None,
              avoid: Collection[str]) -> Placement | None:
        """A placement of a new request of `model` over two workers (`balancer`: the core's, for the
        first), none in `avoid` (suspects of a failure); None: not this strategy's to place."""
        return None

    def keep_kv(self, rid: str, prefill: WorkerState, decode: WorkerState) -> KeptKV | None:
        """Whether disaggregated request `rid`, now counted in `decode.inflight`, keeps its prompt KV on
        `prefill` (None: it is sent to `decode` as usual)."""
        return None

    def pair_broken(self, pairing: str, why: str) -> None:  # noqa: B027 - only pair-keeping strategies care
        """A request found the worker pair `pairing` unusable."""

    def expected_links(self, configured: Sequence[WorkerState]) -> list[dict[str, Any]]:
        """Every link it should keep among `configured` (the launcher's own workers, in configuration
        order), as GET /readiness lists them: `kind`, the workers linked, and `state` ("active" once the
        link serves; one not made yet says so). The probe counts them and reports those not active."""
        return []

    @abstractmethod
    def describe(self) -> list[dict[str, Any]]:
        """Its links as /get_server_info shows them (under `info_key`)."""

    @abstractmethod
    def close(self) -> None:
        """Stop: cancel the tasks it started (the core has unsubscribed it from the bus)."""
