"""The window draw's fused last step (`sglang_ext/sampling/window_pick.py`, one Triton kernel) against the
sort-based reference. On a machine without CUDA the kernel runs under Triton's interpreter
(TRITON_INTERPRET=1, numpy on the CPU), so its arithmetic is checked here too; skipped where Triton
is not installed (`pip install triton`)."""

from __future__ import annotations

import importlib.util

import _triton_interp
import pytest
import torch
from test_sampling import StubFlashInfer, V, _logits, _sample, chi2_pvalue, ref_filtered

from sglang_ext.sampling.params import SamplingParams
from sglang_ext.sampling.sampler import Sampler

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (pip install triton; runs under its interpreter without a GPU)",
                allow_module_level=True)
DEVICE = _triton_interp.device(fixes=False)  # before the kernel is imported below
from sglang_ext.sampling import window_pick  # noqa: E402

# The interpreter runs ~30 ms per row (one program each): the CPU draws few rows, the GPU ten times more.
SCALE = 10 if DEVICE == "cuda" else 1


def _window(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = torch.topk(probs, k, dim=-1)
    return vals.contiguous(), ids.contiguous()


def _pick(probs: torch.Tensor, k: int, top_k: list[int], top_p: list[float], seed: int) -> list[int]:
    vals, ids = _window(probs.to(DEVICE), k)
    out = window_pick.pick(vals, ids, torch.tensor(top_k, device=DEVICE), torch.tensor(top_p, device=DEVICE),
                           any(p < 1.0 for p in top_p), seed)
    assert out.dtype == torch.int64 and out.shape == (probs.shape[0],)
    return out.tolist()


def test_a_top_k_of_one_or_a_tiny_top_p_is_the_argmax() -> None:
    probs = torch.softmax(_logits(6, seed=4), dim=-1)
    best = probs.argmax(dim=-1).tolist()
    assert _pick(probs, 8, [1] * 6, [1.0] * 6, seed=3) == best
    assert _pick(probs, 8, [8] * 6, [1e-6] * 6, seed=4) == best


def test_only_the_kept_tokens_are_drawn_and_ties_at_the_threshold_survive() -> None:
    """Four large tokens (0.30, 0.25, 0.20, 0.15) and six small: top-p 0.5 keeps the two whose mass
    strictly above is at most 0.5, top-k 3 keeps three; each kept token is drawn, no other. As in
    SGLang, a token tied with the threshold survives: two equal largest tokens under top-k 1."""
    n = 48 * SCALE  # a kept token is missed with probability below 0.73 ** 48 = 3e-7
    probs = torch.full((n, 10), 0.1 / 6)
    probs[:, [7, 2, 5, 0]] = torch.tensor([0.30, 0.25, 0.20, 0.15])
    assert set(_pick(probs, 6, [6] * n, [0.5] * n, seed=1)) == {7, 2}
    assert set(_pick(probs, 6, [3] * n, [1.0] * n, seed=2)) == {7, 2, 5}
    probs[:, 2] = 0.30
    assert set(_pick(probs, 6, [1] * n, [1.0] * n, seed=3)) == {7, 2}


def test_sampler_window_draws_through_the_kernel_follow_the_filtered_distribution() -> None:
    """The Sampler's window path with the kernel as its last step (FlashInfer's softmax and top-k
    stood in by torch) against the reference, each step a fresh Philox seed."""
    row = _logits(1, seed=3)[0]
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=12)
    n = 200 * SCALE
    sampler = Sampler(V, DEVICE, seed=5, use_flashinfer=False, top_k_window=256)
    sampler.fi = sampler.fi_topk = StubFlashInfer()
    sampler.fi_pick = window_pick.pick
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(2):
        for t in _sample(row.expand(n, V).contiguous().to(DEVICE), [p] * n, sampler):
            counts[t] += 1
    assert sampler.picks == 2
    assert chi2_pvalue(counts, ref_filtered(row, p)) > 1e-4


def test_rows_keep_their_own_filters_and_seeds_differ_per_call() -> None:
    n = 60 * SCALE
    probs = torch.softmax(_logits(2, seed=9).repeat(n, 1), dim=-1)
    a = _pick(probs, 20, [3, 20] * n, [1.0, 0.5] * n, seed=11)
    b = _pick(probs, 20, [3, 20] * n, [1.0, 0.5] * n, seed=12)
    assert a != b
    assert a == _pick(probs, 20, [3, 20] * n, [1.0, 0.5] * n, seed=11)  # a seed fixes the draw
    for j, (k, top_p) in enumerate([(3, 1.0), (20, 0.5)]):
        p = SamplingParams(temperature=1.0, top_k=k, top_p=top_p)
        counts = torch.bincount(torch.tensor(a[j::2] + b[j::2]), minlength=V).double()
        assert chi2_pvalue(counts, ref_filtered(torch.log(probs[j]), p)) > 1e-4
