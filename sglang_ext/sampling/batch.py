"""One step's sampling parameters as device tensors, built once on the host without a sync.

The scheduler describes each row (`SampleRow`); `SamplingBatch.build` packs every per-row value
(temperature, top-k, top-p, min-p, a uniform random number from `rng.py`), the sparse (row, token)
lists of `logit_bias`, min_new_tokens bans and penalties, and the rows each draw takes into two
host buffers, and moves each to the device in one asynchronous copy (`to_device`). Flags on the
host say which stages any row needs, so a greedy or plain-temperature batch skips the rest.

Everything the sampler later indexes with is in those two copies: it never builds a tensor from a
Python list itself, so a step makes no other host-to-device copy (a copy from pageable memory can
wait for the stream) and reads nothing back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from sglang_ext.sampling.params import SamplingParams
from sglang_ext.sampling.rng import RowRandom

Rows = slice | torch.Tensor  # every row (slice(None)) or some of them (int64 indices on the device)


class SampleRow(NamedTuple):
    params: SamplingParams
    counter: int  # which output token of the request this is (0 for the first)
    banned: Sequence[int] = ()  # token ids masked out (eos / stop ids below min_new_tokens)
    penalty_slot: int = -1  # the request's PenaltyTable slot; -1 when it has no penalties


@dataclass
class SamplingBatch:
    size: int
    vocab: int  # the logits' width the offsets below are for
    greedy: list[bool]  # host: rows that take the argmax
    exact_only: list[bool]  # host: rows the counter-based exact draw must take (seeded, or min-p)
    fast_rows: Rows | None  # rows FlashInfer draws (built with fast_draw), None if none
    exact_rows: Rows | None  # rows the exact counter-based draw takes, None if none
    temperature: torch.Tensor  # [B] float32 (1.0 on greedy rows)
    top_p: torch.Tensor  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor  # [B] float32, 0.0 where disabled
    uniforms: torch.Tensor  # [B] float32 in [0, 1)
    top_k: torch.Tensor  # [B] int64, vocab size where disabled
    max_top_k: int  # host: the largest top-k any sampled row asks for (0: none)
    any_top_p: bool
    top_p_sorts: bool  # host: a top-p row has no top-k, so its threshold needs the whole row sorted
    any_min_p: bool
    fast_in_window: bool = False  # host: the fast rows take the top-k window draw (Sampler.top_k_window)
    # logit_bias and bans as offsets into the flattened [B, V] logits (row * V + token id), so that
    # applying them is one kernel each
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # offsets, values
    bans: torch.Tensor | None = None  # offsets
    # penalties: rows that have them and their PenaltyTable slots
    pen_rows: torch.Tensor | None = None
    pen_slots: torch.Tensor | None = None
    pen_all_rows: bool = False  # host: every row, in order
    repetition: torch.Tensor | None = None  # [P]
    any_repetition: bool = False
    # what recording a sampled token costs, per penalised row (PenaltyTable.record): the slot's offset
    # in the flattened table, and what the token adds to its additive penalty (frequency, plus
    # presence on its first occurrence)
    pen_offsets: torch.Tensor | None = None  # [P] int64: slot * vocab
    pen_again: torch.Tensor | None = None  # [P] float32: frequency
    pen_first: torch.Tensor | None = None  # [P] float32: frequency + presence

    @classmethod
    def build(cls, rows: Sequence[SampleRow], vocab_size: int, rng: RowRandom,
              device: torch.device | str, fast_draw: bool = False, top_k_window: int = 0) -> SamplingBatch:
        """`fast_draw`: the sampler has FlashInfer, which takes the unseeded rows without min-p;
        `top_k_window`: those rows take the window draw when each has a top-k of at most this."""
        device = torch.device(device)
        b = len(rows)
        ps = [r.params for r in rows]
        greedy = [p.is_greedy for p in ps]
        exact_only = [p.seed is not None or p.min_p > 0.0 for p in ps]
        sampled = [p for p, g in zip(ps, greedy, strict=True) if not g]
        drawn = [i for i, g in enumerate(greedy) if not g]
        fast = [i for i in drawn if fast_draw and not exact_only[i]]
        exact = [i for i in drawn if not fast_draw or exact_only[i]]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
        # ---- floats: 4 per row, the bias values, then per penalised row its repetition penalty,
        # frequency and frequency + presence
        bias_at: list[int] = []
        bias_vals: list[float] = []
        bans_at: list[int] = []
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                for key, val in r.params.logit_bias.items():
                    bias_at.append(i * vocab_size + int(key))
                    bias_vals.append(val)
            bans_at.extend(i * vocab_size + t for t in r.banned)
        pen = [i for i, r in enumerate(rows) if r.penalty_slot >= 0]
        k = len(pen)
        fp = 4 * b + len(bias_vals)  # where the penalised rows' floats start
        floats = np.empty(fp + 3 * k, dtype=np.float32)
        floats[0:b] = [1.0 if g else p.temperature for p, g in zip(ps, greedy, strict=True)]
        floats[b : 2 * b] = [p.top_p for p in ps]
        floats[2 * b : 3 * b] = [p.min_p for p in ps]
        floats[3 * b : 4 * b] = rng.uniforms([p.seed for p in ps], [r.counter for r in rows]) if sampled else 0.0
        floats[4 * b : fp] = bias_vals
        floats[fp : fp + k] = [ps[i].repetition_penalty for i in pen]
        freq = np.array([ps[i].frequency_penalty for i in pen], dtype=np.float32)
        floats[fp + k : fp + 2 * k] = freq
        # summed in float32, as the device summed them before (the same bits in the table)
        floats[fp + 2 * k :] = freq + np.array([ps[i].presence_penalty for i in pen], dtype=np.float32)
        # ---- ints: top-k per row, the bias and ban offsets, penalised rows with their slots and
        # slot offsets, then each draw's rows where it takes only some
        slots = [rows[i].penalty_slot for i in pen]
        ints = np.array([*top_k, *bias_at, *bans_at, *pen, *slots,
                         *(s * vocab_size for s in slots), *(fast if len(fast) < b else ()),
                         *(exact if len(exact) < b else ())], dtype=np.int64)
        f, n = to_device(floats, device), to_device(ints, device)
        sb = cls(
            size=b, vocab=vocab_size, greedy=greedy, exact_only=exact_only,
            fast_rows=None, exact_rows=None,
            temperature=f[0:b], top_p=f[b : 2 * b], min_p=f[2 * b : 3 * b], uniforms=f[3 * b : 4 * b],
            top_k=n[0:b],
            max_top_k=max((p.top_k for p in sampled if 0 < p.top_k < vocab_size), default=0),
            any_top_p=any(p.top_p < 1.0 for p in sampled),
            top_p_sorts=any(p.top_p < 1.0 and not 0 < p.top_k < vocab_size for p in sampled),
            any_min_p=any(p.min_p > 0.0 for p in sampled),
        )
        sb.fast_in_window = bool(fast) and 0 < sb.max_top_k <= top_k_window and all(
            0 < ps[i].top_k < vocab_size for i in fast)
        o = b
        if bias_at:
            sb.bias = (n[o : o + len(bias_at)], f[4 * b : fp])
            o += len(bias_at)
        if bans_at:
            sb.bans = n[o : o + len(bans_at)]
            o += len(bans_at)
        if pen:
            sb.pen_rows, sb.pen_slots, sb.pen_offsets = n[o : o + k], n[o + k : o + 2 * k], n[o + 2 * k : o + 3 * k]
            o += 3 * k
            sb.pen_all_rows = k == b
            sb.repetition, sb.pen_again, sb.pen_first = f[fp : fp + k], f[fp + k : fp + 2 * k], f[fp + 2 * k :]
            sb.any_repetition = any(ps[i].repetition_penalty != 1.0 for i in pen)
        sb.fast_rows, o = _rows(fast, b, n, o)
        sb.exact_rows, o = _rows(exact, b, n, o)
        return sb


def _rows(idx: list[int], b: int, packed: torch.Tensor, o: int) -> tuple[Rows | None, int]:
    """A draw's rows: None, every row, or their indices (packed at `o` when only some)."""
    if not idx:
        return None, o
    if len(idx) == b:
        return slice(None), o
    return packed[o : o + len(idx)], o + len(idx)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """`a` on `device` in one asynchronous copy. On a GPU it is staged in pinned memory first: a
    copy from pageable memory may wait for the stream, and the caching host allocator keeps the
    pinned buffer alive until its copy has run."""
    t = torch.from_numpy(a)
    if device.type == "cuda":
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t)
        return pinned.to(device, non_blocking=True)
    return t.to(device)
