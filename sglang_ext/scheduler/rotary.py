"""KV rotation (`preemption_mode=rotate`), a scheduler member: requests whose KV waits in host memory.

A request's home goes LOCAL -> HOST (rotated out: its full pages published to the prefix cache, its
KV copied to host pages, its own pages freed) -> LOCAL (resumed: the prefix matched again, only the
pages the cache lost copied back; it joins batches once that copy has landed). Nothing blocks on a
copy: pages it still uses are parked, and cache pages a released request held stay locked, until it
lands. An eager copy of a full page is trusted only while the request holds that same device page.
The rules in full: docs/architecture.md, "Rotation to host memory".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sglang_ext.kvcache.allocator import PageAllocator
from sglang_ext.kvcache.holds import HoldingAllocator
from sglang_ext.kvcache.host_pool import HostKVPool
from sglang_ext.kvcache.rotation import RotationEngine, Transfer, host_kv_bytes, make_host_pool, make_rotation_engine
from sglang_ext.scheduler.member import Residency
from sglang_ext.scheduler.output import LoadStats
from sglang_ext.scheduler.request import KVHome, Req, ReqStatus
from sglang_ext.scheduler.view import LoopView
from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _InFlight:
    t: Transfer
    dev: list[int]
    host: list[int]
    landed: bool = False
    fenced: bool = False  # a swap-in the compute stream was made to wait for (readable by the next step)


class Rotation(Residency):
    """Host pool, engine, transfers in flight and counters of one scheduler, and its rotary rows."""

    home = KVHome.HOST
    wants_deficit = True  # eager copies cover the pages the pool is short of

    def __init__(self, s: LoopView, engine: RotationEngine, budget: int, eager: bool) -> None:
        self.s = s
        # a rotating scheduler's device pages: freed pages under a copy in flight are parked
        assert isinstance(s.kv.allocator, HoldingAllocator)
        self.dev_alloc: HoldingAllocator = s.kv.allocator
        self.engine = engine
        self.budget = budget  # B_xfer, bytes per direction per iteration
        self.eager = eager
        self.inflight: list[_InFlight] = []
        # (copies, cache node to unlock once they land, pages under that node)
        self.deferred: list[tuple[list[_InFlight], Any, int]] = []
        self.rotations_out = 0
        self.rotations_in = 0
        self.recompute_fallbacks = 0
        self.unhidden_iterations = 0
        self.new_iteration()
        s.kv.on_swap = self._swapped

    @staticmethod
    def allocator(args: ServerArgs, num_pages: int) -> PageAllocator:
        """The device pool's allocator: with rotation, pages a copy in flight still uses are parked
        when their owner frees them (`HoldingAllocator`)."""
        return HoldingAllocator(num_pages) if args.preemption_mode == "rotate" else PageAllocator(num_pages)

    @classmethod
    def make(cls, s: LoopView, args: ServerArgs) -> Rotation | None:
        """The member, when `preemption_mode` is rotate (None otherwise: preempted requests recompute)."""
        if args.preemption_mode != "rotate":
            return None
        pool = s.runner.pool
        host = make_host_pool(pool.geometry, host_kv_bytes(args.kv_host_size_gb, pool.total_bytes), pool.device)
        host.allocator = HoldingAllocator(host.num_pages)  # fresh: nothing allocated yet
        return cls(s, make_rotation_engine(pool, host), args.rotation_budget_bytes, not args.disable_eager_rotation)

    def new_iteration(self) -> None:
        self.left = {"out": self.budget, "in": self.budget}  # budget left this iteration, per direction
        self.moved = {"out": False, "in": False}  # a transfer went this iteration, per direction
        self.spent = {"out": [0, 0], "in": [0, 0]}  # per direction: [bytes, transfers] in budget
        self.waited = False  # this iteration's step waited for a copy, or ran nothing because of copies

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

    # ---- member hooks ---------------------------------------------------------------------------
    def begin(self) -> None:
        """Land finished copies, refill the budget."""
        self.poll()
        self.new_iteration()

    def end(self) -> None:
        """Eager copies with what the budget left; count an unhidden iteration."""
        if self.eager and self.s.deficit > 0:
            self._eager_copies()
        if self.waited:
            self.unhidden_iterations += 1

    def needs_landed_state(self, reqs: list[Req]) -> bool:
        """Only a voluntary rotation the policy may decide now. Admissions and resumes wait for
        landed state by the overlap loop's own rule (it keeps overlapping only while the head
        candidate cannot get its pages), and a forced rotation when a decoder cannot grow. Holding
        every step to landed state while a queue stood cost ~40 % of decode speed on an H200
        (median inter-token 14-16 ms against 10 ms; docs/benchmarks.md)."""
        s = self.s
        if not (s.waiting or s.rotary) or not s.policy.voluntary:
            return False
        head = next(iter(s.policy.candidates(s.waiting, s.rotary, s.kv.cache)), None)
        if head is None:
            return False
        local = [r for r in s.running if r.home is KVHome.LOCAL]
        return s.policy.may_rotate_for(head, local, s.clock())

    def busy(self) -> bool:
        self.poll()
        return bool(self.inflight)  # rotation copies still read cache pages

    def release(self, r: Req) -> None:
        self._drop_host(r)
        self._hold_prefix_while_copying(r)
        r.rot.copy_in = None

    def stats(self, st: LoadStats) -> None:
        st.num_rotary, st.host_used_bytes = len(self.s.rotary), self.host.used_bytes
        st.host_total_bytes = self.host.allocator.capacity * self.engine.page_bytes
        st.rotations_out, st.rotations_in = self.rotations_out, self.rotations_in
        st.rotation_bytes_out, st.rotation_bytes_in = self.engine.bytes_out, self.engine.bytes_in
        st.unhidden_iterations = self.unhidden_iterations

    # ---- copies in flight -----------------------------------------------------------------------
    def copies_in_flight(self) -> bool:
        """Copies not landed yet (their pages come free when they do); counts the iteration as unhidden."""
        self.waited |= bool(self.inflight)
        return bool(self.inflight)

    def ready(self, r: Req) -> bool:
        """A running request may join this step's batch: no swap-in of its KV is still on the way."""
        f = r.rot.copy_in
        return f is None or f.landed or f.fenced

    def may_admit(self, r: Req) -> bool:
        """Not while its KV is still on the way out: a copy back would race it."""
        return all(f.landed for f in r.rot.transfers)

    def first_pages(self, r: Req) -> int | None:
        """A resume brings back all of its KV the cache lacks, at once."""
        kv = self.s.kv
        match = kv.cache.match_prefix(r.fill_ids[: kv.match_limit(r)])
        return kv.pages_for(max(r.rot.host_len, match.num_tokens) + 1) - len(match.pages)

    def park(self, r: Req) -> bool:
        """A preemption rotates the victim out when the host pool has room (else it is recomputed)."""
        return self.rotate_out(r, forced=True)

    def fence_arrivals(self) -> bool:
        """Nothing else can run: let the next step read the swap-ins still in flight, the compute
        stream waiting for them (no host sync). True if there were any."""
        arriving = [r.rot.copy_in for r in self.s.running if not self.ready(r)]
        for f in arriving:
            self.engine.fence(f.t)
            f.fenced = True
        if arriving:
            self.waited = True
        return bool(arriving)

    def pages_coming(self) -> int:
        """Device pages that copies in flight will give back when they land: freed pages parked under
        them, and cache pages kept locked for them (an upper bound: another user may hold those)."""
        if not self.inflight:
            return 0
        return len(self.dev_alloc.parked) + sum(n for _, _, n in self.deferred)

    def poll(self) -> None:
        still: list[_InFlight] = []
        for f in self.inflight:
            if self.engine.done(f.t):
                f.landed = True
                self.dev_alloc.unhold(f.dev)
                self.host_alloc.unhold(f.host)
            else:
                still.append(f)
        self.inflight = still
        keep: list[tuple[list[_InFlight], Any, int]] = []
        for d in self.deferred:
            if all(f.landed for f in d[0]):
                self.s.kv.cache.unlock(d[1])
            else:
                keep.append(d)
        self.deferred = keep

    def _issue(self, r: Req, direction: str, dev: list[int], host: list[int]) -> _InFlight | None:
        """Start a copy; the copy in flight (its pages held until it lands), or None if it is done."""
        t = self.engine.swap_out(dev, host) if direction == "out" else self.engine.swap_in(host, dev)
        if self.engine.done(t):  # the reference engine's copies are done on return: nothing to hold
            return None
        f = _InFlight(t, list(dev), list(host))
        self.dev_alloc.hold(f.dev)
        self.host_alloc.hold(f.host)
        self.inflight.append(f)
        r.rot.transfers = [x for x in r.rot.transfers if not x.landed] + [f]
        return f

    def _swapped(self, r: Req, indices: list[int]) -> None:
        """`cache_prefix` swapped these pages for the cache's twins: their eager copies are dropped at
        once (so the remaining copies stay trusted without a scan every iteration)."""
        stale = [i for i in indices if i in r.rot.eager]
        if stale:
            self.host_alloc.free([r.rot.eager.pop(i)[1] for i in stale])

    # ---- releasing ------------------------------------------------------------------------------
    def _drop_host(self, r: Req) -> None:
        """Free the request's host pages: eager copies and rotated KV."""
        st = r.rot
        pages = [h for _, h in st.eager.values()] + st.host_pages
        if pages:
            self.host_alloc.free(pages)
        st.eager, st.host_pages, st.host_len = {}, [], 0

    def _hold_prefix_while_copying(self, r: Req) -> None:
        """Before a release: if copies of its pages are in flight, publish its full pages and keep
        their cache node locked until those copies land (unlocked pages could be evicted and
        rewritten under a copy). Its own pages are parked by the allocator."""
        if not r.admitted:
            return
        pending = [f for f in r.rot.transfers if not f.landed]
        r.rot.transfers = pending
        if not pending:
            return
        self.s.kv.cache_prefix(r)
        if r.prefix_node is not None:
            self.s.kv.cache.lock(r.prefix_node)
            self.deferred.append((pending, r.prefix_node, r.cached_pages))

    # ---- eager copies ---------------------------------------------------------------------------
    def _valid_eager(self, r: Req) -> dict[int, int]:
        """Page index -> host copy, for the copies still trusted; the others are dropped. (`_swapped`
        already drops copies of swapped pages; this is the check before a copy is relied on.)"""
        full = r.kv_len // self.s.page_size
        good: dict[int, int] = {}
        stale: list[int] = []
        for i, (dev, host) in r.rot.eager.items():
            if i < full and i < len(r.pages) and r.pages[i] == dev:
                good[i] = host
            else:
                stale.append(host)
        if stale:
            self.host_alloc.free(stale)
            r.rot.eager = {i: (r.pages[i], h) for i, h in good.items()}
        return good

    def _eager_copies(self) -> None:
        """Copy full pages of the likeliest victims, in the policy's victim order, until they cover
        the pages the pool is short of (the scheduler's `deficit`): copies of requests no rotation
        would reach only cost link time, host memory and host time. A request whose full pages all
        have copies costs one comparison (its copies stay trusted: `_swapped` drops the ones it
        invalidates)."""
        s = self.s
        page = self.engine.page_bytes
        cover = s.deficit
        for r in s.policy.victims([x for x in s.running if x.home is KVHome.LOCAL and x.admitted]):
            if cover <= 0:
                return
            cover -= len(r.pages)
            full = r.kv_len // s.page_size
            if len(r.rot.eager) >= full or not self.ready(r):
                continue
            room = min(self.left["out"] // page, self.host.num_free)
            if room <= 0:
                return
            todo = [i for i in range(full) if i not in r.rot.eager][:room]
            host = self.host_alloc.alloc_lowest(len(todo))
            self._issue(r, "out", [r.pages[i] for i in todo], host)
            self.spend("out", len(todo) * page)
            for i, h in zip(todo, host, strict=True):
                r.rot.eager[i] = (r.pages[i], h)

    def _host_room(self, n: int, keep: Req) -> bool:
        """At least `n` free host pages, dropping eager copies (least likely victims' first)."""
        if self.host.num_free >= n:
            return True
        for r in reversed(self.s.policy.victims(self.s.running)):
            if r is not keep and r.rot.eager:
                self.host_alloc.free([h for _, h in r.rot.eager.values()])
                r.rot.eager = {}
                if self.host.num_free >= n:
                    return True
        return False

    # ---- rotating out and back ------------------------------------------------------------------
    def rotate_out(self, r: Req, forced: bool) -> bool:
        """Move a running request's KV to the host pool; False (nothing changed) if it cannot."""
        s = self.s
        if r.home is not KVHome.LOCAL or not r.admitted or r.kv_len == 0 or not self.ready(r):
            return False  # (a swap-in still writing its pages would race the copy out)
        # Its full pages go to the cache first (as at a release), so a resume may find them there;
        # this may swap pages for the cache's twins, which invalidates their eager copies.
        s.kv.cache_prefix(r)
        n = s.kv.pages_for(r.kv_len)
        copies = self._valid_eager(r)
        need = [i for i in range(n) if i not in copies]
        nbytes = len(need) * self.engine.page_bytes
        if not forced and not self.may_move("out", nbytes):
            return False
        if not self._host_room(len(need), keep=r):
            if forced:
                self.recompute_fallbacks += 1
                logger.info("host KV pool full: %s is preempted by recompute", r.rid)
            return False
        host = self.host_alloc.alloc_lowest(len(need))
        if need:
            self._issue(r, "out", [r.pages[i] for i in need], host)
            self.spend("out", nbytes, forced)
        copies.update(zip(need, host, strict=True))
        r.rot.host_pages = [copies[i] for i in range(n)]
        r.rot.eager = {}
        r.rot.host_len = r.kv_len
        self._hold_prefix_while_copying(r)
        s.kv.release(r, keep_in_cache=True)
        r.rot.copy_in = None
        s.running.remove(r)
        r.status, r.home = ReqStatus.WAITING, KVHome.HOST
        s.rotary.append(r)
        self.rotations_out += 1
        logger.debug("rotated out %s (%d tokens, %d pages copied)", r.rid, r.rot.host_len, len(need))
        return True

    def make_room_for(self, cand: Req, protect: set[int]) -> bool:
        """Rotate out the policy's voluntary victims (not in this step's batch) until `cand` could
        fit; True if any went. Pages that copies in flight will give back count as room: a victim's
        pages come free only when its copy lands (next iteration on a GPU), so without them every
        victim in the list would go for one candidate."""
        s = self.s
        if not s.policy.voluntary:
            return False
        hit = s.kv.cache.match_prefix(cand.fill_ids[: s.kv.match_limit(cand)]).num_tokens
        have = max(hit, cand.rot.host_len)
        need = s.kv.pages_for(min(cand.fill_len, have + s.chunk)) - hit // s.page_size

        def short() -> int:
            return need - (s.kv.available_pages + self.pages_coming() - s.decode_reserve())

        def slot() -> bool:
            return len(s.running) < s.max_running

        if short() <= 0 and slot():
            return False  # the room is there or on its way: a rotation would buy nothing
        local = [r for r in s.running if r.home is KVHome.LOCAL]
        victims = s.policy.make_room_for(
            cand, [r for r in local if id(r) not in protect and self.ready(r)],
            short_tokens=max(short(), 1) * s.page_size, local=local)
        if not victims:
            return False
        if short() > sum(len(v.pages) for v in victims):
            return False  # even all of them would not make room
        moved = False
        for v in victims:
            if not self.rotate_out(v, forced=False):
                break
            moved = True
            if short() <= 0 and slot():
                break
        return moved

    def admit(self, r: Req, budget: int, reserve: int) -> int | None:
        """Resume a rotary request: its prefix is matched again and the pages the cache no longer
        holds are copied back. 0 while its copy is on the way (it joins a batch once it landed)."""
        kv = self.s.kv
        kv.admit(r)
        # tokens of KV after the swap-in, and pages to copy in (none if the cache holds all of it)
        target, copy = (r.kv_len, 0) if r.kv_len >= r.rot.host_len else (
            r.rot.host_len, kv.pages_for(r.rot.host_len) - r.cached_pages)
        decoding = bool(r.output_ids) and target == r.fill_len - 1
        n = 0 if decoding else min(r.fill_len - target, budget)
        need = kv.pages_for(target + max(n, 1)) - len(r.pages)
        if need + reserve > kv.available_pages or (copy and not self.may_move("in", copy * self.engine.page_bytes)):
            kv.release(r, keep_in_cache=False)
            return None
        if not self._resume(r, target, copy):
            return 0  # its KV is on the way in: it joins a batch once the copy has landed
        if n:
            kv.grow(r, r.kv_len + n)
        return n

    def _resume(self, r: Req, target: int, copy: int) -> bool:
        """Swap an admitted rotary request's missing pages in; it is running again. True if it may
        join this step's batch; False while its copy is on the way (it joins the first batch after the
        copy has landed, so no step waits for it: the copy runs beside this step)."""
        s, st = self.s, r.rot
        n_full = st.host_len // s.page_size
        if copy:
            first = r.cached_pages
            s.kv.grow(r, st.host_len)
            st.copy_in = self._issue(r, "in", r.pages[first:], st.host_pages[first : first + copy])
            self.spend("in", copy * self.engine.page_bytes)
        # Its full pages' host copies stay as eager copies of the pages they came back to (or of the
        # cache's pages for the same tokens): a second rotation moves only what changed since.
        keep = {i: (r.pages[i], st.host_pages[i]) for i in range(n_full)} if self.eager else {}
        kept = {h for _, h in keep.values()}
        self.host_alloc.free([h for h in st.host_pages if h not in kept])  # parked while the copy-in reads them
        st.eager = keep
        st.host_pages, st.host_len, r.kv_len, r.home = [], 0, target, KVHome.LOCAL
        s.start_running(r, s.rotary)
        r.rotations += 1
        self.rotations_in += 1
        return self.ready(r)

    # ---- integrity ------------------------------------------------------------------------------
    def check(self) -> None:
        """Every used host page is in exactly one place: a rotary request's KV, a running request's
        eager copy, or parked under a copy in flight."""
        s = self.s
        owners: dict[int, str] = {p: "in flight" for p in self.host_alloc.parked}
        for r in s.rotary:
            assert r.home is KVHome.HOST and not r.admitted and not r.pages, f"{r.rid} is not rotary"
            assert len(r.rot.host_pages) == s.kv.pages_for(r.rot.host_len) > 0, f"{r.rid}: host pages != KV"
            for p in r.rot.host_pages:
                assert p not in owners, f"host page {p} owned by {r.rid} and {owners[p]}"
                owners[p] = r.rid
        for r in s.running + s.waiting:
            assert not r.rot.host_pages, f"{r.rid} holds rotated KV but is {r.status.value}"
            for _, p in r.rot.eager.values():
                assert p not in owners, f"host page {p} owned by {r.rid} and {owners[p]}"
                owners[p] = r.rid
        alloc = self.host_alloc
        used = {p for p in range(1, alloc.num_pages) if alloc.is_used(p)}
        assert used == set(owners), f"host pages leaked: {sorted(used - set(owners))[:8]}, " \
                                    f"unallocated owned: {sorted(set(owners) - used)[:8]}"
