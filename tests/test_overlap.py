"""Overlap scheduling (decode t+1 launched before t lands) gives the same outputs, the same finish
reasons and the same page accounting as the plain loop. Runs on CPU; on GPU with the test device."""

from __future__ import annotations

from typing import Any

import pytest
from _tiny import VOCAB, greedy, make_scheduler, prompts, run_all

from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.overlap import NOT_OVERLAPPED
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler, default_overlap

LENGTHS = [5, 17, 33, 9, 40, 3]


def _pair(device: str, **args: Any) -> tuple[Scheduler, Scheduler]:
    args.setdefault("max_total_tokens", 16384)  # two pools at once: never size them from free GPU memory
    plain = make_scheduler(device, **args)
    other = make_scheduler(device, **args)
    ov = Scheduler(other.args, other.runner, other.page_size, other.eos_ids, vocab_size=VOCAB, overlap=True)
    return plain, ov


def _reqs(params: list[SamplingParams]) -> list[Req]:
    return [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(LENGTHS), params, strict=True))]


@pytest.mark.parametrize("args", [{}, {"max_total_tokens": 72}, {"chunked_prefill_size": 8}])
def test_greedy_outputs_equal_plain_loop(test_device: str, args: dict[str, Any]) -> None:
    plain, ov = _pair(test_device, **args)
    params = [greedy(12 + i) for i in range(len(LENGTHS))]
    assert run_all(ov, _reqs(params)) == run_all(plain, _reqs(params))
    assert ov.overlapped_steps > 0
    assert ov.allocator.num_free + ov.kv.cache.size_info().cached_pages == ov.allocator.capacity


def test_stops_min_new_tokens_and_seeded_sampling(test_device: str) -> None:
    plain, ov = _pair(test_device)
    ref = run_all(plain, _reqs([greedy(16)] * len(LENGTHS)))
    stop = ref["r0"][4]  # stops r0 (and maybe others) mid-run: the overlapped extra row is dropped
    params = [greedy(16, stop_token_ids=[stop]), greedy(16, stop_token_ids=[stop], min_new_tokens=6),
              SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20, seed=7),
              SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, min_p=0.05, seed=8),
              greedy(1), greedy(0)]
    rs = _reqs(params)
    got_plain = run_all(plain, rs)
    rs2 = _reqs(params)
    got_ov = run_all(ov, rs2)
    assert got_ov == got_plain
    assert [r.finish_reason for r in rs2] == [r.finish_reason for r in rs]
    assert got_ov["r0"][-1] == stop and len(got_ov["r0"]) <= 5


def test_penalties_bias_and_bans_overlap(test_device: str) -> None:
    """Penalised, biased and min_new_tokens rows no longer drain the overlap loop: the statistics
    they need live on the device. Outputs equal the plain loop's (greedy and seeded rows)."""
    plain, ov = _pair(test_device)
    params = [greedy(14, frequency_penalty=1.5), greedy(14, presence_penalty=1.0, repetition_penalty=1.4),
              greedy(14, logit_bias={"5": 3.0, "9": -50.0}),
              SamplingParams(max_new_tokens=14, temperature=0.0, min_new_tokens=8, stop_token_ids=[7]),
              SamplingParams(max_new_tokens=14, temperature=0.9, top_k=40, frequency_penalty=0.7, seed=3),
              SamplingParams(max_new_tokens=14, temperature=1.1, repetition_penalty=1.2, seed=4)]
    got_plain = run_all(plain, _reqs(params))
    got_ov = run_all(ov, _reqs(params))
    assert got_ov == got_plain
    assert ov.overlapped_steps > 5
    # the penalties did something: the unpenalised greedy run differs
    assert run_all(make_scheduler(test_device), _reqs([greedy(14)] * 6))["r0"] != got_plain["r0"]
    assert ov.sampler.penalties._free and len(ov.sampler.penalties._free) == ov.sampler.penalties.capacity


@pytest.mark.parametrize("after_steps", [1, 3, 6])
def test_abort_while_in_flight_frees_pages(test_device: str, after_steps: int) -> None:
    _, ov = _pair(test_device, disable_radix_cache=True)
    reqs = _reqs([greedy(20)] * len(LENGTHS))
    for r in reqs:
        ov.add_request(r)
    for _ in range(after_steps):
        ov.step()
    for r in reqs[::2]:
        assert ov.abort(r.rid)
    finished = {}
    while ov.has_work():
        for o in ov.step():
            if o.finished:
                finished[o.rid] = o.finish_reason
        ov.kv.check(ov.running + ov.waiting)
    assert {finished[r.rid]["type"] for r in reqs[::2]} == {"abort"}
    assert {finished[r.rid]["type"] for r in reqs[1::2]} == {"length"}
    assert all(len(r.output_ids) == 20 for r in reqs[1::2])
    assert ov.allocator.num_free == ov.allocator.capacity


def test_logprob_requests_run_without_overlap(test_device: str) -> None:
    plain, ov = _pair(test_device)
    mk = lambda: [Req("a", prompts([9])[0], greedy(5), return_logprob=True, top_logprobs_num=2)]  # noqa: E731
    a, b = mk(), mk()
    assert run_all(ov, b) == run_all(plain, a)
    assert ov.overlapped_steps == 0
    assert [t for _, t in b[0].output_token_logprobs] == [t for _, t in a[0].output_token_logprobs]


def test_default_overlap_choice() -> None:
    assert not default_overlap("cpu", False)
    assert default_overlap("cuda", False)
    assert not default_overlap("cuda:0", True)


def test_decode_keeps_overlapping_while_a_queue_waits_for_pages(test_device: str) -> None:
    """A KV-bound pool with a standing queue: decode steps go on overlapping while nothing can be
    admitted (no page beyond the decoders' reserve), and the outputs stay the plain loop's."""
    plain, ov = _pair(test_device, max_total_tokens=96, max_running_requests=4)
    launched_with_queue = []
    assert ov.overlap is not None
    follow_up = ov.overlap._follow_up

    def spy(prev: Any) -> Any:
        out = follow_up(prev)
        if out is not None and ov.waiting:
            launched_with_queue.append(len(ov.waiting))
        return out

    ov.overlap._follow_up = spy  # type: ignore[method-assign]
    params = [greedy(16 + i) for i in range(len(LENGTHS))] * 2
    reqs = [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(LENGTHS * 2, seed=5), params, strict=True))]
    want = run_all(plain, [Req(r.rid, r.input_ids, r.sampling) for r in reqs])
    assert run_all(ov, reqs) == want
    assert launched_with_queue, "no decode step overlapped while requests waited"
    assert ov.allocator.num_free + ov.kv.cache.size_info().cached_pages == ov.allocator.capacity


def test_a_standing_queue_that_cannot_be_admitted_keeps_the_loop_overlapped(test_device: str) -> None:
    """A KV-bound pool with a queue whose head needs more pages than are spare: the loop keeps
    overlapping decode steps (it used to drain whenever one page was spare), the queue is admitted as
    pages come free, and outputs equal the plain loop's."""
    lengths = [40, 38, 36, 34, 44, 42, 39, 41]
    params = [greedy(24) for _ in lengths]
    reqs = lambda: [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(lengths), params, strict=True))]  # noqa: E731
    plain, ov = _pair(test_device, max_total_tokens=200, chunked_prefill_size=64)
    want = run_all(plain, reqs())
    assert run_all(ov, reqs()) == want
    _, old = _pair(test_device, max_total_tokens=200, chunked_prefill_size=64)
    assert old.overlap is not None
    old.overlap._admission_blocked = lambda: (len(old.running) >= old.max_running  # type: ignore[method-assign]
                                              or old.kv.available_pages - old.decode_reserve() < 1)
    assert run_all(old, reqs()) == want
    assert ov.overlapped_steps > old.overlapped_steps


def test_the_sampler_gets_the_top_k_window_of_the_server_args() -> None:
    assert make_scheduler("cpu").sampler.top_k_window == 256  # the default: only a GPU with FlashInfer uses it
    assert make_scheduler("cpu", sampling_top_k_window=0).sampler.top_k_window == 0


def test_why_a_step_was_not_overlapped_is_counted(test_device: str) -> None:
    """Each step in flight that the loop did not follow with an overlapped one is counted by its reason
    (the step log prints them); the plain loop has none."""
    plain, ov = _pair(test_device, max_total_tokens=72)
    run_all(ov, _reqs([greedy(12 + i) for i in range(len(LENGTHS))]))
    why = ov.not_overlapped
    assert tuple(why) == NOT_OVERLAPPED and sum(why.values()) > 0 and ov.overlapped_steps > 0
    assert why["executor"] == 0  # no executor here
    assert plain.not_overlapped == {}



def test_a_prefill_stalled_for_pages_keeps_the_loop_overlapped(test_device: str) -> None:
    """A running request part-way through its prefill whose next chunk gets no pages (the pool binds) no
    longer drains the loop: decoding goes on overlapped while it waits, as for a queue that cannot be
    admitted (it used to count `rows` and run every such decode plain). Outputs equal the plain loop's."""
    lengths = [150, 90, 140, 120, 100, 130, 110, 95]
    params = [greedy(30 + 3 * i) for i in range(len(lengths))]
    reqs = lambda: [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(lengths, seed=3), params, strict=True))]  # noqa: E731
    plain, ov = _pair(test_device, max_total_tokens=360, chunked_prefill_size=64)
    assert ov.overlap is not None
    stalled = []
    check = ov.overlap._stalled

    def spy(r: Req) -> bool:
        out = check(r)
        stalled.append(out)
        return out

    ov.overlap._stalled = spy  # type: ignore[method-assign]
    want = run_all(plain, reqs())
    assert run_all(ov, reqs()) == want
    assert any(stalled), "no prefill waited for pages: the case is not exercised"
    _, old = _pair(test_device, max_total_tokens=360, chunked_prefill_size=64)
    assert old.overlap is not None
    old.overlap._stalled = lambda r: False  # type: ignore[method-assign]
    assert run_all(old, reqs()) == want
    assert ov.overlapped_steps > old.overlapped_steps
    assert ov.not_overlapped["rows"] < old.not_overlapped["rows"]
    assert ov.allocator.num_free + ov.kv.cache.size_info().cached_pages == ov.allocator.capacity
