"""The offline Engine end to end (worker process, ZeroMQ, msgspec), on the embedded default model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_ext import Engine
from sglang_ext.models.default_model import ensure_default_model
from sglang_ext.sampling.params import InvalidRequest

GREEDY = {"max_new_tokens": 12, "temperature": 0}
PROMPTS = ["The weather today is", "Once upon a time,", "A list of fruits: apples, pears", "Hi"]


@pytest.fixture(scope="module")
def engine(test_device: str) -> Iterator[Engine]:
    kw = {"page_size": 4, "chunked_prefill_size": 16, "max_total_tokens": 65536}
    with Engine(device=test_device, dtype="float32", **kw) as eng:
        yield eng


def test_single_and_batch_shapes(engine: Engine) -> None:
    one = engine.generate(prompt="Hello", sampling_params=GREEDY)
    assert isinstance(one, dict) and set(one) == {"text", "output_ids", "meta_info"}
    many = engine.generate(prompt=["Hello", "Hi"], sampling_params=GREEDY)
    assert isinstance(many, list) and len(many) == 2
    assert many[0]["output_ids"] == one["output_ids"] and many[0]["text"] == one["text"]
    meta = one["meta_info"]
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"):
        assert key in meta
    assert meta["completion_tokens"] == len(one["output_ids"]) <= 12


def test_batch_matches_alone_and_input_ids(engine: Engine) -> None:
    alone = [engine.generate(prompt=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    batch = [o["output_ids"] for o in engine.generate(prompt=PROMPTS, sampling_params=GREEDY)]
    assert batch == alone
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(ensure_default_model())).encode("Once upon a time,")
    by_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert by_ids["output_ids"] == alone[1]


def test_prefix_cache_hit_reported_and_output_unchanged(engine: Engine) -> None:
    long = "Shared system prompt: you are a careful assistant who answers briefly. " * 3
    first = engine.generate(prompt=long + "Question one?", sampling_params=GREEDY)
    second = engine.generate(prompt=long + "Question one?", sampling_params=GREEDY)
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["output_ids"] == first["output_ids"]
    assert engine.flush_cache()
    third = engine.generate(prompt=long + "Question one?", sampling_params=GREEDY)
    assert third["meta_info"]["cached_tokens"] == 0 and third["output_ids"] == first["output_ids"]


def test_stop_string_is_trimmed(engine: Engine) -> None:
    ref = engine.generate(prompt="Once upon a time,", sampling_params={**GREEDY, "max_new_tokens": 20})
    text = ref["text"]
    stop = text.strip()[2:5] if len(text.strip()) > 6 else None
    if not stop:
        pytest.skip("the default model produced too little text for a stop string")
    out = engine.generate(prompt="Once upon a time,", sampling_params={**GREEDY, "max_new_tokens": 20, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])
    kept = engine.generate(prompt="Once upon a time,",
                           sampling_params={**GREEDY, "max_new_tokens": 20, "stop": stop, "no_stop_trim": True})
    assert kept["text"].endswith(stop)


def test_stop_token_ids_max_new_tokens_ignore_eos(engine: Engine) -> None:
    ref = engine.generate(prompt="Hi", sampling_params=GREEDY)["output_ids"]
    out = engine.generate(prompt="Hi", sampling_params={**GREEDY, "stop_token_ids": [ref[2]]})
    assert out["output_ids"] == ref[: ref.index(ref[2]) + 1]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    out = engine.generate(prompt="Hi", sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 3 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_seeded_sampling_and_n(engine: Engine) -> None:
    sp = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 42}
    a = engine.generate(prompt="Hello", sampling_params=sp)["output_ids"]
    b = engine.generate(prompt="Hello", sampling_params=sp)["output_ids"]
    c = engine.generate(prompt="Hello", sampling_params={**sp, "seed": 43})["output_ids"]
    assert a == b and a != c
    many = engine.generate(prompt="Hello", sampling_params={**sp, "n": 3})
    assert isinstance(many, list) and len(many) == 3
    assert many[0]["output_ids"] == a and many[1]["output_ids"] == c


def test_logprobs(engine: Engine) -> None:
    out = engine.generate(prompt="Once upon a time,", sampling_params={**GREEDY, "max_new_tokens": 4},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                          return_text_in_logprobs=True)
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert len(inp) == meta["prompt_tokens"] and inp[0][0] is None
    assert all(lp <= 0 for lp, _, _ in inp[1:])
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == out["output_ids"] and all(isinstance(x[2], str) for x in outp)
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])
    # greedy: the chosen token is the top-1
    assert all(row[0][1] == t for row, (_, t, _) in zip(meta["output_top_logprobs"], outp, strict=True))
    only_out = engine.generate(prompt="Once upon a time,", sampling_params={**GREEDY, "max_new_tokens": 3},
                               return_logprob=True)  # logprob_start_len -1 (default): output logprobs only
    assert only_out["meta_info"]["input_token_logprobs"] == []
    assert len(only_out["meta_info"]["output_token_logprobs"]) == 3
    zero = engine.generate(prompt="Once upon a time,", sampling_params={"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=2)
    assert zero["output_ids"] == [] and len(zero["meta_info"]["input_token_logprobs"]) == meta["prompt_tokens"] - 2


def test_streaming_matches_non_streaming(engine: Engine) -> None:
    full = engine.generate(prompt="The weather today is", sampling_params=GREEDY)
    chunks = list(engine.generate(prompt="The weather today is", sampling_params=GREEDY, stream=True))
    assert len(chunks) >= 2
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]


def test_invalid_input_is_rejected_and_engine_keeps_serving(engine: Engine) -> None:
    for bad, name in [({"top_p": 5}, "top_p"), ({"temperature": -1}, "temperature"),
                      ({"max_new_tokens": "x"}, "max_new_tokens"), ({"nope": 1}, "nope")]:
        with pytest.raises(InvalidRequest, match=name):
            engine.generate(prompt="Hi", sampling_params=bad)
    with pytest.raises(InvalidRequest, match="context length"):
        engine.generate(input_ids=[5] * 5000, sampling_params=GREEDY)
    with pytest.raises(InvalidRequest, match="input_ids"):
        engine.generate(input_ids=[10**7], sampling_params=GREEDY)
    assert engine.generate(prompt="Hi", sampling_params=GREEDY)["meta_info"]["completion_tokens"] > 0


def test_skip_tokenizer_init(tmp_path: Path, test_device: str) -> None:
    src = ensure_default_model()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, tmp_path / f)
    with Engine(model_path=str(tmp_path), device=test_device, skip_tokenizer_init=True, max_total_tokens=8192) as eng:
        out = eng.generate(input_ids=[1, 50, 60, 70], sampling_params=GREEDY)
        assert out["text"] == "" and len(out["output_ids"]) > 0
        with pytest.raises(InvalidRequest, match="skip_tokenizer_init"):
            eng.generate(prompt="text needs a tokenizer", sampling_params=GREEDY)
