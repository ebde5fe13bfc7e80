"""The sampler on a GPU: FlashInfer's rows follow the filtered distribution (chi-square against
the same reference as the CPU tests), seeded rows give the same tokens on the GPU as on the CPU and
whatever their batch, and greedy rows are the argmax. Skipped where CUDA or FlashInfer is absent."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_sampling import V, chi2_pvalue, ref_filtered

from sglang_ext.sampling.batch import SampleRow
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.sampling.sampler import Sampler

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer (pip install flashinfer-python)", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _draw(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], counters: list[int]) -> list[int]:
    sb = sampler.batch([SampleRow(p, c) for p, c in zip(params, counters, strict=True)])
    return sampler.sample(logits, sb).tolist()


def _sample_without_sync(sampler: Sampler, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """One step after a warm-up (JIT, allocator), under torch's sync debug mode: it raises on any
    synchronising call."""
    sampler.sample(logits, sampler.batch(rows))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return sampler.sample(logits, sampler.batch(rows))
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _draws_pvalue(sampler: Sampler, p: SamplingParams) -> float:
    """10,000 draws from one row of logits: the chi-square p-value against the sort-based reference."""
    row = torch.randn(1, V, generator=torch.Generator().manual_seed(3))[0] * 2.0
    counts = torch.zeros(V, dtype=torch.float64)
    logits = row.expand(1000, V).contiguous().cuda()
    for _ in range(10):
        for t in _draw(sampler, logits, [p] * 1000, [0] * 1000):
            counts[t] += 1
    return chi2_pvalue(counts, ref_filtered(row, p))


@pytest.mark.parametrize("kw", [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.6},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 12},
])
def test_flashinfer_rows_follow_the_filtered_distribution(kw: dict) -> None:
    p = SamplingParams(**kw)
    sampler = Sampler(V, "cuda", seed=5)
    assert sampler.fi is not None
    assert _draws_pvalue(sampler, p) > 1e-4


@pytest.mark.parametrize("kw", [
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 12},
])
def test_window_rows_follow_the_filtered_distribution(kw: dict) -> None:
    """The top-k window draw (`top_k_window`, FlashInfer's softmax and radix top-k) on the GPU."""
    p = SamplingParams(**kw)
    sampler = Sampler(V, "cuda", seed=5, top_k_window=256)
    assert sampler.batch([SampleRow(p, 0)]).fast_in_window
    assert _draws_pvalue(sampler, p) > 1e-4


def test_window_draw_never_syncs_the_host() -> None:
    sampler = Sampler(128256, "cuda", top_k_window=256)
    rows = [SampleRow(SamplingParams(temperature=0.8, top_p=0.9, top_k=50), 0) for _ in range(8)]
    logits = torch.randn(8, 128256, device="cuda")
    assert sampler.batch(rows).fast_in_window
    tokens = _sample_without_sync(sampler, logits, rows)
    top50 = torch.topk(logits, 50, dim=-1).indices
    assert bool((top50 == tokens.unsqueeze(1)).any(dim=1).all())  # every token within its row's top 50


def test_seeded_rows_match_cpu_and_ignore_their_batch() -> None:
    logits = torch.randn(6, 128256, generator=torch.Generator().manual_seed(1)) * 3
    mine = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=77)
    cpu = [_draw(Sampler(128256, "cpu"), logits[2:3], [mine], [c])[0] for c in range(8)]
    gpu_alone = [_draw(Sampler(128256, "cuda"), logits[2:3].cuda(), [mine], [c])[0] for c in range(8)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    batch = [others[0], others[1], mine, others[0], others[1], others[0]]
    gpu_mixed = [_draw(Sampler(128256, "cuda", seed=c), logits.cuda(), batch, [3, 3, c, 1, 1, 1])[2]
                 for c in range(8)]
    assert gpu_alone == gpu_mixed
    assert sum(a == b for a, b in zip(cpu, gpu_alone, strict=True)) >= 7  # float rounding may flip a near-tie


def test_greedy_rows_are_argmax() -> None:
    logits = torch.randn(64, 128256, device="cuda")
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9) for i in range(64)]
    out = _draw(Sampler(128256, "cuda"), logits, params, [0] * 64)
    want = logits.argmax(-1).tolist()
    assert all(out[i] == want[i] for i in range(1, 64, 2))


def test_sampling_never_syncs_the_host() -> None:
    """Every stage (bias, bans, penalties, filters, both draws, the penalty update) stays on the
    device: torch's sync debug mode raises on any synchronising call."""
    sampler = Sampler(128256, "cuda")
    slot = sampler.penalties.acquire([1, 2, 3], [4], 0.5, 0.2)
    rows = [SampleRow(SamplingParams(temperature=0.8, top_p=0.9, top_k=50, frequency_penalty=0.5,
                                     presence_penalty=0.2, repetition_penalty=1.1), 1, (), slot),
            SampleRow(SamplingParams(temperature=0.9, top_p=0.8, seed=3, logit_bias={"5": 1.0}), 0, (2,)),
            SampleRow(SamplingParams(temperature=0.7, min_p=0.1), 0),
            SampleRow(SamplingParams(temperature=0.0), 0)]
    tokens = _sample_without_sync(sampler, torch.randn(4, 128256, device="cuda"), rows)
    assert tokens.is_cuda and tokens.shape == (4,)
