"""The placement strategies a router runs, built from its configuration: the one place that knows
them all and wires one to another (the core sees only `PlacementStrategy`)."""

from __future__ import annotations

from collections.abc import Sequence

from router.config import OffloadSpec
from router.placement.base import PlacementStrategy, RouterHandle
from router.placement.offload import OffloadPlacement
from router.placement.pd import PDPlacement


def build_strategies(router: RouterHandle, offload: Sequence[OffloadSpec] = ()) -> list[PlacementStrategy]:
    """Offload placement for the cluster file's `offload:` entries (none without), then PD placement (KV
    pairs of models with prefill and decode workers: always). In this order they hear each event; the
    PD one picks decode workers by the offload one's Adrenaline executors."""
    off = OffloadPlacement(router, offload) if offload else None
    pd = PDPlacement(router, off.adrenaline_executor) if off is not None else PDPlacement(router)
    return [off, pd] if off is not None else [pd]
