"""Copy plans for moving KV pages between two page arrays (device pool <-> host pool).

Pure host-side logic, used by `DuplexRotationEngine` and tested on CPU:
- `check_pages`: a transfer's page lists validated before any copy.
- `plan_runs`: the (src, dst) page pairs merged into maximal runs where both sides are consecutive,
  so a request whose pages were allocated together moves in a few large copies.
"""

from __future__ import annotations

from typing import NamedTuple


class Run(NamedTuple):
    src: int  # first source page
    dst: int  # first destination page
    n: int  # pages


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
