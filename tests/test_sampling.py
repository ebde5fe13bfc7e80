"""Sampling: parameter validation, and the batched sampler checked against per-row references --
exact equality for greedy rows, bias, bans and penalties on the same random numbers; chi-square
agreement with the filtered distribution for random draws; batch-independent seeded draws."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_ext.sampling.batch import SampleRow
from sglang_ext.sampling.params import InvalidRequest, SamplingParams, parse_sampling_params
from sglang_ext.sampling.rng import RowRandom, seeded_uniforms
from sglang_ext.sampling.sampler import Sampler, logprobs_of

V = 40


def _logits(rows: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def _sample(logits: torch.Tensor, params: list[SamplingParams], sampler: Sampler | None = None,
            counters: list[int] | None = None, slots: list[int] | None = None,
            banned: list[list[int]] | None = None) -> list[int]:
    sampler = sampler or Sampler(logits.shape[1], "cpu")
    n = len(params)
    rows = [SampleRow(p, (counters or [0] * n)[i], (banned or [[]] * n)[i], (slots or [-1] * n)[i])
            for i, p in enumerate(params)]
    return sampler.sample(logits, sampler.batch(rows)).tolist()


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_new_tokens": -5}, "max_new_tokens"),
        ({"n": 0}, "n"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"min_new_tokens": 9, "max_new_tokens": 3}, "min_new_tokens"),
    ],
)
def test_invalid_values_name_the_parameter(raw: dict, name: str) -> None:
    with pytest.raises(InvalidRequest, match=name):
        parse_sampling_params(raw).validate(100)


def test_wrong_types_and_unknown_keys() -> None:
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        parse_sampling_params({"max_new_tokens": "ten"})
    with pytest.raises(InvalidRequest, match="frobnicate"):
        parse_sampling_params({"frobnicate": 1})
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        parse_sampling_params({"stop_token_ids": [500]}).validate(100)


def test_string_stop_and_int_stop_id_accepted() -> None:
    p = parse_sampling_params({"stop": "END", "stop_token_ids": 7, "temperature": 0})
    assert p.stop == ["END"] and p.stop_token_ids == [7] and p.is_greedy




# ---- per-row references (the semantics the batched code must reproduce) -----------------------------
def ref_adjust(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
               banned: list[int]) -> torch.Tensor:
    x = logits.clone()
    for key, val in (p.logit_bias or {}).items():
        x[int(key)] += val
    x[banned] = float("-inf")
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def ref_filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Sort-based SGLang filtering of one row: top-k, top-p, min-p as masks on one distribution."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k > 0:
        keep[order[p.top_k:]] = False
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if mass > p.top_p and rank > 0:
            keep[t] = False
        mass += float(probs[t])
    keep &= probs >= p.min_p * probs.max()
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def chi2_pvalue(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = counts.sum()
    support = expected_p > 0
    assert counts[~support].sum() == 0, "drew a token outside the filtered support"
    exp = expected_p[support] * n
    stat = ((counts[support] - exp) ** 2 / exp).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


# ---- tests ---------------------------------------------------------------------------------------------
def test_greedy_and_top_k_1_take_argmax() -> None:
    logits = _logits(3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1),
              SamplingParams(temperature=0.0)]
    assert _sample(logits, params) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kw", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 0.8, "top_p": 0.6},
    {"temperature": 1.3, "min_p": 0.2},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 12},
    {"temperature": 0.9, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "top_p": 0.7, "seed": 11},
])
def test_draws_follow_the_filtered_distribution(kw: dict) -> None:
    """10,000 draws in batches of 500 rows (each row its own uniform) against the reference."""
    row = _logits(1, seed=3)[0]
    p = SamplingParams(**kw)
    sampler = Sampler(V, "cpu", seed=5)
    counts = torch.zeros(V, dtype=torch.float64)
    for b in range(20):
        ps = [p] * 500
        counters = [b * 500 + i for i in range(500)]  # seeded rows: distinct positions
        for t in _sample(row.expand(500, V).contiguous(), ps, sampler, counters=counters):
            counts[t] += 1
    assert chi2_pvalue(counts, ref_filtered(row, p)) > 1e-4


def _window_sampler(vocab: int, seed: int = 5, window: int = 256) -> Sampler:
    """A CPU sampler whose unseeded rows take the fast draw with the top-k window on (FlashInfer's
    softmax and top-k done by torch, a CPU generator)."""
    sampler = Sampler(vocab, "cpu", seed=seed, use_flashinfer=False, top_k_window=window)
    sampler.fi = sampler.fi_topk = StubFlashInfer()
    sampler.gen = torch.Generator().manual_seed(seed)
    return sampler


@pytest.mark.parametrize("kw", [
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 12},
    {"temperature": 1.0, "top_p": 0.6, "top_k": 20},
    {"temperature": 1.2, "top_p": 0.95, "top_k": 39},  # a window of all tokens but one
])
def test_window_draws_follow_the_filtered_distribution(kw: dict) -> None:
    """10,000 window draws against the sort-based reference."""
    row = _logits(1, seed=3)[0]
    p = SamplingParams(**kw)
    sampler = _window_sampler(V)
    assert sampler.batch([SampleRow(p, 0)]).fast_in_window
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(20):
        for t in _sample(row.expand(500, V).contiguous(), [p] * 500, sampler):
            counts[t] += 1
    assert chi2_pvalue(counts, ref_filtered(row, p)) > 1e-4


def test_window_draw_rows_keep_their_own_filters() -> None:
    """Rows with different top-k / top-p in one batch (the window is the largest k), greedy rows among
    them: each sampled row follows its own filtered distribution, greedy rows take the argmax."""
    rows = _logits(3, seed=8)
    ps = [SamplingParams(temperature=0.9, top_k=3), SamplingParams(temperature=0.0),
          SamplingParams(temperature=1.1, top_k=15, top_p=0.7)]
    sampler = _window_sampler(V, seed=2)
    logits = rows.repeat(400, 1)
    counts = torch.zeros(3, V, dtype=torch.float64)
    for _ in range(10):
        sb = sampler.batch([SampleRow(p, 0) for p in ps] * 400)
        assert sb.fast_in_window and sb.max_top_k == 15
        toks = sampler.sample(logits, sb).view(400, 3)
        for j in range(3):
            counts[j] += torch.bincount(toks[:, j], minlength=V).double()
    assert counts[1, int(rows[1].argmax())] == 4000
    for j in (0, 2):
        assert chi2_pvalue(counts[j], ref_filtered(rows[j], ps[j])) > 1e-4


@pytest.mark.parametrize(("ks", "window", "taken"), [
    ([50, 50], 256, True),
    ([50, 256], 256, True),
    ([50, 257], 256, False),  # a wider top-k: FlashInfer's rejection kernels
    ([50, -1], 256, False),  # a row without top-k: the whole row counts
    ([50, 50], 0, False),  # the window off (the default)
])
def test_which_batches_take_the_window_draw(ks: list[int], window: int, taken: bool) -> None:
    sampler = _window_sampler(1000, window=window)
    rows = [SampleRow(SamplingParams(temperature=0.8, top_p=0.9, top_k=k), 0) for k in ks]
    assert sampler.batch(rows).fast_in_window == taken
    # seeded rows take the exact draw: one without a top-k keeps no one from the window
    exact = SampleRow(SamplingParams(temperature=0.8, top_p=0.9, seed=1), 0)
    assert sampler.batch([rows[0], exact]).fast_in_window == (window > 0)
    assert not Sampler(1000, "cpu", top_k_window=256).batch(rows[:1]).fast_in_window  # no fast draw on CPU


def test_seeded_rows_do_not_depend_on_their_batch() -> None:
    logits = _logits(8, seed=1)
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=30, seed=1234)
    alone = [_sample(logits[3:4], [mine], counters=[c])[0] for c in range(6)]
    for c in range(6):
        others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.5, min_p=0.1, seed=9)] * 3
        batch = [*others[:3], mine, *others[3:7]]
        counters = [7] * 3 + [c] + [2] * 4
        assert _sample(logits, batch, Sampler(V, "cpu", seed=c), counters=counters)[3] == alone[c]
    assert len(set(alone)) > 1, "the draws should vary with the position"
    other_seed = [_sample(logits[3:4], [SamplingParams(temperature=0.9, top_p=0.95, top_k=30, seed=99)],
                          counters=[c])[0] for c in range(6)]
    assert other_seed != alone


def test_uniforms_are_counter_based() -> None:
    a = seeded_uniforms([5, 5, 6], [0, 1, 0])
    assert a.tolist() == seeded_uniforms([5, 5, 6], [0, 1, 0]).tolist()
    assert len(set(a.tolist())) == 3 and all(0 <= x < 1 for x in a)
    r1, r2 = RowRandom(0), RowRandom(0)
    assert r1.uniforms([None, 3], [0, 4]).tolist() == r2.uniforms([None, 3], [0, 4]).tolist()
    assert r1.uniforms([None], [0])[0] != RowRandom(1).uniforms([None], [0])[0]


def test_bias_bans_and_penalties_match_per_row_reference() -> None:
    """Mixed rows (some penalised, some biased, some banned): the batched adjustment equals the
    per-row reference exactly, and so do the tokens drawn with the same uniforms."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (9,), generator=g).tolist() for _ in range(6)]
    outputs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 5, 3, 8, 1, 4)]
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, presence_penalty=1.5, repetition_penalty=1.3, seed=1),
        SamplingParams(temperature=0.0, logit_bias={"3": 4.0, "7": -2.5}),
        SamplingParams(temperature=1.0, repetition_penalty=0.7, frequency_penalty=-0.4, top_k=9, seed=2),
        SamplingParams(temperature=0.6, top_p=0.8, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.8, logit_bias={"1": 1.0}),
    ]
    banned = [[], [2, 5], [], [0], [], []]
    logits = _logits(6, seed=2)
    sampler = Sampler(V, "cpu")
    slots = [sampler.penalties.acquire(pr, out, p.frequency_penalty, p.presence_penalty) if p.has_penalties else -1
             for p, pr, out in zip(params, prompts, outputs, strict=True)]
    counters = [len(o) for o in outputs]
    rows = [SampleRow(p, c, b, s) for p, c, b, s in zip(params, counters, banned, slots, strict=True)]
    sb = sampler.batch(rows)
    from sglang_ext.sampling.sampler import adjust_logits, filtered_probs, invert_cdf

    got = adjust_logits(logits, sb, sampler.penalties)
    want = torch.stack([ref_adjust(logits[i], params[i], prompts[i], outputs[i], banned[i]) for i in range(6)])
    assert torch.equal(got, want)
    tokens = sampler.sample(logits, sb).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            assert tokens[i] == int(want[i].argmax())
        else:  # the same uniform through the one-row path
            one = sampler.batch([rows[i]._replace(penalty_slot=-1)])
            probs = filtered_probs(want[i : i + 1], one.temperature, one.top_k, one.top_p, one.min_p,
                                   one.max_top_k, one.any_top_p, one.any_min_p)
            assert tokens[i] == int(invert_cdf(probs, sb.uniforms[i : i + 1])[0])
        assert tokens[i] not in banned[i]


def test_penalty_table_tracks_sampled_tokens() -> None:
    sampler = Sampler(V, "cpu")
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5)
    table = sampler.penalties
    slot = table.acquire([1, 2], [4, 4], 1.0, 0.5)
    assert float(table.additive[slot, 4]) == 2.5 and bool(table.seen[slot, 1]) and not bool(table.in_output[slot, 1])
    logits = torch.zeros(1, V)
    logits[0, 4] = 2.6  # 2.6 - (2 * 1.0 + 0.5) = 0.1 > 0: still the argmax
    logits[0, 9] = 0.05
    t = _sample(logits, [p], sampler, counters=[2], slots=[slot])
    assert t == [4] and float(table.additive[slot, 4]) == 3.5  # recorded on the device at once
    assert _sample(logits, [p], sampler, counters=[3], slots=[slot]) == [9]  # 2.6 - 3.5 < 0.05
    assert float(table.additive[slot, 9]) == 1.5  # first occurrence: frequency + presence
    table.release(slot)
    again = table.acquire([3], [], 0.2, 0.0)
    assert again == slot and float(table.additive[slot].abs().sum()) == 0  # reused, reset
    assert bool(table.seen[slot, 3]) and not bool(table.seen[slot, 4])


def test_penalty_table_grows() -> None:
    table = Sampler(V, "cpu").penalties
    slots = [table.acquire([i % V], [i % V], 1.0, 0.0) for i in range(20)]
    assert len(set(slots)) == 20 and table.capacity >= 20
    assert all(float(table.additive[s, i % V]) == 1.0 for i, s in enumerate(slots))


def test_min_new_tokens_bans_and_logit_bias() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    params = [SamplingParams(temperature=0.0, logit_bias={"7": 10.0}),
              SamplingParams(temperature=0.0, logit_bias={"3": -100.0, "2": 1.0})]
    assert _sample(logits, params) == [7, 2]
    assert _sample(logits, [SamplingParams(temperature=0.0)] * 2, banned=[[3], []]) != [3, 3]


def test_logprobs_of() -> None:
    logits = torch.tensor([[0.0, 0.0], [0.0, 10.0]])
    lp, tops = logprobs_of(logits, torch.tensor([0, 1]), 1)
    assert lp[0] == pytest.approx(-0.6931, abs=1e-3) and lp[1] == pytest.approx(0.0, abs=1e-3)
    assert tops[1][0][1] == 1


def test_logit_bias_is_validated() -> None:
    with pytest.raises(InvalidRequest, match="logit_bias"):
        parse_sampling_params({"logit_bias": {"x": 1.0}}).validate(10)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        parse_sampling_params({"logit_bias": {"3": 500.0}}).validate(10)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        parse_sampling_params({"logit_bias": {"10": 1.0}}).validate(10)


# ---- no host sync, no copy to the device while sampling ------------------------------------------------
aten = torch.ops.aten
# ops whose result the host must wait for: a value read back (item, bool, int) or an output whose
# shape depends on the data
_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default, aten.equal.default,
          aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
          aten.repeat_interleave.Tensor}


class HostTraffic(TorchDispatchMode):
    """Records, for every aten op run inside it, the reads of device values and the copies between
    devices (source, destination)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.copies: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READS:
            self.reads.append(str(func))  # before the call: on 'meta' the call itself fails
        out = func(*args, **(kwargs or {}))
        if func in (aten._to_copy.default, aten.copy_.default):
            src, dst = (args[0], out) if func is aten._to_copy.default else (args[1], args[0])
            if src.device != dst.device:
                self.copies.append((src.device.type, dst.device.type))
        return out


class StubFlashInfer:
    """FlashInfer's entry points, the drawing ones as shapes: so the fast draw runs on the CPU test
    machine too. softmax and top_k compute (torch), so the window draw's tokens are real."""

    @staticmethod
    def softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits / temperature.unsqueeze(1), dim=-1)

    @staticmethod
    def top_k(probs: torch.Tensor, k: int, sorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        assert sorted, "the window draw needs its window in descending order"
        vals, ids = torch.topk(probs, k, dim=-1)
        return vals, ids

    @staticmethod
    def top_k_top_p_sampling_from_logits(scaled: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(scaled.shape[0], dtype=torch.int32, device=scaled.device)

    @staticmethod
    def sampling_from_logits(scaled: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(scaled.shape[0], dtype=torch.int32, device=scaled.device)


@pytest.mark.parametrize("fast", ["flashinfer", "window", ""], ids=["flashinfer", "window", "exact"])
@pytest.mark.parametrize("mix", ["mixed", "frequency", "seeded"])
def test_sampling_neither_syncs_nor_copies_to_the_device(fast: str, mix: str) -> None:
    """The CPU stand-in for the GPU test's sync debug mode (tests/test_gpu_sampling.py), on the
    penalty and seeded paths. The sampler runs on torch's 'meta' device, whose tensors have shapes
    and no data: reading any value back on the host (item, bool, tolist, nonzero, a data-dependent
    shape) fails there, and HostTraffic lists every copy between devices. A step may copy its two
    packed buffers to the device (batch) and nothing else; sample copies nothing either way.
    'mixed' has each draw take some rows (index tensors), the others every row (bench/sampling.py's
    frequency-penalty and seeded mixes)."""
    vocab = 1000
    sampler = Sampler(vocab, "meta", use_flashinfer=False, top_k_window=256 if fast == "window" else 0)
    if fast:
        sampler.fi = sampler.fi_topk = StubFlashInfer()
    freq = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, frequency_penalty=0.5, presence_penalty=0.2)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)
    params = {
        "mixed": [SamplingParams(temperature=0.8, top_p=0.9, frequency_penalty=0.5, repetition_penalty=1.1),
                  SamplingParams(temperature=0.9, top_p=0.8, seed=3, logit_bias={"5": 1.0}, presence_penalty=0.3),
                  SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=1.0)],
        "frequency": [freq] * 4,
        "seeded": [seeded] * 4,
    }[mix]
    with HostTraffic() as acquiring:
        slots = [sampler.penalties.acquire([1, 2, 3], [4, 4], p.frequency_penalty, p.presence_penalty)
                 if p.has_penalties else -1 for p in params]
    assert not acquiring.reads
    assert acquiring.copies == [("cpu", "meta")] * sum(s >= 0 for s in slots)  # a slot's tokens: one copy
    rows = [SampleRow(p, 7, (2, 9) if i == 1 else (), s) for i, (p, s) in enumerate(zip(params, slots, strict=True))]
    logits = torch.empty(len(rows), vocab, device="meta")
    for _ in range(2):  # a second step: the penalties recorded by the first are read
        with HostTraffic() as building:
            sb = sampler.batch(rows)
        assert not building.reads and building.copies == [("cpu", "meta")] * 2  # floats, ints
        with HostTraffic() as sampling:
            tokens = sampler.sample(logits, sb)
        assert not sampling.reads and not sampling.copies
        assert tokens.device.type == "meta" and tokens.shape == (len(rows),) and tokens.dtype == torch.int64
    assert sb.fast_in_window == (fast == "window" and mix == "frequency")  # every fast row with a top-k
    draws = (sb.fast_rows, sb.exact_rows)
    if mix == "mixed":
        assert all(isinstance(r, torch.Tensor) for r in draws) if fast else isinstance(sb.exact_rows, torch.Tensor)
    else:
        assert any(isinstance(r, slice) for r in draws) and sb.pen_all_rows == (mix == "frequency")


def test_a_window_kernel_that_cannot_compile_leaves_the_torch_draw(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Triton failing to build the window kernel (a driver or compiler problem) is a warning and the
    window's last step in torch ops, not a worker that cannot start."""
    import types

    import sglang_ext.sampling
    from sglang_ext.sampling import sampler as sampler_mod

    def warm(device: torch.device) -> None:
        raise RuntimeError("no compiler")

    fake = types.SimpleNamespace(warm=warm, pick=None)
    monkeypatch.setitem(sys.modules, "sglang_ext.sampling.window_pick", fake)
    monkeypatch.setattr(sglang_ext.sampling, "window_pick", fake, raising=False)
    with caplog.at_level("WARNING"):
        assert sampler_mod._compiled_window_pick(torch.device("cpu")) is None
    assert "Triton kernel unavailable (RuntimeError: no compiler)" in caplog.text
