"""ForwardBatch.build's layout, checked against the definition (slot = page * page_size + offset, per token)."""

from __future__ import annotations

import random

import torch

from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode


def _rows(rng: random.Random, page_size: int) -> list[BatchRow]:
    rows = []
    for i in range(12):
        start = rng.choice([0, 1, page_size - 1, page_size, 3 * page_size + 5, rng.randrange(0, 400)])
        n = rng.choice([1, 1, 2, page_size, page_size + 1, rng.randrange(1, 300)])
        pages = rng.sample(range(1000), -(-(start + n) // page_size) + rng.randrange(0, 3))  # spare pages
        remote = 100 + i if n == 1 and rng.random() < 0.3 else None
        rows.append(BatchRow(start, [rng.randrange(5, 50_000) for _ in range(n)], pages, (n - 1,), remote))
    return rows


def test_build_matches_the_per_token_definition() -> None:
    rng = random.Random(0)
    for page_size in (1, 16, 64):
        for _ in range(20):
            rows = _rows(rng, page_size)
            b = ForwardBatch.build(rows, ForwardMode.EXTEND, page_size, "cpu")
            local = [r for r in rows if r.remote is None]
            want_loc = [r.pages[p // page_size] * page_size + p % page_size
                        for r in local for p in range(r.start, r.start + len(r.tokens))]
            assert b.out_cache_loc.tolist() == want_loc
            assert b.input_ids.tolist() == [t for r in rows for t in r.tokens]
            assert b.positions.tolist() == [p for r in rows for p in range(r.start, r.start + len(r.tokens))]
            assert b.out_cache_loc.dtype == b.positions.dtype == b.input_ids.dtype == torch.long
            assert b.kv_indptr.dtype == b.kv_last_page_len.dtype == b.kv_indices.dtype == torch.int32
            n_pages = [-(-(r.start + len(r.tokens)) // page_size) for r in local]
            assert b.kv_indices.tolist() == [p for r, n in zip(local, n_pages, strict=True) for p in r.pages[:n]]
            assert b.kv_indptr.tolist() == [sum(n_pages[:i]) for i in range(len(local) + 1)]
            assert b.kv_last_page_len.tolist() == [r.start + len(r.tokens) - (n - 1) * page_size
                                                   for r, n in zip(local, n_pages, strict=True)]
            assert (b.split is not None) == any(r.remote is not None for r in rows)


def test_build_of_remote_rows_only_has_empty_local_layout() -> None:
    rows = [BatchRow(7, [11], [3], (0,), remote=1), BatchRow(40, [12], [5, 6, 9], (0,), remote=2)]
    b = ForwardBatch.build(rows, ForwardMode.DECODE, 16, "cpu")
    assert b.out_cache_loc.numel() == 0 and b.kv_indices.numel() == 0 and b.kv_indptr.tolist() == [0]
    assert b.split is not None and b.split.remote_tokens.tolist() == [0, 1] and b.split.local_tokens.numel() == 0
