"""Overlap scheduling with remote rows (an in-process `local` executor): step t+1 is planned on the
executor while step t is in flight, and the greedy outputs equal the plain loop's and those without
offload -- with stops (EOS, stop tokens) that land after the extra row was planned, max_new_tokens,
aborts, an executor that drops rows while a step is in flight, and a lost executor. Pages are
checked on both sides after every step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _offload_util import force_drop
from _tiny import VOCAB, greedy, make_scheduler, prompts, run_all

from sglang_ext.offload import sender
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler

LENGTHS = [5, 17, 33, 9, 40, 3, 21, 12]


def _overlap(eos: frozenset[int] | None = None, **args: Any) -> Scheduler:
    args.setdefault("offload_ratio", 0.5)
    s = make_scheduler(offload_executor="local", **args)
    return Scheduler(s.args, s.runner, s.page_size, eos or s.eos_ids, vocab_size=VOCAB, remote_sender=s.remote_sender,
                     overlap=True)


def _plain(remote: bool, eos: frozenset[int] | None = None, **args: Any) -> Scheduler:
    if remote:
        args.setdefault("offload_ratio", 0.5)
        args["offload_executor"] = "local"
    s = make_scheduler(**args)
    if eos is not None:
        s.eos_ids = eos
    return s


def _reqs(params: list[SamplingParams] | None = None, max_new: int = 12) -> list[Req]:
    params = params or [greedy(max_new + i) for i in range(len(LENGTHS))]  # finishes at different steps
    return [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(LENGTHS), params, strict=True))]


class PlanSpy:
    """Records the RemoteSender's plans: those made while the step before was in flight (ahead=1),
    the requests they named (rid, landed output count) and the rows the executor dropped."""

    def __init__(self, s: Scheduler) -> None:
        assert s.remote_sender is not None
        self.inner = s.remote_sender.begin_step
        self.ahead: list[list[tuple[str, int]]] = []
        self.dropped_ahead = 0
        s.remote_sender.begin_step = self  # type: ignore[method-assign]

    def __call__(self, reqs: list[Req], ahead: int = 0) -> list[Req]:
        named = [(r.rid, len(r.output_ids)) for r in reqs]
        dropped = self.inner(reqs, ahead)
        if ahead:
            self.ahead.append(named)
            self.dropped_ahead += len(dropped)
        return dropped


def _drive(s: Scheduler, reqs: list[Req], before_step: Callable[[int], None] | None = None) -> dict[str, list[int]]:
    """run_all with a hook before each step; pages checked on both sides after every step."""
    for r in reqs:
        s.add_request(r)
    out: dict[str, list[int]] = {r.rid: [] for r in reqs}
    steps = 0
    while s.has_work():
        if before_step is not None:
            before_step(steps)
        for o in s.step():
            out[o.rid].extend(o.new_token_ids)
        s.check()
        assert s.remote_sender is not None
        s.remote_sender.remote.executor.check()  # type: ignore[attr-defined]
        steps += 1
        assert steps < 2000
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return run_all(_plain(remote=False), _reqs())


@pytest.mark.parametrize("args", [{"offload_ratio": 0.25}, {"offload_ratio": 0.5}, {"offload_ratio": 1.0},
                                  {"max_total_tokens": 72}, {"chunked_prefill_size": 8}])
def test_greedy_outputs_equal_plain_loop_and_no_offload(reference: dict[str, list[int]], args: dict[str, Any]) -> None:
    s = _overlap(**args)
    spy = PlanSpy(s)
    reqs = _reqs()
    assert run_all(s, reqs) == reference
    assert run_all(_plain(remote=True, **args), _reqs()) == reference
    assert spy.ahead, "no remote rows were planned while a step was in flight"
    assert s.overlapped_steps > 0 and any(r.attention_executor for r in reqs)
    assert s.remote_sender is not None and s.remote_sender.num_remote == 0
    assert s.remote_sender.remote.executor.partition.used_pages("tiny") == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_stops_after_the_extra_row_was_planned(reference: dict[str, list[int]], how: str) -> None:
    """Each request stops at a token of its own: a remote one was already planned into the next
    step on the executor when its stop lands; it is released there with its extra row."""
    stops = {rid: toks[3 + i % 4] for i, (rid, toks) in enumerate(sorted(reference.items()))}
    eos: frozenset[int] | None = None
    if how == "eos":
        eos = frozenset(stops.values())
        params = [SamplingParams(max_new_tokens=12 + i, temperature=0.0) for i in range(len(LENGTHS))]
    else:
        params = [greedy(12 + i, stop_token_ids=[stops[f"r{i}"]]) for i in range(len(LENGTHS))]
    want_reqs = _reqs(params)
    want = run_all(_plain(remote=False, eos=eos), want_reqs)
    assert run_all(_plain(remote=True, eos=eos), _reqs(params)) == want
    s = _overlap(eos=eos, offload_ratio=1.0)
    spy = PlanSpy(s)
    reqs = _reqs(params)
    assert run_all(s, reqs) == want
    assert [r.finish_reason for r in reqs] == [r.finish_reason for r in want_reqs]
    stopped = [r for r in reqs if r.finish_reason is not None and r.finish_reason.type == "stop"
               and r.attention_executor is not None]
    assert stopped
    planned_past_stop = {(rid, n) for plan in spy.ahead for rid, n in plan}
    # planned into step t+1 while its stop token (output number n) was in flight at step t
    assert any((r.rid, len(r.output_ids) - 1) in planned_past_stop for r in stopped)
    assert s.remote_sender is not None and s.remote_sender.remote.executor.partition.used_pages("tiny") == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("after_steps", [2, 5, 9])
def test_abort_of_remote_requests_in_flight(reference: dict[str, list[int]], after_steps: int) -> None:
    s = _overlap(offload_ratio=0.5, disable_radix_cache=True)
    reqs = _reqs()
    aborted: list[str] = []

    def abort(step: int) -> None:
        if step == after_steps:
            remote = [r for r in reqs if r.remote is not None]
            assert remote and s.overlap is not None and s.overlap.inflight is not None
            for r in remote[::2] + [r for r in reqs if r.remote is None and not r.finished][:1]:
                assert s.abort(r.rid)
                aborted.append(r.rid)

    out = _drive(s, reqs, abort)
    assert aborted
    for r in reqs:
        if r.rid in aborted:
            assert r.finish_reason is not None and r.finish_reason.type == "abort"
            assert out[r.rid] == reference[r.rid][: len(out[r.rid])]
        else:
            assert out[r.rid] == reference[r.rid]
    assert s.remote_sender is not None and s.remote_sender.remote.executor.partition.used_pages("tiny") == 0  # type: ignore[attr-defined]
    assert s.allocator.num_free == s.allocator.capacity


def test_a_full_executor_drops_rows_while_a_step_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """An executor with room for ~40 pages, taking requests without setting pages aside for their
    longest (as for a sender that does not ask): requests that cannot grow there while the next step
    is planned are taken back with their in-flight token and recomputed. Outputs do not change."""
    monkeypatch.setattr(sender, "reserve_tokens", lambda r, context_len=None: 0)
    want = run_all(_plain(remote=False), _reqs(max_new=40))
    s = _overlap(offload_ratio=1.0, executor_mem_gb=40 * 4096 / 2**30)
    spy = PlanSpy(s)
    assert run_all(s, _reqs(max_new=40)) == want
    assert spy.dropped_ahead > 0 and s.num_preemptions > 0


def test_a_full_executor_refuses_loads_instead_when_they_reserve() -> None:
    """The sender asks the executor to set pages aside for each request's longest: a small executor
    then refuses loads (the requests stay local) and never drops a planned row. Outputs do not change."""
    want = run_all(_plain(remote=False), _reqs(max_new=40))
    s = _overlap(offload_ratio=1.0, executor_mem_gb=40 * 4096 / 2**30)
    spy = PlanSpy(s)
    assert run_all(s, _reqs(max_new=40)) == want
    assert spy.dropped_ahead == 0 and spy.ahead  # remote rows ran, planned ahead, none dropped


@pytest.mark.parametrize("case", ["stops_in_flight", "continues", "every_remote_row"])
def test_rows_dropped_in_flight_keep_their_token(reference: dict[str, list[int]], case: str) -> None:
    """A request dropped while its step-t token is in flight keeps that token: if it is a stop, the
    request ends from the queue; else it is recomputed with it. When every remote row is dropped,
    the step runs local rows only."""
    k = next(i for i in range(3, 10) if reference["r0"][i] not in reference["r0"][:i])
    params = [greedy(12 + i) for i in range(len(LENGTHS))]
    if case == "stops_in_flight":
        params[0] = greedy(12, stop_token_ids=[reference["r0"][k]])
    want = run_all(_plain(remote=False), _reqs(params))
    s = _overlap(offload_ratio=0.5 if case == "every_remote_row" else 1.0)
    local_only: list[bool] = []  # the batches launched right after every remote row was dropped
    if case == "every_remote_row":
        def pick(reqs: list[Req]) -> list[Req]:
            if local_only or len(reqs) < 2 or min(len(r.output_ids) for r in reqs) < 3:
                return []
            local_only.append(True)
            return reqs

        forward = s.runner.forward

        def watch(batch: Any) -> Any:
            if local_only and local_only[-1] is True:
                local_only[-1] = batch.split is None and batch.batch_size > 0
            return forward(batch)

        s.runner.forward = watch  # type: ignore[method-assign]
    else:
        def pick(reqs: list[Req]) -> list[Req]:
            return [r for r in reqs if r.rid == "r0" and len(r.output_ids) == k]  # output k (in flight): the stop

    dropped = force_drop(s, pick)
    reqs = _reqs(params)
    assert run_all(s, reqs) == want
    assert dropped and s.num_preemptions > 0
    if case == "stops_in_flight":
        assert dropped == ["r0"] and reqs[0].finish_reason is not None
        assert reqs[0].finish_reason.type == "stop" and len(reqs[0].output_ids) == k + 1
    if case == "every_remote_row":
        assert len(dropped) > 1 and local_only == [True]  # the step went on with its local rows alone
    assert s.remote_sender is not None and s.remote_sender.remote.executor.partition.used_pages("tiny") == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["post", "begin_step"])
@pytest.mark.parametrize("after_steps", [3, 8])
def test_executor_lost_with_a_step_in_flight(where: str, after_steps: int) -> None:
    """The executor dies while the next step is planned or run: remote requests keep their
    in-flight token and are recomputed. Penalised rows show that the token is not drawn twice (the
    device's penalty statistics already count it)."""
    params = [greedy(12 + i, frequency_penalty=0.8 if i % 2 else 0.0) for i in range(len(LENGTHS))]
    want = run_all(_plain(remote=False), _reqs(params))
    s = _overlap()
    remote: Any = s.remote_sender.remote if s.remote_sender else None

    def kill(step: int) -> None:
        if step == after_steps:
            assert s.remote_sender is not None and s.remote_sender.num_remote > 0
            assert s.overlap is not None and s.overlap.inflight is not None

            def gone(*_: object) -> None:
                raise ExecutorLost("the executor's worker died (simulated)")

            setattr(remote, where, gone)

    assert _drive(s, _reqs(params), kill) == want
    assert s.remote_sender is not None and not s.remote_sender.active and s.num_preemptions > 0


@pytest.mark.parametrize("loop", ["overlap", "plain"])
@pytest.mark.parametrize("after_steps", [3, 8])
def test_steps_let_through_without_the_executor_are_dropped(loop: str, after_steps: int) -> None:
    """A GPU-signalled transport whose executor died mid-step: the watchdog raised the completion
    flags, so that step's remote rows landed with garbage (`results_forged`), and the next plan
    finds the executor gone. Those tokens are dropped and the requests recomputed: outputs equal the
    reference (penalised rows: the garbage token's count is not kept either)."""
    params = [greedy(12 + i, frequency_penalty=0.8 if i % 2 else 0.0) for i in range(len(LENGTHS))]
    want = run_all(_plain(remote=False), _reqs(params))
    s = _overlap() if loop == "overlap" else _plain(remote=True)
    remote: Any = s.remote_sender.remote if s.remote_sender else None
    plans = remote.begin_step
    gen = torch.Generator().manual_seed(0)

    def forged_plan(*a: object) -> list[int]:
        if remote.plans_left == 0:
            raise ExecutorLost("the executor's worker died (simulated)")
        remote.plans_left -= 1
        return list(plans(*a))

    def garbage(layer: int) -> torch.Tensor:
        out = type(remote).collect(remote, layer)
        return torch.randn(out.shape, generator=gen).to(out.dtype) * 50

    def die(step: int) -> None:
        if step == after_steps:
            assert s.remote_sender is not None and s.remote_sender.num_remote > 0
            remote.plans_left = 1  # the step planned now runs without results, then the loss shows
            remote.begin_step, remote.collect, remote.results_forged = forged_plan, garbage, lambda upto=None: True

    assert _drive(s, _reqs(params), die) == want
    assert s.remote_sender is not None and not s.remote_sender.active and s.num_preemptions > 0


def test_a_reservation_is_the_requests_longest_capped_by_the_context() -> None:
    s = _overlap()
    assert s.remote_sender is not None and s.remote_sender.context_len == s.runner.context_len
    r = Req("r", [1] * 10, greedy(20))
    assert sender.reserve_tokens(r) == 31 and sender.reserve_tokens(r, context_len=16) == 17
