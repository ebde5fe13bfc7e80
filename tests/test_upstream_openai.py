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
