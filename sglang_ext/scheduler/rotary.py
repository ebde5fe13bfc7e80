"""The scheduler's side of KV rotation (`preemption_mode=rotate`): requests whose KV waits in host memory.

States: waiting -> running <-> rotary -> finished. Kept apart from the batching loop (`scheduler.py`):

* **Rotating out** a running request: its full pages are first published to the prefix cache (as a
  finishing request's are), then every page of its KV is copied to the host pool (those with a valid
  eager copy are not copied again), its cache lock is released (its prefix pages become evictable,
  never freed under another user) and its own pages are freed.
* **Resuming**: the prefix is matched again; only the pages the cache no longer holds are copied
  back (into new device pages). The request is running again but joins batches only once the copy
  has landed, so the copy runs beside the step of the iteration that issued it and no step waits
  for it; only when nothing else could run is the compute stream fenced on it. Its full pages' host
  copies stay as eager copies (a second rotation moves only what changed).
* **Eager copies**: while the pool is short, with the budget an iteration leaves, full pages of the
  likeliest victims are copied out ahead of time, so a rotation moves little more than the last,
  partly filled page. A full page's KV never changes, but its page can: `cache_prefix` may swap it
  for the cache's twin (`_cache_prefix` drops that copy at once), a release frees it. So a copy is
  trusted only while the request still holds the same device page at that index, and all of a
  request's copies are dropped when it lets go of its pages.
* **Transfers in flight** (kvcache/rotation.py): nothing blocks on a copy. Pages a copy still uses
  are parked when freed (kvcache/holds.py) and a released request's cache pages stay locked until
  its copies land; those pages count as room that is coming (`_pages_coming`), so a decoder sits out
  a step instead of pushing out more victims, and voluntary rotations stop once the room is on its
  way. An iteration whose step waited for a copy (a fence) or that ran nothing because of copies
  counts as unhidden.
* **Budget**: `rotation_budget_mb` (B_xfer) bytes per direction per iteration for resumes,
  voluntary rotations and eager copies (the first transfer of an iteration may exceed it, so a
  large request still moves). Rotations forced by a full pool are not limited by it.
* A full host pool drops eager copies first; if that is not enough, the request is preempted by
  recompute instead (nothing is lost).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang_ext.kvcache.holds import HoldingAllocator
from sglang_ext.kvcache.host_pool import HostKVPool
from sglang_ext.kvcache.pool import KVPool
from sglang_ext.kvcache.rotation import RotationEngine, Transfer, host_kv_bytes, make_host_pool, make_rotation_engine
from sglang_ext.scheduler.kv_manager import KVManager
from sglang_ext.scheduler.policy import SchedulePolicy
from sglang_ext.scheduler.request import Req, ReqStatus
from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _InFlight:
    t: Transfer
    dev: list[int]
    host: list[int]
    landed: bool = False
    fenced: bool = False  # a swap-in the compute stream was made to wait for (readable by the next step)


@dataclass
class Rotation:
    """Host pool, engine, transfers in flight and counters of one scheduler."""

    engine: RotationEngine
    budget: int  # B_xfer, bytes per direction per iteration
    eager: bool
    inflight: list[_InFlight] = field(default_factory=list)
    # (copies, cache node to unlock once they land, pages under that node)
    deferred: list[tuple[list[_InFlight], Any, int]] = field(default_factory=list)
    left: dict[str, int] = field(default_factory=dict)  # budget left this iteration, per direction
    moved: dict[str, bool] = field(default_factory=dict)  # a transfer went this iteration, per direction
    waited: bool = False  # this iteration's step waited for a copy, or ran nothing because of copies
    spent: dict[str, list[int]] = field(default_factory=dict)  # per direction: [bytes, transfers] in budget
    rotations_out: int = 0
    rotations_in: int = 0
    recompute_fallbacks: int = 0
    unhidden_iterations: int = 0

    def __post_init__(self) -> None:
        self.new_iteration()

    def new_iteration(self) -> None:
        self.left = {"out": self.budget, "in": self.budget}
        self.moved = {"out": False, "in": False}
        self.spent = {"out": [0, 0], "in": [0, 0]}
        self.waited = False

    @property
    def host(self) -> HostKVPool:
        return self.engine.host

    @property
    def host_alloc(self) -> HoldingAllocator:
        alloc = self.host.allocator
        assert isinstance(alloc, HoldingAllocator)
        return alloc

    def may_move(self, direction: str, nbytes: int) -> bool:
        return nbytes <= self.left[direction] or not self.moved[direction]

    def spend(self, direction: str, nbytes: int, forced: bool = False) -> None:
        self.left[direction] -= nbytes
        self.moved[direction] = True
        if not forced:
            self.spent[direction][0] += nbytes
            self.spent[direction][1] += 1


def make_rotation(args: ServerArgs, pool: KVPool) -> Rotation:
    nbytes = host_kv_bytes(args.kv_host_size_gb, pool.total_bytes)
    host = make_host_pool(pool.geometry, nbytes, pool.device)
    host.allocator = HoldingAllocator(host.num_pages)  # fresh: nothing allocated yet
    return Rotation(make_rotation_engine(pool, host), args.rotation_budget_bytes, not args.disable_eager_rotation)


class RotaryRows:
    rot: Rotation | None
    kv: KVManager
    allocator: Any
    policy: SchedulePolicy
    running: list[Req]
    waiting: list[Req]
    rotary: list[Req]
    page_size: int
    clock: Callable[[], float]
    _deficit: int = 0  # pages by which all requests' KV exceeds the pool (0: everything fits), per iteration

    # ---- iterations ----------------------------------------------------------------------------
    def _rot_begin(self) -> None:
        """Start of an iteration: land finished copies, refill the budget."""
        rot = self.rot
        if rot is None:
            return
        self._rot_poll()
        rot.new_iteration()

    def _rot_end(self) -> None:
        """End of scheduling: eager copies with what the budget left; count an unhidden iteration."""
        rot = self.rot
        if rot is None:
            return
        if rot.eager and self._deficit > 0:
            self._eager_copies()
        if rot.waited:
            rot.unhidden_iterations += 1

    def _copies_in_flight(self) -> bool:
        """Copies not landed yet (their pages come free when they do); counts the iteration as unhidden."""
        if self.rot is None or not self.rot.inflight:
            return False
        self.rot.waited = True
        return True

    def _ready(self, r: Req) -> bool:
        """A running request may join this step's batch: no swap-in of its KV is still on the way."""
        f = r.copy_in
        return f is None or f.landed or f.fenced

    def _fence_arrivals(self) -> bool:
        """Nothing else can run: let the next step read the swap-ins still in flight, the compute
        stream waiting for them (no host sync). True if there were any."""
        rot = self.rot
        if rot is None:
            return False
        arriving = [r.copy_in for r in self.running if not self._ready(r)]
        for f in arriving:
            rot.engine.fence(f.t)
            f.fenced = True
        if arriving:
            rot.waited = True
        return bool(arriving)

    def _pages_coming(self) -> int:
        """Device pages that copies in flight will give back when they land: freed pages parked under
        them, and cache pages kept locked for them (an upper bound: another user may hold those)."""
        rot = self.rot
        if rot is None or not rot.inflight:
            return 0
        return len(self.allocator.parked) + sum(n for _, _, n in rot.deferred)

    def _rot_poll(self) -> None:
        rot = self.rot
        assert rot is not None
        still: list[_InFlight] = []
        for f in rot.inflight:
            if rot.engine.done(f.t):
                f.landed = True
                self.allocator.unhold(f.dev)
                rot.host_alloc.unhold(f.host)
            else:
                still.append(f)
        rot.inflight = still
        keep: list[tuple[list[_InFlight], Any, int]] = []
        for d in rot.deferred:
            if all(f.landed for f in d[0]):
                self.kv.cache.unlock(d[1])
            else:
                keep.append(d)
        rot.deferred = keep

    def _issue(self, r: Req, direction: str, dev: list[int], host: list[int]) -> _InFlight | None:
        """Start a copy; the copy in flight (its pages held until it lands), or None if it is done."""
        rot = self.rot
        assert rot is not None
        if direction == "out":
            t = rot.engine.swap_out(dev, host)
        else:
            t = rot.engine.swap_in(host, dev)
        if rot.engine.done(t):  # the reference engine's copies are done on return: nothing to hold
            return None
        f = _InFlight(t, list(dev), list(host))
        self.allocator.hold(f.dev)
        rot.host_alloc.hold(f.host)
        rot.inflight.append(f)
        r.transfers = [x for x in r.transfers if not x.landed] + [f]
        return f

    def _cache_prefix(self, r: Req) -> None:
        """`kv.cache_prefix`, dropping eager copies of pages it swapped for the cache's twins (so the
        remaining copies stay trusted without a scan every iteration)."""
        if self.rot is None or not r.eager:
            self.kv.cache_prefix(r)
            return
        before = list(r.pages)
        self.kv.cache_prefix(r)
        stale = [i for i in r.eager if i >= len(r.pages) or r.pages[i] != before[i]]
        if stale:
            self.rot.host_alloc.free([r.eager.pop(i)[1] for i in stale])

    # ---- releasing ------------------------------------------------------------------------------
    def _drop_host(self, r: Req) -> None:
        """Free the request's host pages: eager copies and rotated KV."""
        rot = self.rot
        if rot is None:
            return
        pages = [h for _, h in r.eager.values()] + r.host_pages
        if pages:
            rot.host_alloc.free(pages)
        r.eager, r.host_pages, r.host_len = {}, [], 0

    def _hold_prefix_while_copying(self, r: Req) -> None:
        """Before a release: if copies of its pages are in flight, publish its full pages and keep
        their cache node locked until those copies land (unlocked pages could be evicted and
        rewritten under a copy). Its own pages are parked by the allocator."""
        if self.rot is None or not r.admitted:
            return
        pending = [f for f in r.transfers if not f.landed]
        r.transfers = pending
        if not pending:
            return
        self._cache_prefix(r)
        if r.prefix_node is not None:
            self.kv.cache.lock(r.prefix_node)
            self.rot.deferred.append((pending, r.prefix_node, r.cached_pages))

    def _release_kv(self, r: Req) -> None:
        self._drop_host(r)
        self._hold_prefix_while_copying(r)
        r.copy_in = None
        super()._release_kv(r)  # type: ignore[misc]

    def _drop_local_kv(self, r: Req) -> None:
        self._drop_host(r)
        self._hold_prefix_while_copying(r)
        super()._drop_local_kv(r)  # type: ignore[misc]

    # ---- eager copies ---------------------------------------------------------------------------
    def _valid_eager(self, r: Req) -> dict[int, int]:
        """Page index -> host copy, for the copies still trusted; the others are dropped. (`_cache_prefix`
        already drops copies of swapped pages; this is the check before a copy is relied on.)"""
        rot = self.rot
        assert rot is not None
        full = r.kv_len // self.page_size
        good: dict[int, int] = {}
        stale: list[int] = []
        for i, (dev, host) in r.eager.items():
            if i < full and i < len(r.pages) and r.pages[i] == dev:
                good[i] = host
            else:
                stale.append(host)
        if stale:
            rot.host_alloc.free(stale)
            r.eager = {i: (r.pages[i], h) for i, h in good.items()}
        return good

    def _eager_copies(self) -> None:
        """Copy full pages of the likeliest victims, in the policy's victim order, until they cover
        the pages the pool is short of (`_deficit`): copies of requests no rotation would reach only
        cost link time, host memory and host time. A request whose full pages all have copies costs
        one comparison (its copies stay trusted: `_cache_prefix` drops the ones it invalidates)."""
        rot = self.rot
        assert rot is not None
        page = rot.engine.page_bytes
        cover = self._deficit
        for r in self.policy.victims([x for x in self.running if x.remote is None and x.admitted]):
            if cover <= 0:
                return
            cover -= len(r.pages)
            full = r.kv_len // self.page_size
            if len(r.eager) >= full or not self._ready(r):
                continue
            room = min(rot.left["out"] // page, rot.host.num_free)
            if room <= 0:
                return
            todo = [i for i in range(full) if i not in r.eager][:room]
            host = rot.host_alloc.alloc_lowest(len(todo))
            self._issue(r, "out", [r.pages[i] for i in todo], host)
            rot.spend("out", len(todo) * page)
            for i, h in zip(todo, host, strict=True):
                r.eager[i] = (r.pages[i], h)

    def _host_room(self, n: int, keep: Req) -> bool:
        """At least `n` free host pages, dropping eager copies (least likely victims' first)."""
        rot = self.rot
        assert rot is not None
        if rot.host.num_free >= n:
            return True
        for r in reversed(self.policy.victims(self.running)):
            if r is not keep and r.eager:
                rot.host_alloc.free([h for _, h in r.eager.values()])
                r.eager = {}
                if rot.host.num_free >= n:
                    return True
        return False

    # ---- rotating out and back ------------------------------------------------------------------
    def _rotate_out(self, r: Req, forced: bool) -> bool:
        """Move a running request's KV to the host pool; False (nothing changed) if it cannot."""
        rot = self.rot
        if rot is None or r.remote is not None or not r.admitted or r.kv_len == 0 or not self._ready(r):
            return False  # (a swap-in still writing its pages would race the copy out)
        # Its full pages go to the cache first (as at a release), so a resume may find them there;
        # this may swap pages for the cache's twins, which invalidates their eager copies.
        self._cache_prefix(r)
        n = self.kv.pages_for(r.kv_len)
        copies = self._valid_eager(r)
        need = [i for i in range(n) if i not in copies]
        nbytes = len(need) * rot.engine.page_bytes
        if not forced and not rot.may_move("out", nbytes):
            return False
        if not self._host_room(len(need), keep=r):
            if forced:
                rot.recompute_fallbacks += 1
                logger.info("host KV pool full: %s is preempted by recompute", r.rid)
            return False
        host = rot.host_alloc.alloc_lowest(len(need))
        if need:
            self._issue(r, "out", [r.pages[i] for i in need], host)
            rot.spend("out", nbytes, forced)
        copies.update(zip(need, host, strict=True))
        r.host_pages = [copies[i] for i in range(n)]
        r.eager = {}
        r.host_len = r.kv_len
        self._hold_prefix_while_copying(r)
        self.kv.release(r, keep_in_cache=True)
        r.copy_in = None
        self.running.remove(r)
        r.status = ReqStatus.ROTARY
        self.rotary.append(r)
        rot.rotations_out += 1
        logger.debug("rotated out %s (%d tokens, %d pages copied)", r.rid, r.host_len, len(need))
        return True

    def _resume_plan(self, r: Req) -> tuple[int, int]:
        """For an admitted (prefix matched) rotary request: (tokens of KV after the swap-in, pages to
        copy in)."""
        if r.kv_len >= r.host_len:
            return r.kv_len, 0
        return r.host_len, self.kv.pages_for(r.host_len) - r.cached_pages

    def _resume(self, r: Req) -> bool:
        """Swap an admitted rotary request's missing pages in; it is running again. True if it may
        join this step's batch; False while its copy is on the way (it joins the first batch after the
        copy has landed, so no step waits for it: the copy runs beside this step)."""
        rot = self.rot
        assert rot is not None
        target, copy = self._resume_plan(r)
        n_full = r.host_len // self.page_size
        if copy:
            first = r.cached_pages
            self.kv.grow(r, r.host_len)
            r.copy_in = self._issue(r, "in", r.pages[first:], r.host_pages[first : first + copy])
            rot.spend("in", copy * rot.engine.page_bytes)
        # Its full pages' host copies stay as eager copies of the pages they came back to (or of the
        # cache's pages for the same tokens): a second rotation moves only what changed since.
        keep = {i: (r.pages[i], r.host_pages[i]) for i in range(n_full)} if rot.eager else {}
        kept = {h for _, h in keep.values()}
        rot.host_alloc.free([h for h in r.host_pages if h not in kept])  # parked while the copy-in reads them
        r.eager = keep
        r.host_pages, r.host_len, r.kv_len = [], 0, target
        self.rotary.remove(r)
        r.start_running(self.clock())
        self.running.append(r)
        r.rotations += 1
        rot.rotations_in += 1
        return self._ready(r)

    # ---- integrity ------------------------------------------------------------------------------
    def _rot_check(self) -> None:
        """Every used host page is in exactly one place: a rotary request's KV, a running request's
        eager copy, or parked under a copy in flight."""
        rot = self.rot
        if rot is None:
            return
        owners: dict[int, str] = {p: "in flight" for p in rot.host_alloc.parked}
        for r in self.rotary:
            assert r.status is ReqStatus.ROTARY and not r.admitted and not r.pages, f"{r.rid} is not rotary"
            assert len(r.host_pages) == self.kv.pages_for(r.host_len) > 0, f"{r.rid}: host pages != KV"
            for p in r.host_pages:
                assert p not in owners, f"host page {p} owned by {r.rid} and {owners[p]}"
                owners[p] = r.rid
        for r in self.running + self.waiting:
            assert not r.host_pages, f"{r.rid} holds rotated KV but is {r.status.value}"
            for _, p in r.eager.values():
                assert p not in owners, f"host page {p} owned by {r.rid} and {owners[p]}"
                owners[p] = r.rid
        alloc = rot.host_alloc
        used = {p for p in range(1, alloc.num_pages) if alloc.is_used(p)}
        assert used == set(owners), f"host pages leaked: {sorted(used - set(owners))[:8]}, " \
                                    f"unallocated owned: {sorted(set(owners) - used)[:8]}"
