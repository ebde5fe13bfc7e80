"""The batched sampler, shared by the plain and the overlap loops; tokens stay on the device.

    logits ─ logit_bias, bans, penalties (batched) ─┬─ argmax ─────────────────────── greedy rows
                                                    └─ / temperature ─ filter ─ draw ── sampled rows

Filters follow SGLang: top-k, top-p and min-p are each a mask on the same (unrenormalised)
distribution, and a token survives all three; ties at a threshold survive. Two ways to draw:

* exact (CPU and GPU): the row's kept probabilities are summed in vocabulary order and the
  token is found by inverting that CDF at the row's uniform (`rng.py`) -- so a seeded row's token
  depends on its own logits and seed alone, never on its batch. Top-p needs the row sorted.
* FlashInfer (GPU, unseeded rows without min-p): its sorting-free rejection kernels, drawing
  from the worker's device generator. Its Philox streams are keyed by the row's place in the
  batch, which is why seeded rows never take this path. With `top_k_window` > 0, such rows that
  all have a top-k of at most that many take `window_draw` instead: FlashInfer's fused softmax and
  radix top-k, then work on [B, k] only (the rejection kernels need more rounds the flatter the
  distribution). Where Triton is there, the work on [B, k] is one kernel (`window_pick.py`). The
  server turns it on (`--sampling-top-k-window`, 256; measured in bench/sampling.py --top-k-window).

Greedy rows are exactly the argmax of the adjusted logits. Penalty statistics are updated on the
device as the tokens are drawn (`penalties.py`).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sglang_ext.sampling.batch import Rows, SampleRow, SamplingBatch
from sglang_ext.sampling.penalties import PenaltyTable
from sglang_ext.sampling.rng import RowRandom

logger = logging.getLogger(__name__)


def adjust_logits(logits: torch.Tensor, sb: SamplingBatch, table: PenaltyTable | None) -> torch.Tensor:
    """logit_bias, then min_new_tokens bans, then repetition / frequency / presence penalties.
    Never writes to `logits` (the caller may still want the raw values for logprobs)."""
    out = logits
    assert logits.shape[1] == sb.vocab, "the batch's offsets are into rows of its vocabulary"
    if sb.bias is not None or sb.bans is not None:
        out = logits.clone()
        if sb.bias is not None:
            at, vals = sb.bias
            out.view(-1).index_add_(0, at, vals)
        if sb.bans is not None:
            out.view(-1).index_fill_(0, sb.bans, float("-inf"))
    if sb.pen_rows is not None:
        assert table is not None and sb.pen_slots is not None and sb.repetition is not None
        every = sb.pen_all_rows  # the common case: every row penalised, in order
        sub = out if every else out.index_select(0, sb.pen_rows)
        if sb.any_repetition:
            rep = sb.repetition.unsqueeze(1)
            sub = torch.where(table.seen.index_select(0, sb.pen_slots),
                              torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - table.additive.index_select(0, sb.pen_slots)
        if every:
            return sub
        if out is logits:
            out = logits.clone()
        out.index_copy_(0, sb.pen_rows, sub)
    return out


def filter_threshold(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                     max_top_k: int, any_top_p: bool, any_min_p: bool, top_p_sorts: bool = True) -> torch.Tensor:
    """Per row, the smallest probability that survives top-k, top-p and min-p ([B, 1]).

    A row with top-k never keeps more than its k largest, so when every top-p row has a top-k,
    the top-p boundary is looked for among the `max_top_k` largest only (no full sort): if it lies
    beyond them, the top-k threshold is the higher one anyway."""
    top = torch.topk(probs, max_top_k, dim=-1).values if max_top_k > 0 else None  # sorted, as many as the largest k
    if top is not None or any_top_p:
        sorted_p = torch.sort(probs, dim=-1, descending=True)[0] if any_top_p and (top_p_sorts or top is None) else None
        t = sorted_threshold(top, sorted_p, top_k, top_p, max_top_k, any_top_p)
    else:
        t = torch.zeros(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    if any_min_p:
        t = torch.maximum(t, min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values)
    return t


def sorted_threshold(top: torch.Tensor | None, sorted_p: torch.Tensor | None, top_k: torch.Tensor,
                     top_p: torch.Tensor, max_top_k: int, any_top_p: bool) -> torch.Tensor:
    """The top-k and top-p part of `filter_threshold` ([B, 1]) from each row's `max_top_k` largest
    probabilities (`top`, descending; None without top-k) and, for top-p, all its probabilities in
    descending order (`sorted_p`; None when `top` suffices: every top-p row has a top-k)."""
    ref = top if top is not None else sorted_p
    assert ref is not None, "a threshold of neither top-k nor top-p"
    t = torch.zeros(ref.shape[0], 1, dtype=ref.dtype, device=ref.device)
    if top is not None:
        kth = top.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        t = torch.where(top_k.unsqueeze(1) <= max_top_k, kth, t)  # rows without top-k keep 0
    if any_top_p:
        sp = sorted_p if sorted_p is not None else ref
        before = torch.cumsum(sp, dim=-1) - sp  # mass strictly above each token
        last = (before <= top_p.unsqueeze(1)).sum(-1, keepdim=True).clamp(min=1) - 1
        t = torch.maximum(t, sp.gather(1, last))
    return t


TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (values, indices), descending


def window_draw(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int, any_top_p: bool,
                generator: torch.Generator | None, topk: TopK) -> torch.Tensor:
    """Token ids [B] drawn from `probs` (the whole row's softmax) filtered by top-k and top-p, for rows
    that all have a top-k of at most `max_top_k`: only each row's `max_top_k` largest probabilities are
    looked at. They are the full row's probabilities, so top-p's mass is the same as on the whole row,
    and the kept tokens are exactly `filtered_probs`' (up to ties at the window's edge). The draw is an
    exponential race (argmax of p / Exp(1)): a token wins with probability proportional to p."""
    vals, ids = topk(probs, max_top_k)
    t = sorted_threshold(vals, None, top_k, top_p, max_top_k, any_top_p)
    # a draw of exactly 0 would make 0 / 0 of a filtered token: floor it at the smallest normal float
    race = torch.where(vals >= t, vals, torch.zeros_like(vals)) / torch.empty_like(vals).exponential_(
        generator=generator).clamp_(min=torch.finfo(vals.dtype).tiny)
    return ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, max_top_k: int, any_top_p: bool, any_min_p: bool,
                   top_p_sorts: bool = True) -> torch.Tensor:
    """softmax(logits / T) with filtered-out tokens set to 0 (not renormalised)."""
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    if max_top_k > 0 or any_top_p or any_min_p:
        t = filter_threshold(probs, top_k, top_p, min_p, max_top_k, any_top_p, any_min_p, top_p_sorts)
        probs = torch.where(probs >= t, probs, torch.zeros_like(probs))
    return probs


def invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative mass (vocabulary order) first exceeds u * total, per row."""
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms.unsqueeze(1) * cdf[:, -1:]
    # cdf only rises at tokens with mass, so the first index above the target holds a kept token
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)


def _compiled_window_pick(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """`window_pick.pick`, compiled now; None (the window's last step in torch ops) if Triton cannot
    build it on this machine: sampling slows down, it does not stop."""
    try:
        from sglang_ext.sampling import window_pick

        window_pick.warm(device)
        return window_pick.pick
    except Exception as e:  # a compiler or driver problem: say which, keep serving
        logger.warning("top-k window draw: Triton kernel unavailable (%s: %s); using torch ops", type(e).__name__, e)
        return None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0,
                 use_flashinfer: bool | None = None, top_k_window: int = 0) -> None:
        """`top_k_window`: FlashInfer's rows whose top-ks are all at most this take `window_draw` (0: never)."""
        self.vocab = vocab_size
        self.top_k_window = top_k_window
        self.device = torch.device(device)
        self.rng = RowRandom(seed)
        self.penalties = PenaltyTable(vocab_size, self.device)
        if use_flashinfer is None:
            use_flashinfer = self.device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None
        self.fi: Any = None
        self.fi_topk: Any = None
        self.fi_pick: Any = None  # window_pick.pick when Triton is there
        self.picks = 0  # window_pick calls so far: each gets its own Philox seed
        self.seed = seed
        self.gen: torch.Generator | None = None
        if use_flashinfer:
            import flashinfer.sampling

            self.fi = flashinfer.sampling
            if top_k_window > 0:
                import flashinfer.topk

                self.fi_topk = flashinfer.topk
                if importlib.util.find_spec("triton") is not None:
                    self.fi_pick = _compiled_window_pick(self.device)
            self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def batch(self, rows: Sequence[SampleRow]) -> SamplingBatch:
        return SamplingBatch.build(rows, self.vocab, self.rng, self.device, fast_draw=self.fi is not None,
                                   top_k_window=self.top_k_window)

    def sample(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64 on the device. No host sync and no copy to
        the device: every index it needs came with `sb` (tests/test_sampling.py checks both)."""
        logits = adjust_logits(logits, sb, self.penalties)
        if any(sb.greedy):
            tokens = torch.argmax(logits, dim=-1)
        else:  # every row is drawn below; the argmax is a full pass over the logits (~40 us at bs 64)
            tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if sb.fast_rows is not None:
            assert self.fi is not None, "a batch built for FlashInfer, sampled without it"
            self._draw_rows(tokens, logits, sb.fast_rows, sb, self._draw_flashinfer)
        if sb.exact_rows is not None:
            self._draw_rows(tokens, logits, sb.exact_rows, sb, self._draw_exact)
        if sb.pen_rows is not None:
            assert sb.pen_offsets is not None and sb.pen_again is not None and sb.pen_first is not None
            drawn = tokens if sb.pen_all_rows else tokens.index_select(0, sb.pen_rows)
            self.penalties.record(sb.pen_offsets, drawn, sb.pen_again, sb.pen_first)
        return tokens

    @staticmethod
    def _draw_rows(tokens: torch.Tensor, logits: torch.Tensor, rows: Rows, sb: SamplingBatch,
                   draw: Callable[[torch.Tensor, Rows, SamplingBatch], torch.Tensor]) -> None:
        if isinstance(rows, slice):
            tokens.copy_(draw(logits, rows, sb))
        else:
            tokens.index_copy_(0, rows, draw(logits.index_select(0, rows), rows, sb))

    @staticmethod
    def _draw_exact(logits: torch.Tensor, rows: Rows, sb: SamplingBatch) -> torch.Tensor:
        probs = filtered_probs(logits, sb.temperature[rows], sb.top_k[rows], sb.top_p[rows], sb.min_p[rows],
                               sb.max_top_k, sb.any_top_p, sb.any_min_p, sb.top_p_sorts)
        return invert_cdf(probs, sb.uniforms[rows])

    def _draw_flashinfer(self, logits: torch.Tensor, rows: Rows, sb: SamplingBatch) -> torch.Tensor:
        if sb.fast_in_window:
            probs = self.fi.softmax(logits, temperature=sb.temperature[rows])  # one fused kernel
            if self.fi_pick is not None:
                vals, ids = self._radix_topk(probs, sb.max_top_k)
                self.picks += 1
                return self.fi_pick(vals, ids, sb.top_k[rows], sb.top_p[rows], sb.any_top_p,
                                    seed=self.seed * 1_000_003 + self.picks)
            return window_draw(probs, sb.top_k[rows], sb.top_p[rows], sb.max_top_k, sb.any_top_p, self.gen,
                               self._radix_topk)
        scaled = logits / sb.temperature[rows].unsqueeze(1)
        if sb.max_top_k > 0 or sb.any_top_p:
            out = self.fi.top_k_top_p_sampling_from_logits(
                scaled, sb.top_k[rows].to(torch.int32), sb.top_p[rows], filter_apply_order="joint",
                generator=self.gen)
        else:
            out = self.fi.sampling_from_logits(scaled, generator=self.gen)
        return out.long()

    def _radix_topk(self, probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's radix top-k (one pass over the row, where torch.topk runs several kernels)."""
        return self.fi_topk.top_k(probs, k, sorted=True)


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Log-probabilities (raw logits, before temperature/penalties) of `token_ids`, plus top-n."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1)).squeeze(1).tolist()
    tops: list[list[tuple[float, int]]] = []
    if top_n > 0:
        v, ix = torch.topk(lp, min(top_n, lp.shape[1]), dim=-1)
        tops = [list(zip(vr, ir, strict=True)) for vr, ir in zip(v.tolist(), ix.tolist(), strict=True)]
    return chosen, tops
