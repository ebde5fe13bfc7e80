"""Sampling parameters: validation messages, filters, penalties and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.sampling.params import InvalidRequest, SamplingParams, parse_sampling_params
from sglang_ext.sampling.sampler import RowInfo, apply_penalties, logprobs_of, sample


def _row(**kw: object) -> RowInfo:
    gen = kw.pop("gen", None)
    return RowInfo(SamplingParams(**kw), [1, 2], [3], gen, [])  # type: ignore[arg-type]


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


def test_greedy_and_top_k_1_take_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [_row(temperature=0.0), _row(temperature=0.7, top_k=1), _row(temperature=0.0)]
    assert sample(logits, rows, None) == logits.argmax(-1).tolist()


def test_seeded_sampling_reproducible_and_seed_dependent() -> None:
    logits = torch.zeros(1, 1000)
    draws = []
    for seed in (1, 1, 2):
        g = torch.Generator().manual_seed(seed)
        draws.append([sample(logits, [_row(temperature=1.0, gen=g)], None)[0] for _ in range(5)])
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_top_p_and_min_p_restrict_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, [_row(temperature=1.0, top_p=0.7, gen=g)], None)[0] for _ in range(200)}
    assert seen == {0, 1}
    seen = {sample(logits, [_row(temperature=1.0, min_p=0.5, gen=g)], None)[0] for _ in range(200)}
    assert seen == {0, 1}


def test_penalties() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0]])
    row = RowInfo(SamplingParams(repetition_penalty=2.0), [0], [3], None, [])
    out = apply_penalties(logits.clone(), [row])
    assert out[0].tolist() == [0.5, 1.0, 1.0, -2.0, 1.0]
    row = RowInfo(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0], [4, 4, 1], None, [])
    out = apply_penalties(logits.clone(), [row])
    assert out[0].tolist() == pytest.approx([1.0, 0.25, 1.0, -1.0, -0.25])


def test_logprobs_of() -> None:
    logits = torch.tensor([[0.0, 0.0], [0.0, 10.0]])
    lp, tops = logprobs_of(logits, torch.tensor([0, 1]), 1)
    assert lp[0] == pytest.approx(-0.6931, abs=1e-3) and lp[1] == pytest.approx(0.0, abs=1e-3)
    assert tops[1][0][1] == 1


def test_logit_bias_steers_and_is_validated() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    rows = [_row(temperature=0.0, logit_bias={"7": 10.0}), _row(temperature=0.0, logit_bias={"3": -100.0, "2": 1.0})]
    assert sample(logits, rows, None) == [7, 2]
    with pytest.raises(InvalidRequest, match="logit_bias"):
        parse_sampling_params({"logit_bias": {"x": 1.0}}).validate(10)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        parse_sampling_params({"logit_bias": {"3": 500.0}}).validate(10)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        parse_sampling_params({"logit_bias": {"10": 1.0}}).validate(10)
