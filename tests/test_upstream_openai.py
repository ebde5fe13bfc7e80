"""A worker request as an OpenAI request, and an OpenAI stream as worker outputs (router/upstream/openai.py)."""

from __future__ import annotations

import json

import pytest

from router.upstream.openai import PLACEHOLDER_ID, StreamParser, UpstreamError, request_body
from sglang_ext.messages import GenerateReq
from sglang_ext.sampling.params import SamplingParams


def test_request_bodies() -> None:
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, top_k=20, stop=["\n"], ignore_eos=True)
    path, body = request_body(GenerateReq(rid="r", input_ids=[1, 2, 3], sampling_params=sp), "up-model", 4096)
    assert path == "/v1/completions"
    assert body["prompt"] == [1, 2, 3] and body["model"] == "up-model" and body["max_tokens"] == 16
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["top_k"] == 20 and body["ignore_eos"] is True and body["stop"] == ["\n"]
    assert not {"min_p", "repetition_penalty", "seed", "presence_penalty", "regex", "logprobs"} & set(body)
    msgs = [{"role": "user", "content": "hi"}]
    chat = GenerateReq(rid="c", messages=msgs, sampling_params=SamplingParams(max_new_tokens=4096),
                       return_logprob=True, top_logprobs_num=2)
    path, body = request_body(chat, "up-model", 4096)
    assert path == "/v1/chat/completions" and body["messages"] == msgs
    assert "max_tokens" not in body  # "until the context is full": the upstream's own limit applies
    assert body["logprobs"] is True and body["top_logprobs"] == 2
    assert "return_token_ids" not in body  # a strict OpenAI server would refuse it
    assert request_body(chat, "up-model", 4096, token_ids=True)[1]["return_token_ids"] is True


def lines(*chunks: object) -> list[str]:
    return [f"data: {json.dumps(c)}" for c in chunks] + ["", "data: [DONE]"]


def test_a_completion_stream_becomes_worker_outputs() -> None:
    p = StreamParser("r", chat=False)
    outs = [o for line in lines(
        {"choices": [{"index": 0, "text": "Hel", "logprobs": {"tokens": ["Hel"], "token_logprobs": [-0.5],
                                                              "top_logprobs": [{"Hel": -0.5, "He": -1.5}]}}]},
        {"choices": [{"index": 0, "text": "lo", "finish_reason": "stop", "matched_stop": "\n"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 4}}},
    ) if (o := p.feed(line)) is not None]
    assert [o.text_delta for o in outs] == ["Hel", "lo"]
    assert all(o.token_ids == [PLACEHOLDER_ID] and not o.finished for o in outs)
    assert outs[0].meta_info["output_token_logprobs"] == [[-0.5, PLACEHOLDER_ID, "Hel"]]
    assert outs[0].meta_info["output_top_logprobs"] == [[[-0.5, PLACEHOLDER_ID, "Hel"], [-1.5, PLACEHOLDER_ID, "He"]]]
    assert p.done
    last = p.last()
    assert last.finished and last.token_ids == []
    assert last.meta_info == {"prompt_tokens": 7, "completion_tokens": 2, "cached_tokens": 4,
                              "finish_reason": {"type": "stop", "matched": "\n"}}


def test_a_chat_stream_and_its_endings() -> None:
    p = StreamParser("c", chat=True)
    outs = [p.feed(line) for line in lines(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "length"}]},
    )]
    assert [o.text_delta for o in outs if o is not None] == ["ok"]
    assert p.last().meta_info["finish_reason"] == {"type": "length", "length": 1}  # no usage: chunks count
    tools = StreamParser("t", chat=True)
    tools.feed('data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}')
    assert tools.last().meta_info["finish_reason"]["upstream"] == "tool_calls"


@pytest.mark.parametrize(("line", "error"), [
    ('data: {"error": {"message": "out of memory"}}', "out of memory"),
    ("data: {not json", "a malformed event"),
])
def test_errors_in_a_stream(line: str, error: str) -> None:
    with pytest.raises(UpstreamError, match=error):
        StreamParser("r", chat=False).feed(line)


def test_token_ids_the_upstream_sends_are_the_outputs_ids() -> None:
    """vLLM with `return_token_ids`: each choice carries its tokens' ids (a chunk may hold several, or
    ids without text); they become output ids and logprob ids, and count the tokens if usage is missing."""
    p = StreamParser("r", chat=False)
    outs = [o for line in lines(
        {"choices": [{"index": 0, "text": "Hel", "token_ids": [9906],
                      "logprobs": {"tokens": ["Hel"], "token_logprobs": [-0.5], "top_logprobs": [{"Hel": -0.5}]}}]},
        {"choices": [{"index": 0, "text": "", "token_ids": [128]}]},  # an incomplete UTF-8 character
        {"choices": [{"index": 0, "text": "lo!", "token_ids": [385, 0], "finish_reason": "length"}]},
    ) if (o := p.feed(line)) is not None]
    assert [o.token_ids for o in outs] == [[9906], [128], [385, 0]]
    assert outs[0].meta_info["output_token_logprobs"] == [[-0.5, 9906, "Hel"]]
    assert outs[0].meta_info["output_top_logprobs"] == [[[-0.5, PLACEHOLDER_ID, "Hel"]]]  # not in the stream
    assert p.last().meta_info["completion_tokens"] == 4
    chat = StreamParser("c", chat=True)
    out = chat.feed("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "ok"}, "token_ids": [564],
                                                        "logprobs": {"content": [{"token": "ok", "logprob": -0.1}]}}]}))
    assert out is not None and out.token_ids == [564]
    assert out.meta_info["output_token_logprobs"] == [[-0.1, 564, "ok"]]
