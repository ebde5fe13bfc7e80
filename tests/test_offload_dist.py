"""Remote attention over torch.distributed (gloo): a sender's `DistRemote` and a host's
`ExecutorService`."""

from __future__ import annotations

import torch

from sglang_ext.offload.partition import ForeignKVPartition


def test_executor_memory_starts_zeroed() -> None:
    """The torch backend reads whole pages and masks what it must not see; a NaN left in recycled
    memory would still poison the output (0 * NaN). Freed NaN-filled memory is what malloc hands
    back next, so this failed with an uninitialised arena."""
    n = 40 * 4096
    for _ in range(5):
        junk = torch.full((n // 4,), float("nan"))
        del junk
        assert ForeignKVPartition(n, "cpu", slab_bytes=1 << 15).arena.count_nonzero() == 0
