"""One step's sampling parameters as device tensors, built once on the host without a sync.

The scheduler describes each row (`SampleRow`); `SamplingBatch.build` packs every per-row value
(temperature, top-k, top-p, min-p, a uniform random number from `rng.py`) and the sparse
(row, token) lists of `logit_bias`, min_new_tokens bans and penalties into two host buffers,
and moves each to the device in one asynchronous copy (pinned memory on a GPU: the caching host
allocator keeps a buffer alive until its copy has run). Flags on the host say which stages any
row needs, so a greedy or plain-temperature batch skips the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from sglang_ext.sampling.params import SamplingParams
from sglang_ext.sampling.rng import RowRandom


class SampleRow(NamedTuple):
    params: SamplingParams
    counter: int  # which output token of the request this is (0 for the first)
    banned: Sequence[int] = ()  # token ids masked out (eos / stop ids below min_new_tokens)
    penalty_slot: int = -1  # the request's PenaltyTable slot; -1 when it has no penalties


@dataclass
class SamplingBatch:
    size: int
    greedy: list[bool]  # host: rows that take the argmax
    exact_only: list[bool]  # host: rows the counter-based exact draw must take (seeded, or min-p)
    temperature: torch.Tensor  # [B] float32 (1.0 on greedy rows)
    top_p: torch.Tensor  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor  # [B] float32, 0.0 where disabled
    uniforms: torch.Tensor  # [B] float32 in [0, 1)
    top_k: torch.Tensor  # [B] int64, vocab size where disabled
    max_top_k: int  # host: the largest top-k any sampled row asks for (0: none)
    any_top_p: bool
    top_p_sorts: bool  # host: a top-p row has no top-k, so its threshold needs the whole row sorted
    any_min_p: bool
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, values
    bans: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids
    # penalties: rows that have them and their PenaltyTable slots
    pen_rows: torch.Tensor | None = None
    pen_slots: torch.Tensor | None = None
    pen_all_rows: bool = False  # host: every row, in order
    repetition: torch.Tensor | None = None  # [P]
    any_repetition: bool = False

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    @classmethod
    def build(cls, rows: Sequence[SampleRow], vocab_size: int, rng: RowRandom,
              device: torch.device | str) -> SamplingBatch:
        device = torch.device(device)
        b = len(rows)
        ps = [r.params for r in rows]
        greedy = [p.is_greedy for p in ps]
        sampled = [p for p, g in zip(ps, greedy, strict=True) if not g]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
        # ---- floats: 4 per row, then bias values, then repetition penalties
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                for key, val in r.params.logit_bias.items():
                    bias_rows.append(i)
                    bias_ids.append(int(key))
                    bias_vals.append(val)
            if r.banned:
                ban_rows.extend([i] * len(r.banned))
                ban_ids.extend(r.banned)
        pen = [i for i, r in enumerate(rows) if r.penalty_slot >= 0]
        floats = np.empty(4 * b + len(bias_vals) + len(pen), dtype=np.float32)
        floats[0:b] = [1.0 if g else p.temperature for p, g in zip(ps, greedy, strict=True)]
        floats[b : 2 * b] = [p.top_p for p in ps]
        floats[2 * b : 3 * b] = [p.min_p for p in ps]
        floats[3 * b : 4 * b] = rng.uniforms([p.seed for p in ps], [r.counter for r in rows]) if sampled else 0.0
        floats[4 * b : 4 * b + len(bias_vals)] = bias_vals
        floats[4 * b + len(bias_vals) :] = [ps[i].repetition_penalty for i in pen]
        ints = np.array([*top_k, *bias_rows, *bias_ids, *ban_rows, *ban_ids, *pen,
                         *(rows[i].penalty_slot for i in pen)], dtype=np.int64)
        f, n = _to_device(floats, device), _to_device(ints, device)
        sb = cls(
            size=b, greedy=greedy,
            exact_only=[p.seed is not None or p.min_p > 0.0 for p in ps],
            temperature=f[0:b], top_p=f[b : 2 * b], min_p=f[2 * b : 3 * b], uniforms=f[3 * b : 4 * b],
            top_k=n[0:b],
            max_top_k=max((p.top_k for p in sampled if 0 < p.top_k < vocab_size), default=0),
            any_top_p=any(p.top_p < 1.0 for p in sampled),
            top_p_sorts=any(p.top_p < 1.0 and not 0 < p.top_k < vocab_size for p in sampled),
            any_min_p=any(p.min_p > 0.0 for p in sampled),
        )
        o = b
        if bias_rows:
            k = len(bias_rows)
            sb.bias = (n[o : o + k], n[o + k : o + 2 * k], f[4 * b : 4 * b + k])
            o += 2 * k
        if ban_rows:
            k = len(ban_rows)
            sb.bans = (n[o : o + k], n[o + k : o + 2 * k])
            o += 2 * k
        if pen:
            k = len(pen)
            sb.pen_rows, sb.pen_slots = n[o : o + k], n[o + k : o + 2 * k]
            sb.pen_all_rows = k == b
            sb.repetition = f[4 * b + len(bias_vals) :]
            sb.any_repetition = any(ps[i].repetition_penalty != 1.0 for i in pen)
        return sb


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cuda":
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t)
        return pinned.to(device, non_blocking=True)
    return t.to(device)
