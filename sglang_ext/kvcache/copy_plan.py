"""Copy plans for moving KV pages between two page arrays (device pool <-> host pool).

Pure host-side logic, shared by every `DuplexRotationEngine` method and tested on CPU:
- `plan_runs`: the (src, dst) page pairs merged into maximal runs where both sides are consecutive,
  so a request whose pages were allocated together moves in a few large copies.
- `plan_staged`: the pairs grouped by runs of consecutive host pages and cut into chunks that fit a
  bounded staging buffer; the device side of a chunk is gathered/scattered on the GPU (index_select /
  index_copy_, ~1.7 TB/s), so only the host side decides how many link copies there are.
"""

from __future__ import annotations

from typing import NamedTuple


class Run(NamedTuple):
    src: int  # first source page
    dst: int  # first destination page
    n: int  # pages


class HostRun(NamedTuple):
    row: int  # first staging row
    host: int  # first host page
    n: int


class StagedChunk(NamedTuple):
    dev_pages: list[int]  # staging row i holds device page dev_pages[i]
    host_runs: list[HostRun]  # rows [row, row + n) <-> host pages [host, host + n)


def check_pages(src: list[int], dst: list[int], num_src: int, num_dst: int) -> None:
    """Reject what a raw-pointer copy would turn into memory corruption: unequal lengths, ids outside
    [1, num_pages) (page 0 of either pool is reserved), and a destination page written twice (copies in
    one batch have no order, so the result would be undefined)."""
    if len(src) != len(dst):
        raise ValueError(f"page lists differ in length: {len(src)} source vs {len(dst)} destination pages")
    if not src:
        return
    for name, pages, limit in (("source", src, num_src), ("destination", dst, num_dst)):
        lo, hi = min(pages), max(pages)
        if lo < 1 or hi >= limit:
            bad = lo if lo < 1 else hi
            raise ValueError(f"{name} page {bad} outside [1, {limit}) (page 0 is reserved)")
    if len(set(dst)) != len(dst):
        raise ValueError("a destination page appears twice in one transfer")


def plan_runs(src: list[int], dst: list[int]) -> list[Run]:
    """Pairs sorted by source page, merged while both sides stay consecutive."""
    runs: list[Run] = []
    for s, d in sorted(zip(src, dst, strict=True)):
        if runs:
            r = runs[-1]
            if s == r.src + r.n and d == r.dst + r.n:
                runs[-1] = Run(r.src, r.dst, r.n + 1)
                continue
        runs.append(Run(s, d, 1))
    return runs


def plan_staged(dev: list[int], host: list[int], capacity: int) -> list[StagedChunk]:
    """Pairs sorted by host page, cut into chunks of at most `capacity` staging rows; a host run that
    crosses a chunk boundary is split there."""
    if capacity < 1:
        raise ValueError(f"staging capacity must be at least one page, got {capacity}")
    chunks: list[StagedChunk] = []
    dev_pages: list[int] = []
    host_runs: list[HostRun] = []
    for h, d in sorted(zip(host, dev, strict=True)):
        if len(dev_pages) == capacity:
            chunks.append(StagedChunk(dev_pages, host_runs))
            dev_pages, host_runs = [], []
        row = len(dev_pages)
        dev_pages.append(d)
        if host_runs and h == host_runs[-1].host + host_runs[-1].n:
            r = host_runs[-1]
            host_runs[-1] = HostRun(r.row, r.host, r.n + 1)
        else:
            host_runs.append(HostRun(row, h, 1))
    if dev_pages:
        chunks.append(StagedChunk(dev_pages, host_runs))
    return chunks
