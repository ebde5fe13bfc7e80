"""Scheduler + model runner in one process: batching, chunking, prefix reuse and preemption must
not change greedy outputs, and every KV page must stay accounted for."""

from __future__ import annotations

import pytest
import torch
from _tiny import EOS, greedy, make_scheduler, prompts, run_all

from sglang_ext.sampling.params import InvalidRequest, SamplingParams
from sglang_ext.scheduler.request import Req

LENGTHS = [5, 17, 33, 9, 40, 3]


def _reqs(ps: list[list[int]], max_new: int = 10) -> list[Req]:
    return [Req(f"r{i}", p, greedy(max_new)) for i, p in enumerate(ps)]


@pytest.fixture(scope="module")
def reference(test_device: str) -> dict[str, list[int]]:
    """Each prompt alone, no cache, no chunking."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts(LENGTHS)):
        s = make_scheduler(test_device, disable_radix_cache=True, chunked_prefill_size=-1)
        out.update({f"r{i}": v for v in run_all(s, [Req(f"r{i}", p, greedy())]).values()})
    return out


def test_batch_equals_alone(test_device: str, reference: dict[str, list[int]]) -> None:
    s = make_scheduler(test_device)
    assert run_all(s, _reqs(prompts(LENGTHS))) == reference


def test_chunked_prefill_equals_unchunked(test_device: str, reference: dict[str, list[int]]) -> None:
    s = make_scheduler(test_device, chunked_prefill_size=7)
    assert run_all(s, _reqs(prompts(LENGTHS))) == reference


def test_prefix_cache_hits_keep_outputs(test_device: str, reference: dict[str, list[int]]) -> None:
    s = make_scheduler(test_device)
    ps = prompts(LENGTHS)
    run_all(s, _reqs(ps))  # warm the cache
    again = _reqs(ps)
    assert run_all(s, again) == reference
    assert sum(r.cached_tokens for r in again) > 0
    assert all(r.cached_tokens % 4 == 0 and r.cached_tokens < len(r.input_ids) for r in again)


def test_shared_prefix_between_concurrent_requests(test_device: str) -> None:
    base = prompts([24])[0]
    ps = [[*base, 7, 8, 9], [*base, 10, 11]]
    alone = [run_all(make_scheduler(test_device, disable_radix_cache=True), [Req("a", p, greedy())])["a"]
             for p in ps]
    s = make_scheduler(test_device, chunked_prefill_size=16)
    reqs = _reqs(ps)
    got = run_all(s, reqs)
    assert [got["r0"], got["r1"]] == alone
    assert reqs[1].cached_tokens >= 16


def test_preemption_keeps_outputs(test_device: str, reference: dict[str, list[int]]) -> None:
    s = make_scheduler(test_device, max_total_tokens=72)
    assert run_all(s, _reqs(prompts(LENGTHS))) == reference
    assert s.num_preemptions > 0


def test_preemption_without_radix_cache(test_device: str, reference: dict[str, list[int]]) -> None:
    s = make_scheduler(test_device, max_total_tokens=72, disable_radix_cache=True, chunked_prefill_size=8)
    assert run_all(s, _reqs(prompts(LENGTHS))) == reference
    assert s.num_preemptions > 0


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_policies_and_running_cap(test_device: str, policy: str, reference: dict[str, list[int]]) -> None:
    s = make_scheduler(test_device, schedule_policy=policy, max_running_requests=2)
    assert run_all(s, _reqs(prompts(LENGTHS))) == reference


@pytest.mark.parametrize("after_steps", [0, 1, 3, 8])
def test_abort_at_any_stage_frees_pages(test_device: str, after_steps: int) -> None:
    s = make_scheduler(test_device, chunked_prefill_size=8, disable_radix_cache=True)
    reqs = _reqs(prompts(LENGTHS), max_new=20)
    for r in reqs:
        s.add_request(r)
    for _ in range(after_steps):
        s.step()
    for r in reqs[::2]:
        assert s.abort(r.rid)
    finished = {}
    while s.has_work():
        for o in s.step():
            if o.finished:
                finished[o.rid] = o.finish_reason
        s.kv.check(s.running + s.waiting)
    assert {finished[r.rid]["type"] for r in reqs[::2]} == {"abort"}
    assert {finished[r.rid]["type"] for r in reqs[1::2]} == {"length"}
    assert s.allocator.num_free == s.allocator.capacity


def test_pages_return_to_cache_only(test_device: str) -> None:
    s = make_scheduler(test_device)
    run_all(s, _reqs(prompts(LENGTHS)))
    stats = s.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_used_pages == stats.cached_pages > 0
    assert s.flush_cache()
    assert s.allocator.num_free == s.allocator.capacity


def test_finish_rules(test_device: str) -> None:
    s = make_scheduler(test_device)
    p = prompts([6])[0]
    ref = run_all(s, [Req("ref", p, greedy(8))])["ref"]
    stop_id = ref[3]
    first = ref.index(stop_id)
    got = run_all(s, [Req("a", p, greedy(8, stop_token_ids=[stop_id]))])["a"]
    assert got == ref[: first + 1]
    # EOS stops unless ignore_eos; min_new_tokens bans it early
    r = Req("b", p, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop_id], min_new_tokens=5))
    got = run_all(s, [r])["b"]
    assert stop_id not in got[:5] and len(got) >= 5
    assert EOS not in got[:5]
    zero = Req("z", p, SamplingParams(max_new_tokens=0))
    assert run_all(s, [zero])["z"] == []
    assert zero.finish_reason is not None and zero.finish_reason.type == "length"


def test_prompt_logprobs_and_cache(test_device: str) -> None:
    s = make_scheduler(test_device)
    p = prompts([20])[0]
    a = Req("a", p, greedy(3), return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    run_all(s, [a])
    assert len(a.input_token_logprobs) == len(p)
    assert a.input_token_logprobs[0] == (None, p[0])
    assert [t for _, t in a.input_token_logprobs] == p
    assert len(a.output_token_logprobs) == 3
    # the same prompt again: the cache must not hide the positions whose logprobs are asked
    b = Req("b", p, greedy(3), return_logprob=True, logprob_start_len=5, top_logprobs_num=2)
    run_all(s, [b])
    assert len(b.input_token_logprobs) == len(p) - 5
    for (la, ta), (lb, tb) in zip(a.input_token_logprobs[5:], b.input_token_logprobs, strict=True):
        assert ta == tb and abs(la - lb) < 1e-4  # type: ignore[operator]
    assert all(len(t) == 2 for t in b.output_top_logprobs)


def test_invalid_requests_rejected(test_device: str) -> None:
    s = make_scheduler(test_device, max_total_tokens=64)
    with pytest.raises(InvalidRequest, match="empty"):
        s.add_request(Req("e", [], greedy()))
    with pytest.raises(InvalidRequest, match="input_ids"):
        s.add_request(Req("v", [10**6], greedy()))
    with pytest.raises(InvalidRequest, match="KV cache"):
        s.add_request(Req("k", list(range(3, 200)), greedy()))
    with pytest.raises(InvalidRequest, match="top_p"):
        s.add_request(Req("t", [5], SamplingParams(top_p=0.0)))
    assert not s.has_work()


def test_request_larger_than_cache_fails_explicitly(test_device: str) -> None:
    s = make_scheduler(test_device, max_total_tokens=32)
    r = Req("big", prompts([20])[0], greedy(40))
    out = run_all(s, [r])
    assert r.finish_reason is not None and r.finish_reason.type == "abort"
    assert "KV cache" in (r.finish_reason.message or "")
    assert len(out["big"]) > 0
    assert s.allocator.num_free + s.kv.cache.size_info().cached_pages == s.allocator.capacity


def test_bfloat16_runs_and_batches_consistently(test_device: str) -> None:
    """bf16 is a supported dtype on CPU too; the KV pool and outputs follow it."""
    s = make_scheduler(test_device, dtype="bfloat16")
    assert s.runner.pool.data.dtype == torch.bfloat16
    out = run_all(s, _reqs(prompts([5, 12]), max_new=6))
    assert all(len(v) == 6 for v in out.values())


def test_mem_fraction_sizes_the_pool(test_device: str) -> None:
    small = make_scheduler(test_device, mem_fraction_static=0.01 if test_device == "cpu" else 0.5)
    assert small.allocator.capacity > 0


def test_the_kv_budget_leaves_room_for_hosted_executors() -> None:
    """Sized from free GPU memory, the pool keeps (1 - fraction) of the GPU free, and a worker that
    hosts executors also sets their partition aside (allocated after the pool)."""
    from sglang_ext.engine.model_runner import kv_budget_bytes

    gib = 1 << 30
    assert kv_budget_bytes(100 * gib, 140 * gib, 0.85) == 79 * gib  # 100 - 21
    assert kv_budget_bytes(100 * gib, 140 * gib, 0.85, hosted=32 * gib) == 47 * gib
    assert kv_budget_bytes(40 * gib, 140 * gib, 0.85, hosted=32 * gib) < 0  # the worker then says so
